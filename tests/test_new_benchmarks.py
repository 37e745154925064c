"""Smoke tests of benchmarks/hybrid.py (bytes within and across replicas, against the
formulas), benchmarks/whole_param.py (WholeParamOptimizer beside DDP),
benchmarks/regroup_memory.py (gs.regroup's peak memory) and benchmarks/tensor_parallel.py
(groupshard + TP beside FSDP2 + TP): they run, and their results hold what the README's
tables say of them."""

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


def test_tensor_parallel_benchmark_runs_and_equals_fsdp2_with_tp(tmp_path):
    """At a toy width: every system steps on the 2 x 2 mesh, its collectives are profiled,
    it holds no more than FSDP2 + TP and its weights are FSDP2 + TP's to float precision."""
    output = tmp_path / "tp.json"
    _run("tensor_parallel.py", "--dim", "128", "--hidden", "256", "--vocab", "256",
         "--seq", "16", "--layers", "1", "--rounds", "1", "--steps", "1",
         "--out", str(output))  # fmt: skip
    report = json.loads(output.read_text())
    rows = report["rows"]
    assert report["kind"] == "tensor-parallel"
    assert list(rows) == ["FSDP2 + TP", "groupshard full + TP", "groupshard grad_op + TP"]
    for name, row in rows.items():
        assert row["ms_per_step"] > 0 and row["collectives_per_step"] > 0, (name, row)
        assert row["max_diff_vs_fsdp2"] < 1e-5, (name, row)
    fsdp2 = rows["FSDP2 + TP"]["state_mb_per_rank"]
    assert rows["groupshard full + TP"]["state_mb_per_rank"] <= 1.1 * fsdp2, rows
