"""A DeepEP-compatible ``Buffer``: expert-parallel dispatch and combine (semantics §4, 5).

Argument names, order, defaults and return tuples follow DeepEP's V1 ``deep_ep.Buffer`` (as of
DeepEP commit 567632d), so an engine switches by changing its import::

    from epmoe import Buffer, Config, EventOverlap     # instead of: from deep_ep import ...

``low_latency_dispatch`` also takes the NVFP4 keywords of DeepEP's later branch (sgl-project/DeepEP, commit 8c78562:
``use_nvfp4=True, x_global_scale=...``, as SGLang's dispatcher passes them) and returns its tuple.

Where epmoe's rules are wider or stricter the method docstrings say so. Every error is an
``epmoe.Error`` whose message names the argument, what was expected and what came, raised before any
communication.

Two layouts:

- GPU (DeepEP's): one process per GPU, ``Buffer(group)`` with a ``torch.distributed.ProcessGroup`` (gloo
  or nccl) or ``Buffer(None, comm=mpi4py_comm)``, torch (or CuPy) CUDA tensors. Normal mode runs on the
  cuda_ipc backend (NVLink, one host; ``num_nvl_bytes`` must hold the largest call:
  ``Buffer.get_normal_nvl_size_hint``). Work is ordered after torch's current stream (or
  ``previous_event``); ``async_finish=True`` returns a CUDA event, else the current stream waits.
  Low-latency mode runs on the GPUs too (the cuda_ipc backend's GPU low-latency mode, NVLink, one host): on
  torch's (or CuPy's) current stream, with ``return_recv_hook`` (the hook enqueues the receive on the stream
  current when it is called) and ``async_finish`` (a CUDA event); its outputs are views of the buffer's
  receive half, as DeepEP's, valid until a later dispatch reuses that half (semantics §5). Over an mpi4py communicator that
  became a native MPI group, low-latency calls on CPU tensors run on the CPU.
- CPU: ranks as threads of one process (``epmoe.run_thread_ranks``), or as MPI processes
  (``Buffer(None, comm=mpi4py_comm)`` with an MPI build), NumPy arrays (bf16 / fp8 as
  ``ml_dtypes.bfloat16`` / ``ml_dtypes.float8_e4m3fn``) or torch CPU tensors, both modes. Every call
  is complete when it returns and its event is complete.

Outputs are made in the inputs' framework (torch in, torch out; NumPy in, NumPy out) and on their device.

DeepEP arguments accepted without effect: ``num_qps_per_rank``, ``allow_nvlink_for_low_latency_mode``,
``allow_mnnvl``, ``use_fabric`` (RDMA / NVSHMEM settings), ``config`` (see ``Config``: epmoe's kernels have no
chunked rings; ``Buffer.num_sms`` set by ``set_num_sms`` before the buffer is made is the cuda_ipc block count),
``num_tokens_per_rdma_rank`` (one level of ranks). ``zero_copy=True`` combines the buffer's slab of
``get_next_low_latency_combine_buffer`` (on GPUs a view into the window, the two halves' slabs alternating as
DeepEP's buffers); ``use_logfmt=True`` is refused
(epmoe.Error 'unsupported': combine sends bf16). On the CPU layout also ``num_nvl_bytes``, ``previous_event``, ``async_finish``
and ``allocate_on_comm_stream`` (work is complete on return). ``allocate_on_comm_stream`` on the GPU is
checked as DeepEP does (needs previous_event and async_finish); outputs are not stream-ordered
allocations there, so it changes nothing else.

Not supported (epmoe.Error 'unsupported'): ``enable_shrink=True`` and the mask-buffer methods (rank
masking, a fault-tolerance feature of DeepEP's NVSHMEM path); ``use_logfmt=True``; more than one host (no RDMA).
``get_comm_stream`` and ``get_local_buffer_tensor`` work on GPUs (torch); on CPU ranks the first returns None
and the second raises 'unsupported'.

Low-latency buffers alternate as DeepEP's (semantics §5): low-latency call n since the last clean (a dispatch or
a combine) uses half n % 2. A dispatch's handle can be combined any number of times (DeepEP's test combines each
twice) until a later dispatch reuses its half; its GPU outputs (views of the half) stay valid as long.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple, Union

import sys

import numpy as np

from . import _ext
from ._group import as_group
from ._tensor import (BFLOAT16, arg, current_stream, describe, framework_of, int32_arg, int64_arg, int_arg,
                      invalid_argument, is_cuda, is_torch, required, unsupported, writable)

Event = _ext.Event


def _torch_cuda() -> Any:
    """torch.cuda when torch is imported and a GPU is usable, else None (never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch.cuda if torch.cuda.is_available() else None
    except Exception:  # a broken CUDA setup: treat as no GPU
        return None


def _current_stream_handle() -> Optional[int]:
    """torch's current CUDA stream on the current device (cudaStream_t as an int), else CuPy's, else None."""
    cuda = _torch_cuda()
    if cuda is not None and cuda.is_initialized():
        return int(cuda.current_stream().cuda_stream)
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        return int(cupy.cuda.get_current_stream().ptr)
    return None


class EventOverlap:
    """An event (DeepEP's ``EventOverlap``), for overlapping communication with computation.

    The event is one of: an ``epmoe._ext.Event`` (a CUDA event on the cuda_ipc buffer's communication
    stream after ``async_finish=True``; otherwise already complete), a ``torch.cuda.Event`` (from
    ``Buffer.capture()`` or an async ``get_dispatch_layout``), or None.

    ``current_stream_wait()`` makes torch's current CUDA stream (CuPy's when torch is not in use) wait for
    it, without blocking the host; CPU events return at once. ``with event: ...`` runs the body, then
    waits the same way (DeepEP's overlap idiom).

    Attributes:
        event: the event, or None.
        extra_tensors: tensors kept alive with the event: the inputs of an async_finish call (the
            communication stream may still read them; DeepEP uses record_stream for this).
    """

    def __init__(self, event: Any = None, extra_tensors: Optional[Tuple[Any, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Makes the current stream wait for the event (no-op for a complete or absent event)."""
        event = self.event
        if event is None:
            return
        if isinstance(event, Event):
            if event.is_cuda:
                event.current_stream_wait(_current_stream_handle())
            return
        # A torch.cuda.Event.
        cuda = _torch_cuda()
        if cuda is not None:
            cuda.current_stream().wait_event(event)
        else:
            event.synchronize()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        self.current_stream_wait()


class Config:
    """Performance tuning of the normal-mode kernels (DeepEP's ``Config``); same constructor.

    What each knob does in epmoe: ``num_sms`` — nothing per call (the cuda_ipc block count is fixed per buffer:
    ``Buffer.set_num_sms`` before the buffer is made); ``num_max_nvl_chunked_send_tokens`` /
    ``num_max_nvl_chunked_recv_tokens`` — nothing (epmoe moves whole runs of rows, no chunked ring; its pipeline
    depth is BufferOptions.num_chunks, fixed per buffer); ``num_max_rdma_chunked_*`` — nothing (one host, no
    RDMA). They are checked (ints >= 1). ``get_nvl_buffer_size_hint`` / ``get_rdma_buffer_size_hint``
    give an estimate of ring-buffer bytes in DeepEP's manner (what engines use to size ``num_nvl_bytes`` /
    ``num_rdma_bytes``). The cuda_ipc backend sizes for the worst case instead, which a ring estimate may
    not cover for large batches (a call that does not fit raises epmoe.Error 'out_of_memory' naming the
    bytes needed): size it with ``Buffer.get_normal_nvl_size_hint(max_tokens_per_rank, hidden, num_ranks,
    num_topk)``.
    """

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        for name, value in (("num_sms", num_sms), ("num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens),
                            ("num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens),
                            ("num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens),
                            ("num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens)):
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise invalid_argument(name, "an int >= 1", repr(value))
        self.num_sms = int(num_sms)
        self.num_max_nvl_chunked_send_tokens = int(num_max_nvl_chunked_send_tokens)
        self.num_max_nvl_chunked_recv_tokens = int(num_max_nvl_chunked_recv_tokens)
        self.num_max_rdma_chunked_send_tokens = int(num_max_rdma_chunked_send_tokens)
        self.num_max_rdma_chunked_recv_tokens = int(num_max_rdma_chunked_recv_tokens)

    # Per received token besides its row: source index, up to 32 top-k ids and weights, up to
    # ceil(H/128) fp32 scales (bounded here by 64 groups, H <= 8192).
    _TOKEN_META_BYTES = 4 + 32 * (8 + 4) + 64 * 4

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of intranode staging: one receive ring of num_max_nvl_chunked_recv_tokens tokens per
        (channel = num_sms / 2, peer), rounded up to 128 bytes. Advisory (epmoe's estimate)."""
        channels = max(1, self.num_sms // 2)
        peers = min(int(num_ranks), 8)
        size = channels * peers * self.num_max_nvl_chunked_recv_tokens * (int(hidden_bytes) + self._TOKEN_META_BYTES)
        return (size + 127) // 128 * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of internode staging (0 within one host of at most 8 ranks). Advisory."""
        if int(num_ranks) <= 8:
            return 0
        channels = max(1, self.num_sms // 2)
        nodes = (int(num_ranks) + 7) // 8
        per_token = int(hidden_bytes) + self._TOKEN_META_BYTES
        size = 2 * channels * nodes * self.num_max_rdma_chunked_recv_tokens * per_token
        return (size + 127) // 128 * 128

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, "
                f"num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}, "
                f"num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens}, "
                f"num_max_rdma_chunked_send_tokens={self.num_max_rdma_chunked_send_tokens}, "
                f"num_max_rdma_chunked_recv_tokens={self.num_max_rdma_chunked_recv_tokens})")


class DispatchHandle(tuple):
    """The handle of a normal-mode dispatch, shaped like DeepEP's intranode 6-tuple:
    ``(rank_prefix_matrix, None, None, recv_src_idx, is_token_in_rank, send_head)``.

    - rank_prefix_matrix: int32 [R, R], [s][d] = tokens ranks 0..s send to rank d.
    - channel_prefix_matrix, recv_channel_prefix_matrix: None (epmoe has no channels on CPU).
    - recv_src_idx: int32 [Nrecv], source token index of each received row.
    - is_token_in_rank: bool [T, R] (sender side).
    - send_head: int32 [T, R], row of token t in rank r's recv_x, or -1 (epmoe's send_pos).

    Pass it back unchanged to ``combine`` and to a cached ``dispatch``; ``native`` is what epmoe reads.
    """

    native: Any

    def __new__(cls, native: Any, arrays: Tuple[Any, Any, Any, Any]) -> "DispatchHandle":
        rank_prefix_matrix, recv_src_idx, is_token_in_rank, send_pos = arrays
        obj = super().__new__(cls, (rank_prefix_matrix, None, None, recv_src_idx, is_token_in_rank, send_pos))
        obj.native = native
        return obj


class LowLatencyHandle(tuple):
    """The handle of a low-latency dispatch, DeepEP's 5-tuple
    ``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)``.

    - src_info: int32 [E_local, R*Tmax], source token index of each received row.
    - layout_range: int64 [E_local, R], ``begin << 32 | count`` of each source rank's block.

    It also carries the generation of its call: once a later dispatch reused its half, ``low_latency_combine``
    rejects it (epmoe.Error 'stale_handle'); until then it can be combined any number of times.
    """

    native: Any

    def __new__(cls, native: Any, src_info: Any, layout_range: Any) -> "LowLatencyHandle":
        obj = super().__new__(cls, (src_info, layout_range, native.num_max_dispatch_tokens_per_rank, native.hidden,
                                    native.num_experts))
        obj.native = native
        return obj


def _contiguous(t: Any) -> Any:
    """t itself when row-major contiguous (or None), else a contiguous copy in its framework and on its device."""
    if t is None:
        return None
    if is_torch(t):
        return t if t.is_contiguous() else t.contiguous()
    if isinstance(t, np.ndarray):
        return t if t.flags.c_contiguous else np.ascontiguousarray(t)
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(t, cupy.ndarray) and not t.flags.c_contiguous:
        return cupy.ascontiguousarray(t)
    return t


def _dispatch_scales(t: Any) -> Any:
    """x_scales for the native dispatch: t itself when row- or column-major as scales_have_layout (include/epmoe/quant.hpp)
    defines them (a unit stride in one dimension, the other stride at least the other extent: e.g. DeepGEMM's
    TMA-aligned column-major scales), else a contiguous copy, so any strides are accepted as DeepEP accepts them."""
    if t is None or getattr(t, "ndim", 0) != 2:
        return t
    if is_torch(t):
        strides = tuple(t.stride())
    else:
        strides = tuple(s // t.itemsize for s in t.strides)
    rows, cols = t.shape
    if rows == 0 or cols == 0:
        return t
    row_major = (cols <= 1 or strides[1] == 1) and (rows <= 1 or strides[0] >= cols)
    column_major = (rows <= 1 or strides[0] == 1) and (cols <= 1 or strides[1] >= rows)
    return t if row_major or column_major else _contiguous(t)


def _event_of(previous_event: Optional[EventOverlap]) -> Any:
    if previous_event is not None and not isinstance(previous_event, EventOverlap):
        raise invalid_argument("previous_event", "None or an EventOverlap", describe(previous_event))
    return getattr(previous_event, "event", None)


def _check_config(config: Any) -> None:
    if config is not None and not isinstance(config, Config):
        raise invalid_argument("config", "None or an epmoe.Config", f"an object of type {type(config).__name__}")


def _check_allocate_on_comm_stream(tensors: Tuple[Any, ...], previous_event: Any, async_finish: bool,
                                   allocate_on_comm_stream: bool) -> None:
    """DeepEP's rule, on GPU tensors: allocate_on_comm_stream needs previous_event and async_finish."""
    event = _event_of(previous_event)
    if allocate_on_comm_stream and (event is None or not async_finish) and any(
            t is not None and is_cuda(t) for t in tensors):
        raise invalid_argument("allocate_on_comm_stream", "previous_event and async_finish=True with it (as DeepEP "
                               "requires)", f"previous_event={'None' if event is None else 'set'}, "
                               f"async_finish={async_finish}")


def _synchronize_stream(x: Any) -> None:
    """Blocks the host until the current stream of x's device is done (torch and CuPy release the GIL)."""
    if is_torch(x):
        import torch
        torch.cuda.current_stream(x.device).synchronize()
    else:
        import cupy
        cupy.cuda.get_current_stream().synchronize()


def _gpu_recv_hook(native: Any, tensors: Tuple[Any, ...], host_wait: bool) -> Callable[[], None]:
    """The hook of a GPU low-latency call: enqueues the receive on the current stream of the moment (DeepEP's
    rule), and keeps the call's tensors alive until then (the receive kernel reads topk_idx and topk_weights and
    writes `out` and the stats). With thread ranks in one process (host_wait) it returns once the receive is
    done, as the other calls of such a buffer do."""

    def hook() -> None:
        native(current_stream(*tensors))
        if host_wait:
            _synchronize_stream(tensors[0])

    return hook


def _deepep_nvfp4_views(recv_x: Any, scales: Any) -> Tuple[Any, Any]:
    """DeepEP's logical shapes of an nvfp4 dispatch's outputs (no copy): packed values [E_local, R*Tmax, H/2] as
    [R*Tmax, H/2, E_local], and the swizzled scales [E_local, rm, rk * 512] as (32, 4, rm, 4, rk, E_local)."""
    el, rm, width = scales.shape
    six = scales.reshape(el, rm, width // 512, 32, 4, 4)
    if is_torch(recv_x):
        return recv_x.permute(1, 2, 0), six.permute(3, 4, 1, 5, 2, 0)
    return recv_x.transpose(1, 2, 0), six.transpose(3, 4, 1, 5, 2, 0)


def _opt_int32(name: str, value: Any) -> int:
    """An optional int argument of the C++ combine: None is its unset value 0 (the C++ checks name the rest)."""
    return 0 if value is None else int32_arg(name, value)


def _check_cost_stats(name: str, stats: Any, num_ranks: int) -> None:
    """DeepEP V1's wait-cost statistics: None or int64 [R] (entry s: nanoseconds waited for rank s, semantics §5)."""
    if stats is None:
        return
    shape = tuple(getattr(stats, "shape", ()))
    if str(getattr(stats, "dtype", "")).replace("torch.", "") != "int64" or shape != (num_ranks,):
        raise invalid_argument(name, f"None or a contiguous int64[{num_ranks}] (one entry per source rank)",
                               describe(stats))


class Buffer:
    """Expert-parallel communication buffer of one rank (DeepEP's ``deep_ep.Buffer``, V1 API).

    Normal mode (prefill, training): ``get_dispatch_layout`` -> ``dispatch`` -> experts -> ``combine``.
    Low-latency mode (decode): ``low_latency_dispatch`` -> experts -> ``low_latency_combine``.

    Ordering is deterministic (semantics §4, 5): received rows are grouped by source rank ascending, in source
    token order within a source; combine sums in ascending rank order in float32 and rounds to bf16
    once. Limits are wider than DeepEP's: any hidden size with ``H % 8 == 0`` (bf16) / ``H % 16 == 0``
    (fp8), the last scale group may be partial; top-k up to 32 (normal) / 16 (low-latency); up to 1024
    local experts; any number of ranks; any ``num_max_dispatch_tokens_per_rank`` that fits in memory.

    Attributes:
        num_sms: SMs for the high-throughput kernels (class attribute; ignored on CPU).
        rank: this rank.
        group_size: ranks in the group.
        group: the group given.
        num_nvl_bytes, num_rdma_bytes, low_latency_mode, explicitly_destroy: as given.
        runtime: the C++ buffer (``epmoe._ext.Buffer``).
    """

    num_sms: int = 20
    _num_sms_set: bool = False  # set_num_sms was called: the cuda_ipc kernels use that many blocks

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm: Any = None, *, backend: Optional[str] = None,
                 device: Optional[int] = None, num_recv_slots: int = 0, debug_validate: bool = False) -> None:
        """Creates this rank's buffer. Collective: every rank of the group calls it.

        Arguments:
            group: a ``torch.distributed.ProcessGroup`` (one process per GPU; gloo, nccl or mixed), an
                ``epmoe.Group`` (from ``epmoe.run_thread_ranks``), or None with `comm`.
            num_nvl_bytes: normal-mode buffer bytes of the cuda_ipc backend (> 0 there, or 0 with
                ``low_latency_mode=True``: a low-latency-only buffer, as DeepEP's decode buffers, whose
                normal-mode calls raise epmoe.Error 'invalid_argument' naming num_nvl_bytes; the largest call
                must fit, else that call raises epmoe.Error 'out_of_memory' naming the bytes needed:
                ``Buffer.get_normal_nvl_size_hint(max_tokens_per_rank, hidden, num_ranks, num_topk)``;
                ignored on CPU). >= 0.
            num_rdma_bytes: low-latency buffer bytes per rank; 0 = sized on the first low-latency call;
                a positive size smaller than ``get_low_latency_rdma_size_hint`` is an error at that call
                (it says how many bytes are needed). >= 0.
            low_latency_mode: whether low-latency calls are intended (both modes work either way, except
                that on cuda_ipc it allows ``num_nvl_bytes=0``, a buffer for low-latency calls only).
            num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric: RDMA / NVSHMEM
                settings of DeepEP; accepted, no effect.
            explicitly_destroy: if True, ``destroy()`` must be called to release the buffer.
            enable_shrink: rank masking; not supported (True raises epmoe.Error 'unsupported').
            comm: an mpi4py communicator instead of `group` (one process per GPU).
            backend (epmoe, keyword only): None / 'auto' picks the CPU 'threads' backend for thread ranks,
                and 'cuda_ipc' for a torch or mpi4py group when a GPU is visible (else 'mpi', the CPU
                transport of an MPI group, where mpi4py and epmoe share the MPI library). 'cuda_ipc' with
                thread ranks puts rank r on cuda:r in one process; 'mpi' keeps an MPI group on the CPU.
            device (epmoe, keyword only): this rank's CUDA device for cuda_ipc; None = torch's current
                device when torch has initialised CUDA, else rank % visible devices.
            num_recv_slots (epmoe, keyword only): cuda_ipc zero-copy receive slots, 0..64 (each
                num_nvl_bytes more device memory; 0 = none). With slots, a dispatch's recv_x, scales, ids and
                weights are views of a slot the senders store into directly; the slot is reused once they are
                all freed (see BufferOptions::num_recv_slots in include/epmoe/buffer.hpp). Ignored on CPU.
            debug_validate (epmoe, keyword only): cuda_ipc low-latency calls copy topk_idx to the host and check
                it before any communication (a host synchronisation per call). Off (the default): bad ids are
                found on the device, skipped, and raised by the next call. CPU ranks always check ids eagerly.
                With it, every call also checks that topk_weights on the CPU are finite (a NaN or infinity is
                named with its [t, k]; semantics §11); off, they are not read for this.

        Errors (epmoe.Error): invalid_argument (a bad group, negative sizes, num_nvl_bytes == 0 with
        cuda_ipc and low_latency_mode=False, an unknown backend); unsupported (enable_shrink, a torch /
        mpi4py group without a CUDA build or GPU, more ranks than one host holds); rank_mismatch
        (num_nvl_bytes or num_sms differ across ranks); out_of_memory (the device buffer cannot be allocated).
        """
        if enable_shrink:
            raise unsupported("Buffer(enable_shrink=True): rank masking is not supported")
        num_nvl_bytes = int_arg("num_nvl_bytes", num_nvl_bytes, 0, 2**63 - 1)
        num_rdma_bytes = int_arg("num_rdma_bytes", num_rdma_bytes, 0, 2**63 - 1)
        if backend not in (None, "auto", "threads", "mpi", "cuda_ipc"):
            raise invalid_argument("backend", "None, 'auto', 'threads', 'mpi' or 'cuda_ipc'", repr(backend))
        native_group = as_group(group, comm)
        native_backend = native_group.backend
        gpus = _ext.built_with_cuda() and _ext.cuda_device_count() > 0
        asked_for_cuda_ipc = backend == "cuda_ipc"
        if backend in (None, "auto"):
            # Thread ranks stay on their CPU backend; process groups take the GPUs when there are any, and an
            # MPI group without GPUs its CPU transport.
            if native_backend == "threads" or (native_backend == "mpi" and not gpus):
                backend = "auto"
            else:
                backend = "cuda_ipc"
        if backend == "cuda_ipc" and not gpus:
            why = "this build has no CUDA" if not _ext.built_with_cuda() else "this machine has no visible GPU"
            if asked_for_cuda_ipc:  # the caller's choice, not the group's: say so rather than blame the group
                raise unsupported(f"Buffer(backend='cuda_ipc') needs CUDA GPUs, and {why} (CPU ranks: backend=None, "
                                  f"'threads' or 'mpi')")
            raise unsupported(f"Buffer over a '{native_backend}' group needs the cuda_ipc backend, and {why}"
                              " (CPU ranks: epmoe.run_thread_ranks, or Buffer(None, comm=mpi4py_comm) with an MPI "
                              "build of epmoe)")
        if device is None:
            cuda = _torch_cuda()
            device = int(cuda.current_device()) if backend == "cuda_ipc" and cuda is not None else -1
        elif isinstance(device, bool) or not isinstance(device, (int, np.integer)) or not 0 <= device < 2**31:
            raise invalid_argument("device", "None or a CUDA device index in 0..2**31-1", repr(device))
        if isinstance(num_recv_slots, bool) or not isinstance(num_recv_slots, (int, np.integer)) \
                or not 0 <= num_recv_slots <= 64:
            raise invalid_argument("num_recv_slots", "an int in 0..64", repr(num_recv_slots))
        # Thread ranks on GPUs share one interpreter: an op waits on the host (GIL released) before it returns, also
        # with async_finish, so no later GIL-holding CUDA call of this thread can block the peer thread that must
        # still enqueue its part of the op (seen as device timeouts in the Python GPU suite). Overlap needs one
        # process per GPU (torch.distributed / mpi4py groups), as with DeepEP.
        self._host_wait = backend == "cuda_ipc" and native_backend == "threads"
        self.rank = native_group.rank()
        self.group_size = native_group.size()
        self.group = group
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.num_rdma_bytes = int(num_rdma_bytes)
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.enable_shrink = False
        self.backend = backend
        self.native_group = native_group
        self._side_stream: Any = None
        self.runtime = _ext.Buffer(native_group, self.num_nvl_bytes, self.num_rdma_bytes, self.low_latency_mode,
                                   backend, int(device), Buffer._num_sms_for_kernels(), int(num_recv_slots),
                                   bool(debug_validate))
        # Low-latency calls since the last clean: their parity picks the CPU ranks' combine slab of the next (on
        # GPUs the slabs are views into the window, picked by the runtime).
        self._ll_calls = 0
        self._combine_slabs: List[Any] = [None, None]

    # ---------------------------------------------------------------- life cycle and static helpers

    def destroy(self) -> None:
        """Releases the buffer (needs ``explicitly_destroy=True``). Later calls raise epmoe.Error 'unusable'."""
        if not self.explicitly_destroy:
            raise invalid_argument("explicitly_destroy", "True (destroy() needs Buffer(..., explicitly_destroy=True))",
                                   "False")
        self.runtime.destroy()

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether this build holds the CUDA (sm_90a) implementations."""
        return bool(_ext.built_with_cuda())

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Sets ``Buffer.num_sms`` (must be even, as DeepEP requires). No effect on CPU."""
        if not isinstance(new_num_sms, (int, np.integer)) or new_num_sms <= 0 or new_num_sms % 2 != 0:
            raise invalid_argument("new_num_sms", "an even int > 0", repr(new_num_sms))
        Buffer.num_sms = int(new_num_sms)
        Buffer._num_sms_set = True

    @staticmethod
    def _num_sms_for_kernels() -> int:
        """Blocks per cuda_ipc data kernel: Buffer.num_sms once set_num_sms was called (at most 64), else 0
        (the backend's tuned default)."""
        return min(int(Buffer.num_sms), 64) if Buffer._num_sms_set else 0

    @staticmethod
    def capture() -> EventOverlap:
        """An event on torch's current CUDA stream (a ``torch.cuda.Event``) when torch uses a GPU; else an
        already complete event. Pass it as ``previous_event`` to order a call after the work captured."""
        cuda = _torch_cuda()
        if cuda is not None and cuda.is_initialized():
            event = cuda.Event()
            event.record(cuda.current_stream())
            return EventOverlap(event)
        return EventOverlap(Event())

    @staticmethod
    def get_normal_nvl_size_hint(max_tokens_per_rank: int, hidden: int, num_ranks: int, num_topk: int) -> int:
        """``num_nvl_bytes`` a cuda_ipc buffer needs so that any normal-mode call of up to
        `max_tokens_per_rank` tokens per rank (bf16 or fp8 rows of `hidden`, `num_topk` ids) fits, whatever
        the routing (epmoe; DeepEP sizes its ring buffers with Config.get_nvl_buffer_size_hint instead)."""
        return _ext.Buffer.get_normal_nvl_size_hint(int64_arg("max_tokens_per_rank", max_tokens_per_rank),
                                                    int64_arg("hidden", hidden), int32_arg("num_ranks", num_ranks),
                                                    int32_arg("num_topk", num_topk))

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes per rank the low-latency buffer needs for these settings (both alternating halves,
        fp8 or bf16 payloads). Errors: non-positive sizes, num_experts % num_ranks != 0, more than 1024
        local experts."""
        return _ext.Buffer.get_low_latency_rdma_size_hint(
            int32_arg("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
            int64_arg("hidden", hidden), int32_arg("num_ranks", num_ranks), int32_arg("num_experts", num_experts))

    def get_comm_stream(self) -> Any:
        """The stream async_finish work of both modes runs on (one per buffer, as DeepEP's): on GPUs a
        ``torch.cuda.ExternalStream`` on the buffer's device (work enqueued on it is ordered with the buffer's
        async_finish calls); None on CPU ranks, whose calls are complete when they return. Errors: epmoe.Error
        'unsupported' on GPUs without torch; 'unusable' after destroy()."""
        handle = self.runtime.comm_stream()
        if handle is None:
            return None
        cuda = _torch_cuda()
        if cuda is None:
            raise unsupported("get_comm_stream: returns a torch stream, and torch is not installed (the raw "
                              f"cudaStream_t is {handle:#x})")
        return cuda.ExternalStream(handle, device=self.runtime.local_buffer(False, "torch").device)

    def get_local_buffer_tensor(self, dtype: Any, size: Any = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> Any:
        """This rank's communication memory as a torch tensor (DeepEP's raw buffer), a view that the buffer's
        calls overwrite.

        Arguments:
            dtype: a torch dtype; the tensor is 1-d, of (bytes - offset) // element size elements.
            size: optional shape (a torch.Size or tuple): the first prod(size) elements viewed as it.
            offset: bytes from the start (as DeepEP's implementation counts it), a multiple of dtype's size.
            use_rdma_buffer: False: the normal-mode data region (num_nvl_bytes); True: the low-latency window
                (both halves; see docs/semantics.md §5 for its layout), which the first low-latency call on GPU
                tensors allocates.

        Errors (epmoe.Error): unsupported on CPU ranks (their memory is not one device buffer) or without torch;
        invalid_argument naming use_rdma_buffer before the window exists, offset (out of range or misaligned)
        or size (more elements than the buffer holds)."""
        cuda = _torch_cuda()
        if self.runtime.comm_stream() is None or cuda is None:
            raise unsupported("get_local_buffer_tensor: a GPU (cuda_ipc) buffer and torch are needed; CPU ranks' "
                              "memory is not one device buffer")
        raw = self.runtime.local_buffer(bool(use_rdma_buffer), "torch")
        if raw is None:
            raise invalid_argument("use_rdma_buffer", "False, or True once a low-latency call on GPU tensors "
                                   "allocated the window", "True before the first low-latency call")
        import torch
        elem = torch.empty((), dtype=dtype).element_size()
        offset = int_arg("offset", offset, 0, raw.numel())
        if offset % elem != 0:
            raise invalid_argument("offset", f"a multiple of {elem} bytes ({dtype})", str(offset))
        n = (raw.numel() - offset) // elem
        tensor = raw[offset:offset + n * elem].view(dtype)
        if size is None:
            return tensor
        shape = tuple(int(d) for d in size)
        numel = int(np.prod(shape, dtype=np.int64))
        if numel > n:
            raise invalid_argument("size", f"at most {n} elements of {dtype} past offset {offset}",
                                   f"{shape} ({numel} elements)")
        return tensor[:numel].view(shape)

    def _enter(self, tensors: Tuple[Any, ...], previous_event: Optional[EventOverlap], async_finish: bool,
               allocate_on_comm_stream: bool) -> Tuple[Any, Optional[int], Optional[Callable[[], None]]]:
        """Stream and event arguments of one call: (the epmoe Event to pass as previous_event or None, the
        caller's stream handle or None, a function to run after the call or None).

        A ``torch.cuda.Event`` (from capture) as previous_event: a side stream waits for it and is handed
        down as the caller's stream, so the communication stream waits for that event only (DeepEP's
        meaning); without async_finish, torch's current stream then waits for the side stream."""
        event = _event_of(previous_event)
        _check_allocate_on_comm_stream(tensors, previous_event, async_finish, allocate_on_comm_stream)
        gpu = [t for t in tensors if t is not None and is_cuda(t)]
        stream = current_stream(*gpu)
        if isinstance(event, Event) and not event.is_cuda:
            # A complete event (a synchronous call's) orders nothing: wait for the caller's stream instead,
            # as DeepEP does for an EventOverlap without an event.
            event = None
        if event is None or isinstance(event, Event):
            return event, stream, None
        if not gpu or not hasattr(gpu[0], "device"):  # CPU work (or CuPy): wait on the host
            event.synchronize()
            return None, stream, None
        import torch
        device = gpu[0].device
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=device)
        side = self._side_stream
        side.wait_event(event)

        def after() -> None:
            if not async_finish:
                torch.cuda.current_stream(device).wait_stream(side)

        return None, int(side.cuda_stream), after

    @staticmethod
    def _unpack_bias(bias: Any) -> Tuple[Any, Any]:
        if bias is None:
            return None, None
        if isinstance(bias, tuple):
            if len(bias) != 2:
                raise invalid_argument("bias", "None, a tensor or a tuple of two tensors", f"a tuple of {len(bias)}")
            return bias
        return bias, None

    # DeepEP's tuned chunk sizes per rank count (send, recv, rdma send, rdma recv), as data: the values a
    # DeepEP user gets, so configs printed or compared across the two libraries agree.
    _DISPATCH_CONFIGS = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
                         24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
                         96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128),
                         160: (28, 720, 12, 128)}
    _COMBINE_CONFIGS = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
                        24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
                        96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}

    @staticmethod
    def _config_for(table: dict, num_ranks: Any) -> Config:
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, (int, np.integer)) or num_ranks < 1:
            raise invalid_argument("num_ranks", "an int >= 1", repr(num_ranks))
        # DeepEP knows only the listed counts; others take the next listed one up (1 -> 2; beyond 160 -> 160's).
        key = min((k for k in table if k >= num_ranks), default=max(table))
        return Config(Buffer.num_sms, *table[key])

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's dispatch Config for `num_ranks` ranks (``Buffer.num_sms`` SMs); any count >= 1 (DeepEP
        knows a fixed list: others take the next listed count up). See ``Config`` for what epmoe does with it.
        Errors: epmoe.Error invalid_argument for num_ranks < 1."""
        return Buffer._config_for(Buffer._DISPATCH_CONFIGS, num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's combine Config for `num_ranks` ranks, as get_dispatch_config."""
        return Buffer._config_for(Buffer._COMBINE_CONFIGS, num_ranks)

    # ---------------------------------------------------------------- normal mode

    def get_dispatch_layout(self, topk_idx: Any, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False
                            ) -> Tuple[Any, None, Any, Any, EventOverlap]:
        """Where each token goes (semantics §3). Local: no communication.

        Arguments:
            topk_idx: int64 (or int32) [T, K], global expert ids in [-1, num_experts); -1 = no expert. On a
                GPU the layout is computed on torch's current stream (after previous_event).
            num_experts: E, a positive multiple of the group size, E / R <= 1024.
            previous_event: an EventOverlap to wait for first (GPU: the current stream waits for it).
            async_finish: GPU: also return a torch.cuda.Event recorded after the layout kernels.
            allocate_on_comm_stream: checked as DeepEP does (needs previous_event and async_finish).

        Returns:
            num_tokens_per_rank: int32 [R], tokens sent to each rank (a token counts once per rank).
            num_tokens_per_rdma_rank: None (one level of ranks).
            num_tokens_per_expert: int32 [E].
            is_token_in_rank: bool [T, R].
            event: an EventOverlap (complete on CPU).

        Errors: epmoe.Error('invalid_argument') for a bad dtype/shape, E % R != 0, an id outside [-1, E)
        (naming the first one and its [t, k]) on CPU tensors. On a GPU such an id is skipped (the dispatch drops
        that choice) and flagged without synchronising: epmoe.check_invalid_ids raises it.
        """
        # The layout runs on the caller's stream itself: that stream waits for previous_event first.
        required("topk_idx", topk_idx)
        num_experts = int32_arg("num_experts", num_experts)
        _check_allocate_on_comm_stream((topk_idx,), previous_event, async_finish, allocate_on_comm_stream)
        if previous_event is not None:
            previous_event.current_stream_wait()
        per_rank, per_expert, in_rank = self.runtime.get_dispatch_layout(arg(topk_idx), num_experts,
                                                                         framework_of(topk_idx),
                                                                         current_stream(topk_idx))
        event: Any = Event()
        if async_finish and is_cuda(topk_idx) and _torch_cuda() is not None and hasattr(topk_idx, "device"):
            event = _torch_cuda().Event()
            event.record(_torch_cuda().current_stream(topk_idx.device))
        return per_rank, None, per_expert, in_rank, EventOverlap(event)

    def dispatch(self, x: Union[Any, Tuple[Any, Any]], handle: Optional[Tuple] = None,
                 num_tokens_per_rank: Any = None, num_tokens_per_rdma_rank: Any = None,
                 is_token_in_rank: Any = None, num_tokens_per_expert: Any = None,
                 topk_idx: Any = None, topk_weights: Any = None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False
                 ) -> Tuple[Any, Optional[Any], Optional[Any], Optional[List[int]], Optional[Tuple], EventOverlap]:
        """Normal-mode dispatch (semantics §4). Collective.

        Arguments:
            x: bfloat16 [T, H] (H % 8 == 0), or a tuple (fp8 x, scales): float8_e4m3fn [T, H] (H % 16 == 0)
                with float32 scales [T, ceil(H/128)] (the last group may be partial; DeepEP needs
                H % 128 == 0) or UE8M0 int32 scales [T, ceil(ceil(H/128)/4)]. Scales travel with their rows.
                Errors name the scales 'x[1]'.
            handle: a DispatchHandle from an earlier dispatch of this buffer: cached dispatch (moves x only,
                reuses the layout; topk_idx may be given and is then checked against the handle).
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: from get_dispatch_layout
                (required unless `handle` is given; checked against topk_idx).
            num_tokens_per_rdma_rank: ignored (one level of ranks).
            topk_idx: int64/int32 [T, K], K in 1..32 (DeepEP: fixed list), ids in [-1, E).
            topk_weights: float32 [T, K] (optional).
            expert_alignment: >= 1; each local expert's count is rounded up to a multiple of it.
            num_worst_tokens: > 0 pads the outputs to this many rows (padded rows have topk_idx -1) and
                returns an empty count list, as DeepEP does (GPU: no host synchronisation).
            config: accepted (see the module docstring).
            previous_event: GPU: the communication stream waits for this event instead of torch's current
                stream. CPU: no effect.
            async_finish: GPU: return at once with a CUDA event (event.current_stream_wait() before using the
                outputs; the inputs are kept alive in event.extra_tensors); else torch's current stream
                waits for the communication stream. CPU: no effect.
            allocate_on_comm_stream: GPU: needs previous_event and async_finish (as DeepEP).

        Returns:
            recv_x: [Nrecv, H] of x's dtype (a tuple (recv_x, recv_x_scales) for fp8 input). One row per
                (token, destination rank); rows grouped by source rank ascending, source order within.
            recv_topk_idx: int64 [Nrecv, K], local expert ids (global - rank * E_local) or -1 (None for a
                cached dispatch).
            recv_topk_weights: float32 [Nrecv, K], 0 where the id is -1 (None for a cached dispatch).
            num_recv_tokens_per_expert_list: E_local ints, aligned (None for a cached dispatch).
            handle: a DispatchHandle for combine (None for a cached dispatch).
            event: an EventOverlap (a CUDA event with async_finish on the GPU; else complete).

        Errors: epmoe.Error — invalid_argument for any bad argument (before any exchange, on this rank;
        GPU: a CPU tensor, a tensor on another device); rank_mismatch when settings differ across ranks
        (H, dtype, K, E, alignment; on every rank); out_of_memory (GPU: num_nvl_bytes too small, names the
        bytes needed; CPU: a num_worst_tokens whose padded outputs exceed this machine's memory, named before
        anything is allocated); timeout when a rank does not arrive (GPU: the buffer is unusable afterwards).
        """
        _check_config(config)
        expert_alignment = int32_arg("expert_alignment", expert_alignment)
        num_worst_tokens = int32_arg("num_worst_tokens", num_worst_tokens)
        if isinstance(x, tuple) and len(x) != 2:
            raise invalid_argument("x", "a tensor or a tuple (fp8 x, its scales)", f"a tuple of {len(x)} elements")
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        required("x", x)
        # Scales of any strides, as DeepEP: row- and column-major ones go as they are (semantics §4).
        x_scales = _dispatch_scales(x_scales)
        native_handle = None
        if handle is not None:
            if not isinstance(handle, DispatchHandle):
                raise invalid_argument("handle", "None or the handle returned by dispatch", describe(handle))
            native_handle = handle.native
        inputs = (x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert)
        native_event, stream, after = self._enter(inputs, previous_event, async_finish, allocate_on_comm_stream)
        host_wait = self._host_wait
        recv_x, recv_scales, recv_idx, recv_w, counts, new_handle, event, arrays = self.runtime.dispatch(
            arg(x), arg(x_scales), arg(topk_idx), arg(topk_weights), arg(num_tokens_per_rank),
            arg(is_token_in_rank), arg(num_tokens_per_expert), native_handle, expert_alignment, num_worst_tokens,
            native_event, async_finish or host_wait, allocate_on_comm_stream, framework_of(x), stream)
        if host_wait:
            event.wait_host()
            if not async_finish:
                event.current_stream_wait(stream)
        if after is not None:
            after()
        overlap = EventOverlap(event, inputs if event.is_cuda else None)
        recv = (recv_x, recv_scales) if x_scales is not None else recv_x
        if handle is not None:
            return recv, None, None, None, None, overlap
        return recv, recv_idx, recv_w, counts, DispatchHandle(new_handle, arrays), overlap

    def combine(self, x: Any, handle: Tuple, topk_weights: Any = None,
                bias: Union[Any, Tuple[Any, Any], None] = None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> Tuple[Any, Optional[Any], EventOverlap]:
        """Normal-mode combine (semantics §4): sends each received row back and sums per token. Collective.

        Arguments:
            x: bfloat16 [rows, H], one row per row of the dispatch's recv_x (already reduced over the
                token's local experts: combine applies no router weights).
            handle: the DispatchHandle of that dispatch.
            topk_weights: optional float32 [rows, K]; their per-token sum comes back.
            bias: None, a bfloat16 [T, H] or a tuple of two, added after the sum.
            config, previous_event, async_finish, allocate_on_comm_stream: as for dispatch.

        Returns:
            combined_x: bfloat16 [T, H] = sum over destination ranks (ascending) in float32, plus the
                biases, rounded to bf16 once (bit-reproducible, the same bits on CPU and GPU).
            combined_topk_weights: float32 [T, K] or None.
            event: an EventOverlap (a CUDA event with async_finish on the GPU; else complete).

        Errors: epmoe.Error('invalid_argument') for a handle of another buffer, rows != the handle's, bad
        dtypes, shapes or devices (before any exchange); timeout as for dispatch.
        """
        _check_config(config)
        if not isinstance(handle, DispatchHandle):
            raise invalid_argument("handle", "the handle returned by dispatch", describe(handle))
        required("x", x)
        bias_0, bias_1 = Buffer._unpack_bias(bias)
        inputs = (x, topk_weights, bias_0, bias_1)
        native_event, stream, after = self._enter(inputs, previous_event, async_finish, allocate_on_comm_stream)
        host_wait = self._host_wait
        combined, combined_w, event = self.runtime.combine(
            arg(x), handle.native, arg(topk_weights), arg(bias_0), arg(bias_1), native_event,
            async_finish or host_wait, allocate_on_comm_stream, framework_of(x), stream)
        if host_wait:
            event.wait_host()
            if not async_finish:
                event.current_stream_wait(stream)
        if after is not None:
            after()
        return combined, combined_w, EventOverlap(event, inputs if event.is_cuda else None)

    # DeepEP's explicit internode entry points: one level of ranks here, so they are dispatch/combine.
    internode_dispatch = dispatch
    internode_combine = combine

    # ---------------------------------------------------------------- low-latency mode

    def internode_dispatch(self, x: Union[Any, Tuple[Any, Any]], handle: Optional[Tuple] = None,
                           num_tokens_per_rank: Any = None, num_tokens_per_rdma_rank: Any = None,
                           is_token_in_rank: Any = None, num_tokens_per_expert: Any = None,
                           topk_idx: Any = None, topk_weights: Any = None, expert_alignment: int = 1,
                           num_worst_tokens: int = 0, config: Optional[Config] = None,
                           previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                           allocate_on_comm_stream: bool = False) -> Tuple[Any, ...]:
        """DeepEP's dispatch across RDMA ranks (which its ``dispatch`` calls when the group spans hosts). epmoe's
        buffers span one host (more ranks than one host holds are refused at construction), so this is ``dispatch``
        with the same arguments, returns and errors (num_tokens_per_rdma_rank is accepted and unused, as there)."""
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                             num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                             config, previous_event, async_finish, allocate_on_comm_stream)

    def internode_combine(self, x: Any, handle: Tuple, topk_weights: Any = None,
                          bias: Union[Any, Tuple[Any, Any], None] = None, config: Optional[Config] = None,
                          previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                          allocate_on_comm_stream: bool = False) -> Tuple[Any, Optional[Any], EventOverlap]:
        """DeepEP's combine across RDMA ranks: on epmoe's one-host groups, ``combine`` with the same arguments,
        returns and errors (see internode_dispatch)."""
        return self.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                            allocate_on_comm_stream)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Resets the low-latency buffers (collective). Pending hooks and earlier handles become stale.
        Errors: settings differing from the buffer's first low-latency call."""
        self.runtime.clean_low_latency_buffer(
            int32_arg("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
            int64_arg("hidden", hidden), int32_arg("num_experts", num_experts))
        self._ll_calls = 0
        for slab in self._combine_slabs:  # CPU ranks' own slabs, zeroed as the window's are (GPU slabs are in it)
            if slab is not None:
                slab[...] = 0

    def low_latency_dispatch(self, x: Any, topk_idx: Any, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Any = None, dispatch_wait_recv_cost_stats: Any = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False, *,
                             use_nvfp4: bool = False, x_global_scale: Any = None
                             ) -> Tuple[Any, Any, Tuple, EventOverlap, Optional[Callable[[], None]]]:
        """Low-latency dispatch (semantics §5). Collective.

        CPU tensors run on CPU ranks; CUDA tensors (torch or CuPy, on this rank's device) on a cuda_ipc buffer run
        on the GPUs (bit-identical to the CPU path), on the current stream (torch's, else CuPy's), without
        host synchronisation (the eager topk_idx check is opt-in: ``Buffer(..., debug_validate=True)``).

        Arguments:
            x: bfloat16 [T, H], T <= num_max_dispatch_tokens_per_rank, H % 16 == 0 with fp8 (any such H,
                the last scale group may be partial; DeepEP: a fixed list of H).
            topk_idx: int64/int32 [T, K], K in 1..16, ids in [-1, E).
            num_max_dispatch_tokens_per_rank: Tmax; fixed with H and E by the buffer's first low-latency call, for
                its life (clean_low_latency_buffer takes the same three), and equal on all ranks (a mismatch is an
                error on every rank, never a hang).
            num_experts: E.
            cumulative_local_expert_recv_stats: optional int32 [E_local]; each call adds its counts.
            dispatch_wait_recv_cost_stats: optional int64 [R] on x's device (DeepEP V1's diagnosis statistic):
                entry s += the nanoseconds the receive waited for rank s's data (DeepEP counts GPU clock cycles).
            use_fp8: quantize to fp8 e4m3 with one float32 scale per 128 channels.
            round_scale: scales rounded up to powers of two. use_ue8m0: UE8M0 scales (needs round_scale).
            async_finish: GPU: the call runs on the buffer's communication stream (after the current stream's
                work) and returns a CUDA event (event.current_stream_wait() before reading the outputs; the inputs
                are kept alive in event.extra_tensors). CPU: complete on return. Excludes return_recv_hook.
            return_recv_hook: only send; the returned hook receives. Call it exactly once. GPU: the hook enqueues
                the receive on the current stream at the time it is called (DeepEP's rule) and keeps the inputs
                alive until then.
            use_nvfp4 (keyword): NVFP4 on the wire (semantics §5, §6), as sgl-project/DeepEP's low-latency dispatch:
                e2m1 codes two per byte and an e4m3 scale per 16 channels, quantized with x_global_scale. Needs
                use_fp8=False and H % 64 == 0.
            x_global_scale (keyword): with use_nvfp4, the global scale, a float32 tensor with one element (shape
                [] or [1]; torch or NumPy, on the CPU or x's device; the producers' 448 * 6 / amax). A CPU value must
                be finite and > 0; a device value is read by the kernels (checked on the host with debug_validate,
                else raised by the next call). Ignored without use_nvfp4.

        Returns:
            recv_x: [E_local, R*Tmax, H] bfloat16, or with use_fp8 a tuple (float8_e4m3fn [E_local, R*Tmax, H],
                scales float32 [E_local, R*Tmax, ceil(H/128)] or int32 [..., ceil(ceil(H/128)/4)] with UE8M0).
                The scales are column-major per expert as DeepEP's: strides (C * M, 1, M) in elements, M = R*Tmax
                rounded up to a multiple of 4 (DeepGEMM's TMA alignment; semantics §5, 6). The first
                recv_count[e] rows of expert e are valid: blocks by ascending source rank, source token
                order within (deterministic; DeepEP leaves block order to arrival). Other rows are
                undefined. On CPU these are copies, valid after the call (or after the hook) for good. On GPU
                they are views of the buffer's receive half (as DeepEP's), filled on the stream, and valid until
                a later low_latency_dispatch reuses that half (DeepEP's alternation: the half flips on every
                low-latency dispatch and combine; semantics §5 has the table): clone what must live longer.
                With use_nvfp4, DeepEP's tuple: (uint8 [R*Tmax, H/2, E_local], float8_e4m3fn [32, 4,
                ceil(R*Tmax/128), 4, H/64, E_local]): permuted views of the packed values [E_local, R*Tmax, H/2]
                (channel 2i in the low nibble of byte i) and of the 128x4 swizzled block scales (E_local, rm, rk,
                32, 4, 4), the layouts the block-scaled fp4 grouped GEMMs read.
            recv_count: int32 [E_local] (masked_m).
            handle: a LowLatencyHandle for low_latency_combine.
            event: an EventOverlap (a CUDA event with async_finish on the GPU; else complete).
            hook: with return_recv_hook, the receive half (fills the outputs above); else None.

        Errors: epmoe.Error — invalid_argument (T > Tmax naming both, K > 16, bad ids, dtypes, shapes,
        use_ue8m0 without round_scale, hook with async_finish; use_nvfp4 with use_fp8, H % 64 != 0, x_global_scale
        missing / not float32 / not one element / not finite and > 0), rank_mismatch (Tmax/H/E or the format differ
        across ranks),
        out_of_memory (num_rdma_bytes too small: says how much is needed), timeout.
        """
        required("x", x)
        required("topk_idx", topk_idx)
        # The scalars first: an array passed positionally where DeepEP's signature puts Tmax (e.g. topk_weights, as
        # in some other libraries' order) is named there, not at a later argument it shifted.
        num_max_dispatch_tokens_per_rank = int32_arg("num_max_dispatch_tokens_per_rank",
                                                     num_max_dispatch_tokens_per_rank)
        num_experts = int32_arg("num_experts", num_experts)
        _check_cost_stats("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, self.group_size)
        writable("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats)
        writable("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats)
        gpu = x is not None and is_cuda(x)
        inputs = (x, topk_idx, cumulative_local_expert_recv_stats, x_global_scale, dispatch_wait_recv_cost_stats)
        stream = current_stream(*inputs) if gpu else None
        # Thread ranks on GPUs: wait on the host (GIL released) before returning, as normal mode does.
        host_wait = gpu and self._host_wait and not return_recv_hook
        recv_x, scales, count, src_info, layout_range, native, event, hook = self.runtime.low_latency_dispatch(
            arg(x), arg(topk_idx), None, num_max_dispatch_tokens_per_rank, num_experts,
            arg(cumulative_local_expert_recv_stats), use_fp8, round_scale, use_ue8m0, async_finish or host_wait,
            return_recv_hook, framework_of(x), stream, bool(use_nvfp4), arg(x_global_scale),
            arg(dispatch_wait_recv_cost_stats))
        if host_wait:
            event.wait_host()
            if not async_finish:
                event.current_stream_wait(stream)
        if hook is not None and gpu:
            hook = _gpu_recv_hook(hook, inputs, self._host_wait)
        self._ll_calls += 1
        recv = (recv_x, scales) if use_fp8 else _deepep_nvfp4_views(recv_x, scales) if use_nvfp4 else recv_x
        return (recv, count, LowLatencyHandle(native, src_info, layout_range),
                EventOverlap(event, inputs if event.is_cuda else None), hook)

    def low_latency_combine(self, x: Any, topk_idx: Any, topk_weights: Any, handle: Tuple, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
                            out: Any = None, combine_wait_recv_cost_stats: Any = None, *, overlap: bool = False,
                            packed_recv_count: Any = None, comp_signal: Any = None, block_m: Optional[int] = None,
                            threshold: Optional[int] = None, num_sms: Optional[int] = None,
                            src_signals: Any = None, src_signal_expect_value: Optional[int] = None
                            ) -> Tuple[Any, EventOverlap, Optional[Callable[[], None]]]:
        """Low-latency combine (semantics §5): weighted sum of each token's expert outputs. Collective.

        Arguments:
            x: bfloat16 [E_local, R*Tmax, H], the experts' outputs in the rows of the dispatch.
            topk_idx: the [T, K] ids given to the dispatch of `handle` (checked).
            topk_weights: float32 [T, K].
            handle: the LowLatencyHandle of a low_latency_dispatch: combinable any number of times until a later
                dispatch reuses its half (semantics §5; then epmoe.Error 'stale_handle').
            use_logfmt: False; True raises epmoe.Error 'unsupported' (epmoe's combine sends bf16).
            zero_copy: True: combine the slab get_next_low_latency_combine_buffer hands out for this call (on
                GPUs a view into the window; x may then be None, and when given is only checked), as DeepEP
                sends its own buffer; False: combine x. The send reads its input where it is either way (no
                staging copy).
            async_finish: as for low_latency_dispatch (GPU: a CUDA event); excludes return_recv_hook.
            return_recv_hook: only send; the returned hook receives into the result. Call it once. GPU: as
                for low_latency_dispatch (the receive reads topk_idx and topk_weights: the hook keeps them).
            out: optional bfloat16 [T, H] to write into (returned as combined_x).
            combine_wait_recv_cost_stats: optional int64 [R] on x's device: entry s += the nanoseconds the receive
                waited for rank s's rows (as dispatch_wait_recv_cost_stats).
            overlap: send each block of an expert's rows once its producer (the down GEMM) has signalled it done,
                so the combine overlaps the experts (single-batch overlap; docs/semantics.md "Overlapped
                low-latency combine"). False: the signal arguments below are ignored (DeepEP's rule). On a GPU
                the producer's kernels must have run once before (CUDA's lazy module loading), e.g. one forward
                without overlap or CUDA_MODULE_LOADING=EAGER. Two forms:
            packed_recv_count, comp_signal, block_m, threshold: DeepEP's Hopper form (PR #483): comp_signal int32
                [>= E_local * ceil(R*Tmax / block_m)], entry e * ceil(R*Tmax / block_m) + b covering expert e's
                rows [b * block_m, (b + 1) * block_m); the block is sent once the entry is >= threshold (the
                GEMM adds 1 per N-tile stored: threshold = ceil(H / block_n)). packed_recv_count: the dispatch's
                int32 [E_local] (CPU: must equal it). Only blocks holding rows are waited on.
            num_sms: with overlap, the most SMs the GPU send may use (None or 0: one per local expert).
            src_signals, src_signal_expect_value: the per-expert form (fzyzcjy/DeepEP combine_v2): uint32
                [E_local]; expert e's rows are sent once src_signals[e] >= src_signal_expect_value (1..2^32-1).
                The signals are only read; their writer zeroes them between calls. On CPU ranks they are NumPy
                or torch CPU arrays read in place while another thread writes them. A signal that does not
                arrive within the group's timeout raises epmoe.Error 'timeout' naming the rank, the expert, the
                block and the phase (CPU ranks: the peers raise too, and the buffer stays usable). On CPU ranks
                the send runs in this call, so the call returns once every waited-on signal has arrived (with
                return_recv_hook too): run the producer on another thread. num_sms applies to both forms.

        Returns:
            combined_x: bfloat16 [T, H] = sum over k ascending of topk_weights[t,k] * expert output,
                skipping -1, in float32, rounded to bf16 once (valid after the hook when one is returned;
                GPU: once the stream reaches it).
            event: an EventOverlap (a CUDA event with async_finish on the GPU; else complete).
            hook: the receive half with return_recv_hook, else None.

        Errors: epmoe.Error — invalid_argument naming the argument (None or wrong dtype/shape of x, topk_idx,
        topk_weights; a topk_idx other than the dispatch's; a read-only out or statistic; a bad overlap argument:
        both forms, block_m / threshold / num_sms / src_signal_expect_value out of range, a signal's dtype, shape or
        device), stale_handle (the handle's half was reused: semantics §5), unsupported (use_logfmt), timeout (a
        rank or an overlap signal that does not arrive), rank_mismatch (ranks in different calls).
        """
        required("topk_idx", topk_idx)
        required("topk_weights", topk_weights)
        _check_cost_stats("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, self.group_size)
        writable("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats)
        writable("out", out)
        if not zero_copy:
            required("x", x)
        if not isinstance(handle, LowLatencyHandle):
            raise invalid_argument("handle", "the handle returned by low_latency_dispatch", describe(handle))
        if use_logfmt:
            raise unsupported("low_latency_combine(use_logfmt=True): LogFMT is not implemented (epmoe's combine "
                              "sends bf16 rows, exact where LogFMT rounds); pass use_logfmt=False")
        if zero_copy and is_cuda(handle[0]):
            # the runtime sends its window's slab; x (None allowed) is only checked
            if x is None:
                x = self.get_next_low_latency_combine_buffer(handle)
        elif zero_copy:
            # CPU ranks: the slab is Python's own (their window is re-made by a clean, a view would not survive it)
            slab = self._combine_slabs[self._ll_calls % 2]
            shape = self._combine_slab_shape(handle)
            if slab is None:
                raise invalid_argument("zero_copy", "True only after get_next_low_latency_combine_buffer(handle) "
                                       "made the slab of this call's half", "no slab made for it yet")
            # x is optional here; when given it is checked as without zero_copy (shape and dtype), then not read
            if x is not None and (tuple(getattr(x, "shape", ())) != shape or
                                  "bfloat16" not in str(getattr(x, "dtype", ""))):
                raise invalid_argument("x", f"bfloat16 {list(shape)}", describe(x))
            x = slab
            zero_copy = False
        gpu = x is not None and is_cuda(x)
        if out is None and gpu and not async_finish and framework_of(x) == "torch" and \
                getattr(topk_idx, "ndim", 0) == 2 and getattr(x, "ndim", 0) == 3:
            # The output from torch's allocator, as DeepEP's: inside a CUDA-graph capture torch draws it from the
            # graph's private pool, so the graph owns it past the capture.
            import torch
            out = torch.empty((topk_idx.shape[0], x.shape[2]), dtype=torch.bfloat16, device=x.device)
        inputs = (x, topk_idx, topk_weights, out, combine_wait_recv_cost_stats)
        stream = current_stream(*inputs) if gpu else None
        host_wait = gpu and self._host_wait and not return_recv_hook
        # DeepEP's zero_copy means "x is the buffer's own combine slab"; the GPU combine always copies from x.
        # overlap=False: the signal arguments are not looked at (DeepEP's rule), here as in C++.
        signals = ((arg(packed_recv_count), arg(comp_signal), _opt_int32("block_m", block_m),
                    _opt_int32("threshold", threshold), _opt_int32("num_sms", num_sms), arg(src_signals),
                    0 if src_signal_expect_value is None else int64_arg("src_signal_expect_value",
                                                                         src_signal_expect_value))
                   if overlap else (None, None, 0, 0, 0, None, 0))
        if overlap:
            inputs = inputs + (packed_recv_count, comp_signal, src_signals)  # GPU: read by the stream's kernels
        combined, event, hook = self.runtime.low_latency_combine(
            arg(x), arg(topk_idx), arg(topk_weights), handle.native, zero_copy, async_finish or host_wait,
            return_recv_hook, arg(out), framework_of(x), stream, bool(overlap), *signals,
            arg(combine_wait_recv_cost_stats))
        self._ll_calls += 1
        if host_wait:
            event.wait_host()
            if not async_finish:
                event.current_stream_wait(stream)
        if hook is not None and gpu:
            hook = _gpu_recv_hook(hook, inputs, self._host_wait)
        return (out if out is not None else combined), EventOverlap(event, inputs if event.is_cuda else None), hook

    def _combine_slab_shape(self, handle: "LowLatencyHandle") -> Tuple[int, int, int]:
        tmax, hidden, num_experts = handle[2], handle[3], handle[4]
        return (num_experts // self.group_size, self.group_size * tmax, hidden)

    def get_next_low_latency_combine_buffer(self, handle: Tuple) -> Any:
        """The bfloat16 [E_local, R*Tmax, H] slab the next low-latency call, as a combine with ``zero_copy=True``,
        sends: write the experts' outputs into it (in the rows of the handle's dispatch), then call
        ``low_latency_combine(..., zero_copy=True)``. Two slabs alternate with the calls' halves (DeepEP's rule: the
        slab of half n % 2 for call n). On the GPU (a torch handle on CUDA) it is a contiguous view into this rank's
        low-latency window (C++ Buffer::get_next_low_latency_combine_buffer; DeepEP's combine send buffer), valid
        while the buffer lives. On CPU ranks each slab is an array owned by this buffer, made uninitialised on first
        use. Either way no call writes a slab and a clean zeroes both. Errors: epmoe.Error 'invalid_argument' for a handle of
        another kind or buffer, 'unsupported' for CuPy handles on the GPU (CuPy has no bfloat16)."""
        if not isinstance(handle, LowLatencyHandle):
            raise invalid_argument("handle", "the handle returned by low_latency_dispatch", describe(handle))
        shape = self._combine_slab_shape(handle)
        torch_out = framework_of(handle[0]) == "torch"
        device = handle[0].device if torch_out else None
        if is_cuda(handle[0]) and not torch_out:
            raise unsupported("get_next_low_latency_combine_buffer: CuPy has no bfloat16 array; pass any bfloat16 "
                              "array as x to low_latency_combine")
        if is_cuda(handle[0]):
            return self.runtime.next_low_latency_combine_buffer(handle.native, "torch")
        self.runtime.next_low_latency_combine_buffer(handle.native, "numpy")  # checks the handle is this buffer's
        half = self._ll_calls % 2
        slab = self._combine_slabs[half]
        if slab is None or tuple(slab.shape) != shape or (framework_of(slab) == "torch") != torch_out or \
                (torch_out and slab.device != device):
            if torch_out:
                import torch
                slab = torch.empty(shape, dtype=torch.bfloat16, device=device)
            else:
                slab = np.empty(shape, dtype=BFLOAT16)
            self._combine_slabs[half] = slab
        return slab

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Rank masking (DeepEP's shrink mode): not supported (epmoe.Error 'unsupported')."""
        raise unsupported("low_latency_update_mask_buffer: rank masking (enable_shrink) is not supported")

    def low_latency_query_mask_buffer(self, mask_status: Any) -> None:
        """Rank masking (DeepEP's shrink mode): not supported (epmoe.Error 'unsupported')."""
        raise unsupported("low_latency_query_mask_buffer: rank masking (enable_shrink) is not supported")

    def low_latency_clean_mask_buffer(self) -> None:
        """Rank masking (DeepEP's shrink mode): not supported (epmoe.Error 'unsupported')."""
        raise unsupported("low_latency_clean_mask_buffer: rank masking (enable_shrink) is not supported")
