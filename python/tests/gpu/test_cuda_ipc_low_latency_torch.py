"""Low-latency mode of epmoe.Buffer on GPUs from Python (cuda_ipc backend, GPU low-latency mode), on 2 GPUs or
sharing one.

Two processes (torch.multiprocessing.spawn through launch.spawn), one GPU each or both on one, a
torch.distributed group (gloo, and nccl for a subset) handed to epmoe.Buffer as DeepEP's engines do; each
process runs the scenarios of tests/gpu/cuda_ipc_low_latency_test.cpp through the Python API
(ll_workers.LL_CASES: bf16 at two hidden sizes, fp8 with float32, power-of-two and UE8M0 scales, a zero-token
rank, T = Tmax, int32 ids with K = 1, K = 16; three dispatch + combine pairs each, so both halves of the buffer
and then the first again), synchronously, with return_recv_hook, with async_finish, into a given output, and on
a torch side stream, and compares every output bit for bit with the CPU threads backend on the same inputs (the
valid rows of recv_x and its scales, recv_count, src_info, layout_range, the cumulative stats, combined_x). Bad
inputs must raise epmoe.Error on every rank without a hang. Skipped without torch, a CUDA build or a GPU. With
one GPU (or EPMOE_TEST_SHARE_GPU=1) both processes share cuda:0 (share mode, launch.py); the NCCL-group and
thread-rank tests then skip, as they need a GPU per rank.
"""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # launch.py (it adds the parent folder)
import ll_workers  # noqa: E402
from launch import NCCL_SHARED, THREADS_SHARED, fresh_seed, needs_gpu, own_gpus, spawn  # noqa: E402

pytestmark = needs_gpu


def test_every_low_latency_scenario_matches_the_cpu_path_over_a_gloo_group(tmp_path):
    out = spawn(ll_workers.job_ll_scenarios, "gloo", tmp_path, "ll scenarios")
    want = len(ll_workers.LL_CASES) + (len(ll_workers.LL_VARIANTS) - 1) * len(ll_workers.LL_ALL_VARIANTS)
    assert out[0]["done"] == out[1]["done"] and len(out[0]["done"]) == want, out[0]["done"]
    print("\n".join(out[0]["done"]))


@own_gpus(NCCL_SHARED)
def test_low_latency_on_a_side_stream_over_an_nccl_group(tmp_path):
    out = spawn(ll_workers.job_ll_side_stream, "nccl", tmp_path, "ll side stream")
    assert out[0]["done"] == out[1]["done"] and len(out[0]["done"]) == 4, out[0]["done"]


def test_bad_low_latency_inputs_raise_on_every_rank_without_a_hang(tmp_path):
    for r, out in enumerate(spawn(ll_workers.job_ll_errors, "gloo", tmp_path, "ll errors")):
        assert out["too_many_tokens"][0] == "invalid_argument", out["too_many_tokens"]
        assert "num_max_dispatch_tokens_per_rank" in out["too_many_tokens"][1] or "Tmax" in out["too_many_tokens"][1], \
            out["too_many_tokens"]
        assert out["k17"][0] == "invalid_argument" and "topk_idx" in out["k17"][1], out["k17"]
        assert out["float_x"][0] == "invalid_argument" and "'x'" in out["float_x"][1], out["float_x"]
        assert out["hook_and_async"][0] == "invalid_argument", out["hook_and_async"]
        assert out["cpu_idx"][0] == "invalid_argument" and "topk_idx" in out["cpu_idx"][1], out["cpu_idx"]
        assert out["bad_handle"][0] == "invalid_argument" and "handle" in out["bad_handle"][1], out["bad_handle"]
        assert out["stale_handle"][0] == "stale_handle", out["stale_handle"]


@own_gpus(THREADS_SHARED)
def test_low_latency_thread_ranks_on_two_gpus_in_one_process():
    done = ll_workers.thread_rank_ll_scenarios(fresh_seed("ll thread ranks"))
    assert len(done) == 2 * 2 * 3, done
