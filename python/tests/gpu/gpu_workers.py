"""What each GPU process runs (test_cuda_ipc_torch.py starts one process per rank through launch.spawn: one GPU
each, or both on cuda:0 in share mode).

Every process draws all ranks' inputs from the same seed, computes the reference outputs on the CPU
(epmoe's threads backend on NumPy arrays, in-process thread ranks), runs its own rank on its GPU through
an epmoe.Buffer over the torch.distributed group (cuda_ipc backend), and compares bit for bit. A failed
assertion raises in the process; torch.multiprocessing.spawn re-raises it in the test with its traceback.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import numpy as np

import epmoe
from ep_scenarios import (CASES, CASES_BY_NAME, Case, assert_same, make_inputs, reference_outputs, run_rank,
                          torch_converters)
from launch import WORLD, Proc, error_of, on_thread_ranks

# Every scenario runs synchronously; these also run with async_finish, previous_event and DeepEP's
# positional argument order.
ALL_VARIANTS = ("bf16", "fp8_float_scales", "cached", "num_worst_tokens", "zero_token_rank")
VARIANTS = ("sync", "async", "previous_event", "chained", "positional")


def nvl_bytes_for(cases: List[Case]) -> int:
    """num_nvl_bytes that holds every case (the largest T, H and K together)."""
    t = max(sum(c.T) for c in cases)
    h = max(c.H for c in cases)
    k = max(c.K for c in cases)
    return epmoe.Buffer.get_normal_nvl_size_hint(t, h, WORLD, k)


def _run_cases(buf: Any, rank: int, device: int, seed: int, names: List[str],
               variants_for: Callable[[str], tuple]) -> List[str]:
    import torch
    to_torch, to_numpy = torch_converters(f"cuda:{device}")
    done = []
    for i, name in enumerate(names):
        case = CASES_BY_NAME[name]
        inputs = make_inputs(case, seed + i)
        ref = reference_outputs(case, inputs)
        for variant in variants_for(name):
            got = run_rank(buf, case, inputs[rank], rank, to_torch, to_numpy, variant)
            torch.cuda.synchronize()
            assert_same(got, ref[rank], f"{name}/{variant} rank {rank} on cuda:{device} (seed {seed + i})")
            done.append(f"{name}/{variant}")
    return done


def job_scenarios(p: Proc) -> Dict[str, Any]:
    """Every scenario of ep_scenarios.CASES on one cuda_ipc buffer (reused across all calls)."""
    buf = epmoe.Buffer(p.group, num_nvl_bytes=nvl_bytes_for(CASES))
    assert buf.backend == "cuda_ipc" and (buf.rank, buf.group_size) == (p.rank, p.world)
    done = _run_cases(buf, p.rank, p.device, p.seed, [c.name for c in CASES],
                      lambda name: VARIANTS if name in ALL_VARIANTS else ("sync",))
    return {"done": done}


def job_quick(p: Proc) -> Dict[str, Any]:
    """A few scenarios (for the NCCL-group run: the group's all-gathers then go through NCCL)."""
    names = ["bf16", "fp8_ue8m0_scales", "cached"]
    buf = epmoe.Buffer(p.group, num_nvl_bytes=nvl_bytes_for([CASES_BY_NAME[n] for n in names]))
    return {"done": _run_cases(buf, p.rank, p.device, p.seed, names, lambda name: ("sync", "async"))}


def job_errors(p: Proc) -> Dict[str, Any]:
    """Bad inputs raise epmoe.Error before any communication (the buffer stays usable), on every rank."""
    import torch
    rank, group = p.rank, p.group
    case = CASES_BY_NAME["bf16"]
    inputs = make_inputs(case, p.seed)
    to_gpu, to_numpy = torch_converters(p.cuda)
    to_cpu, _ = torch_converters("cpu")
    buf = epmoe.Buffer(group, num_nvl_bytes=nvl_bytes_for([case]))
    idx = to_gpu(inputs[rank]["idx"])
    x = to_gpu(inputs[rank]["x"])
    ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, case.E)
    layout = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=idx)
    out = {
        "cpu_x": error_of(lambda: buf.dispatch(to_cpu(inputs[rank]["x"]), **layout)),
        "float_x": error_of(lambda: buf.dispatch(x.float(), **layout)),
        "alloc_on_comm": error_of(lambda: buf.dispatch(x, allocate_on_comm_stream=True, **layout)),
        "ll_cpu": error_of(lambda: buf.low_latency_dispatch(to_cpu(inputs[rank]["x"]), to_cpu(inputs[rank]["idx"]),
                                                            32, case.E)),
        "rdma_before_window": error_of(lambda: buf.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)),
        "misaligned_offset": error_of(lambda: buf.get_local_buffer_tensor(torch.int32, offset=2)),
        "zero_nvl_bytes": error_of(lambda: epmoe.Buffer(group)),
    }
    # The communication stream: a torch stream on this rank's device that async_finish work runs on (an event
    # of an async dispatch, waited for on it, leaves it idle once the dispatch is done).
    comm = buf.get_comm_stream()
    out["comm_stream"] = (isinstance(comm, torch.cuda.Stream), comm.device == x.device)
    _, _, _, _, _, ev = buf.dispatch(x, async_finish=True, **layout)
    with torch.cuda.stream(comm):
        ev.current_stream_wait()
    comm.synchronize()
    out["comm_stream_idle"] = comm.query()
    # The raw data region: int32 elements past a 16-byte offset, written and read back through a second view.
    view = buf.get_local_buffer_tensor(torch.int32, (2, 8), offset=16)
    whole = buf.get_local_buffer_tensor(torch.uint8)
    view.copy_(torch.arange(16, dtype=torch.int32, device=x.device).view(2, 8))
    out["local_buffer"] = (tuple(view.shape), whole.numel() == buf.num_nvl_bytes,
                           whole[16:80].view(torch.int32).tolist() == list(range(16)))
    spare = [d for d in range(torch.cuda.device_count()) if d not in p.devices]
    if spare:  # a tensor on a GPU that is no rank's
        other = torch.device("cuda", spare[0])
        out["other_device"] = error_of(
            lambda: buf.dispatch(x.to(other), **{k: v.to(other) for k, v in layout.items()}))
    # still usable: a whole scenario after the errors
    got = run_rank(buf, case, inputs[rank], rank, to_gpu, to_numpy)
    assert_same(got, reference_outputs(case, inputs)[rank], f"after errors, rank {rank} (seed {p.seed})")
    # too small a buffer: every rank learns it at the same call
    small = epmoe.Buffer(group, num_nvl_bytes=4096)
    out["too_small"] = error_of(lambda: small.dispatch(x, **layout))
    return out


