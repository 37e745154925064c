"""Smoke test of benchmarks/overlap.py: it runs, every system trains to DDP's parameters,
overlap on and off end bit-for-bit equal, and the timeline gives a hidden fraction for
every strategy."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_overlap_benchmark_runs_and_checks(tmp_path):
    output = tmp_path / "overlap.json"
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "overlap.py"), "--model", "tiny", "--warmup", "1",
         "--rounds", "2", "--no-deepspeed", "--json", str(output)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(output.read_text())
    sys.path.insert(0, str(BENCHMARKS))
    from overlap import LOCAL, STRATEGIES, TOLERANCE_GROUPSHARD, TOLERANCE_OTHERS, _row

    groupshard = [_row(s, overlap) for s in STRATEGIES for overlap in (True, False)]
    assert list(report["rows"]) == [LOCAL, "DDP", "FSDP2", *groupshard]
    assert report["checks"] == []
    for name, row in report["rows"].items():
        assert len(row["step_ms_rounds"]) == 2 and row["step_ms"] > 0, name
        if name == LOCAL:  # each rank on its own batch: not DDP's parameters
            assert row["max_difference_vs_ddp"] > 0
            continue
        tolerance = TOLERANCE_GROUPSHARD if name.startswith("groupshard") else TOLERANCE_OTHERS
        assert row["max_difference_vs_ddp"] <= tolerance, (name, row["max_difference_vs_ddp"])
    for strategy in STRATEGIES:
        on, off = (report["rows"][_row(strategy, overlap)] for overlap in (True, False))
        assert on["max_difference_vs_overlap_off"] == 0.0, strategy  # bit-for-bit
        # overlap on starts collectives asynchronously and waits for them; off never does
        assert on["async_collectives"] >= 1 and off["async_collectives"] == 0, strategy
        assert on["async_not_waited"] == 0, strategy
        # all-gathers per step, and those started ahead (prefetched): none without overlap
        assert 0 <= on["gathers_async"] <= on["gathers"] and off["gathers_async"] == 0, strategy
        assert on["gathers"] == off["gathers"], strategy
        assert off["exposed_ms"] > 0 and on["exposed_ms"] >= 0, strategy
        hidden = report["hidden"][strategy]
        assert math.isclose(hidden["hidden_fraction"], 1 - on["exposed_ms"] / off["exposed_ms"])
        assert report["hidden_fraction"][strategy] == hidden["hidden_fraction"]
        # one step's timeline per rank: the marks, and the collectives inside the step
        for timeline in on["timeline_last_step"]:
            marks = timeline["marks"]
            assert 0 < marks["forward_end"] <= marks["backward_end"] <= marks["step_end"]
            assert any(e["async"] for e in timeline["events"]), strategy
            for event in timeline["events"]:
                assert 0 <= event["start"] <= marks["step_end"] and event["exposed"] >= 0
        assert f"  {strategy}" in result.stdout and "hidden" in result.stdout
    # issue 13's targets that apply to "tiny": no_shard / DDP, and grad_op / ZeRO-2, which
    # without the DeepSpeed row has no ratio
    targets = {(t["row"], t["baseline"]): t for t in report["targets"]}
    assert set(targets) == {
        (_row(strategy, overlap), baseline)
        for strategy, baseline in (("no_shard", "DDP"), ("grad_op", "ZeRO-2"))
        for overlap in (True, False)
    }
    for (row, baseline), target in targets.items():
        if baseline == "DDP":
            assert target["met"] == (target["ratio"] <= target["bound"]), row
        else:
            assert target["ratio"] is None and target["met"] is None, row
    assert "no DeepSpeed ZeRO-2 row" in result.stdout
