"""Run several guide scripts one after another in one torchrun launch (tests/test_docs.py),
each as if launched alone: in its own folder, as ``__main__``, with its own rendezvous port
(its ``init_process_group`` makes a fresh store, as torchrun's would), rank 0's standard
output into ``stdout.txt`` there, and accelerate's process-wide state dropped after it. One
launch instead of one per script: the interpreter, torch and groupshard start once.

Usage: ``torchrun ... guide_runner.py FOLDER...`` with ``GUIDE_PORTS`` a comma-separated
free port per folder; each folder holds ``script.py``.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys


def main(folders: list[str]) -> None:
    ports = os.environ["GUIDE_PORTS"].split(",")
    # the scripts' own stores, on their own ports, not the launcher's (whose keys a second
    # init_process_group would find taken)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    rank = int(os.environ["RANK"])
    start = os.getcwd()
    for folder, port in zip(folders, ports, strict=True):
        os.environ["MASTER_PORT"] = port
        os.chdir(folder)
        try:
            output = "stdout.txt" if rank == 0 else os.devnull
            with open(output, "w") as out, contextlib.redirect_stdout(out):
                runpy.run_path("script.py", run_name="__main__")
        except BaseException:
            print(f"guide_runner: the script in {folder} failed", file=sys.stderr)
            raise
        finally:
            os.chdir(start)
            _forget_process_wide_state()


def _forget_process_wide_state() -> None:
    """What a script leaves for the process, dropped so that the next one starts as in a
    launch of its own: accelerate's state (its ``PartialState`` keeps the process group it
    found, which the script destroyed)."""
    accelerate_state = sys.modules.get("accelerate.state")
    if accelerate_state is not None:
        accelerate_state.AcceleratorState._reset_state(reset_partial_state=True)


if __name__ == "__main__":
    main(sys.argv[1:])
