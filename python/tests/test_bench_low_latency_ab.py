"""bench/low_latency_ab.py: the A/B table of two builds' bench_gpu_low_latency runs, on random figures.

The runs need a GPU; the table is what a reader of bench/results takes a change's effect from, so its medians and
ratios are checked here against values computed in the test, and runs of two devices are refused.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import statistics

ROOT = pathlib.Path(__file__).resolve().parents[2]
OPS = ["dispatch_fp8", "combine_bf16", "dispatch_fp8_recv"]


def load_ab():
    spec = importlib.util.spec_from_file_location("low_latency_ab", ROOT / "bench" / "low_latency_ab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_file(tmp_path, name, T, medians, device="NVIDIA H100 80GB HBM3"):
    doc = {"device": device, "ranks": 1, "T": T, "H": 7168, "K": 8, "E": 256, "seed": 1, "runs": 60,
           "results": [{"op": op, "median_us": m, "min_us": m * 0.9, "remote_bytes": 0, "remote_gbps_per_rank": 0}
                       for op, m in zip(OPS, medians)]}
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def test_table_gives_each_run_and_the_ratio_of_medians(tmp_path, capsys, rng):
    ab = load_ab()
    figures, base, new = {}, [], []
    for T in (1, 128):
        for i in range(3):
            for side, paths in (("base", base), ("new", new)):
                medians = [float(v) for v in rng.uniform(5.0, 60.0, len(OPS))]
                figures.setdefault((side, T), []).append(medians)
                paths.append(run_file(tmp_path, f"{side}_T{T}_{i}.json", T, medians))
    assert ab.main(["--base", *base, "--new", *new, "--labels", "96d91c4", "change"]) == 0
    lines = capsys.readouterr().out.splitlines()
    title = next(i for i, line in enumerate(lines) if " against " in line)  # after the seed line
    assert lines[title].startswith("change (new) against 96d91c4 (base) on NVIDIA H100 80GB HBM3")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[title + 4:]]
    assert [r[0] for r in rows] == ["128"] * len(OPS) + ["1"] * len(OPS)  # the larger T first
    for row in rows:
        T, k = int(row[0]), OPS.index(row[1])
        b = [runs[k] for runs in figures[("base", T)]]
        n = [runs[k] for runs in figures[("new", T)]]
        assert row[2] == " / ".join(f"{v:.1f}" for v in b)
        assert row[3] == " / ".join(f"{v:.1f}" for v in n)
        assert row[6] == f"{statistics.median(n) / statistics.median(b):.2f}"


def test_runs_of_two_devices_are_refused(tmp_path, capsys, rng):
    ab = load_ab()
    medians = [float(v) for v in rng.uniform(5.0, 60.0, len(OPS))]
    base = run_file(tmp_path, "base.json", 128, medians)
    new = run_file(tmp_path, "new.json", 128, medians, device="NVIDIA H200")
    assert ab.main(["--base", base, "--new", new]) == 2
    err = capsys.readouterr().err
    assert "NVIDIA H100 80GB HBM3" in err and "NVIDIA H200" in err and "not comparable" in err


POINTS = ["start", "index", "ids", "consumed", "writable", "sent", "published", "arrived", "headers", "scanned", "end"]


def trace_file(tmp_path, name, figures, rank=0):
    """A traced run's output as bench_gpu_low_latency prints it: a line per launch kind of (first, last) per point."""
    lines = ["| dispatch_fp8 | 12.0 | 11.0 | 0.00 | 0 |"]  # a table line of the run, not a trace line
    for kind, points in figures.items():
        body = "".join(f"  {p} {a:.2f}/{b:.2f}" for p, (a, b) in points.items())
        lines.append(f"epmoe cuda_ipc low-latency trace, rank {rank}, {kind} (50 launches after 5 left out): us after "
                     f"the first block's start, first / last block to pass each point (%globaltimer):{body}")
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_traces_give_each_point_of_both_builds_and_the_difference(tmp_path, capsys, rng):
    ab = load_ab()
    medians = [float(v) for v in rng.uniform(5.0, 60.0, len(OPS))]
    base, new = run_file(tmp_path, "b.json", 1, medians), run_file(tmp_path, "n.json", 1, medians)
    figures = {}
    for side in ("base", "new"):
        for kind in ("dispatch (send + recv)", "combine recv"):
            stamps = sorted(float(v) for v in rng.uniform(0.0, 30.0, 2 * len(POINTS)))
            figures.setdefault(side, {})[kind] = {p: (stamps[2 * i], stamps[2 * i + 1]) for i, p in enumerate(POINTS)}
    figures["new"]["combine recv"].pop("scanned")  # a point the new build does not pass: left out
    bt, nt = trace_file(tmp_path, "bt.txt", figures["base"]), trace_file(tmp_path, "nt.txt", figures["new"])
    assert ab.main(["--base", base, "--new", new, "--labels", "old", "change", "--traces", "1", bt, nt]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Where the time goes"))
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[start + 4:]]
    expected = [(kind, p) for kind in ("dispatch (send + recv)", "combine recv") for p in POINTS
                if not (kind == "combine recv" and p == "scanned")]
    assert [(r[1], r[2]) for r in rows] == expected
    for T, kind, point, b, n, d in rows:
        assert T == "1"
        b_last, n_last = figures["base"][kind][point][1], figures["new"][kind][point][1]
        assert (b, n) == (f"{b_last:.2f}", f"{n_last:.2f}")
        # the trace prints 2 decimals: the difference is of the figures as printed
        assert d == f"{round(n_last, 2) - round(b_last, 2):+.2f}"


def test_a_trace_without_trace_lines_is_named(tmp_path, capsys, rng):
    ab = load_ab()
    medians = [float(v) for v in rng.uniform(5.0, 60.0, len(OPS))]
    base, new = run_file(tmp_path, "b.json", 1, medians), run_file(tmp_path, "n.json", 1, medians)
    empty = tmp_path / "untraced.txt"
    empty.write_text("| dispatch_fp8 | 12.0 | 11.0 | 0.00 | 0 |\n")
    other_rank = trace_file(tmp_path, "rank1.txt", {"combine recv": {"start": (0.0, 0.1)}}, rank=1)
    for path in (str(empty), other_rank):
        assert ab.main(["--base", base, "--new", new, "--traces", "1", path, path]) == 2
        err = capsys.readouterr().err
        assert path in err and "no low-latency trace line of rank 0" in err
