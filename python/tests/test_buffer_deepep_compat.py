"""The calls DeepEP V1's own tests (tests/test_intranode.py, tests/test_low_latency.py at commit 567632d) make, on
CPU thread ranks: the return shapes and what those tests assert, against the NumPy references of conftest.py.
(The signature table is test_api_and_errors.DEEPEP_V1.)"""

from __future__ import annotations

import numpy as np
import pytest

import epmoe
from conftest import BF16, FP8, TIMEOUT_S, bits, nice_bf16, random_topk_idx, ref_dispatch

H = 256
K = 3


def test_topk_idx_t_is_int64_of_the_framework():
    t = epmoe.topk_idx_t
    assert str(t).replace("torch.", "") == "int64"
    ids = np.arange(6, dtype=np.int32).reshape(2, 3)
    try:
        import torch
    except ImportError:
        assert ids.astype(t).dtype == np.int64
    else:
        assert t is torch.int64 and torch.from_numpy(ids).to(t).dtype == torch.int64


def test_dispatch_and_combine_configs_are_deepeps():
    epmoe.Buffer.set_num_sms(24)
    c = epmoe.Buffer.get_dispatch_config(8)
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (24, 6, 256, 6, 128)
    c = epmoe.Buffer.get_combine_config(2)
    assert (c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens) == (10, 256)
    # one rank (DeepEP's tests on one GPU): the next listed count up, 2
    assert epmoe.Buffer.get_dispatch_config(1).num_max_nvl_chunked_send_tokens == 24
    assert epmoe.Buffer.get_combine_config(3).num_max_nvl_chunked_send_tokens == 9
    with pytest.raises(epmoe.Error):
        epmoe.Buffer.get_dispatch_config(0)


