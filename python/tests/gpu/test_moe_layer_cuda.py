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
- Tensors on the wrong device (and shared experts on a GPU) named before any work; the layer stays usable.
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
from conftest import BF16, fp8_dequantize_ref, fp8_quantize_ref, moe_ref, random_topk_idx, rel_l2  # noqa: E402

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
    code, msg = error(epmoe.MoELayer(epmoe.make_no_ep_prepare_finalize(), epmoe.make_cuda_experts(),
                                     shared_experts=lambda h: h))
    assert code == "unsupported" and "shared_experts" in msg, msg
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
