"""Per-rank cost that does not grow with the world size: one process plays rank 0 of a
world of 4,096 ranks (torch's ``fake`` backend; tests/scale_case.py) and shards, steps,
regroups and builds Muon and WholeParamOptimizer as at 8 ranks: no objects gathered over
the world, time within 3x world 8's + 1 s, peak RSS within 250 MiB of world 8's
(issue 35's bounds; before, Muon's first step took 10.7 s and the process 8.6 GB)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CASE = Path(__file__).resolve().parent / "scale_case.py"


def simulate(*layout: int) -> dict:
    result = subprocess.run(
        [sys.executable, str(CASE), *map(str, layout)], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def world_8() -> dict:
    return simulate(8)


@pytest.mark.parametrize("layout", [(4096,), (4096, 512)], ids=["1-D 4096", "HSDP 512x8"])
def test_setup_and_first_steps_do_not_grow_with_the_world(world_8, layout):
    large = simulate(*layout)
    assert world_8["gathers"] == 0 and large["gathers"] == 0
    for part, seconds in large["seconds"].items():
        assert seconds <= 3 * world_8["seconds"][part] + 1.0, (part, seconds, world_8)
    assert large["peak_rss"] - world_8["peak_rss"] <= 250 * 2**20, (large, world_8)
