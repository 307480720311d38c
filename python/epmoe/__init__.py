"""epmoe: expert-parallel Mixture-of-Experts layers, router to combine, across ranks.

    import epmoe

    def rank_main(group):                          # runs once per rank, on its own thread
        buffer = epmoe.Buffer(group)               # DeepEP-compatible (deep_ep.Buffer's V1 API)
        layout = buffer.get_dispatch_layout(topk_idx, num_experts)
        ...

    results = epmoe.run_thread_ranks(4, rank_main)

On GPUs (one process per GPU, as with DeepEP)::

    buffer = epmoe.Buffer(torch.distributed.group.WORLD, num_nvl_bytes=...)   # torch CUDA tensors in and out

What is here (tensors: NumPy arrays with bf16 / fp8 as ``ml_dtypes.bfloat16`` / ``ml_dtypes.float8_e4m3fn``,
torch tensors or CuPy arrays, by DLPack; outputs in the caller's framework and on its device):

- ``Buffer``, ``Config``, ``EventOverlap``: dispatch / combine in normal and low-latency mode with
  DeepEP's argument names, order, defaults and return tuples (both modes on GPUs through the cuda_ipc
  backend, and on CPU ranks).
- ``run_thread_ranks`` and ``Group``: CPU ranks as threads of one process; ``as_group`` adapts a
  ``torch.distributed`` ProcessGroup or an mpi4py communicator.
- ``topk_softmax``, ``topk_sigmoid``, ``grouped_topk``: routing.
- ``quantize_fp8``, ``dequantize_fp8``: per-token-group fp8 (round_scale, UE8M0); ``quantize_nvfp4``,
  ``dequantize_nvfp4``: NVFP4 (e2m1 values, an e4m3 scale per 16 channels, swizzled or linear scales).
- ``MoELayer`` and the ``make_*`` factories: the modular layer, on CPU tensors (reference / BLAS experts)
  or on one GPU (``make_cuda_experts``, torch or CuPy CUDA tensors); ``MoEModule`` (torch.nn.Module) when
  torch is installed.
- ``rebalance_experts`` (DeepSeek EPLB), ``map_to_physical``, ``ExpertLoadRecorder``: expert load statistics
  and load balancing.
- ``check_invalid_ids``, ``check_moe_faults``: raise what CUDA kernels flagged instead of synchronising (an
  out-of-range id in a layout, a no-EP slab overflow; semantics §11).
- ``Error``: every failure; ``str(e)`` is the C++ message, ``e.code`` its kind.
"""

from __future__ import annotations

from typing import Any

from . import _ext
from ._group import Group, as_group, run_thread_ranks
from ._tensor import BFLOAT16, FLOAT8_E4M3FN
from .buffer import Buffer, Config, DispatchHandle, Event, EventOverlap, LowLatencyHandle
from .eplb import ExpertLoadRecorder, logical_loads, map_to_physical, rebalance_experts
from .moe import (ACTIVATIONS, DISPATCH_MODES, DispatchHookHandle, Experts, MoELayer, PrepareFinalize,
                  SharedExperts, WorkspaceCache, check_moe_faults, make_all_gather_prepare_finalize, make_blas_experts, make_cuda_experts,
                  make_cuda_shared_experts, make_low_latency_prepare_finalize, make_no_ep_prepare_finalize, make_normal_prepare_finalize, make_reference_experts,
                  resolve_dispatch_mode)
from .ops import (FP8_GROUP_SIZE, check_invalid_ids, dequantize_fp8, dequantize_nvfp4, fp8_group_scale, get_dispatch_layout, grouped_topk,
                  num_scale_groups, num_ue8m0_words, quantize_fp8, quantize_nvfp4, topk_sigmoid, topk_softmax, ue8m0_from_scale,
                  ue8m0_to_scale)

Error = _ext.Error
__version__ = _ext.version()


def _topk_idx_t() -> Any:
    """DeepEP's ``deep_ep.topk_idx_t``: ``torch.int64`` when torch is importable, else the NumPy dtype
    ``numpy.int64`` (either works with ``.to`` / ``.astype`` of its framework). int32 ids are accepted too."""
    try:
        import torch
    except ImportError:
        import numpy
        return numpy.dtype(numpy.int64)
    return torch.int64


def default_timeout_s() -> float:
    """Timeout of a wait between ranks, seconds (EPMOE_TIMEOUT_S overrides the default of 100)."""
    return _ext.default_timeout_s()


def built_with_cuda() -> bool:
    """Whether this build holds the CUDA implementations."""
    return bool(_ext.built_with_cuda())


def __getattr__(name: str) -> Any:
    if name == "topk_idx_t":  # made on first use: importing epmoe never imports torch
        return _topk_idx_t()
    if name == "MoEModule":  # torch.nn.Module wrapper, made on first use (imports torch)
        from . import moe
        return moe.MoEModule
    raise AttributeError(f"module 'epmoe' has no attribute {name!r}")


__all__ = [
    "ACTIVATIONS", "DISPATCH_MODES", "DispatchHookHandle", "resolve_dispatch_mode",
    "BFLOAT16", "Buffer", "Config", "DispatchHandle", "Error", "Event", "EventOverlap", "Experts",
    "ExpertLoadRecorder", "logical_loads", "map_to_physical", "rebalance_experts",
    "FLOAT8_E4M3FN", "FP8_GROUP_SIZE", "Group", "LowLatencyHandle", "MoELayer", "PrepareFinalize", "WorkspaceCache",
    "as_group", "built_with_cuda", "check_invalid_ids", "check_moe_faults", "default_timeout_s", "dequantize_fp8",
    "dequantize_nvfp4", "fp8_group_scale", "get_dispatch_layout",
    "grouped_topk", "make_all_gather_prepare_finalize", "make_blas_experts", "make_cuda_experts",
    "make_cuda_shared_experts", "SharedExperts", "make_low_latency_prepare_finalize", "make_no_ep_prepare_finalize",
    "make_normal_prepare_finalize", "make_reference_experts", "num_scale_groups", "num_ue8m0_words", "quantize_fp8",
    "quantize_nvfp4", "run_thread_ranks", "topk_idx_t", "topk_sigmoid", "topk_softmax", "ue8m0_from_scale", "ue8m0_to_scale",
]
