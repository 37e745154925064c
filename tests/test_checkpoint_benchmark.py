"""Smoke tests of benchmarks/checkpoint.py and async_checkpoint.py: every row saves and
loads exactly, and benchmarks/tables.py renders their results."""

from __future__ import annotations

from helpers import rendered_table, run_benchmark


def test_checkpoint_benchmark_runs_every_row_exactly_and_renders(tmp_path):
    arguments = ("--model", "tiny", "--rounds", "1")
    report = run_benchmark("checkpoint.py", tmp_path, *arguments, timeout=240)
    assert report["kind"] == "checkpoint" and report["rounds"] == 1
    assert set(report["rows"]) == {
        "fsdp2 torch idiom", "groupshard torch idiom", "groupshard gs.checkpoint",
    }  # fmt: skip
    for name, row in report["rows"].items():
        assert row["max_difference"] == 0.0, name
        assert row["save_s"] > 0 and row["load_s"] > 0, name
        assert row["folder_bytes"] > 0, name

    lines = rendered_table("checkpoint", [report])
    assert len(lines) == 2 + len(report["rows"])
    assert lines[2].startswith("| tiny | fsdp2 torch idiom | ")


def test_async_checkpoint_benchmark_runs_every_row_exactly_and_renders(tmp_path):
    """benchmarks/async_checkpoint.py: the synchronous and asynchronous saves of FSDP2 and
    groupshard each write a folder that loads exactly, and the table renders."""
    report = run_benchmark("async_checkpoint.py", tmp_path, "--model", "tiny", "--rounds", "1",
                           timeout=240)  # fmt: skip
    assert report["kind"] == "async-checkpoint" and len(report["rows"]) == 5
    for name, row in report["rows"].items():
        assert row["max_difference"] == 0.0, name
        assert 0 < row["blocked_s"] <= row["total_s"], (name, row)
    assert len(rendered_table("async-checkpoint", [report])) == 2 + 5
