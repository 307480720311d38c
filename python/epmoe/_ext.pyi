"""Type stubs of epmoe._ext, the nanobind extension under the `epmoe` package.

Use the `epmoe` package; these functions take tensors in the boundary form of epmoe/_tensor.py:
``None``, an array (NumPy int/float/bool, or a DLPack tensor such as torch.Tensor or cupy.ndarray, on
the CPU or a CUDA device), or for ml_dtypes arrays and torch float8 a tuple ``(same-width unsigned view,
"bfloat16" | "float8_e4m3fn")``. Outputs are NumPy arrays (``framework="numpy"``; bf16 / fp8 come back
as ml_dtypes arrays), torch tensors (``framework="torch"``; float8 as torch.float8_e4m3fn) or CuPy arrays
(``framework="cupy"``), sharing memory with epmoe's result (no copy), on the inputs' device.
``stream`` arguments are a cudaStream_t as an int (``torch.cuda.current_stream().cuda_stream``), None for
the legacy default stream; GPU work is ordered after it. Every function raises :class:`Error`; for bad
arguments the message names the argument, what was expected and what came, and nothing has been
communicated yet.
"""

from typing import Any, Callable, List, Optional, Sequence, Tuple, Union, overload

ArrayArg = Any  # None | array | (array, dtype name)
Array = Any     # numpy.ndarray, torch.Tensor (framework="torch") or cupy.ndarray (framework="cupy")

class Error(RuntimeError):
    """Every failure epmoe reports. ``str(e)``: the C++ message ("epmoe: invalid argument 'x': expected
    bfloat16[4, 128], got float32[4, 128]"). ``code``: 'invalid_argument', 'rank_mismatch', 'timeout',
    'stale_handle', 'unusable', 'out_of_memory', 'unsupported' or 'internal'."""
    code: str

def version() -> str:
    """'MAJOR.MINOR.PATCH' of the C++ library."""
def built_with_cuda() -> bool:
    """Whether the CUDA implementations were compiled in."""
def cuda_device_count() -> int:
    """Visible CUDA devices (0 in CPU-only builds)."""
def register_torch(tensor_type: type, strided: Any, dtypes: Sequence[Tuple[Any, str]],
                   slow_arg: Callable[[Any], Any], from_dlpack: Optional[Callable[[Any], Any]]) -> None:
    """Hands over torch.Tensor, torch.strided, the (torch dtype, epmoe dtype name) pairs read directly, the
    function giving any other torch tensor's DLPack form, and torch._C._from_dlpack or None (epmoe/_tensor.py calls
    it once torch is imported): a torch.Tensor argument is then read from its attributes (pointer, shape, strides,
    dtype, device), and torch outputs are made from a DLPack capsule directly."""
has_mpi: bool
def default_timeout_s() -> float:
    """Timeout of every wait between ranks, seconds (EPMOE_TIMEOUT_S overrides 100)."""

class Group:
    """The ranks of one expert-parallel group: threads (run_thread_ranks), or over another runtime's
    all-gather (from_all_gather: torch.distributed, mpi4py)."""
    timeout_s: float
    """Timeout of this group's waits, seconds (> 0)."""
    @property
    def backend(self) -> str:
        """'threads', 'mpi', or the name given to from_all_gather ('torch', 'mpi4py')."""
    def rank(self) -> int: ...
    def size(self) -> int: ...
    def barrier(self, phase: str = "python barrier") -> None:
        """Waits for every rank (GIL released). Errors: timeout naming the missing ranks and the phase."""
    def all_gather_bytes(self, data: bytes, phase: str = "python all_gather_bytes") -> List[bytes]:
        """Every rank's bytes, by rank (lengths may differ). Collective."""
    def broadcast_bytes(self, data: bytes, root: int, phase: str = "python broadcast_bytes") -> bytes:
        """`root`'s data on every rank (every rank passes the same length). Errors: root outside [0, size)."""
    def check_agreement(self, settings: List[Tuple[str, int]], phase: str = "python check_agreement") -> None:
        """Compares the (name, value) settings across ranks (same names and order everywhere, at most 16);
        a mismatch raises Error 'rank_mismatch' on every rank naming the setting and both values."""
    @staticmethod
    def from_all_gather(rank: int, size: int, backend: str, all_gather: Callable[[bytes, str], bytes]) -> "Group":
        """A group whose every collective calls ``all_gather(data, phase)``, which must return all ranks'
        `data` concatenated by rank (each rank passes the same length); called with the GIL held from
        whichever thread runs the collective. A Python exception or a result of the wrong length raises
        Error 'internal' naming the rank and phase, and the group is 'unusable' afterwards. Errors:
        size < 1, rank outside [0, size), backend '', 'threads' or 'mpi'."""

