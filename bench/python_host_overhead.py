"""Host time of epmoe's Python boundary per call, torch CPU tensors beside NumPy arrays.

    python3 bench/python_host_overhead.py [--calls 20000] [--repeats 5] [--json PATH]

CPU only: every figure is host time, microseconds per call, the median of --repeats timed loops of --calls calls.
The calls do little real work, so the figures are mostly the conversion of arguments and outputs:
  - record: ExpertLoadRecorder.record of an int64 [E] counts tensor: one tensor in, nothing out (the input side).
  - topk_softmax: ops.topk_softmax of float32 [1, 8] logits: one tensor in, two new tensors out.
  - quantize_fp8: ops.quantize_fp8 of bfloat16 [1, 128]: one tensor in, two out (float8 among them).
  - ll_pair: Buffer.low_latency_dispatch (fp8) + low_latency_combine on one CPU rank, T = 1, H = 128, E = 8, K = 2,
    Tmax = 8: four tensors in per pair plus the Python layer's checks (the CPU rank also copies its outputs out).
  - normal_pair: Buffer.get_dispatch_layout + dispatch + combine (normal mode, bf16) on one CPU rank, same sizes:
    eight tensors in, eleven out.
Compare two builds by running this script under each (e.g. PYTHONPATH pointing at an older install first).
"""
import argparse
import json
import statistics
import sys
import time

import numpy as np

import epmoe

T, H, E, K, TMAX = 1, 128, 8, 2, 8


def per_call_us(fn, calls: int, repeats: int) -> float:
    fn()  # warm-up (first-call setup: agreement of settings, caches)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def inputs(torch_in: bool):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, H)).astype(np.float32)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int64)
    w = rng.uniform(0.1, 1.0, (T, K)).astype(np.float32)
    counts = np.arange(E, dtype=np.int64)
    logits = rng.standard_normal((1, 8)).astype(np.float32)
    if torch_in:
        import torch
        return (torch.from_numpy(x).to(torch.bfloat16), torch.from_numpy(idx), torch.from_numpy(w),
                torch.from_numpy(counts), torch.from_numpy(logits))
    return x.astype(epmoe.BFLOAT16), idx, w, counts, logits


def measure(torch_in: bool, calls: int, repeats: int) -> dict:
    x, idx, w, counts, logits = inputs(torch_in)
    recorder = epmoe.ExpertLoadRecorder(1, E, 1, 4)
    out = {
        "record": per_call_us(lambda: recorder.record(0, counts), calls, repeats),
        "topk_softmax": per_call_us(lambda: epmoe.topk_softmax(logits, 2), calls, repeats),
        "quantize_fp8": per_call_us(lambda: epmoe.quantize_fp8(x), calls, repeats),
    }

    def rank_main(group):
        buf = epmoe.Buffer(group, low_latency_mode=True)

        def pair():
            (recv_x, _), _, handle, _, _ = buf.low_latency_dispatch(x, idx, TMAX, E)
            y = buf.get_next_low_latency_combine_buffer(handle)
            buf.low_latency_combine(y, idx, w, handle)

        return per_call_us(pair, max(1, calls // 4), repeats)

    out["ll_pair"] = epmoe.run_thread_ranks(1, rank_main)[0]

    def normal_main(group):
        buf = epmoe.Buffer(group)

        def pair():
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
            recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                           num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
            buf.combine(recv_x, handle, topk_weights=recv_w)

        return per_call_us(pair, max(1, calls // 4), repeats)

    out["normal_pair"] = epmoe.run_thread_ranks(1, normal_main)[0]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    result = {"epmoe": epmoe.__file__, "python": sys.version.split()[0], "numpy": measure(False, a.calls, a.repeats)}
    try:
        import torch
        result["torch_version"] = torch.__version__
        result["torch"] = measure(True, a.calls, a.repeats)
    except ImportError:
        result["torch"] = None
    print(f"epmoe from {result['epmoe']}")
    print(f"{'us per call':<14}{'numpy':>10}{'torch':>10}")
    for name in result["numpy"]:
        t = result["torch"][name] if result["torch"] else float("nan")
        print(f"{name:<14}{result['numpy'][name]:>10.2f}{t:>10.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
