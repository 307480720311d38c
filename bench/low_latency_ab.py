"""Two builds' bench_gpu_low_latency runs side by side: the A/B of a change, both measured in one call.

    python3 bench/low_latency_ab.py --base B1.json B2.json ... --new N1.json N2.json ... [--labels BASE NEW]
                                    [--traces T BASE_TRACE NEW_TRACE]...

Each file is one run's `bench_gpu_low_latency --json` (median of its runs per op); `scripts/gpu_check.sh llab` writes
them, alternating base and new at each T so that a drift of the machine touches both alike. Prints a markdown table:
per T and op, every run's median as it ran, the median of those medians for each build, and new / base (below 1.0:
the change is faster). Only runs of the same machine and T are set against each other; a file of another device is
refused.

--traces T BASE_TRACE NEW_TRACE (repeatable): the output of a traced run of each build at T (`EPMOE_CUDA_IPC_TRACE=1`,
docs/cuda_ipc_design.md "Trace"): a second table gives, per kind of launch and trace point, the us after the launch's
first block started at which the last block passed it, base and new, and the difference: where a change moved time.
"""
import argparse
import json
import re
import statistics
import sys

TRACE_LINE = re.compile(r"low-latency trace, rank (\d+), (.+?) \((\d+) launches.*?\(%globaltimer\):(.*)$")
TRACE_POINT = re.compile(r"(\S+) (-?[\d.]+)/(-?[\d.]+)")


def load(paths):
    """{T: {op: [median us of each run, in the order given]}}, and the device name."""
    runs, device = {}, None
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        if device is not None and doc["device"] != device:
            raise ValueError(f"{path}: device {doc['device']!r}, the other runs' {device!r}")
        device = doc["device"]
        per_op = runs.setdefault(doc["T"], {})
        for r in doc["results"]:
            per_op.setdefault(r["op"], []).append(r["median_us"])
    return runs, device


def table(base_paths, new_paths, labels=("base", "new")):
    """The markdown table (a list of lines) of the base and new runs."""
    base, device = load(base_paths)
    new, new_device = load(new_paths)
    if device != new_device:
        raise ValueError(f"base runs on {device!r}, new runs on {new_device!r}: not comparable")
    b, n = labels
    lines = [f"{n} (new) against {b} (base) on {device} (bench_gpu_low_latency, median us of each run, in the order "
             "they ran)", "",
             f"| T | op | {b} runs | {n} runs | {b} | {n} | {n} / {b} |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for T in sorted(set(base) & set(new), reverse=True):
        for op, b_runs in base[T].items():
            n_runs = new[T].get(op)
            if not n_runs:
                continue
            mb, mn = statistics.median(b_runs), statistics.median(n_runs)
            ratio = f"{mn / mb:.2f}" if mb > 0 else "-"
            lines.append(f"| {T} | {op} | {' / '.join(f'{v:.1f}' for v in b_runs)} | "
                         f"{' / '.join(f'{v:.1f}' for v in n_runs)} | {mb:.1f} | {mn:.1f} | {ratio} |")
    return lines


def load_trace(path):
    """{launch kind: {point: (first block us, last block us)}} of rank 0's lines in a traced run's output, points in
    the order printed."""
    kinds = {}
    with open(path) as f:
        for line in f:
            m = TRACE_LINE.search(line)
            if m is None or m.group(1) != "0":
                continue
            kinds[m.group(2)] = {p: (float(a), float(b)) for p, a, b in TRACE_POINT.findall(m.group(4))}
    if not kinds:
        raise ValueError(f"{path}: no low-latency trace line of rank 0 (was EPMOE_CUDA_IPC_TRACE=1 set?)")
    return kinds


def trace_table(traces, labels=("base", "new")):
    """The markdown table (a list of lines) of traced runs: [(T, base trace path, new trace path)]."""
    b, n = labels
    lines = [f"Where the time goes (device stamps, us after each launch's first block started, the last block to pass "
             f"each point), {n} (new) against {b} (base)", "",
             f"| T | launch | point | {b} | {n} | {n} - {b} |", "| --- | --- | --- | --- | --- | --- |"]
    for T, base_path, new_path in traces:
        base, new = load_trace(base_path), load_trace(new_path)
        for kind, points in base.items():
            for point, (_, last) in points.items():
                if point in new.get(kind, {}):
                    other = new[kind][point][1]
                    lines.append(f"| {T} | {kind} | {point} | {last:.2f} | {other:.2f} | {other - last:+.2f} |")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", nargs="+", required=True, metavar="JSON")
    p.add_argument("--new", nargs="+", required=True, metavar="JSON")
    p.add_argument("--labels", nargs=2, default=["base", "new"], metavar=("BASE", "NEW"))
    p.add_argument("--traces", nargs=3, action="append", default=[], metavar=("T", "BASE_TRACE", "NEW_TRACE"))
    args = p.parse_args(argv)
    try:
        lines = table(args.base, args.new, tuple(args.labels))
        if args.traces:
            lines += [""] + trace_table(args.traces, tuple(args.labels))
        print("\n".join(lines))
    except (OSError, ValueError, KeyError) as exc:
        print(f"low_latency_ab.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
