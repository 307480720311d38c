"""Low-latency mode of epmoe.Buffer on GPUs from Python (cuda_ipc backend, GPU low-latency mode), on 2 GPUs.

Two processes (torch.multiprocessing.spawn), one GPU each, a torch.distributed group (gloo, and nccl for a
subset) handed to epmoe.Buffer as DeepEP's engines do; each process runs the scenarios of
tests/gpu/cuda_ipc_low_latency_test.cpp through the Python API (ll_workers.LL_CASES: bf16 at two hidden sizes,
fp8 with float32, power-of-two and UE8M0 scales, a zero-token rank, T = Tmax, int32 ids with K = 1, K = 16;
three dispatch + combine pairs each, so both halves of the buffer and then the first again), synchronously, with
return_recv_hook, with async_finish, into a given output, and on a torch side stream, and compares every output
bit for bit with the CPU threads backend on the same inputs (the valid rows of recv_x and its scales, recv_count,
src_info, layout_range, the cumulative stats, combined_x). Bad inputs must raise epmoe.Error on every rank
without a hang. Skipped without torch, a CUDA build or 2 GPUs.
"""

from __future__ import annotations

import os
import random
import sys

import pytest

import epmoe

# The parent folder's helpers (ep_scenarios.py) and this folder's (ll_workers.py) are importable here and in the
# spawned processes (they inherit sys.path).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# NVLink multicast stays off on shared machines; epmoe never uses it, this guards the libraries (NCCL).
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)
# A protocol bug costs seconds, not the 100 s default wait.
os.environ.setdefault("EPMOE_TIMEOUT_S", "20")

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(
    not epmoe.built_with_cuda() or torch.cuda.device_count() < 2,
    reason=f"needs a CUDA build of epmoe (built_with_cuda={epmoe.built_with_cuda()}) and 2 GPUs "
    f"(found {torch.cuda.device_count() if torch.cuda.is_available() else 0})")

WORLD = 2


def fresh_seed(name: str) -> int:
    seed = int(os.environ.get("EPMOE_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"[{name}] seed={seed} (EPMOE_TEST_SEED={seed} reproduces it)")
    return seed


def spawn(job: str, backend: str, tmp_path, name: str):
    import torch.multiprocessing as mp
    from ll_workers import run_worker
    seed = fresh_seed(name)
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    mp.spawn(run_worker, args=(WORLD, str(tmp_path / "init"), backend, seed, job, results), nprocs=WORLD, join=True)
    return [results[r] for r in range(WORLD)]


def test_every_low_latency_scenario_matches_the_cpu_path_over_a_gloo_group(tmp_path):
    from ll_workers import LL_ALL_VARIANTS, LL_CASES, LL_VARIANTS
    out = spawn("ll_scenarios", "gloo", tmp_path, "ll scenarios")
    want = len(LL_CASES) + (len(LL_VARIANTS) - 1) * len(LL_ALL_VARIANTS)
    assert out[0]["done"] == out[1]["done"] and len(out[0]["done"]) == want, out[0]["done"]
    print("\n".join(out[0]["done"]))


def test_low_latency_on_a_side_stream_over_an_nccl_group(tmp_path):
    out = spawn("ll_side_stream", "nccl", tmp_path, "ll side stream")
    assert out[0]["done"] == out[1]["done"] and len(out[0]["done"]) == 4, out[0]["done"]


def test_bad_low_latency_inputs_raise_on_every_rank_without_a_hang(tmp_path):
    for r, out in enumerate(spawn("ll_errors", "gloo", tmp_path, "ll errors")):
        assert out["too_many_tokens"][0] == "invalid_argument", out["too_many_tokens"]
        assert "num_max_dispatch_tokens_per_rank" in out["too_many_tokens"][1] or "Tmax" in out["too_many_tokens"][1], \
            out["too_many_tokens"]
        assert out["k17"][0] == "invalid_argument" and "topk_idx" in out["k17"][1], out["k17"]
        assert out["float_x"][0] == "invalid_argument" and "'x'" in out["float_x"][1], out["float_x"]
        assert out["hook_and_async"][0] == "invalid_argument", out["hook_and_async"]
        assert out["cpu_idx"][0] == "invalid_argument" and "topk_idx" in out["cpu_idx"][1], out["cpu_idx"]
        assert out["bad_handle"][0] == "invalid_argument" and "handle" in out["bad_handle"][1], out["bad_handle"]
        assert out["stale_handle"][0] == "stale_handle", out["stale_handle"]


def test_low_latency_thread_ranks_on_two_gpus_in_one_process():
    from ll_workers import thread_rank_ll_scenarios
    done = thread_rank_ll_scenarios(fresh_seed("ll thread ranks"))
    assert len(done) == 2 * 2 * 3, done
