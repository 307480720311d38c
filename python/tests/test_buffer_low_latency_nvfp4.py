"""NVFP4 low-latency dispatch (semantics §5, §6) on thread ranks: DeepEP's call form (sgl-project/DeepEP's
use_nvfp4 / x_global_scale) and tuple; received codes and swizzled scales equal to the NumPy reference quantizer bit for
bit, the dequantized rows within the format's bound of the float64 inputs; the errors, each named before any exchange;
SGLang's dispatcher call (seeds/001) unchanged."""

from __future__ import annotations

import numpy as np
import pytest

import epmoe
from conftest import (FP8, TIMEOUT_S, e2m1_decode_ref, nice_bf16, nvfp4_quantize_ref, random_topk_idx,
                      ref_low_latency, swizzled_offset_ref)

K = 4


def global_scale(x) -> np.ndarray:
    """The producers' convention: 448 * 6 / amax, as a float32 scalar array."""
    amax = float(np.max(np.abs(x.astype(np.float64)))) if x.size else 1.0
    return np.array(448.0 * 6.0 / amax, dtype=np.float32)


def make_inputs(rng, R, E, H, tmax):
    Ts = [max(1, tmax - 3 * r) for r in range(R)]
    xs = [nice_bf16(rng, (T, H), low=1e-3, high=8.0) for T in Ts]
    idxs = [random_topk_idx(rng, T, K, E) for T in Ts]
    return Ts, xs, idxs


def unpermute(recv):
    """DeepEP's logical views back to epmoe's storage order: packed [E_local, R*Tmax, H/2] and the scales of each
    expert as one flat swizzled matrix [E_local, rm * rk * 512]."""
    q, sf = recv
    packed = np.transpose(q, (2, 0, 1))
    phys = np.transpose(sf, (5, 2, 4, 0, 1, 3))  # (E_local, rm, rk, 32, 4, 4)
    return packed, phys.reshape(phys.shape[0], -1).view(np.uint8)


