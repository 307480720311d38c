"""Normal-mode Buffer (semantics §4) on thread ranks, against the NumPy references of conftest.py."""

from __future__ import annotations

import numpy as np
import pytest

import epmoe
from conftest import (BF16, FP8, TIMEOUT_S, Unwritten, bits, nice_bf16, random_topk_idx, ref_dispatch,
                      ref_expert_counts)

H = 128
K = 3


def make_inputs(rng, R, E, H=H, K=K):
    Ts = [5 + 2 * r for r in range(R)]  # ranks hold different numbers of tokens
    xs = [nice_bf16(rng, (T, H)) for T in Ts]
    idxs = [random_topk_idx(rng, T, K, E) for T in Ts]
    ws = [rng.uniform(0.05, 1.0, size=(T, K)).astype(np.float32) for T in Ts]
    return Ts, xs, idxs, ws


def expert_output(recv_x, rank):
    """The tests' stand-in for the experts: each rank scales its rows by (rank + 1), rounded to bf16."""
    return (recv_x.astype(np.float64) * (rank + 1)).astype(BF16)


@pytest.mark.parametrize("R", [2, 4])
def test_dispatch_combine_round_trip(rng, R):
    E = 4 * R
    Ts, xs, idxs, ws = make_inputs(rng, R, E)
    bias0 = [((rng.integers(-32, 33, size=(T, H)) / 8.0)).astype(BF16) for T in Ts]
    bias1 = [((rng.integers(-32, 33, size=(T, H)) / 8.0)).astype(BF16) for T in Ts]

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group)
        assert (buf.rank, buf.group_size) == (r, R)
        unwritten = Unwritten(topk_idx=idxs[r])  # every call's inputs stay as they were (semantics §1)
        ntpr, ntp_rdma, ntpe, in_rank, ev = buf.get_dispatch_layout(idxs[r], E)
        assert ntp_rdma is None and isinstance(ev, epmoe.EventOverlap)
        unwritten.add("x", xs[r]).add("topk_weights", ws[r]).add("layout", (ntpr, ntpe, in_rank))
        recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(
            xs[r], num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
            topk_idx=idxs[r], topk_weights=ws[r])
        event.current_stream_wait()
        y = expert_output(recv_x, r)
        unwritten.add("y", y).add("recv_w", recv_w).add("handle", handle).add("bias", (bias0[r], bias1[r]))
        combined, combined_w, ev2 = buf.combine(y, handle, topk_weights=recv_w, bias=(bias0[r], bias1[r]))
        plain, none_w, _ = buf.combine(y, handle)
        unwritten.check()
        return dict(layout=(ntpr, ntpe, in_rank), recv_x=recv_x, recv_idx=recv_idx, recv_w=recv_w, counts=counts,
                    handle=handle, combined=combined, combined_w=combined_w, plain=plain, none_w=none_w)

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    el = E // R
    for d in range(R):
        o = out[d]
        # layout (semantics §3)
        ntpr, ntpe, in_rank = o["layout"]
        ids = idxs[d]
        exp_in_rank = np.stack([np.any((ids >= 0) & (ids // el == r), axis=1) for r in range(R)], axis=1)
        np.testing.assert_array_equal(in_rank, exp_in_rank)
        np.testing.assert_array_equal(ntpr, exp_in_rank.sum(axis=0).astype(np.int32))
        np.testing.assert_array_equal(ntpe, np.array([np.sum(ids == e) for e in range(E)], dtype=np.int32))
        assert ntpr.dtype == np.int32 and ntpe.dtype == np.int32 and in_rank.dtype == np.bool_
        # dispatch
        rows, local, mine = ref_dispatch(idxs, E, R, d)
        exp_x = np.stack([xs[s][t] for s, t in rows]) if rows else np.zeros((0, H), BF16)
        assert o["recv_x"].dtype == BF16 and o["recv_x"].shape == (len(rows), H)
        np.testing.assert_array_equal(bits(o["recv_x"]), bits(exp_x))
        assert o["recv_idx"].dtype == np.int64
        np.testing.assert_array_equal(o["recv_idx"], local)
        exp_w = np.array([[ws[s][t, k] if mine[j, k] else 0.0 for k in range(K)] for j, (s, t) in enumerate(rows)],
                         dtype=np.float32).reshape(len(rows), K)
        np.testing.assert_array_equal(o["recv_w"], exp_w)
        assert o["counts"] == ref_expert_counts(local, el)
        # the handle looks like DeepEP's intranode 6-tuple
        h = o["handle"]
        assert isinstance(h, tuple) and len(h) == 6 and h[1] is None and h[2] is None
        np.testing.assert_array_equal(h[3], np.array([t for _, t in rows], dtype=np.int32))
    for s in range(R):
        # combine: sum over destination ranks (ascending) of what each sent back, plus the biases
        T = Ts[s]
        exp = np.zeros((T, H))
        exp_w = np.zeros((T, K))
        for d in range(R):
            rows, _, mine = ref_dispatch(idxs, E, R, d)
            for j, (src, t) in enumerate(rows):
                if src == s:
                    exp[t] += expert_output(xs[s][t:t + 1], d)[0].astype(np.float64)
                    exp_w[t] += np.where(mine[j], ws[s][t], 0.0)
        with_bias = (exp + bias0[s].astype(np.float64) + bias1[s].astype(np.float64)).astype(BF16)
        np.testing.assert_array_equal(bits(out[s]["combined"]), bits(with_bias))
        np.testing.assert_array_equal(bits(out[s]["plain"]), bits(exp.astype(BF16)))
        np.testing.assert_array_equal(out[s]["combined_w"], exp_w.astype(np.float32))
        assert out[s]["none_w"] is None


@pytest.mark.parametrize("R", [2, 4])
def test_cached_dispatch_reuses_the_layout(rng, R):
    E = 2 * R
    Ts, xs, idxs, ws = make_inputs(rng, R, E)
    xs2 = [nice_bf16(rng, (T, H)) for T in Ts]

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group)
        ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idxs[r], E)
        _, _, _, _, handle, _ = buf.dispatch(xs[r], None, ntpr, None, in_rank, ntpe, idxs[r], ws[r])
        again = buf.dispatch(xs2[r], handle=handle)
        return again

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    for d in range(R):
        recv_x, recv_idx, recv_w, counts, handle, event = out[d]
        assert recv_idx is None and recv_w is None and counts is None and handle is None
        assert isinstance(event, epmoe.EventOverlap)
        rows, _, _ = ref_dispatch(idxs, E, R, d)
        exp = np.stack([xs2[s][t] for s, t in rows]) if rows else np.zeros((0, H), BF16)
        np.testing.assert_array_equal(bits(recv_x), bits(exp))


@pytest.mark.parametrize("ue8m0", [False, True])
def test_fp8_dispatch_moves_rows_with_their_scales(rng, ue8m0):
    R, E, Hf = 2, 8, 144  # H = 144: one full scale group and one of 16 channels
    G = 2
    Ts = [6, 4]
    xs = [rng.uniform(-400, 400, size=(T, Hf)).astype(np.float32).astype(FP8) for T in Ts]
    if ue8m0:
        scales = [rng.integers(0, 2**31 - 1, size=(T, (G + 3) // 4), dtype=np.int64).astype(np.int32) for T in Ts]
    else:
        scales = [rng.uniform(1e-3, 1.0, size=(T, G)).astype(np.float32) for T in Ts]
    idxs = [random_topk_idx(rng, T, 2, E) for T in Ts]

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group)
        ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idxs[r], E)
        unwritten = Unwritten(x=(xs[r], scales[r]), topk_idx=idxs[r], layout=(ntpr, ntpe, in_rank))
        recv, recv_idx, _, counts, _, _ = buf.dispatch((xs[r], scales[r]), num_tokens_per_rank=ntpr,
                                                       is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
                                                       topk_idx=idxs[r])
        unwritten.check()
        return recv, recv_idx

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    for d in range(R):
        (rx, rs), recv_idx = out[d]
        rows, local, _ = ref_dispatch(idxs, E, R, d)
        assert rx.dtype == FP8 and rs.dtype == scales[0].dtype
        np.testing.assert_array_equal(bits(rx), bits(np.stack([xs[s][t] for s, t in rows])))
        np.testing.assert_array_equal(rs, np.stack([scales[s][t] for s, t in rows]))
        np.testing.assert_array_equal(recv_idx, local)


@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_fp8_dispatch_with_column_major_scales(rng, R, use_ue8m0):
    """x = (q, scales) with scales from quantize_fp8(scale_layout='column_major') (DeepGEMM's layout, T not a
    multiple of 4, a rank with no tokens), and with scales in neither layout (strided both ways: copied, as
    DeepEP takes any strides): the received rows and scales are those of the row-major path, bit for bit."""
    E, Hs = 4 * R, 2880
    Ts = [5 + 2 * r for r in range(R)]
    Ts[-1] = 0
    xs = [nice_bf16(rng, (T, Hs)) for T in Ts]
    idxs = [random_topk_idx(rng, T, 2, E) for T in Ts]
    rows_q = [epmoe.quantize_fp8(x, round_scale=use_ue8m0, use_ue8m0=use_ue8m0) for x in xs]
    cols_q = [epmoe.quantize_fp8(x, round_scale=use_ue8m0, use_ue8m0=use_ue8m0, scale_layout="column_major")
              for x in xs]
    for (_, c), T in zip(cols_q, Ts):
        assert T == 0 or c.strides == (4, 4 * ((T + 3) // 4 * 4))

    def strided_both_ways(s):
        wide = np.zeros((2 * s.shape[0], 2 * s.shape[1]), s.dtype)
        wide[::2, ::2] = s
        return wide[::2, ::2]

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group)
        ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idxs[r], E)
        out = []
        for x in (rows_q[r], cols_q[r], (cols_q[r][0], strided_both_ways(rows_q[r][1]))):
            recv, _, _, _, _, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                                               num_tokens_per_expert=ntpe, topk_idx=idxs[r])
            out.append(recv)
        return out

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    for d in range(R):
        rows, _, _ = ref_dispatch(idxs, E, R, d)
        want_q = np.stack([rows_q[s][0][t] for s, t in rows]) if rows else None
        want_s = np.stack([rows_q[s][1][t] for s, t in rows]) if rows else None
        for rx, rs in out[d]:
            assert rs.dtype == (np.int32 if use_ue8m0 else np.float32) and rs.flags.c_contiguous
            assert rx.shape[0] == len(rows) and rs.shape[0] == len(rows)
            if rows:
                np.testing.assert_array_equal(bits(rx), bits(want_q))
                np.testing.assert_array_equal(rs, want_s)


def test_expert_alignment_and_num_worst_tokens(rng):
    R, E, alignment = 2, 8, 4
    Ts, xs, idxs, ws = make_inputs(rng, R, E)
    worst = sum(Ts)

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group)
        ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idxs[r], E)
        aligned = buf.dispatch(xs[r], num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                               num_tokens_per_expert=ntpe, topk_idx=idxs[r], topk_weights=ws[r],
                               expert_alignment=alignment)
        padded = buf.dispatch(xs[r], num_tokens_per_rank=ntpr, is_token_in_rank=in_rank,
                              num_tokens_per_expert=ntpe, topk_idx=idxs[r], topk_weights=ws[r],
                              num_worst_tokens=worst)
        recv_x, _, _, _, handle, _ = padded
        combined, _, _ = buf.combine(recv_x, handle)  # the padded rows go nowhere
        return aligned[3], padded, combined

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    for d in range(R):
        counts, (recv_x, recv_idx, recv_w, padded_counts, _, _), combined = out[d]
        rows, local, _ = ref_dispatch(idxs, E, R, d)
        assert counts == ref_expert_counts(local, E // R, alignment)
        assert all(c % alignment == 0 for c in counts)
        n = len(rows)
        assert recv_x.shape == (worst, H) and recv_idx.shape == (worst, K)
        assert padded_counts == []  # as DeepEP: no counts without a host synchronisation
        np.testing.assert_array_equal(bits(recv_x[:n]), bits(np.stack([xs[s][t] for s, t in rows])))
        np.testing.assert_array_equal(recv_idx[:n], local)
        assert np.all(recv_idx[n:] == -1)
    for s in range(R):
        exp = np.zeros((Ts[s], H))
        for d in range(R):
            for src, t in ref_dispatch(idxs, E, R, d)[0]:
                if src == s:
                    exp[t] += xs[s][t].astype(np.float64)
        np.testing.assert_array_equal(bits(out[s][2]), bits(exp.astype(BF16)))


def test_events_configs_and_static_helpers():
    ev = epmoe.Buffer.capture()
    ev.current_stream_wait()
    with ev:
        pass
    with epmoe.EventOverlap() as e:
        e.current_stream_wait()
    for R in (1, 2, 3, 8, 24, 256):  # any number of ranks (DeepEP: a fixed list)
        cfg = epmoe.Buffer.get_dispatch_config(R)
        assert isinstance(cfg, epmoe.Config) and cfg.num_sms == epmoe.Buffer.num_sms
        assert isinstance(epmoe.Buffer.get_combine_config(R), epmoe.Config)
        assert cfg.get_nvl_buffer_size_hint(7168 * 2, R) > 0
        assert cfg.get_rdma_buffer_size_hint(7168 * 2, R) >= 0
    c = epmoe.Config()
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (20, 6, 256, 6, 256)
    hint = epmoe.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256)
    assert isinstance(hint, int) and hint > 128 * 7168
    old = epmoe.Buffer.num_sms
    epmoe.Buffer.set_num_sms(24)
    assert epmoe.Buffer.num_sms == 24
    epmoe.Buffer.set_num_sms(old)
    with pytest.raises(epmoe.Error, match="new_num_sms"):
        epmoe.Buffer.set_num_sms(23)
    assert epmoe.Buffer.is_sm90_compiled() == epmoe.built_with_cuda()


