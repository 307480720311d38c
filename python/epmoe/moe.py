"""The modular MoE layer (SPEC 7, 8): prepare/finalize x experts, over the C++ MoELayer.

    pf = epmoe.make_normal_prepare_finalize(buffer, dispatch_dtype="float8_e4m3fn")
    layer = epmoe.MoELayer(pf, epmoe.make_blas_experts())
    out = layer.forward(hidden, w1, w2, topk_weights, topk_idx, activation="silu")

``MoEModule`` (a ``torch.nn.Module`` holding w1/w2) exists only when torch can be imported; torch is
optional and the rest of the package never imports it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

from . import _ext
from ._tensor import arg, framework_of, invalid_argument
from .buffer import Buffer

Experts = _ext.Experts
PrepareFinalize = _ext.PrepareFinalize
WorkspaceCache = _ext.WorkspaceCache

ACTIVATIONS = ("silu", "gelu", "swigluoai", "silu_no_mul", "gelu_no_mul", "relu2_no_mul")


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
    reference to relative L2 1e-2 (SPEC 13). Arguments as make_reference_experts."""
    return _ext.make_blas_experts(activation_format, reduce)


def make_no_ep_prepare_finalize(dispatch_dtype: str = "bfloat16", round_scale: bool = False,
                                use_ue8m0: bool = False) -> PrepareFinalize:
    """One rank, no expert parallelism: prepare only quantizes (dispatch_dtype 'float8_e4m3fn') and
    dequantizes; finalize applies the weight-and-reduce."""
    return _ext.make_no_ep_prepare_finalize(dispatch_dtype, round_scale, use_ue8m0)


def make_normal_prepare_finalize(buffer: Union[Buffer, Any], dispatch_dtype: str = "bfloat16",
                                 round_scale: bool = False, use_ue8m0: bool = False) -> PrepareFinalize:
    """Normal-mode dispatch/combine over `buffer` ('standard' format; experts see one row per
    (token, rank), local ids)."""
    return _ext.make_normal_prepare_finalize(_runtime(buffer), dispatch_dtype, round_scale, use_ue8m0)


def make_low_latency_prepare_finalize(buffer: Union[Buffer, Any], num_max_dispatch_tokens_per_rank: int,
                                      dispatch_dtype: str = "bfloat16", round_scale: bool = False,
                                      use_ue8m0: bool = False) -> PrepareFinalize:
    """Low-latency dispatch/combine over `buffer` ('batched_experts' format, at most
    num_max_dispatch_tokens_per_rank tokens per rank per call; the combine applies the router weights)."""
    return _ext.make_low_latency_prepare_finalize(_runtime(buffer), num_max_dispatch_tokens_per_rank,
                                                  dispatch_dtype, round_scale, use_ue8m0)


