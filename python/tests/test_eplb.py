"""EPLB planner, routing step and load recorder (semantics §9) from Python: a hand-made case, an independent
NumPy (float64) reference of DeepSeek's EPLB compared exactly on random loads, torch in / torch out, errors."""

from __future__ import annotations

import json
from typing import List, Tuple

import numpy as np
import pytest

import epmoe
from conftest import BF16


# ------------------------------------------------------------------------------ reference (never calls epmoe)

def _pack(loads: List[float], num_packs: int) -> List[List[int]]:
    """Balanced packing: each pack gets len/num_packs items; heaviest first (ties: lower index) into the
    lightest pack with room (ties: lower pack). One item per pack: item i -> pack i. Returns items per pack
    in the order they were put in."""
    per = len(loads) // num_packs
    if per == 1:
        return [[i] for i in range(len(loads))]
    packs: List[List[int]] = [[] for _ in range(num_packs)]
    total = [0.0] * num_packs
    for item in sorted(range(len(loads)), key=lambda i: (-loads[i], i)):
        room = [p for p in range(num_packs) if len(packs[p]) < per]
        p = min(room, key=lambda q: (total[q], q))
        packs[p].append(item)
        total[p] += loads[item]
    return packs


def eplb_reference(weight: np.ndarray, P: int, G: int, N: int, M: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    L, E = weight.shape
    if G % N != 0:
        G, N = 1, 1
    gs = E // G
    phy2log = np.full((L, P), -1, dtype=np.int64)
    rank = np.full((L, P), -1, dtype=np.int64)
    logcnt = np.zeros((L, E), dtype=np.int64)
    for l in range(L):
        w = [float(x) for x in weight[l]]
        group_load = [0.0] * G
        for g in range(G):
            for j in range(gs):
                group_load[g] += w[g * gs + j]
        for n, groups in enumerate(_pack(group_load, N)):
            experts = [g * gs + j for g in groups for j in range(gs)]  # this node's experts, in pack order
            cnt = np.ones(len(experts), dtype=np.int64)
            slots = list(range(len(experts)))  # slot -> index into experts
            reps = [0] * len(experts)
            nw = np.array([w[e] for e in experts], dtype=np.float64)
            for _ in range(P // N - len(experts)):
                k = int(np.argmax(nw / cnt))  # first maximum: ties to the lower index
                slots.append(k)
                reps.append(int(cnt[k]))
                cnt[k] += 1
            per_slot = [float(nw[k] / cnt[k]) for k in slots]
            order = [s for gpu in _pack(per_slot, M // N) for s in gpu]  # GPU-major
            for i, s in enumerate(order):
                phy2log[l, n * (P // N) + i] = experts[slots[s]]
                rank[l, n * (P // N) + i] = reps[s]
            for k, e in enumerate(experts):
                logcnt[l, e] = cnt[k]
    X = int(logcnt.max()) if L else 1
    log2phy = np.full((L, E, X), -1, dtype=np.int64)
    for l in range(L):
        for p in range(P):
            log2phy[l, phy2log[l, p], rank[l, p]] = p
    return phy2log, log2phy, logcnt


# ------------------------------------------------------------------------------------------------- tests

def test_hand_case_one_node_two_gpus():
    # E=4, P=6, 1 node, 2 GPUs, loads [10, 20, 40, 30] (worked out in tests/eplb/eplb_test.cpp): experts 2 and
    # 3 get a second replica; GPU 0 holds experts [1, 2, 0], GPU 1 holds [2, 3, 3] (50 tokens each).
    phy2log, log2phy, logcnt = epmoe.rebalance_experts(np.array([[10, 20, 40, 30]], dtype=np.float64), 6, 1, 1, 2)
    assert phy2log.dtype == np.int64 and log2phy.dtype == np.int64 and logcnt.dtype == np.int64
    np.testing.assert_array_equal(phy2log, [[1, 2, 0, 2, 3, 3]])
    np.testing.assert_array_equal(logcnt, [[1, 1, 2, 2]])
    np.testing.assert_array_equal(log2phy, [[[2, -1], [0, -1], [3, 1], [4, 5]]])
    # Routing: token t takes replica t mod count. Token 0: [2, 3, -1] -> [3, 4, -1]; token 1: [2, 0, 3] ->
    # [1, 2, 5]; token 2: [-1, 1, 2] -> [-1, 0, 3].
    idx = np.array([[2, 3, -1], [2, 0, 3], [-1, 1, 2]], dtype=np.int32)
    out = epmoe.map_to_physical(idx, log2phy, logcnt, 0)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, [[3, 4, -1], [1, 2, 5], [-1, 0, 3]])


@pytest.mark.parametrize("L,E,P,G,N,M", [
    (3, 16, 24, 4, 2, 4), (2, 64, 80, 8, 4, 8), (2, 32, 48, 8, 1, 4), (2, 24, 32, 3, 2, 4),
    (2, 8, 8, 2, 2, 8), (2, 12, 16, 4, 2, 2), (2, 256, 288, 8, 4, 32)])
def test_matches_reference_on_random_loads(rng, L, E, P, G, N, M):
    for _ in range(5):
        w = np.floor(rng.lognormal(4.0, 1.5, size=(L, E)))
        w[rng.random((L, E)) < 0.1] = 0.0
        w[0, 0] += 1
        if rng.random() < 0.5:
            w = w + rng.random((L, E))  # non-integer loads too
        got = epmoe.rebalance_experts(w, P, G, N, M)
        want = eplb_reference(w, P, G, N, M)
        for g, r, name in zip(got, want, ["phy2log", "log2phy", "logcnt"]):
            np.testing.assert_array_equal(g, r, err_msg=name)
        # map_to_physical keeps -1 and lands in the replicas of the right expert.
        idx = rng.integers(-1, E, size=(40, 3), dtype=np.int64)
        for layer in range(L):
            phys = epmoe.map_to_physical(idx, got[1], got[2], layer)
            assert np.all((phys == -1) == (idx == -1))
            ok = idx >= 0
            np.testing.assert_array_equal(got[0][layer][phys[ok]], idx[ok])


def test_torch_in_torch_out():
    torch = pytest.importorskip("torch")
    w = torch.tensor([[10.0, 20.0, 40.0, 30.0]])
    phy2log, log2phy, logcnt = epmoe.rebalance_experts(w, 6, 1, 1, 2)
    assert isinstance(phy2log, torch.Tensor) and phy2log.dtype == torch.int64
    assert phy2log.tolist() == [[1, 2, 0, 2, 3, 3]]
    out = epmoe.map_to_physical(torch.tensor([[2, 3, -1]]), log2phy, logcnt, 0)
    assert isinstance(out, torch.Tensor) and out.tolist() == [[3, 4, -1]]
    rec = epmoe.ExpertLoadRecorder(1, 4, 2, 2)
    rec.record(0, torch.tensor([1, 2, 3, 4], dtype=torch.int32))
    assert rec.loads().tolist() == [[1, 2, 3, 4]]


def test_recorder_window_balancedness_and_json():
    # L=2, E=4, R=2, window 2. Layer 0 records [1,2,3,4], [5,0,0,1], [2,2,2,2] -> last two sum [7, 2, 2, 3];
    # ranks 9 and 5 -> balancedness 7 / 9. Layer 1 has none: loads 0, balancedness 1.
    rec = epmoe.ExpertLoadRecorder(2, 4, 2, 2)
    for c in ([1, 2, 3, 4], [5, 0, 0, 1], [2, 2, 2, 2]):
        rec.record(0, np.array(c, dtype=np.int32))
    np.testing.assert_array_equal(rec.loads(), [[7, 2, 2, 3], [0, 0, 0, 0]])
    np.testing.assert_allclose(rec.balancedness(), [7 / 9, 1.0], rtol=0, atol=1e-15)
    np.testing.assert_array_equal(rec.num_records(), [2, 0])
    j = json.loads(rec.to_json())
    assert j["loads"] == [[7, 2, 2, 3], [0, 0, 0, 0]] and j["window"] == 2 and j["num_ranks"] == 2
    rec.reset()
    np.testing.assert_array_equal(rec.loads(), np.zeros((2, 4)))


def test_recorder_random_window(rng):
    rec = epmoe.ExpertLoadRecorder(1, 8, 4, 3)
    history = []
    for _ in range(10):
        c = rng.integers(0, 1000, size=8, dtype=np.int32)
        history.append(c.astype(np.int64))
        rec.record(0, c)
        np.testing.assert_array_equal(rec.loads()[0], np.sum(history[-3:], axis=0))


def test_logical_loads_fold_the_counts_of_mapped_ids(rng):
    """Count the physical slots random logical ids map to, fold them back: the logical counts, counted by hand."""
    L, E, P, T, K = 2, 8, 12, 300, 3
    phy2log, log2phy, logcnt = epmoe.rebalance_experts(rng.integers(0, 100, size=(L, E)).astype(np.float64),
                                                       P, 2, 1, 4)
    physical = np.zeros((L, P), np.int64)
    want = np.zeros((L, E), np.int64)
    for layer in range(L):
        idx = np.stack([rng.choice(E, size=K, replace=False) for _ in range(T)]).astype(np.int64)
        idx[rng.random(idx.shape) < 0.1] = -1
        phy = epmoe.map_to_physical(idx, log2phy, logcnt, layer)
        for e, p in zip(idx.ravel(), phy.ravel()):
            if e >= 0:
                want[layer, e] += 1
                physical[layer, p] += 1
    np.testing.assert_array_equal(epmoe.logical_loads(physical, phy2log, E), want)
    with pytest.raises(epmoe.Error, match="'physical_loads'"):
        epmoe.logical_loads(physical[:, :-1], phy2log, E)
    bad = physical.copy()
    bad[1, 2] = -3
    with pytest.raises(epmoe.Error, match=r"-3 at \[1, 2\]"):
        epmoe.logical_loads(bad, phy2log, E)


def test_float_counts_and_maps_are_refused_not_truncated(rng):
    """A float array where epmoe reads integers (loads, maps, counts) is refused naming the argument, not truncated:
    0.9 loads would count 0, a NaN would show as a count the caller never gave."""
    L, E, P = 1, 6, 8
    phy2log, log2phy, logcnt = epmoe.rebalance_experts(rng.integers(1, 50, size=(L, E)).astype(np.float64), P, 1, 1, 2)
    loads = np.full((L, P), 0.9)
    with pytest.raises(epmoe.Error, match=r"'physical_loads'.*integer.*float64\[1, 8\]"):
        epmoe.logical_loads(loads, phy2log, E)
    with pytest.raises(epmoe.Error, match=r"'physical_loads'.*float64"):
        epmoe.logical_loads(np.full((L, P), np.nan), phy2log, E)
    idx = rng.integers(0, E, size=(5, 2)).astype(np.int64)
    with pytest.raises(epmoe.Error, match=r"'logical_to_physical'.*float64"):
        epmoe.map_to_physical(idx, np.asarray(log2phy) + 0.7, logcnt, 0)
    with pytest.raises(epmoe.Error, match=r"'logical_replica_count'.*float64"):
        epmoe.map_to_physical(idx, log2phy, np.asarray(logcnt) + 0.9, 0)
    with pytest.raises(epmoe.Error, match=r"'loads'.*float32"):
        epmoe.eplb.load_balancedness(np.ones((L, E), np.float32), 2)
    # integers of any width still pass, with the same results as int64
    np.testing.assert_array_equal(epmoe.logical_loads(np.ones((L, P), np.int32), phy2log, E),
                                  epmoe.logical_loads(np.ones((L, P), np.int64), phy2log, E))


def test_a_weight_that_is_not_integer_or_floating_is_refused_naming_its_dtype():
    """Found by a fresh user: rebalance_experts planned from digit strings, complex loads (imaginary parts dropped),
    booleans and object arrays as NumPy converted them, and raised NumPy's ValueError (naming no argument) for other
    strings. Any weight that is not an integer or floating array is refused naming 'weight', the dtypes taken and its
    own; integers of any width, float16 and ml_dtypes' bfloat16 still plan as their float64 values do."""
    want = epmoe.rebalance_experts(np.array([[10.0, 20, 40, 30]]), 6, 1, 1, 2)
    numeric = "an integer or floating array (float64 values)"
    for weight, expected, got in [
        (np.array([["10", "20", "40", "30"]]), numeric, "<U2[1, 4]"),
        ([["10", "20", "40", "30"]], numeric, "<U2[1, 4]"),
        (np.array([["a", "b", "c", "d"]]), numeric, "<U1[1, 4]"),
        (np.array([[10, 20, 40, 30]], np.complex128), numeric, "complex128[1, 4]"),
        (np.array([[True, False, True, True]]), numeric, "bool[1, 4]"),
        (np.array([[10, 20, 40, 30]], dtype=object), numeric, "object[1, 4]"),
        (np.array([[10, 20, 40, 30]], dtype="timedelta64[s]"), numeric, "timedelta64[s][1, 4]"),
        ([[10, 20], [30]], "an array (or nested lists of one shape)", "an object of type list"),
    ]:
        with pytest.raises(epmoe.Error) as e:
            epmoe.rebalance_experts(weight, 6, 1, 1, 2)
        assert (e.value.code, str(e.value)) == (
            "invalid_argument", f"epmoe: invalid argument 'weight': expected {expected}, got {got}"), weight
    for dtype in (np.int32, np.uint8, np.float16, BF16):
        got = epmoe.rebalance_experts(np.array([[10, 20, 40, 30]]).astype(dtype), 6, 1, 1, 2)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("args,name", [
    ((np.ones((2, 4)), 8, 1, 1, 3), "num_replicas"),
    ((np.ones((2, 4)), 3, 1, 1, 1), "num_replicas"),
    ((np.ones((2, 4)), 8, 3, 1, 2), "num_groups"),
    ((np.ones((2, 4)), 8, 2, 2, 3), "num_gpus"),
    ((np.ones((2, 4)), 8, 2, 0, 2), "num_nodes"),
    ((np.ones(4), 8, 2, 1, 2), "weight"),
    ((-np.ones((2, 4)), 8, 2, 1, 2), "weight"),
])
def test_planner_errors_name_the_argument(args, name):
    with pytest.raises(epmoe.Error, match=f"'{name}'") as e:
        epmoe.rebalance_experts(*args)
    assert e.value.code == "invalid_argument"


def test_routing_and_recorder_errors_name_the_argument():
    _, log2phy, logcnt = epmoe.rebalance_experts(np.array([[10.0, 20, 40, 30]]), 6, 1, 1, 2)
    with pytest.raises(epmoe.Error, match="'layer'"):
        epmoe.map_to_physical(np.zeros((2, 2), np.int64), log2phy, logcnt, 1)
    with pytest.raises(epmoe.Error, match="'topk_idx'"):
        epmoe.map_to_physical(np.full((2, 2), 4, np.int64), log2phy, logcnt, 0)
    with pytest.raises(epmoe.Error, match="'topk_idx'"):
        epmoe.map_to_physical(np.zeros((2, 2), np.float32), log2phy, logcnt, 0)
    with pytest.raises(epmoe.Error, match="'logical_replica_count'"):
        epmoe.map_to_physical(np.zeros((2, 2), np.int64), log2phy, logcnt[:, :3], 0)
    with pytest.raises(epmoe.Error, match="'logical_to_physical'"):
        epmoe.map_to_physical(np.zeros((2, 2), np.int64), log2phy[0], logcnt, 0)
    with pytest.raises(epmoe.Error, match="'num_ranks'"):
        epmoe.ExpertLoadRecorder(1, 4, 3, 1)
    with pytest.raises(epmoe.Error, match="'window'"):
        epmoe.ExpertLoadRecorder(1, 4, 2, 0)
    # Found by a fresh user: a window whose history cannot fit in memory failed in the allocation, naming nothing;
    # it is named before allocating. Ints outside int64 are named too (not nanobind's TypeError).
    with pytest.raises(epmoe.Error) as e:
        epmoe.ExpertLoadRecorder(1, 4, 2, 2**40)
    assert e.value.code == "out_of_memory" and "'window' = 1099511627776" in str(e.value), str(e.value)
    for name, args in (("num_layers", (2**64, 4, 2, 1)), ("num_experts", (1, 2**64, 2, 1)),
                       ("num_ranks", (1, 4, 2**64, 1)), ("window", (1, 4, 2, 2**64))):
        with pytest.raises(epmoe.Error) as e:
            epmoe.ExpertLoadRecorder(*args)
        assert e.value.code == "invalid_argument" and f"'{name}'" in str(e.value) and str(2**64) in str(e.value)
    with pytest.raises(epmoe.Error, match="'num_replicas'.*18446744073709551616"):
        epmoe.rebalance_experts(np.ones((1, 4)), 2**64, 1, 1, 2)
    rec = epmoe.ExpertLoadRecorder(1, 4, 2, 1)
    with pytest.raises(epmoe.Error, match="'num_tokens_per_expert'"):
        rec.record(0, np.ones(3, np.int32))
    with pytest.raises(epmoe.Error, match="'layer'"):
        rec.record(1, np.ones(4, np.int32))


# ------------------------------------------------------------------ the recorder fed by MoELayer forwards

def _hand_count(idx: np.ndarray, E: int) -> np.ndarray:
    """Tokens choosing each expert, -1 skipped (written here, independent of epmoe)."""
    ids = idx[idx >= 0]
    return np.bincount(ids, minlength=E).astype(np.int64)


def test_recorder_local_records_global_loads_and_balancedness(rng):
    # Each thread rank records its own 2 experts' counts at offset 2 * rank; global_loads sums them.
    R, el, W = 3, 2, 2
    E = R * el
    steps = [[rng.integers(0, 100, size=el, dtype=np.int32) for _ in range(R)] for _ in range(4)]
    want = np.zeros(E, np.int64)
    for s in steps[-W:]:
        for r in range(R):
            want[r * el:(r + 1) * el] += s[r]

    def rank_main(group):
        r = group.rank()
        rec = epmoe.ExpertLoadRecorder(1, E, R, W)
        for s in steps:
            rec.record_local(0, s[r], r * el)
        own = rec.loads()
        return own, rec.global_loads(group), json.loads(rec.to_json(group))

    for r, (own, glob, j) in enumerate(epmoe.run_thread_ranks(R, rank_main, timeout_s=30.0)):
        mine = np.zeros(E, np.int64)
        mine[r * el:(r + 1) * el] = want[r * el:(r + 1) * el]
        np.testing.assert_array_equal(own[0], mine)
        np.testing.assert_array_equal(glob[0], want)
        assert j["loads"] == [want.tolist()]
        per_rank = want.reshape(R, el).sum(axis=1)
        assert abs(j["balancedness"][0] - per_rank.mean() / per_rank.max()) < 1e-12
    np.testing.assert_allclose(epmoe.eplb.load_balancedness(want[None, :], R),
                               [want.reshape(R, el).sum(1).mean() / want.reshape(R, el).sum(1).max()], atol=1e-15)
    rec = epmoe.ExpertLoadRecorder(1, 4, 2, 1)
    with pytest.raises(epmoe.Error, match="'expert_offset'"):
        rec.record_local(0, np.ones(2, np.int32), 3)
    with pytest.raises(epmoe.Error, match="'device'"):
        epmoe.ExpertLoadRecorder(1, 4, 2, 1, device="tpu")
    assert rec.device == "cpu" and "device='cpu'" in repr(rec)


@pytest.mark.parametrize("R", [1, 2, 4])
@pytest.mark.parametrize("mode", ["normal", "low_latency", "auto"])
def test_moe_layer_records_every_forward(rng, R, mode):
    H, N, K, tmax, W, steps = 128, 32, 2, 12, 3, 5
    E = 2 * R
    el = E // R
    w1 = (rng.standard_normal((E, 2 * N, H)) / np.sqrt(H)).astype(epmoe.BFLOAT16)
    w2 = (rng.standard_normal((E, H, N)) / np.sqrt(N)).astype(epmoe.BFLOAT16)
    tokens = []  # [step][rank]; the last rank sends nothing on step 1
    for s in range(steps):
        row = []
        for r in range(R):
            T = 0 if (R > 1 and r == R - 1 and s == 1) else int(rng.integers(1, tmax + 1))
            idx = np.stack([rng.choice(E, size=K, replace=False) for _ in range(T)]).astype(np.int64) if T \
                else np.zeros((0, K), np.int64)
            idx[rng.random(size=idx.shape) < 0.2] = -1
            row.append((rng.standard_normal((T, H)).astype(epmoe.BFLOAT16), idx,
                        rng.uniform(0.1, 1.0, size=(T, K)).astype(np.float32)))
        tokens.append(row)
    want = sum(_hand_count(tokens[s][r][1], E) for s in range(steps - W, steps) for r in range(R))

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group)
        layer = epmoe.MoELayer.from_buffer(buf, tmax, epmoe.make_reference_experts(),
                                           epmoe.make_reference_experts("batched_experts"), mode=mode)
        rec = epmoe.ExpertLoadRecorder(2, E, R, W)
        layer.set_load_recorder(rec, 1)
        assert layer.load_recorder is rec and layer.load_recorder_layer == 1
        for s in range(steps):
            x, idx, w = tokens[s][r]
            layer.forward(x, w1[r * el:(r + 1) * el], w2[r * el:(r + 1) * el], w, idx,
                          is_extend_in_batch=(s % 2 == 0))
        return rec.loads(), rec.global_loads(group), rec.num_records()

    for r, (own, glob, n) in enumerate(epmoe.run_thread_ranks(R, rank_main, timeout_s=30.0)):
        mine = np.zeros(E, np.int64)
        mine[r * el:(r + 1) * el] = want[r * el:(r + 1) * el]
        np.testing.assert_array_equal(own, np.stack([np.zeros(E, np.int64), mine]))
        np.testing.assert_array_equal(glob[1], want)
        np.testing.assert_array_equal(n, [0, W])
    # The planner on the recorded loads: every slot filled, two spare slots per rank.
    phy2log, _, logcnt = epmoe.rebalance_experts(glob[1:].astype(np.float64), E + 2 * R, 1, 1, R)
    assert phy2log.shape == (1, E + 2 * R) and int(logcnt.sum()) == E + 2 * R


def test_moe_layer_recorder_errors(rng):
    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_reference_experts())
    with pytest.raises(epmoe.Error, match="'layer'"):
        layer.set_load_recorder(epmoe.ExpertLoadRecorder(2, 4, 1, 1), 2)
    with pytest.raises(epmoe.Error, match="'recorder'"):
        layer.set_load_recorder(object(), 0)
    layer.set_load_recorder(epmoe.ExpertLoadRecorder(1, 8, 1, 1), 0)  # 8 experts, the layer runs 4
    x = rng.standard_normal((5, 128)).astype(epmoe.BFLOAT16)
    w1 = (rng.standard_normal((4, 64, 128)) / 12).astype(epmoe.BFLOAT16)
    w2 = (rng.standard_normal((4, 128, 32)) / 6).astype(epmoe.BFLOAT16)
    idx = np.stack([rng.choice(4, size=2, replace=False) for _ in range(5)]).astype(np.int64)
    w = np.full((5, 2), 0.5, np.float32)
    with pytest.raises(epmoe.Error, match="'load_recorder'"):
        layer.forward(x, w1, w2, w, idx, global_num_experts=4)
    rec = epmoe.ExpertLoadRecorder(1, 4, 1, 2)
    layer.set_load_recorder(rec, 0)
    layer.forward(x, w1, w2, w, idx, global_num_experts=4)  # the layer stayed usable
    np.testing.assert_array_equal(rec.loads()[0], _hand_count(idx, 4))
    layer.set_load_recorder(None)
    assert layer.load_recorder is None
    layer.forward(x, w1, w2, w, idx, global_num_experts=4)
    np.testing.assert_array_equal(rec.loads()[0], _hand_count(idx, 4))


def test_none_for_an_array_is_named():
    """None where an array goes: epmoe.Error naming the argument (NumPy made it a 0-d object array, nanobind a
    TypeError naming no argument)."""
    weight = np.ones((1, 4))
    phy2log, log2phy, logcnt = epmoe.rebalance_experts(weight, 4, 1, 1, 1)
    rec = epmoe.ExpertLoadRecorder(num_layers=1, num_experts=4, num_ranks=1, window=2)
    cases = [
        (lambda: epmoe.rebalance_experts(None, 4, 1, 1, 1), "weight"),
        (lambda: epmoe.map_to_physical(None, log2phy, logcnt, 0), "topk_idx"),
        (lambda: epmoe.map_to_physical(np.zeros((1, 1), np.int64), None, logcnt, 0), "logical_to_physical"),
        (lambda: epmoe.map_to_physical(np.zeros((1, 1), np.int64), log2phy, None, 0), "logical_replica_count"),
        (lambda: epmoe.logical_loads(None, phy2log, 4), "physical_loads"),
        (lambda: epmoe.logical_loads(np.ones((1, 4), np.int64), None, 4), "physical_to_logical"),
        (lambda: rec.record(0, None), "num_tokens_per_expert"),
        (lambda: rec.record_local(0, None, 0), "num_recv_tokens_per_expert"),
    ]
    for call, name in cases:
        with pytest.raises(epmoe.Error) as e:
            call()
        assert e.value.code == "invalid_argument"
        assert f"'{name}'" in str(e.value) and "got None" in str(e.value), str(e.value)
