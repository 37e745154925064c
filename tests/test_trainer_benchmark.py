"""Smoke tests of benchmarks/trainer.py and lightning_trainer.py: their rows train and are
timed, and benchmarks/tables.py renders them. Of trainer.py three of the six rows, which
between them take every path of the script (plain DDP; FSDP2 and groupshard, each with
LoRA, which builds the model as the rows without it do and adds the adapter): each row
starts two processes."""

from __future__ import annotations

from helpers import rendered_table, run_benchmark

ROWS = ("ddp", "fsdp2 lora", "groupshard lora")
LIGHTNING_ROWS = (
    "ddp", "fsdp2", "groupshard", "fabric-ddp", "fabric-fsdp2", "fabric-groupshard"
)


def test_trainer_benchmark_rows_run_and_render(tmp_path):
    arguments = ("--model", "tiny", "--rounds", "1", "--rows", *ROWS)
    report = run_benchmark("trainer.py", tmp_path, *arguments, timeout=300)
    assert report["kind"] == "trainer" and report["rounds"] == 1
    assert set(report["rows"]) == set(ROWS)
    for name, row in report["rows"].items():
        assert row["step_s"] > 0 and row["cpu_s"] > 0, name
        assert all(rank["steps"] == 6 for rank in row["per_round"][0]), name

    lines = rendered_table("trainer", [report])
    assert len(lines) == 2 + len(report["rows"])


def test_lightning_benchmark_rows_run_and_render(tmp_path):
    """benchmarks/lightning_trainer.py: every row trains (each checks it ran DDP, FSDP2's
    DTensors or an unwrapped sharded module) and renders in the trainer table."""
    arguments = ("--model", "tiny", "--rounds", "1")
    report = run_benchmark("lightning_trainer.py", tmp_path, *arguments, timeout=300)
    assert report["kind"] == "trainer" and set(report["rows"]) == set(LIGHTNING_ROWS)
    for name, row in report["rows"].items():
        assert row["step_s"] > 0 and row["cpu_s"] > 0, name
        assert all(rank["steps"] == 6 for rank in row["per_round"][0]), name
    assert len(rendered_table("trainer", [report])) == 2 + len(LIGHTNING_ROWS)