class MoELayer:
    """``MoELayer(prepare_finalize, experts, shared_experts=None)`` (SPEC 8).

    Arguments:
        prepare_finalize: from make_*_prepare_finalize.
        experts: from make_reference_experts / make_blas_experts; its activation format must match the
            prepare/finalize's (else epmoe.Error 'invalid_argument' naming both).
        shared_experts: optional callable hidden -> bfloat16 [T, H], run on a side thread overlapped with
            dispatch and combine (it receives a copy of the hidden states).
        chunk_size: standard format: run the experts over chunks of this many rows (0 = one chunk).
        micro_batch: which workspace set to use; workspaces: a WorkspaceCache shared by layers.
    """

    def __init__(self, prepare_finalize: PrepareFinalize, experts: Experts,
                 shared_experts: Optional[Callable[[Any], Any]] = None, chunk_size: int = 0, micro_batch: int = 0,
                 workspaces: Optional[WorkspaceCache] = None) -> None:
        self.prepare_finalize = prepare_finalize
        self.experts = experts
        self.shared_experts = shared_experts
        wrapped = None
        if shared_experts is not None:
            def wrapped(hidden: Any, fn: Callable[[Any], Any] = shared_experts) -> Any:
                return arg(fn(hidden))
        self._layer = _ext.MoELayer(prepare_finalize, experts, wrapped, chunk_size, micro_batch, workspaces)

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
                apply_router_weight_on_input: bool = False) -> Any:
        """Router output in, MoE output out (vLLM's FusedMoEModularKernel.forward). Collective over the
        buffer's ranks.

        Arguments:
            hidden: bfloat16 [T, H].
            w1: bfloat16 [E_local, 2N, H] (gated: silu, gelu, swigluoai) or [E_local, N, H] (*_no_mul).
            w2: bfloat16 [E_local, H, N].
            topk_weights: float32 [T, K]. topk_idx: int64/int32 [T, K], global ids or -1.
            activation: one of ACTIVATIONS (vLLM's definitions, SPEC 7).
            global_num_experts: E; -1 means E_local * ranks.
            expert_map: must be None with expert parallelism (the owner of an expert follows from the rank).
            apply_router_weight_on_input: K == 1 only: scale the input instead of the output.

        Returns: bfloat16 [T, H]; with shared experts a tuple (output, shared_output).
        Errors: epmoe.Error — invalid_argument for bad shapes/dtypes/ids/activation (naming the argument, the
        expected and the actual value). Every argument (w1, w2 included) is checked before any communication, so
        such an error leaves the layer usable. A call that fails after the dispatch started (a timeout, a broken
        group) leaves the ranks out of step: later calls raise 'unusable' naming that failure.
        """
        if global_num_experts is None or global_num_experts < 0:
            e_local = getattr(w1, "shape", (0,))[0]
            global_num_experts = int(e_local) * int(self.prepare_finalize.num_ranks)
        out, shared = self._layer.forward(arg(hidden), arg(w1), arg(w2), arg(topk_weights), arg(topk_idx), activation,
                                          global_num_experts, arg(expert_map), apply_router_weight_on_input,
                                          framework_of(hidden))
        return (out, shared) if self.shared_experts is not None else out

    __call__ = forward


def _make_torch_module() -> Any:
    """MoEModule: a torch.nn.Module over MoELayer, defined only when torch imports."""
    try:
        import torch  # noqa: F401  (optional)
    except ImportError:
        return None

    class MoEModule(torch.nn.Module):
        """A torch.nn.Module holding w1 / w2 and running an epmoe MoELayer on CPU tensors.

        forward(hidden, topk_weights, topk_idx) -> torch.Tensor (bf16 [T, H]). Tensors go through NumPy
        (CPU only: the package's experts, reference and BLAS, run on the CPU). Not differentiable.
        """

        def __init__(self, layer: MoELayer, w1: "torch.Tensor", w2: "torch.Tensor", activation: str = "silu",
                     global_num_experts: int = -1) -> None:
            super().__init__()
            self.layer = layer
            self.w1 = torch.nn.Parameter(w1, requires_grad=False)
            self.w2 = torch.nn.Parameter(w2, requires_grad=False)
            self.activation = activation
            self.global_num_experts = global_num_experts

        @staticmethod
        def _to_numpy(t: "torch.Tensor") -> Any:
            t = t.detach().cpu().contiguous()
            if t.dtype == torch.bfloat16:
                import ml_dtypes
                return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
            return t.numpy()

        def forward(self, hidden: "torch.Tensor", topk_weights: "torch.Tensor", topk_idx: "torch.Tensor") -> Any:
            import numpy as np
            n = self._to_numpy
            out = self.layer.forward(n(hidden), n(self.w1), n(self.w2), n(topk_weights), n(topk_idx),
                                     self.activation, self.global_num_experts)
            if isinstance(out, tuple):
                out = out[0]
            return torch.from_numpy(np.ascontiguousarray(out).view(np.int16)).view(torch.bfloat16)

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
