"""The expert load recorder on a GPU from Python (semantics §9): epmoe.ExpertLoadRecorder(device='cuda:0') fed by
hand with torch CUDA counts and by epmoe.MoELayer forwards (no-EP, both formats, on a torch side stream), against
counts made here from topk_idx with NumPy and against a host recorder fed the same. Skipped without torch, a CUDA
build of epmoe or a GPU.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

import epmoe

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(
    not epmoe.built_with_cuda() or not torch.cuda.is_available(),
    reason=f"needs a CUDA build of epmoe (built_with_cuda={epmoe.built_with_cuda()}) and a GPU "
    f"(torch.cuda.is_available()={torch.cuda.is_available()})")

BF16 = epmoe.BFLOAT16


def fresh_rng(name: str) -> np.random.Generator:
    seed = int(os.environ.get("EPMOE_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"[{name}] seed={seed} (EPMOE_TEST_SEED={seed} reproduces it)")
    return np.random.default_rng(seed)


def bf16_cuda(a: np.ndarray) -> "torch.Tensor":
    return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to("cuda:0")


def test_device_recorder_matches_the_host_recorder():
    rng = fresh_rng("device_recorder")
    L, E, R, W = 2, 48, 4, 3
    dev = epmoe.ExpertLoadRecorder(L, E, R, W, device="cuda:0")
    host = epmoe.ExpertLoadRecorder(L, E, R, W)
    assert dev.device == "cuda:0"
    for step in range(8):
        layer = int(rng.integers(0, L))
        dtype = np.int32 if step % 2 else np.int64
        if step % 3:
            r = int(rng.integers(0, R))
            c = rng.integers(0, 500, size=E // R).astype(dtype)
            dev.record_local(layer, torch.from_numpy(c).to("cuda:0"), r * (E // R))
            host.record_local(layer, c, r * (E // R))
        else:
            c = rng.integers(0, 500, size=E).astype(dtype)
            dev.record(layer, torch.from_numpy(c).to("cuda:0"))
            host.record(layer, c)
        np.testing.assert_array_equal(dev.loads(), host.loads())
        np.testing.assert_array_equal(dev.num_records(), host.num_records())
    assert dev.to_json() == host.to_json()


@pytest.mark.parametrize("fmt", ["standard", "batched_experts"])
def test_no_ep_cuda_layer_records_on_a_side_stream(fmt):
    rng = fresh_rng(f"no_ep_cuda_{fmt}")
    E, K, H, N, W = 16, 4, 2048, 128, 2
    w1 = bf16_cuda((rng.standard_normal((E, 2 * N, H)) / np.sqrt(H)).astype(BF16))
    w2 = bf16_cuda((rng.standard_normal((E, H, N)) / np.sqrt(N)).astype(BF16))
    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(activation_format=fmt), epmoe.make_cuda_experts(fmt))
    rec = epmoe.ExpertLoadRecorder(1, E, 1, W, device="cuda:0")
    layer.set_load_recorder(rec, 0)
    counts = []
    side = torch.cuda.Stream()
    for _ in range(4):
        T = int(rng.integers(1, 40))
        idx = np.stack([rng.choice(E, size=K, replace=False) for _ in range(T)]).astype(np.int64)
        idx[rng.random(size=idx.shape) < 0.2] = -1
        x = bf16_cuda(rng.standard_normal((T, H)).astype(BF16))
        w = torch.from_numpy(rng.uniform(0.1, 1.0, size=(T, K)).astype(np.float32)).to("cuda:0")
        with torch.cuda.stream(side):
            layer.forward(x, w1, w2, w, torch.from_numpy(idx).to("cuda:0"))
            counts.append(np.bincount(idx[idx >= 0], minlength=E))
            np.testing.assert_array_equal(rec.loads()[0], np.sum(counts[-W:], axis=0))
    with pytest.raises(epmoe.Error, match="'load_recorder'"):  # a host recorder for a CUDA layer
        layer.set_load_recorder(epmoe.ExpertLoadRecorder(1, E, 1, W), 0)
        layer.forward(x, w1, w2, w, torch.from_numpy(idx).to("cuda:0"))
