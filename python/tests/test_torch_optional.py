"""torch stays optional: epmoe imports without it; MoEModule exists only where torch imports."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import epmoe
from conftest import BF16, moe_ref, random_topk_idx, rel_l2


def test_importing_epmoe_does_not_import_torch():
    code = "import sys, epmoe; assert 'torch' not in sys.modules, 'epmoe imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_moe_module_on_cpu_tensors(rng):
    torch = pytest.importorskip("torch")
    E, T, H, N, K = 4, 5, 128, 32, 2
    w1 = (rng.standard_normal((E, 2 * N, H)) / np.sqrt(H)).astype(BF16)
    w2 = (rng.standard_normal((E, H, N)) / np.sqrt(N)).astype(BF16)
    x = rng.standard_normal((T, H)).astype(BF16)
    idx = random_topk_idx(rng, T, K, E)
    w = rng.uniform(0.1, 1.0, size=(T, K)).astype(np.float32)

    def to_torch(a):
        if a.dtype == BF16:
            return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(a.copy())

    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_reference_experts())
    module = epmoe.MoEModule(layer, to_torch(w1), to_torch(w2), global_num_experts=E)
    assert isinstance(module, torch.nn.Module)
    out = module(to_torch(x), to_torch(w), to_torch(idx))
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (T, H)
    assert rel_l2(out.float().numpy(), moe_ref(x, w1, w2, w, idx, "silu")) <= 1e-2
