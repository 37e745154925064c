"""benchmarks/README.md's tables are what benchmarks/tables.py makes of the results JSON."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TABLES = BENCHMARKS / "tables.py"


def tables(*args: str) -> subprocess.CompletedProcess[str]:
    """Run benchmarks/tables.py with ``args``."""
    return subprocess.run(
        [sys.executable, str(TABLES), *args], capture_output=True, text=True, timeout=60
    )


def copy_benchmarks(destination: Path) -> Path:
    """benchmarks/README.md and the results JSON, copied into ``destination``."""
    shutil.copy(BENCHMARKS / "README.md", destination / "README.md")
    for path in BENCHMARKS.glob("results-*.json"):
        shutil.copy(path, destination / path.name)
    return destination


def test_readme_tables_match_the_results_json():
    result = tables("--check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_readme_has_tables_for_every_benchmark():
    text = (BENCHMARKS / "README.md").read_text()
    for kind in (
        "main", "ratios", "precision", "overlap", "prefetch", "construction", "muon", "regroup",
        "whole-param", "hybrid-bytes", "hybrid-model",
    ):
        assert f" {kind} -->" in text, kind


def test_a_changed_number_fails_the_check_and_a_rewrite_fixes_it(tmp_path):
    folder = copy_benchmarks(tmp_path)
    results = folder / "results-4m.json"
    report = json.loads(results.read_text())
    report["rows"]["DDP"]["step_ms"] = 999.0  # the README's table says 276
    results.write_text(json.dumps(report))

    check = tables("--check", "--dir", str(folder))
    assert check.returncode == 1
    assert "results-4m.json main" in check.stdout
    assert "| DDP | 999 |" in check.stdout  # the difference is shown

    assert tables("--dir", str(folder)).returncode == 0  # rewrites the tables
    assert "| DDP | 999 |" in (folder / "README.md").read_text()
    assert tables("--check", "--dir", str(folder)).returncode == 0


def test_a_hand_edited_table_fails_the_check(tmp_path):
    folder = copy_benchmarks(tmp_path)
    readme = folder / "README.md"
    text = readme.read_text()
    assert "| groupshard full | 296 |" in text
    readme.write_text(text.replace("| groupshard full | 296 |", "| groupshard full | 290 |", 1))
    check = tables("--check", "--dir", str(folder))
    assert check.returncode == 1
    assert "results-4m.json main" in check.stdout


def test_a_missing_file_or_unknown_kind_is_an_error(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("<!-- table: results-none.json main -->\n<!-- end table -->\n")
    result = tables("--check", "--dir", str(tmp_path))
    assert result.returncode == 2 and "no file" in result.stderr
    readme.write_text("<!-- table: results-4m.json nope -->\n<!-- end table -->\n")
    result = tables("--check", "--dir", str(tmp_path))
    assert result.returncode == 2 and "KIND one of" in result.stderr
