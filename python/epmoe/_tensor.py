"""Tensors and errors at the boundary to epmoe._ext.

Tensors cross by DLPack (nanobind's ndarray): NumPy arrays, torch tensors (CPU or CUDA) and CuPy arrays
come in; outputs are made in the caller's framework (torch in, torch out; CuPy in, CuPy out; else
NumPy), on the inputs' device, without a copy. A torch.Tensor argument (not a subclass) skips the DLPack
export, which costs ~10 us of host time per tensor: the extension reads its pointer, shape, strides, dtype
and device itself (register_torch, once torch is imported), and hands any tensor it does not read that way
(another dtype, layout or device) back to _torch_arg, so the checks and messages stay those of DLPack.

NumPy has no bfloat16 or fp8 of its own; epmoe uses ml_dtypes' ``bfloat16`` and ``float8_e4m3fn``.
DLPack cannot carry those NumPy dtypes, so such arrays travel to C++ as a same-width unsigned view
plus a dtype tag (``(x.view(np.uint16), "bfloat16")``); the C++ side returns them the same way and
re-views them as ml_dtypes arrays. CuPy arrays are handled alike (a CuPy without ml_dtypes support
gets uint16 / uint8 views back). torch.bfloat16 crosses as itself; torch.float8_e4m3fn crosses as a
uint8 view with a tag both ways (torch's DLPack float8 support is recent) and comes back as
torch.float8_e4m3fn.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator, Optional

import ml_dtypes
import numpy as np

from . import _ext

Error = _ext.Error

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT8_E4M3FN = np.dtype(ml_dtypes.float8_e4m3fn)


_torch_tensor: Optional[type] = None  # torch.Tensor, once torch is imported and its types are registered with _ext
# torch's raw current-stream getter (device index -> cudaStream_t as an int), looked up with torch.Tensor; None where
# this torch lacks it
_torch_raw_stream: Optional[Any] = None

# torch dtypes that _ext reads from a torch.Tensor directly (their epmoe names are torch's attribute names).
_TORCH_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "int8", "int16", "int32", "int64", "bool", "uint8",
                 "uint32")


def _find_torch() -> Optional[type]:
    """torch.Tensor when torch is imported (never imports it). The first time, hands torch's types to _ext, which then
    reads torch.Tensor arguments from their attributes instead of a DLPack export per tensor (see arg), and makes torch
    outputs with torch._C._from_dlpack (skipping torch.utils.dlpack.from_dlpack's per-call work)."""
    global _torch_tensor, _torch_raw_stream
    torch = sys.modules.get("torch")
    tensor, strided = getattr(torch, "Tensor", None), getattr(torch, "strided", None)
    if tensor is None or strided is None:  # not imported (or still importing)
        return None
    dtypes = [(getattr(torch, name), name) for name in _TORCH_DTYPES if hasattr(torch, name)]
    _ext.register_torch(tensor, strided, dtypes, _torch_arg, getattr(getattr(torch, "_C", None), "_from_dlpack", None))
    _torch_raw_stream = getattr(getattr(torch, "_C", None), "_cuda_getCurrentRawStream", None)
    _torch_tensor = tensor
    return tensor


def is_torch(x: Any) -> bool:
    """True for a torch.Tensor (checked without importing torch)."""
    tensor = _torch_tensor or _find_torch()
    return tensor is not None and isinstance(x, tensor)


def is_cupy(x: Any) -> bool:
    """True for a cupy.ndarray (checked without importing CuPy)."""
    return type(x).__module__.split(".")[0] == "cupy" and hasattr(x, "__dlpack__")


def is_cuda(x: Any) -> bool:
    """True for a torch tensor on a CUDA device or a CuPy array."""
    if is_torch(x):
        return x.is_cuda
    return is_cupy(x)


def framework_of(*tensors: Any) -> str:
    """The framework outputs are made in: 'torch' when any tensor is a torch.Tensor, else 'cupy' when any
    is a CuPy array, else 'numpy'."""
    framework = "numpy"
    for t in tensors:
        if t is None:
            continue
        if is_torch(t):
            return "torch"
        if framework == "numpy" and is_cupy(t):
            framework = "cupy"
    return framework


def current_stream(*tensors: Any) -> Optional[int]:
    """The caller's CUDA stream (cudaStream_t as an int) for work on these tensors: torch's current stream
    on the first CUDA tensor's device, or CuPy's current stream; None when no tensor is on a GPU."""
    for t in tensors:
        if t is None:
            continue
        if is_torch(t) and t.is_cuda:
            # torch's raw getter (Triton's way) skips building a torch.cuda.Stream object on every call
            if _torch_raw_stream is not None:  # (is_torch looked it up)
                return int(_torch_raw_stream(t.get_device()))
            import torch
            return int(torch.cuda.current_stream(t.device).cuda_stream)
        if is_cupy(t):
            import cupy
            return int(cupy.cuda.get_current_stream().ptr)
    return None


@contextlib.contextmanager
def on_stream(*tensors: Any) -> Iterator[None]:
    """Runs the block on the caller's CUDA stream (current_stream) when a tensor is on a GPU: epmoe's current
    stream is per thread, and the _ext calls of the block run on this thread."""
    stream = current_stream(*tensors)
    if stream is None:
        yield
        return
    previous = _ext.set_current_stream(stream)
    try:
        yield
    finally:
        _ext.set_current_stream(previous)


_DLPACK_CPU, _DLPACK_CUDA = 1, 2


def device_of(x: Any) -> str:
    """Where a tensor lives, as 'cpu' or 'cuda:<index>' (DLPack's __dlpack_device__: torch, CuPy, NumPy);
    objects without it are host memory (the buffer protocol). Other DLPack devices: 'dlpack device <type>'."""
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], str):  # (integer view, dtype tag) from arg()
        x = x[0]
    query = getattr(x, "__dlpack_device__", None)
    if query is None:
        return "cpu"
    kind, index = (int(v) for v in query())
    if kind == _DLPACK_CPU:
        return "cpu"
    if kind == _DLPACK_CUDA:
        return f"cuda:{index}"
    return f"dlpack device {kind}"


