"""bench/low_latency_vs_deepep.py --compare: the epmoe / DeepEP table from two result files, on random figures.

The measuring half needs a GPU and both libraries; the table is what a reader of bench/results takes the ratios from,
so its rows are checked here against ratios computed in the test: the default shape, the --sweep shapes named in the
T column, a shape one library refused (its error in the row), and a file written before --sweep (the shape only at
the top).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_bench():
    spec = importlib.util.spec_from_file_location("low_latency_vs_deepep", ROOT / "bench" / "low_latency_vs_deepep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def result(rng, dtype, K, H, T, eager=True):
    fig = lambda: float(rng.uniform(5.0, 60.0))  # noqa: E731 - microseconds, never zero
    r = {"dtype": dtype, "K": K, "H": H, "T": T,
         "kernel_us": {op: {"per_call_us": fig()} for op in ("dispatch", "combine")},
         "call_us_l2_flushed": {"dispatch": fig(), "combine": fig()}, "graph_pair_us": fig(), "graph_error": None}
    if eager:  # files written before the eager pair was measured have neither key
        r.update(eager_pair_us=fig(), eager_pair_host_us=fig(), eager_pair_stats_us=fig(),
                 eager_pair_stats_host_us=fig())
    return r


def write(tmp_path, name, doc):
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def rows_of(capsys):
    lines = capsys.readouterr().out.splitlines()
    header = lines.index("| T | figure | epmoe us | DeepEP us | epmoe / DeepEP |")  # after the seed line
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[header + 2:]]


def test_compare_sweep_shapes_and_refused_shape(tmp_path, capsys, rng):
    bench = load_bench()
    shapes = [("fp8", 8, 7168, 1), ("fp8", 8, 7168, 128), ("bf16", 8, 7168, 32), ("fp8", 2, 7168, 1),
              ("fp8", 8, 4096, 128)]
    ours = [result(rng, *s) for s in shapes]
    theirs = [result(rng, *s) for s in shapes]
    ours.append(result(rng, "fp8", 8, 2880, 1))
    theirs.append({"dtype": "fp8", "K": 8, "H": 2880, "T": None, "error": "RuntimeError: Unsupported hidden"})
    a = write(tmp_path, "epmoe.json", {"topk": 8, "hidden": 7168, "results": ours})
    b = write(tmp_path, "deepep.json", {"topk": 8, "hidden": 7168, "results": theirs})
    assert bench.compare(a, b) == 0
    rows = rows_of(capsys)
    by_label = {}
    for row in rows:
        by_label.setdefault(row[0], []).append(row)
    for (dtype, K, H, T), x, y in zip(shapes, ours, theirs):
        label = f"{T}" if (dtype, K, H) == ("fp8", 8, 7168) else f"{T} ({dtype}, K = {K}, H = {H})"
        got = {row[1]: row for row in by_label[label]}
        assert len(got) == 9, label
        kernel = got["dispatch kernel time (every kernel)"]
        want = x["kernel_us"]["dispatch"]["per_call_us"] / y["kernel_us"]["dispatch"]["per_call_us"]
        assert kernel[2] == f"{x['kernel_us']['dispatch']['per_call_us']:.2f}"
        assert kernel[4] == f"{want:.2f}"
        graph = got[f"CUDA graph, {dtype} dispatch + combine"]
        assert graph[4] == f"{x['graph_pair_us'] / y['graph_pair_us']:.2f}"
        eager = got[f"eager {dtype} dispatch + combine (DeepEP's avg_t)"]
        assert eager[4] == f"{x['eager_pair_us'] / y['eager_pair_us']:.2f}"
        host = got["its host time per pair"]
        assert (host[2], host[3]) == (f"{x['eager_pair_host_us']:.2f}", f"{y['eager_pair_host_us']:.2f}")
        stats = got["the same with cumulative_local_expert_recv_stats (DeepEP's test_func)"]
        assert stats[4] == f"{x['eager_pair_stats_us'] / y['eager_pair_stats_us']:.2f}"
        stats_host = got["its host time per pair, with the stats"]
        assert (stats_host[2], stats_host[3]) == (f"{x['eager_pair_stats_host_us']:.2f}",
                                                  f"{y['eager_pair_stats_host_us']:.2f}")
    # The refused shape: DeepEP's error in one row; epmoe's figure for it is not set against anything.
    refused = [row for row in rows if "H = 2880" in row[0]]
    assert [row[1] for row in refused] == ["not compared", "not compared"]
    assert any("DeepEP: RuntimeError: Unsupported hidden" in row[4] for row in refused)
    assert any("not measured by DeepEP" in row[4] for row in refused)
    # The default shape comes first, T ascending.
    assert [row[0] for row in rows[:18]] == ["1"] * 9 + ["128"] * 9


def test_compare_reads_files_written_before_sweep(tmp_path, capsys, rng):
    bench = load_bench()
    old = []
    for _ in range(2):
        r = result(rng, "fp8", 8, 7168, 1, eager=False)
        for key in ("dtype", "K", "H"):
            del r[key]
        old.append(r)
    a = write(tmp_path, "epmoe.json", {"topk": 8, "hidden": 7168, "results": [old[0]]})
    b = write(tmp_path, "deepep.json", {"topk": 8, "hidden": 7168, "results": [old[1]]})
    bench.compare(a, b)
    rows = rows_of(capsys)
    assert len(rows) == 5 and all(row[0] == "1" for row in rows)
    combine = [row for row in rows if row[1] == "combine call time, L2 flushed"][0]
    want = old[0]["call_us_l2_flushed"]["combine"] / old[1]["call_us_l2_flushed"]["combine"]
    assert combine[4] == f"{want:.2f}"


def test_host_profile_names_the_calls_that_took_the_time(tmp_path, rng):
    bench = load_bench()
    calls = {"dispatch": 0, "combine": 0}
    work = int(rng.integers(200, 400))  # a little host work per call, so each shows in the profile

    def spend_in_dispatch():
        calls["dispatch"] += 1
        return sum(range(work)), "handle"

    def spend_in_combine(handle):
        assert handle == "handle"
        calls["combine"] += 1
        return sum(range(work))

    path = tmp_path / "host_profile.txt"
    runs = int(rng.integers(20, 40))
    assert bench.host_profile(spend_in_dispatch, spend_in_combine, str(path), "test shape", runs=runs) == str(path)
    assert calls == {"dispatch": runs, "combine": runs}
    text = path.read_text()
    assert text.startswith(f"host profile of {runs} eager dispatch + combine pairs: test shape")
    # Both orders (own time, cumulative) name both calls, each called `runs` times.
    assert text.count("spend_in_dispatch") >= 2 and text.count("spend_in_combine") >= 2
    assert f"{runs}    " in text or f" {runs} " in text