def run_thread_ranks(num_ranks: int, fn: Callable[[Group], Any], timeout_s: Optional[float] = None) -> List[Any]:
    """fn(group) on num_ranks threads of one threads-backend group; returns the results by rank and
    re-raises the first failing rank's exception, the root cause before the timeouts and 'unusable' errors it caused,
    as the same object naming that rank ("rank 1: ..." in its message, or a note; see epmoe.run_thread_ranks).
    Errors: num_ranks < 1,
    timeout_s <= 0."""

class Event:
    """Completion of an operation: a CUDA event of a cuda_ipc buffer (async_finish=True), else complete."""
    def __init__(self) -> None: ...
    def done(self) -> bool: ...
    @property
    def is_cuda(self) -> bool:
        """True for a CUDA event (of the cuda_ipc backend)."""
    def current_stream_wait(self, stream: Optional[int] = None) -> None:
        """Makes `stream` wait for the event on the device (no host wait); no-op for a complete event."""
    def wait_host(self) -> None:
        """Blocks the host until the event completes, with the GIL released."""

class NormalHandle:
    """What combine and a cached dispatch need (opaque; epmoe.DispatchHandle wraps it)."""
    num_tokens: int
    num_recv_tokens: int
    num_recv_rows: int
    hidden: int
    num_experts: int
    expert_alignment: int
    num_worst_tokens: int

class LowLatencyHandle:
    """What low_latency_combine needs (opaque; epmoe.LowLatencyHandle wraps it). `generation` is the
    index of the low-latency call that made it (two-buffer rule)."""
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    generation: int

class RecvHook:
    """Receive half of a low-latency call. Call exactly once (again: Error 'stale_handle'). On a GPU buffer
    the receive kernel is enqueued on `stream` (cudaStream_t as an int; None: the legacy default stream)."""
    def __call__(self, stream: Optional[int] = None) -> None: ...