def test_config_and_events_are_accepted_by_dispatch_and_combine(rng):
    R, E = 2, 4
    Ts, xs, idxs, ws = make_inputs(rng, R, E)

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group, num_nvl_bytes=1 << 20, num_rdma_bytes=0, low_latency_mode=False)
        prev = buf.capture()
        ntpr, _, ntpe, in_rank, ev = buf.get_dispatch_layout(idxs[r], E, previous_event=prev, async_finish=True,
                                                             allocate_on_comm_stream=True)
        recv_x, _, recv_w, _, handle, ev = buf.dispatch(
            xs[r], None, ntpr, None, in_rank, ntpe, idxs[r], ws[r], 1, 0, buf.get_dispatch_config(R), ev, True, True)
        ev.current_stream_wait()
        combined, _, ev = buf.combine(recv_x, handle, None, None, buf.get_combine_config(R), ev, True, True)
        with ev:
            return combined

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    for s in range(R):
        exp = np.zeros((Ts[s], H))
        for d in range(R):
            for src, t in ref_dispatch(idxs, E, R, d)[0]:
                if src == s:
                    exp[t] += xs[s][t].astype(np.float64)
        np.testing.assert_array_equal(bits(out[s]), bits(exp.astype(BF16)))


def test_a_rank_without_tokens_and_a_rank_that_receives_nothing(rng):
    R, E = 2, 4
    x1 = nice_bf16(rng, (3, H))
    idx1 = np.full((3, K), -1, dtype=np.int64)
    idx1[:, 0] = 3  # all of rank 1's tokens stay on rank 1; rank 0 has none and receives none
    xs = [np.zeros((0, H), dtype=BF16), x1]
    idxs = [np.zeros((0, K), dtype=np.int64), idx1]

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group)
        ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idxs[r], E)
        recv_x, recv_idx, _, counts, handle, _ = buf.dispatch(xs[r], num_tokens_per_rank=ntpr,
                                                              is_token_in_rank=in_rank, num_tokens_per_expert=ntpe,
                                                              topk_idx=idxs[r])
        combined, _, _ = buf.combine(recv_x, handle)
        recv, count, ll_handle, _, _ = buf.low_latency_dispatch(xs[r], idxs[r], 4, E, use_fp8=False)
        return recv_x, recv_idx, counts, combined, count

    (rx0, ri0, c0, comb0, n0), (rx1, ri1, c1, comb1, n1) = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    assert rx0.shape == (0, H) and ri0.shape == (0, K) and c0 == [0, 0] and comb0.shape == (0, H)
    np.testing.assert_array_equal(bits(rx1), bits(x1))
    assert c1 == [0, 3] and list(n0) == [0, 0] and list(n1) == [0, 3]
    np.testing.assert_array_equal(bits(comb1), bits(x1))