def check_nvfp4(recv, count, xs, idxs, gss, E, R, d, tmax, H):
    el = E // R
    q, sf = recv
    rows = R * tmax
    rm, rk = (rows + 127) // 128, H // 64
    assert q.dtype == np.uint8 and q.shape == (rows, H // 2, el)
    assert sf.dtype == FP8 and sf.shape == (32, 4, rm, 4, rk, el)
    packed, scales = unpermute(recv)
    per_expert, _ = ref_low_latency(idxs, E, R, d)
    np.testing.assert_array_equal(count, np.array([len(r) for r in per_expert], dtype=np.int32))
    refs = [nvfp4_quantize_ref(xs[s], gss[s]) for s in range(R)]
    for e, src_rows in enumerate(per_expert):
        for j, (s, t) in enumerate(src_rows):
            rq, rsc, step, amax = refs[s]
            np.testing.assert_array_equal(packed[e, j], rq[t], err_msg=f"codes expert {e} row {j}")
            got_sc = np.array([scales[e, swizzled_offset_ref(j, b, rk)] for b in range(H // 16)], dtype=np.uint8)
            np.testing.assert_array_equal(got_sc, rsc[t], err_msg=f"scales expert {e} row {j}")
            # Dequantized in float64 from what was received, within max(s, amax - 6 s) of the input per element.
            codes = np.stack([packed[e, j] & 0xF, packed[e, j] >> 4], axis=1).reshape(-1)
            sfv = got_sc.view(FP8).astype(np.float64)
            deq = e2m1_decode_ref(codes) * np.repeat(sfv / float(gss[s]), 16)
            x = xs[s][t].astype(np.float64)
            bound = np.repeat(np.maximum(step[t], amax[t] - 6.0 * step[t]), 16) * (1 + 1e-6)
            assert np.all(np.abs(deq - x) <= bound), f"expert {e} row {j}: round trip past the bound"


@pytest.mark.parametrize("R,tmax", [(2, 8), (4, 40)])  # 4 x 40 = 160 rows: two tiles of 128 in the scales
@pytest.mark.parametrize("H", [128, 2048])
def test_nvfp4_dispatch_matches_reference_quantizer(rng, R, tmax, H):
    E = 4 * R
    Ts, xs, idxs = make_inputs(rng, R, E, H, tmax)
    gss = [global_scale(x) for x in xs]

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group, low_latency_mode=True)
        recv, count, handle, event, hook = buf.low_latency_dispatch(xs[r], idxs[r], tmax, E, use_fp8=False,
                                                                    use_nvfp4=True, x_global_scale=gss[r])
        assert hook is None and isinstance(recv, tuple) and len(recv) == 2
        return recv, count

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    for d in range(R):
        check_nvfp4(out[d][0], out[d][1], xs, idxs, gss, E, R, d, tmax, H)


def test_nvfp4_errors_are_named_before_any_exchange(rng):
    R, E, H, tmax = 2, 4, 128, 8
    Ts, xs, idxs = make_inputs(rng, R, E, H, tmax)
    x96 = [nice_bf16(rng, (T, 96)) for T in Ts]
    good = np.array(2.0, dtype=np.float32)

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group, low_latency_mode=True)
        x, idx = xs[r], idxs[r]
        cases = {
            "use_nvfp4": lambda: buf.low_latency_dispatch(x, idx, tmax, E, use_nvfp4=True, x_global_scale=good),
            "x_global_scale": [
                lambda: buf.low_latency_dispatch(x, idx, tmax, E, use_fp8=False, use_nvfp4=True),
                lambda: buf.low_latency_dispatch(x, idx, tmax, E, use_fp8=False, use_nvfp4=True,
                                                 x_global_scale=np.array(2.0, dtype=np.float64)),
                lambda: buf.low_latency_dispatch(x, idx, tmax, E, use_fp8=False, use_nvfp4=True,
                                                 x_global_scale=np.ones(2, dtype=np.float32)),
                lambda: buf.low_latency_dispatch(x, idx, tmax, E, use_fp8=False, use_nvfp4=True, x_global_scale=2.0),
            ] + [
                (lambda v: lambda: buf.low_latency_dispatch(x, idx, tmax, E, use_fp8=False, use_nvfp4=True,
                                                            x_global_scale=np.array(v, dtype=np.float32)))(v)
                for v in (np.nan, np.inf, -np.inf, 0.0, -1.0)
            ],
            "x": lambda: buf.low_latency_dispatch(x96[r], idx, tmax, E, use_fp8=False, use_nvfp4=True,
                                                  x_global_scale=good),
        }
        for name, calls in cases.items():
            for call in calls if isinstance(calls, list) else [calls]:
                with pytest.raises(epmoe.Error) as e:
                    call()
                assert e.value.code == "invalid_argument", str(e.value)
                assert f"'{name}'" in str(e.value), str(e.value)
        # Still usable, and the same dispatch with a [1]-shaped scale works.
        recv, count, _, _, _ = buf.low_latency_dispatch(x, idx, tmax, E, use_fp8=False, use_nvfp4=True,
                                                        x_global_scale=good.reshape(1))
        return recv, count

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    for d in range(R):
        check_nvfp4(out[d][0], out[d][1], xs, idxs, [np.float32(2.0)] * R, E, R, d, tmax, H)


def _sglang_dispatch(buffer, hidden_states, topk_ids, num_max_dispatch_tokens_per_rank, num_experts,
                     input_global_scale, return_recv_hook):
    """SGLang's DeepEP low-latency dispatcher (seeds/001, _dispatch_core and dispatch_b) with use_nvfp4, verbatim in
    the arguments it passes."""
    use_fp8, use_nvfp4 = False, True
    packed_recv_hidden, packed_recv_count, handle, event, hook = buffer.low_latency_dispatch(
        hidden_states,
        topk_ids,
        num_max_dispatch_tokens_per_rank,
        num_experts,
        use_fp8=use_fp8,
        **(dict(use_nvfp4=True) if use_nvfp4 else dict()),
        **(dict(x_global_scale=input_global_scale) if input_global_scale is not None else dict()),
        async_finish=not return_recv_hook,
        return_recv_hook=return_recv_hook,
    )
    hook() if return_recv_hook else event.current_stream_wait()
    if isinstance(packed_recv_hidden, tuple):
        hidden_states, hidden_states_scale = packed_recv_hidden
    else:
        hidden_states_scale = None
    return (hidden_states, hidden_states_scale), packed_recv_count


@pytest.mark.parametrize("return_recv_hook", [False, True])
def test_sglang_nvfp4_call_form_runs_unchanged(rng, return_recv_hook):
    R, E, H, tmax = 2, 8, 256, 16
    Ts, xs, idxs = make_inputs(rng, R, E, H, tmax)
    gss = [global_scale(x) for x in xs]

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group, num_rdma_bytes=epmoe.Buffer.get_low_latency_rdma_size_hint(tmax, H, R, E),
                           low_latency_mode=True)
        return _sglang_dispatch(buf, xs[r], idxs[r], tmax, E, gss[r], return_recv_hook)

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    for d in range(R):
        (q, sf), count = out[d]
        assert sf is not None
        check_nvfp4((q, sf), count, xs, idxs, gss, E, R, d, tmax, H)


def test_sglang_nvfp4_call_form_with_torch_tensors(rng):
    torch = pytest.importorskip("torch")
    R, E, H, tmax = 2, 8, 128, 8
    Ts, xs, idxs = make_inputs(rng, R, E, H, tmax)
    gss = [global_scale(x) for x in xs]

    def rank_main(group):
        r = group.rank()
        buf = epmoe.Buffer(group, low_latency_mode=True)
        x = torch.from_numpy(xs[r].astype(np.float32)).to(torch.bfloat16)
        (q, sf), count = _sglang_dispatch(buf, x, torch.from_numpy(idxs[r]), tmax, E,
                                          torch.tensor(float(gss[r]), dtype=torch.float32), False)
        assert q.dtype == torch.uint8 and sf.dtype == torch.float8_e4m3fn
        # The consumer's unpacking (SGLang's flashinfer_cutedsl_moe_masked): m, k // 2, num_experts = a_q.shape.
        m, k_by_2, num_experts = q.shape
        assert (m, k_by_2 * 2, num_experts) == (R * tmax, H, E // R)
        return (q.numpy(), sf.view(torch.uint8).numpy().view(FP8)), count.numpy()

    out = epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)
    for d in range(R):
        check_nvfp4(out[d][0], out[d][1], xs, idxs, gss, E, R, d, tmax, H)
