"""The modular MoE layer (SPEC 7, 8) against a NumPy float64 reference (SPEC 13: relative L2 <= 1e-2)."""

from __future__ import annotations

import numpy as np
import pytest

import epmoe
from conftest import BF16, TIMEOUT_S, fp8_dequantize_ref, fp8_quantize_ref, moe_ref, random_topk_idx, rel_l2

H, N, K = 128, 64, 2


def make_weights(rng, E, gated=True):
    rows = 2 * N if gated else N
    w1 = (rng.standard_normal((E, rows, H)) / np.sqrt(H)).astype(BF16)
    w2 = (rng.standard_normal((E, H, N)) / np.sqrt(N)).astype(BF16)
    return w1, w2


def make_tokens(rng, T, E):
    x = rng.standard_normal((T, H)).astype(BF16)
    idx = random_topk_idx(rng, T, K, E, p_none=0.1)
    w = rng.uniform(0.1, 1.0, size=(T, K)).astype(np.float32)
    return x, idx, w


def seen_by_experts(x, dispatch_dtype):
    """The activations the experts read: x itself, or its fp8 quantize-dequantize round trip."""
    if dispatch_dtype == "bfloat16":
        return x
    q, s = fp8_quantize_ref(x)
    return fp8_dequantize_ref(q, s)


@pytest.mark.parametrize("activation", ["silu", "gelu", "relu2_no_mul"])
@pytest.mark.parametrize("experts", ["reference", "blas"])
def test_no_ep_layer_matches_numpy(rng, activation, experts):
    E, T = 6, 11
    w1, w2 = make_weights(rng, E, gated=activation in ("silu", "gelu"))
    x, idx, w = make_tokens(rng, T, E)
    make = epmoe.make_reference_experts if experts == "reference" else epmoe.make_blas_experts
    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), make(), chunk_size=4)
    out = layer.forward(x, w1, w2, w, idx, activation=activation, global_num_experts=E)
    assert out.dtype == BF16 and out.shape == (T, H)
    assert not np.any(np.isnan(out.astype(np.float32)))
    assert rel_l2(out, moe_ref(x, w1, w2, w, idx, activation)) <= 1e-2
    assert layer.last_chunk_rows == [4, 4, 3] and layer.stage == "INITIAL"


@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("mode,dispatch_dtype", [("normal", "bfloat16"), ("normal", "float8_e4m3fn"),
                                                 ("low_latency", "bfloat16"), ("low_latency", "float8_e4m3fn")])
def test_expert_parallel_layer_matches_numpy(rng, R, mode, dispatch_dtype):
    E, tmax = 2 * R, 8
    w1, w2 = make_weights(rng, E)
    Ts = [3 + r for r in range(R)]
    tokens = [make_tokens(rng, T, E) for T in Ts]
    el = E // R

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group, low_latency_mode=(mode == "low_latency"))
        if mode == "normal":
            pf = epmoe.make_normal_prepare_finalize(buf, dispatch_dtype=dispatch_dtype)
            experts = epmoe.make_reference_experts()
        else:
            pf = epmoe.make_low_latency_prepare_finalize(buf, tmax, dispatch_dtype=dispatch_dtype)
            experts = epmoe.make_reference_experts("batched_experts")
        layer = epmoe.MoELayer(pf, experts)
        x, idx, w = tokens[r]
        # this rank's experts only; global_num_experts defaults to E_local * ranks
        return layer.forward(x, w1[r * el:(r + 1) * el], w2[r * el:(r + 1) * el], w, idx)

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    for r in range(R):
        x, idx, w = tokens[r]
        ref = moe_ref(seen_by_experts(x, dispatch_dtype), w1, w2, w, idx, "silu")
        assert out[r].shape == (Ts[r], H)
        assert rel_l2(out[r], ref) <= 1e-2, (r, rel_l2(out[r], ref))


def test_shared_experts_run_beside_the_routed_ones(rng):
    E, T = 4, 7
    w1, w2 = make_weights(rng, E)
    x, idx, w = make_tokens(rng, T, E)
    seen = []

    def shared(hidden):
        seen.append(hidden.copy())
        return (hidden.astype(np.float64) * 2.0).astype(BF16)

    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_blas_experts(), shared_experts=shared,
                           workspaces=epmoe.WorkspaceCache())
    out, shared_out = layer.forward(x, w1, w2, w, idx)
    np.testing.assert_array_equal(seen[0].view(np.uint16), x.view(np.uint16))
    np.testing.assert_array_equal(shared_out.view(np.uint16), (x.astype(np.float64) * 2.0).astype(BF16).view(np.uint16))
    assert rel_l2(out, moe_ref(x, w1, w2, w, idx, "silu")) <= 1e-2


