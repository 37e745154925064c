"""Smoke test of benchmarks/soak.py: a short soak runs, samples every rank, and finds no
growth of descriptors or threads after warm-up (RSS within its bound)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_a_short_soak_stays_flat(tmp_path):
    output = tmp_path / "soak.json"
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "soak.py"), "--steps", "80", "--every", "10",
         "--warmup", "30", "--save-every", "20", "--json", str(output)],
        capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    report = json.loads(output.read_text())
    assert len(report["ranks"]) == 2 and all(len(samples) == 8 for samples in report["ranks"])
    for grown in report["growth"]:
        assert grown["fds"] == 0 and grown["threads"] == 0, grown
        assert grown["rss"] <= report["rss_bound_bytes"], grown


def test_growth_is_measured_from_the_end_of_warmup():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from soak import growth
    finally:
        sys.path.remove(str(BENCHMARKS))
    samples = [
        {"step": 10, "rss": 100, "fds": 9, "threads": 3},
        {"step": 20, "rss": 150, "fds": 10, "threads": 4},
        {"step": 30, "rss": 160, "fds": 11, "threads": 4},
    ]
    assert growth(samples, warmup=20) == {"rss": 10, "fds": 1, "threads": 0}
