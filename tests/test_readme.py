"""The README's code runs as printed, and its promises about processes hold."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import groupshard as gs

README = Path(__file__).resolve().parents[1] / "README.md"
# Appended to the snippet: each rank saves its final full state dict for the test to compare.
SAVE_STATE = """
import os as _os
torch.save(state, _os.path.join(_os.environ["SNIPPET_OUT"], f"rank{_os.environ['RANK']}.pt"))
"""


def python_block(section: str) -> str:
    """The first ```python block of the README section whose heading is ``section``."""
    text = README.read_text()
    start = text.index(f"\n{section}\n")
    match = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL).search(text, start)
    assert match is not None, f"no python block under {section}"
    return match.group(1)


def test_use_snippet_runs_under_torchrun_and_ranks_agree(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(python_block("## Use") + SAVE_STATE)
    env = {**os.environ, "SNIPPET_OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    result = subprocess.run(
        [*command, "2", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    printed = r"20 steps, final loss \d+\.\d{4}"
    assert re.fullmatch(printed + "\n", result.stdout), result.stdout  # rank 0's line alone
    assert re.search(f"`{printed}`", README.read_text())  # the README shows what it prints
    first, second = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert "0.linear.weight" in first and first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


def _groups() -> list[dict]:
    return gs.decay_groups(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), weight_decay=0.1)


def test_several_processes_without_process_group_are_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it, but no init_process_group
    with pytest.raises(ValueError, match=r"WORLD_SIZE is 2 .*init_process_group"):
        gs.shard(nn.Linear(4, 4), None)
    with pytest.raises(ValueError, match=r"WORLD_SIZE is 2 .*init_process_group"):
        gs.ZeroRedundancyOptimizer(_groups(), torch.optim.AdamW, lr=1e-3)
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process (torchrun --nproc-per-node 1) trains
    model = gs.shard(nn.Linear(4, 4), None)
    model(torch.ones(2, 4)).sum().backward()
    assert len(gs.ZeroRedundancyOptimizer(_groups(), torch.optim.AdamW).param_groups) == 2
