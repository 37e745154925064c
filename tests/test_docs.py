"""The guides' complete scripts run as written: the first ```python block of each guide
listed here, under ``torchrun --standalone --nproc-per-node 2`` on CPU, prints what the
guide shows it prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
# guide -> a pattern of the line its script prints (the guide shows that line)
GUIDES = {
    "checkpoints.md": r"loss after 9 steps: FSDP2 -> groupshard -> FSDP2 ([\d.]+), "
    r"FSDP2 alone ([\d.]+)",
}


def first_script(guide: str) -> str:
    match = BLOCK.search((DOCS / guide).read_text())
    assert match is not None, f"{guide} has no python block"
    return match.group(1)


def run_under_torchrun(script: str, folder: Path) -> str:
    path = folder / "script.py"
    path.write_text(script)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    result = subprocess.run(
        [*command, "2", str(path)], env=env, cwd=folder, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _crossed_equals_alone(crossed: str, alone: str) -> bool:
    """FSDP2 -> groupshard -> FSDP2 through checkpoints ends where FSDP2 alone does."""
    return abs(float(crossed) - float(alone)) <= 1e-5 * max(1.0, abs(float(alone)))


# what the printed numbers must show, beside being printed
CHECKS = {"checkpoints.md": _crossed_equals_alone}


@pytest.mark.parametrize("guide", sorted(GUIDES))
def test_the_guides_first_script_runs_as_written(tmp_path, guide):
    printed = run_under_torchrun(first_script(guide), tmp_path)
    found = re.search(GUIDES[guide], printed)
    assert found is not None, printed
    # the guide shows the line it prints (its digits may differ on another CPU)
    assert re.search(GUIDES[guide], (DOCS / guide).read_text()) is not None
    if guide in CHECKS:
        assert CHECKS[guide](*found.groups()), found.group(0)
