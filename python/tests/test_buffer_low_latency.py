"""Low-latency Buffer (semantics §5) on thread ranks, against the NumPy references of conftest.py."""

from __future__ import annotations

import numpy as np
import pytest

import epmoe
from conftest import (BF16, FP8, TIMEOUT_S, Unwritten, bits, fp8_quantize_ref, nice_bf16, random_topk_idx,
                      ref_low_latency)

H = 256
K = 4
TMAX = 8


def make_inputs(rng, R, E, H=H):
    Ts = [min(TMAX, 3 + 2 * r) for r in range(R)]
    xs = [nice_bf16(rng, (T, H)) for T in Ts]
    idxs = [random_topk_idx(rng, T, K, E) for T in Ts]
    ws = [rng.uniform(0.05, 1.0, size=(T, K)).astype(np.float32) for T in Ts]
    return Ts, xs, idxs, ws


def edge_inputs(rng, R, E, routing):
    """make_inputs' tokens, or an edge case of routing: "no_tokens": T = 0 on every rank; "rank_all_minus_one": rank
    0's ids all -1 (it sends nothing); "one_expert": T = TMAX everywhere, every token to expert E - 1 alone (its slab
    full: R * TMAX rows)."""
    Ts, xs, idxs, ws = make_inputs(rng, R, E)
    if routing == "no_tokens":
        Ts = [0] * R
        xs = [np.zeros((0, H), BF16) for _ in range(R)]
        idxs = [np.zeros((0, K), np.int64) for _ in range(R)]
        ws = [np.zeros((0, K), np.float32) for _ in range(R)]
    elif routing == "rank_all_minus_one":
        idxs[0][:] = -1
    elif routing == "one_expert":
        Ts = [TMAX] * R
        xs = [nice_bf16(rng, (TMAX, H)) for _ in range(R)]
        idxs = [np.full((TMAX, K), -1, np.int64) for _ in range(R)]
        for idx in idxs:
            idx[:, 0] = E - 1
        ws = [rng.uniform(0.05, 1.0, size=(TMAX, K)).astype(np.float32) for _ in range(R)]
    return Ts, xs, idxs, ws


def expert_scale(e_global):
    return (e_global + 1) * 0.25


def experts_on_packed(recv_x, counts, rank, el):
    """The tests' experts: local expert e scales its valid rows by expert_scale(global id), in bf16."""
    y = np.zeros(recv_x.shape, dtype=BF16)
    for e in range(el):
        c = int(counts[e])
        y[e, :c] = (recv_x[e, :c].astype(np.float64) * expert_scale(rank * el + e)).astype(BF16)
    return y


def combine_ref(x, idx, w):
    """semantics §5's rule in float32: out[t] = sum over k ascending of w[t,k] * y(t,k) (product rounded, then
    added, from +0), skipping -1, rounded to bf16 once; y(t,k) = bf16(x[t] * expert_scale(e))."""
    T = x.shape[0]
    out = np.zeros((T, x.shape[1]), dtype=np.float32)
    for t in range(T):
        acc = np.zeros(x.shape[1], dtype=np.float32)
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e < 0:
                continue
            y = (x[t].astype(np.float64) * expert_scale(e)).astype(BF16).astype(np.float32)
            acc = acc + np.float32(w[t, k]) * y
        out[t] = acc
    return out.astype(BF16)


def check_packed(out, xs, idxs, E, R, d, fp8=None, tmax=TMAX):
    """Compares rank d's packed receive with the reference (bf16 rows bit for bit; fp8 rows and scales
    against the NumPy quantization of the source rows)."""
    recv, count, handle = out
    el = E // R
    per_expert, ranges = ref_low_latency(idxs, E, R, d)
    np.testing.assert_array_equal(count, np.array([len(r) for r in per_expert], dtype=np.int32))
    assert count.dtype == np.int32
    src_info, layout_range, handle_tmax, hidden, num_experts = handle
    assert (handle_tmax, hidden, num_experts) == (tmax, xs[0].shape[1], E)
    np.testing.assert_array_equal(layout_range, ranges)
    for e, rows in enumerate(per_expert):
        n = len(rows)
        np.testing.assert_array_equal(src_info[e, :n], np.array([t for _, t in rows], dtype=np.int32))
        if fp8 is None:
            assert recv.dtype == BF16 and recv.shape == (el, R * tmax, hidden)
            exp = np.stack([xs[s][t] for s, t in rows]) if rows else np.zeros((0, hidden), BF16)
            np.testing.assert_array_equal(bits(recv[e, :n]), bits(exp))
        else:
            q, scales = recv
            round_scale, ue8m0 = fp8
            assert q.dtype == FP8 and q.shape == (el, R * tmax, hidden)
            for j, (s, t) in enumerate(rows):
                rq, rs = fp8_quantize_ref(xs[s][t:t + 1], round_scale, ue8m0)
                np.testing.assert_array_equal(bits(q[e, j]), bits(rq[0]))
                np.testing.assert_array_equal(scales[e, j], rs[0])


