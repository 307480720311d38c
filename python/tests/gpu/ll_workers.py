"""Low-latency mode on GPUs from Python: what each process runs (test_cuda_ipc_low_latency_torch.py starts one
process per rank through launch.spawn: one GPU each, or both on cuda:0 in share mode), mirroring gpu_workers.py
for normal mode.

Every process draws all ranks' inputs from the same seed, computes the reference outputs on the CPU (epmoe's
threads backend on NumPy arrays, in-process thread ranks; itself tested against NumPy references in
test_buffer_low_latency.py), runs its own rank on its GPU through an epmoe.Buffer over the torch.distributed group
(cuda_ipc backend, GPU low-latency mode), and compares bit for bit: per call the valid rows of recv_x (and of its
scales), recv_count, the valid rows of the handle's src_info, layout_range, the cumulative stats, and combined_x.
A call's GPU outputs are views of the buffer's receive half, so they are copied to the host before the next call.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

import epmoe
from ep_scenarios import BF16, assert_same, nice_bf16, numpy_identity, torch_converters
from launch import Proc, error_of, on_thread_ranks


@dataclasses.dataclass(frozen=True)
class LLCase:
    name: str
    T: Sequence[int] = (24, 17)  # tokens of each rank (len = number of ranks)
    H: int = 256
    K: int = 4
    E: int = 16
    tmax: int = 32
    fp8: bool = False
    round_scale: bool = False
    ue8m0: bool = False
    int32_idx: bool = False
    p_none: float = 0.1  # share of top-k entries set to -1
    calls: int = 3  # dispatch + combine pairs (both halves of the buffer, then the first again)

    @property
    def R(self) -> int:
        return len(self.T)


# The scenarios of tests/gpu/cuda_ipc_low_latency_test.cpp, at sizes that run in seconds on thread ranks.
LL_CASES: List[LLCase] = [
    LLCase("bf16"),
    LLCase("bf16_odd_hidden", T=(33, 40), H=2880, K=8, E=32, tmax=40),
    LLCase("fp8_float_scales", fp8=True, H=384),
    LLCase("fp8_round_scale", fp8=True, round_scale=True, H=512),
    LLCase("fp8_ue8m0_scales", fp8=True, round_scale=True, ue8m0=True, H=640),
    # R*Tmax = 10: each expert's scale columns padded to 12 rows (DeepGEMM's TMA alignment)
    LLCase("fp8_padded_scale_columns", T=(5, 3), H=2880, tmax=5, fp8=True, round_scale=True, ue8m0=True),
    LLCase("zero_token_rank", T=(0, 21)),
    LLCase("t_equals_tmax", T=(32, 32), p_none=0.0),
    LLCase("int32_ids_k1", K=1, int32_idx=True),
    LLCase("k16", K=16, E=32),
]
LL_CASES_BY_NAME = {c.name: c for c in LL_CASES}


def make_ll_inputs(case: LLCase, seed: int) -> List[List[Dict[str, Any]]]:
    """inputs[rank][call]: x bf16 [T, H], idx [T, K] (distinct ids, some -1), w float32 [T, K], the experts'
    output y bf16 [E_local, R*Tmax, H] (any values: only the rows of valid slots are read), and the initial
    cumulative stats int32 [E_local] (call 0 only). Drawn from `seed` alone."""
    rng = np.random.default_rng(seed)
    el = case.E // case.R
    out = []
    for r, T in enumerate(case.T):
        calls = []
        for i in range(case.calls):
            idx = np.array([rng.choice(case.E, size=case.K, replace=False) for _ in range(T)],
                           dtype=np.int64).reshape(T, case.K)
            idx = np.where(rng.random(size=(T, case.K)) < case.p_none, -1, idx).astype(
                np.int32 if case.int32_idx else np.int64)
            calls.append({
                "x": nice_bf16(rng, (T, case.H)),
                "idx": idx,
                "w": rng.uniform(0.05, 1.0, size=(T, case.K)).astype(np.float32),
                "y": nice_bf16(rng, (el, case.R * case.tmax, case.H)),
                "stats": rng.integers(0, 100, size=el).astype(np.int32),
            })
        out.append(calls)
    return out


def _valid_rows(a: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Rows [0, count[e]) of each expert e of a [E_local, rows, ...] array, concatenated."""
    return np.concatenate([a[e, :int(count[e])] for e in range(a.shape[0])], axis=0)


