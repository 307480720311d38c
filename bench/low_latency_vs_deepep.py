"""Low-latency dispatch and combine of epmoe and DeepEP, measured one way, in one process per library.

    python3 bench/low_latency_vs_deepep.py --lib epmoe|deepep [--tokens 1,128] [--hidden 7168] [--topk 8]
                                           [--experts 256] [--dispatch-dtype fp8|bf16] [--runs 30] [--json PATH]
                                           [--host-profile PATH]
    python3 bench/low_latency_vs_deepep.py --lib epmoe|deepep --sweep [--tokens 1,32,128] [--json PATH]
    python3 bench/low_latency_vs_deepep.py --compare EPMOE.json DEEPEP.json     # the table of ratios

One GPU, one rank (a one-rank NCCL group, as DeepEP's tests make it). `--lib deepep` imports DeepEP's `deep_ep`
(its build folder on PYTHONPATH), `--lib epmoe` imports `epmoe`; both are driven through the same DeepEP V1 calls
(`low_latency_dispatch` in fp8, or bf16 with --dispatch-dtype, `low_latency_combine` in bf16), on the same inputs: T
tokens of hidden H, top-K of E experts from random scores, ten random (token, k) entries masked to -1 (DeepEP's test
masks the same way), seeded.

--sweep measures the shapes around DeepEP's decode default (fp8, K = 8, H = 7168, E = 256), one setting changed at a
time: bf16 dispatch; K = 1, 2, 4; H = 2048, 2880, 4096 (SWEEP below), each at every T of --tokens (default 1,32,128),
one buffer per shape. A shape a library refuses (DeepEP compiles a fixed set of hidden sizes) is recorded with its
error and the next shape runs.

Three figures per op and T (semantics §12 gives the rules; DeepEP's test reports the first):
  - kernel time: torch profiler over `--runs` back-to-back dispatch + combine pairs, no L2 flush; every kernel and
    copy an op launches counts (each device event is charged to the op whose `record_function` range launched it),
    per call. DeepEP's own `bench_kineto` sums only kernels whose names hold "dispatch" / "combine"; that figure is
    printed beside it when they differ.
  - call time, L2 flushed: CUDA events around one call on the caller's stream (host enqueue included), a 256 MiB
    memset before each, median of 50 after 5 warm-up calls.
  - graph: one CUDA-graph replay of an fp8 dispatch + its combine, events around the replay, median of 50.
  - eager pair: DeepEP's `avg_t` (tests/utils.py `bench`): events around each of 50 back-to-back dispatch + combine
    calls on the caller's stream, mean of the last 49. Where the host enqueues slower than the GPU runs, this is
    the host's time per pair; its host time alone (no synchronisation) is recorded beside it. Measured first, before
    any profiler runs in the process; then again with DeepEP's test_func's dispatch arguments
    (`cumulative_local_expert_recv_stats` given), the calls its own test times.
--host-profile PATH writes a cProfile of 200 eager pairs (the host's own time, by function) at the largest T.
Writes one JSON object (--json) with every figure and the kernel list; `scripts/gpu_check.sh anchors` runs it for
both libraries in the same call and prints epmoe / DeepEP.
"""
import argparse
import json
import os
import statistics
import sys


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", choices=["epmoe", "deepep"])
    p.add_argument("--compare", nargs=2, metavar=("EPMOE_JSON", "DEEPEP_JSON"))
    p.add_argument("--tokens", default="", help="comma-separated T values (tokens per rank); default 1,128, with "
                   "--sweep 1,32,128")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--dispatch-dtype", choices=["fp8", "bf16"], default="fp8")
    p.add_argument("--sweep", action="store_true", help="the shapes of SWEEP instead of one (dtype, K, H)")
    p.add_argument("--runs", type=int, default=30, help="back-to-back pairs under the profiler")
    p.add_argument("--seed", type=int, default=int(os.environ.get("EPMOE_SEED", "1")))
    p.add_argument("--json", default="")
    p.add_argument("--host-profile", default="", metavar="PATH",
                   help="write where the host's time of an eager dispatch + combine pair goes (cProfile of 200 pairs "
                   "at the largest T of the first shape, top functions by own and by cumulative time) to PATH")
    return p.parse_args()


