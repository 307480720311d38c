"""Shared fixtures and NumPy references for the epmoe Python tests.

The references are written from docs/semantics.md in NumPy (float64 where arithmetic is involved; float32 where
the semantics fix float32 arithmetic, e.g. fp8 scales and the low-latency combine), and never call epmoe.
Every test gets a seeded generator; the seed is printed (pytest shows it on failure) and can be forced
with EPMOE_TEST_SEED.
"""

from __future__ import annotations

import math
import os
import random
from typing import List, Sequence, Tuple

import ml_dtypes
import numpy as np
import pytest

BF16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn
FP8_MAX = np.float32(448.0)
GROUP = 128

# Waits between thread ranks give up after this long in the tests (a failing rank then cannot hang
# the suite for the default 100 s).
TIMEOUT_S = 30.0


@pytest.fixture
def rng(request) -> np.random.Generator:
    seed = int(os.environ.get("EPMOE_TEST_SEED", random.SystemRandom().randrange(2**32)))
    print(f"[{request.node.name}] seed={seed} (EPMOE_TEST_SEED={seed} reproduces it)")
    return np.random.default_rng(seed)


# ------------------------------------------------------------------------------------------ inputs

def nice_bf16(rng: np.random.Generator, shape: Sequence[int], low: float = 0.125, high: float = 4.0) -> np.ndarray:
    """bf16 values with |v| in [low, high) and random signs (never zero): sums of a few of them, scaled
    by small integers, are exact in float32, so float64 references compare bit for bit."""
    mag = rng.uniform(low, high, size=shape)
    sign = np.where(rng.random(size=shape) < 0.5, -1.0, 1.0)
    return (mag * sign).astype(BF16)


