"""scripts/plot_bench.py on files that are not `epmoe bench --json` output: one line naming what is wrong, exit 2,
no traceback (the plot itself, which needs matplotlib, is tested by the command line's tests)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("doc, says", [
    ([], "expected an object, got list"),
    ({"results": []}, 'expected "command": "bench", got null'),
    ({"command": "run", "results": []}, 'expected "command": "bench", got "run"'),
    ({"command": "bench"}, "no 'results' list"),
    ({"command": "bench", "results": [{"T": 1}]}, "results[0] lacks 'op', 'tokens'"),
    ({"command": "bench", "results": [{"op": "dispatch_bf16", "tokens": 1}, 7]}, "results[1] lacks 'op', 'tokens'"),
])
def test_a_file_that_is_not_bench_output_is_named(tmp_path, doc, says):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_bench.py"), str(path), "-o",
                        str(tmp_path / "out.png")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out.png").exists()
