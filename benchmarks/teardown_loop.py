"""Run tests/test_teardown.py many times and count the runs that fail (issue 51: it failed
about one clean suite run in four).

    python benchmarks/teardown_loop.py [--runs 50] [--after-suite] [--load] [--json PATH]

Each run is ``python -m pytest tests/test_teardown.py`` in a fresh process. With
``--after-suite`` one pytest session first runs every test file that precedes
test_teardown.py in the suite (so its pooled ranks carry what those tests left), then the
file ``--runs`` times over in the same session (``--keep-duplicates``); a run is one pass
over the file. With ``--load`` another multi-process job runs beside the loop the whole
time: ``benchmarks/stress_exit.py``'s short world-2 torchrun trainings, one after another.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TEARDOWN = "tests/test_teardown.py"
DEADLINE_S = 3600  # --after-suite runs most of the suite, then the file --runs times


def _pytest(*args: str, junit: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--junitxml={junit}", *args]  # fmt: skip
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=DEADLINE_S)


def _cases(junit: Path) -> list[tuple[str, bool, str]]:
    """Each test case of a junit file in order: (file::name, passed, failure text)."""
    cases = []
    for case in ElementTree.parse(junit).iter("testcase"):
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        name = f"{case.get('classname')}::{case.get('name')}"
        cases.append((name, failure is None, "" if failure is None else failure.get("message", "")))
    return cases


def fresh_runs(runs: int, folder: Path) -> list[dict[str, Any]]:
    """``runs`` fresh pytest processes of the teardown tests."""
    results = []
    for index in range(runs):
        junit = folder / f"run-{index}.xml"
        started = time.monotonic()
        _pytest(TEARDOWN, junit=junit)
        failed = [(name, why) for name, ok, why in _cases(junit) if not ok]
        results.append({"run": index, "failed": failed, "seconds": time.monotonic() - started})
        print(f"run {index}: {failed or 'ok'}", flush=True)
    return results


def runs_after_the_suite(runs: int, folder: Path) -> list[dict[str, Any]]:
    """One session: the files before test_teardown.py, then the teardown file ``runs`` times."""
    before = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").glob("test_*.py"))
    before = [path for path in before if path < TEARDOWN]
    junit = folder / "after-suite.xml"
    _pytest("--keep-duplicates", *before, *[TEARDOWN] * runs, junit=junit)
    cases = _cases(junit)
    earlier = [case for case in cases if not case[0].startswith("tests.test_teardown")]
    teardown = [case for case in cases if case[0].startswith("tests.test_teardown")]
    per_run = len(teardown) // runs
    if per_run == 0 or per_run * runs != len(teardown):
        raise RuntimeError(f"{len(teardown)} teardown test results for {runs} runs in {junit}")
    results = []
    for index in range(runs):
        mine = teardown[index * per_run : (index + 1) * per_run]
        failed = [(name, why) for name, ok, why in mine if not ok]
        results.append({"run": index, "failed": failed})
    failed_before = [(name, why) for name, ok, why in earlier if not ok]
    print(f"{len(earlier)} earlier tests, {len(failed_before)} failed", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--after-suite", action="store_true")
    parser.add_argument("--load", action="store_true", help="stress_exit.py's jobs beside")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="groupshard-teardown-"))
    load = None
    if args.load:
        command = [sys.executable, str(ROOT / "benchmarks" / "stress_exit.py"), "--runs", "100000",
                   "--jobs", "1", "--system", "groupshard"]  # fmt: skip
        load = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)  # fmt: skip
    try:
        if args.after_suite:
            results = runs_after_the_suite(args.runs, folder)
        else:
            results = fresh_runs(args.runs, folder)
    finally:
        if load is not None:
            os.killpg(load.pid, 9)
            load.wait()
    failed = sum(bool(result["failed"]) for result in results)
    print(f"{len(results)} runs of {TEARDOWN}, {failed} failed")
    if args.json:
        payload = {"after_suite": args.after_suite, "load": args.load, "runs": len(results),
                   "failed": failed, "results": results}  # fmt: skip
        Path(args.json).write_text(json.dumps(payload, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