def random_topk_idx(rng: np.random.Generator, T: int, K: int, E: int, p_none: float = 0.15) -> np.ndarray:
    """int64 [T, K]: K distinct experts per token, some entries -1 (and some tokens with no expert)."""
    idx = np.stack([rng.choice(E, size=K, replace=False) for _ in range(T)]).astype(np.int64) if T else \
        np.zeros((0, K), np.int64)
    idx[rng.random(size=idx.shape) < p_none] = -1
    if T >= 3:
        idx[T // 2] = -1  # a token sent nowhere
    return idx


# ------------------------------------------------------------------------------------------ dispatch

def ref_dispatch(idxs: List[np.ndarray], E: int, R: int,
                 d: int) -> Tuple[List[Tuple[int, int]], np.ndarray, np.ndarray]:
    """What rank d receives in normal mode (semantics §4): the (source rank, token) of each row, in order
    (source ascending, token order within), the local ids [-1 where elsewhere] and a mask of them."""
    el = E // R
    rows = []
    for s in range(R):
        for t in range(idxs[s].shape[0]):
            ids = idxs[s][t]
            if np.any((ids >= 0) & (ids // el == d)):
                rows.append((s, t))
    K = idxs[0].shape[1]
    local = np.full((len(rows), K), -1, dtype=np.int64)
    for j, (s, t) in enumerate(rows):
        ids = idxs[s][t]
        mine = (ids >= 0) & (ids // el == d)
        local[j, mine] = ids[mine] - d * el
    return rows, local, local >= 0


def ref_expert_counts(local: np.ndarray, el: int, alignment: int = 1) -> List[int]:
    """Received rows per local expert, rounded up to a multiple of `alignment`."""
    counts = [int(np.sum(np.any(local == e, axis=1))) for e in range(el)]
    return [(c + alignment - 1) // alignment * alignment for c in counts]


def ref_low_latency(idxs: List[np.ndarray], E: int, R: int, d: int):
    """Rank d's low-latency receive (semantics §5): per local expert the (source, token) rows (blocks by
    source ascending, token order within), and layout_range[e][s] = begin << 32 | count."""
    el = E // R
    per_expert = []
    ranges = np.zeros((el, R), dtype=np.int64)
    for e in range(el):
        g = d * el + e
        rows = []
        for s in range(R):
            begin = len(rows)
            for t in range(idxs[s].shape[0]):
                if g in idxs[s][t]:
                    rows.append((s, t))
            ranges[e, s] = (begin << 32) | (len(rows) - begin)
        per_expert.append(rows)
    return per_expert, ranges


# ------------------------------------------------------------------------------------------ fp8

def fp8_quantize_ref(x: np.ndarray, round_scale: bool = False, use_ue8m0: bool = False):
    """semantics §6 in NumPy float32: a = max(amax, 1e-4); scale = a / 448 (or 2^ceil(log2(a / 448)));
    q = fp8(x * (448 / a)) (or fp8(x / scale)); ml_dtypes' float32 -> e4m3fn rounds to nearest even.
    Returns (q float8_e4m3fn [T, H], scales float32 [T, G] or UE8M0 int32 [T, ceil(G/4)])."""
    x32 = x.astype(np.float32)
    T, H = x32.shape
    G = (H + GROUP - 1) // GROUP
    q = np.zeros((T, H), dtype=FP8)
    scales = np.zeros((T, G), dtype=np.float32)
    exps = np.zeros((T, G), dtype=np.int64)
    for g in range(G):
        blk = x32[:, g * GROUP:(g + 1) * GROUP]
        a = np.maximum(np.max(np.abs(blk), axis=1), np.float32(1e-4)).astype(np.float32)
        if round_scale:
            c = (a / FP8_MAX).astype(np.float32)
            m, e = np.frexp(c.astype(np.float64))  # c = m * 2^e, m in [0.5, 1)
            e = np.where(m == 0.5, e - 1, e)
            s = np.ldexp(np.float32(1.0), e).astype(np.float32)
            q[:, g * GROUP:(g + 1) * GROUP] = (blk / s[:, None]).astype(FP8)
            scales[:, g] = s
            exps[:, g] = e
        else:
            inv = (FP8_MAX / a).astype(np.float32)
            q[:, g * GROUP:(g + 1) * GROUP] = (blk * inv[:, None]).astype(np.float32).astype(FP8)
            scales[:, g] = (a / FP8_MAX).astype(np.float32)
    if not use_ue8m0:
        return q, scales
    W = (G + 3) // 4
    words = np.zeros((T, W), dtype=np.uint32)
    for g in range(G):
        words[:, g // 4] |= ((exps[:, g] + 127).astype(np.uint32) & 0xFF) << np.uint32(8 * (g % 4))
    return q, words.view(np.int32)


def fp8_dequantize_ref(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64 q * scale per group; UE8M0 int32 words are unpacked to 2^(byte - 127)."""
    qf = q.astype(np.float64)
    T, H = qf.shape
    G = (H + GROUP - 1) // GROUP
    if scales.dtype == np.int32:
        b = scales.view(np.uint32)
        s = np.stack([((b[:, g // 4] >> np.uint32(8 * (g % 4))) & 0xFF).astype(np.float64) for g in range(G)], axis=1)
        s = np.exp2(s - 127.0)
    else:
        s = scales.astype(np.float64)
    out = np.empty_like(qf)
    for g in range(G):
        out[:, g * GROUP:(g + 1) * GROUP] = qf[:, g * GROUP:(g + 1) * GROUP] * s[:, g:g + 1]
    return out


# ------------------------------------------------------------------------------------------ nvfp4

E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_encode_ref(y: np.ndarray) -> np.ndarray:
    """Nearest e2m1 code (uint8, 0..15) of each value: ties to the even code, magnitudes past 6 saturate, the sign
    kept (also for zeros), NaN -> 0x7 (semantics §6, "NVFP4")."""
    y = np.asarray(y, dtype=np.float64)
    mag = np.abs(y)
    d = np.abs(mag[..., None] - E2M1_GRID)
    best = np.argmin(d, axis=-1)  # the lower of two equally near codes
    upper = np.minimum(best + 1, 7)
    tie = (np.take_along_axis(d, upper[..., None], -1)[..., 0] == np.take_along_axis(d, best[..., None], -1)[..., 0])
    best = np.where(tie & (best % 2 == 1) & (best < 7), upper, best)
    best = np.where(mag > 6.0, 7, best)
    code = (best | np.where(np.signbit(y), 8, 0)).astype(np.uint8)
    return np.where(np.isnan(y), np.uint8(7), code).astype(np.uint8)


def e2m1_decode_ref(code: np.ndarray) -> np.ndarray:
    v = E2M1_GRID[code & 7]
    return np.where(code & 8, -v, v)


def nvfp4_quantize_ref(x: np.ndarray, gs: float):
    """semantics §6 NVFP4 in NumPy float32: per block of 16, amax; sf = e4m3((amax / 6) * gs) (ml_dtypes rounds to
    nearest even; saturated at 448 first); m = gs / float(sf) (0 for a zero scale); q = e2m1(x * m) with codes 2i / 2i+1
    in the low / high nibble. Returns (q uint8 [T, H/2], scales uint8 [T, H/16] linear e4m3 codes, step float64
    [T, H/16] = float(sf) / gs, amax float64 [T, H/16])."""
    x32 = x.astype(np.float32)
    T, H = x32.shape
    blk = x32.reshape(T, H // 16, 16)
    g = np.float32(gs)
    amax = np.max(np.abs(blk), axis=2).astype(np.float32)
    s = ((amax / np.float32(6.0)).astype(np.float32) * g).astype(np.float32)
    sf = np.minimum(s, FP8_MAX).astype(FP8)
    sfv = sf.astype(np.float32)
    with np.errstate(divide="ignore"):
        m = np.where(sfv > 0, np.minimum(g / sfv, np.float32(np.finfo(np.float32).max)), np.float32(0)).astype(np.float32)
    y = (blk * m[:, :, None]).astype(np.float32).reshape(T, H)
    codes = e2m1_encode_ref(y)
    q = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return q, sf.view(np.uint8), sfv.astype(np.float64) / float(g), amax.astype(np.float64)


def swizzled_offset_ref(row: int, col: int, col_tiles: int) -> int:
    """Byte of scale (row, col) in a 128x4-tiled matrix: tiles (row / 128, col / 4) row-major, 512 bytes each, inside
    (row % 32) * 16 + ((row % 128) / 32) * 4 + col % 4 (CUTLASS's / FlashInfer's / DeepEP's nvfp4 scale layout)."""
    return ((row // 128) * col_tiles + col // 4) * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4 + col % 4


# ------------------------------------------------------------------------------------------ router

def softmax64(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def sigmoid64(logits: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))


def topk_ref(scores: np.ndarray, K: int) -> Tuple[np.ndarray, np.ndarray]:
    """The K largest per row, descending, ties to the lower index (a stable sort of -score)."""
    order = np.argsort(-scores, axis=1, kind="stable")[:, :K]
    return np.take_along_axis(scores, order, axis=1), order.astype(np.int64)


def grouped_topk_ref(logits, K, num_groups, topk_group, scoring, renormalize, factor, bias=None):
    """DeepSeek-V2/V3 grouped top-k (semantics §2) in float64."""
    scores = softmax64(logits) if scoring == "softmax" else sigmoid64(logits)
    T, E = scores.shape
    sel = scores + bias.astype(np.float64)[None, :] if bias is not None else scores
    grouped = sel.reshape(T, num_groups, E // num_groups)
    if bias is not None:
        top2 = -np.sort(-grouped, axis=2)[:, :, :2]
        group_score = top2.sum(axis=2)
    else:
        group_score = grouped.max(axis=2)
    keep = np.argsort(-group_score, axis=1, kind="stable")[:, :topk_group]
    mask = np.zeros((T, num_groups), dtype=bool)
    np.put_along_axis(mask, keep, True, axis=1)
    masked = np.where(np.repeat(mask, E // num_groups, axis=1), sel, -np.inf)
    order = np.argsort(-masked, axis=1, kind="stable")[:, :K]
    w = np.take_along_axis(scores, order, axis=1)
    if renormalize:
        w = w / w.sum(axis=1, keepdims=True)
    return w * factor, order.astype(np.int64)


# ------------------------------------------------------------------------------------------ experts

_erf = np.vectorize(math.erf, otypes=[np.float64])


def act_ref(name: str, gate: np.ndarray, up: np.ndarray = None) -> np.ndarray:
    """vLLM's activations (semantics §7) in float64."""
    silu = lambda v: v / (1.0 + np.exp(-v))  # noqa: E731
    gelu = lambda v: 0.5 * v * (1.0 + _erf(v / math.sqrt(2.0)))  # noqa: E731
    if name == "silu":
        return silu(gate) * up
    if name == "gelu":
        return gelu(gate) * up
    if name == "silu_no_mul":
        return silu(gate)
    if name == "relu2_no_mul":
        return np.maximum(gate, 0.0) ** 2
    raise ValueError(name)


def moe_ref(x: np.ndarray, w1: np.ndarray, w2: np.ndarray, topk_w: np.ndarray, topk_idx: np.ndarray,
            activation: str) -> np.ndarray:
    """float64 out[t] = sum_k w[t,k] * w2[e] @ act(w1[e] @ x[t]), e = topk_idx[t,k] (global), -1 skipped."""
    x64, w1_64, w2_64 = x.astype(np.float64), w1.astype(np.float64), w2.astype(np.float64)
    gated = activation in ("silu", "gelu", "swigluoai")
    N = w2.shape[2]
    out = np.zeros((x.shape[0], w2.shape[1]))
    for t in range(x.shape[0]):
        for k in range(topk_idx.shape[1]):
            e = int(topk_idx[t, k])
            if e < 0:
                continue
            h = w1_64[e] @ x64[t]
            a = act_ref(activation, h[:N], h[N:]) if gated else act_ref(activation, h)
            out[t] += float(topk_w[t, k]) * (w2_64[e] @ a)
    return out


def rel_l2(a: np.ndarray, ref: np.ndarray) -> float:
    a64, r64 = np.asarray(a, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(a64 - r64) / max(np.linalg.norm(r64), 1e-300))


class Unwritten:
    """Copies of a call's input arrays, taken before it, to check that it wrote none of them (semantics §1: inputs
    are never written). Tuples (fp8 x with its scales, a handle) are taken element by element; None is skipped."""

    def __init__(self, **arrays):
        self._saved = []
        for name, a in arrays.items():
            self.add(name, a)

    def add(self, name: str, a) -> "Unwritten":
        if isinstance(a, tuple):
            for i, part in enumerate(a):
                self.add(f"{name}[{i}]", part)
        elif isinstance(a, np.ndarray):
            self._saved.append((name, a, a.tobytes()))
        return self

    def check(self) -> None:
        for name, a, before in self._saved:
            assert a.tobytes() == before, f"input '{name}' was written"


def bits(a: np.ndarray) -> np.ndarray:
    """The raw bits of a bf16 / fp8 array, for bit-exact comparisons."""
    return a.view(np.uint16) if a.dtype == BF16 else a.view(np.uint8) if a.dtype == FP8 else a