def _strides_in_elements(a: Any) -> np.ndarray:
    """A torch tensor's or a NumPy array's strides in elements (the layout of the low-latency scales)."""
    strides = a.stride() if callable(getattr(a, "stride", None)) else tuple(s // a.itemsize for s in a.strides)
    return np.array(strides, dtype=np.int64)


def run_ll_rank(buf: Any, case: LLCase, inputs: List[Dict[str, Any]], to_fw: Callable[[np.ndarray], Any],
                to_np: Callable[[Any], np.ndarray], variant: str = "sync",
                sync: Optional[Callable[[], None]] = None) -> Dict[str, Any]:
    """One rank's calls: low_latency_dispatch, then low_latency_combine of the case's expert output, then the
    same combine again with zero_copy from get_next_low_latency_combine_buffer, `calls` times. variant: 'sync', 'hook' (return_recv_hook on both), 'async' (async_finish on both, then
    event.current_stream_wait()), 'out' (combine into a given, poisoned array). `sync` waits for the device
    (GPU) before the outputs are read. Returns every output as NumPy arrays."""
    sync = sync or (lambda: None)
    hook = variant == "hook"
    async_finish = variant == "async"
    stats = to_fw(inputs[0]["stats"].copy())  # written in place by every dispatch
    got: Dict[str, Any] = {}
    for i, ci in enumerate(inputs):
        x, idx, w, y = to_fw(ci["x"]), to_fw(ci["idx"]), to_fw(ci["w"]), to_fw(ci["y"])
        recv, count, handle, event, recv_hook = buf.low_latency_dispatch(
            x, idx, case.tmax, case.E, cumulative_local_expert_recv_stats=stats, use_fp8=case.fp8,
            round_scale=case.round_scale, use_ue8m0=case.ue8m0, async_finish=async_finish, return_recv_hook=hook)
        assert (recv_hook is not None) == hook, f"{case.name}: hook {recv_hook!r}"
        if hook:
            recv_hook()
        if async_finish:
            assert event.event is not None
            event.current_stream_wait()
        sync()
        count_np = to_np(count)
        recv_x, scales = recv if case.fp8 else (recv, None)
        if i == 0:
            first_recv_x = recv_x
        elif i == 2 and getattr(recv_x, "is_cuda", False):
            # Call 2 uses call 0's half: a fresh tensor over the same window memory (the Python object of each
            # window view is made once and handed out as aliases since).
            assert recv_x is not first_recv_x and recv_x.data_ptr() == first_recv_x.data_ptr(), case.name
        got[f"call{i}.count"] = count_np
        got[f"call{i}.x_rows"] = _valid_rows(to_np(recv_x), count_np)
        got[f"call{i}.scales_rows"] = _valid_rows(to_np(scales), count_np) if case.fp8 else None
        # DeepEP's column-major layout on every backend (semantics §5), the same strides as the threads backend's.
        got[f"call{i}.scales_strides"] = _strides_in_elements(scales) if case.fp8 else None
        got[f"call{i}.src_info_rows"] = _valid_rows(to_np(handle[0]), count_np)
        got[f"call{i}.layout_range"] = to_np(handle[1])
        assert tuple(handle[2:]) == (case.tmax, case.H, case.E), handle[2:]
        out = None
        if variant == "out":
            out = to_fw(np.full((len(ci["x"]), case.H), np.nan, dtype=BF16))  # poisoned
        combined, event, recv_hook = buf.low_latency_combine(y, idx, w, handle, async_finish=async_finish,
                                                             return_recv_hook=hook, out=out)
        if out is not None:
            assert combined is out
        if hook:
            recv_hook()
        if async_finish:
            event.current_stream_wait()
        sync()
        got[f"call{i}.combined"] = to_np(combined)
        # The same handle combined again from the next call's slab (DeepEP's test: zero_copy off, then on); on the
        # GPU the slab is a view into the low-latency window, x only checked.
        slab = buf.get_next_low_latency_combine_buffer(handle)
        slab[:, :, :] = y
        if getattr(slab, "is_cuda", False):
            import torch
            window = buf.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)
            assert window.data_ptr() <= slab.data_ptr() < window.data_ptr() + window.numel(), "slab outside window"
        combined, event, recv_hook = buf.low_latency_combine(to_fw(np.zeros_like(ci["y"])), idx, w, handle,
                                                             zero_copy=True, async_finish=async_finish,
                                                             return_recv_hook=hook)
        if hook:
            recv_hook()
        if async_finish:
            event.current_stream_wait()
        sync()
        got[f"call{i}.combined_zero_copy"] = to_np(combined)
    sync()
    got["stats"] = to_np(stats)
    return got


