"""The guides' complete scripts run as written: the ```python blocks listed here, under
``torchrun --standalone --nproc-per-node 2`` on CPU, print what the guide shows they print."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import DOCS, guide_script, run_under_torchrun

# guide -> a pattern of the line its script prints (the guide shows that line)
SCRIPTS = {
    ("checkpoints.md", 0): r"loss after 9 steps: FSDP2 -> groupshard -> FSDP2 ([\d.]+), "
    r"FSDP2 alone ([\d.]+)",
    ("integrations.md", 0): r"trained 10 steps, loss ([\d.]+); from_pretrained: (\d+) parameters",
    ("integrations.md", 1): r"LoRA weights (\d+), optimizer elements on this rank (\d+)",
    ("integrations.md", 2): r"32 micro-batches per rank, last loss ([\d.]+)",
    ("lightning.md", 0): r"trained 8 steps, loss ([\d.]+), val_loss ([\d.]+); "
    r"state_dict: 27 tensors",
}
"""(guide, index of its python block) -> a pattern of the line the script prints (the guide
shows that line). Each guide's first block; every block of integrations.md."""


def run_script(text: str, folder: Path) -> str:
    path = folder / "script.py"
    path.write_text(text)
    return run_under_torchrun([str(path)], folder)


def _crossed_equals_alone(crossed: str, alone: str) -> bool:
    """FSDP2 -> groupshard -> FSDP2 through checkpoints ends where FSDP2 alone does."""
    return abs(float(crossed) - float(alone)) <= 1e-5 * max(1.0, abs(float(alone)))


def _state_for_a_shard_of_lora_only(lora: str, on_this_rank: str) -> bool:
    """A rank's optimizer holds about half of the LoRA weights (2 ranks; padding) and
    nothing of the frozen base model."""
    return int(lora) // 2 <= int(on_this_rank) < int(lora) // 2 + 64


# what the printed numbers must show, beside being printed
CHECKS = {
    ("checkpoints.md", 0): _crossed_equals_alone,
    ("integrations.md", 1): _state_for_a_shard_of_lora_only,
}


@pytest.mark.parametrize("guide, index", sorted(SCRIPTS))
def test_the_guides_scripts_run_as_written(tmp_path, guide, index):
    printed = run_script(guide_script(guide, index), tmp_path)
    pattern = SCRIPTS[guide, index]
    found = re.search(pattern, printed)
    assert found is not None, printed
    # the guide shows the line it prints (its digits may differ on another CPU)
    assert re.search(pattern, (DOCS / guide).read_text()) is not None
    if (guide, index) in CHECKS:
        assert CHECKS[guide, index](*found.groups()), found.group(0)
