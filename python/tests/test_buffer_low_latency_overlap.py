"""Overlapped low-latency combine on thread ranks (docs/semantics.md "Overlapped low-latency combine"): SGLang's
keywords in both forms, a producer thread writing the expert outputs block by block and then their signals, the
result bit-identical to the plain combine and the reference, a signal that never arrives named, bad arguments
named before any communication."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import epmoe
from conftest import BF16, TIMEOUT_S, bits, nice_bf16, random_topk_idx
from test_buffer_low_latency import combine_ref, experts_on_packed

H = 256
TMAX = 8
BLOCK_M = 3
BLOCK_N = 96  # threshold = ceil(H / BLOCK_N) = 3


def ceil_div(a, b):
    return -(-a // b)


def make_inputs(rng, R, E, K, Ts, p_none=0.15):
    xs = [nice_bf16(rng, (T, H)) for T in Ts]
    idxs = [random_topk_idx(rng, T, K, E, p_none) for T in Ts]
    ws = [rng.uniform(0.05, 1.0, size=(T, K)).astype(np.float32) for T in Ts]
    return xs, idxs, ws


def produce(form, y, x, counts, signal, delay_s=0.02, skip=None):
    """Copies y into x (block by block, N-tile by N-tile for the block form) and then adds to the signals."""
    time.sleep(delay_s)
    el, rows = y.shape[0], y.shape[1]
    bpe = ceil_div(rows, BLOCK_M)
    for e in range(el):
        n = int(counts[e])
        if form == "experts":
            x[e, :n] = y[e, :n]
            if skip != (e, None):
                signal[e] += 1
            continue
        for b in range(ceil_div(n, BLOCK_M)):
            for c0 in range(0, H, BLOCK_N):
                x[e, b * BLOCK_M:min(n, (b + 1) * BLOCK_M), c0:c0 + BLOCK_N] = \
                    y[e, b * BLOCK_M:min(n, (b + 1) * BLOCK_M), c0:c0 + BLOCK_N]
                if skip != (e, b):
                    signal[e * bpe + b] += 1


def overlap_kwargs(form, signal, count):
    """The keywords SGLang's DeepEP dispatcher passes (Hopper, else Blackwell)."""
    if form == "blocks":
        return dict(overlap=True, packed_recv_count=count, comp_signal=signal, block_m=BLOCK_M,
                    threshold=ceil_div(H, BLOCK_N), num_sms=3)
    return dict(overlap=True, src_signals=signal, src_signal_expect_value=1)


def make_signal(form, el, R):
    if form == "blocks":
        return np.zeros(el * ceil_div(R * TMAX, BLOCK_M) + 5, dtype=np.int32)  # extra entries are unused
    return np.zeros(el, dtype=np.uint32)


