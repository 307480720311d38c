"""What each GPU process runs (test_cuda_ipc_torch.py spawns one process per GPU with torch.multiprocessing).

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

# Every scenario runs synchronously; these also run with async_finish, previous_event and DeepEP's
# positional argument order.
ALL_VARIANTS = ("bf16", "fp8_float_scales", "cached", "num_worst_tokens", "zero_token_rank")
VARIANTS = ("sync", "async", "previous_event", "chained", "positional")


def nvl_bytes_for(cases: List[Case]) -> int:
    """num_nvl_bytes that holds every case (the largest T, H and K together)."""
    t = max(sum(c.T) for c in cases)
    h = max(c.H for c in cases)
    k = max(c.K for c in cases)
    return epmoe.Buffer.get_normal_nvl_size_hint(t, h, 2, k)


def _run_cases(buf: Any, rank: int, seed: int, names: List[str], variants_for: Callable[[str], tuple]) -> List[str]:
    import torch
    to_torch, to_numpy = torch_converters(f"cuda:{rank}")
    done = []
    for i, name in enumerate(names):
        case = CASES_BY_NAME[name]
        inputs = make_inputs(case, seed + i)
        ref = reference_outputs(case, inputs)
        for variant in variants_for(name):
            got = run_rank(buf, case, inputs[rank], rank, to_torch, to_numpy, variant)
            torch.cuda.synchronize()
            assert_same(got, ref[rank], f"{name}/{variant} rank {rank} (seed {seed + i})")
            done.append(f"{name}/{variant}")
    return done


def job_scenarios(rank: int, world: int, seed: int, group: Any) -> Dict[str, Any]:
    """Every scenario of ep_scenarios.CASES on one cuda_ipc buffer (reused across all calls)."""
    buf = epmoe.Buffer(group, num_nvl_bytes=nvl_bytes_for(CASES))
    assert buf.backend == "cuda_ipc" and (buf.rank, buf.group_size) == (rank, world)
    done = _run_cases(buf, rank, seed, [c.name for c in CASES],
                      lambda name: VARIANTS if name in ALL_VARIANTS else ("sync",))
    return {"done": done}


def job_quick(rank: int, world: int, seed: int, group: Any) -> Dict[str, Any]:
    """A few scenarios (for the NCCL-group run: the group's all-gathers then go through NCCL)."""
    names = ["bf16", "fp8_ue8m0_scales", "cached"]
    buf = epmoe.Buffer(group, num_nvl_bytes=nvl_bytes_for([CASES_BY_NAME[n] for n in names]))
    return {"done": _run_cases(buf, rank, seed, names, lambda name: ("sync", "async"))}


def _error(call: Callable[[], Any]) -> tuple:
    try:
        call()
    except epmoe.Error as e:
        return (e.code, str(e))
    return ("no error", "")


def job_errors(rank: int, world: int, seed: int, group: Any) -> Dict[str, Any]:
    """Bad inputs raise epmoe.Error before any communication (the buffer stays usable), on every rank."""
    import torch
    case = CASES_BY_NAME["bf16"]
    inputs = make_inputs(case, seed)
    to_gpu, to_numpy = torch_converters(f"cuda:{rank}")
    to_cpu, _ = torch_converters("cpu")
    buf = epmoe.Buffer(group, num_nvl_bytes=nvl_bytes_for([case]))
    idx = to_gpu(inputs[rank]["idx"])
    x = to_gpu(inputs[rank]["x"])
    ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, case.E)
    layout = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=idx)
    out = {
        "cpu_x": _error(lambda: buf.dispatch(to_cpu(inputs[rank]["x"]), **layout)),
        "float_x": _error(lambda: buf.dispatch(x.float(), **layout)),
        "alloc_on_comm": _error(lambda: buf.dispatch(x, allocate_on_comm_stream=True, **layout)),
        "ll_cpu": _error(lambda: buf.low_latency_dispatch(to_cpu(inputs[rank]["x"]), to_cpu(inputs[rank]["idx"]),
                                                          32, case.E)),
        "comm_stream": _error(lambda: buf.get_comm_stream()),
        "zero_nvl_bytes": _error(lambda: epmoe.Buffer(group)),
    }
    if torch.cuda.device_count() > world:  # a tensor on a GPU that is not this rank's
        other = torch.device("cuda", world)
        out["other_device"] = _error(lambda: buf.dispatch(x.to(other), **{k: v.to(other) for k, v in layout.items()}))
    # still usable: a whole scenario after the errors
    got = run_rank(buf, case, inputs[rank], rank, to_gpu, to_numpy)
    assert_same(got, reference_outputs(case, inputs)[rank], f"after errors, rank {rank} (seed {seed})")
    # too small a buffer: every rank learns it at the same call
    small = epmoe.Buffer(group, num_nvl_bytes=4096)
    out["too_small"] = _error(lambda: small.dispatch(x, **layout))
    return out


def job_cupy(rank: int, world: int, seed: int, group: Any) -> Dict[str, Any]:
    """CuPy in, CuPy out: the layout of a CuPy topk_idx, against the NumPy path."""
    import cupy
    case = CASES_BY_NAME["bf16"]
    inputs = make_inputs(case, seed)
    buf = epmoe.Buffer(group, num_nvl_bytes=nvl_bytes_for([case]))
    with cupy.cuda.Device(rank):
        idx = cupy.asarray(inputs[rank]["idx"])
        ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idx, case.E)
        assert all(isinstance(a, cupy.ndarray) for a in (ntpr, ntpe, in_rank))
        got = [cupy.asnumpy(a) for a in (ntpr, ntpe, in_rank)]
    ref = epmoe.get_dispatch_layout(inputs[rank]["idx"], case.E, world)
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype and g.shape == r.shape
        np.testing.assert_array_equal(g, r)
    return {"done": ["cupy_layout"]}


JOBS = {"scenarios": job_scenarios, "quick": job_quick, "errors": job_errors, "cupy": job_cupy}


def run_worker(rank: int, world: int, init_file: str, backend: str, seed: int, job: str, results: Any) -> None:
    """Entry point of one spawned process: rank `rank` on cuda:`rank`, a torch.distributed group over
    `backend` ('gloo' or 'nccl'), then JOBS[job]; its result lands in results[rank]."""
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    kwargs = {"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world, **kwargs)
    try:
        results[rank] = JOBS[job](rank, world, seed, dist.group.WORLD)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def thread_rank_scenarios(seed: int) -> List[str]:
    """One process, thread rank r on cuda:r (the cuda_ipc peer-access path), a few scenarios."""
    import torch
    names = ["bf16", "fp8_float_scales", "cached"]
    nvl = nvl_bytes_for([CASES_BY_NAME[n] for n in names])

    def rank_main(group: Any) -> List[str]:
        r = group.rank()
        with torch.cuda.device(r):
            buf = epmoe.Buffer(group, num_nvl_bytes=nvl, backend="cuda_ipc", device=r)
            return _run_cases(buf, r, seed, names, lambda name: ("sync", "async"))

    return [d for per_rank in epmoe.run_thread_ranks(2, rank_main) for d in per_rank]