@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("routing", ["random", "no_tokens", "rank_all_minus_one", "one_expert"])
def test_low_latency_round_trip_bf16(rng, R, routing):
    E = 4 * R
    Ts, xs, idxs, ws = edge_inputs(rng, R, E, routing)

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group, num_rdma_bytes=epmoe.Buffer.get_low_latency_rdma_size_hint(TMAX, H, R, E),
                           low_latency_mode=True)
        unwritten = Unwritten(x=xs[r], topk_idx=idxs[r], topk_weights=ws[r])  # semantics §1
        recv, count, handle, event, hook = buf.low_latency_dispatch(xs[r], idxs[r], TMAX, E, use_fp8=False)
        assert hook is None and isinstance(event, epmoe.EventOverlap)
        y = experts_on_packed(recv, count, r, E // R)
        unwritten.add("y", y).add("handle", handle)
        combined, event, hook = buf.low_latency_combine(y, idxs[r], ws[r], handle)
        assert hook is None
        unwritten.check()
        return (recv, count, handle), combined

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    for d in range(R):
        check_packed(out[d][0], xs, idxs, E, R, d)
        combined = out[d][1]
        assert combined.dtype == BF16 and combined.shape == (Ts[d], H)
        np.testing.assert_array_equal(bits(combined), bits(combine_ref(xs[d], idxs[d], ws[d])))
    counts = np.concatenate([out[d][0][1] for d in range(R)])
    if routing == "no_tokens":
        assert not counts.any()
    if routing == "one_expert":  # only the last rank's last expert receives, every token of every rank
        assert counts[-1] == R * TMAX and not counts[:-1].any()


def test_wait_cost_stats_count_the_nanoseconds_waited_for_each_source(rng):
    """DeepEP V1's dispatch_/combine_wait_recv_cost_stats (semantics §5): int64 [R], entry s += the nanoseconds this
    rank's receive waited for rank s. Rank 1 sleeps before its dispatch, rank 0 before its combine: the other rank's
    entry for the late one grows by at least most of the sleep; entries accumulate on the caller's values; the
    results are those without statistics."""
    import time
    R, E, late_s, base = 2, 8, 0.15, 1000
    Ts, xs, idxs, ws = make_inputs(rng, R, E)

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group, low_latency_mode=True)
        buf.low_latency_dispatch(xs[r], idxs[r], TMAX, E, use_fp8=False)  # the first call agrees on the settings
        dstats, cstats = np.full(R, base, np.int64), np.full(R, base, np.int64)
        group.barrier()
        if r == 1:
            time.sleep(late_s)
        recv, count, handle, _, _ = buf.low_latency_dispatch(xs[r], idxs[r], TMAX, E, use_fp8=False,
                                                             dispatch_wait_recv_cost_stats=dstats)
        y = experts_on_packed(recv, count, r, E // R)
        group.barrier()
        if r == 0:
            time.sleep(late_s)
        combined, _, _ = buf.low_latency_combine(y, idxs[r], ws[r], handle, combine_wait_recv_cost_stats=cstats)
        return dstats, cstats, (recv, count, handle), combined

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    assert out[0][0][1] - base >= late_s * 2 / 3 * 1e9, out[0][0]
    assert out[1][1][0] - base >= late_s * 2 / 3 * 1e9, out[1][1]
    for d in range(R):
        assert (out[d][0] >= base).all() and (out[d][1] >= base).all()
        check_packed(out[d][2], xs, idxs, E, R, d)
        np.testing.assert_array_equal(bits(out[d][3]), bits(combine_ref(xs[d], idxs[d], ws[d])))


@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
def test_low_latency_fp8_dispatch(rng, round_scale, use_ue8m0):
    R, E = 2, 8
    Ts, xs, idxs, ws = make_inputs(rng, R, E, H=272)  # H = 272: two full scale groups and one of 16

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group, low_latency_mode=True)
        recv, count, handle, _, _ = buf.low_latency_dispatch(xs[r], idxs[r], TMAX, E, use_fp8=True,
                                                             round_scale=round_scale, use_ue8m0=use_ue8m0)
        return recv, count, handle

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    for d in range(R):
        (q, scales), _, _ = out[d]
        G = 3
        assert scales.shape == (E // R, R * TMAX, (G + 3) // 4 if use_ue8m0 else G)
        assert scales.dtype == (np.int32 if use_ue8m0 else np.float32)
        check_packed(out[d], xs, idxs, E, R, d, fp8=(round_scale, use_ue8m0))


def deepep_scale_strides(rows, cols):
    """DeepEP's low-latency scales [E_local, R*Tmax, C] (bytes): a transposed [E_local, C, M] float32/int32
    allocation, M = R*Tmax rounded up to a multiple of 4 (DeepGEMM's get_tma_aligned_size(R*Tmax, 4); DeepEP
    itself requires R*Tmax % 4 == 0)."""
    m = (rows + 3) // 4 * 4
    return (cols * m * 4, 4, m * 4)


@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
def test_low_latency_fp8_scales_have_deepeps_strides(rng, R, round_scale, use_ue8m0):
    """Scales column-major per expert as DeepEP returns them (R*Tmax = 10 or 20: padded to 12 at R = 2), the
    values those of the row-major quantization of each source row; a test indexing them as a tensor (DeepEP's
    test_low_latency.py) sees the same numbers."""
    E, tmax, Hs = 4 * R, 5, 2880  # H = 2880: 22 full groups and one of 64
    Ts = [min(tmax, 2 + r) for r in range(R)]
    xs = [nice_bf16(rng, (T, Hs)) for T in Ts]
    idxs = [random_topk_idx(rng, T, K, E) for T in Ts]

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group, low_latency_mode=True)
        recv, count, handle, _, _ = buf.low_latency_dispatch(xs[r], idxs[r], tmax, E, use_fp8=True,
                                                             round_scale=round_scale, use_ue8m0=use_ue8m0)
        return recv, count, handle

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    G = 23
    C = (G + 3) // 4 if use_ue8m0 else G
    for d in range(R):
        (q, scales), _, _ = out[d]
        assert scales.shape == (E // R, R * tmax, C)
        assert scales.strides == deepep_scale_strides(R * tmax, C)
        check_packed(out[d], xs, idxs, E, R, d, fp8=(round_scale, use_ue8m0), tmax=tmax)


@pytest.mark.parametrize("R", [2, 4])
def test_low_latency_hooks_receive_once(rng, R):
    E = 2 * R
    Ts, xs, idxs, ws = make_inputs(rng, R, E)

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group, low_latency_mode=True)
        stats = np.zeros(E // R, dtype=np.int32)
        recv, count, handle, _, hook = buf.low_latency_dispatch(
            xs[r], idxs[r], TMAX, E, cumulative_local_expert_recv_stats=stats, use_fp8=False, return_recv_hook=True)
        assert callable(hook)
        hook()  # the data arrives here
        with pytest.raises(epmoe.Error) as twice:
            hook()
        y = experts_on_packed(recv, count, r, E // R)
        out = np.full((Ts[r], H), np.nan, dtype=BF16)  # poisoned: every row must be written
        combined, _, chook = buf.low_latency_combine(y, idxs[r], ws[r], handle, return_recv_hook=True, out=out)
        assert combined is out
        chook()
        with pytest.raises(epmoe.Error):
            chook()
        return (recv, count, handle), combined, stats, twice.value.code

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    for d in range(R):
        check_packed(out[d][0], xs, idxs, E, R, d)
        np.testing.assert_array_equal(bits(out[d][1]), bits(combine_ref(xs[d], idxs[d], ws[d])))
        np.testing.assert_array_equal(out[d][2], out[d][0][1])  # stats added this call's counts
        assert out[d][3] == "stale_handle"


def test_alternation_rule_rejects_reused_halves_and_clean_resets(rng):
    """semantics §5: a handle combines (any number of times, zero_copy or not) until a later dispatch reuses its
    half; clean_low_latency_buffer makes every handle stale."""
    R, E = 2, 4
    Ts, xs, idxs, ws = make_inputs(rng, R, E)

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group, low_latency_mode=True)
        stats = np.zeros(E // R, dtype=np.int32)
        a = buf.low_latency_dispatch(xs[r], idxs[r], TMAX, E, stats, use_fp8=False)  # call 0, half 0
        b = buf.low_latency_dispatch(xs[r], idxs[r], TMAX, E, stats, use_fp8=False)  # call 1, half 1
        y = experts_on_packed(a[0], a[1], r, E // R)
        again = buf.low_latency_combine(y, idxs[r], ws[r], a[2])[0]  # half 0 still holds a
        buf.low_latency_dispatch(xs[r], idxs[r], TMAX, E, use_fp8=False)  # call 3, half 1: b is gone
        with pytest.raises(epmoe.Error) as stale:
            buf.low_latency_combine(y, idxs[r], ws[r], b[2])
        combined, _, _ = buf.low_latency_combine(y, idxs[r], ws[r], a[2])
        buf.clean_low_latency_buffer(TMAX, H, E)
        with pytest.raises(epmoe.Error) as after_clean:
            buf.low_latency_combine(y, idxs[r], ws[r], a[2])
        c = buf.low_latency_dispatch(xs[r], idxs[r], TMAX, E, use_fp8=False)
        # zero copy: the experts write into the slab the buffer hands out for the next call
        z = buf.get_next_low_latency_combine_buffer(c[2])
        assert z.shape == (E // R, R * TMAX, H) and z.dtype == BF16
        z[...] = experts_on_packed(c[0], c[1], r, E // R)
        zc, _, _ = buf.low_latency_combine(np.zeros_like(z), idxs[r], ws[r], c[2], zero_copy=True)
        with pytest.raises(epmoe.Error) as logfmt:
            buf.low_latency_combine(z, idxs[r], ws[r], c[2], use_logfmt=True)
        return stale.value.code, after_clean.value.code, combined, again, stats, a[1], zc, logfmt.value.code

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    for d in range(R):
        stale, after_clean, combined, again, stats, counts, zc, logfmt = out[d]
        assert stale == "stale_handle" and after_clean == "stale_handle" and logfmt == "unsupported"
        exp = bits(combine_ref(xs[d], idxs[d], ws[d]))
        np.testing.assert_array_equal(bits(combined), exp)
        np.testing.assert_array_equal(bits(again), exp)
        np.testing.assert_array_equal(bits(zc), exp)  # read from the slab, not from x (zeros)


def test_zero_copy_slab_on_cpu_ranks(rng):
    """semantics §5 zero_copy on CPU ranks: x may be None; a given x is checked (dtype too) and not read; the getter
    refuses another buffer's handle; a clean zeroes the slabs."""
    R, E = 2, 4
    Ts, xs, idxs, ws = make_inputs(rng, R, E)

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group, low_latency_mode=True)
        other = epmoe.Buffer(group, low_latency_mode=True)
        c = buf.low_latency_dispatch(xs[r], idxs[r], TMAX, E, use_fp8=False)
        z = buf.get_next_low_latency_combine_buffer(c[2])
        z[...] = experts_on_packed(c[0], c[1], r, E // R)
        none_x, _, _ = buf.low_latency_combine(None, idxs[r], ws[r], c[2], zero_copy=True)
        z2 = buf.get_next_low_latency_combine_buffer(c[2])  # the next call's half: the other slab
        z2[...] = z
        with pytest.raises(epmoe.Error) as dtype:
            buf.low_latency_combine(z.astype(np.float32), idxs[r], ws[r], c[2], zero_copy=True)
        with pytest.raises(epmoe.Error) as foreign:
            other.get_next_low_latency_combine_buffer(c[2])
        buf.clean_low_latency_buffer(TMAX, H, E)
        zeroed = not np.any(bits(z)) and not np.any(bits(z2))
        return none_x, dtype.value, foreign.value, zeroed

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    for d in range(R):
        none_x, dtype, foreign, zeroed = out[d]
        np.testing.assert_array_equal(bits(none_x), bits(combine_ref(xs[d], idxs[d], ws[d])))
        assert dtype.code == "invalid_argument" and "'x'" in str(dtype) and "float32" in str(dtype), str(dtype)
        assert foreign.code == "invalid_argument" and "'handle'" in str(foreign), str(foreign)
        assert zeroed


def test_low_latency_errors_name_the_argument(rng):
    R, E = 2, 4
    Ts, xs, idxs, ws = make_inputs(rng, R, E)
    big = nice_bf16(rng, (TMAX + 1, H))
    big_idx = random_topk_idx(rng, TMAX + 1, K, E)

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group, low_latency_mode=True)
        errors = {}
        for name, call in {
            # a window of about 10 TB: named before allocating (the allocator's failure named no setting)
            "window_past_memory": lambda: buf.low_latency_dispatch(xs[r], idxs[r], 1 << 29, E),
            # no token, but rows of 2^37 bytes: even Tmax = 1 cannot fit, so hidden is the setting named
            "rows_past_memory": lambda: buf.low_latency_dispatch(np.zeros((0, 1 << 36), BF16),
                                                                 np.zeros((0, K), np.int64), 8, E),
            "too_many_tokens": lambda: buf.low_latency_dispatch(big, big_idx, TMAX, E),
            "ue8m0": lambda: buf.low_latency_dispatch(xs[r], idxs[r], TMAX, E, use_ue8m0=True),
            "k_too_large": lambda: buf.low_latency_dispatch(
                xs[r], np.zeros((Ts[r], 17), np.int64), TMAX, E),
            "cost_stats": lambda: buf.low_latency_dispatch(
                xs[r], idxs[r], TMAX, E, dispatch_wait_recv_cost_stats=np.zeros((R, R), np.int64)),
            "hook_and_async": lambda: buf.low_latency_dispatch(xs[r], idxs[r], TMAX, E, async_finish=True,
                                                               return_recv_hook=True),
            "mask": lambda: buf.low_latency_update_mask_buffer(1, True),
        }.items():
            with pytest.raises(epmoe.Error) as e:
                call()
            errors[name] = (e.value.code, str(e.value))
        return errors

    for errors in epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S):
        code, msg = errors["window_past_memory"]
        assert code == "invalid_argument" and "'num_max_dispatch_tokens_per_rank'" in msg and str(1 << 29) in msg, msg
        code, msg = errors["rows_past_memory"]
        assert code == "invalid_argument" and "'hidden'" in msg and str(1 << 36) in msg, msg
        code, msg = errors["too_many_tokens"]
        assert code == "invalid_argument" and str(TMAX) in msg and str(TMAX + 1) in msg
        assert errors["ue8m0"][0] == "invalid_argument" and "round_scale" in errors["ue8m0"][1]
        assert errors["k_too_large"][0] == "invalid_argument" and "topk_idx" in errors["k_too_large"][1]
        assert "dispatch_wait_recv_cost_stats" in errors["cost_stats"][1]
        assert errors["hook_and_async"][0] == "invalid_argument" and "async_finish" in errors["hook_and_async"][1]
        assert errors["mask"][0] == "unsupported"


def test_low_latency_settings_must_agree_across_ranks(rng):
    R, E = 2, 4
    xs = [nice_bf16(rng, (2, 128)), nice_bf16(rng, (2, 256))]  # H differs across ranks
    idxs = [random_topk_idx(rng, 2, 2, E, p_none=0.0) for _ in range(R)]

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group, low_latency_mode=True)
        with pytest.raises(epmoe.Error) as e:
            buf.low_latency_dispatch(xs[r], idxs[r], TMAX, E, use_fp8=False)
        return e.value.code, str(e.value)

    for code, msg in epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S):
        assert code == "rank_mismatch", msg