def job_cupy(p: Proc) -> Dict[str, Any]:
    """CuPy in, CuPy out: the layout of a CuPy topk_idx, against the NumPy path."""
    import cupy
    case = CASES_BY_NAME["bf16"]
    inputs = make_inputs(case, p.seed)
    buf = epmoe.Buffer(p.group, num_nvl_bytes=nvl_bytes_for([case]))
    with cupy.cuda.Device(p.device):
        idx = cupy.asarray(inputs[p.rank]["idx"])
        ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, case.E)
        assert all(isinstance(a, cupy.ndarray) for a in (ntpr, ntpe, in_rank))
        got = [cupy.asnumpy(a) for a in (ntpr, ntpe, in_rank)]
    ref = epmoe.get_dispatch_layout(inputs[p.rank]["idx"], case.E, p.world)
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype and g.shape == r.shape
        np.testing.assert_array_equal(g, r)
    return {"done": ["cupy_layout"]}


def thread_rank_scenarios(seed: int) -> List[str]:
    """One process, thread rank r on cuda:r (the cuda_ipc peer-access path), a few scenarios."""
    names = ["bf16", "fp8_float_scales", "cached"]
    nvl = nvl_bytes_for([CASES_BY_NAME[n] for n in names])

    def rank_main(group: Any, device: int) -> List[str]:
        buf = epmoe.Buffer(group, num_nvl_bytes=nvl, backend="cuda_ipc", device=device)
        return _run_cases(buf, group.rank(), device, seed, names, lambda name: ("sync", "async"))

    return on_thread_ranks(rank_main)
