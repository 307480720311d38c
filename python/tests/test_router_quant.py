"""Router (semantics §2), dispatch layout (semantics §3), fp8 and NVFP4 quantization (semantics §6) against NumPy
references."""

from __future__ import annotations

import numpy as np
import pytest

import epmoe
from conftest import (BF16, FP8, bits, e2m1_decode_ref, fp8_dequantize_ref, fp8_quantize_ref, grouped_topk_ref,
                      nice_bf16, nvfp4_quantize_ref, random_topk_idx, sigmoid64, softmax64, swizzled_offset_ref,
                      topk_ref)


def spaced_logits(rng, T, E):
    """Logits whose sorted values are at least ~0.05 apart, so float32 and float64 agree on the order."""
    base = np.stack([rng.permutation(E) for _ in range(T)]).astype(np.float64) * 0.07
    return (base + rng.uniform(-0.01, 0.01, size=(T, E))).astype(np.float32)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("fn,score", [("topk_softmax", softmax64), ("topk_sigmoid", sigmoid64)])
def test_topk_matches_numpy(rng, fn, score, renormalize):
    T, E, K = 17, 32, 6
    logits = spaced_logits(rng, T, E)
    w, idx = getattr(epmoe, fn)(logits, K, renormalize)
    ref_w, ref_idx = topk_ref(score(logits), K)
    if renormalize:
        ref_w = ref_w / ref_w.sum(axis=1, keepdims=True)
    assert w.dtype == np.float32 and idx.dtype == np.int64 and w.shape == (T, K)
    np.testing.assert_array_equal(idx, ref_idx)
    np.testing.assert_allclose(w, ref_w, rtol=2e-6, atol=1e-7)


def test_topk_ties_go_to_the_lower_expert():
    logits = np.array([[1.0, 3.0, 3.0, 0.5, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]], dtype=np.float32)
    _, idx = epmoe.topk_softmax(logits, 3)
    np.testing.assert_array_equal(idx, [[1, 2, 4], [0, 1, 2]])
    _, idx = epmoe.topk_sigmoid(logits.astype(BF16), 2)  # bfloat16 logits are accepted too
    np.testing.assert_array_equal(idx, [[1, 2], [0, 1]])


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_topk_matches_numpy(rng, scoring, with_bias):
    T, E, K, groups, keep = 13, 64, 8, 8, 4
    logits = spaced_logits(rng, T, E)
    bias = (rng.permutation(E) * 0.003).astype(np.float32) if with_bias else None
    w, idx = epmoe.grouped_topk(logits, K, groups, keep, scoring_func=scoring, renormalize=True,
                                routed_scaling_factor=2.5, e_score_correction_bias=bias)
    ref_w, ref_idx = grouped_topk_ref(logits, K, groups, keep, scoring, True, 2.5, bias)
    np.testing.assert_array_equal(idx, ref_idx)
    np.testing.assert_allclose(w, ref_w, rtol=2e-6, atol=1e-7)