class Buffer:
    """epmoe::Buffer of one rank. Every method that communicates releases the GIL."""
    def __init__(self, group: Group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, backend: str = "auto", device: int = -1, num_sms: int = 0) -> None:
        """backend: 'auto' (the group's CPU backend), 'threads', 'mpi' or 'cuda_ipc' (both modes over
        NVLink; num_nvl_bytes > 0, or 0 with low_latency_mode for a low-latency-only buffer; device -1 = rank %
        visible devices; num_sms: blocks per data kernel, 0 = 24, at most 64). Collective. Errors:
        invalid_argument, unsupported (no CUDA in this build), rank_mismatch (num_nvl_bytes / num_sms differ),
        out_of_memory."""
    def rank(self) -> int: ...
    def num_ranks(self) -> int: ...
    def destroy(self) -> None:
        """Drops the C++ buffer; later calls raise Error 'unusable'."""
    @staticmethod
    def get_normal_nvl_size_hint(max_tokens_per_rank: int, hidden: int, num_ranks: int, num_topk: int) -> int:
        """num_nvl_bytes a cuda_ipc buffer needs for normal-mode calls of up to max_tokens_per_rank tokens."""
    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Low-latency buffer bytes per rank (both halves)."""
    def get_dispatch_layout(self, topk_idx: ArrayArg, num_experts: int, framework: str = "numpy",
                            stream: Optional[int] = None) -> Tuple[Array, Array, Array]:
        """(num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E], is_token_in_rank bool [T, R])."""
    def dispatch(self, x: ArrayArg, x_scales: ArrayArg, topk_idx: ArrayArg, topk_weights: ArrayArg,
                 num_tokens_per_rank: ArrayArg, is_token_in_rank: ArrayArg, num_tokens_per_expert: ArrayArg,
                 handle: Optional[NormalHandle], expert_alignment: int = 1, num_worst_tokens: int = 0,
                 previous_event: Optional[Event] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False, framework: str = "numpy", stream: Optional[int] = None
                 ) -> Tuple[Array, Optional[Array], Optional[Array], Optional[Array], List[int], NormalHandle, Event,
                            Tuple[Array, Array, Array, Array]]:
        """Normal-mode dispatch (semantics §4): (recv_x [rows, H], recv_x_scales or None, recv_topk_idx int64
        [rows, K] or None (cached), recv_topk_weights float32 [rows, K] or None, counts per local expert,
        handle, event, (rank_prefix_matrix int32 [R, R], recv_src_idx int32 [Nrecv], is_token_in_rank bool
        [T, R], send_pos int32 [T, R]))."""
    def combine(self, x: ArrayArg, handle: Optional[NormalHandle], topk_weights: ArrayArg, bias_0: ArrayArg,
                bias_1: ArrayArg, previous_event: Optional[Event] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False, framework: str = "numpy", stream: Optional[int] = None
                ) -> Tuple[Array, Optional[Array], Event]:
        """Normal-mode combine (semantics §4): (combined_x bfloat16 [T, H], combined_topk_weights float32 [T, K]
        or None, event)."""
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Collective reset of the low-latency buffers; older handles and pending hooks become stale."""
    def low_latency_dispatch(self, x: ArrayArg, topk_idx: ArrayArg, topk_weights: ArrayArg,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: ArrayArg, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False, framework: str = "numpy", stream: Optional[int] = None,
                             use_nvfp4: bool = False, x_global_scale: ArrayArg = None
                             ) -> Tuple[Array, Optional[Array], Array, Array, Array, LowLatencyHandle, Event,
                                        Optional[RecvHook]]:
        """Low-latency dispatch (semantics §5): (packed_recv_x [E_local, R*Tmax, H] fp8 or bf16 (nvfp4: uint8
        [E_local, R*Tmax, H/2], scales float8_e4m3fn [E_local, ceil(R*Tmax/128), H/64*512] swizzled), scales
        float32 [E_local, R*Tmax, G] / int32 [..., ceil(G/4)] or None, packed_recv_count int32 [E_local],
        src_info int32 [E_local, R*Tmax], layout_range int64 [E_local, R], handle, event, hook or None).
        CPU: the arrays are copies of the valid rows, filled at return or when the hook is called. GPU (cuda_ipc,
        CUDA tensors; work on `stream`): views of the buffer's receive half, filled on the stream, valid until
        a later low-latency dispatch reuses that half (DeepEP's alternation, semantics §5)."""
    def low_latency_combine(self, x: ArrayArg, topk_idx: ArrayArg, topk_weights: ArrayArg,
                            handle: LowLatencyHandle, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: ArrayArg = None, framework: str = "numpy",
                            stream: Optional[int] = None, overlap: bool = False, packed_recv_count: ArrayArg = None,
                            comp_signal: ArrayArg = None, block_m: int = 0, threshold: int = 0, num_sms: int = 0,
                            src_signals: ArrayArg = None, src_signal_expect_value: int = 0
                            ) -> Tuple[Optional[Array], Event, Optional[RecvHook]]:
        """Low-latency combine (semantics §5): (combined_x bfloat16 [T, H], or None when `out` was given and
        written, event, hook or None). overlap and the signal arguments: LowLatencyCombineArgs (buffer.hpp) and
        docs/semantics.md "Overlapped low-latency combine"."""

def topk_softmax(logits: ArrayArg, num_topk: int, renormalize: bool = False,
                 framework: str = "numpy") -> Tuple[Array, Array]:
    """(topk_weights float32 [T, K], topk_idx int64 [T, K]) of softmax(logits) (semantics §2)."""