@pytest.mark.parametrize("form", ["blocks", "experts"])
@pytest.mark.parametrize("case", ["random", "k1", "zero_tokens", "all_minus_one", "hook"])
def test_overlapped_combine_is_bit_identical_to_the_plain_one(rng, form, case):
    R, E = 2, 8
    K = 1 if case == "k1" else 3
    Ts = [0, TMAX] if case == "zero_tokens" else [TMAX, 5]
    xs, idxs, ws = make_inputs(rng, R, E, K, Ts, 1.0 if case == "all_minus_one" else 0.15)
    hook_mode = case == "hook"

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group, low_latency_mode=True)
        recv, count, handle, _, _ = buf.low_latency_dispatch(xs[r], idxs[r], TMAX, E, use_fp8=False)
        y = experts_on_packed(recv, count, r, E // R)
        plain, _, _ = buf.low_latency_combine(y, idxs[r], ws[r], handle)
        x = np.full(y.shape, np.nan, dtype=BF16)  # rows sent before they are produced would show
        signal = make_signal(form, E // R, R)
        producer = threading.Thread(target=produce, args=(form, y, x, count, signal))
        producer.start()
        try:
            combined, _, hook = buf.low_latency_combine(x, idxs[r], ws[r], handle, return_recv_hook=hook_mode,
                                                        **overlap_kwargs(form, signal, count))
            if hook_mode:
                hook()
        finally:
            producer.join()
        return plain, combined

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    for d in range(R):
        plain, combined = out[d]
        want = combine_ref(xs[d], idxs[d], ws[d])
        np.testing.assert_array_equal(bits(plain), bits(want))
        np.testing.assert_array_equal(bits(combined), bits(want))


@pytest.mark.parametrize("form", ["blocks", "experts"])
def test_a_signal_that_never_arrives_times_out_naming_rank_expert_block(rng, form):
    R, E = 2, 4
    xs, idxs, ws = make_inputs(rng, R, E, 1, [TMAX, TMAX], 0.0)
    for idx in idxs:
        idx[:, 0] = 1  # every token to rank 0's local expert 1: 16 rows, 6 blocks

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group, low_latency_mode=True)
        recv, count, handle, _, _ = buf.low_latency_dispatch(xs[r], idxs[r], TMAX, E, use_fp8=False)
        y = experts_on_packed(recv, count, r, E // R)
        x = np.full(y.shape, np.nan, dtype=BF16)
        signal = make_signal(form, E // R, R)
        produce(form, y, x, count, signal, 0.0, skip=(1, 4 if form == "blocks" else None) if r == 0 else None)
        timeout = group.timeout_s
        if r == 0:
            group.timeout_s = 0.3  # below the peer's wait for this rank's header
        with pytest.raises(epmoe.Error) as err:
            buf.low_latency_combine(x, idxs[r], ws[r], handle, **overlap_kwargs(form, signal, count))
        group.timeout_s = timeout
        again, _, _ = buf.low_latency_combine(y, idxs[r], ws[r], handle)  # the buffer stays usable
        return err.value.code, str(err.value), again

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    block = ", block 4" if form == "blocks" else ""
    code, msg, _ = out[0]
    assert code == "timeout", msg
    assert "rank 0" in msg and "local expert 1 (global 1)" + block in msg and "overlap signal" in msg, msg
    code, msg, _ = out[1]
    assert code == "timeout" and "rank 0's send gave up" in msg and "local expert 1" + block in msg, msg
    for d in range(R):
        np.testing.assert_array_equal(bits(out[d][2]), bits(combine_ref(xs[d], idxs[d], ws[d])))


def test_bad_overlap_arguments_are_named_before_any_communication(rng):
    R, E = 2, 4
    xs, idxs, ws = make_inputs(rng, R, E, 2, [TMAX, 4])
    el = E // R
    blocks = ceil_div(R * TMAX, BLOCK_M)

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group, low_latency_mode=True)
        recv, count, handle, _, _ = buf.low_latency_dispatch(xs[r], idxs[r], TMAX, E, use_fp8=False)
        y = experts_on_packed(recv, count, r, el)
        good = dict(overlap=True, packed_recv_count=count, comp_signal=np.zeros(el * blocks, np.int32),
                    block_m=BLOCK_M, threshold=1)
        cases = {
            "overlap": dict(overlap=True),
            "block_m": dict(good, block_m=0),
            "threshold": dict(good, threshold=-1),
            "num_sms": dict(good, num_sms=-3),
            "comp_signal": dict(good, comp_signal=np.zeros(el * blocks - 1, np.int32)),
            "packed_recv_count": dict(good, packed_recv_count=count + 1),
            "src_signals": dict(good, src_signals=np.zeros(el, np.uint32)),
            "src_signal_expect_value": dict(overlap=True, src_signals=np.zeros(el, np.uint32),
                                            src_signal_expect_value=0),
            "src_signals dtype": dict(overlap=True, src_signals=np.zeros(el, np.int32), src_signal_expect_value=1),
            "block_m type": dict(good, block_m=2.5),
        }
        errors = {}
        for name, kwargs in cases.items():
            with pytest.raises(epmoe.Error) as e:
                buf.low_latency_combine(y, idxs[r], ws[r], handle, **kwargs)
            errors[name] = (e.value.code, str(e.value))
        # overlap=False: the signal arguments are not looked at
        ignored, _, _ = buf.low_latency_combine(y, idxs[r], ws[r], handle, overlap=False, comp_signal="junk",
                                                block_m=-1, threshold=None, num_sms=None)
        return errors, ignored

    for d, (errors, ignored) in enumerate(epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)):
        for name, (code, msg) in errors.items():
            assert code == "invalid_argument", (name, msg)
            assert f"'{name.split()[0]}'" in msg, (name, msg)
        np.testing.assert_array_equal(bits(ignored), bits(combine_ref(xs[d], idxs[d], ws[d])))