def _torch_arg(x: Any) -> Any:
    import torch
    x = x.detach()  # DLPack refuses tensors that require grad; epmoe never differentiates
    if x.dtype == torch.float8_e4m3fn:
        # Older torch cannot export float8 through DLPack: a same-width view plus a tag always works.
        return (x.view(torch.uint8), "float8_e4m3fn")
    if x.dtype == getattr(torch, "uint32", None):
        # torch's uint32 is a recent "shell" dtype: an int32 view plus a tag does not depend on its DLPack export.
        return (x.view(torch.int32), "uint32")
    return x


def arg(x: Any) -> Any:
    """What _ext accepts for a tensor argument: None, an array, or (integer view, dtype name).

    NumPy and CuPy arrays of ml_dtypes' bfloat16 / float8_e4m3fn travel as same-width unsigned views with
    a tag; a torch.Tensor goes as itself (_ext reads its pointer, shape, strides, dtype and device, and hands
    any other kind back to _torch_arg); subclasses of it travel by DLPack (float8 as a uint8 view with a tag)."""
    if x is None:
        return None
    if is_torch(x):
        return x if type(x) is _torch_tensor else _torch_arg(x)
    dtype = getattr(x, "dtype", None)
    if dtype is not None and hasattr(x, "view") and (isinstance(x, np.ndarray) or is_cupy(x)):
        if dtype == BFLOAT16:
            return (x.view(np.uint16), "bfloat16")
        if dtype == FLOAT8_E4M3FN:
            return (x.view(np.uint8), "float8_e4m3fn")
    return x


def required(name: str, x: Any) -> Any:
    """`x`, or epmoe.Error('invalid_argument') naming `name` when it is None (a required tensor argument;
    nanobind would otherwise raise a TypeError that names no argument)."""
    if x is None:
        raise invalid_argument(name, "an array (NumPy, torch or CuPy)", "None")
    return x


def writable(name: str, x: Any) -> Any:
    """`x`, or epmoe.Error('invalid_argument') naming `name` when it is a read-only NumPy array (an output the call
    would write into: DLPack hands the C++ side its memory whatever the flag says)."""
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise invalid_argument(name, "a writable array (it is written into)", "a read-only array")
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


def int_arg(name: str, value: Any, low: int = 0, high: int = 2**31 - 1) -> int:
    """`value` as a Python int in [low, high] (what the C++ side takes), else epmoe.Error('invalid_argument') naming
    `name` (bools, strings and floats included: the binding's own TypeError would not name the argument).

    The message names the bound `value` passes, alone ("expected an int of at most 2147483647, got 2147483648"): low
    and high are often the C++ type's limits, the argument's own range being checked on the C++ side, and a range
    from the type's least value would read as the range the argument takes. Anything that is not an int: "expected an
    int, got ...". Callers whose argument has a range of its own pass it as low and high."""
    v = None
    if not isinstance(value, bool) and hasattr(value, "__index__"):
        try:
            v = int(value)
        except (TypeError, ValueError):  # e.g. an array of more than one element (NumPy's __index__ raises)
            v = None
    if v is None:
        shape = getattr(value, "shape", None)
        got = repr(value) if shape is None else f"an array of shape {tuple(shape)} ({dtype_name(value)})"
        raise invalid_argument(name, "an int", got)
    if v > high:
        raise invalid_argument(name, f"an int of at most {high}", repr(value))
    if v < low:
        raise invalid_argument(name, f"an int of at least {low}", repr(value))
    return v


def int32_arg(name: str, value: Any) -> int:
    """int_arg over the C++ int's range: the binding's own checks (>= 1, a multiple of ...) then name the rest."""
    return int_arg(name, value, -(2**31), 2**31 - 1)


def int64_arg(name: str, value: Any) -> int:
    """int_arg over the C++ std::int64_t's range."""
    return int_arg(name, value, -(2**63), 2**63 - 1)


def dtype_name(x: Any) -> Optional[str]:
    """'bfloat16', 'float32', ... for NumPy / torch / CuPy arrays; None for other objects."""
    dtype = getattr(x, "dtype", None)
    return None if dtype is None else str(dtype).replace("torch.", "")


def first_dim(x: Any) -> Optional[int]:
    """Size of dimension 0 of an array, or None."""
    shape = getattr(x, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) > 0 else None
