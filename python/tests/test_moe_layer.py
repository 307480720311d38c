"""The modular MoE layer (semantics §7, 8) against a NumPy float64 reference (semantics §13: relative L2 <= 1e-2)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import epmoe
from conftest import (BF16, TIMEOUT_S, Unwritten, fp8_dequantize_ref, fp8_quantize_ref, moe_ref, random_topk_idx,
                      rel_l2)

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
        w1_r, w2_r = w1[r * el:(r + 1) * el], w2[r * el:(r + 1) * el]
        unwritten = Unwritten(hidden=x, w1=w1_r, w2=w2_r, topk_weights=w, topk_idx=idx)  # semantics §1
        result = layer.forward(x, w1_r, w2_r, w, idx)
        unwritten.check()
        return result

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    for r in range(R):
        x, idx, w = tokens[r]
        ref = moe_ref(seen_by_experts(x, dispatch_dtype), w1, w2, w, idx, "silu")
        assert out[r].shape == (Ts[r], H)
        assert rel_l2(out[r], ref) <= 1e-2, (r, rel_l2(out[r], ref))


def make_shared_expert(rng):
    """A gated SiLU MLP as an engine's shared expert (float32 NumPy), its weights, and its float64 reference: moe_ref
    with one expert that every token picks with weight 1 (written independently of the callable)."""
    ws1 = (rng.standard_normal((1, 2 * N, H)) / np.sqrt(H)).astype(BF16)
    ws2 = (rng.standard_normal((1, H, N)) / np.sqrt(N)).astype(BF16)
    gate_up_w, down_w = ws1[0].astype(np.float32), ws2[0].astype(np.float32)

    def mlp(hidden):
        gate_up = hidden.astype(np.float32) @ gate_up_w.T
        gate, up = gate_up[:, :N], gate_up[:, N:]
        return ((gate / (1.0 + np.exp(-gate)) * up) @ down_w.T).astype(BF16)

    def reference(x):
        T = x.shape[0]
        return moe_ref(x, ws1, ws2, np.ones((T, 1), np.float32), np.zeros((T, 1), np.int64), "silu")

    return mlp, reference


def test_shared_experts_run_beside_the_routed_ones(rng):
    E, T = 4, 7
    w1, w2 = make_weights(rng, E)
    x, idx, w = make_tokens(rng, T, E)
    mlp, shared_ref = make_shared_expert(rng)
    seen = []

    def shared(hidden):
        seen.append(hidden.copy())
        return mlp(hidden)

    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_blas_experts(), shared_experts=shared,
                           workspaces=epmoe.WorkspaceCache())
    out, shared_out = layer.forward(x, w1, w2, w, idx)
    assert len(seen) == 1
    np.testing.assert_array_equal(seen[0].view(np.uint16), x.view(np.uint16))
    assert shared_out.dtype == BF16 and shared_out.shape == (T, H)
    assert rel_l2(shared_out, shared_ref(x)) <= 1e-2
    assert rel_l2(out, moe_ref(x, w1, w2, w, idx, "silu")) <= 1e-2


def test_shared_experts_overlap_the_dispatch_and_combine(rng):
    """Rank 0's shared experts must be running while its dispatch and combine run. They signal that they started, and
    only then does rank 1 enter its forward: rank 0's dispatch (a collective) cannot complete before they started.
    They then block until rank 1's forward has returned, which needs rank 0's dispatch and combine to complete while
    they still run. Run before the dispatch or after the combine instead, one of the waits (shorter than the group's
    timeout) runs out and its flag says which. Both outputs are checked against float64 references."""
    R, E = 2, 4
    el = E // R
    wait_s = TIMEOUT_S / 3  # well below the group's timeout: a missing overlap shows as a flag, not a timeout
    w1, w2 = make_weights(rng, E)
    mlp, shared_ref = make_shared_expert(rng)
    Ts = [5, 6]
    tokens = [make_tokens(rng, T, E) for T in Ts]
    shared_started, rank1_returned = threading.Event(), threading.Event()
    flags = {}

    def rank_main(group):
        r = group.rank()

        def shared(hidden):
            if r == 0:
                shared_started.set()
                flags["rank 1 returned before rank 0's shared experts started"] = rank1_returned.is_set()
                flags["rank 1 returned while rank 0's shared experts ran"] = rank1_returned.wait(wait_s)
            return mlp(hidden)

        buf = epmoe.Buffer(group)
        layer = epmoe.MoELayer(epmoe.make_normal_prepare_finalize(buf), epmoe.make_blas_experts(),
                               shared_experts=shared)
        x, idx, w = tokens[r]
        if r == 1:
            flags["rank 0's shared experts started before rank 1's forward"] = shared_started.wait(wait_s)
        result = layer.forward(x, w1[r * el:(r + 1) * el], w2[r * el:(r + 1) * el], w, idx)
        if r == 1:
            rank1_returned.set()
        return result

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    assert flags == {"rank 0's shared experts started before rank 1's forward": True,
                     "rank 1 returned before rank 0's shared experts started": False,
                     "rank 1 returned while rank 0's shared experts ran": True}
    for r in range(R):
        x, idx, w = tokens[r]
        routed, shared_out = out[r]
        assert routed.shape == (Ts[r], H) and shared_out.shape == (Ts[r], H)
        assert rel_l2(routed, moe_ref(x, w1, w2, w, idx, "silu")) <= 1e-2, r
        assert rel_l2(shared_out, shared_ref(x)) <= 1e-2, r


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


def test_arguments_the_binding_would_refuse_unnamed_are_named(rng):
    """None tensors, non-int or out-of-range integers, dtypes the tensor layer cannot hold and a shared-experts result
    of the wrong shape: each raises epmoe.Error('invalid_argument') naming the argument (nanobind's own TypeError, or
    one from inside the package, would not), and the layer stays usable."""
    E, T = 4, 5
    w1, w2 = make_weights(rng, E)
    x, idx, w = make_tokens(rng, T, E)
    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_blas_experts())

    def named(name, call):
        with pytest.raises(epmoe.Error) as e:
            call()
        assert e.value.code == "invalid_argument" and f"'{name}'" in str(e.value), str(e.value)
        return str(e.value)

    named("hidden", lambda: layer.forward(None, w1, w2, w, idx))
    named("topk_idx", lambda: layer.forward(x, w1, w2, w, None))
    assert "got '8'" in named("global_num_experts", lambda: layer.forward(x, w1, w2, w, idx, global_num_experts="8"))
    named("global_num_experts", lambda: layer.forward(x, w1, w2, w, idx, global_num_experts=2**40))
    assert "float32" in named("topk_weights", lambda: layer.forward(x, w1, w2, w.astype(np.float64), idx))
    assert "bfloat16" in named("hidden", lambda: layer.forward(x.view(np.uint16), w1, w2, w, idx))
    named("max_tokens_per_expert", lambda: epmoe.make_no_ep_prepare_finalize(
        activation_format="batched_experts", max_tokens_per_expert=2**70))
    named("chunk_size", lambda: epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_blas_experts(),
                                               chunk_size=2**70))
    named("num_topk", lambda: epmoe.topk_softmax(np.zeros((2, 8), np.float32), 2**40))
    named("use_ue8m0", lambda: epmoe.make_no_ep_prepare_finalize("float8_e4m3fn", use_ue8m0=True))
    shared = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_blas_experts(),
                            shared_experts=lambda h: h[:2])
    assert f"bfloat16[{T}, {H}]" in named("shared_experts", lambda: shared.forward(x, w1, w2, w, idx))
    out = layer.forward(x, w1, w2, w, idx)  # still usable
    assert rel_l2(out, moe_ref(x, w1, w2, w, idx, "silu")) <= 1e-2


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


# ------------------------------------------------------------------------------------------ the GPU path's API on CPU
# (python/tests/gpu/test_moe_layer_cuda.py runs it on a GPU)

@pytest.mark.skipif(epmoe.built_with_cuda(), reason="this build has CUDA (the GPU tests cover make_cuda_experts)")
def test_make_cuda_experts_without_cuda_says_so():
    for fmt in ("standard", "batched_experts"):
        with pytest.raises(epmoe.Error) as e:
            epmoe.make_cuda_experts(fmt)
        assert e.value.code == "unsupported" and "make_cuda_experts" in str(e.value) and "without CUDA" in str(e.value)
    # the arguments are still checked first
    with pytest.raises(epmoe.Error) as e:
        epmoe.make_cuda_experts("ragged")
    assert e.value.code == "invalid_argument" and "'activation_format'" in str(e.value) and "'ragged'" in str(e.value)


@pytest.mark.parametrize("experts", ["reference", "blas"])
@pytest.mark.parametrize("dispatch_dtype", ["bfloat16", "float8_e4m3fn"])
def test_no_ep_batched_layer_matches_numpy_and_writes_into_output(rng, experts, dispatch_dtype):
    E, T = 6, 9
    w1, w2 = make_weights(rng, E)
    x, idx, w = make_tokens(rng, T, E)
    make = epmoe.make_reference_experts if experts == "reference" else epmoe.make_blas_experts
    pf = epmoe.make_no_ep_prepare_finalize(dispatch_dtype, activation_format="batched_experts")
    assert pf.activation_format == "batched_experts"
    layer = epmoe.MoELayer(pf, make("batched_experts"))
    output = np.full((T, H), np.nan, dtype=BF16)  # poisoned: every element must be written
    got = layer.forward(x, w1, w2, w, idx, global_num_experts=E, output=output)
    assert got is output
    assert not np.any(np.isnan(output.astype(np.float32)))
    ref = moe_ref(seen_by_experts(x, dispatch_dtype), w1, w2, w, idx, "silu")
    assert rel_l2(output, ref) <= 1e-2, rel_l2(output, ref)
    # without an output array, and with slabs exactly as big as the busiest expert's count
    busiest = max(int(np.sum(idx == e)) for e in range(E))
    pf = epmoe.make_no_ep_prepare_finalize(dispatch_dtype, activation_format="batched_experts",
                                           max_tokens_per_expert=busiest)
    layer = epmoe.MoELayer(pf, make("batched_experts"))
    assert rel_l2(layer.forward(x, w1, w2, w, idx, global_num_experts=E), ref) <= 1e-2


def test_no_ep_batched_options_are_checked(rng):
    E, T = 4, 8
    w1, w2 = make_weights(rng, E)
    x, idx, w = make_tokens(rng, T, E)
    idx[:, 0] = 2  # expert 2 gets every token
    with pytest.raises(epmoe.Error) as e:
        epmoe.make_no_ep_prepare_finalize(max_tokens_per_expert=4)  # standard format: unused, so refused
    assert e.value.code == "invalid_argument" and "'max_tokens_per_expert'" in str(e.value)
    with pytest.raises(epmoe.Error) as e:
        epmoe.make_no_ep_prepare_finalize(activation_format="batched_experts", max_tokens_per_expert=-1)
    assert e.value.code == "invalid_argument" and "'max_tokens_per_expert'" in str(e.value)
    with pytest.raises(epmoe.Error, match="'activation_format'"):
        epmoe.make_no_ep_prepare_finalize(activation_format="ragged")
    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(activation_format="batched_experts",
                                                             max_tokens_per_expert=T - 1),
                           epmoe.make_reference_experts("batched_experts"))
    with pytest.raises(epmoe.Error) as e:  # slab rows too few for expert 2: says how many are needed
        layer.forward(x, w1, w2, w, idx, global_num_experts=E)
    need = int(np.sum(idx == 2))
    assert e.value.code == "out_of_memory" and "expert 2" in str(e.value) and f">= {need}" in str(e.value)
    assert layer.stage == "INITIAL"


def test_forward_output_argument_is_checked(rng):
    E, T = 4, 5
    w1, w2 = make_weights(rng, E)
    x, idx, w = make_tokens(rng, T, E)
    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_blas_experts())
    with pytest.raises(epmoe.Error) as e:
        layer.forward(x, w1, w2, w, idx, output=np.zeros((T, H + 8), BF16))
    assert e.value.code == "invalid_argument" and "'output'" in str(e.value) and f"[{T}, {H}]" in str(e.value)
    assert layer.stage == "INITIAL"
    output = np.full((T, H), np.nan, dtype=BF16)
    assert layer.forward(x, w1, w2, w, idx, output=output) is output
    assert rel_l2(output, moe_ref(x, w1, w2, w, idx, "silu")) <= 1e-2


class _FakeCudaArray:
    """Stands in for a CUDA tensor (DLPack device (2, 0)) in a build or on a machine without one: the layer must
    refuse it by its device, before handing anything to C++."""

    def __init__(self, like: np.ndarray) -> None:
        self.shape, self.dtype = like.shape, like.dtype

    def __dlpack_device__(self):
        return (2, 0)


@pytest.mark.parametrize("which", ["hidden", "w1", "w2", "topk_weights", "topk_idx", "output"])
def test_tensor_on_another_device_than_the_experts_is_named_before_any_work(rng, which):
    E, T = 4, 5
    w1, w2 = make_weights(rng, E)
    x, idx, w = make_tokens(rng, T, E)
    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_reference_experts())
    args = dict(hidden=x, w1=w1, w2=w2, topk_weights=w, topk_idx=idx, output=np.zeros((T, H), BF16))
    args[which] = _FakeCudaArray(args[which])
    with pytest.raises(epmoe.Error) as e:
        layer.forward(**args, global_num_experts=E)
    msg = str(e.value)
    assert e.value.code == "invalid_argument" and f"'{which}'" in msg and "cuda:0" in msg, msg
    if which == "hidden":
        assert "a CPU tensor" in msg and "'reference' experts run on the CPU" in msg, msg
    else:
        assert "a tensor on cpu" in msg, msg
    assert layer.stage == "INITIAL"
    assert rel_l2(layer.forward(x, w1, w2, w, idx, global_num_experts=E), moe_ref(x, w1, w2, w, idx, "silu")) <= 1e-2


# Dispatch hooks and DeepEP modes on one Buffer (semantics §8).

def _deepep_layer(group, mode, tmax, chunk_size=0):
    buf = epmoe.Buffer(group, low_latency_mode=True)
    return epmoe.MoELayer.from_buffer(buf, tmax, epmoe.make_reference_experts(),
                                      epmoe.make_reference_experts("batched_experts"), mode=mode,
                                      chunk_size=chunk_size)


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_dispatch_hooks_run_once_per_forward_between_the_halves_in_order(rng, mode):
    R, E, T = 2, 4, 10
    w1, w2 = make_weights(rng, E)
    tokens = [[make_tokens(rng, T, E) for _ in range(3)] for _ in range(R)]
    el = E // R

    def rank_main(group):
        r = group.rank()
        layer = _deepep_layer(group, mode, T, chunk_size=3)  # chunks: still one hook call per forward
        log, errors = [], []

        def run(i):
            log.append("forward")
            x, idx, w = tokens[r][i]
            out = layer.forward(x, w1[r * el:(r + 1) * el], w2[r * el:(r + 1) * el], w, idx)
            errors.append(rel_l2(out, moe_ref(x, w1, w2, w, idx, "silu")))

        first = layer.register_dispatch_hook(lambda pf: log.append(("first", pf.name, pf.stage)))
        second = layer.register_dispatch_hook(lambda pf: log.append(("second", pf.name, pf.stage)))
        assert layer.num_dispatch_hooks == 2
        run(0)
        second.remove()
        assert not second.active and first.active
        run(1)
        first.remove()
        first.remove()  # a no-op
        run(2)
        return log, errors, layer.num_dispatch_hooks

    for log, errors, remaining in epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S):
        assert log == ["forward", ("first", mode, "AFTER_DISPATCH_A"), ("second", mode, "AFTER_DISPATCH_A"),
                       "forward", ("first", mode, "AFTER_DISPATCH_A"), "forward"]
        assert max(errors) <= 1e-2 and remaining == 0


def test_a_dropped_hook_handle_keeps_the_hook_registered(rng):
    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_reference_experts())
    calls = []
    layer.register_dispatch_hook(lambda pf: calls.append(pf.stage))  # handle dropped at once
    E = 4
    w1, w2 = make_weights(rng, E)
    x, idx, w = make_tokens(rng, 5, E)
    layer.forward(x, w1, w2, w, idx)
    assert calls == ["AFTER_DISPATCH_A"] and layer.num_dispatch_hooks == 1
    with pytest.raises(epmoe.Error, match="hook"):
        layer.register_dispatch_hook(42)


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_a_raising_hook_propagates_and_the_layer_stays_usable(rng, mode):
    R, E, T = 2, 4, 8
    w1, w2 = make_weights(rng, E)
    tokens = [[make_tokens(rng, T, E) for _ in range(2)] for _ in range(R)]
    el = E // R

    class HookFailed(Exception):
        pass

    def rank_main(group):
        r = group.rank()
        layer = _deepep_layer(group, mode, T)

        def hook(pf):
            if r == 0:
                raise HookFailed(f"hook failed on rank {r}")

        handle = layer.register_dispatch_hook(hook)
        got = []
        for i in range(2):
            x, idx, w = tokens[r][i]
            try:
                out = layer.forward(x, w1[r * el:(r + 1) * el], w2[r * el:(r + 1) * el], w, idx)
                got.append(rel_l2(out, moe_ref(x, w1, w2, w, idx, "silu")))
            except HookFailed as e:
                got.append(str(e))
            handle.remove()
        return got, layer.stage

    results = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    assert results[0][0][0] == "hook failed on rank 0" and results[0][0][1] <= 1e-2
    assert results[1][0][0] <= 1e-2 and results[1][0][1] <= 1e-2
    assert results[0][1] == results[1][1] == "INITIAL"


def test_auto_mode_alternates_prefill_and_decode_on_one_buffer(rng):
    R, E, tmax = 2, 4, 6
    w1, w2 = make_weights(rng, E)
    # prefill, decode (clean), decode, prefill, decode (clean), prefill, decode (clean); decode T up to Tmax
    steps = [(True, 20), (False, tmax), (False, 3), (True, 15), (False, tmax), (True, 4), (False, tmax)]
    tokens = [[make_tokens(rng, T, E) for _, T in steps] for _ in range(R)]
    el = E // R

    def rank_main(group):
        r = group.rank()
        layer = _deepep_layer(group, "auto", tmax)
        seen = []
        layer.register_dispatch_hook(lambda pf: seen.append(pf.name))
        errors, modes = [], []
        for (extend, _), (x, idx, w) in zip(steps, tokens[r]):
            out = layer.forward(x, w1[r * el:(r + 1) * el], w2[r * el:(r + 1) * el], w, idx,
                                is_extend_in_batch=extend)
            errors.append(rel_l2(out, moe_ref(x, w1, w2, w, idx, "silu")))
            modes.append(layer.last_resolved_mode)
        return errors, modes, seen, layer.num_low_latency_cleans, layer.dispatch_mode

    want = [epmoe.resolve_dispatch_mode("auto", extend) for extend, _ in steps]
    assert want == ["normal", "low_latency", "low_latency", "normal", "low_latency", "normal", "low_latency"]
    for errors, modes, seen, cleans, mode in epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S):
        assert max(errors) <= 1e-2 and modes == want and seen == want and cleans == 3 and mode == "auto"


def test_auto_mode_errors_name_the_argument(rng):
    E, tmax = 4, 4
    w1, w2 = make_weights(rng, E)
    x, idx, w = make_tokens(rng, tmax + 1, E)

    def rank_main(group):
        layer = _deepep_layer(group, "auto", tmax)
        with pytest.raises(epmoe.Error, match="is_extend_in_batch"):
            layer.forward(x, w1, w2, w, idx)
        with pytest.raises(epmoe.Error, match="is_extend_in_batch"):
            layer.forward(x, w1, w2, w, idx, is_extend_in_batch=1)
        with pytest.raises(epmoe.Error, match=r"hidden.*num_max_dispatch_tokens_per_rank = 4"):
            layer.forward(x, w1, w2, w, idx, is_extend_in_batch=False)
        out = layer.forward(x, w1, w2, w, idx, is_extend_in_batch=True)  # prefill: normal mode takes T > Tmax
        return rel_l2(out, moe_ref(x, w1, w2, w, idx, "silu"))

    assert epmoe.run_thread_ranks(1, rank_main, timeout_s=TIMEOUT_S)[0] <= 1e-2
    with pytest.raises(epmoe.Error, match="mode"):
        epmoe.resolve_dispatch_mode("fast", True)

    def construct(group):
        buf = epmoe.Buffer(group, low_latency_mode=True)
        messages = []
        for kwargs in ({"mode": "fast"}, {"mode": "auto", "low_latency_experts": None},
                       {"mode": "low_latency", "low_latency_experts": epmoe.make_reference_experts()}):
            args = {"normal_experts": epmoe.make_reference_experts(),
                    "low_latency_experts": epmoe.make_reference_experts("batched_experts"), **kwargs}
            try:
                epmoe.MoELayer.from_buffer(buf, 4, **args)
                messages.append("accepted")
            except epmoe.Error as e:
                messages.append(str(e))
        return messages

    fast, missing, wrong_format = epmoe.run_thread_ranks(1, construct, timeout_s=TIMEOUT_S)[0]
    assert "mode" in fast and "fast" in fast
    assert "low_latency_experts" in missing and "null" in missing
    assert "low_latency_experts" in wrong_format and "batched_experts" in wrong_format


# ---- expert_map and the EPLB mapping (semantics §8, §9) ----

def test_no_ep_expert_map_selects_local_experts_and_bad_maps_are_named(rng):
    E, T = 8, 13
    w1, w2 = make_weights(rng, E)
    x, idx, w = make_tokens(rng, T, E)
    held = [6, 1, 3]  # local slots 0, 1, 2
    emap = np.full(E, -1, np.int32)
    emap[held] = np.arange(len(held), dtype=np.int32)
    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_reference_experts())
    out = layer.forward(x, w1[held], w2[held], w, idx, global_num_experts=E, expert_map=emap)
    local = np.where(np.isin(idx, held), idx, -1)  # choices of experts this rank does not hold contribute nothing
    assert rel_l2(out, moe_ref(x, w1, w2, w, local, "silu")) <= 1e-2
    bad = emap.copy()
    bad[0] = 1  # local id 1 twice
    with pytest.raises(epmoe.Error, match=r"'expert_map'.*at most once"):
        layer.forward(x, w1[held], w2[held], w, idx, global_num_experts=E, expert_map=bad)
    with pytest.raises(epmoe.Error, match=r"'expert_map'.*int32 \[8\]"):
        layer.forward(x, w1[held], w2[held], w, idx, global_num_experts=E, expert_map=emap.astype(np.int64))


@pytest.mark.parametrize("R", [2, 4])
def test_eplb_plan_in_forward_matches_the_unbalanced_layer(rng, R):
    E, T = 8, 24
    w1, w2 = make_weights(rng, E)
    hot = np.array([8.0, 4.0] + [1.0] * (E - 2))
    tokens = []
    for _ in range(R):
        x = rng.standard_normal((T, H)).astype(BF16)
        idx = np.stack([rng.choice(E, size=K, replace=False, p=hot / hot.sum()) for _ in range(T)]).astype(np.int64)
        tokens.append((x, idx, rng.uniform(0.1, 1.0, size=(T, K)).astype(np.float32)))
    counts = np.bincount(np.concatenate([t[1].ravel() for t in tokens]), minlength=E).astype(np.float64)
    P = E + R
    plan = epmoe.rebalance_experts(counts[None, :], P, 1, 1, R)
    phy2log = np.asarray(plan[0])[0]
    w1p, w2p, pl = w1[phy2log], w2[phy2log], P // R

    def rank_main(group):
        r = group.rank()
        layer = epmoe.MoELayer(epmoe.make_normal_prepare_finalize(epmoe.Buffer(group)), epmoe.make_reference_experts())
        x, idx, w = tokens[r]
        out = layer.forward(x, w1p[r * pl:(r + 1) * pl], w2p[r * pl:(r + 1) * pl], w, idx, eplb_plan=plan,
                            eplb_layer=0)
        assert layer._layer.eplb_layer == 0
        return out

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    if R == 2:  # a float plan is refused naming its part, not truncated into ids nobody planned
        layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_reference_experts())
        x, idx, w = tokens[0]
        float_plan = (plan[0], np.asarray(plan[1]) + 0.5, plan[2])
        with pytest.raises(epmoe.Error, match=r"'eplb_plan.log2phy'.*integer.*float64"):
            layer.forward(x, w1p, w2p, w, idx, eplb_plan=float_plan, eplb_layer=0)
        # a layer past the plan's is named as the caller typed it
        with pytest.raises(epmoe.Error, match=r"'eplb_layer': expected a layer of the plan, in \[0, 1\), got 5"):
            layer.forward(x, w1p, w2p, w, idx, eplb_plan=plan, eplb_layer=5)
    before = np.bincount(np.concatenate([t[1].ravel() for t in tokens]) // (E // R), minlength=R)
    phys = np.concatenate([epmoe.map_to_physical(t[1], plan[1], plan[2], 0).ravel() for t in tokens])
    after = np.bincount(phys // pl, minlength=R)
    assert after.max() / after.mean() < before.max() / before.mean()
    for r in range(R):
        x, idx, w = tokens[r]
        assert rel_l2(out[r], moe_ref(x, w1, w2, w, idx, "silu")) <= 1e-2


# ---- the all-gather + reduce-scatter baseline (make_all_gather_prepare_finalize) ----

@pytest.mark.parametrize("R", [1, 2, 4])
@pytest.mark.parametrize("dispatch_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("group_kind", ["threads", "from_all_gather"])
def test_all_gather_layer_matches_numpy_and_normal_mode_bit_for_bit(rng, R, dispatch_dtype, group_kind):
    E = 2 * R
    w1, w2 = make_weights(rng, E)
    Ts = [5 + 2 * r if r != 1 else 0 for r in range(R)]  # rank 1 has no tokens
    tokens = [make_tokens(rng, T, E) for T in Ts]
    el = E // R

    def rank_main(group):
        r = group.rank()
        inner = group
        if group_kind == "from_all_gather":  # a Group implemented in Python: Group's default reduce-scatter
            group = epmoe.Group.from_all_gather(r, R, "python-test",
                                                lambda data, phase: b"".join(inner.all_gather_bytes(data, phase)))
        # normal mode over the thread group's Buffer (a CPU Buffer needs a threads or MPI group)
        buf = epmoe.Buffer(inner if group_kind == "from_all_gather" else group)
        ag_on = group if group_kind == "from_all_gather" else buf
        x, idx, w = tokens[r]
        outs = []
        for pf in (epmoe.make_all_gather_prepare_finalize(ag_on, dispatch_dtype=dispatch_dtype),
                   epmoe.make_normal_prepare_finalize(buf, dispatch_dtype=dispatch_dtype)):
            layer = epmoe.MoELayer(pf, epmoe.make_reference_experts())
            outs.append(layer.forward(x, w1[r * el:(r + 1) * el], w2[r * el:(r + 1) * el], w, idx))
        return outs

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    for r in range(R):
        x, idx, w = tokens[r]
        ag, normal = out[r]
        assert ag.shape == (Ts[r], H)
        if Ts[r]:
            ref = moe_ref(seen_by_experts(x, dispatch_dtype), w1, w2, w, idx, "silu")
            assert rel_l2(ag, ref) <= 1e-2, (r, rel_l2(ag, ref))
        assert ag.view(np.uint16).tobytes() == normal.view(np.uint16).tobytes(), r


def test_all_gather_layer_errors_name_the_argument(rng):
    with pytest.raises(epmoe.Error, match="use_ue8m0"):
        epmoe.make_all_gather_prepare_finalize(None, dispatch_dtype="float8_e4m3fn", use_ue8m0=True)
    with pytest.raises(epmoe.Error, match="buffer"):
        epmoe.make_all_gather_prepare_finalize(object())
    w1, w2 = make_weights(rng, 3)
    x, idx, w = make_tokens(rng, 4, 3)

    def rank_main(group):
        layer = epmoe.MoELayer(epmoe.make_all_gather_prepare_finalize(epmoe.Buffer(group)),
                               epmoe.make_reference_experts())
        with pytest.raises(epmoe.Error, match="global_num_experts"):
            layer.forward(x, w1[:1], w2[:1], w, idx, global_num_experts=3)
        return True

    assert epmoe.run_thread_ranks(2, rank_main, timeout_s=TIMEOUT_S) == [True, True]
