"""Smoke test of benchmarks/trainer.py: every row (Trainer + DDP, + FSDP2, + groupshard,
each with and without LoRA) trains and is timed, and benchmarks/tables.py renders it."""

from __future__ import annotations

from helpers import rendered_table, run_benchmark


def test_trainer_benchmark_runs_every_row_and_renders(tmp_path):
    report = run_benchmark("trainer.py", tmp_path, "--model", "tiny", "--rounds", "1", timeout=300)
    assert report["kind"] == "trainer" and report["rounds"] == 1
    systems = ("ddp", "fsdp2", "groupshard")
    assert set(report["rows"]) == {*systems, *(f"{s} lora" for s in systems)}
    for name, row in report["rows"].items():
        assert row["step_s"] > 0 and row["cpu_s"] > 0, name
        assert all(rank["steps"] == 6 for rank in row["per_round"][0]), name

    lines = rendered_table("trainer", [report])
    assert len(lines) == 2 + len(report["rows"])