@pytest.mark.parametrize("R", [1, 2, 3])
def test_intranode_calls_without_topk_cached_worst_and_fp8_column_major_scales(rng, R):
    """test_intranode's sequence: layout-only dispatch (no topk_idx), with top-k, num_worst_tokens, cached dispatch
    of fp8 rows with column-major scales, combine with and without topk_weights."""
    E = 4 * R
    el = E // R
    Ts = [5 + 3 * r for r in range(R)]
    xs = [nice_bf16(rng, (T, H)) for T in Ts]
    idxs = [random_topk_idx(rng, T, K, E) for T in Ts]
    ws = [rng.uniform(0.1, 1.0, size=(T, K)).astype(np.float32) for T in Ts]
    fp8s = [rng.integers(0, 0x7f, size=(T, H), dtype=np.uint8).view(FP8) for T in Ts]
    # column-major scales, as per_token_cast_to_fp8(x)[1].T.contiguous().T
    scales = [np.asfortranarray(rng.uniform(0.01, 1.0, size=(T, H // 128)).astype(np.float32)) for T in Ts]

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group, int(2e9), 0, explicitly_destroy=True)
        ntpr, _, ntpe, in_rank, _ = buf.get_dispatch_layout(idxs[r], E)
        config = epmoe.Config(24, 8, 256)
        layout = dict(num_tokens_per_rank=ntpr, is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, config=config)
        plain = buf.dispatch(xs[r], **layout, previous_event=buf.capture(), async_finish=True)
        with_topk = buf.dispatch(xs[r], **layout, topk_idx=idxs[r], topk_weights=ws[r])
        worst = buf.dispatch(xs[r], **layout, topk_idx=idxs[r], topk_weights=ws[r], num_worst_tokens=sum(Ts))
        handle = plain[4]
        fp8 = buf.dispatch((fp8s[r], scales[r]), handle=handle, config=config)
        combined, combined_w, ev = buf.combine(plain[0], handle, config=config)
        combined_t, combined_tw, _ = buf.combine(with_topk[0], with_topk[4], topk_weights=with_topk[2])
        buf.destroy()
        return plain, with_topk, worst, fp8, (combined, combined_w), (combined_t, combined_tw), ntpe

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    gbl_per_expert = np.sum([out[s][6] for s in range(R)], axis=0)
    for d in range(R):
        plain, with_topk, worst, fp8, (combined, combined_w), (combined_t, combined_tw), _ = out[d]
        rows, local, _ = ref_dispatch(idxs, E, R, d)
        recv_x, recv_idx, recv_w, counts, handle, event = plain
        assert recv_idx is None and recv_w is None and len(handle) == 6
        assert recv_x.shape == (len(rows), H)
        np.testing.assert_array_equal(bits(recv_x), bits(np.stack([xs[s][t] for s, t in rows]).reshape(-1, H)))
        # test_intranode: gbl_num_tokens_per_expert.view(num_ranks, -1)[rank].tolist() == the list
        assert counts == gbl_per_expert[d * el:(d + 1) * el].tolist()
        assert with_topk[3] == counts
        np.testing.assert_array_equal(with_topk[1], local)
        # rank_prefix_matrix[i][rank] ends source i's rows
        pm = np.asarray(handle[0])
        assert pm[R - 1][d] == len(rows)
        # num_worst_tokens: padded, empty list, the same leading rows, -1 ids after
        wx, widx, ww, wlist = worst[0], worst[1], worst[2], worst[3]
        assert len(wlist) == 0 and wx.shape[0] == widx.shape[0] == ww.shape[0] == sum(Ts)
        np.testing.assert_array_equal(bits(wx[:len(rows)]), bits(recv_x))
        np.testing.assert_array_equal(widx[:len(rows)], local)
        assert np.all(widx[len(rows):] == -1)
        # cached fp8 dispatch: rows and their scales (sent from column-major views) arrive in the layout's order
        (fx, fs), fidx, fw, flist, fhandle, _ = fp8
        assert fidx is None and fw is None and flist is None and fhandle is None
        np.testing.assert_array_equal(fx.view(np.uint8), np.stack([fp8s[s][t] for s, t in rows]).view(np.uint8)
                                      .reshape(-1, H))
        np.testing.assert_array_equal(fs, np.stack([scales[s][t] for s, t in rows]).reshape(-1, H // 128))
        # combine of the layout-only handle: each token summed over the ranks it went to
        n_ranks = np.stack([np.any((idxs[d] >= 0) & (idxs[d] // el == r), axis=1) for r in range(R)], 1).sum(1)
        want = (xs[d].astype(np.float64) * n_ranks[:, None] + 0.0).astype(BF16)  # from +0: a token sent nowhere is +0
        assert combined_w is None
        np.testing.assert_array_equal(bits(combined), bits(want))
        np.testing.assert_array_equal(bits(combined_t), bits(want))
        assert combined_tw.shape == (Ts[d], K)


def test_low_latency_calls_of_deepeps_test(rng):
    """test_low_latency's sequence: dispatch (once or twice), stats, combine twice per handle (zero_copy False, then
    True through get_next_low_latency_combine_buffer), with and without hooks."""
    R, E, tmax = 2, 8, 6
    el = E // R
    Ts = [4, 6]
    xs = [nice_bf16(rng, (T, H)) for T in Ts]
    idxs = [random_topk_idx(rng, T, K, E) for T in Ts]
    ws = [rng.uniform(0.1, 1.0, size=(T, K)).astype(np.float32) for T in Ts]

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group, num_rdma_bytes=epmoe.Buffer.get_low_latency_rdma_size_hint(tmax, H, R, E),
                           low_latency_mode=True, num_qps_per_rank=el, explicitly_destroy=True)
        got = []
        for times, hook_mode in ((1, False), (2, True), (2, False)):
            for _ in range(times):
                stats = np.zeros(el, dtype=np.int32)
                recv, count, handle, event, hook = buf.low_latency_dispatch(
                    xs[r], idxs[r], tmax, E, cumulative_local_expert_recv_stats=stats, use_fp8=False,
                    async_finish=not hook_mode, return_recv_hook=hook_mode)
                hook() if hook_mode else event.current_stream_wait()
            assert len(handle) == 5 and recv.shape == (el, R * tmax, H)
            y = recv.copy()
            results = []
            for zero_copy in (False, True):
                if zero_copy:
                    buf.get_next_low_latency_combine_buffer(handle)[:, :, :] = y
                out = np.empty((Ts[r], H), dtype=BF16)
                combined, event, chook = buf.low_latency_combine(y, idxs[r], ws[r], handle, async_finish=not hook_mode,
                                                                 zero_copy=zero_copy, return_recv_hook=hook_mode,
                                                                 out=out)
                chook() if hook_mode else event.current_stream_wait()
                assert combined is out
                results.append(out.copy())
            got.append((count.copy(), stats, results))
        buf.destroy()
        return got

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    for d in range(R):
        # combine = x * sum of the token's weights (the experts are the identity)
        want = (xs[d].astype(np.float32) * np.where(idxs[d] >= 0, ws[d], 0).sum(1, dtype=np.float32)[:, None])
        for count, stats, results in out[d]:
            exp_count = [sum(int(np.sum(idxs[s] == d * el + e)) for s in range(R)) for e in range(el)]
            assert count.tolist() == exp_count and stats.tolist() == exp_count
            for res in results:
                np.testing.assert_allclose(res.astype(np.float64), want, rtol=1e-2, atol=1e-2)
            np.testing.assert_array_equal(bits(results[0]), bits(results[1]))  # zero_copy reads the same rows
