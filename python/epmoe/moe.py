"""The modular MoE layer (semantics §7, 8): prepare/finalize x experts, over the C++ MoELayer.

    pf = epmoe.make_normal_prepare_finalize(buffer, dispatch_dtype="float8_e4m3fn")
    layer = epmoe.MoELayer(pf, epmoe.make_blas_experts())
    out = layer.forward(hidden, w1, w2, topk_weights, topk_idx, activation="silu")

On a GPU (torch or CuPy CUDA tensors, run asynchronously on the caller's current stream)::

    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_cuda_experts())
    out = layer.forward(hidden_cuda, w1_cuda, w2_cuda, topk_weights_cuda, topk_idx_cuda)

``MoEModule`` (a ``torch.nn.Module`` holding w1/w2) exists only when torch can be imported; torch is
optional and the rest of the package never imports it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple, Union

import numpy as np

from . import _ext
from ._tensor import (arg, describe, device_of, dtype_name, framework_of, int_arg, invalid_argument, on_stream,
                      writable)
from .buffer import Buffer
from .eplb import check_numeric_array

Experts = _ext.Experts
PrepareFinalize = _ext.PrepareFinalize
DispatchHookHandle = _ext.DispatchHookHandle
WorkspaceCache = _ext.WorkspaceCache

ACTIVATIONS = ("silu", "gelu", "swigluoai", "silu_no_mul", "gelu_no_mul", "relu2_no_mul")
DISPATCH_MODES = ("normal", "low_latency", "auto")  # SGLang's DeepEPMode


def resolve_dispatch_mode(mode: str, is_extend_in_batch: bool) -> str:
    """DeepEPMode.resolve: 'auto' -> 'normal' when the batch holds prefill (extend) tokens, else 'low_latency';
    'normal' and 'low_latency' resolve to themselves. Errors: an unknown mode (invalid_argument)."""
    if mode not in DISPATCH_MODES:
        raise invalid_argument("mode", "'normal', 'low_latency' or 'auto'", repr(mode))
    if mode != "auto":
        return mode
    return "normal" if is_extend_in_batch else "low_latency"


def _runtime(buffer: Any) -> Any:
    if isinstance(buffer, Buffer):
        return buffer.runtime
    if isinstance(buffer, _ext.Buffer):
        return buffer
    raise invalid_argument("buffer", "an epmoe.Buffer", f"an object of type {type(buffer).__name__}")


def make_reference_experts(activation_format: str = "standard", reduce: bool = True) -> Experts:
    """Float64 reference experts (exact inputs, double intermediates, one bf16 rounding of the output).
    activation_format: 'standard' ([M, H] + top-k) or 'batched_experts' ([E_local, max_tokens, H] + counts).
    reduce (standard): True -> output [M, H] weighted and summed over k; False -> [M, K, H] unweighted."""
    return _ext.make_reference_experts(activation_format, reduce)


def make_blas_experts(activation_format: str = "standard", reduce: bool = True) -> Experts:
    """Fast CPU experts on OpenBLAS (float32 GEMMs, bf16 intermediates as vLLM's kernels); agree with the
    reference to relative L2 1e-2 (semantics §13). Arguments as make_reference_experts."""
    return _ext.make_blas_experts(activation_format, reduce)


def make_cuda_experts(activation_format: str = "standard", reduce: bool = True, quant: str = "none") -> Experts:
    """The experts on one GPU (cuBLAS GEMMs, bf16 intermediates as vLLM's kernels); agree with the float64
    reference to relative L2 1e-2 (semantics §13; typically ~3e-3). Arguments as make_reference_experts.

    In MoELayer.forward every tensor (hidden, w1, w2, topk_weights, topk_idx, output) is a torch or CuPy CUDA
    tensor on one device; the work is enqueued on the caller's current stream (torch's, else CuPy's) and the
    output is ready when that stream reaches it. Shapes and dtypes as MoELayer.forward (bfloat16 hidden
    [T, H] and weights w1 [E_local, 2N or N, H], w2 [E_local, H, N], contiguous), with H % 8 == 0 and
    N % 8 == 0. 'standard': the per-expert row counts are read on the host, so a forward waits once for the
    stream (and checks the ids then); 'batched_experts': no host synchronisation.
    Pairs with make_no_ep_prepare_finalize (either format), make_normal_prepare_finalize over a cuda_ipc Buffer
    ('standard') and make_low_latency_prepare_finalize over a cuda_ipc Buffer ('batched_experts').

    Errors: epmoe.Error 'invalid_argument' for an unknown activation_format; 'unsupported' in a build without
    CUDA ("epmoe was built without CUDA"; see epmoe.built_with_cuda()); an unknown quant (invalid_argument).

    quant 'fp8_block': DeepSeek-V3's block-scaled fp8 experts (cuBLASLt's block-scaled fp8 GEMMs, Hopper, cuBLAS
    >= 12.9): MoELayer.forward then takes float8_e4m3fn w1 / w2 with float32 w1_scale / w2_scale (one scale per
    128x128 block; see MoELayer.forward), quantizes the activations per 1x128 group (semantics §6) and agrees with
    the float64 model of those quantizations to relative L2 1e-2; H % 16 == 0 and N % 16 == 0."""
    return _ext.make_cuda_experts(activation_format, reduce, quant)


# ---- shared experts on a GPU ----
SharedExperts = _ext.SharedExperts


def make_cuda_shared_experts(w1_shared: Any, w2_shared: Any, activation: str = "silu") -> SharedExperts:
    """Built-in GPU shared experts for MoELayer(shared_experts=...): the dense MLP w2_shared @ act(w1_shared @ x)
    of every token on the CUDA experts (cuBLAS, bf16 in and out, float32 accumulation; no host synchronisation,
    CUDA-graph capturable once the same T ran eagerly), run on the layer's side stream.

    w1_shared: bfloat16 [2N_s, H] (gated activation) or [N_s, H] (*_no_mul); w2_shared: bfloat16 [H, N_s];
    contiguous torch or CuPy CUDA tensors on one GPU (held by the callable), H % 8 == 0 and N_s % 8 == 0.
    The layer's shared_output then views a buffer of the callable's own, overwritten by its next forward (clone it
    to keep it past that). Errors: epmoe.Error 'invalid_argument' naming w1_shared, w2_shared or activation;
    'unsupported' in a build without CUDA."""
    if activation not in ACTIVATIONS:
        raise invalid_argument("activation", f"one of {ACTIVATIONS}", repr(activation))
    return _ext.make_cuda_shared_experts(arg(w1_shared), arg(w2_shared), activation)


def _run_on_side_stream(fn: Callable[[Any], Any], hidden: Any, stream: int) -> Any:
    """fn(hidden) with the layer's side stream (a cudaStream_t handle) as torch's or CuPy's current stream, so the
    work fn enqueues overlaps the dispatch and combine on the caller's stream (the layer orders the two with
    events)."""
    from ._tensor import is_cupy, is_torch
    if is_torch(hidden):
        import torch
        main = torch.cuda.current_stream(hidden.device)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=hidden.device)):
            out = fn(hidden)
        if is_torch(out) and out.device.type == "cuda":
            out.record_stream(main)  # read on the caller's stream: the caching allocator must not reuse it earlier
        return out
    if is_cupy(hidden):
        import cupy
        with cupy.cuda.ExternalStream(stream):
            return fn(hidden)
    return fn(hidden)


def _check_scale_format(round_scale: bool, use_ue8m0: bool) -> None:
    """UE8M0 scales are powers of two: use_ue8m0 needs round_scale (checked when the prepare/finalize is made, not at
    its first forward)."""
    if use_ue8m0 and not round_scale:
        raise invalid_argument("use_ue8m0", "False unless round_scale=True (UE8M0 scales are powers of two)",
                               "True with round_scale=False")


def make_no_ep_prepare_finalize(dispatch_dtype: str = "bfloat16", round_scale: bool = False,
                                use_ue8m0: bool = False, activation_format: str = "standard",
                                max_tokens_per_expert: int = 0) -> PrepareFinalize:
    """One rank, no expert parallelism: prepare only quantizes (dispatch_dtype 'float8_e4m3fn') and
    dequantizes; finalize applies the weight-and-reduce. On CPU tensors, or on CUDA tensors (with
    make_cuda_experts) asynchronously on the current stream.

    activation_format: 'standard' (the tokens as they are) or 'batched_experts' (each (token, k) choice copied
        to a slab [E, max_tokens, H] in token order; pair with experts of that format).
    max_tokens_per_expert: batched_experts only: slab rows; 0 = T (nothing can be dropped). A slab that
        overflows raises epmoe.Error 'out_of_memory' on the CPU; on CUDA the choices past it are dropped and
        flagged (semantics §11). Errors: < 0, or set with 'standard' (invalid_argument); use_ue8m0 without
        round_scale (invalid_argument)."""
    _check_scale_format(round_scale, use_ue8m0)
    max_tokens_per_expert = int_arg("max_tokens_per_expert", max_tokens_per_expert, -(2**63), 2**63 - 1)
    return _ext.make_no_ep_prepare_finalize(dispatch_dtype, round_scale, use_ue8m0, activation_format,
                                            max_tokens_per_expert)


def check_moe_faults(like: Any = None) -> None:
    """Raises what the no-EP MoE layer's CUDA kernels flagged instead of synchronising (semantics §11): an id outside
    [-1, E) that was skipped, or a batched slab that got more choices than max_tokens_per_expert (the rest dropped).

    The kernels record a fault in host-mapped memory of the current CUDA device, also across CUDA-graph replays;
    this call reads and clears it. It returns at once when nothing is flagged; for a bad id it waits for the stream
    to read the id's detail.

    Arguments:
        like: optional CUDA tensor (torch or CuPy): the stream is torch's (or CuPy's) current one on its device;
            None: epmoe's current stream of this thread.
    Errors: epmoe.Error('invalid_argument') naming topk_idx, the bound, the first bad value and its [t, k];
    epmoe.Error('out_of_memory') naming the expert, the choices it got and max_tokens_per_expert. A no-op in builds
    without CUDA.
    """
    with on_stream(like):
        _ext.check_moe_faults()


def make_normal_prepare_finalize(buffer: Union[Buffer, Any], dispatch_dtype: str = "bfloat16",
                                 round_scale: bool = False, use_ue8m0: bool = False) -> PrepareFinalize:
    """Normal-mode dispatch/combine over `buffer` ('standard' format; experts see one row per
    (token, rank), local ids).

    CPU tensors over a threads or MPI Buffer; CUDA tensors (with make_cuda_experts) over a cuda_ipc Buffer on their
    GPU: the layout, the fp8 quantization, the dispatch, the dequantization, the weight-and-reduce and the combine
    then run on that GPU on the current stream (the dispatch waits once on the host for its receive counts).
    Errors: use_ue8m0 without round_scale (invalid_argument)."""
    _check_scale_format(round_scale, use_ue8m0)
    return _ext.make_normal_prepare_finalize(_runtime(buffer), dispatch_dtype, round_scale, use_ue8m0)


def make_all_gather_prepare_finalize(buffer: Union[Buffer, Any], dispatch_dtype: str = "bfloat16",
                                     round_scale: bool = False, use_ue8m0: bool = False) -> PrepareFinalize:
    """The all-gather + reduce-scatter baseline over `buffer`'s group, or over `buffer` itself when it is an
    epmoe.Group (any group: threads, MPI, Group.from_all_gather) (vLLM's naive EP backend; 'standard' format).

    Every rank all-gathers every rank's tokens (bfloat16, or fp8 quantized before the gather and dequantized after),
    top-k ids and weights; its experts run over all R * T_max rows (other ranks' experts' ids -1, padding rows of
    ranks with fewer tokens all -1); the weighted partials [R * T_max, H] are reduce-scattered in float32 in rank order
    (one bfloat16 rounding), so each rank gets its own [T, H] back, bit for bit what normal mode gives on the same
    inputs and experts. Only the group is used (a Buffer's moves nothing here). CUDA tensors (make_cuda_experts): R == 1 stays
    on the GPU; R > 1 is staged through the host on the current stream. Errors (invalid_argument, before any
    communication): use_ue8m0 without round_scale; global_num_experts not a multiple of R; ids outside [-1, E)."""
    _check_scale_format(round_scale, use_ue8m0)
    target = buffer if isinstance(buffer, _ext.Group) else _runtime(buffer)
    return _ext.make_all_gather_prepare_finalize(target, dispatch_dtype, round_scale, use_ue8m0)


def make_low_latency_prepare_finalize(buffer: Union[Buffer, Any], num_max_dispatch_tokens_per_rank: int,
                                      dispatch_dtype: str = "bfloat16", round_scale: bool = False,
                                      use_ue8m0: bool = False) -> PrepareFinalize:
    """Low-latency dispatch/combine over `buffer` ('batched_experts' format, at most
    num_max_dispatch_tokens_per_rank tokens per rank per call; the combine applies the router weights).
    Errors: use_ue8m0 without round_scale, num_max_dispatch_tokens_per_rank not an int (invalid_argument)."""
    _check_scale_format(round_scale, use_ue8m0)
    tmax = int_arg("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, -(2**31), 2**31 - 1)
    return _ext.make_low_latency_prepare_finalize(_runtime(buffer), tmax, dispatch_dtype, round_scale, use_ue8m0)


class MoELayer:
    """``MoELayer(prepare_finalize, experts, shared_experts=None)`` (semantics §8).

    Arguments:
        prepare_finalize: from make_*_prepare_finalize.
        experts: from make_reference_experts / make_blas_experts (CPU tensors) or make_cuda_experts (CUDA
            tensors); its activation format must match the prepare/finalize's (else epmoe.Error
            'invalid_argument' naming both).
        shared_experts: optional callable hidden -> bfloat16 [T, H] beside the routed experts. CPU tensors: run on
            a side thread overlapped with dispatch and combine (it receives a copy of the hidden states). CUDA tensors:
            run on the calling thread under torch.cuda.stream(side_stream) (CuPy: its ExternalStream), the layer's
            side stream, which waits for the caller's stream first; the caller's stream waits for it before forward
            returns (events, no host synchronisation, CUDA-graph capturable), so what the callable enqueues overlaps
            the dispatch, experts and combine. It receives hidden itself (no copy) and must not synchronise with the
            host. Or make_cuda_shared_experts(w1_shared, w2_shared) (CUDA experts only).
        chunk_size: standard format: run the experts over chunks of this many rows (0 = one chunk).
        micro_batch: which workspace set to use (>= 0); workspaces: a WorkspaceCache shared by layers.

    Errors: epmoe.Error('invalid_argument') naming the argument for a prepare_finalize or experts of another
    type (None included), chunk_size < 0, micro_batch < 0.
    """

    def __init__(self, prepare_finalize: PrepareFinalize, experts: Experts,
                 shared_experts: Union[None, SharedExperts, Callable[[Any], Any]] = None, chunk_size: int = 0,
                 micro_batch: int = 0, workspaces: Optional[WorkspaceCache] = None) -> None:
        if not isinstance(prepare_finalize, PrepareFinalize):
            raise invalid_argument("prepare_finalize", "a PrepareFinalize (from make_*_prepare_finalize)",
                                   f"an object of type {type(prepare_finalize).__name__}")
        if not isinstance(experts, Experts):
            raise invalid_argument("experts", "an Experts (from make_*_experts)",
                                   f"an object of type {type(experts).__name__}")
        self.prepare_finalize = prepare_finalize
        self.experts = experts
        self.shared_experts = shared_experts
        chunk_size = int_arg("chunk_size", chunk_size, 0, 2**63 - 1)
        micro_batch = int_arg("micro_batch", micro_batch, 0, 2**31 - 1)
        wrapped: Any = None
        if isinstance(shared_experts, SharedExperts):
            if getattr(experts, "name", None) != "cuda":
                raise invalid_argument("shared_experts", "a callable (make_cuda_shared_experts runs with "
                                       "make_cuda_experts on CUDA tensors)", f"built-in GPU shared experts with "
                                       f"the '{getattr(experts, 'name', '?')}' experts")
            wrapped = shared_experts
        elif shared_experts is not None:
            if not callable(shared_experts):
                raise invalid_argument("shared_experts", "None, a callable hidden -> bfloat16 [T, H], or "
                                       "make_cuda_shared_experts(...)",
                                       f"an object of type {type(shared_experts).__name__}")

            def wrapped(hidden: Any, stream: Optional[int] = None, fn: Callable[[Any], Any] = shared_experts) -> Any:
                out = fn(hidden) if stream is None else _run_on_side_stream(fn, hidden, stream)
                # What the layer returns as shared_output: the same dtype and shape as its input, else named here.
                if dtype_name(out) != dtype_name(hidden) or tuple(getattr(out, "shape", ())) != tuple(hidden.shape):
                    raise invalid_argument("shared_experts", f"a callable returning {describe(hidden)} (bfloat16 "
                                           "[T, H], as its input)", f"{describe(out)} from it")
                return arg(out)
        self._layer = _ext.MoELayer(prepare_finalize, experts, wrapped, chunk_size, micro_batch, workspaces)

    @classmethod
    def from_buffer(cls, buffer: Union[Buffer, Any], num_max_dispatch_tokens_per_rank: int,
                    normal_experts: Optional[Experts] = None, low_latency_experts: Optional[Experts] = None,
                    mode: str = "auto", dispatch_dtype: str = "bfloat16", round_scale: bool = False,
                    use_ue8m0: bool = False, chunk_size: int = 0, micro_batch: int = 0,
                    workspaces: Optional[WorkspaceCache] = None) -> "MoELayer":
        """DeepEP's modes on ONE Buffer (SGLang's DeepEPMode; semantics §8).

        mode 'normal': normal-mode prepare/finalize with normal_experts ('standard' format); 'low_latency':
        low-latency prepare/finalize (at most num_max_dispatch_tokens_per_rank tokens per rank) with
        low_latency_experts ('batched_experts' format); 'auto': both, picked per forward by its
        is_extend_in_batch (True, prefill: normal; False, decode: low_latency; every rank must pass the same).
        On each switch from normal to low_latency the layer first calls the buffer's clean_low_latency_buffer
        (collective), DeepEP's rule for a buffer both modes use. No shared experts.

        Errors (epmoe.Error 'invalid_argument', naming the argument): an unknown mode; a mode's experts None or
        of the other format; num_max_dispatch_tokens_per_rank < 1 where low_latency can be used; experts on
        different devices (one CUDA, one CPU); use_ue8m0 without round_scale."""
        if mode not in DISPATCH_MODES:
            raise invalid_argument("mode", "'normal', 'low_latency' or 'auto'", repr(mode))
        _check_scale_format(round_scale, use_ue8m0)
        tmax = int_arg("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, -(2**31), 2**31 - 1)
        chunk_size = int_arg("chunk_size", chunk_size, -(2**63), 2**63 - 1)
        micro_batch = int_arg("micro_batch", micro_batch, -(2**31), 2**31 - 1)
        used = [e for e, m in ((normal_experts, "normal"), (low_latency_experts, "low_latency"))
                if e is not None and mode in (m, "auto")]
        if len(used) == 2 and (used[0].name == "cuda") != (used[1].name == "cuda"):
            raise invalid_argument("low_latency_experts", f"experts on the device of normal_experts "
                                   f"('{used[0].name}')", f"'{used[1].name}' experts")
        self = cls.__new__(cls)
        self._layer = _ext.MoELayer(_runtime(buffer), mode, tmax, normal_experts, low_latency_experts,
                                    dispatch_dtype, round_scale, use_ue8m0, chunk_size, micro_batch, workspaces)
        self.prepare_finalize = None  # the layer's own two; see dispatch_mode and last_resolved_mode
        self.experts = used[0]
        self.shared_experts = None
        return self

    def register_dispatch_hook(self, hook: Callable[[PrepareFinalize], Any]) -> DispatchHookHandle:
        """Runs hook(prepare_finalize) between dispatch_a and dispatch_b of every forward (stage
        'AFTER_DISPATCH_A'), once per forward whatever chunk_size, after the hooks registered before it, on the
        calling thread. Stays registered until handle.remove(). A hook that raises: the later hooks are skipped,
        the forward still completes its dispatch, experts and combine (so the other ranks and the next forward
        are not left waiting), then the hook's exception propagates unchanged.
        Errors: hook not callable (invalid_argument)."""
        return self._layer.register_dispatch_hook(hook)

    # ---- expert load recorder (semantics §9) ----
    def set_load_recorder(self, recorder: Optional[Any], layer: int = 0) -> None:
        """Attaches an epmoe.ExpertLoadRecorder as layer `layer` of it (a model's layers on one rank share one
        recorder, each with its own index); None detaches. Every later forward records, right after its dispatch,
        the counts of the experts this rank received tokens for (normal: num_recv_tokens_per_expert; low-latency:
        masked_m; no-EP: all E) at this rank's experts [rank * E_local, (rank + 1) * E_local), once per forward
        (in mode 'auto' from whichever half ran). On CUDA that is one kernel on the current stream reading the
        counts on the device: nothing waits, and a CUDA-graph replay of the forward records too. A forward refuses
        a recorder whose num_experts differs from global_num_experts or whose device is not hidden's (epmoe.Error
        'invalid_argument' naming load_recorder, before any communication). Sum the ranks' records with
        recorder.global_loads(group). Errors: layer outside [0, recorder.num_layers) (invalid_argument naming
        layer); recorder not an ExpertLoadRecorder."""
        if recorder is not None and not hasattr(recorder, "_impl"):
            raise invalid_argument("recorder", "an epmoe.ExpertLoadRecorder or None",
                                   f"an object of type {type(recorder).__name__}")
        layer = int_arg("layer", layer, -(2**63), 2**63 - 1)
        self._layer.set_load_recorder(None if recorder is None else recorder._impl, layer)
        self._load_recorder = recorder

    @property
    def load_recorder(self) -> Optional[Any]:
        """The attached ExpertLoadRecorder, or None."""
        return getattr(self, "_load_recorder", None)

    @property
    def load_recorder_layer(self) -> int:
        """The layer index the attached recorder records this layer's forwards under (0 when none)."""
        return int(self._layer.load_recorder_layer)

    @property
    def num_dispatch_hooks(self) -> int:
        """Hooks registered and not removed."""
        return int(self._layer.num_dispatch_hooks)

    @property
    def dispatch_mode(self) -> str:
        """'normal', 'low_latency' or 'auto' (layers made from a prepare/finalize: 'low_latency' for a
        low-latency one, else 'normal')."""
        return self._layer.dispatch_mode

    @property
    def last_resolved_mode(self) -> str:
        """'normal' or 'low_latency': the mode the last forward ran in."""
        return self._layer.last_resolved_mode

    @property
    def num_low_latency_cleans(self) -> int:
        """How many times a forward cleaned the low-latency buffer on a switch from normal."""
        return int(self._layer.num_low_latency_cleans)

    @property
    def last_chunk_rows(self) -> list:
        """Rows of each expert chunk of the last forward."""
        return list(self._layer.last_chunk_rows)

    @property
    def stage(self) -> str:
        """The prepare/finalize stage ('INITIAL' between forwards)."""
        return self._layer.stage

    def forward(self, hidden: Any, w1: Any, w2: Any, topk_weights: Any, topk_idx: Any, activation: str = "silu",
                global_num_experts: int = -1, expert_map: Optional[Any] = None,
                apply_router_weight_on_input: bool = False, output: Optional[Any] = None,
                is_extend_in_batch: Optional[bool] = None, w1_scale: Optional[Any] = None,
                w2_scale: Optional[Any] = None, eplb_plan: Optional[Tuple[Any, Any, Any]] = None,
                eplb_layer: int = 0) -> Any:
        """Router output in, MoE output out (vLLM's FusedMoEModularKernel.forward). Collective over the
        buffer's ranks.

        Arguments:
            hidden: bfloat16 [T, H].
            w1: bfloat16 [E_local, 2N, H] (gated: silu, gelu, swigluoai) or [E_local, N, H] (*_no_mul).
            w2: bfloat16 [E_local, H, N].
            topk_weights: float32 [T, K]. topk_idx: int64/int32 [T, K], global ids or -1.
            activation: one of ACTIVATIONS (vLLM's definitions, semantics §7).
            global_num_experts: E; -1 means E_local * ranks.
            expert_map: optional int32 [E] (E = global_num_experts, P with eplb_plan), on the CPU or hidden's
                device: global -> local expert id, or -1 (vLLM's FusedMoE expert_map, semantics §8). No-EP
                prepare/finalize: which experts this rank holds and their slot in w1/w2 (E_local = w1.shape[0] <= E);
                choices that map to -1 contribute nothing. With expert parallelism it must equal the map the rank
                implies (rank r owns experts [r*E_local, (r+1)*E_local)), else invalid_argument naming expert_map,
                the expected and the actual entry. On CUDA it costs one synchronous copy of E int32.
            eplb_plan: optional (phy2log [L, P], log2phy [L, E, X], logcnt [L, E]) as rebalance_experts returns:
                topk_idx holds logical ids and is mapped to physical slots of layer `eplb_layer` before dispatch
                (map_to_physical's rule; on CUDA a kernel, no synchronisation); w1/w2 then hold this rank's P / R
                physical experts, copies of the logical ones (phy2log), and global_num_experts is E (-1: from the
                plan). The plan stays set on the layer until a forward passes another one or None.
            apply_router_weight_on_input: K == 1 only: scale the input instead of the output.
            output: optional contiguous bfloat16 [T, H] on hidden's device to write the result into (returned
                as the result). On CUDA with a batched no-EP prepare/finalize it makes the call capturable in a CUDA
                graph once the same shapes ran eagerly.
            is_extend_in_batch: whether the batch holds prefill tokens (True) or is decode only (False); required by
                a MoELayer.from_buffer layer in mode 'auto' (same value on every rank), ignored otherwise.
            w1_scale, w2_scale: with make_cuda_experts(quant='fp8_block') only (w1, w2 then float8_e4m3fn): float32
                block scales, one per 128x128 block of each expert's matrix (DeepSeek-V3 / DeepGEMM layout; edge
                blocks partial): w1_scale [E_local, ceil(2N (or N) / 128), ceil(H / 128)], w2_scale [E_local,
                ceil(H / 128), ceil(N / 128)], contiguous, on the weights' device; weight = fp8 * its block's scale.
                None with bf16 weights. A mismatch (fp8 weights without scales, scales with bf16 weights, a wrong
                shape, dtype or device) is invalid_argument naming the argument, before any communication.

        Devices: every tensor on the experts' device: the CPU for the reference and BLAS experts (NumPy with
        ml_dtypes, or torch CPU tensors), one GPU for make_cuda_experts (torch or CuPy CUDA tensors; the work is
        enqueued on the current stream and nothing waits for it, except the 'standard' CUDA experts' one read
        of their row counts). Outputs are made in hidden's framework, on its device.

        Returns: bfloat16 [T, H]; with shared experts a tuple (output, shared_output).
        Errors: epmoe.Error — invalid_argument for bad shapes/dtypes/ids/activation, and for a tensor on another
        device than the experts' (naming the argument, the expected and the actual value). Every argument (w1, w2,
        w1_scale, w2_scale included) is checked before any communication, so such an error leaves the layer usable.
        A call that fails after the dispatch started (a timeout, a broken group) leaves the ranks out of step: later
        calls raise 'unusable' naming that failure. An exception of the shared experts propagates after the routed
        forward completed.
        """
        for name, value in (("hidden", hidden), ("w1", w1), ("w2", w2), ("topk_weights", topk_weights),
                            ("topk_idx", topk_idx)):
            if value is None:
                raise invalid_argument(name, "a tensor", "None")
        writable("output", output)
        if is_extend_in_batch is not None and not isinstance(is_extend_in_batch, bool):
            raise invalid_argument("is_extend_in_batch", "True, False or None",
                                   f"an object of type {type(is_extend_in_batch).__name__}")
        if global_num_experts is not None:
            global_num_experts = int_arg("global_num_experts", global_num_experts, -(2**31), 2**31 - 1)
        self._check_devices(hidden, w1, w2, topk_weights, topk_idx, output, w1_scale, w2_scale)
        # ---- EPLB mapping (semantics §9): set on the C++ layer when the plan or layer changes ----
        eplb_layer = int_arg("eplb_layer", eplb_layer, 0, 2**63 - 1)
        if eplb_plan is None:
            if getattr(self, "_eplb_key", None) is not None:
                self._layer.clear_eplb_plan()
                self._eplb_key = None
        else:
            if not isinstance(eplb_plan, (tuple, list)) or len(eplb_plan) != 3:
                raise invalid_argument("eplb_plan", "(phy2log, log2phy, logcnt) as rebalance_experts returns",
                                       f"an object of type {type(eplb_plan).__name__}")
            phy2log, log2phy, logcnt = (np.asarray(a.cpu() if hasattr(a, "cpu") else a) for a in eplb_plan)
            if phy2log.ndim != 2 or log2phy.ndim != 3 or logcnt.ndim != 2:
                raise invalid_argument("eplb_plan", "phy2log [L, P], log2phy [L, E, X], logcnt [L, E]",
                                       f"shapes {phy2log.shape}, {log2phy.shape}, {logcnt.shape}")
            # integer arrays only: a float plan would be truncated into ids and counts nobody planned
            for name, a in (("phy2log", phy2log), ("log2phy", log2phy), ("logcnt", logcnt)):
                check_numeric_array(f"eplb_plan.{name}", a)
            if eplb_layer >= phy2log.shape[0]:  # named as the caller typed it (the binding's is 'layer')
                raise invalid_argument("eplb_layer", f"a layer of the plan, in [0, {phy2log.shape[0]})", eplb_layer)
            key = (id(eplb_plan), eplb_layer)
            if getattr(self, "_eplb_key", None) != key:
                self._layer.set_eplb_plan(phy2log.astype(np.int64).ravel().tolist(),
                                          log2phy.astype(np.int64).ravel().tolist(),
                                          logcnt.astype(np.int64).ravel().tolist(), phy2log.shape[0],
                                          log2phy.shape[1], phy2log.shape[1], log2phy.shape[2], eplb_layer)
                self._eplb_key = key
                self._eplb_plan_ref = eplb_plan  # keeps id() unique while the key is held
            if global_num_experts is None or global_num_experts < 0:
                global_num_experts = int(log2phy.shape[1])
        if global_num_experts is None or global_num_experts < 0:
            e_local = getattr(w1, "shape", (0,))[0]
            global_num_experts = int(e_local) * int(self._layer.num_ranks)
        with on_stream(hidden):
            result, shared = self._layer.forward(arg(hidden), arg(w1), arg(w2), arg(topk_weights), arg(topk_idx),
                                                 activation, global_num_experts, arg(expert_map),
                                                 apply_router_weight_on_input, arg(output), framework_of(hidden),
                                                 is_extend_in_batch, arg(w1_scale), arg(w2_scale))
        if output is not None:
            result = output  # written in place: hand back the caller's own object
        return (result, shared) if self.shared_experts is not None else result

    __call__ = forward

    def _check_devices(self, hidden: Any, w1: Any, w2: Any, topk_weights: Any, topk_idx: Any, output: Any,
                       w1_scale: Any = None, w2_scale: Any = None) -> None:
        """Every tensor on the experts' device, checked before any work: the C++ layer would otherwise find some
        mismatches only after its prepare step ran (leaving the layer unusable) or read device memory on the
        host."""
        if hidden is None:
            return  # the C++ check names it
        name = self.experts.name
        on_gpu = name == "cuda"
        where = device_of(hidden)
        if on_gpu and not where.startswith("cuda:"):
            raise invalid_argument("hidden", f"a CUDA tensor (the '{name}' experts run on a GPU)",
                                   f"{describe(hidden)} on {where}")
        if not on_gpu and where != "cpu":
            raise invalid_argument("hidden", f"a CPU tensor (the '{name}' experts run on the CPU; "
                                   "epmoe.make_cuda_experts runs on a GPU)", f"{describe(hidden)} on {where}")
        for arg_name, t in (("w1", w1), ("w2", w2), ("topk_weights", topk_weights), ("topk_idx", topk_idx),
                            ("output", output), ("w1_scale", w1_scale), ("w2_scale", w2_scale)):
            if t is not None and device_of(t) != where:
                raise invalid_argument(arg_name, f"a tensor on {where} (hidden's device, where the '{name}' experts "
                                       "run)", f"{describe(t)} on {device_of(t)}")


