"""Router (semantics §2), dispatch layout (semantics §3), fp8 and NVFP4 quantization (semantics §6).

Every function takes NumPy arrays (bf16 / fp8 as ml_dtypes), torch tensors or CuPy arrays and returns
the same framework's arrays on the same device: CPU input runs on the CPU and is done on return; CUDA
input runs on torch's (or CuPy's) current stream and is ordered like any other work on it.
Errors are ``epmoe.Error`` naming the argument, what was expected and what came.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from . import _ext
from ._tensor import arg, framework_of, int_arg, required
from ._tensor import on_stream as _on_stream

FP8_GROUP_SIZE = 128
"""Hidden channels per fp8 scale group."""


def num_scale_groups(hidden: int, group_size: int = FP8_GROUP_SIZE) -> int:
    """ceil(hidden / group_size): fp32 scales per token (the last group may be partial)."""
    return (int(hidden) + group_size - 1) // group_size


def num_ue8m0_words(hidden: int, group_size: int = FP8_GROUP_SIZE) -> int:
    """ceil(groups / 4): int32 words of UE8M0 scales per token."""
    return (num_scale_groups(hidden, group_size) + 3) // 4


def topk_softmax(logits: Any, num_topk: int, renormalize: bool = False) -> Tuple[Any, Any]:
    """Softmax over the E logits (float32), then the K largest (ties: lower expert id).

    Arguments:
        logits: float32 or bfloat16 [T, E], contiguous.
        num_topk: K in 1..E.
        renormalize: divide the K weights by their sum.

    Returns: (topk_weights float32 [T, K], topk_idx int64 [T, K]), in descending weight order.
    Errors: epmoe.Error('invalid_argument') for logits not 2-d float32/bfloat16, K outside 1..E.
    """
    required("logits", logits)
    num_topk = int_arg("num_topk", num_topk, -(2**31), 2**31 - 1)
    with _on_stream(logits):
        return _ext.topk_softmax(arg(logits), num_topk, renormalize, framework_of(logits))


def topk_sigmoid(logits: Any, num_topk: int, renormalize: bool = False) -> Tuple[Any, Any]:
    """Sigmoid of each logit, then the K largest (ties: lower expert id). Shapes and errors as topk_softmax."""
    required("logits", logits)
    num_topk = int_arg("num_topk", num_topk, -(2**31), 2**31 - 1)
    with _on_stream(logits):
        return _ext.topk_sigmoid(arg(logits), num_topk, renormalize, framework_of(logits))


def grouped_topk(logits: Any, num_topk: int, num_expert_group: int, topk_group: int,
                 scoring_func: str = "softmax", renormalize: bool = True, routed_scaling_factor: float = 1.0,
                 e_score_correction_bias: Optional[Any] = None) -> Tuple[Any, Any]:
    """DeepSeek-V2/V3 grouped top-k (semantics §2).

    scores = softmax or sigmoid of the logits; with ``e_score_correction_bias`` (float32 [E]) selection
    uses score + bias and a group's score is the sum of its top-2 biased scores, otherwise the group max;
    keep ``topk_group`` of ``num_expert_group`` groups (ties: lower group), then the top K experts in them
    (ties: lower id). Weights are the unbiased scores, renormalized if asked, times routed_scaling_factor.

    Returns: (topk_weights float32 [T, K], topk_idx int64 [T, K]). With a bias the ids are in descending
    biased-score order.
    Errors: epmoe.Error('invalid_argument') for E % num_expert_group != 0, topk_group > num_expert_group,
    K > topk_group * E / num_expert_group, a bias of the wrong shape or dtype, scoring_func not
    'softmax'/'sigmoid'.
    """
    required("logits", logits)
    num_topk = int_arg("num_topk", num_topk, -(2**31), 2**31 - 1)
    num_expert_group = int_arg("num_expert_group", num_expert_group, -(2**31), 2**31 - 1)
    topk_group = int_arg("topk_group", topk_group, -(2**31), 2**31 - 1)
    with _on_stream(logits):
        return _ext.grouped_topk(arg(logits), num_topk, num_expert_group, topk_group, scoring_func, renormalize,
                                 float(routed_scaling_factor), arg(e_score_correction_bias), framework_of(logits))


def get_dispatch_layout(topk_idx: Any, num_experts: int, num_ranks: int) -> Tuple[Any, Any, Any]:
    """The dispatch layout (semantics §3) without a buffer.

    Returns: (num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E], is_token_in_rank bool [T, R]);
    -1 ids are ignored, a token counts once per rank.
    Errors: epmoe.Error('invalid_argument') for topk_idx not int32/int64 [T, K], E % R != 0, E / R > 1024,
    an id outside [-1, E) (naming it and its [t, k]). On CUDA tensors the layout runs asynchronously: an id outside
    [-1, E) is skipped and flagged, and check_invalid_ids raises this error later (semantics §11).
    """
    required("topk_idx", topk_idx)
    num_experts = int_arg("num_experts", num_experts, -(2**31), 2**31 - 1)
    num_ranks = int_arg("num_ranks", num_ranks, -(2**31), 2**31 - 1)
    with _on_stream(topk_idx):
        return _ext.get_dispatch_layout(arg(topk_idx), num_experts, num_ranks, framework_of(topk_idx))


def check_invalid_ids(like: Any = None) -> None:
    """Raises the first out-of-range expert id that a CUDA kernel skipped (semantics §11), as the CPU would have.

    On CUDA tensors, get_dispatch_layout (also Buffer.get_dispatch_layout, which the normal-mode dispatch's layout
    comes from) skips ids outside [-1, E) and records the first one (smallest [t, k]) in a word of the device
    rather than synchronising; the normal-mode dispatch then drops those choices. This call waits for the stream,
    reads and clears the current CUDA device's record, and raises. (The low-latency mode raises such ids at the
    buffer's next call by itself; the no-EP MoE layer's faults are check_moe_faults'.)

    Arguments:
        like: optional CUDA tensor (torch or CuPy): the stream waited for is torch's (or CuPy's) current one on its
            device; None: epmoe's current stream of this thread (the default stream unless set).
    Errors: epmoe.Error('invalid_argument') naming topk_idx, the bound, the first bad value and its [t, k]; then
    the record is clear. Nothing is raised, and nothing waited for past the stream, when no id was flagged. A no-op
    in builds without CUDA.
    """
    with _on_stream(like):
        _ext.check_invalid_ids()


def quantize_fp8(x: Any, round_scale: bool = False, use_ue8m0: bool = False,
                 scale_layout: str = "row_major") -> Tuple[Any, Any]:
    """Per-token-group fp8 e4m3 quantization (semantics §6), one scale per 128 channels of a token.

    a = max(amax(group), 1e-4); q = fp8(x * (448 / a)); scale = a / 448, in float32; fp8 rounds to nearest
    even and saturates to +-448. round_scale: scale = 2^ceil(log2(a / 448)), q = fp8(x / scale).
    use_ue8m0 (needs round_scale): the scales' exponent bytes (log2(scale) + 127), four groups per int32,
    group 4i in the lowest byte.

    Arguments:
        x: bfloat16 or float32 [T, H], H % 16 == 0 (the last group may be shorter than 128).
        scale_layout: 'row_major' (strides (C, 1)) or 'column_major': the token dimension has unit stride and
            each column is padded to a multiple of 4 rows, strides (1, ceil(T / 4) * 4): what DeepGEMM's
            get_mn_major_tma_aligned_tensor / get_mn_major_tma_aligned_packed_ue8m0_tensor return. The values
            are the same in both layouts.

    Returns: (q float8_e4m3fn [T, H], scales float32 [T, ceil(H/128)] or int32 [T, ceil(ceil(H/128)/4)]).
    Errors: epmoe.Error('invalid_argument') for x not 2-d bfloat16/float32, H % 16 != 0, use_ue8m0 without
    round_scale, scale_layout not 'row_major' / 'column_major'.
    """
    required("x", x)
    with _on_stream(x):
        return _ext.quantize_fp8(arg(x), round_scale, use_ue8m0, str(scale_layout), framework_of(x))


def dequantize_fp8(q: Any, scales: Any, out_dtype: str = "bfloat16") -> Any:
    """q * scale per group, into 'bfloat16' or 'float32' [T, H]. The scales' format comes from their dtype
    (float32 [T, G] or UE8M0 int32 [T, ceil(G/4)]), their layout (row- or column-major) from their strides.
    Errors: epmoe.Error('invalid_argument') for mismatched shapes or dtypes, out_dtype not bfloat16/float32.
    """
    if hasattr(out_dtype, "name"):  # a NumPy / ml_dtypes dtype
        out_dtype = out_dtype.name
    elif isinstance(out_dtype, type):
        out_dtype = out_dtype.__name__
    required("q", q)
    required("scales", scales)
    with _on_stream(q):
        return _ext.dequantize_fp8(arg(q), arg(scales), str(out_dtype), framework_of(q))


def _global_scale(global_scale: Any) -> Any:
    """A Python number as the float32 scalar array quantize_nvfp4 / dequantize_nvfp4 take; arrays as they are."""
    if isinstance(global_scale, (int, float)) and not isinstance(global_scale, bool):
        return np.array(global_scale, dtype=np.float32)
    return global_scale


def quantize_nvfp4(x: Any, global_scale: Any, scale_layout: str = "swizzled") -> Tuple[Any, Any]:
    """NVFP4 quantization (semantics §6 "NVFP4"; NVIDIA's format as vLLM's scaled_fp4_quant and FlashInfer's
    fp4_quantize produce it): e2m1 values two per byte (channel 2i in the low nibble of byte i), one fp8 e4m3 scale
    per 16 channels, one float32 global scale. Per block of 16: sf = e4m3((amax / 6) * gs), q = e2m1(x * gs / sf),
    rounded to nearest even and saturating at 6.

    Arguments:
        x: bfloat16 or float32 [T, H], H a multiple of 16 (of 64 with the swizzled layout).
        global_scale: gs, float32 with one element (shape [] or [1], on the CPU or on x's device) or a Python
            number; producers use 448 * 6 / amax(x). A CPU value must be finite and > 0.
        scale_layout: 'swizzled' (the 128x4 tiles the block-scaled fp4 GEMMs read, as the NVFP4 low-latency dispatch
            returns them: float8_e4m3fn [ceil(T / 128), (H / 64) * 512], padding tokens 0) or 'linear'
            (float8_e4m3fn [T, H / 16], row-major).

    Returns: (q uint8 [T, H / 2], scales float8_e4m3fn in scale_layout).
    Errors: epmoe.Error('invalid_argument') naming x (not 2-d bfloat16/float32, H), global_scale (dtype, size, not
    finite and > 0), scale_layout.
    """
    required("x", x)
    required("global_scale", global_scale)
    with _on_stream(x):
        return _ext.quantize_nvfp4(arg(x), arg(_global_scale(global_scale)), str(scale_layout), framework_of(x))


def dequantize_nvfp4(q: Any, scales: Any, global_scale: Any, scale_layout: str = "swizzled",
                     out_dtype: str = "bfloat16") -> Any:
    """x' = e2m1_value(q) * (float(sf) / gs) in float32, into 'bfloat16' (rounded once) or 'float32' [T, H]: the
    inverse of quantize_nvfp4 (semantics §6 bounds the error per element).

    Arguments:
        q: uint8 [T, H / 2] as quantize_nvfp4 returns it.
        scales: float8_e4m3fn in scale_layout, as quantize_nvfp4 returns them.
        global_scale: the gs the values were quantized with (as quantize_nvfp4's).
        scale_layout: 'swizzled' or 'linear' (the 4th positional argument, as quantize_nvfp4's 3rd).
        out_dtype: 'bfloat16' or 'float32'.

    Errors: epmoe.Error('invalid_argument') naming the argument: dtypes, shapes that do not match q, a bad
    global_scale, scale_layout or out_dtype.
    """
    if hasattr(out_dtype, "name"):  # a NumPy / ml_dtypes dtype
        out_dtype = out_dtype.name
    required("q", q)
    required("scales", scales)
    required("global_scale", global_scale)
    with _on_stream(q):
        return _ext.dequantize_nvfp4(arg(q), arg(scales), arg(_global_scale(global_scale)), str(scale_layout),
                                     str(out_dtype), framework_of(q))


def fp8_group_scale(amax: float, round_scale: bool = False) -> float:
    """The scale semantics §6 computes from a group's absolute maximum (float32 arithmetic)."""
    return _ext.fp8_group_scale(amax, round_scale)


def ue8m0_from_scale(pow2_scale: float) -> int:
    """The UE8M0 byte (log2(scale) + 127) of a power-of-two scale."""
    return _ext.ue8m0_from_scale(pow2_scale)


def ue8m0_to_scale(byte: int) -> float:
    """2^(byte - 127)."""
    return _ext.ue8m0_to_scale(byte)
