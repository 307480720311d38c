"""The MoE layer on one GPU from Python (semantics §7, 8, 13): epmoe.MoELayer with epmoe.make_cuda_experts on torch CUDA
tensors, one process, one GPU.

- No-EP prepare/finalize (make_no_ep_prepare_finalize) in the 'standard' and 'batched_experts' formats, bf16 and
  fp8 dispatch, K = 1 and K = 8, H = 2048 and 7168 at small T, on a torch side stream (the layer must run on
  torch's current stream), checked against the NumPy float64 reference of conftest.moe_ref (of the values the
  experts see: the fp8 round trip with an fp8 dispatch) and against the same layer on the CPU with the float64
  reference experts (make_reference_experts), both within semantics §13's relative L2 1e-2 (as
  tests/gpu/moe_layer_gpu_test.cpp). Outputs given to the layer are poisoned (0xff: NaN) first; a second call
  lets the layer allocate.
- K = 1 with the router weight on the input and int32 ids.
- Tensors on the wrong device named before any work; the layer stays usable.
- Faults flagged on the device rather than synchronised on (semantics §11): a bad id in get_dispatch_layout on CUDA
  tensors (skipped: the counts as if it were -1; raised by epmoe.check_invalid_ids naming its value and [t, k], then
  cleared), and in the no-EP layer (raised by epmoe.check_moe_faults).
- Shared experts on CUDA tensors: a torch callable runs under torch.cuda.stream(the layer's side stream), overlapped
  with the dispatch (CUDA events: the side stream's start before the dispatch hook's point on the caller's stream,
  its end after it, and the caller's stream after forward after its end; only the caller's stream is synchronised),
  and the built-in make_cuda_shared_experts, no-EP and low-latency, against the float64 dense MLP.
- fp8 block-scaled experts (make_cuda_experts(quant='fp8_block'), w1_scale / w2_scale) through the no-EP, normal and
  low-latency layers against a NumPy float64 model (weights dequantized per 128x128 block, activations quantized per
  1x128 group as the GEMMs see them); mismatched scales named before any work.
- MoEModule moved with .cuda() / .to('cuda').
- Low-latency and normal-mode prepare/finalize over a world-size-1 cuda_ipc Buffer (a thread rank on cuda:0
  sending to itself), bf16 and fp8, K = 1 and 8, three forwards through one layer (an output given, then allocated
  by the layer), against the NumPy float64 reference and the same layer on a CPU rank with the reference experts;
  the normal layer on a torch side stream, with CUDA experts that reduce or not (then the GPU weight-and-reduce).

Fresh random inputs per test (seed logged; EPMOE_TEST_SEED reproduces). Skipped without torch, a CUDA build of
epmoe or a GPU.
"""

from __future__ import annotations

import os
import random
import sys

import numpy as np
import pytest

import epmoe

# The parent folder's helpers (conftest.py) are importable here. No conftest.py in this folder: a second module
# named conftest would shadow the parent's.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import (BF16, FP8, act_ref, fp8_dequantize_ref, fp8_quantize_ref, moe_ref, random_topk_idx,  # noqa: E402
                      rel_l2)

# A protocol bug in the low-latency case costs seconds, not the 100 s default wait.
os.environ.setdefault("EPMOE_TIMEOUT_S", "20")

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(
    not epmoe.built_with_cuda() or not torch.cuda.is_available(),
    reason=f"needs a CUDA build of epmoe (built_with_cuda={epmoe.built_with_cuda()}) and a GPU "
    f"(torch.cuda.is_available()={torch.cuda.is_available()})")

TOLERANCE = 1e-2  # semantics §13, as tests/gpu/moe_layer_gpu_test.cpp
N = 128