def _make_torch_module() -> Any:
    """MoEModule: a torch.nn.Module over MoELayer, defined only when torch imports."""
    try:
        import torch  # noqa: F401  (optional)
    except ImportError:
        return None

    class MoEModule(torch.nn.Module):
        """A torch.nn.Module holding w1 / w2 (bf16 parameters, no grad) and running an epmoe MoELayer.

        forward(hidden, topk_weights, topk_idx) -> torch.Tensor (bf16 [T, H], on hidden's device). The tensors
        go to the layer as they are (DLPack, no copy), so they must be where its experts run: on the CPU for the
        reference and BLAS experts, on a GPU for make_cuda_experts, after ``.to('cuda')`` / ``.cuda()`` (which
        moves w1 and w2); CUDA work runs on torch's current stream. A tensor on the wrong device raises
        epmoe.Error 'invalid_argument' naming it. Not differentiable.
        """

        def __init__(self, layer: MoELayer, w1: "torch.Tensor", w2: "torch.Tensor", activation: str = "silu",
                     global_num_experts: int = -1) -> None:
            super().__init__()
            self.layer = layer
            self.w1 = torch.nn.Parameter(w1, requires_grad=False)
            self.w2 = torch.nn.Parameter(w2, requires_grad=False)
            self.activation = activation
            self.global_num_experts = global_num_experts

        def forward(self, hidden: "torch.Tensor", topk_weights: "torch.Tensor", topk_idx: "torch.Tensor") -> Any:
            c = torch.Tensor.contiguous  # the layer reads contiguous rows (a no-op for most callers)
            out = self.layer.forward(c(hidden), c(self.w1), c(self.w2), c(topk_weights), c(topk_idx),
                                     self.activation, self.global_num_experts)
            return out[0] if isinstance(out, tuple) else out

    return MoEModule


_torch_module: Any = None


def __getattr__(name: str) -> Any:
    # MoEModule is made on first use, so importing epmoe never imports torch.
    global _torch_module
    if name == "MoEModule":
        if _torch_module is None:
            _torch_module = _make_torch_module()
        if _torch_module is None:
            raise AttributeError("epmoe.MoEModule needs torch, which is not installed")
        return _torch_module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
