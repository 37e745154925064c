"""Smoke test of benchmarks/checkpoint.py: every row saves and loads exactly, and
benchmarks/tables.py renders its results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def test_checkpoint_benchmark_runs_every_row_exactly_and_renders(tmp_path):
    out = tmp_path / "r.json"
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "checkpoint.py"), "--model", "tiny", "--rounds", "1",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["kind"] == "checkpoint" and report["rounds"] == 1
    assert set(report["rows"]) == {
        "fsdp2 torch idiom", "groupshard torch idiom", "groupshard gs.checkpoint",
    }  # fmt: skip
    for name, row in report["rows"].items():
        assert row["max_difference"] == 0.0, name
        assert row["save_s"] > 0 and row["load_s"] > 0, name
        assert row["folder_bytes"] > 0, name

    sys.path.insert(0, str(BENCHMARKS))
    try:
        from tables import checkpoint_table
    finally:
        sys.path.remove(str(BENCHMARKS))
    lines = checkpoint_table([report])
    assert len(lines) == 2 + len(report["rows"])
    assert lines[2].startswith("| tiny | fsdp2 torch idiom | ")