def topk_sigmoid(logits: ArrayArg, num_topk: int, renormalize: bool = False,
                 framework: str = "numpy") -> Tuple[Array, Array]:
    """(topk_weights float32 [T, K], topk_idx int64 [T, K]) of sigmoid(logits) (semantics §2)."""
def grouped_topk(logits: ArrayArg, num_topk: int, num_expert_group: int, topk_group: int,
                 scoring_func: str = "softmax", renormalize: bool = True, routed_scaling_factor: float = 1.0,
                 e_score_correction_bias: ArrayArg = None, framework: str = "numpy") -> Tuple[Array, Array]:
    """DeepSeek-V2/V3 grouped top-k (semantics §2)."""
def check_invalid_ids() -> None: ...
def check_moe_faults() -> None: ...
def get_dispatch_layout(topk_idx: ArrayArg, num_experts: int, num_ranks: int,
                        framework: str = "numpy") -> Tuple[Array, Array, Array]:
    """(num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E], is_token_in_rank bool [T, R])."""
def quantize_fp8(x: ArrayArg, round_scale: bool = False, use_ue8m0: bool = False, scale_layout: str = "row_major",
                 framework: str = "numpy") -> Tuple[Array, Array]:
    """(q float8_e4m3fn [T, H], scales float32 [T, ceil(H/128)] or UE8M0 int32 [T, ceil(ceil(H/128)/4)]),
    scales row-major or column-major (strides (1, T rounded up to 4))."""
def dequantize_fp8(q: ArrayArg, scales: ArrayArg, out_dtype: str = "bfloat16", framework: str = "numpy") -> Array:
    """q * scale per group as 'bfloat16' or 'float32' [T, H]."""
def quantize_nvfp4(x: ArrayArg, global_scale: ArrayArg, scale_layout: str = "swizzled",
                   framework: str = "numpy") -> Tuple[Array, Array]:
    """(q uint8 [T, H/2], scales float8_e4m3fn: swizzled [ceil(T/128), (H/64)*512] or linear [T, H/16])."""
def dequantize_nvfp4(q: ArrayArg, scales: ArrayArg, global_scale: ArrayArg, scale_layout: str = "swizzled",
                     out_dtype: str = "bfloat16", framework: str = "numpy") -> Array:
    """e2m1 value * (scale / global_scale) as 'bfloat16' or 'float32' [T, H]."""
def fp8_group_scale(amax: float, round_scale: bool = False) -> float: ...
def ue8m0_from_scale(pow2_scale: float) -> int: ...
def ue8m0_to_scale(byte: int) -> float: ...

class Experts:
    """Expert MLPs: name 'reference' or 'blas' (CPU), 'cuda' (one GPU)."""
    @property
    def name(self) -> str: ...
    @property
    def activation_format(self) -> str:
        """'standard' or 'batched_experts'."""
    @property
    def weight_and_reduce(self) -> str:
        """'none', 'contiguous', 'naive_batched' or 'delegate'."""

def make_reference_experts(activation_format: str = "standard", reduce: bool = True) -> Experts: ...
def make_blas_experts(activation_format: str = "standard", reduce: bool = True) -> Experts: ...
def make_cuda_experts(activation_format: str = "standard", reduce: bool = True, quant: str = "none") -> Experts:
    """quant 'none' (bf16 weights) or 'fp8_block'. Errors: unsupported in a build without CUDA."""

class SharedExperts:
    """Built-in GPU shared experts (make_cuda_shared_experts)."""

def make_cuda_shared_experts(w1_shared: ArrayArg, w2_shared: ArrayArg, activation: str = "silu") -> SharedExperts:
    """A dense MLP on the CUDA experts. Errors: invalid_argument naming w1_shared / w2_shared / activation;
    unsupported in a build without CUDA."""

class PrepareFinalize:
    """Quantize + dispatch and combine (no_ep, normal or low_latency)."""
    num_ranks: int
    @property
    def name(self) -> str: ...
    @property
    def activation_format(self) -> str: ...
    @property
    def stage(self) -> str:
        """'INITIAL', 'AFTER_DISPATCH_A', 'AFTER_DISPATCH_B' or 'AFTER_COMBINE_A'."""

