"""Normal-mode scenarios shared by the torch tests (CPU thread ranks) and the GPU tests (one process per GPU).

A scenario is a Case (sizes and options) plus a seed. ``make_inputs`` draws every rank's inputs as NumPy
arrays from the seed alone, so every process of a multi-process test holds all ranks' inputs.
``reference_outputs`` runs them through epmoe's threads backend on NumPy arrays (itself tested against
the NumPy references of conftest.py in test_buffer_normal.py); ``run_rank`` runs one rank's call sequence
through any Buffer in any framework (``to_fw`` converts NumPy arrays in, ``to_np`` converts outputs back),
and ``assert_same`` compares the two bit for bit. The call sequence (what the C++ GPU tests of
tests/gpu/cuda_ipc_normal_test.cpp do): layout, dispatch, a stand-in expert ((rank + 1) * rows in bf16),
combine with the dispatch's weights and biases, and optionally a cached dispatch of fresh rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence

import ml_dtypes
import numpy as np

import epmoe

BF16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn
GROUP = 128


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    T: Sequence[int] = (24, 17)  # tokens of each rank (len = number of ranks)
    H: int = 256
    K: int = 4
    E: int = 16
    fp8: bool = False
    ue8m0: bool = False
    int32_idx: bool = False
    p_none: float = 0.1  # share of top-k entries set to -1
    all_minus_one_rank: int = -1  # this rank routes every token nowhere
    only_expert: int = -1  # every token of every rank goes to this expert only (K = 1)
    worst: int = 0  # num_worst_tokens
    alignment: int = 1
    cached: bool = False
    bias: bool = True

    @property
    def R(self) -> int:
        return len(self.T)


# The scenarios of tests/gpu/cuda_ipc_normal_test.cpp, at sizes that run in seconds on thread ranks.
CASES: List[Case] = [
    Case("bf16"),
    Case("bf16_odd_hidden", T=(33, 40), H=2880, K=8, E=32),
    Case("fp8_float_scales", fp8=True, H=384),
    Case("fp8_ue8m0_scales", fp8=True, ue8m0=True, H=640),
    Case("zero_token_rank", T=(0, 21)),
    Case("all_minus_one_rank", all_minus_one_rank=1),
    Case("one_expert", K=1, only_expert=5),
    Case("num_worst_tokens", worst=24 + 17),
    Case("cached", cached=True),
    Case("int32_ids_alignment_k1", K=1, int32_idx=True, alignment=4),
    Case("k32", K=32, E=64),
]
CASES_BY_NAME = {c.name: c for c in CASES}


def nice_bf16(rng: np.random.Generator, shape: Sequence[int]) -> np.ndarray:
    mag = rng.uniform(0.125, 4.0, size=shape)
    sign = np.where(rng.random(size=shape) < 0.5, -1.0, 1.0)
    return (mag * sign).astype(BF16)


def make_inputs(case: Case, seed: int) -> List[Dict[str, Any]]:
    """Every rank's inputs, from `seed` alone: x (bf16, or fp8 with scales), topk_idx, topk_weights,
    biases and the rows of a cached dispatch."""
    rng = np.random.default_rng(seed)
    G = (case.H + GROUP - 1) // GROUP
    out = []
    for r, T in enumerate(case.T):
        if T:
            idx = np.stack([rng.choice(case.E, size=case.K, replace=False) for _ in range(T)]).astype(np.int64)
        else:
            idx = np.zeros((0, case.K), np.int64)
        idx[rng.random(size=idx.shape) < case.p_none] = -1
        if case.only_expert >= 0:
            idx[:] = case.only_expert
        if r == case.all_minus_one_rank:
            idx[:] = -1
        if case.int32_idx:
            idx = idx.astype(np.int32)
        d = dict(idx=idx, w=rng.uniform(0.05, 1.0, size=(T, case.K)).astype(np.float32),
                 x=nice_bf16(rng, (T, case.H)), x2=nice_bf16(rng, (T, case.H)),
                 bias0=(rng.integers(-32, 33, size=(T, case.H)) / 8.0).astype(BF16),
                 bias1=(rng.integers(-32, 33, size=(T, case.H)) / 8.0).astype(BF16))
        if case.fp8:
            d["x"] = d["x"].astype(FP8)
            d["x2"] = d["x2"].astype(FP8)
            if case.ue8m0:
                d["scales"] = rng.integers(0, 2**31 - 1, size=(T, (G + 3) // 4), dtype=np.int64).astype(np.int32)
            else:
                d["scales"] = rng.uniform(1e-3, 1.0, size=(T, G)).astype(np.float32)
        out.append(d)
    return out


def expert_output(recv_x: np.ndarray, rank: int) -> np.ndarray:
    """The stand-in for the experts: (rank + 1) * rows, rounded to bf16 once (fp8 rows: from their values)."""
    return (recv_x.astype(np.float64) * (rank + 1)).astype(BF16)


def run_rank(buf: Any, case: Case, inputs: Dict[str, Any], rank: int, to_fw: Callable[[np.ndarray], Any],
             to_np: Callable[[Any], np.ndarray], variant: str = "sync",
             before: Optional[Callable[[], Any]] = None) -> Dict[str, Any]:
    """One rank's layout -> dispatch -> expert -> combine (-> cached dispatch) through `buf`, with outputs
    converted to NumPy.

    variant: 'sync' (defaults), 'async' (async_finish=True, then event.current_stream_wait()),
    'previous_event' (every call after buf.capture() and the previous call's async event, the `with`
    form for the last), 'chained' (synchronous calls, each given the previous call's complete event as
    previous_event), 'positional' (DeepEP's positional argument order)."""
    x = to_fw(inputs["x"])
    scales = to_fw(inputs["scales"]) if case.fp8 else None
    idx, w = to_fw(inputs["idx"]), to_fw(inputs["w"])
    xin = (x, scales) if case.fp8 else x
    out: Dict[str, Any] = {}
    is_async = variant in ("async", "previous_event")

    prev = buf.capture() if variant == "previous_event" else None
    ntpr, ntp_rdma, ntpe, in_rank, ev = buf.get_dispatch_layout(idx, case.E, previous_event=prev,
                                                                async_finish=is_async)
    assert ntp_rdma is None
    if variant == "async":
        ev.current_stream_wait()
    if variant == "positional":
        recv, recv_idx, recv_w, counts, handle, ev = buf.dispatch(
            xin, None, ntpr, None, in_rank, ntpe, idx, w, case.alignment, case.worst, None, None, False, False)
    else:
        recv, recv_idx, recv_w, counts, handle, ev = buf.dispatch(
            xin, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=idx,
            topk_weights=w, expert_alignment=case.alignment, num_worst_tokens=case.worst,
            previous_event=ev if variant in ("previous_event", "chained") else None, async_finish=is_async)
    if is_async:
        ev.current_stream_wait()
    recv_x, recv_scales = recv if case.fp8 else (recv, None)
    out.update(layout=(to_np(ntpr), to_np(ntpe), to_np(in_rank)), recv_x=to_np(recv_x), recv_idx=to_np(recv_idx),
               recv_w=to_np(recv_w), counts=list(counts),
               handle=[None if a is None else to_np(a) for a in handle])
    if case.fp8:
        out["recv_scales"] = to_np(recv_scales)
    y = to_fw(expert_output(out["recv_x"], rank))
    bias = (to_fw(inputs["bias0"]), to_fw(inputs["bias1"])) if case.bias else None
    prev = buf.capture() if variant == "previous_event" else ev if variant == "chained" else None
    if variant == "positional":
        combined, combined_w, ev = buf.combine(y, handle, recv_w, bias, None, None, False, False)
    else:
        combined, combined_w, ev = buf.combine(y, handle, topk_weights=recv_w, bias=bias, previous_event=prev,
                                               async_finish=is_async)
    if variant == "previous_event":
        with ev:
            pass
    elif is_async:
        ev.current_stream_wait()
    out.update(combined=to_np(combined), combined_w=to_np(combined_w))
    if case.cached:
        x2 = to_fw(inputs["x2"])
        again = buf.dispatch((x2, scales) if case.fp8 else x2, handle=handle, async_finish=is_async)
        assert again[1:5] == (None, None, None, None)
        if is_async:
            again[5].current_stream_wait()
        out["cached_x"] = to_np(again[0][0] if case.fp8 else again[0])
    return out


def numpy_identity(a: np.ndarray) -> np.ndarray:
    return a


def reference_outputs(case: Case, inputs: List[Dict[str, Any]], timeout_s: float = 30.0) -> List[Dict[str, Any]]:
    """The threads backend on NumPy arrays: every rank's outputs."""

    def rank_main(group: Any) -> Dict[str, Any]:
        r = group.rank()
        return run_rank(epmoe.Buffer(group), case, inputs[r], r, numpy_identity, numpy_identity)

    return epmoe.run_thread_ranks(case.R, rank_main, timeout_s=timeout_s)


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    if a.dtype in (np.dtype(BF16), np.dtype(np.float16)):
        return a.view(np.uint16)
    if a.dtype == np.dtype(FP8):
        return a.view(np.uint8)
    if a.dtype == np.float32:
        return a.view(np.uint32)
    return a


def assert_same(got: Dict[str, Any], ref: Dict[str, Any], where: str) -> None:
    """Every output bit-identical (dtype and shape too)."""
    assert sorted(got) == sorted(ref), where
    for key in ref:
        a, b = got[key], ref[key]
        if key == "counts":
            assert a == b, f"{where}: counts {a} != {b}"
            continue
        pairs = list(zip(a, b)) if isinstance(b, (list, tuple)) else [(a, b)]
        assert len(pairs) == (len(b) if isinstance(b, (list, tuple)) else 1), f"{where}: {key}"
        for i, (u, v) in enumerate(pairs):
            if v is None:
                assert u is None, f"{where}: {key}[{i}] should be None"
                continue
            if key == "handle" and i == 3 and u is not None and u.ndim == 1 and u.shape[0] > v.shape[0]:
                # recv_src_idx with num_worst_tokens: the GPU keeps num_worst_tokens rows as DeepEP does (padding
                # -1), the CPU path the Nrecv valid rows.
                np.testing.assert_array_equal(u[:v.shape[0]], v, err_msg=f"{where}: {key}[{i}] valid rows")
                assert (u[v.shape[0]:] == -1).all(), f"{where}: {key}[{i}] padding rows are not -1"
                continue
            assert u is not None and u.dtype == v.dtype and u.shape == v.shape, \
                f"{where}: {key}[{i}]: {getattr(u, 'dtype', None)}{getattr(u, 'shape', None)} != {v.dtype}{v.shape}"
            np.testing.assert_array_equal(_bits(u), _bits(v), err_msg=f"{where}: {key}[{i}]")


# ------------------------------------------------------------------------------------------ torch helpers

def torch_converters(device: str) -> "tuple[Callable[[np.ndarray], Any], Callable[[Any], np.ndarray]]":
    """(NumPy -> torch on `device`, torch -> NumPy) keeping bf16 / fp8 bits exact."""
    import torch

    def to_torch(a: np.ndarray) -> Any:
        if a.dtype == np.dtype(BF16):
            return torch.from_numpy(np.ascontiguousarray(a).view(np.int16).copy()).view(torch.bfloat16).to(device)
        if a.dtype == np.dtype(FP8):
            return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8).copy()).view(torch.float8_e4m3fn).to(
                device)
        return torch.from_numpy(np.ascontiguousarray(a).copy()).to(device)

    def to_numpy(t: Any) -> np.ndarray:
        assert isinstance(t, torch.Tensor), f"expected a torch.Tensor, got {type(t).__name__}"
        assert t.device.type == torch.device(device).type, f"output on {t.device}, expected {device}"
        t = t.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(BF16)
        if t.dtype == torch.float8_e4m3fn:
            return t.view(torch.uint8).numpy().view(FP8)
        return t.numpy()

    return to_torch, to_numpy
