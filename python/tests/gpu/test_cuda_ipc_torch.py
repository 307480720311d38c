"""The GPU path of epmoe.Buffer from Python (cuda_ipc backend, normal mode), on 2 GPUs or sharing one.

Two processes (torch.multiprocessing.spawn through launch.spawn), one GPU each or both on one, a
torch.distributed group (gloo, and nccl for a subset) handed to epmoe.Buffer as DeepEP's engines do; each
process runs the scenarios of tests/gpu/cuda_ipc_normal_test.cpp through the Python API (ep_scenarios.CASES:
bf16 at two hidden sizes, fp8 with float32 and UE8M0 scales, a zero-token rank, a rank routing nowhere, one
expert, num_worst_tokens, cached dispatch, int32 ids with expert_alignment and K = 1, K = 32), synchronously,
with async_finish, with previous_event (torch events from capture(), epmoe's CUDA events, and the complete
events of synchronous calls), and with DeepEP's positional order, and compares every output bit for bit with
the CPU threads backend on the same inputs. Bad inputs must raise epmoe.Error on every rank without a hang.
Skipped without torch, a CUDA build or a GPU. With one GPU (or EPMOE_TEST_SHARE_GPU=1) both processes share
cuda:0 (share mode, launch.py); the NCCL-group and thread-rank tests then skip, as they need a GPU per rank.
"""

from __future__ import annotations

import os
import sys

import pytest

import epmoe

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # launch.py (it adds the parent folder)
import gpu_workers  # noqa: E402
from launch import NCCL_SHARED, THREADS_SHARED, fresh_seed, needs_gpu, own_gpus, spawn  # noqa: E402

pytestmark = needs_gpu


def test_every_scenario_matches_the_cpu_path_over_a_gloo_group(tmp_path):
    out = spawn(gpu_workers.job_scenarios, "gloo", tmp_path, "scenarios")
    assert out[0]["done"] == out[1]["done"] and len(out[0]["done"]) >= 20
    print("\n".join(out[0]["done"]))


@own_gpus(NCCL_SHARED)
def test_scenarios_over_an_nccl_group(tmp_path):
    out = spawn(gpu_workers.job_quick, "nccl", tmp_path, "nccl")
    assert len(out[0]["done"]) == 6


def test_bad_inputs_raise_on_every_rank_without_a_hang(tmp_path):
    for r, out in enumerate(spawn(gpu_workers.job_errors, "gloo", tmp_path, "errors")):
        assert out["cpu_x"][0] == "invalid_argument" and "'x'" in out["cpu_x"][1], out["cpu_x"]
        assert out["float_x"][0] == "invalid_argument" and "'x'" in out["float_x"][1], out["float_x"]
        assert out["alloc_on_comm"][0] == "invalid_argument" and "allocate_on_comm_stream" in out["alloc_on_comm"][1]
        assert out["ll_cpu"][0] == "unsupported" and "low-latency" in out["ll_cpu"][1], out["ll_cpu"]
        assert out["comm_stream"] == (True, True) and out["comm_stream_idle"], out["comm_stream"]
        assert out["local_buffer"] == ((2, 8), True, True), out["local_buffer"]
        assert out["rdma_before_window"][0] == "invalid_argument" and "use_rdma_buffer" in out["rdma_before_window"][1]
        assert out["misaligned_offset"][0] == "invalid_argument" and "'offset'" in out["misaligned_offset"][1]
        assert out["zero_nvl_bytes"][0] == "invalid_argument" and "num_nvl_bytes" in out["zero_nvl_bytes"][1]
        assert out["too_small"][0] == "out_of_memory", out["too_small"]
        if "other_device" in out:
            assert out["other_device"][0] == "invalid_argument", out["other_device"]


def test_cupy_arrays_in_cupy_arrays_out(tmp_path):
    pytest.importorskip("cupy")
    assert spawn(gpu_workers.job_cupy, "gloo", tmp_path, "cupy")[0]["done"] == ["cupy_layout"]


@own_gpus(THREADS_SHARED)
def test_thread_ranks_on_two_gpus_in_one_process():
    done = gpu_workers.thread_rank_scenarios(fresh_seed("thread ranks"))
    assert len(done) == 2 * 6


def test_ops_on_cuda_tensors_run_on_the_current_stream_and_match_the_cpu():
    """Router, layout and fp8 quantization with torch CUDA tensors, issued on a side stream (epmoe must run
    on torch's current stream, so the results are ready once that stream is synchronised)."""
    import numpy as np
    from ep_scenarios import BF16, nice_bf16, torch_converters
    rng = np.random.default_rng(fresh_seed("ops"))
    to_gpu, to_numpy = torch_converters("cuda:0")
    x = nice_bf16(rng, (64, 384))
    logits = rng.standard_normal((64, 32)).astype(np.float32)
    idx = np.stack([rng.choice(32, size=4, replace=False) for _ in range(64)]).astype(np.int64)
    side = torch.cuda.Stream(device=0)
    with torch.cuda.device(0), torch.cuda.stream(side):
        xg, lg, ig = to_gpu(x), to_gpu(logits), to_gpu(idx)
        q, s = epmoe.quantize_fp8(xg)
        w, i = epmoe.topk_softmax(lg, 4)
        layout = epmoe.get_dispatch_layout(ig, 32, 4)
        side.synchronize()
        assert q.dtype == torch.float8_e4m3fn and q.device == xg.device
        ref_q, ref_s = epmoe.quantize_fp8(x)
        np.testing.assert_array_equal(to_numpy(q).view(np.uint8), ref_q.view(np.uint8))
        np.testing.assert_array_equal(to_numpy(s), ref_s)
        ref_w, ref_i = epmoe.topk_softmax(logits, 4)
        np.testing.assert_array_equal(to_numpy(i), ref_i)
        np.testing.assert_allclose(to_numpy(w), ref_w, rtol=1e-6, atol=1e-7)
        for g, r in zip(layout, epmoe.get_dispatch_layout(idx, 32, 4)):
            np.testing.assert_array_equal(to_numpy(g), r)
    assert x.dtype == BF16
