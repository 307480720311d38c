"""A DeepEP-compatible ``Buffer``: expert-parallel dispatch and combine (SPEC 4, 5).

Argument names, order, defaults and return tuples follow DeepEP's V1 ``deep_ep.Buffer`` (as of
DeepEP commit 567632d), so an engine switches by changing its import::

    from epmoe import Buffer, Config, EventOverlap     # instead of: from deep_ep import ...

Where epmoe's rules are wider or stricter the method docstrings say so. Tensors: NumPy arrays (bf16
and fp8 as ``ml_dtypes.bfloat16`` / ``ml_dtypes.float8_e4m3fn``) on the CPU backends; outputs are
NumPy arrays. Every error is an ``epmoe.Error`` whose message names the argument, what was expected
and what came, raised before any communication.

DeepEP arguments that are accepted but have no effect on the CPU backends: ``num_nvl_bytes``,
``num_qps_per_rank``, ``allow_nvlink_for_low_latency_mode``, ``allow_mnnvl``, ``use_fabric``,
``config``, ``allocate_on_comm_stream``, ``async_finish`` (CPU work is complete on return; the event
is complete), ``previous_event`` (CPU events are complete), ``num_tokens_per_rdma_rank`` (one level of
ranks), ``zero_copy``, ``use_logfmt`` (combine always sends bf16, which is exact where LogFMT rounds),
``dispatch_wait_recv_cost_stats`` / ``combine_wait_recv_cost_stats`` (checked, never updated).

Not supported (epmoe.Error 'unsupported'): ``enable_shrink=True`` and the mask-buffer methods
(rank masking is a fault-tolerance feature of DeepEP's NVSHMEM path), ``comm=`` (mpi4py), a torch
``ProcessGroup`` as ``group`` (comes with the GPU backend), ``get_comm_stream`` and
``get_local_buffer_tensor`` (no streams or registered buffer on CPU).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple, Union

import numpy as np

from . import _ext
from ._group import as_group
from ._tensor import BFLOAT16, arg, describe, framework_of, invalid_argument, unsupported

Event = _ext.Event


class EventOverlap:
    """An event (DeepEP's ``EventOverlap``), for overlapping communication with computation.

    On the CPU backends every operation is complete when it returns, so the event is always complete:
    ``current_stream_wait()`` returns at once and the ``with`` form just runs its body.

    Attributes:
        event: the ``epmoe._ext.Event`` (or None).
        extra_tensors: tensors kept alive with the event (DeepEP uses them instead of record_stream).
    """

    def __init__(self, event: Optional[Event] = None, extra_tensors: Optional[Tuple[Any, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Makes the current stream wait for the event (no-op on CPU)."""
        if self.event is not None:
            self.event.current_stream_wait()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


class Config:
    """Performance tuning of the normal-mode kernels (DeepEP's ``Config``); same constructor.

    The CPU backends accept and ignore it. ``get_nvl_buffer_size_hint`` / ``get_rdma_buffer_size_hint``
    give epmoe's own estimate of the staging bytes such a configuration needs (what engines use to size
    ``num_nvl_bytes`` / ``num_rdma_bytes``); the CPU backends need neither.
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

    It also carries the generation of its call: a handle from two or more low-latency calls ago is
    rejected by ``low_latency_combine`` (epmoe.Error 'stale_handle').
    """

    native: Any

    def __new__(cls, native: Any, src_info: Any, layout_range: Any) -> "LowLatencyHandle":
        obj = super().__new__(cls, (src_info, layout_range, native.num_max_dispatch_tokens_per_rank, native.hidden,
                                    native.num_experts))
        obj.native = native
        return obj


def _event_of(previous_event: Optional[EventOverlap]) -> Optional[Event]:
    return getattr(previous_event, "event", None)


def _check_config(config: Any) -> None:
    if config is not None and not isinstance(config, Config):
        raise invalid_argument("config", "None or an epmoe.Config", f"an object of type {type(config).__name__}")


def _check_cost_stats(name: str, stats: Any, num_ranks: int) -> None:
    """DeepEP's wait-cost statistics: int64 [R, R]. Checked; the CPU backends do not time waits."""
    if stats is None:
        return
    shape = tuple(getattr(stats, "shape", ()))
    if str(getattr(stats, "dtype", "")).replace("torch.", "") != "int64" or shape != (num_ranks, num_ranks):
        raise invalid_argument(name, f"None or int64[{num_ranks}, {num_ranks}]", describe(stats))


class Buffer:
    """Expert-parallel communication buffer of one rank (DeepEP's ``deep_ep.Buffer``, V1 API).

    Normal mode (prefill, training): ``get_dispatch_layout`` -> ``dispatch`` -> experts -> ``combine``.
    Low-latency mode (decode): ``low_latency_dispatch`` -> experts -> ``low_latency_combine``.

    Ordering is deterministic (SPEC 4, 5): received rows are grouped by source rank ascending, in source
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

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm: Any = None) -> None:
        """Creates this rank's buffer. Collective: every rank of the group calls it.

        Arguments:
            group: an ``epmoe.Group`` (from ``epmoe.run_thread_ranks``). A torch ``ProcessGroup`` comes with
                the GPU backend (today: epmoe.Error 'unsupported').
            num_nvl_bytes: normal-mode staging bytes (GPU backends; ignored on CPU). >= 0.
            num_rdma_bytes: low-latency buffer bytes per rank; 0 = sized on the first low-latency call;
                a positive size smaller than ``get_low_latency_rdma_size_hint`` is an error at that call
                (it says how many bytes are needed). >= 0.
            low_latency_mode: whether low-latency calls are intended (accepted; both modes work either way).
            num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric: RDMA / NVSHMEM
                settings of DeepEP; accepted, no effect.
            explicitly_destroy: if True, ``destroy()`` must be called to release the buffer.
            enable_shrink: rank masking; not supported (True raises epmoe.Error 'unsupported').
            comm: an mpi4py communicator instead of `group`; not supported yet.
        """
        native_group = as_group(group, comm)
        if enable_shrink:
            raise unsupported("Buffer(enable_shrink=True): rank masking is not supported")
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if not isinstance(value, (int, np.integer)) or value < 0:
                raise invalid_argument(name, "an int >= 0", repr(value))
        self.rank = native_group.rank()
        self.group_size = native_group.size()
        self.group = group
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.num_rdma_bytes = int(num_rdma_bytes)
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.enable_shrink = False
        self.runtime = _ext.Buffer(native_group, self.num_nvl_bytes, self.num_rdma_bytes, self.low_latency_mode)
        self._combine_scratch: Optional[np.ndarray] = None

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

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream (CPU: already complete)."""
        return EventOverlap(Event())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes per rank the low-latency buffer needs for these settings (both alternating halves,
        fp8 or bf16 payloads). Errors: non-positive sizes, num_experts % num_ranks != 0, more than 1024
        local experts."""
        return _ext.Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                                          num_experts)

    def get_comm_stream(self) -> Any:
        """The communication stream (GPU backends). CPU: epmoe.Error 'unsupported'."""
        raise unsupported("get_comm_stream: the CPU backends have no streams")

    def get_local_buffer_tensor(self, dtype: Any, size: Any = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> Any:
        """The raw registered buffer (GPU backends). CPU: epmoe.Error 'unsupported'."""
        raise unsupported("get_local_buffer_tensor: the CPU backends have no registered buffer to expose")

    @staticmethod
    def _unpack_bias(bias: Any) -> Tuple[Any, Any]:
        if bias is None:
            return None, None
        if isinstance(bias, tuple):
            if len(bias) != 2:
                raise invalid_argument("bias", "None, a tensor or a tuple of two tensors", f"a tuple of {len(bias)}")
            return bias
        return bias, None

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """A dispatch Config for `num_ranks` ranks (any number >= 1; DeepEP only knows a fixed list).
        Ignored by the CPU backends."""
        if not isinstance(num_ranks, (int, np.integer)) or num_ranks < 1:
            raise invalid_argument("num_ranks", "an int >= 1", repr(num_ranks))
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """A combine Config for `num_ranks` ranks (any number >= 1). Ignored by the CPU backends."""
        if not isinstance(num_ranks, (int, np.integer)) or num_ranks < 1:
            raise invalid_argument("num_ranks", "an int >= 1", repr(num_ranks))
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    # ---------------------------------------------------------------- normal mode

    def get_dispatch_layout(self, topk_idx: Any, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False
                            ) -> Tuple[Any, None, Any, Any, EventOverlap]:
        """Where each token goes (SPEC 3). Local: no communication.

        Arguments:
            topk_idx: int64 (or int32) [T, K], global expert ids in [-1, num_experts); -1 = no expert.
            num_experts: E, a positive multiple of the group size, E / R <= 1024.

        Returns:
            num_tokens_per_rank: int32 [R], tokens sent to each rank (a token counts once per rank).
            num_tokens_per_rdma_rank: None (one level of ranks).
            num_tokens_per_expert: int32 [E].
            is_token_in_rank: bool [T, R].
            event: a complete EventOverlap.

        Errors: epmoe.Error('invalid_argument') for a bad dtype/shape, E % R != 0, an id outside [-1, E)
        (naming the first one and its [t, k]).
        """
        per_rank, per_expert, in_rank = self.runtime.get_dispatch_layout(arg(topk_idx), num_experts,
                                                                         framework_of(topk_idx))
        return per_rank, None, per_expert, in_rank, EventOverlap(Event())

    def dispatch(self, x: Union[Any, Tuple[Any, Any]], handle: Optional[Tuple] = None,
                 num_tokens_per_rank: Any = None, num_tokens_per_rdma_rank: Any = None,
                 is_token_in_rank: Any = None, num_tokens_per_expert: Any = None,
                 topk_idx: Any = None, topk_weights: Any = None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False
                 ) -> Tuple[Any, Optional[Any], Optional[Any], Optional[List[int]], Optional[Tuple], EventOverlap]:
        """Normal-mode dispatch (SPEC 4). Collective.

        Arguments:
            x: bfloat16 [T, H] (H % 8 == 0), or a tuple (fp8 x, scales): float8_e4m3fn [T, H] (H % 16 == 0)
                with float32 scales [T, ceil(H/128)] (the last group may be partial; DeepEP needs
                H % 128 == 0) or UE8M0 int32 scales [T, ceil(ceil(H/128)/4)]. Scales travel with their rows.
            handle: a DispatchHandle from an earlier dispatch of this buffer: cached dispatch (moves x only,
                reuses the layout; topk_idx may be given and is then checked against the handle).
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: from get_dispatch_layout
                (required unless `handle` is given; checked against topk_idx).
            num_tokens_per_rdma_rank: ignored (one level of ranks).
            topk_idx: int64/int32 [T, K], K in 1..32 (DeepEP: fixed list), ids in [-1, E).
            topk_weights: float32 [T, K] (optional).
            expert_alignment: >= 1; each local expert's count is rounded up to a multiple of it.
            num_worst_tokens: > 0 pads the outputs to this many rows (padded rows have topk_idx -1) and
                returns an empty count list, as DeepEP does.
            config, previous_event, async_finish, allocate_on_comm_stream: accepted; no effect on CPU.

        Returns:
            recv_x: [Nrecv, H] of x's dtype (a tuple (recv_x, recv_x_scales) for fp8 input). One row per
                (token, destination rank); rows grouped by source rank ascending, source order within.
            recv_topk_idx: int64 [Nrecv, K], local expert ids (global - rank * E_local) or -1 (None for a
                cached dispatch).
            recv_topk_weights: float32 [Nrecv, K], 0 where the id is -1 (None for a cached dispatch).
            num_recv_tokens_per_expert_list: E_local ints, aligned (None for a cached dispatch).
            handle: a DispatchHandle for combine (None for a cached dispatch).
            event: a complete EventOverlap.

        Errors: epmoe.Error — invalid_argument for any bad argument (before any exchange, on this rank);
        rank_mismatch when settings differ across ranks (H, dtype, K, E, alignment; on every rank);
        timeout when a rank does not arrive.
        """
        _check_config(config)
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        native_handle = None
        if handle is not None:
            if not isinstance(handle, DispatchHandle):
                raise invalid_argument("handle", "None or the handle returned by dispatch", describe(handle))
            native_handle = handle.native
        recv_x, recv_scales, recv_idx, recv_w, counts, new_handle, event, arrays = self.runtime.dispatch(
            arg(x), arg(x_scales), arg(topk_idx), arg(topk_weights), arg(num_tokens_per_rank),
            arg(is_token_in_rank), arg(num_tokens_per_expert), native_handle, expert_alignment, num_worst_tokens,
            _event_of(previous_event), async_finish, allocate_on_comm_stream, framework_of(x))
        recv = (recv_x, recv_scales) if x_scales is not None else recv_x
        if handle is not None:
            return recv, None, None, None, None, EventOverlap(event)
        return recv, recv_idx, recv_w, counts, DispatchHandle(new_handle, arrays), EventOverlap(event)

    def combine(self, x: Any, handle: Tuple, topk_weights: Any = None,
                bias: Union[Any, Tuple[Any, Any], None] = None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> Tuple[Any, Optional[Any], EventOverlap]:
        """Normal-mode combine (SPEC 4): sends each received row back and sums per token. Collective.

        Arguments:
            x: bfloat16 [rows, H], one row per row of the dispatch's recv_x (already reduced over the
                token's local experts: combine applies no router weights).
            handle: the DispatchHandle of that dispatch.
            topk_weights: optional float32 [rows, K]; their per-token sum comes back.
            bias: None, a bfloat16 [T, H] or a tuple of two, added after the sum.
            config, previous_event, async_finish, allocate_on_comm_stream: accepted; no effect on CPU.

        Returns:
            combined_x: bfloat16 [T, H] = sum over destination ranks (ascending) in float32, plus the
                biases, rounded to bf16 once (bit-reproducible).
            combined_topk_weights: float32 [T, K] or None.
            event: a complete EventOverlap.

        Errors: epmoe.Error('invalid_argument') for a handle of another buffer, rows != the handle's, bad
        dtypes or shapes (before any exchange).
        """
        _check_config(config)
        if not isinstance(handle, DispatchHandle):
            raise invalid_argument("handle", "the handle returned by dispatch", describe(handle))
        bias_0, bias_1 = Buffer._unpack_bias(bias)
        combined, combined_w, event = self.runtime.combine(
            arg(x), handle.native, arg(topk_weights), arg(bias_0), arg(bias_1), _event_of(previous_event),
            async_finish, allocate_on_comm_stream, framework_of(x))
        return combined, combined_w, EventOverlap(event)

    # DeepEP's explicit internode entry points: one level of ranks here, so they are dispatch/combine.
    internode_dispatch = dispatch
    internode_combine = combine

    # ---------------------------------------------------------------- low-latency mode

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Resets the low-latency buffers (collective). Pending hooks and earlier handles become stale.
        Errors: settings differing from the buffer's first low-latency call."""
        self.runtime.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(self, x: Any, topk_idx: Any, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Any = None, dispatch_wait_recv_cost_stats: Any = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False
                             ) -> Tuple[Any, Any, Tuple, EventOverlap, Optional[Callable[[], None]]]:
        """Low-latency dispatch (SPEC 5). Collective.

        Arguments:
            x: bfloat16 [T, H], T <= num_max_dispatch_tokens_per_rank, H % 16 == 0 with fp8 (any such H,
                the last scale group may be partial; DeepEP: a fixed list of H).
            topk_idx: int64/int32 [T, K], K in 1..16, ids in [-1, E).
            num_max_dispatch_tokens_per_rank: Tmax; with H and E fixed for the buffer's life (until a clean)
                and equal on all ranks (a mismatch is an error on every rank, never a hang).
            num_experts: E.
            cumulative_local_expert_recv_stats: optional int32 [E_local]; each call adds its counts.
            dispatch_wait_recv_cost_stats: optional int64 [R, R]; checked, not updated on CPU.
            use_fp8: quantize to fp8 e4m3 with one float32 scale per 128 channels.
            round_scale: scales rounded up to powers of two. use_ue8m0: UE8M0 scales (needs round_scale).
            async_finish: accepted (CPU: complete on return); excludes return_recv_hook.
            return_recv_hook: only send; the returned hook receives. Call it exactly once.

        Returns:
            recv_x: [E_local, R*Tmax, H] bfloat16, or with use_fp8 a tuple (float8_e4m3fn [E_local, R*Tmax, H],
                scales float32 [E_local, R*Tmax, ceil(H/128)] or int32 [..., ceil(ceil(H/128)/4)] with UE8M0).
                Row-major here (DeepEP's scales are column-major in the last two dims). The first
                recv_count[e] rows of expert e are valid: blocks by ascending source rank, source token
                order within (deterministic; DeepEP leaves block order to arrival). Other rows are
                undefined. On CPU these are copies, valid after the call (or after the hook) for good.
            recv_count: int32 [E_local] (masked_m).
            handle: a LowLatencyHandle for low_latency_combine.
            event: a complete EventOverlap.
            hook: with return_recv_hook, the receive half (fills the outputs above); else None.

        Errors: epmoe.Error — invalid_argument (T > Tmax naming both, K > 16, bad ids, dtypes, shapes,
        use_ue8m0 without round_scale, hook with async_finish), rank_mismatch (Tmax/H/E differ across ranks),
        out_of_memory (num_rdma_bytes too small: says how much is needed), timeout.
        """
        _check_cost_stats("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, self.group_size)
        recv_x, scales, count, src_info, layout_range, native, event, hook = self.runtime.low_latency_dispatch(
            arg(x), arg(topk_idx), None, num_max_dispatch_tokens_per_rank, num_experts,
            arg(cumulative_local_expert_recv_stats), use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook,
            framework_of(x))
        recv = (recv_x, scales) if use_fp8 else recv_x
        return recv, count, LowLatencyHandle(native, src_info, layout_range), EventOverlap(event), hook

    def low_latency_combine(self, x: Any, topk_idx: Any, topk_weights: Any, handle: Tuple, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
                            out: Any = None, combine_wait_recv_cost_stats: Any = None
                            ) -> Tuple[Any, EventOverlap, Optional[Callable[[], None]]]:
        """Low-latency combine (SPEC 5): weighted sum of each token's expert outputs. Collective.

        Arguments:
            x: bfloat16 [E_local, R*Tmax, H], the experts' outputs in the rows of the dispatch.
            topk_idx: the [T, K] ids given to the dispatch of `handle` (checked).
            topk_weights: float32 [T, K].
            handle: the LowLatencyHandle of the low-latency call just before this one (two buffers
                alternate: an older handle raises epmoe.Error 'stale_handle').
            use_logfmt: accepted; epmoe always sends bf16 (exact, where LogFMT rounds).
            zero_copy: accepted (x may be the array of get_next_low_latency_combine_buffer or any other).
            async_finish: accepted (CPU: complete on return); excludes return_recv_hook.
            return_recv_hook: only send; the returned hook receives into the result. Call it once.
            out: optional bfloat16 [T, H] to write into (returned as combined_x).
            combine_wait_recv_cost_stats: optional int64 [R, R]; checked, not updated on CPU.

        Returns:
            combined_x: bfloat16 [T, H] = sum over k ascending of topk_weights[t,k] * expert output,
                skipping -1, in float32, rounded to bf16 once (valid after the hook when one is returned).
            event: a complete EventOverlap.
            hook: the receive half with return_recv_hook, else None.
        """
        _check_cost_stats("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, self.group_size)
        if not isinstance(handle, LowLatencyHandle):
            raise invalid_argument("handle", "the handle returned by low_latency_dispatch", describe(handle))
        combined, event, hook = self.runtime.low_latency_combine(
            arg(x), arg(topk_idx), arg(topk_weights), handle.native, zero_copy, async_finish, return_recv_hook,
            arg(out), framework_of(x))
        return (out if out is not None else combined), EventOverlap(event), hook

    def get_next_low_latency_combine_buffer(self, handle: Tuple) -> Any:
        """A bfloat16 [E_local, R*Tmax, H] array to write the experts' outputs into and pass to
        ``low_latency_combine(..., zero_copy=True)``. On CPU it is a scratch array owned by this buffer
        (reused by later calls with the same shape), not the communication buffer itself."""
        if not isinstance(handle, LowLatencyHandle):
            raise invalid_argument("handle", "the handle returned by low_latency_dispatch", describe(handle))
        tmax, hidden, num_experts = handle[2], handle[3], handle[4]
        shape = (num_experts // self.group_size, self.group_size * tmax, hidden)
        if self._combine_scratch is None or self._combine_scratch.shape != shape:
            self._combine_scratch = np.zeros(shape, dtype=BFLOAT16)
        return self._combine_scratch

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Rank masking (DeepEP's shrink mode): not supported (epmoe.Error 'unsupported')."""
        raise unsupported("low_latency_update_mask_buffer: rank masking (enable_shrink) is not supported")

    def low_latency_query_mask_buffer(self, mask_status: Any) -> None:
        """Rank masking (DeepEP's shrink mode): not supported (epmoe.Error 'unsupported')."""
        raise unsupported("low_latency_query_mask_buffer: rank masking (enable_shrink) is not supported")

    def low_latency_clean_mask_buffer(self) -> None:
        """Rank masking (DeepEP's shrink mode): not supported (epmoe.Error 'unsupported')."""
        raise unsupported("low_latency_clean_mask_buffer: rank masking (enable_shrink) is not supported")
