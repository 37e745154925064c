"""Smoke test of benchmarks/construction.py: every system reports, groupshard's construction
stays per rank, and all systems start from the same weights (same first loss)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_construction_benchmark_tiny(tmp_path):
    output = tmp_path / "construction.json"
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "construction.py"), "--model", "tiny",
         "--world-size", "2", "--rank-timeout", "60", "--json", str(output)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-6000:]
    report = json.loads(output.read_text())
    systems = report["systems"]
    assert list(systems) == ["groupshard", "FSDP2", "DeepSpeed", "DDP"]
    for name, entry in systems.items():
        if name == "DeepSpeed" and "absent" in entry:  # not installed here
            continue
        ranks = entry["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1], name
        for r in ranks:
            assert r["baseline"] > 0 and r["construct_peak"] >= r["held_after_construct"] > 0, name
            assert r["step_peak"] >= r["held_after_step"] > 0, name
            assert r["time_to_first_step_s"] >= r["construct_s"] > 0, name
            assert r["activation_bytes"] > 0 and r["loss"] > 0, name
    full_bytes = report["parameter_bytes"]
    # groupshard builds one unit at a time: its shards (half the model) plus one unit
    # (1/6 of it), never the whole model as DDP does
    for r in systems["groupshard"]["ranks"]:
        assert r["construct_peak"] - r["baseline"] < full_bytes, r
    assert systems["DDP"]["construct_peak_above_baseline"] >= full_bytes
    # FSDP2, DDP (and DeepSpeed) are initialized with groupshard's seeding rule: the same
    # weights, so the first step's loss (computed before any update) is the same on each rank
    others = [name for name, entry in systems.items() if "ranks" in entry and name != "groupshard"]
    assert "FSDP2" in others and "DDP" in others
    for name in others:
        for mine, theirs in zip(
            systems["groupshard"]["ranks"], systems[name]["ranks"], strict=True
        ):
            assert abs(mine["loss"] - theirs["loss"]) <= 1e-5, (name, mine["loss"], theirs["loss"])
    assert "target:" in result.stdout and "groupshard" in result.stdout
