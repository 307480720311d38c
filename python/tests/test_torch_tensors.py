"""torch tensors through DLPack on the CPU (thread ranks), and torch.distributed groups as epmoe Groups.

Skipped where torch is not installed (CI installs no torch: see requirements-dev.txt). The Buffer
scenarios of ep_scenarios.py run with torch CPU tensors and must give torch outputs bit-identical to the
NumPy path on the same inputs; the group adapter is checked with two processes over gloo.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

import epmoe
from conftest import BF16, FP8, TIMEOUT_S, fp8_quantize_ref, nice_bf16, random_topk_idx
from ep_scenarios import CASES, assert_same, make_inputs, reference_outputs, run_rank, torch_converters

torch = pytest.importorskip("torch")


def fresh_seed(name: str) -> int:
    seed = int(os.environ.get("EPMOE_TEST_SEED", random.SystemRandom().randrange(2**32)))
    print(f"[{name}] seed={seed} (EPMOE_TEST_SEED={seed} reproduces it)")
    return seed


@pytest.mark.parametrize("variant", ["sync", "async", "previous_event", "chained", "positional"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_torch_cpu_tensors_match_the_numpy_path(case, variant):
    seed = fresh_seed(f"{case.name}-{variant}")
    inputs = make_inputs(case, seed)
    ref = reference_outputs(case, inputs, TIMEOUT_S)
    to_torch, to_numpy = torch_converters("cpu")

    def rank_main(group):
        r = group.rank()
        return run_rank(epmoe.Buffer(group), case, inputs[r], r, to_torch, to_numpy, variant)

    got = epmoe.run_thread_ranks(case.R, rank_main, timeout_s=TIMEOUT_S)
    for r in range(case.R):
        assert_same(got[r], ref[r], f"{case.name}/{variant} rank {r} (seed {seed})")


def test_torch_dtypes_cross_both_ways(rng):
    to_torch, _ = torch_converters("cpu")
    x = nice_bf16(rng, (6, 256))
    q, scales = fp8_quantize_ref(x)

    # fp8 quantization of a torch bf16 tensor returns torch float8_e4m3fn (crossing DLPack as a uint8 view)
    out_q, out_s = epmoe.quantize_fp8(to_torch(x))
    assert out_q.dtype == torch.float8_e4m3fn and out_s.dtype == torch.float32
    np.testing.assert_array_equal(out_q.view(torch.uint8).numpy(), q.view(np.uint8))
    np.testing.assert_array_equal(out_s.numpy(), scales)
    # and back: a torch fp8 tensor in, torch bf16 out
    deq = epmoe.dequantize_fp8(out_q, out_s)
    assert isinstance(deq, torch.Tensor) and deq.dtype == torch.bfloat16
    # a tensor that requires grad is accepted (epmoe never differentiates)
    idx = to_torch(random_topk_idx(rng, 6, 2, 8))
    logits = torch.randn(6, 8, requires_grad=True)
    w, i = epmoe.topk_softmax(logits, 2)
    assert isinstance(w, torch.Tensor) and isinstance(i, torch.Tensor) and tuple(i.shape) == (6, 2)
    assert idx.dtype == torch.int64


def test_torch_low_latency_round_trip_matches_numpy(rng):
    R, E, T, H, K, tmax = 2, 8, 5, 256, 2, 8
    xs = [nice_bf16(rng, (T, H)) for _ in range(R)]
    idxs = [random_topk_idx(rng, T, K, E) for _ in range(R)]
    ws = [rng.uniform(0.1, 1.0, size=(T, K)).astype(np.float32) for _ in range(R)]
    to_torch, to_numpy = torch_converters("cpu")

    def rank_main(group, torch_in):
        r = group.rank()
        conv = to_torch if torch_in else (lambda a: a)
        back = to_numpy if torch_in else (lambda a: a)
        buf = epmoe.Buffer(group, low_latency_mode=True)
        (rx, rs), count, handle, ev, hook = buf.low_latency_dispatch(conv(xs[r]), conv(idxs[r]), tmax, E,
                                                                     return_recv_hook=True)
        hook()
        nxt = buf.get_next_low_latency_combine_buffer(handle)
        assert (framework := type(nxt).__module__.split(".")[0]) == ("torch" if torch_in else "numpy"), framework
        c = back(count)
        deq = np.zeros(rx.shape, np.float32)  # rows past count[e] are undefined: leave them 0
        for e in range(len(c)):
            deq[e, :c[e]] = back(rx)[e, :c[e]].astype(np.float32) * back(rs)[e, :c[e]].repeat(128, axis=-1)[:, :H]
        y = conv(deq.astype(BF16))
        out, ev, _ = buf.low_latency_combine(y, conv(idxs[r]), conv(ws[r]), handle)
        return back(rx), back(rs), back(count), back(out)

    ref = epmoe.run_thread_ranks(R, lambda g: rank_main(g, False), timeout_s=TIMEOUT_S)
    got = epmoe.run_thread_ranks(R, lambda g: rank_main(g, True), timeout_s=TIMEOUT_S)
    for r in range(R):
        count = ref[r][2]
        np.testing.assert_array_equal(got[r][2], count)
        for e in range(len(count)):  # only the first count[e] rows of each expert are defined
            np.testing.assert_array_equal(got[r][0][e, :count[e]].view(np.uint8), ref[r][0][e, :count[e]].view(np.uint8))
            np.testing.assert_array_equal(got[r][1][e, :count[e]], ref[r][1][e, :count[e]])
        np.testing.assert_array_equal(got[r][3].view(np.uint16), ref[r][3].view(np.uint16))


def _gloo_worker(rank, world, init_file, results):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        g = epmoe.as_group(dist.group.WORLD)
        out = {"repr": (g.rank(), g.size(), g.backend)}
        g.barrier()
        out["gathered"] = g.all_gather_bytes(bytes([rank + 1]) * (3 + rank))
        out["bcast"] = g.broadcast_bytes(bytes([rank] * 5), 0)
        try:
            g.check_agreement([("num_experts", 64 + rank)])
            out["mismatch"] = None
        except epmoe.Error as e:
            out["mismatch"] = (e.code, str(e))
        out["buffer"] = None
        if not (epmoe.built_with_cuda() and epmoe._ext.cuda_device_count() > 0):  # GPUs: tests/gpu covers it
            try:
                epmoe.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 20)
            except epmoe.Error as e:
                out["buffer"] = (e.code, str(e))
        epmoe.as_group(dist.group.WORLD).barrier()
        results[rank] = out
    finally:
        dist.destroy_process_group()


def test_torch_process_group_over_gloo_is_an_epmoe_group(tmp_path):
    import torch.multiprocessing as mp
    world = 2
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    mp.spawn(_gloo_worker, args=(world, str(tmp_path / "init"), results), nprocs=world, join=True)
    for rank in range(world):
        out = results[rank]
        assert out["repr"] == (rank, world, "torch")
        assert out["gathered"] == [bytes([s + 1]) * (3 + s) for s in range(world)]
        assert out["bcast"] == bytes([0] * 5)
        assert out["mismatch"][0] == "rank_mismatch" and "num_experts" in out["mismatch"][1]
        if not (epmoe.built_with_cuda() and epmoe._ext.cuda_device_count() > 0):
            # No GPU: a process group cannot drive the CPU transports, which live in one process or MPI.
            assert out["buffer"][0] == "unsupported" and "cuda_ipc" in out["buffer"][1]


class _Subclass(torch.Tensor):
    """A torch.Tensor subclass: it takes the DLPack route (only torch.Tensor itself is read from its attributes)."""


def _outcome(fn, *args):
    """('ok', (dtype, shape, bytes) per output) or ('error', code, message)."""
    try:
        out = fn(*args)
    except epmoe.Error as e:
        return ("error", e.code, str(e))
    outs = out if isinstance(out, tuple) else (out,)
    return ("ok",) + tuple(None if t is None else
                           (str(t.dtype), tuple(t.shape), t.detach().contiguous().flatten().view(torch.uint8).numpy()
                            .tobytes()) for t in outs)


def _direct_read_cases(rng):
    to_torch, _ = torch_converters("cpu")
    x = nice_bf16(rng, (6, 256))
    q, scales = (to_torch(a) for a in fp8_quantize_ref(x))
    logits = torch.from_numpy(rng.standard_normal((9, 8)).astype(np.float32))
    one_rank = epmoe.ExpertLoadRecorder(1, 1, 1, 4)
    two = epmoe.ExpertLoadRecorder(1, 2, 1, 4)
    counts = torch.arange(10, dtype=torch.int64)
    return {
        "float32": (epmoe.topk_softmax, logits, 2),
        "storage_offset": (epmoe.topk_softmax, logits[3:], 2),
        "transposed": (epmoe.topk_softmax, logits.t().contiguous().t(), 2),
        "empty": (epmoe.topk_softmax, logits[:0], 2),
        "requires_grad": (epmoe.topk_softmax, logits.clone().requires_grad_(True), 2),
        "float64": (epmoe.topk_softmax, logits.double(), 2),
        "five_dims": (epmoe.topk_softmax, logits.reshape(1, 1, 1, 9, 8), 2),
        "float8": (epmoe.dequantize_fp8, q, scales),
        "float8_strided": (epmoe.dequantize_fp8, q[::2], scales[::2]),
        "bfloat16": (epmoe.quantize_fp8, to_torch(x)),
        "broadcast": (epmoe.quantize_fp8, to_torch(x)[:1].expand(4, 256)),
        "one_element_strided": (lambda c: one_rank.record(0, c), counts[3:4:5]),
        "two_elements_strided": (lambda c: two.record(0, c), counts[::5]),
        "uint32": (lambda c: two.record(0, c), counts[:2].to(torch.uint32)),
        "bool": (lambda c: two.record(0, c), counts[:2] > 0),
        "int16": (lambda c: two.record(0, c), counts[:2].to(torch.int16)),
    }


def test_torch_tensors_read_directly_match_the_dlpack_route(rng):
    """A torch.Tensor is read from its attributes (no DLPack export); the results and the errors (argument, expected,
    got) are those of the DLPack route, which a subclass takes."""
    for name, (fn, *args) in _direct_read_cases(rng).items():
        direct = _outcome(fn, *args)
        dlpack = _outcome(fn, *[a.as_subclass(_Subclass) if isinstance(a, torch.Tensor) else a for a in args])
        assert direct == dlpack, name
    assert _outcome(*_direct_read_cases(rng)["float64"])[1] == "invalid_argument"
    assert "float64[9, 8]" in _outcome(*_direct_read_cases(rng)["float64"])[2]
    # a meta tensor (no CPU or CUDA memory) is refused as before, naming the argument
    code, message = _outcome(epmoe.topk_softmax, torch.empty(2, 8, device="meta"), 2)[1:]
    assert code == "invalid_argument" and "'logits'" in message, message


def test_only_unusual_torch_tensors_take_the_dlpack_route(rng):
    from epmoe import _ext, _tensor
    seen = []

    def counting(x):
        seen.append(str(x.dtype))
        return _tensor._torch_arg(x)

    _tensor.is_torch(torch.zeros(1))  # registers torch's types
    _ext.register_torch(torch.Tensor, torch.strided, [(getattr(torch, n), n) for n in _tensor._TORCH_DTYPES], counting,
                        None)  # and torch outputs through torch.utils.dlpack.from_dlpack
    try:
        cases = _direct_read_cases(rng)
        for name in ("float32", "storage_offset", "transposed", "empty", "requires_grad", "float8", "bfloat16",
                     "broadcast", "one_element_strided", "uint32", "bool", "int16"):
            fn, *args = cases[name]
            _outcome(fn, *args)
        assert seen == [], seen
        _outcome(*cases["float64"])
        assert seen == ["torch.float64"], seen
    finally:
        _tensor._find_torch()  # the package's own registration again