def test_layer_errors(rng):
    E, T = 4, 3
    w1, w2 = make_weights(rng, E)
    x, idx, w = make_tokens(rng, T, E)
    with pytest.raises(epmoe.Error) as e:  # standard prepare, batched experts: refused, naming both
        epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_reference_experts("batched_experts"))
    assert e.value.code == "invalid_argument" and "standard" in str(e.value) and "batched_experts" in str(e.value)
    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_reference_experts())
    with pytest.raises(epmoe.Error, match="activation"):
        layer.forward(x, w1, w2, w, idx, activation="tanh")
    with pytest.raises(epmoe.Error, match="'w1'"):
        layer.forward(x, w1.astype(np.float32), w2, w, idx)

    def failing_shared(hidden):
        raise KeyError("from the shared experts")

    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_reference_experts(),
                           shared_experts=failing_shared)
    with pytest.raises(KeyError, match="from the shared experts"):
        layer.forward(x, w1, w2, w, idx)


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_bad_weights_on_one_rank_fail_before_communicating_and_leave_the_layer_usable(rng, mode):
    # Rank 1 alone makes each bad call: had one communicated, it would wait for rank 0 (which makes no such
    # call) and time out, or leave the layer mid-way (stale_handle on the next call). Then both ranks run
    # valid calls on the same layers.
    R, E, T, tmax = 2, 4, 5, 8
    el = E // R
    w1, w2 = make_weights(rng, E)
    tokens = [make_tokens(rng, T, E) for _ in range(R)]

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group, low_latency_mode=(mode == "low_latency"))
        if mode == "normal":
            layer = epmoe.MoELayer(epmoe.make_normal_prepare_finalize(buf), epmoe.make_blas_experts())
        else:
            layer = epmoe.MoELayer(epmoe.make_low_latency_prepare_finalize(buf, tmax),
                                   epmoe.make_blas_experts("batched_experts"))
        x, idx, w = tokens[r]
        mine1, mine2 = w1[r * el:(r + 1) * el], w2[r * el:(r + 1) * el]
        errors = {}
        if r == 1:
            bad = {
                "w1_float32": (mine1.astype(np.float32), mine2),
                "w2_float32": (mine1, mine2.astype(np.float32)),
                "w2_wrong_n": (mine1, np.ones((el, H, N // 2), BF16)),
                "w2_wrong_h": (mine1, np.ones((el, H + 16, N), BF16)),
                "w1_wrong_h": (np.ones((el, 2 * N, H + 16), BF16), mine2),
            }
            for name, (a, b) in bad.items():
                with pytest.raises(epmoe.Error) as e:
                    layer.forward(x, a, b, w, idx, global_num_experts=E)
                errors[name] = (e.value.code, str(e.value), layer.stage)
        out = layer.forward(x, mine1, mine2, w, idx)
        return errors, out, layer.stage

    results = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    errors = results[1][0]
    for name, (code, msg, stage) in errors.items():
        assert code == "invalid_argument" and stage == "INITIAL", (name, code, msg, stage)
    assert "'w1'" in errors["w1_float32"][1] and "float32" in errors["w1_float32"][1]
    assert "'w2'" in errors["w2_float32"][1] and "float32" in errors["w2_float32"][1]
    # a bad w2 is blamed on w2, with the expected and the actual shape
    msg = errors["w2_wrong_n"][1]
    assert "'w2'" in msg and "'w1'" not in msg and f"[{el}, {H}, {N}]" in msg and f"[{el}, {H}, {N // 2}]" in msg
    msg = errors["w2_wrong_h"][1]
    assert "'w2'" in msg and f"[{el}, {H}, {N}]" in msg and f"[{el}, {H + 16}, {N}]" in msg
    msg = errors["w1_wrong_h"][1]
    assert "'w1'" in msg and f"H = {H} from hidden" in msg and f"[{el}, {2 * N}, {H + 16}]" in msg
    for r in range(R):
        x, idx, w = tokens[r]
        _, out, stage = results[r]
        assert stage == "INITIAL"
        assert rel_l2(out, moe_ref(x, w1, w2, w, idx, "silu")) <= 1e-2


def test_no_ep_layer_stays_usable_after_bad_weights(rng):
    E, T = 4, 3
    w1, w2 = make_weights(rng, E)
    x, idx, w = make_tokens(rng, T, E)
    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_reference_experts())
    with pytest.raises(epmoe.Error, match=r"'w2'.*expected shape \[4, 128, 64\].*got bfloat16\[4, 128, 32\]"):
        layer.forward(x, w1, w2[:, :, :32].copy(), w, idx, global_num_experts=E)
    with pytest.raises(epmoe.Error, match=r"'w2'.*bfloat16"):
        layer.forward(x, w1, w2.astype(np.float32), w, idx, global_num_experts=E)
    assert layer.stage == "INITIAL"
    out = layer.forward(x, w1, w2, w, idx, global_num_experts=E)
    assert rel_l2(out, moe_ref(x, w1, w2, w, idx, "silu")) <= 1e-2