def test_dispatch_layout_matches_numpy(rng):
    T, K, E, R = 23, 4, 16, 4
    idx = random_topk_idx(rng, T, K, E)
    per_rank, per_expert, in_rank = epmoe.get_dispatch_layout(idx.astype(np.int32), E, R)  # int32 accepted
    el = E // R
    exp_in_rank = np.stack([np.any((idx >= 0) & (idx // el == r), axis=1) for r in range(R)], axis=1)
    np.testing.assert_array_equal(in_rank, exp_in_rank)
    np.testing.assert_array_equal(per_rank, exp_in_rank.sum(axis=0))
    np.testing.assert_array_equal(per_expert, [np.sum(idx == e) for e in range(E)])


@pytest.mark.parametrize("H", [128, 144, 512, 2880])
@pytest.mark.parametrize("dtype", [BF16, np.float32])
@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
def test_quantize_fp8_matches_numpy(rng, H, dtype, round_scale, use_ue8m0):
    T = 9
    x = (rng.standard_normal((T, H)) * rng.uniform(0.01, 30.0, size=(T, 1))).astype(dtype)
    x[0, :] = 0  # an all-zero group: amax floors at 1e-4
    x[1, 5] = 1e6 if dtype == np.float32 else 3e4  # one huge value: the rest of its group underflows
    q, scales = epmoe.quantize_fp8(x, round_scale=round_scale, use_ue8m0=use_ue8m0)
    rq, rs = fp8_quantize_ref(x, round_scale, use_ue8m0)
    G = (H + 127) // 128
    assert q.dtype == FP8 and q.shape == (T, H)
    assert scales.shape == (T, (G + 3) // 4 if use_ue8m0 else G)
    assert scales.dtype == (np.int32 if use_ue8m0 else np.float32)
    np.testing.assert_array_equal(bits(q), bits(rq))
    np.testing.assert_array_equal(scales, rs)
    # dequantize: q * scale per group, then one rounding to the output dtype
    ref = fp8_dequantize_ref(rq, rs)
    np.testing.assert_array_equal(epmoe.dequantize_fp8(q, scales, "float32"), ref.astype(np.float32))
    np.testing.assert_array_equal(bits(epmoe.dequantize_fp8(q, scales)), bits(ref.astype(np.float32).astype(BF16)))


@pytest.mark.parametrize("H", [2048, 2880, 4096, 7168])
@pytest.mark.parametrize("T", [0, 1, 5, 12])
@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
def test_quantize_fp8_column_major_scales(rng, H, T, round_scale, use_ue8m0):
    """scale_layout='column_major': DeepGEMM's MN-major TMA-aligned layout, strides (1, T rounded up to 4) in
    elements; the same values as the row-major path and the NumPy reference; dequantize reads either."""
    x = (rng.standard_normal((T, H)) * rng.uniform(0.01, 30.0, size=(T, 1))).astype(BF16)
    q, col = epmoe.quantize_fp8(x, round_scale=round_scale, use_ue8m0=use_ue8m0, scale_layout="column_major")
    q_row, row = epmoe.quantize_fp8(x, round_scale=round_scale, use_ue8m0=use_ue8m0)
    rq, rs = fp8_quantize_ref(x, round_scale, use_ue8m0)
    G = (H + 127) // 128
    C = (G + 3) // 4 if use_ue8m0 else G
    pitch = (T + 3) // 4 * 4
    assert col.shape == (T, C) and col.dtype == row.dtype
    if T > 0:
        assert col.strides == (4, 4 * pitch)  # bytes
        assert row.strides == (4 * C, 4)
    np.testing.assert_array_equal(bits(q), bits(rq))
    np.testing.assert_array_equal(bits(q_row), bits(rq))
    np.testing.assert_array_equal(col, rs)
    np.testing.assert_array_equal(col, row)
    np.testing.assert_array_equal(bits(epmoe.dequantize_fp8(q, col)), bits(epmoe.dequantize_fp8(q_row, row)))


def test_grouped_topk_errors_name_the_python_arguments():
    """Found by a fresh user: grouped_topk's errors named 'options.e_score_correction_bias' (and options.topk_group,
    ...), the C++ API's fields, which a Python caller never typed. They name the Python arguments."""
    T, E = 3, 8
    logits = np.zeros((T, E), np.float32)
    bias = np.zeros(E, np.float32)
    cases = [
        (dict(num_topk=5, num_expert_group=4, topk_group=2), "num_topk", "expected in [1, 4], got 5"),
        (dict(num_topk=2, num_expert_group=3, topk_group=1), "num_expert_group", "expected a divisor of E = 8, got 3"),
        (dict(num_topk=2, num_expert_group=4, topk_group=5), "topk_group", "expected in [1, num_expert_group = 4], "
                                                                         "got 5"),
        (dict(num_topk=2, num_expert_group=2, topk_group=1, routed_scaling_factor=float("inf")),
         "routed_scaling_factor", "expected a finite number, got inf"),
        (dict(num_topk=2, num_expert_group=2, topk_group=1, e_score_correction_bias=bias[:4]),
         "e_score_correction_bias", "expected float32[8] (one per expert), got float32[4] cpu"),
        (dict(num_topk=2, num_expert_group=2, topk_group=1, e_score_correction_bias=bias.astype(np.float16)),
         "e_score_correction_bias", "expected float32[8] (one per expert), got float16[8] cpu"),
        (dict(num_topk=2, num_expert_group=2, topk_group=1, e_score_correction_bias=np.zeros(2 * E, np.float32)[::2]),
         "e_score_correction_bias", "expected stride 1, got 2"),
    ]
    for kwargs, name, rest in cases:
        with pytest.raises(epmoe.Error) as e:
            epmoe.grouped_topk(logits, **kwargs)
        assert (e.value.code, str(e.value)) == ("invalid_argument", f"epmoe: invalid argument '{name}': {rest}"), kwargs
    weights, idx = epmoe.grouped_topk(logits, 2, 2, 1, e_score_correction_bias=bias)  # the names change nothing else
    assert weights.shape == idx.shape == (T, 2)


def test_quantize_fp8_scale_layout_errors(rng):
    x = nice_bf16(rng, (4, 256))
    with pytest.raises(epmoe.Error, match="'scale_layout'.*'row_major' or 'column_major'.*'columns'"):
        epmoe.quantize_fp8(x, scale_layout="columns")
    # Named as the Python caller names it (the C++ API's field is options.use_ue8m0).
    with pytest.raises(epmoe.Error, match="^epmoe: invalid argument 'use_ue8m0': expected round_scale = true"):
        epmoe.quantize_fp8(x, use_ue8m0=True, scale_layout="column_major")
    # dequantize refuses scales in neither layout (strided in both dimensions)
    q, scales = epmoe.quantize_fp8(x)
    wide = np.zeros((8, 4), np.float32)
    wide[::2, ::2] = scales
    with pytest.raises(epmoe.Error, match="'scales'.*row-major.*column-major"):
        epmoe.dequantize_fp8(q, wide[::2, ::2])


def test_ue8m0_bytes_and_group_scale():
    assert epmoe.ue8m0_from_scale(1.0) == 127
    assert epmoe.ue8m0_from_scale(2.0 ** -10) == 117
    assert epmoe.ue8m0_to_scale(130) == 8.0
    assert epmoe.fp8_group_scale(448.0) == np.float32(1.0)
    assert epmoe.fp8_group_scale(0.0) == np.float32(np.float32(1e-4) / np.float32(448.0))
    assert epmoe.fp8_group_scale(449.0, round_scale=True) == 2.0
    assert epmoe.num_scale_groups(2880) == 23 and epmoe.num_ue8m0_words(2880) == 6


def swizzle_ref(linear: np.ndarray) -> np.ndarray:
    """Linear e4m3 codes uint8 [T, H/16] into the 128x4-tiled matrix uint8 [ceil(T/128), (H/64)*512], padding 0."""
    T, C = linear.shape
    col_tiles = (C + 3) // 4
    out = np.zeros(((T + 127) // 128) * col_tiles * 512, dtype=np.uint8)
    for t in range(T):
        for c in range(C):
            out[swizzled_offset_ref(t, c, col_tiles)] = linear[t, c]
    return out.reshape((T + 127) // 128, col_tiles * 512)


@pytest.mark.parametrize("H", [64, 2048, 2880, 7168])
@pytest.mark.parametrize("T", [0, 1, 130])
@pytest.mark.parametrize("dtype", [BF16, np.float32])
@pytest.mark.parametrize("scale_layout", ["swizzled", "linear"])
def test_quantize_nvfp4_matches_numpy(rng, H, T, dtype, scale_layout):
    if scale_layout == "swizzled" and H % 64:
        pytest.skip("the swizzled layout needs H % 64 == 0 (refused: test_nvfp4_errors_name_the_argument)")
    x = (rng.standard_normal((T, H)) * rng.uniform(0.01, 30.0, size=(T, 1))).astype(dtype)
    if T:
        x[0, :16] = 0  # a zero block: scale 0, every code +-0
        x[-1, 20] = 3e4  # one large value: the rest of its block rounds to small codes
    amax = float(np.max(np.abs(x.astype(np.float32)))) if T else 1.0
    gs = np.float32(448.0 * 6.0 / amax)
    q, scales = epmoe.quantize_nvfp4(x, np.array([gs], dtype=np.float32), scale_layout=scale_layout)
    rq, rsf, step, _ = nvfp4_quantize_ref(x, gs)
    assert q.dtype == np.uint8 and q.shape == (T, H // 2)
    np.testing.assert_array_equal(q, rq)
    assert scales.dtype == FP8
    want = swizzle_ref(rsf) if scale_layout == "swizzled" else rsf
    assert scales.shape == want.shape
    np.testing.assert_array_equal(scales.view(np.uint8), want)
    # dequantize: e2m1 value * (sf / gs) in float32, then one rounding to bfloat16 if asked; a Python float is the
    # same global scale
    codes = np.stack([rq & 15, rq >> 4], axis=-1).reshape(T, H)
    ref = (e2m1_decode_ref(codes).astype(np.float32) *
           np.repeat((rsf.view(FP8).astype(np.float32) / gs).astype(np.float32), 16, axis=1)).astype(np.float32)
    got = epmoe.dequantize_nvfp4(q, scales, float(gs), scale_layout=scale_layout, out_dtype="float32")
    np.testing.assert_array_equal(got, ref)
    got16 = epmoe.dequantize_nvfp4(q, scales, np.array(gs, dtype=np.float32), scale_layout=scale_layout)
    assert got16.dtype == BF16
    np.testing.assert_array_equal(bits(got16), bits(ref.astype(BF16)))


def test_nvfp4_errors_name_the_argument(rng):
    x = nice_bf16(rng, (4, 64))
    gs = np.array([2.0], dtype=np.float32)

    def named(name, call):
        with pytest.raises(epmoe.Error) as e:
            call()
        assert e.value.code == "invalid_argument" and f"'{name}'" in str(e.value), str(e.value)

    named("x", lambda: epmoe.quantize_nvfp4(nice_bf16(rng, (4, 40)), gs))  # H % 16 != 0
    named("x", lambda: epmoe.quantize_nvfp4(nice_bf16(rng, (4, 48)), gs))  # swizzled needs H % 64 == 0
    named("x", lambda: epmoe.quantize_nvfp4(x.astype(np.float64), gs))
    named("global_scale", lambda: epmoe.quantize_nvfp4(x, np.array([0.0], dtype=np.float32)))
    named("global_scale", lambda: epmoe.quantize_nvfp4(x, float("nan")))
    named("global_scale", lambda: epmoe.quantize_nvfp4(x, np.array([1.0, 2.0], dtype=np.float32)))
    named("global_scale", lambda: epmoe.quantize_nvfp4(x, np.array([1.0], dtype=np.float64)))
    named("global_scale", lambda: epmoe.quantize_nvfp4(x, None))
    named("scale_layout", lambda: epmoe.quantize_nvfp4(x, gs, scale_layout="tiled"))
    q, s = epmoe.quantize_nvfp4(x, gs)
    named("out_dtype", lambda: epmoe.dequantize_nvfp4(q, s, gs, out_dtype="float16"))
    named("scales", lambda: epmoe.dequantize_nvfp4(q, s.view(np.uint8), gs))
    named("q", lambda: epmoe.dequantize_nvfp4(q.view(np.int8), s, gs))
