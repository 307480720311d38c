"""Tensors and errors at the boundary to epmoe._ext.

NumPy has no bfloat16 or fp8 of its own; epmoe uses ml_dtypes' ``bfloat16`` and ``float8_e4m3fn``.
DLPack cannot carry those NumPy dtypes, so such arrays travel to C++ as a same-width unsigned view
plus a dtype tag (``(x.view(np.uint16), "bfloat16")``); the C++ side returns them the same way and
re-views them as ml_dtypes arrays. The caller only ever sees ml_dtypes arrays. Frameworks that have
the dtypes (PyTorch) pass their tensors unchanged through DLPack; outputs then use that framework.
"""

from __future__ import annotations

from typing import Any, Optional

import ml_dtypes
import numpy as np

from . import _ext

Error = _ext.Error

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT8_E4M3FN = np.dtype(ml_dtypes.float8_e4m3fn)


def is_torch(x: Any) -> bool:
    """True for a torch.Tensor (checked without importing torch)."""
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "__dlpack__")


def framework_of(*tensors: Any) -> str:
    """'torch' when any of the tensors is a torch.Tensor, else 'numpy' (the framework outputs are made in)."""
    return "torch" if any(is_torch(t) for t in tensors if t is not None) else "numpy"


def arg(x: Any) -> Any:
    """What _ext accepts for a tensor argument: None, an array, or (integer view, dtype name)."""
    if x is None:
        return None
    if isinstance(x, np.ndarray):
        if x.dtype == BFLOAT16:
            return (x.view(np.uint16), "bfloat16")
        if x.dtype == FLOAT8_E4M3FN:
            return (x.view(np.uint8), "float8_e4m3fn")
    return x


def make_error(code: str, message: str) -> Error:
    """An epmoe.Error carrying `code`, as the C++ side raises it."""
    e = Error(message)
    e.code = code
    return e


def invalid_argument(argument: str, expected: str, actual: Any) -> Error:
    """epmoe.Error('invalid_argument') with the C++ message format: names the argument, expected, actual."""
    return make_error("invalid_argument", f"epmoe: invalid argument '{argument}': expected {expected}, got {actual}")


def unsupported(message: str) -> Error:
    """epmoe.Error('unsupported'): a valid request this build or backend does not implement."""
    return make_error("unsupported", "epmoe: " + message)


def describe(x: Any) -> str:
    """'bfloat16[4, 128]' for arrays, the type name otherwise (for error messages)."""
    if x is None:
        return "None"
    dtype, shape = getattr(x, "dtype", None), getattr(x, "shape", None)
    if dtype is not None and shape is not None:
        name = str(dtype).replace("torch.", "")
        return f"{name}[{', '.join(str(int(d)) for d in shape)}]"
    return f"an object of type {type(x).__name__}"


def first_dim(x: Any) -> Optional[int]:
    """Size of dimension 0 of an array, or None."""
    shape = getattr(x, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) > 0 else None