def reference_ll_outputs(case: LLCase, inputs: List[List[Dict[str, Any]]],
                         timeout_s: float = 30.0) -> List[Dict[str, Any]]:
    """The threads backend on NumPy arrays: every rank's outputs."""

    def rank_main(group: Any) -> Dict[str, Any]:
        r = group.rank()
        return run_ll_rank(epmoe.Buffer(group), case, inputs[r], numpy_identity, numpy_identity)

    return epmoe.run_thread_ranks(case.R, rank_main, timeout_s=timeout_s)


def assert_same_ll(got: Dict[str, Any], ref: Dict[str, Any], where: str) -> None:
    """Every output bit-identical (dtype and shape too); None (no scales) on both sides."""
    assert sorted(got) == sorted(ref), where
    for key in ref:
        if ref[key] is None:
            assert got[key] is None, f"{where}: {key}"
            continue
        assert_same({key: got[key]}, {key: ref[key]}, where)


LL_VARIANTS = ("sync", "hook", "async", "out")
# Every case runs synchronously; these also with hooks, async_finish and a given output.
LL_ALL_VARIANTS = ("bf16", "fp8_float_scales", "fp8_ue8m0_scales", "zero_token_rank")


def _run_ll_cases(buf: Any, rank: int, device: int, seed: int, names: List[str],
                  variants_for: Callable[[str], tuple], side_stream: bool = False) -> List[str]:
    import torch
    to_torch, to_numpy = torch_converters(f"cuda:{device}")
    done = []
    for i, name in enumerate(names):
        case = LL_CASES_BY_NAME[name]
        inputs = make_ll_inputs(case, seed + i)
        ref = reference_ll_outputs(case, inputs)
        for variant in variants_for(name):
            if side_stream:
                # Calls issued on a side stream: epmoe must work on torch's current stream, so the outputs are
                # ready once that stream is synchronised.
                side = torch.cuda.Stream(device=device)
                with torch.cuda.stream(side):
                    got = run_ll_rank(buf, case, inputs[rank], to_torch, to_numpy, variant, sync=side.synchronize)
            else:
                got = run_ll_rank(buf, case, inputs[rank], to_torch, to_numpy, variant,
                                  sync=torch.cuda.current_stream(device).synchronize)
            torch.cuda.synchronize()
            assert_same_ll(got, ref[rank], f"{name}/{variant}{' side stream' if side_stream else ''} rank {rank} "
                           f"on cuda:{device} (seed {seed + i})")
            done.append(f"{name}/{variant}")
    return done


def job_ll_scenarios(p: Proc) -> Dict[str, Any]:
    """Every low-latency scenario, one buffer per case (Tmax, H and E are fixed for a buffer's life)."""
    done = []
    for j, case in enumerate(LL_CASES):
        buf = epmoe.Buffer(p.group, num_nvl_bytes=epmoe.Buffer.get_normal_nvl_size_hint(1, case.H, p.world, 1),
                           low_latency_mode=True)
        assert buf.backend == "cuda_ipc" and (buf.rank, buf.group_size) == (p.rank, p.world)
        done += _run_ll_cases(buf, p.rank, p.device, p.seed + 100 * j, [case.name],
                              lambda name: LL_VARIANTS if name in LL_ALL_VARIANTS else ("sync",))
    return {"done": done}


