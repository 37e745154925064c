"""Smoke tests of benchmarks/hybrid.py (bytes within and across replicas, against the
formulas), benchmarks/whole_param.py (WholeParamOptimizer beside DDP) and
benchmarks/regroup_memory.py (gs.regroup's peak memory): they run, and their results hold
what the README's tables say of them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(script: str, *args: str) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_hybrid_bytes_equal_the_formulas(tmp_path):
    output = tmp_path / "hybrid.json"
    _run("hybrid.py", "--models", "tiny", "--json", str(output))
    measured = json.loads(output.read_text())["measured"]
    assert [row["layout"] for row in measured] == ["full over 4", "HSDP 2x2"]
    for row in measured:
        assert row["same_on_every_rank"], row
        assert row["across"] == row["formula_across"], row
        assert row["within"] == row["formula_within"] - row["root_not_regathered"], row
    full, hybrid = measured
    assert full["across"] == 0 and hybrid["across"] > 0
    assert hybrid["within"] < full["within"]


def test_whole_param_benchmark_runs_and_equals_ddp(tmp_path):
    output = tmp_path / "whole.json"
    _run("whole_param.py", "--world-size", "2", "--rounds", "1", "--warmup", "1",
         "--json", str(output))  # fmt: skip
    rows = json.loads(output.read_text())["rows"]
    ours = [name for name in rows if name.startswith("groupshard")]
    assert len(ours) == 3, list(rows)
    for name in ours:
        row = rows[name]
        assert row["error"] is None, (name, row["error"])
        assert row["max_difference_vs_ddp"] == 0.0, name  # world 2: bit for bit
        assert row["optimizer_ms"] > 0 and row["compute_ms"] > 0 and row["step_ms"] > 0, name
        assert row["state_ratio_to_ddp"] < 1.0, (name, row["state_ratio_to_ddp"])
        if "measured" not in name:  # costs by formula: balanced elements, so state too
            assert row["balance"] <= 1.1, (name, row["balance"])
            assert row["state_ratio_to_ddp"] < 0.6, (name, row["state_ratio_to_ddp"])


def test_regroup_memory_benchmark_runs(tmp_path):
    """The tiny model (its peaks are allocator noise): both calls on both ranks, each with
    its unit sizes, and the regrouped model trained on (the script steps it after)."""
    output = tmp_path / "regroup.json"
    _run("regroup_memory.py", "--model", "tiny", "--out", str(output))
    report = json.loads(output.read_text())
    assert report["kind"] == "regroup-memory" and report["model"] == "tiny"
    ranks = report["ranks"]
    assert [entry["rank"] for entry in ranks] == [0, 1]
    for entry in ranks:
        assert len(entry["calls"]) == 2, entry["calls"]
        for call in entry["calls"].values():
            assert call["seconds"] > 0 and call["peak_above_before"] >= 0, call
        assert entry["unit_params_bytes"] and entry["optimizer_state_bytes"] > 0, entry