# (dispatch dtype, K, H) of --sweep: DeepEP's decode shape with one setting changed at a time.
SWEEP = [("bf16", 8, 7168)] + [("fp8", k, 7168) for k in (1, 2, 4)] + [("fp8", 8, h) for h in (2048, 2880, 4096)]


def main():
    args = parse_args()
    if args.compare:
        return compare(*args.compare)
    if not args.lib:
        sys.exit("low_latency_vs_deepep.py: give --lib epmoe|deepep or --compare A B")
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + (os.getpid() % 300)))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    group = dist.new_group([0])
    if args.lib == "deepep":
        import deep_ep as lib
    else:
        import epmoe as lib
    tokens = [int(t) for t in (args.tokens or ("1,32,128" if args.sweep else "1,128")).split(",")]
    tmax = max(tokens)
    E = args.experts
    shapes = SWEEP if args.sweep else [(args.dispatch_dtype, args.topk, args.hidden)]
    print(f"{args.lib}: {torch.cuda.get_device_name(0)}, T={tokens} (Tmax {tmax}) E={E}, shapes (dtype, K, H) "
          f"{shapes}, runs={args.runs}, seed {args.seed}", flush=True)
    out = {"lib": args.lib, "device": torch.cuda.get_device_name(0), "hidden": args.hidden, "topk": args.topk,
           "experts": E, "num_max_dispatch_tokens_per_rank": tmax, "runs": args.runs, "seed": args.seed,
           "results": []}
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    try:
        for dtype, K, H in shapes:
            try:
                nbytes = lib.Buffer.get_low_latency_rdma_size_hint(tmax, H, 1, E)
                buf = lib.Buffer(group, 0, nbytes, low_latency_mode=True, num_qps_per_rank=E)
                run_all(torch, lib, buf, tokens, tmax, (dtype, K, H), E, args, flush, out)
            except Exception as exc:  # a shape the library refuses: recorded, the next shape runs
                if not args.sweep:
                    raise
                msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                print(f"dtype={dtype} K={K} H={H}: failed: {msg}", flush=True)
                out["results"].append({"dtype": dtype, "K": K, "H": H, "T": None, "error": msg})
                torch.cuda.synchronize()
            buf = None
    finally:  # what was measured is kept when a later step fails
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1, default=str)
    dist.destroy_process_group()


def run_all(torch, lib, buf, tokens, tmax, shape, E, args, flush, out):
    graphs = []
    for T in tokens:
        out["results"].append(measure(torch, lib, buf, T, tmax, shape, E, args, flush, graphs))
    # CUDA graphs last: a library whose calls cannot be captured may leave the context unusable.
    for res, dispatch, combine in graphs:
        if out.get("graph_failed"):
            res["graph_error"] = "not tried: an earlier capture failed"
            continue
        res["graph_pair_us"], res["graph_error"] = graph_time(torch, dispatch, combine)
        out["graph_failed"] = res["graph_error"] is not None
        print(f"dtype={res['dtype']} K={res['K']} H={res['H']} T={res['T']}: CUDA graph dispatch + combine "
              + (f"{res['graph_pair_us']:.2f} us" if res["graph_error"] is None else f"failed: {res['graph_error']}"),
              flush=True)