def job_ll_side_stream(p: Proc) -> Dict[str, Any]:
    """Two cases with every call issued on a torch side stream (not the default one)."""
    done = []
    for j, name in enumerate(["bf16", "fp8_float_scales"]):
        case = LL_CASES_BY_NAME[name]
        buf = epmoe.Buffer(p.group, num_nvl_bytes=epmoe.Buffer.get_normal_nvl_size_hint(1, case.H, p.world, 1))
        done += _run_ll_cases(buf, p.rank, p.device, p.seed + 100 * j, [name], lambda n: ("sync", "hook"),
                              side_stream=True)
    return {"done": done}


def job_ll_errors(p: Proc) -> Dict[str, Any]:
    """Bad low-latency inputs raise epmoe.Error before any communication, on every rank; the buffer stays usable."""
    import torch
    rank, seed = p.rank, p.seed
    case = LL_CASES_BY_NAME["bf16"]
    inputs = make_ll_inputs(case, seed)
    to_gpu, to_numpy = torch_converters(p.cuda)
    buf = epmoe.Buffer(p.group, num_nvl_bytes=epmoe.Buffer.get_normal_nvl_size_hint(1, case.H, p.world, 1))
    ci = inputs[rank][0]
    x, idx = to_gpu(ci["x"]), to_gpu(ci["idx"])
    big_x = to_gpu(nice_bf16(np.random.default_rng(seed), (case.tmax + 1, case.H)))
    big_idx = torch.arange(case.K, dtype=torch.int64, device=x.device).repeat(case.tmax + 1, 1)  # distinct ids
    wide_idx = torch.zeros((x.shape[0], 17), dtype=torch.int64, device=x.device)
    out = {
        "too_many_tokens": error_of(lambda: buf.low_latency_dispatch(big_x, big_idx, case.tmax, case.E)),
        "k17": error_of(lambda: buf.low_latency_dispatch(x, wide_idx, case.tmax, case.E)),
        "float_x": error_of(lambda: buf.low_latency_dispatch(x.float(), idx, case.tmax, case.E)),
        "hook_and_async": error_of(lambda: buf.low_latency_dispatch(x, idx, case.tmax, case.E, async_finish=True,
                                                                    return_recv_hook=True)),
        "cpu_idx": error_of(lambda: buf.low_latency_dispatch(x, idx.cpu(), case.tmax, case.E)),
        "bad_handle": error_of(lambda: buf.low_latency_combine(to_gpu(ci["y"]), idx, to_gpu(ci["w"]), (1, 2, 3))),
    }
    # still usable: a whole scenario after the errors
    got = run_ll_rank(buf, case, inputs[rank], to_gpu, to_numpy, sync=torch.cuda.synchronize)
    assert_same_ll(got, reference_ll_outputs(case, inputs)[rank], f"after errors, rank {rank} (seed {seed})")
    # A handle from two low-latency calls ago is stale (the two-buffer rule), on every rank.
    recv, count, h0, _, _ = buf.low_latency_dispatch(x, idx, case.tmax, case.E, use_fp8=False)
    buf.low_latency_combine(to_gpu(ci["y"]), idx, to_gpu(ci["w"]), h0)
    _, _, h1, _, _ = buf.low_latency_dispatch(x, idx, case.tmax, case.E, use_fp8=False)
    out["stale_handle"] = error_of(lambda: buf.low_latency_combine(to_gpu(ci["y"]), idx, to_gpu(ci["w"]), h0))
    buf.low_latency_combine(to_gpu(ci["y"]), idx, to_gpu(ci["w"]), h1)  # the pending call completes
    torch.cuda.synchronize()
    return out


def thread_rank_ll_scenarios(seed: int) -> List[str]:
    """One process, thread rank r on cuda:r (the calls wait on the host before returning), a few cases with
    hooks and async_finish."""
    names = ["bf16", "fp8_ue8m0_scales"]

    def rank_main(group: Any, device: int) -> List[str]:
        done = []
        for j, name in enumerate(names):
            case = LL_CASES_BY_NAME[name]
            buf = epmoe.Buffer(group, num_nvl_bytes=epmoe.Buffer.get_normal_nvl_size_hint(1, case.H, group.size(), 1),
                               backend="cuda_ipc", device=device)
            done += _run_ll_cases(buf, group.rank(), device, seed + 100 * j, [name],
                                  lambda n: ("sync", "hook", "async"))
        return done

    return on_thread_ranks(rank_main)
