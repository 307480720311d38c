"""Two builds' bench_gpu_low_latency runs side by side: the A/B of a change, both measured in one call.

    python3 bench/low_latency_ab.py --base B1.json B2.json ... --new N1.json N2.json ... [--labels BASE NEW]

Each file is one run's `bench_gpu_low_latency --json` (median of its runs per op); `scripts/gpu_check.sh llab` writes
them, alternating base and new at each T so that a drift of the machine touches both alike. Prints a markdown table:
per T and op, every run's median as it ran, the median of those medians for each build, and new / base (below 1.0:
the change is faster). Only runs of the same machine and T are set against each other; a file of another device is
refused.
"""
import argparse
import json
import statistics
import sys


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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", nargs="+", required=True, metavar="JSON")
    p.add_argument("--new", nargs="+", required=True, metavar="JSON")
    p.add_argument("--labels", nargs=2, default=["base", "new"], metavar=("BASE", "NEW"))
    args = p.parse_args(argv)
    try:
        print("\n".join(table(args.base, args.new, tuple(args.labels))))
    except (OSError, ValueError, KeyError) as exc:
        print(f"low_latency_ab.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
