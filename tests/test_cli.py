"""`groupshard train` through the command, as a person runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import groupshard as gs

TIMEOUT = 300
TINY = ["--model", "tiny", "--batch-size", "4"]


def groupshard(*args, check=True):
    result = subprocess.run(
        [sys.executable, "-m", "groupshard", *args],
        capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def _losses(out):
    with open(os.path.join(out, "log.jsonl")) as log:
        return [json.loads(line)["loss"] for line in log]


def test_train_end_to_end(tmp_path):
    out = str(tmp_path / "run")
    result = groupshard(
        "train", *TINY, "--steps", "40", "--eval-every", "10", "--ckpt-every", "15", "--out", out
    )
    for name in (
        "log.jsonl",
        "log.csv",
        "training.png",
        "summary.json",
        "checkpoint/groupshard.json",
    ):
        assert os.path.exists(os.path.join(out, name)), name
    assert f"outputs in {out}/" in result.stdout
    losses = _losses(out)
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5  # it learns
    with open(os.path.join(out, "log.jsonl")) as log:
        rows = [json.loads(line) for line in log]
    assert sum("val_loss" in row for row in rows) == 4
    assert {"grad_norm/decay", "grad_norm/no_decay"} <= rows[0].keys()
    with open(os.path.join(out, "summary.json")) as handle:
        summary = json.load(handle)
    assert summary["parameters_per_rank"] * 2 <= summary["parameters_total"] + 2 * 1024


@pytest.mark.parametrize(
    "options", [["--zero", "--optimizer", "lamb"], ["--optimizer", "lars", "--strategy", "grad_op"]]
)
def test_other_modes_run(tmp_path, options):
    out = str(tmp_path / "run")
    groupshard("train", *TINY, "--steps", "6", "--out", out, *options)
    assert len(_losses(out)) == 6


def _model_tensors(checkpoint, output):
    gs.checkpoint.to_torch_save(checkpoint, output)
    return torch.load(output, weights_only=True)["model"]


def test_interrupt_then_resume_equals_uninterrupted(tmp_path):
    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    steps = ["--steps", "60", "--eval-every", "20"]
    groupshard("train", *TINY, *steps, "--out", whole)
    process = subprocess.Popen(
        [sys.executable, "-m", "groupshard", "train", *TINY, *steps, "--out", parts],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    log = os.path.join(parts, "log.jsonl")
    deadline = time.time() + TIMEOUT
    while time.time() < deadline and not (os.path.exists(log) and len(_losses(parts)) >= 3):
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in a terminal reaches the whole group
    _, stderr = process.communicate(timeout=TIMEOUT)
    assert process.returncode == 130, stderr[-3000:]
    assert f"continue with --resume --out {parts}" in stderr
    stopped_at = len(_losses(parts))
    assert 3 <= stopped_at < 60
    groupshard("train", *TINY, *steps, "--out", parts, "--resume")
    assert len(_losses(parts)) == 60
    expected = _model_tensors(os.path.join(whole, "checkpoint"), str(tmp_path / "whole.pt"))
    resumed = _model_tensors(os.path.join(parts, "checkpoint"), str(tmp_path / "parts.pt"))
    assert expected.keys() == resumed.keys()
    for name in expected:
        assert torch.equal(expected[name], resumed[name]), name


def test_bad_inputs_give_one_line_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    run = str(tmp_path / "run")
    groupshard("train", *TINY, "--steps", "2", "--out", run)
    cases = {
        "no such file or folder": ["--data", str(tmp_path / "missing")],
        "the data is empty": ["--data", str(empty)],
        "invalid choice: 'adam'": ["--optimizer", "adam"],
        "more than this machine can run sensibly": ["--nproc", "1000"],
        "is from another run (--model tiny, not small)": [
            "--out",
            run,
            "--resume",
            "--model",
            "small",
        ],
        "already holds a run; pass --resume": ["--out", run],
        "--steps must be at least 1": ["--steps", "0"],
    }
    for expected, args in cases.items():
        options = args if "--model" in args else [*TINY, *args]
        result = groupshard("train", *options, check=False)
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], (args, result.stderr)