def fresh_seed(name: str) -> int:
    seed = int(os.environ.get("EPMOE_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"[{name}] seed={seed} (EPMOE_TEST_SEED={seed} reproduces it)")
    return seed


def to_cuda(a: np.ndarray, device: str = "cuda:0") -> "torch.Tensor":
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(device)
    return torch.from_numpy(a.copy()).to(device)


def to_numpy(t: "torch.Tensor") -> np.ndarray:
    t = t.detach().cpu()
    return t.view(torch.int16).numpy().view(BF16) if t.dtype == torch.bfloat16 else t.numpy()


def poisoned(T: int, H: int, device: str = "cuda:0") -> "torch.Tensor":
    out = torch.empty((T, H), dtype=torch.bfloat16, device=device)
    out.view(torch.int16).fill_(-1)  # 0xffff: NaN in bf16
    return out


def make_weights(rng, E: int, H: int):
    w1 = (rng.standard_normal((E, 2 * N, H)) / np.sqrt(H)).astype(BF16)
    w2 = (rng.standard_normal((E, H, N)) / np.sqrt(N)).astype(BF16)
    return w1, w2


def make_tokens(rng, T: int, H: int, K: int, E: int):
    x = rng.standard_normal((T, H)).astype(BF16)
    idx = random_topk_idx(rng, T, K, E, p_none=0.1)
    w = rng.uniform(0.1, 1.0, size=(T, K)).astype(np.float32)
    return x, idx, w


def seen_by_experts(x: np.ndarray, dispatch_dtype: str, round_scale: bool) -> np.ndarray:
    """The activations the experts read: x, or its fp8 quantize-dequantize round trip (semantics §6)."""
    if dispatch_dtype == "bfloat16":
        return x
    q, s = fp8_quantize_ref(x, round_scale=round_scale)
    return fp8_dequantize_ref(q, s)


def check(got: np.ndarray, ref: np.ndarray, what: str) -> float:
    assert not np.any(np.isnan(got.astype(np.float32))), f"{what}: NaN (poison left in the output?)"
    err = rel_l2(got, ref)
    print(f"[rel_l2] {what}: {err:.3e}")
    assert err <= TOLERANCE, f"{what}: relative L2 {err:.3e} > {TOLERANCE}"
    return err


# ------------------------------------------------------------------------------------------ no-EP prepare/finalize

@pytest.mark.parametrize("H", [2048, 7168])
@pytest.mark.parametrize("K", [1, 8])
@pytest.mark.parametrize("dispatch_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("fmt", ["standard", "batched_experts"])
def test_no_ep_layer_on_cuda_matches_float64(fmt, dispatch_dtype, K, H):
    name = f"no-EP {fmt} {dispatch_dtype} K={K} H={H}"
    rng = np.random.default_rng(fresh_seed(name))
    E, T = 10, (12 if H == 2048 else 5)
    round_scale = dispatch_dtype == "float8_e4m3fn"  # as the C++ GPU test
    w1, w2 = make_weights(rng, E, H)
    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(dispatch_dtype, round_scale, activation_format=fmt),
                           epmoe.make_cuda_experts(fmt))
    assert layer.experts.name == "cuda" and layer.experts.activation_format == fmt
    cpu = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(dispatch_dtype, round_scale, activation_format=fmt),
                         epmoe.make_reference_experts(fmt))
    d_w1, d_w2 = to_cuda(w1), to_cuda(w2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the weights' copies
    for call in ("output given", "layer-allocated output"):
        x, idx, w = make_tokens(rng, T, H, K, E)
        with torch.cuda.stream(side):  # inputs, the layer and the output all on torch's current (side) stream
            d_x, d_idx, d_w = to_cuda(x), to_cuda(idx), to_cuda(w)
            output = poisoned(T, H) if call == "output given" else None
            got = layer.forward(d_x, d_w1, d_w2, d_w, d_idx, global_num_experts=E, output=output)
            if output is not None:
                assert got is output
            assert isinstance(got, torch.Tensor) and got.device == d_x.device and got.dtype == torch.bfloat16
            assert tuple(got.shape) == (T, H)
        side.synchronize()
        got_np = to_numpy(got)
        check(got_np, moe_ref(seen_by_experts(x, dispatch_dtype, round_scale), w1, w2, w, idx, "silu"),
              f"{name} {call} vs NumPy float64")
        check(got_np, cpu.forward(x, w1, w2, w, idx, global_num_experts=E), f"{name} {call} vs CPU reference experts")
        assert layer.stage == "INITIAL"


@pytest.mark.parametrize("fmt", ["standard", "batched_experts"])
def test_weight_on_input_with_int32_ids(fmt):
    name = f"no-EP {fmt} K=1 apply_router_weight_on_input int32 ids"
    rng = np.random.default_rng(fresh_seed(name))
    E, T, H = 6, 9, 2048
    w1, w2 = make_weights(rng, E, H)
    x, idx, w = make_tokens(rng, T, H, 1, E)
    idx = idx.astype(np.int32)
    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(activation_format=fmt), epmoe.make_cuda_experts(fmt))
    output = poisoned(T, H)
    layer.forward(to_cuda(x), to_cuda(w1), to_cuda(w2), to_cuda(w), to_cuda(idx), global_num_experts=E,
                  apply_router_weight_on_input=True, output=output)
    torch.cuda.current_stream().synchronize()
    # The token is scaled by its weight and rounded to bf16 before the experts; nothing weights it again.
    scaled = (x.astype(np.float32) * w).astype(BF16)
    check(to_numpy(output), moe_ref(scaled, w1, w2, np.ones_like(w), idx, "silu"), f"{name} vs NumPy float64")


# ------------------------------------------------------------------------------------------ flagged faults

def raised_once(check, like, pattern: str) -> None:
    """check(like) raises invalid_argument matching `pattern`; a second call raises nothing (the first cleared it)."""
    with pytest.raises(epmoe.Error, match=pattern) as e:
        check(like)
    assert e.value.code == "invalid_argument"
    check(like)


def test_a_bad_id_in_a_cuda_layout_is_raised_by_check_invalid_ids():
    rng = np.random.default_rng(fresh_seed("layout bad id"))
    T, K, E, R = 37, 4, 16, 2
    idx = random_topk_idx(rng, T, K, E, p_none=0.1)
    t, k = int(rng.integers(T)), int(rng.integers(K))
    bad = int(rng.choice([E, E + 5, -2]))
    idx[t, k] = bad
    per_rank, per_expert, in_rank = epmoe.get_dispatch_layout(to_cuda(idx), E, R)
    # The layout skips the bad id: counts as if it were -1.
    clean = idx.copy()
    clean[t, k] = -1
    want_expert = np.array([(clean == e).sum() for e in range(E)], dtype=np.int32)
    want_in_rank = np.array([[((row >= 0) & (row // (E // R) == r)).any() for r in range(R)] for row in clean])
    np.testing.assert_array_equal(to_numpy(per_expert), want_expert)
    np.testing.assert_array_equal(to_numpy(in_rank), want_in_rank)
    np.testing.assert_array_equal(to_numpy(per_rank), want_in_rank.sum(axis=0).astype(np.int32))
    raised_once(epmoe.check_invalid_ids, per_expert, rf"'topk_idx'.*{bad} at \[{t}, {k}\]")


def test_a_bad_id_in_the_no_ep_layer_is_raised_by_check_moe_faults():
    rng = np.random.default_rng(fresh_seed("no-EP bad id"))
    E, T, H, K = 6, 9, 2048, 2
    w1, w2 = make_weights(rng, E, H)
    x, idx, w = make_tokens(rng, T, H, K, E)
    t, k = int(rng.integers(T)), int(rng.integers(K))
    idx[t, k] = E + 3
    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_cuda_experts())
    out = layer.forward(to_cuda(x), to_cuda(w1), to_cuda(w2), to_cuda(w), to_cuda(idx), global_num_experts=E)
    raised_once(epmoe.check_moe_faults, out, rf"'topk_idx'.*{E + 3} at \[{t}, {k}\]")


# ------------------------------------------------------------------------------------------ devices

def test_tensors_on_the_wrong_device_are_named_before_any_work():
    rng = np.random.default_rng(fresh_seed("wrong devices"))
    E, T, H, K = 4, 6, 2048, 2
    w1, w2 = make_weights(rng, E, H)
    x, idx, w = make_tokens(rng, T, H, K, E)
    d = dict(hidden=to_cuda(x), w1=to_cuda(w1), w2=to_cuda(w2), topk_weights=to_cuda(w), topk_idx=to_cuda(idx))
    host = dict(hidden=x, w1=w1, w2=w2, topk_weights=w, topk_idx=idx)
    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_cuda_experts())

    def error(lay, **changes):
        with pytest.raises(epmoe.Error) as e:
            lay.forward(**{**d, **changes}, global_num_experts=E)
        assert lay.stage == "INITIAL"
        return e.value.code, str(e.value)

    for name in ("w1", "w2", "topk_weights", "topk_idx"):  # one CPU (NumPy) tensor among CUDA ones
        code, msg = error(layer, **{name: host[name]})
        assert code == "invalid_argument" and f"'{name}'" in msg and "cuda:0" in msg and "on cpu" in msg, msg
    code, msg = error(layer, output=torch.empty((T, H), dtype=torch.bfloat16))  # a torch CPU output
    assert code == "invalid_argument" and "'output'" in msg and "cuda:0" in msg and "on cpu" in msg, msg
    code, msg = error(layer, **host)  # every tensor on the CPU, the experts on the GPU
    assert code == "invalid_argument" and "'hidden'" in msg and "a CUDA tensor" in msg and "'cuda' experts" in msg, msg
    code, msg = error(epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_blas_experts()))
    assert code == "invalid_argument" and "'hidden'" in msg and "a CPU tensor" in msg and "cuda:0" in msg, msg
    code, msg = error(layer, w1_scale=torch.ones((E, 2, 16), dtype=torch.float32))  # scales with bf16 experts (CPU)
    assert code == "invalid_argument" and "'w1_scale'" in msg, msg
    if torch.cuda.device_count() >= 2:
        code, msg = error(layer, w2=to_cuda(w2, "cuda:1"))
        assert code == "invalid_argument" and "'w2'" in msg and "cuda:0" in msg and "cuda:1" in msg, msg
    # Every refusal came before any work: the layer still runs.
    got = layer.forward(**d, global_num_experts=E)
    torch.cuda.current_stream().synchronize()
    check(to_numpy(got), moe_ref(x, w1, w2, w, idx, "silu"), "after the refused calls")


@pytest.mark.parametrize("move", ["cuda()", "to('cuda')"])
def test_moe_module_moved_to_the_gpu(move):
    rng = np.random.default_rng(fresh_seed(f"MoEModule.{move}"))
    E, T, H, K = 8, 7, 2048, 4
    w1, w2 = make_weights(rng, E, H)
    x, idx, w = make_tokens(rng, T, H, K, E)
    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_cuda_experts())
    module = epmoe.MoEModule(layer, to_cuda(w1, "cpu"), to_cuda(w2, "cpu"), global_num_experts=E)
    with pytest.raises(epmoe.Error) as e:  # still on the CPU: named, not run
        module(to_cuda(x, "cpu"), to_cuda(w, "cpu"), to_cuda(idx, "cpu"))
    assert e.value.code == "invalid_argument" and "'hidden'" in str(e.value)
    module = module.cuda() if move == "cuda()" else module.to("cuda")
    assert module.w1.device.type == "cuda" and module.w2.device.type == "cuda"
    out = module(to_cuda(x), to_cuda(w), to_cuda(idx))
    assert out.device.type == "cuda" and out.dtype == torch.bfloat16 and tuple(out.shape) == (T, H)
    torch.cuda.current_stream().synchronize()
    check(to_numpy(out), moe_ref(x, w1, w2, w, idx, "silu"), f"MoEModule.{move}")


# ------------------------------------------------------------------------------------------ over a cuda_ipc Buffer

def check_one_rank_forwards(name, calls, w1, w2, H, dispatch_dtype, gpu_rank, cpu_rank):
    """Runs gpu_rank, then cpu_rank, on one thread rank each (gpu_rank returns its outputs as NumPy arrays and its
    layer's stage, cpu_rank its outputs); checks the GPU layer ended at INITIAL and each forward's output, bf16
    [T, H], against the NumPy float64 reference of what the experts saw and against the CPU rank's."""
    outs, stage = epmoe.run_thread_ranks(1, gpu_rank, timeout_s=60)[0]
    cpu_outs = epmoe.run_thread_ranks(1, cpu_rank, timeout_s=60)[0]
    assert stage == "INITIAL"
    for f, ((x, idx, w), got, cpu) in enumerate(zip(calls, outs, cpu_outs)):
        assert got.shape == (x.shape[0], H)
        check(got, moe_ref(seen_by_experts(x, dispatch_dtype, False), w1, w2, w, idx, "silu"),
              f"{name} forward {f} vs NumPy float64")
        check(got, cpu, f"{name} forward {f} vs CPU reference experts")


@pytest.mark.parametrize("dispatch_dtype,H,K", [("bfloat16", 2048, 8), ("float8_e4m3fn", 2048, 8),
                                                ("bfloat16", 7168, 1), ("float8_e4m3fn", 7168, 1)])
def test_low_latency_layer_over_a_one_rank_cuda_ipc_buffer(dispatch_dtype, H, K):
    name = f"low-latency cuda_ipc R=1 {dispatch_dtype} H={H} K={K}"
    rng = np.random.default_rng(fresh_seed(name))
    E, T, tmax = 8, 10, 16
    w1, w2 = make_weights(rng, E, H)
    calls = [make_tokens(rng, T - f, H, K, E) for f in range(3)]  # three forwards: both halves of the buffer

    def gpu_rank(group):
        torch.cuda.set_device(0)
        buf = epmoe.Buffer(group, low_latency_mode=True, backend="cuda_ipc", device=0)
        layer = epmoe.MoELayer(epmoe.make_low_latency_prepare_finalize(buf, tmax, dispatch_dtype=dispatch_dtype),
                               epmoe.make_cuda_experts("batched_experts"))
        d_w1, d_w2 = to_cuda(w1), to_cuda(w2)
        outs = []
        for f, (x, idx, w) in enumerate(calls):
            output = poisoned(x.shape[0], H) if f != 1 else None  # forward 1: the layer allocates
            got = layer.forward(to_cuda(x), d_w1, d_w2, to_cuda(w), to_cuda(idx), output=output)
            assert output is None or got is output
            outs.append(got)
        torch.cuda.synchronize()
        return [to_numpy(o) for o in outs], layer.stage

    def cpu_rank(group):
        layer = epmoe.MoELayer(epmoe.make_low_latency_prepare_finalize(epmoe.Buffer(group), tmax,
                                                                       dispatch_dtype=dispatch_dtype),
                               epmoe.make_reference_experts("batched_experts"))
        return [layer.forward(x, w1, w2, w, idx) for x, idx, w in calls]

    check_one_rank_forwards(name, calls, w1, w2, H, dispatch_dtype, gpu_rank, cpu_rank)


@pytest.mark.parametrize("dispatch_dtype,H,K,reduce", [("bfloat16", 2048, 8, True), ("float8_e4m3fn", 2048, 8, False),
                                                       ("bfloat16", 7168, 1, False), ("float8_e4m3fn", 7168, 1, True)])
def test_normal_layer_over_a_one_rank_cuda_ipc_buffer(dispatch_dtype, H, K, reduce):
    # The normal-mode prepare/finalize on CUDA tensors (layout, fp8 quantization, dispatch, dequantization,
    # weight-and-reduce when the experts do not reduce, combine, all on the GPU) with the 'standard' CUDA experts.
    name = f"normal cuda_ipc R=1 {dispatch_dtype} H={H} K={K} reduce={reduce}"
    rng = np.random.default_rng(fresh_seed(name))
    E, T = 8, 10
    w1, w2 = make_weights(rng, E, H)
    calls = [make_tokens(rng, T - f, H, K, E) for f in range(3)]

    def gpu_rank(group):
        torch.cuda.set_device(0)
        buf = epmoe.Buffer(group, num_nvl_bytes=epmoe.Buffer.get_normal_nvl_size_hint(T, H, 1, K),
                           backend="cuda_ipc", device=0)
        layer = epmoe.MoELayer(epmoe.make_normal_prepare_finalize(buf, dispatch_dtype=dispatch_dtype),
                               epmoe.make_cuda_experts("standard", reduce=reduce))
        d_w1, d_w2 = to_cuda(w1), to_cuda(w2)
        outs = []
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):  # the layer must run on torch's current stream
            for f, (x, idx, w) in enumerate(calls):
                output = poisoned(x.shape[0], H) if f != 1 else None  # forward 1: the layer allocates
                got = layer.forward(to_cuda(x), d_w1, d_w2, to_cuda(w), to_cuda(idx), output=output)
                assert output is None or got is output
                assert got.device.type == "cuda" and got.dtype == torch.bfloat16
                outs.append(got)
        torch.cuda.synchronize()
        return [to_numpy(o) for o in outs], layer.stage

    def cpu_rank(group):
        layer = epmoe.MoELayer(epmoe.make_normal_prepare_finalize(epmoe.Buffer(group), dispatch_dtype=dispatch_dtype),
                               epmoe.make_reference_experts("standard"))
        return [layer.forward(x, w1, w2, w, idx) for x, idx, w in calls]

    check_one_rank_forwards(name, calls, w1, w2, H, dispatch_dtype, gpu_rank, cpu_rank)


# ------------------------------------------------------------------------------------------ shared experts on a GPU

def make_shared_weights(rng, H: int, Ns: int):
    w1s = (rng.standard_normal((2 * Ns, H)) / np.sqrt(H)).astype(BF16)
    w2s = (rng.standard_normal((H, Ns)) / np.sqrt(Ns)).astype(BF16)
    return w1s, w2s


def dense_ref(x: np.ndarray, w1s: np.ndarray, w2s: np.ndarray) -> np.ndarray:
    """float64 w2s @ silu-gated(w1s @ x) per token: moe_ref with one expert taking every token at weight 1."""
    T = x.shape[0]
    return moe_ref(x, w1s[None], w2s[None], np.ones((T, 1), np.float32), np.zeros((T, 1), np.int64), "silu")


@pytest.mark.parametrize("fmt", ["standard", "batched_experts"])
def test_torch_shared_experts_run_on_the_side_stream_overlapping_the_dispatch(fmt):
    name = f"torch shared experts on the side stream, no-EP {fmt}"
    rng = np.random.default_rng(fresh_seed(name))
    E, T, H, K, Ns = 8, 32, 2048, 4, 1024
    w1, w2 = make_weights(rng, E, H)
    w1s, w2s = make_shared_weights(rng, H, Ns)
    d_w1s, d_w2s = to_cuda(w1s), to_cuda(w2s)
    ev = {k: torch.cuda.Event(enable_timing=True) for k in ("side_start", "side_end", "dispatch", "after")}
    seen = {}

    def shared(h):
        seen["stream"] = torch.cuda.current_stream().cuda_stream
        ev["side_start"].record()
        torch.cuda._sleep(5_000_000)  # ~3 ms: a serial schedule would put the dispatch after it
        g = h @ d_w1s.t()
        out = (torch.nn.functional.silu(g[:, :Ns].float()) * g[:, Ns:].float()).to(torch.bfloat16) @ d_w2s.t()
        ev["side_end"].record()
        return out

    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(activation_format=fmt), epmoe.make_cuda_experts(fmt),
                           shared_experts=shared)
    handle = layer.register_dispatch_hook(lambda pf: ev["dispatch"].record())
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for f in range(3):
            x, idx, w = make_tokens(rng, T, H, K, E)
            out, shared_out = layer.forward(to_cuda(x), to_cuda(w1), to_cuda(w2), to_cuda(w), to_cuda(idx))
            ev["after"].record()
            stream.synchronize()  # only the caller's stream
            assert seen["stream"] != stream.cuda_stream, "the shared experts ran on the caller's stream"
            start_to_dispatch = ev["side_start"].elapsed_time(ev["dispatch"])
            dispatch_to_end = ev["dispatch"].elapsed_time(ev["side_end"])
            end_to_after = ev["side_end"].elapsed_time(ev["after"])
            print(f"[events] {name} forward {f}: side start -> dispatch {start_to_dispatch:.3f} ms, dispatch -> side "
                  f"end {dispatch_to_end:.3f} ms, side end -> after forward {end_to_after:.3f} ms")
            # The first forward of a process pays torch's and cuBLAS's first-use set-up on the host between the
            # side stream's sleep and the dispatch (tens of ms, more than the sleep): only later ones show overlap.
            if f > 0:
                assert start_to_dispatch > 0, "the shared experts started after the dispatch"
                assert dispatch_to_end > 0, "the dispatch waited for the shared experts"
            assert end_to_after >= 0, "the caller's stream did not wait for the side stream"
            check(to_numpy(out), moe_ref(x, w1, w2, w, idx, "silu"), f"{name} forward {f} routed")
            check(to_numpy(shared_out), dense_ref(x, w1s, w2s), f"{name} forward {f} shared")
    handle.remove()