def make_inputs(torch, T, H, K, E, seed):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    x = torch.randn((T, H), dtype=torch.bfloat16, device="cuda", generator=g)
    scores = torch.randn((T, E), dtype=torch.float32, device="cuda", generator=g).abs() + 1
    topk_idx = torch.topk(scores, K, dim=-1, largest=True, sorted=True)[1].to(torch.int64)
    topk_weights = torch.randn((T, K), dtype=torch.float32, device="cuda", generator=g).abs()
    cpu = torch.Generator()
    cpu.manual_seed(seed)
    for _ in range(10):
        t = int(torch.randint(0, T, (1,), generator=cpu))
        k = int(torch.randint(0, K, (1,), generator=cpu))
        topk_idx[t, k] = -1
    return x, topk_idx, topk_weights


def measure(torch, lib, buf, T, tmax, shape, E, args, flush, graphs):
    dtype, K, H = shape
    x, topk_idx, topk_weights = make_inputs(torch, T, H, K, E, args.seed + T)
    fp8 = dtype == "fp8"

    def dispatch():
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, topk_idx, tmax, E, use_fp8=fp8,
                                                             async_finish=False, return_recv_hook=False)
        return recv, handle

    recv, _ = dispatch()
    # The experts' output stand-in: bf16 of the received shape, random, made once (no expert runs here).
    expert_out = torch.randn((recv[0] if fp8 else recv).shape, dtype=torch.bfloat16, device="cuda")

    def combine(handle):
        y, _, _ = buf.low_latency_combine(expert_out, topk_idx, topk_weights, handle, async_finish=False,
                                          return_recv_hook=False)
        return y

    for _ in range(5):
        combine(dispatch()[1])
    torch.cuda.synchronize()
    # The eager pairs first: host time is what they measure, and nothing profiled in this process may weigh on it.
    eager, host = eager_pair_time(torch, dispatch, combine)
    # As DeepEP's test_low_latency.py test_func dispatches (its avg_t): with cumulative_local_expert_recv_stats.
    stats = torch.zeros((E // buf.group_size,), dtype=torch.int32, device="cuda")

    def dispatch_as_deepep_test():
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, topk_idx, tmax, E,
                                                             cumulative_local_expert_recv_stats=stats, use_fp8=fp8,
                                                             async_finish=False, return_recv_hook=False)
        return recv, handle

    eager_stats, host_stats = eager_pair_time(torch, dispatch_as_deepep_test, combine)
    kernels = kernel_times(torch, dispatch, combine, args.runs)
    # Combine: each timed call gets a fresh dispatch's handle, made before the flush, outside the timed region.
    flushed = {"dispatch": call_time(torch, flush, lambda _: dispatch()),
               "combine": call_time(torch, flush, combine, prepare=lambda: dispatch()[1])}
    profiled = None
    if args.host_profile and T == tmax:  # once: the first shape's largest T
        profiled = host_profile(dispatch, combine, args.host_profile, f"{args.lib}, {dtype} K={K} H={H} T={T}")
        args.host_profile = ""
        torch.cuda.synchronize()
    res = {"dtype": dtype, "K": K, "H": H, "T": T, "kernel_us": kernels, "call_us_l2_flushed": flushed,
           "eager_pair_us": eager, "eager_pair_host_us": host, "eager_pair_stats_us": eager_stats,
           "eager_pair_stats_host_us": host_stats, "graph_pair_us": None, "graph_error": None}
    if profiled:
        res["host_profile"] = profiled
    graphs.append((res, dispatch, combine))
    d, c = kernels["dispatch"], kernels["combine"]
    print(f"dtype={dtype} K={K} H={H} T={T}: kernel time dispatch {d['per_call_us']:.2f} us "
          f"({d['num_kernels_per_call']:.0f} kernels; by name {d['by_name_us']:.2f}), combine {c['per_call_us']:.2f} us "
          f"({c['num_kernels_per_call']:.0f}; by name {c['by_name_us']:.2f}); call time L2 flushed {flushed['dispatch']:.2f} / {flushed['combine']:.2f}"
          f" us; eager pair {eager:.2f} us (host {host:.2f}); unattributed device time "
          f"{kernels['unattributed_us_per_call']:.2f} us/call", flush=True)
    for op in ("dispatch", "combine"):
        for name, us in kernels[op]["kernels"].items():
            print(f"    {op:8s} {us:8.2f} us/call  {name[:100]}")
    return res


def kernel_times(torch, dispatch, combine, runs):
    """Per-call device time of each op: every device event (kernel, memcpy, memset) charged to the op whose range
    launched it. A device event names its launch by correlation id (the runtime call's, or the innermost
    RecordFunction's as `linked_correlation_id`); that CPU event's start lies inside one of the op ranges."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            with record_function("lvd::dispatch"):
                _, handle = dispatch()
            with record_function("lvd::combine"):
                combine(handle)
        torch.cuda.synchronize()
    events = list(prof.profiler.kineto_results.events())
    cpu = torch.autograd.DeviceType.CPU
    ranges, cpu_start = [], {}
    for e in events:
        if e.device_type() != cpu:
            continue
        cpu_start.setdefault(e.correlation_id(), e.start_ns())
        if e.name() in ("lvd::dispatch", "lvd::combine"):
            ranges.append((e.start_ns(), e.start_ns() + e.duration_ns(), e.name().split("::")[1]))
    ranges.sort()

    def op_of(t):
        for start, end, op in ranges:
            if start <= t <= end:
                return op
        return None

    per_op = {"dispatch": {}, "combine": {}}
    count = {"dispatch": 0, "combine": 0}
    unattributed = 0.0
    for e in events:
        if e.device_type() == cpu:
            continue
        op = None
        for corr in (getattr(e, "linked_correlation_id", lambda: 0)(), e.correlation_id()):
            if corr and corr in cpu_start:
                op = op_of(cpu_start[corr])
                if op:
                    break
        if e.name() in ("lvd::dispatch", "lvd::combine"):
            continue  # the range's own device-side annotation, not work: counting it would double each op
        us = e.duration_ns() / 1e3
        if op is None:
            unattributed += us
            continue
        per_op[op][e.name()] = per_op[op].get(e.name(), 0.0) + us
        count[op] += 1
    result = {}
    for op, per_kernel in per_op.items():
        result[op] = {"per_call_us": sum(per_kernel.values()) / runs,
                      "by_name_us": sum(us for name, us in per_kernel.items() if op in name) / runs,
                      "num_kernels_per_call": count[op] / runs,
                      "kernels": {n: us / runs for n, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])}}
    result["unattributed_us_per_call"] = unattributed / runs
    return result


def call_time(torch, flush, fn, prepare=lambda: None, warmup=5, runs=50):
    """Median event time of fn(prepare()) in us, the L2 flushed before each call."""
    for _ in range(warmup):
        fn(prepare())
    times = []
    for _ in range(runs):
        arg = prepare()
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(arg)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def host_profile(dispatch, combine, path, title, runs=200):
    """cProfile of `runs` eager dispatch + combine pairs (no synchronisation: the host's own time), written to `path`
    as the top 30 functions by own time and by cumulative time under `title`; returns `path`."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(runs):
        combine(dispatch()[1])
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    text.write(f"host profile of {runs} eager dispatch + combine pairs: {title}\n")
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)
    with open(path, "w") as f:
        f.write(text.getvalue())
    return path


def eager_pair_time(torch, dispatch, combine, runs=50):
    """DeepEP's avg_t: the mean event time of back-to-back dispatch + combine pairs (the first left out), in us; and
    the host's time per pair (perf_counter around the same loop, before the synchronisation)."""
    import time
    for _ in range(10):
        combine(dispatch()[1])
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    t0 = time.perf_counter()
    for i in range(runs):
        starts[i].record()
        combine(dispatch()[1])
        ends[i].record()
    host = (time.perf_counter() - t0) / runs * 1e6
    torch.cuda.synchronize()
    return statistics.mean(s.elapsed_time(e) * 1e3 for s, e in list(zip(starts, ends))[1:]), host


def graph_time(torch, dispatch, combine, runs=50):
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                combine(dispatch()[1])
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            combine(dispatch()[1])
        for _ in range(5):
            graph.replay()
        times = []
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times), None
    except Exception as exc:  # a library that cannot be captured reports why, the other figures stand
        torch.cuda.synchronize()
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def shape_key(doc, r):
    """(dtype, K, H, T) of a result; files written before --sweep name the shape once, at the top (fp8)."""
    return (r.get("dtype", "fp8"), r.get("K", doc.get("topk")), r.get("H", doc.get("hidden")), r["T"])