def make_no_ep_prepare_finalize(dispatch_dtype: str = "bfloat16", round_scale: bool = False,
                                use_ue8m0: bool = False, activation_format: str = "standard",
                                max_tokens_per_expert: int = 0) -> PrepareFinalize: ...
@overload
def make_all_gather_prepare_finalize(buffer: Buffer, dispatch_dtype: str = "bfloat16", round_scale: bool = False,
                                     use_ue8m0: bool = False) -> PrepareFinalize: ...
@overload
def make_all_gather_prepare_finalize(group: Group, dispatch_dtype: str = "bfloat16", round_scale: bool = False,
                                     use_ue8m0: bool = False) -> PrepareFinalize: ...
def make_normal_prepare_finalize(buffer: Buffer, dispatch_dtype: str = "bfloat16", round_scale: bool = False,
                                 use_ue8m0: bool = False) -> PrepareFinalize: ...
def make_low_latency_prepare_finalize(buffer: Buffer, num_max_dispatch_tokens_per_rank: int,
                                      dispatch_dtype: str = "bfloat16", round_scale: bool = False,
                                      use_ue8m0: bool = False) -> PrepareFinalize: ...

class WorkspaceCache:
    """Workspaces shared by the layers of a model."""
    def __init__(self) -> None: ...
    def bytes(self) -> int: ...

class DispatchHookHandle:
    """One registration of MoELayer.register_dispatch_hook."""
    def remove(self) -> None:
        """Unregisters the hook (a no-op once removed)."""
    @property
    def active(self) -> bool: ...

class MoELayer:
    """The C++ MoELayer (use epmoe.MoELayer)."""
    num_ranks: int
    has_shared_experts: bool
    @overload
    def __init__(self, prepare_finalize: PrepareFinalize, experts: Experts,
                 shared_experts: Union[None, SharedExperts, Callable[..., ArrayArg]] = None, chunk_size: int = 0,
                 micro_batch: int = 0, workspaces: Optional[WorkspaceCache] = None,
                 framework: str = "numpy") -> None:
        """Errors: a prepare/finalize whose activation format differs from the experts' (names both)."""
    @overload
    def __init__(self, buffer: Buffer, mode: str, num_max_dispatch_tokens_per_rank: int,
                 normal_experts: Optional[Experts], low_latency_experts: Optional[Experts],
                 dispatch_dtype: str = "bfloat16", round_scale: bool = False, use_ue8m0: bool = False,
                 chunk_size: int = 0, micro_batch: int = 0, workspaces: Optional[WorkspaceCache] = None) -> None:
        """DeepEP's modes ('normal', 'low_latency', 'auto') on one Buffer. Errors: an unknown mode, a mode's
        experts missing or of the other format, num_max_dispatch_tokens_per_rank < 1 (invalid_argument)."""
    def forward(self, hidden: ArrayArg, w1: ArrayArg, w2: ArrayArg, topk_weights: ArrayArg, topk_idx: ArrayArg,
                activation: str = "silu", global_num_experts: int = 0, expert_map: ArrayArg = None,
                apply_router_weight_on_input: bool = False, output: ArrayArg = None,
                framework: str = "numpy", is_extend_in_batch: Optional[bool] = None, w1_scale: ArrayArg = None,
                w2_scale: ArrayArg = None) -> Tuple[Array, Optional[Array]]:
        """(output bfloat16 [T, H], shared_output bfloat16 [T, H] or None). Collective."""
    def set_eplb_plan(self, physical_to_logical: Sequence[int], logical_to_physical: Sequence[int],
                      logical_replica_count: Sequence[int], num_layers: int, num_logical_experts: int,
                      num_physical_experts: int, max_replicas: int, layer: int) -> None:
        """Later forwards map topk_idx (logical ids) to physical slots of `layer` of the plan (flattened
        row-major [L, P], [L, E, X], [L, E]) before dispatch (semantics §9). Errors name 'plan' or 'layer'."""
    def clear_eplb_plan(self) -> None: ...
    @property
    def eplb_layer(self) -> int:
        """The layer of the plan set, -1 when none."""
    def register_dispatch_hook(self, hook: Callable[[PrepareFinalize], Any]) -> DispatchHookHandle:
        """Runs hook(prepare_finalize) between dispatch_a and dispatch_b of every forward."""
    @property
    def num_dispatch_hooks(self) -> int: ...
    @property
    def dispatch_mode(self) -> str: ...
    @property
    def last_resolved_mode(self) -> str: ...
    @property
    def num_low_latency_cleans(self) -> int: ...
    @property
    def prepare_finalize(self) -> PrepareFinalize: ...
    @property
    def last_chunk_rows(self) -> List[int]: ...
    @property
    def stage(self) -> str: ...
    # ---- expert load recorder (semantics §9) ----
    def set_load_recorder(self, recorder: Optional[ExpertLoadRecorder], layer: int) -> None:
        """Records every forward's received counts per expert into `recorder` as layer `layer`; None detaches."""
    @property
    def load_recorder_layer(self) -> int: ...