def test_builtin_shared_experts_no_ep_and_low_latency():
    name = "built-in GPU shared experts"
    rng = np.random.default_rng(fresh_seed(name))
    E, T, H, K, Ns, tmax = 8, 12, 2048, 4, 512, 16
    w1, w2 = make_weights(rng, E, H)
    w1s, w2s = make_shared_weights(rng, H, Ns)
    builtin = epmoe.make_cuda_shared_experts(to_cuda(w1s), to_cuda(w2s))
    layer = epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_cuda_experts(), shared_experts=builtin)
    x, idx, w = make_tokens(rng, T, H, K, E)
    out, shared_out = layer.forward(to_cuda(x), to_cuda(w1), to_cuda(w2), to_cuda(w), to_cuda(idx))
    torch.cuda.current_stream().synchronize()
    check(to_numpy(out), moe_ref(x, w1, w2, w, idx, "silu"), f"{name} no-EP routed")
    check(to_numpy(shared_out), dense_ref(x, w1s, w2s), f"{name} no-EP shared")
    with pytest.raises(epmoe.Error) as e:  # the built-in runs beside the CUDA experts only
        epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_blas_experts(), shared_experts=builtin)
    assert e.value.code == "invalid_argument" and "'shared_experts'" in str(e.value)
    with pytest.raises(epmoe.Error) as e:
        epmoe.make_cuda_shared_experts(to_cuda(w1s), to_cuda(w2s[:, :Ns // 2]))
    assert e.value.code == "invalid_argument" and "'w2_shared'" in str(e.value)

    def gpu_rank(group):
        torch.cuda.set_device(0)
        buf = epmoe.Buffer(group, low_latency_mode=True, backend="cuda_ipc", device=0)
        lay = epmoe.MoELayer(epmoe.make_low_latency_prepare_finalize(buf, tmax),
                             epmoe.make_cuda_experts("batched_experts"),
                             shared_experts=epmoe.make_cuda_shared_experts(to_cuda(w1s), to_cuda(w2s)))
        got, sh = lay.forward(to_cuda(x), to_cuda(w1), to_cuda(w2), to_cuda(w), to_cuda(idx))
        torch.cuda.current_stream().synchronize()
        return to_numpy(got), to_numpy(sh)

    got, sh = epmoe.run_thread_ranks(1, gpu_rank, timeout_s=60)[0]
    check(got, moe_ref(x, w1, w2, w, idx, "silu"), f"{name} low-latency routed")
    check(sh, dense_ref(x, w1s, w2s), f"{name} low-latency shared")


# ------------------------------------------------------------------------------------------ fp8 block-scaled experts

BLOCK = 128


def quantize_blocks(rng, E: int, rows: int, cols: int, base: float):
    """fp8 [E, rows, cols] with float32 scales [E, ceil(rows/128), ceil(cols/128)]: each 128x128 block's values
    uniform in a range of its own, scale = amax / 448, q = fp8(w / scale)."""
    rb, cb = -(-rows // BLOCK), -(-cols // BLOCK)
    w = rng.uniform(-1, 1, size=(E, rows, cols)).astype(np.float32)
    w *= np.repeat(np.repeat(base * 2.0 ** rng.uniform(-2, 2, size=(E, rb, cb)), BLOCK, 1), BLOCK, 2)[:, :rows, :cols]
    scales = np.zeros((E, rb, cb), np.float32)
    for bi in range(rb):
        for bj in range(cb):
            blk = w[:, bi * BLOCK:(bi + 1) * BLOCK, bj * BLOCK:(bj + 1) * BLOCK]
            scales[:, bi, bj] = np.maximum(np.abs(blk).reshape(E, -1).max(axis=1), 1e-12) / 448.0
    full = np.repeat(np.repeat(scales, BLOCK, 1), BLOCK, 2)[:, :rows, :cols]
    return (w / full).astype(FP8), scales


def dequantize_blocks(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    E, rows, cols = q.shape
    return q.astype(np.float64) * np.repeat(np.repeat(scales.astype(np.float64), BLOCK, 1), BLOCK, 2)[:, :rows, :cols]


def fp8_round_trip(a: np.ndarray) -> np.ndarray:
    q, s = fp8_quantize_ref(a.astype(np.float32))
    return fp8_dequantize_ref(q, s)


def fp8_experts_ref(x, w1q, w1s, w2q, w2s, topk_w, topk_idx) -> np.ndarray:
    """float64 model of the fp8 block-scaled experts (silu): weights dequantized per block; x and act(g) (rounded to
    float32) quantized per 1x128 group (semantics §6) as the GEMMs see them."""
    w1d, w2d = dequantize_blocks(w1q, w1s), dequantize_blocks(w2q, w2s)
    N = w2q.shape[2]
    xq = fp8_round_trip(x)
    out = np.zeros((x.shape[0], w2q.shape[1]))
    for t in range(x.shape[0]):
        for k in range(topk_idx.shape[1]):
            e = int(topk_idx[t, k])
            if e < 0:
                continue
            g = w1d[e] @ xq[t]
            a = fp8_round_trip(act_ref("silu", g[:N], g[N:]).astype(np.float32)[None])[0]
            out[t] += float(topk_w[t, k]) * (w2d[e] @ a)
    return out


def fp8_to_cuda(q: np.ndarray) -> "torch.Tensor":
    return torch.from_numpy(q.view(np.uint8).copy()).view(torch.float8_e4m3fn).to("cuda:0")


@pytest.mark.parametrize("mode", ["no_ep_standard", "no_ep_batched", "normal", "low_latency"])
def test_fp8_block_scaled_experts_through_the_layer(mode):
    name = f"fp8 block-scaled experts {mode}"
    rng = np.random.default_rng(fresh_seed(name))
    E, T, H, Nf, K, tmax = 8, 10, 2880, 256, 4, 16  # H = 2880: a partial last 128-block
    w1q, w1s = quantize_blocks(rng, E, 2 * Nf, H, 6.0 / np.sqrt(H))
    w2q, w2s = quantize_blocks(rng, E, H, Nf, 3.0 / np.sqrt(Nf))
    calls = [make_tokens(rng, T - f, H, K, E) for f in range(2)]
    fmt = "batched_experts" if mode in ("no_ep_batched", "low_latency") else "standard"

    def gpu_rank(group):
        torch.cuda.set_device(0)
        if mode == "normal":
            buf = epmoe.Buffer(group, num_nvl_bytes=epmoe.Buffer.get_normal_nvl_size_hint(T, H, 1, K),
                               backend="cuda_ipc", device=0)
            pf = epmoe.make_normal_prepare_finalize(buf)
        elif mode == "low_latency":
            pf = epmoe.make_low_latency_prepare_finalize(
                epmoe.Buffer(group, low_latency_mode=True, backend="cuda_ipc", device=0), tmax)
        else:
            pf = epmoe.make_no_ep_prepare_finalize(activation_format=fmt)
        layer = epmoe.MoELayer(pf, epmoe.make_cuda_experts(fmt, quant="fp8_block"))
        d = dict(w1=fp8_to_cuda(w1q), w2=fp8_to_cuda(w2q), w1_scale=torch.from_numpy(w1s).cuda(),
                 w2_scale=torch.from_numpy(w2s).cuda())
        x, idx, w = calls[0]
        errors = {}
        for arg_name, change in (("w1_scale", dict(w1_scale=None)), ("w2_scale", dict(w2_scale=d["w1_scale"])),
                                 ("w1", dict(w1=to_cuda(np.zeros((E, 2 * Nf, H), BF16))))):
            with pytest.raises(epmoe.Error) as e:
                layer.forward(to_cuda(x), **{**d, **change}, topk_weights=to_cuda(w), topk_idx=to_cuda(idx))
            errors[arg_name] = (e.value.code, str(e.value), layer.stage)
        outs = []
        for f, (x, idx, w) in enumerate(calls):
            output = poisoned(x.shape[0], H) if f == 0 else None
            outs.append(layer.forward(to_cuda(x), topk_weights=to_cuda(w), topk_idx=to_cuda(idx), output=output, **d))
        torch.cuda.synchronize()
        return [to_numpy(o) for o in outs], errors

    outs, errors = epmoe.run_thread_ranks(1, gpu_rank, timeout_s=60)[0]
    for arg_name, (code, msg, stage) in errors.items():
        assert code == "invalid_argument" and f"'{arg_name}'" in msg and stage == "INITIAL", msg
    for f, ((x, idx, w), got) in enumerate(zip(calls, outs)):
        check(got, fp8_experts_ref(x, w1q, w1s, w2q, w2s, w, idx), f"{name} forward {f} vs NumPy float64")
