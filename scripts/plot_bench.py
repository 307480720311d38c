#!/usr/bin/env python3
"""Plots the JSON of `epmoe bench --json PATH`: bandwidth against T, one panel per op.

Each panel shows epmoe's bandwidth (remote bytes / median time), the floor measured in the same run
(GPU: cudaMemcpyPeerAsync of the same bytes, every direction at once; CPU: memcpy) and, when the
bench had it, NCCL's all-to-all-v of the same rows.

    build/venv/bin/pip install -r scripts/requirements-plot.txt   # matplotlib, once
    build/venv/bin/python scripts/plot_bench.py bench.json -o bench.png
"""
import argparse
import json
import os
import sys


def fail(message):
    """A bad input file or output path: one line on stderr, exit status 2 (as the epmoe command's bad arguments)."""
    print(f"plot_bench: {message}", file=sys.stderr)
    sys.exit(2)


def load(path):
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")
    except ValueError as e:
        fail(f"{path} is not JSON ({e})")
    if not isinstance(data, dict):
        fail(f"{path} is not the JSON of `epmoe bench` (expected an object, got {type(data).__name__})")
    if data.get("command") != "bench":
        fail(f"{path} is not the JSON of `epmoe bench` (expected \"command\": \"bench\", got "
             f"{json.dumps(data.get('command'))})")
    if not isinstance(data.get("results"), list):
        fail(f"{path} is not the JSON of `epmoe bench` (no 'results' list)")
    for i, r in enumerate(data["results"]):
        missing = [k for k in ("op", "tokens") if not isinstance(r, dict) or k not in r]
        if missing:
            fail(f"{path}: results[{i}] lacks {', '.join(repr(k) for k in missing)} (not `epmoe bench` output)")
    return data


def series(rows, key):
    pts = [(r["tokens"], r[key]) for r in rows if r.get(key) is not None and r[key] > 0]
    return [p[0] for p in pts], [p[1] for p in pts]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="output of epmoe bench --json")
    ap.add_argument("-o", "--output", default=None, help="PNG to write (default: the JSON path with .png)")
    args = ap.parse_args(argv)
    data = load(args.json)
    out = args.output or (args.json[:-5] if args.json.endswith(".json") else args.json) + ".png"
    out_dir = os.path.dirname(out) or "."
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        fail(f"cannot write {out}: {out_dir} is not a writable directory")

    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    ops = []
    for r in data["results"]:
        if r["op"] not in ops:
            ops.append(r["op"])
    if not ops:
        fail(f"{args.json} holds no results")
    cols = min(3, len(ops))
    rows = (len(ops) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
    floor_name = "peer copy" if data.get("floor") == "peer_copy" else "memcpy"
    for i, op in enumerate(ops):
        ax = axes[i // cols][i % cols]
        rs = sorted((r for r in data["results"] if r["op"] == op), key=lambda r: r["tokens"])
        for key, label, style in (("gb_per_s", "epmoe", "o-"), ("floor_gb_per_s", floor_name, "s--"),
                                  ("nccl_gb_per_s", "NCCL", "^:")):
            x, y = series(rs, key)
            if x:
                ax.plot(x, y, style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # bandwidth spans decades from T = 1 to 16384
        ax.set_title(op)
        ax.set_xlabel("T (tokens per rank)")
        ax.set_ylabel("GB/s (remote bytes, all ranks)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    for j in range(len(ops), rows * cols):
        axes[j // cols][j % cols].axis("off")
    fig.suptitle(f"epmoe {data.get('version', '')} bench: {data.get('ranks')} x {data.get('device_name')}, "
                 f"H={data.get('hidden')} K={data.get('num_topk')} E={data.get('num_experts')}, nccl: {data.get('nccl')}",
                 fontsize="medium")
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=110)
    except OSError as e:
        fail(f"cannot write {out}: {e.strerror}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