def set_current_stream(stream: Optional[int]) -> Optional[int]:
    """Sets the calling thread's current CUDA stream for epmoe's functions (cudaStream_t as an int; None:
    the legacy default stream); returns the previous one (None for the default)."""

# Expert load statistics and EPLB (semantics §9): the planner on the host, the recorder on the host or a GPU.
def rebalance_experts(weight: Any, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> Tuple[Any, Any, Any]:
    """DeepSeek's EPLB on a C-contiguous float64 [L, E] NumPy array: (phy2log int64 [L, P], log2phy int64
    [L, E, X] padded with -1, logcnt int64 [L, E]) as NumPy arrays."""
def map_to_physical(topk_idx: ArrayArg, logical_to_physical: Any, logical_replica_count: Any, layer: int,
                    framework: str = "numpy") -> Array:
    """Physical slot ids [T, K] (topk_idx's dtype) of logical ids; replica t mod count; -1 kept. The maps are
    C-contiguous int64 NumPy arrays [L, E, X] and [L, E]."""

def load_balancedness(loads: Any, num_ranks: int) -> Any:
    """float64 [L] NumPy array: mean / max load per rank of C-contiguous int64 [L, E] loads."""

class ExpertLoadRecorder:
    """Tokens per (layer, expert) over a window (use epmoe.ExpertLoadRecorder)."""
    num_layers: int
    num_experts: int
    num_ranks: int
    window: int
    device: str
    def __init__(self, num_layers: int, num_experts: int, num_ranks: int, window: int, device: int = -1) -> None:
        """device: -1 for the CPU, else the CUDA device index."""
    def record(self, layer: int, num_tokens_per_expert: ArrayArg) -> None:
        """Adds int32/int64 [E] counts on the recorder's device for `layer`."""
    def record_local(self, layer: int, num_recv_tokens_per_expert: ArrayArg, expert_offset: int) -> None:
        """Adds int32/int64 [n] counts for experts [expert_offset, expert_offset + n), zeros elsewhere."""
    def global_loads(self, group: Group) -> Any:
        """int64 [L, E] NumPy array: the sum of every rank's loads (collective)."""
    def loads(self) -> Any:
        """int64 [L, E] NumPy array."""
    def balancedness(self) -> Any:
        """float64 [L] NumPy array: mean / max load per rank."""
    def num_records(self) -> Any:
        """int64 [L] NumPy array."""
    def to_json(self, group: Optional[Group] = None) -> str: ...
    def reset(self) -> None: ...

# Builds with MPI only (has_mpi):
def mpi_library_version() -> str:
    """MPI_Get_library_version() of the MPI library this extension links (callable before MPI_Init)."""
def mpi_group_from_fortran(fortran_handle: int) -> Group:
    """epmoe's native MPI Group (backend 'mpi') over the communicator with this Fortran handle (mpi4py:
    comm.py2f()); collective. Only valid when the caller uses the same MPI library (epmoe.as_group checks)."""