def shape_label(dtype, K, H, T):
    """The T column: T alone for DeepEP's decode default (fp8, K = 8, H = 7168), else with the shape; '-' for a
    refused shape (no T)."""
    t = "-" if T is None else f"{T}"
    return t if (dtype, K, H) == ("fp8", 8, 7168) and T is not None else f"{t} ({dtype}, K = {K}, H = {H})"


def compare(epmoe_json, deepep_json):
    """Markdown table of epmoe / DeepEP per figure (below 1.0: epmoe faster), both files from one call. A shape that
    one library refused gets one row with its error; shapes other than DeepEP's decode default (fp8, K = 8,
    H = 7168) are named in the T column."""
    tables = []
    for path in (epmoe_json, deepep_json):
        with open(path) as f:
            doc = json.load(f)
        tables.append({shape_key(doc, r): r for r in doc["results"]})
    ours, theirs = tables
    print("| T | figure | epmoe us | DeepEP us | epmoe / DeepEP |\n| --- | --- | --- | --- | --- |")
    for key in sorted(set(ours) | set(theirs), key=lambda k: (k[0] != "fp8", -(k[1] or 0), -(k[2] or 0), k[3] or 0)):
        dtype, T = key[0], key[3]
        label = shape_label(*key)
        a, b = ours.get(key), theirs.get(key)
        if a is None or b is None or T is None:
            errors = "; ".join(f"{lib}: {r['error']}" for lib, r in (("epmoe", a), ("DeepEP", b))
                               if r is not None and r.get("error"))
            missing = [lib for lib, r in (("epmoe", a), ("DeepEP", b)) if r is None]
            print(f"| {label} | not compared | - | - | {errors or 'not measured by ' + ', '.join(missing)} |")
            continue
        rows = [(f"{op} kernel time (every kernel)", a["kernel_us"][op]["per_call_us"], b["kernel_us"][op]["per_call_us"])
                for op in ("dispatch", "combine")]
        rows += [(f"{op} call time, L2 flushed", a["call_us_l2_flushed"][op], b["call_us_l2_flushed"][op])
                 for op in ("dispatch", "combine")]
        rows.append((f"CUDA graph, {dtype} dispatch + combine", a["graph_pair_us"], b["graph_pair_us"]))
        if "eager_pair_us" in a and "eager_pair_us" in b:  # (files written before it was measured have none)
            rows.append((f"eager {dtype} dispatch + combine (DeepEP's avg_t)", a["eager_pair_us"], b["eager_pair_us"]))
            rows.append(("  its host time per pair", a["eager_pair_host_us"], b["eager_pair_host_us"]))
        if "eager_pair_stats_us" in a and "eager_pair_stats_us" in b:
            rows.append(("  the same with cumulative_local_expert_recv_stats (DeepEP's test_func)",
                         a["eager_pair_stats_us"], b["eager_pair_stats_us"]))
            rows.append(("  its host time per pair, with the stats", a["eager_pair_stats_host_us"],
                         b["eager_pair_stats_host_us"]))
        for name, x, y in rows:
            ratio = f"{x / y:.2f}" if x and y else "-"
            fx = f"{x:.2f}" if x else "-"
            fy = f"{y:.2f}" if y else "-"
            print(f"| {label} | {name} | {fx} | {fy} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
