"""`groupshard train` through the command, as a person runs it."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import groupshard as gs
from groupshard.cli import DEFAULT_LRS, report

TIMEOUT = 300
TINY = ["--model", "tiny", "--batch-size", "4"]
STEPS = ["--steps", "60", "--eval-every", "20"]
PROGRESS = re.compile(r"\s*\d+%\|")  # a line of tqdm's progress bar
WARNING = re.compile("groupshard train: warning: ")


def groupshard(*args, check=True):
    result = subprocess.run(
        [sys.executable, "-m", "groupshard", *args],
        capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def _not_standard_json(constant):
    raise ValueError(f"{constant} is not standard JSON")


def _rows(out):
    with open(os.path.join(out, "log.jsonl")) as log:
        return [json.loads(line, parse_constant=_not_standard_json) for line in log]


def _losses(out):
    return [row["loss"] for row in _rows(out)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A finished 60-step run of the tiny model, the reference for resumed runs."""
    out = str(tmp_path_factory.mktemp("cli") / "whole")
    groupshard("train", *TINY, *STEPS, "--out", out)
    return out


def _start(*args):
    return subprocess.Popen(
        [sys.executable, "-m", "groupshard", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def _wait_for_rows(process, out, count):
    """Until ``out``'s log has ``count`` rows (or ``process`` ended)."""
    log, deadline = os.path.join(out, "log.jsonl"), time.time() + TIMEOUT
    while time.time() < deadline and process.poll() is None:
        if os.path.exists(log) and len(_losses(out)) >= count:
            return
        time.sleep(0.05)
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    raise AssertionError(f"no {count} rows in {log}: {process.communicate()[1][-3000:]}")


def _children(pid, marker=b""):
    """The pids of ``pid``'s child processes whose command line holds ``marker``."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == pid and marker in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except (OSError, ValueError, IndexError):
            continue
    return sorted(pids)


def _workers(launcher, marker=None):
    """The pids of the launcher's worker processes: the children of the multiprocessing
    forkserver it started (or, given ``marker``, its own children whose command line holds
    it, as torchrun's are)."""
    if marker is not None:
        return _children(launcher.pid, marker)
    servers = _children(launcher.pid, b"forkserver")
    return sorted(pid for server in servers for pid in _children(server))


def _alive(pid):
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_train_end_to_end(tmp_path):
    """The default run (AdamW, its default --lr) for 100 steps: every output, and it learns
    as test_each_optimizer_learns_in_the_default_run_with_its_own_lr asks of the others."""
    out = str(tmp_path / "run")
    result = groupshard("train", "--steps", "100", "--eval-every", "25", "--ckpt-every", "30",
                        "--out", out)  # fmt: skip
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
    assert len(losses) == 100
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5  # it learns
    with open(os.path.join(out, "log.jsonl")) as log:
        rows = [json.loads(line) for line in log]
    assert sum("val_loss" in row for row in rows) == 4
    assert {"grad_norm/decay", "grad_norm/no_decay"} <= rows[0].keys()
    with open(os.path.join(out, "summary.json")) as handle:
        summary = json.load(handle)
    _assert_learned(summary, "adamw")
    assert summary["parameters_per_rank"] * 2 <= summary["parameters_total"] + 2 * 1024
    printed = result.stdout.splitlines()  # the per-group table, and the sample
    for group in summary["groups"]:
        row = next(line.split() for line in printed if line.startswith(group["group"] + " "))
        assert row[1:3] == [str(group["tensors"]), f"{group['elements']:,}"], row
    assert "    " + report.printable(summary["sample"]["text"].split("\n")[0]) in printed


@pytest.mark.parametrize(
    "options",
    [
        ["--optimizer", "sgd"],
        ["--zero", "--optimizer", "lamb"],
        ["--optimizer", "lars", "--strategy", "grad_op"],
        ["--optimizer", "muon"],
        ["--optimizer", "adafactor"],
    ],
    ids=["sgd", "lamb-zero", "lars-grad_op", "muon", "adafactor"],
)
def test_each_optimizer_learns_in_the_default_run_with_its_own_lr(tmp_path, options):
    """The default model and batch, 100 steps, no --lr: with its own default, each optimizer
    closes at least two thirds of the gap between guessing bytes uniformly and the
    byte-bigram table (with AdamW's 3e-3, Adafactor, LAMB, LARS and SGD stayed within the
    first third; AdamW itself needs more than 200 steps to pass the bigram table). AdamW
    is test_train_end_to_end's run."""
    out = str(tmp_path / "run")
    groupshard("train", "--steps", "100", "--eval-every", "100", "--out", out, *options)
    with open(os.path.join(out, "summary.json")) as handle:
        summary = json.load(handle)
    _assert_learned(summary, options[options.index("--optimizer") + 1])
    if "muon" in options:  # the AdamW group: embeddings, biases and norms, without decay
        assert [(g["group"], g["weight_decay"]) for g in summary["groups"]] == [
            ("muon", 0.1), ("adamw", 0.0)
        ]


def _assert_learned(summary: dict, optimizer: str) -> None:
    """The run used ``optimizer``'s default --lr and closed two thirds of the gap between
    guessing uniformly and the byte-bigram table (benchmarks/README.md has the sweep)."""
    assert summary["config"]["lr"] == DEFAULT_LRS[optimizer]
    uniform, bigram = summary["baselines"]["uniform"], summary["baselines"]["bigram"]
    assert summary["val_loss"] < bigram + (uniform - bigram) / 3, summary["val_loss"]


def test_muon_decays_only_the_hidden_matrices():
    from groupshard.cli.config import PRESETS
    from groupshard.cli.model import GPT
    from groupshard.cli.train import optimizer_groups

    model = GPT(PRESETS["tiny"])
    groups, names = optimizer_groups("muon", model, weight_decay=0.1)
    name_of = {id(p): n for n, p in model.named_parameters()}
    decayed = {name_of[id(p)] for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    kept = {name_of[id(p)] for g in groups if g["weight_decay"] == 0 for p in g["params"]}
    assert names == ["muon", "adamw"] and decayed and kept
    assert all(model.get_parameter(n).ndim == 2 and n.startswith("blocks.") for n in decayed)
    assert {"wte.weight", "wpe.weight"} <= kept
    assert any(n.endswith(".bias") for n in kept) and any(".ln_" in n for n in kept)


def _model_tensors(checkpoint, output):
    gs.checkpoint.to_torch_save(checkpoint, output)
    return torch.load(output, weights_only=True)["model"]


_BY_COMMAND = ("the data is empty",)  # of each table of cases, one runs the command itself


def _assert_one_line_error(capsys, expected, options, by_command):
    """``groupshard train *options`` exits 2 with one line on stderr holding ``expected``.
    The checks run in the launcher before any worker starts, so, but for the case that runs
    the command as a person does (``by_command``), they run in this process: the same
    ``main()``, without a second of starting Python and torch per case."""
    if by_command:
        result = groupshard("train", *options, check=False)
        status, stderr = result.returncode, result.stderr
    else:
        from groupshard.cli.main import main

        try:
            status = main(["train", *options])
        except SystemExit as exit:  # argparse's errors
            status = exit.code
        stderr = capsys.readouterr().err
    assert status == 2, (options, stderr[-3000:])
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], (options, stderr[-3000:])


def test_bad_inputs_give_one_line_errors(tmp_path, uninterrupted, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    run = uninterrupted
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
        "--timeout must be a positive number of seconds, got 0.0": ["--timeout", "0"],
        "--tp 3 must divide the world size (2 processes)": ["--tp", "3"],
        "--tp 3 must divide --model tiny's heads (4), MLP width (256) and vocabulary (256)": [
            "--tp", "3", "--nproc", "3"
        ],
        "--tp 2 does not work with --zero": ["--tp", "2", "--zero"],
        "--async-checkpoint needs groupshard's sharding": ["--async-checkpoint", "--zero"],
    }
    for expected, args in cases.items():
        options = args if "--model" in args else [*TINY, *args]
        _assert_one_line_error(capsys, expected, options, by_command=expected in _BY_COMMAND)


def _lines(stderr):
    """The lines of ``stderr`` but the progress bar's (text mode reads its \\r as a newline)
    and a warning (of more processes than cores, on a machine with one core)."""
    lines = stderr.strip().splitlines()
    return [line for line in lines if not PROGRESS.match(line) and not WARNING.match(line)]


def test_nonfinite_loss_stops_at_once_and_keeps_the_last_good_checkpoint(tmp_path):
    out = str(tmp_path / "run")
    result = groupshard(
        "train", *TINY, "--optimizer", "sgd", "--lr", "1e6", "--clip", "0", "--steps", "12",
        "--ckpt-every", "1", "--eval-every", "50", "--out", out, check=False,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    rows = _rows(out)  # standard JSON: the non-finite loss is written as null
    failed, kept = rows[-1]["step"], rows[-1]["step"] - 1
    assert rows[-1]["loss"] is None and all(math.isfinite(r["loss"]) for r in rows[:-1])
    assert [r["step"] for r in rows] == list(range(1, failed + 1)) and failed < 12
    loss = re.search(r"error: loss is (\S+) at step", _lines(result.stderr)[-1]).group(1)
    assert not math.isfinite(float(loss))
    with open(os.path.join(out, "summary.json")) as handle:
        json.loads(handle.read(), parse_constant=_not_standard_json)
    assert _lines(result.stderr)[-1] == (
        f"groupshard train: error: loss is {loss} at step {failed} "
        f"(lr {rows[-1]['lr']:g}); the last good checkpoint (step {kept}) is kept in "
        f"{out}/checkpoint"
    )
    assert gs.checkpoint.read_extra(os.path.join(out, "checkpoint"))["step"] == kept
    saved = _model_tensors(os.path.join(out, "checkpoint"), str(tmp_path / "saved.pt"))
    assert all(torch.isfinite(tensor).all() for tensor in saved.values())


def test_corrupt_checkpoint_on_resume_names_file_and_cause(tmp_path, uninterrupted):
    out = str(tmp_path / "run")
    shutil.copytree(uninterrupted, out)
    damaged = sorted(Path(out, "checkpoint").glob("*.distcp"))[0]
    damaged.write_bytes(bytes(damaged.stat().st_size))  # same size, no longer a checkpoint
    result = groupshard("train", *TINY, "--steps", "61", "--out", out, "--resume", check=False)
    assert result.returncode != 0
    assert len(_lines(result.stderr)) < 15, result.stderr[-3000:]
    last = _lines(result.stderr)[-1]
    assert last.startswith("groupshard train: error:") and str(damaged) in last, last
    assert "Error" in last and "To enable traceback" not in last, last
    assert os.path.exists(os.path.join(out, "launcher.log"))


def test_hung_worker_fails_the_run_after_timeout(tmp_path):
    out, timeout = str(tmp_path / "run"), 5  # seconds: the run is past its start-up by then
    process = _start("train", *TINY, "--steps", "1000", "--timeout", str(timeout), "--out", out)
    _wait_for_rows(process, out, 3)
    stopped, *others = _workers(process)[::-1]
    os.kill(stopped, signal.SIGSTOP)  # alive, but it never answers the other rank
    hung = time.time()
    while any(_alive(pid) for pid in others) and time.time() < hung + TIMEOUT:
        time.sleep(0.1)
    waited = time.time() - hung
    os.kill(stopped, signal.SIGCONT)  # lets it take the launcher's SIGTERM
    _, stderr = process.communicate(timeout=TIMEOUT)
    assert timeout / 2 < waited < timeout + 15, (waited, stderr[-3000:])  # not at once
    assert process.returncode == 1, stderr[-3000:]
    last = _lines(stderr)[-1]
    assert "error: worker" in last and "timed out" in last.lower(), last


def test_help_and_argument_errors_answer_without_importing_torch():
    cases = {
        "(default: 1500)": ["--help"],
        "argument --lr: must be a finite number, got 'inf'": ["--lr", "inf"],
        "argument --lr: must be a finite number, got 'nan'": ["--lr", "nan"],
        "argument --clip: must be a finite number, got '-inf'": ["--clip=-inf"],
        "argument --timeout: expected a number, got 'soon'": ["--timeout", "soon"],
        "--weight-decay must be 0 or more, got -0.1": ["--weight-decay=-0.1"],
        "--steps must be at least 1": ["--steps", "0"],
        "--grad-accum must be at least 1, got 0": ["--grad-accum", "0"],
        "argument --grad-accum: invalid int value: '1.5'": ["--grad-accum", "1.5"],
        "--precision bf16 needs groupshard's sharding": ["--zero", "--precision", "bf16"],
        "--precision fp16 needs groupshard's sharding": ["--zero", "--precision", "fp16"],
        "--loss-scale needs --precision fp16, got --precision fp32": ["--loss-scale", "8"],
        "--loss-scale must be positive, got -1.0": ["--precision", "fp16", "--loss-scale=-1"],
        "--init meta needs groupshard's sharding": ["--zero", "--init", "meta"],
        "--replicate 3 must divide the world size (2 processes)": ["--replicate", "3"],
        "--replicate and --hsdp need groupshard's sharding": ["--zero", "--replicate", "2"],
    }
    for expected, args in cases.items():
        started = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "groupshard", "train", *args],
            capture_output=True, text=True, timeout=TIMEOUT,
        )  # fmt: skip
        elapsed = time.perf_counter() - started
        imports = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
        modules = {line.rsplit("|", 1)[1].strip() for line in imports}
        assert "groupshard.cli.main" in modules and "torch" not in modules, args
        assert elapsed < 3, (args, elapsed)  # importing torch alone takes seconds
        if args == ["--help"]:
            assert result.returncode == 0 and expected in result.stdout, result.stdout
            continue
        errors = [line for line in result.stderr.splitlines() if line not in imports]
        assert result.returncode == 2, (args, result.stderr[-3000:])
        assert len(errors) == 1 and expected in errors[0], (args, errors)


def test_help_shows_every_default():
    from groupshard.cli import MODEL_SIZES
    from groupshard.cli.config import PRESETS

    assert set(MODEL_SIZES) == set(PRESETS)  # the parser's choices, named without torch
    text = groupshard("train", "--help").stdout
    options = re.split(r"\n  (?=--)", text.split("options:", 1)[1])[1:]
    without = {"--help", "--zero", "--hsdp", "--resume", "--async-checkpoint", "--out"}  # flags
    assert {option.split()[0] for option in options} >= {"--steps", "--lr", "--timeout"}
    for option in options:
        if option.split()[0] not in without:
            assert re.search(r"default:? ", " ".join(option.split())), option


def test_ctrl_c_during_start_up_claims_no_checkpoint_and_resume_says_so(tmp_path):
    """Ctrl-C while the command checks its options and data (the server the workers will fork
    from has just started): no worker is started; while the launcher waits for that server
    to import torch and the training loop: the workers start and stop at once. Either way
    one line, exit 130, no checkpoint, and --resume says there is nothing to resume."""
    out = str(tmp_path / "run")
    launcher_log = Path(out, "launcher.log")
    moments = (
        lambda process: _children(process.pid, b"forkserver"),  # checking
        lambda process: launcher_log.exists(),  # launching: torch's launcher logs there
    )
    for reached in moments:
        launcher_log.unlink(missing_ok=True)  # not the last start's
        process = _start("train", *TINY, "--out", out)
        deadline = time.time() + TIMEOUT
        while not reached(process) and process.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        os.killpg(process.pid, signal.SIGINT)
        interrupted = time.time()
        _, stderr = process.communicate(timeout=TIMEOUT)
        assert time.time() - interrupted < 30, stderr[-3000:]
        assert process.returncode == 130, stderr[-3000:]
        assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
        assert _lines(stderr) == [
            "groupshard train: interrupted; no checkpoint was saved, so there is nothing to resume"
        ]
        assert not os.path.exists(os.path.join(out, "checkpoint"))
    result = groupshard("train", *TINY, "--out", out, "--resume", check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"groupshard train: error: --resume: no checkpoint in {out}, so nothing to resume (the "
        "run stopped before saving one); start it again without --resume"
    ]


def test_bad_out_folders_give_one_line_errors_before_any_worker_starts(
    tmp_path, uninterrupted, capsys
):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    cases = {
        f"--out {a_file} is a file, not a folder": ["--out", str(a_file)],
        f"--out {a_file}/run is under {a_file}, a file, not a folder": ["--out", f"{a_file}/run"],
        f"--resume: the run in {uninterrupted} is at step 60 already; pass a --steps above 60": [
            "--out", uninterrupted, "--resume", "--steps", "60",
        ],
    }  # fmt: skip
    try:  # root may write almost anywhere, but not into sysfs
        os.mkdir("/sys/groupshard-probe")
        os.rmdir("/sys/groupshard-probe")
    except OSError:
        cases["--out /sys/groupshard/run is not writable (/sys: Permission denied)"] = [
            "--out", "/sys/groupshard/run",
        ]  # fmt: skip
    for expected, args in cases.items():
        by_command = expected.startswith("--resume:")
        _assert_one_line_error(capsys, expected, [*TINY, *args], by_command=by_command)
    assert not os.path.exists(f"{a_file}/run")


def test_resume_with_more_steps_continues_the_lr_schedule_then_holds_its_last_lr(
    tmp_path, uninterrupted
):
    out = str(tmp_path / "run")
    shutil.copytree(uninterrupted, out)
    groupshard("train", *TINY, *STEPS, "--out", out, "--resume", "--steps", "120")
    rows = _rows(out)
    assert [row["step"] for row in rows] == list(range(1, 121))
    lrs = [row["lr"] for row in rows]
    assert lrs[:60] == [row["lr"] for row in _rows(uninterrupted)]
    with open(os.path.join(uninterrupted, "summary.json")) as handle:
        final = json.load(handle)["config"]["lr"] * 0.1  # the cosine's end: a tenth of --lr
    assert lrs[59] == pytest.approx(final, rel=0.01)  # step 60: the end of the first schedule
    assert lrs[60:] == pytest.approx([final] * 60, rel=1e-9)  # no jump, held


def test_summary_has_baselines_groups_and_a_sample_from_the_validation_text(uninterrupted):
    from groupshard.cli import data as corpus
    from groupshard.cli.config import PRESETS
    from groupshard.cli.model import GPT

    with open(os.path.join(uninterrupted, "summary.json")) as handle:
        summary = json.load(handle)
    rows = _rows(uninterrupted)
    train, validation = corpus.split(corpus.load_corpus(None))
    assert summary["baselines"] == pytest.approx(
        {"uniform": math.log(256), "bigram": corpus.bigram_loss(train, validation)}
    )
    assert summary["val_loss"] == [r["val_loss"] for r in rows if "val_loss" in r][-1]
    assert [g["group"] for g in summary["groups"]] == ["decay", "no_decay"]
    assert sum(g["elements"] for g in summary["groups"]) == summary["parameters_total"]
    tensors = len(list(GPT(PRESETS["tiny"]).parameters()))  # the tied embedding once
    assert sum(g["tensors"] for g in summary["groups"]) == tensors
    assert [g["weight_decay"] for g in summary["groups"]] == [0.1, 0.0]
    for group in summary["groups"]:
        assert group["lr"] == rows[-1][f"lr/{group['group']}"] == rows[-1]["lr"]
        assert group["grad_norm"] == rows[-1][f"grad_norm/{group['group']}"]
        assert group["weight_norm"] > 0
    text = Path(uninterrupted, "sample.txt").read_bytes()
    written = summary["sample"]
    assert text.decode() == written["text"]
    assert len(text) >= written["prompt_bytes"] + written["new_bytes"]  # U+FFFD is 3 bytes
    prompt = text[: written["prompt_bytes"]]
    assert prompt.startswith(b"def ") and prompt in bytes(validation.tolist())


def test_bf16_with_grad_accum_trains_records_both_and_resumes_only_alike(tmp_path):
    from groupshard.cli import data as corpus
    from groupshard.cli.config import PRESETS
    from groupshard.cli.model import GPT

    out = str(tmp_path / "run")
    options = ["--precision", "bf16", "--grad-accum", "2", "--init", "full"]  # eager: as below
    groupshard("train", *TINY, "--steps", "6", "--eval-every", "3", *options, "--out", out)
    rows = _rows(out)
    assert [(r["precision"], r["grad_accum"]) for r in rows] == [("bf16", 2)] * 6
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5  # it learns
    with open(os.path.join(out, "summary.json")) as handle:
        summary = json.load(handle)
    assert (summary["config"]["precision"], summary["config"]["grad_accum"]) == ("bf16", 2)
    assert math.isfinite(summary["val_loss"])
    # step 1 (before any update): the loss is the mean over 2 ranks x 2 micro-batches, the
    # gradient that of their mean (all four summed, each / 2, reduced once), as in fp32
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    train = corpus.split(corpus.load_corpus(None))[0]
    batches = [corpus.batch(train, 64, 4, 0, micro, rank) for rank in (0, 1) for micro in (0, 1)]
    loss = torch.stack([model(*batch) for batch in batches]).mean()
    loss.backward()
    assert rows[0]["loss"] == pytest.approx(loss.item(), rel=1e-3)
    for name, group in zip(["decay", "no_decay"], gs.decay_groups(model, 0.1), strict=True):
        norm = math.sqrt(sum(float(p.grad.norm()) ** 2 for p in group["params"]))
        assert rows[0][f"grad_norm/{name}"] == pytest.approx(norm, rel=1e-2), name
    # --precision goes the same way (both are in TrainConfig.identity())
    resumed = ["--precision", "bf16", "--grad-accum", "1", "--steps", "8", "--resume"]
    result = groupshard("train", *TINY, *resumed, "--out", out, check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"groupshard train: error: --resume: the checkpoint in {out} is from another run "
        "(--grad-accum 2, not 1)"
    ]


def test_fp16_skips_overflowing_steps_and_resumes_bit_identically(tmp_path):
    """--precision fp16 (and 2 micro-batches) from a loss scale of 2**18, which the tiny
    model's first gradients overflow: such steps are skipped on both ranks and the scale
    halved. A run resumed at step 6 from a copy of a run stopped at step 4 ends as the
    one resumed only at step 4 (the same LR schedule, fixed by the first --steps 4): the
    same rows and weights, so the scaler's state was saved and restored with them."""
    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    options = [*TINY, "--precision", "fp16", "--grad-accum", "2", "--eval-every", "2"]
    groupshard("train", *options, "--loss-scale", str(2**18), "--steps", "4", "--out", whole)
    shutil.copytree(whole, parts)
    groupshard("train", *options, "--steps", "8", "--resume", "--out", whole)
    for steps in ("6", "8"):
        groupshard("train", *options, "--steps", steps, "--resume", "--out", parts)
    rows = _rows(whole)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["precision"] for r in rows] == ["fp16"] * 8
    assert rows[0]["loss_scale"] == 2**18 and rows[0]["grad_norm/decay"] is None  # skipped
    for previous, row in itertools.pairwise(rows):  # halved after an overflow (null norms)
        overflowed = previous["grad_norm/decay"] is None
        assert row["loss_scale"] == previous["loss_scale"] / (2 if overflowed else 1), rows
    assert rows[-1]["loss_scale"] < 2**18
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3  # it learns from the steps it took
    extra = gs.checkpoint.read_extra(os.path.join(whole, "checkpoint"))
    last = rows[-1]["loss_scale"] / (2 if rows[-1]["grad_norm/decay"] is None else 1)
    assert extra["scaler"]["scale"] == last
    timing = {"tokens_per_s"}
    assert [{k: v for k, v in r.items() if k not in timing} for r in _rows(parts)] == [
        {k: v for k, v in r.items() if k not in timing} for r in rows
    ]
    expected = _model_tensors(os.path.join(whole, "checkpoint"), str(tmp_path / "whole.pt"))
    resumed = _model_tensors(os.path.join(parts, "checkpoint"), str(tmp_path / "parts.pt"))
    assert expected.keys() == resumed.keys()
    for name in expected:
        assert torch.equal(expected[name], resumed[name]), name


def _timeless(rows):
    return [{key: value for key, value in row.items() if key != "tokens_per_s"} for row in rows]


def _assert_same_run(out, whole, tmp_path):
    """``out``'s log rows (but their timing) and final weights are ``whole``'s, bit for bit."""
    assert _timeless(_rows(out)) == _timeless(_rows(whole))
    weights = _model_tensors(os.path.join(out, "checkpoint"), str(tmp_path / "out.pt"))
    reference = _model_tensors(os.path.join(whole, "checkpoint"), str(tmp_path / "whole.pt"))
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[name], reference[name]) for name in weights)


def _stop_by_signals(out, uninterrupted):
    """Ctrl-C (SIGINT to the command's process group, as a terminal sends it), then, resumed,
    SIGTERM to the group and again to the command 0.2 s later, as `timeout` sends it (SLURM
    and Kubernetes alike): each is one request to stop, so the run saves within seconds
    (torch's launcher waited 30 s), says where in one line and exits 130 / 143 (the second
    signal used to kill the workers unsaved); its rows so far are the uninterrupted run's.
    The stopped runs write a checkpoint every 2 steps in the background (--async-checkpoint),
    so a stop finds a write in flight: it completes, then the stop's own checkpoint is
    written."""
    stops = ((signal.SIGINT, [], False), (signal.SIGTERM, ["--resume"], True))
    in_background = ["--async-checkpoint", "--ckpt-every", "2"]
    for signum, resume, repeated in stops:
        before = len(_rows(out)) if resume else 0
        process = _start("train", *TINY, *STEPS, "--out", out, *resume, *in_background)
        _wait_for_rows(process, out, before + 3)
        os.killpg(process.pid, signum)
        if repeated:
            time.sleep(0.2)
            os.kill(process.pid, signum)
        stopped = time.time()
        _, stderr = process.communicate(timeout=TIMEOUT)
        assert time.time() - stopped < 15, stderr[-3000:]
        assert process.returncode == 128 + signum, stderr[-3000:]
        saved = gs.checkpoint.read_extra(os.path.join(out, "checkpoint"))["step"]
        assert before + 3 <= saved == len(_rows(out)) < 60
        by = " by SIGTERM" if signum == signal.SIGTERM else ""
        assert _lines(stderr) == [
            f"groupshard train: interrupted{by} at step {saved}; checkpoint in {out}/checkpoint; "
            f"continue with --resume --out {out}"
        ]
    assert _timeless(_rows(out)) == _timeless(_rows(uninterrupted)[:saved])


def _kill_a_worker(out):
    """The run resumed, one worker SIGKILLed after a checkpoint: the run fails within seconds
    (exit 1, one line naming the worker, the signal and the launcher's log), and the rows it
    logged past the checkpoint stay, for the resumed run to log again, once."""
    before = len(_rows(out))
    process = _start("train", *TINY, *STEPS, "--ckpt-every", "10", "--out", out, "--resume")
    _wait_for_rows(process, out, (before // 10 + 1) * 10 + 3)  # its checkpoint is complete
    os.kill(_workers(process)[-1], signal.SIGKILL)
    killed = time.time()
    _, stderr = process.communicate(timeout=TIMEOUT)
    assert time.time() - killed < 30, stderr[-3000:]
    assert process.returncode == 1, stderr[-3000:]
    assert len(_lines(stderr)) < 5, stderr[-3000:]
    last = _lines(stderr)[-1]
    assert "error: worker" in last and "Signal 9 (SIGKILL)" in last, last
    assert f"{out}/launcher.log" in last
    assert len(_rows(out)) > gs.checkpoint.read_extra(os.path.join(out, "checkpoint"))["step"]


def test_tensor_parallel_resumes_across_the_split_and_trains_as_tp_1(tmp_path, uninterrupted):
    """A run on 2 processes stopped (SIGTERM) and resumed with --tp 2 on 4 (dp 2 x tp 2: the
    same global batch): its checkpoint crosses the split, the TP run trains, samples and
    saves as the uninterrupted run to float precision (TP reorders sums), rows and weights.
    Stopped and resumed once more at --tp 2, it ends as the TP run that was not, bit for bit."""
    out = str(tmp_path / "run")
    process = _start("train", *TINY, *STEPS, "--out", out)
    _wait_for_rows(process, out, 10)
    os.killpg(process.pid, signal.SIGTERM)
    _, stderr = process.communicate(timeout=TIMEOUT)
    assert process.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    saved = len(_rows(out))
    parts = str(tmp_path / "parts")
    shutil.copytree(out, parts)
    tp = ["--resume", "--nproc", "4", "--tp", "2"]
    groupshard("train", *TINY, *STEPS, "--out", out, *tp)
    # stopped and resumed again at the same split: the same run as the one above, bit for bit
    process = _start("train", *TINY, *STEPS, "--out", parts, *tp)
    _wait_for_rows(process, parts, 30)
    os.killpg(process.pid, signal.SIGTERM)
    _, stderr = process.communicate(timeout=TIMEOUT)
    assert process.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    groupshard("train", *TINY, *STEPS, "--out", parts, *tp)
    _assert_same_run(parts, out, tmp_path)
    rows, whole = _rows(out), _rows(uninterrupted)
    assert [row["step"] for row in rows] == list(range(1, 61))
    assert _timeless(rows[:saved]) == _timeless(whole[:saved])  # before the stop: itself
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(rows, whole, strict=True)) < 1e-4
    weights = _model_tensors(os.path.join(out, "checkpoint"), str(tmp_path / "tp.pt"))
    reference = _model_tensors(os.path.join(uninterrupted, "checkpoint"), str(tmp_path / "1.pt"))
    assert weights.keys() == reference.keys()
    assert max((weights[n] - reference[n]).abs().max().item() for n in weights) < 1e-4
    with open(os.path.join(out, "summary.json")) as handle:
        summary = json.load(handle)
    assert summary["sample"]["new_bytes"] > 0, summary
    # attention split by heads as the MLP and the embedding are: a rank holds a quarter of
    # each split tensor (dp 2 x tp 2) and half of each replicated one, plus padding
    from groupshard.cli.config import PRESETS
    from groupshard.cli.model import GPT

    split = re.compile(r"wte\.|attn\.qkv\.|attn\.proj\.weight|\.fc\.|\.out\.weight")
    held = sum(
        p.numel() / (4 if split.search(name) else 2)
        for name, p in GPT(PRESETS["tiny"]).named_parameters()
    )
    assert held <= summary["parameters_per_rank"] < held + 64, (held, summary)


def test_a_resumed_run_keeps_the_attention_layout_of_its_checkpoint(tmp_path, uninterrupted):
    """New runs lay the fused attention projection out head by head (so that --tp splits it);
    a checkpoint that does not record the layout was written with the earlier one (all
    queries, then keys, then values), and its run resumes in it rather than misreading it."""
    from groupshard.cli.main import _check, _parser

    out = tmp_path / "earlier"
    shutil.copytree(uninterrupted, out)
    meta_file = out / "checkpoint" / "groupshard.json"
    meta = json.loads(meta_file.read_text())
    assert ["qkv_by_head", True] in meta["extra"]["config"]["__dict__"]
    meta["extra"]["config"]["__dict__"].remove(["qkv_by_head", True])
    meta_file.write_text(json.dumps(meta))
    resume = ["train", *TINY, "--steps", "70", "--resume"]
    earlier = _check(_parser().parse_args([*resume, "--out", str(out)]))
    assert not earlier.qkv_by_head and not earlier.model_config().qkv_by_head
    today = _check(_parser().parse_args([*resume, "--out", uninterrupted]))
    assert today.qkv_by_head and today.model_config().qkv_by_head


def test_stop_requests_take_a_repeat_within_a_second_as_the_same_one(monkeypatch):
    from groupshard.cli.main import _StopRequests

    stop, clock, kills = _StopRequests(), iter([100.0, 100.5, 102.0]), []
    monkeypatch.setattr(stop, "_clock", lambda: next(clock))
    monkeypatch.setattr(stop, "_kill_workers", lambda: kills.append(stop.signum))
    stop._handle(signal.SIGTERM, None)  # to the group
    stop._handle(signal.SIGTERM, None)  # to the command, 0.5 s later: the same request
    assert stop.event.is_set() and not stop.forced and kills == []
    stop._handle(signal.SIGINT, None)  # 2 s after the first: Ctrl-C again, kill now
    assert stop.forced and kills == [signal.SIGTERM]


@contextlib.contextmanager
def _small_tmpfs(folder, size):
    """A tmpfs of ``size`` mounted on ``folder`` (skips the test where mounting is refused)."""
    folder.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
        capture_output=True, text=True,
    )  # fmt: skip
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (it takes root): {mount.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def test_a_full_disk_says_so_and_resume_continues_from_the_intact_checkpoint(
    tmp_path, uninterrupted
):
    """On a 2.5 MB tmpfs the checkpoint of step 10 (1.7 MB) fits, that of step 20 not: the
    run stops, exits 1 with one line (not torch's "unexpected pos"), the checkpoint of step
    10 intact; once there is room, --resume ends as the uninterrupted run."""
    disk = tmp_path / "disk"
    with _small_tmpfs(disk, "2500k"):
        out = str(disk / "run")
        options = [*TINY, *STEPS, "--ckpt-every", "10", "--out", out]
        result = groupshard("train", *options, check=False)
        assert result.returncode == 1, result.stderr[-3000:]
        last = _lines(result.stderr)[-1]
        found = re.fullmatch(
            f"groupshard train: error: no space left on device in {out} for the checkpoint of "
            r"step 20 \(it needs about ([\d,]+) bytes, ([\d,]+) are free\); the last good "
            f"checkpoint \\(step 10\\) is kept in {out}/checkpoint; make room, then continue "
            f"with --resume --out {out}",
            last,
        )
        assert found, last
        needed, free = (int(number.replace(",", "")) for number in found.groups())
        assert needed > 1_500_000 > free > 0, (needed, free)
        assert gs.checkpoint.read_extra(os.path.join(out, "checkpoint"))["step"] == 10
        assert sorted(name for name in os.listdir(out) if "checkpoint" in name) == ["checkpoint"]
        subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True)
        groupshard("train", *options, "--resume")
        _assert_same_run(out, uninterrupted, tmp_path)


def test_torchrun_restarts_continue_from_the_newest_checkpoint(tmp_path, uninterrupted):
    """Under torchrun --max-restarts 1, a worker SIGKILLed after the checkpoint of step 10:
    torchrun restarts both, they resume from step 10 by themselves (no --resume) and the run
    ends as the uninterrupted one."""
    out = str(tmp_path / "run")
    torchrun = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "1", "-m", "groupshard", "train", *TINY, *STEPS, "--ckpt-every",
         "10", "--out", out],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    _wait_for_rows(torchrun, out, 13)
    os.kill(_workers(torchrun, marker=b"groupshard")[-1], signal.SIGKILL)
    _, stderr = torchrun.communicate(timeout=TIMEOUT)
    assert torchrun.returncode == 0, stderr[-3000:]
    with open(os.path.join(out, "summary.json")) as handle:
        assert json.load(handle)["start_step"] == 10  # resumed, not started again
    _assert_same_run(out, uninterrupted, tmp_path)


def _group(pgid):
    """The states (R, S, T, ...) of the processes in process group ``pgid``."""
    states = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                states.append(fields[0])
    return states


def _inside_a_save(out):
    """The temporary folders of a save under way: data files written, no description yet."""
    return [
        folder
        for folder in Path(out).glob("checkpoint.tmp-*")
        if any(folder.glob("*.distcp")) and not (folder / gs.checkpoint.META_FILE).exists()
    ]


def _kill_inside_a_save(process, out):
    """SIGKILL ``process``'s group while a save is under way: seen from outside, the group
    frozen (SIGSTOP) and the save found still unfinished, else let go until the next one."""
    deadline = time.time() + TIMEOUT
    while process.poll() is None and time.time() < deadline:
        if _inside_a_save(out):
            os.killpg(process.pid, signal.SIGSTOP)
            frozen = time.time() + 10
            while any(state not in "TZ" for state in _group(process.pid)) and time.time() < frozen:
                time.sleep(0.001)
            if _inside_a_save(out):  # frozen inside it
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate(timeout=TIMEOUT)
                return
            os.killpg(process.pid, signal.SIGCONT)
        time.sleep(0.001)
    raise AssertionError(f"no save caught under way: {process.communicate()[1][-3000:]}")


def _saved_step(out):
    """The step of ``out``'s newest complete checkpoint; None if there is none (or it is
    being swapped in just now)."""
    with contextlib.suppress(OSError, ValueError):
        return gs.checkpoint.read_extra(os.path.join(out, "checkpoint"))["step"]
    return None


def _kill_anywhere(out):
    """The run resumed, then SIGKILL to the command's whole process group inside a save (one
    written in the background, --async-checkpoint, while training goes on), while a resumed
    run starts, and between two checkpoints; resumed after each."""
    options = [*TINY, *STEPS, "--ckpt-every", "5", "--out", out, "--resume"]
    before = _saved_step(out)
    process = _start("train", *options, "--async-checkpoint")
    # a checkpoint of this run, written in the background, complete (the leftovers of
    # earlier kills are deleted with it): kill inside a later one
    deadline = time.time() + TIMEOUT
    while _saved_step(out) == before and process.poll() is None and time.time() < deadline:
        time.sleep(0.001)
    _kill_inside_a_save(process, out)
    assert len(_inside_a_save(out)) == 1  # the unfinished save's folder, left behind
    process = _start("train", *options)
    while len(_workers(process)) < 2 and process.poll() is None:  # they import, then load
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate(timeout=TIMEOUT)
    saved = gs.checkpoint.read_extra(os.path.join(out, "checkpoint"))["step"]
    process = _start("train", *options)
    _wait_for_rows(process, out, saved + 7)  # past the next checkpoint, before another
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate(timeout=TIMEOUT)


def test_stopped_and_killed_every_way_then_resumed_ends_as_the_uninterrupted_run(
    tmp_path, uninterrupted
):
    """One run stopped and killed every way a run ends early, one after the other, and
    resumed (--resume) after each: asked to stop by signals (``_stop_by_signals``), a worker
    killed (``_kill_a_worker``), the whole command killed anywhere (``_kill_anywhere``). It
    ends with the uninterrupted run's rows, each step logged once, and weights, bit for bit,
    and one checkpoint folder. (One run through all of them: a finished run after each way
    took a launch more each.)"""
    out = str(tmp_path / "run")
    _stop_by_signals(out, uninterrupted)
    _kill_a_worker(out)
    _kill_anywhere(out)
    groupshard("train", *TINY, *STEPS, "--out", out, "--resume")
    assert sorted(name for name in os.listdir(out) if "checkpoint" in name) == ["checkpoint"]
    _assert_same_run(out, uninterrupted, tmp_path)


def test_the_command_exits_at_once_unless_a_thread_is_still_at_work(monkeypatch):
    """``run()``, the command's entry point: main()'s status, with the exit handlers run
    first, then ``os._exit`` (no unloading of torch); with a thread still at work, the
    normal exit, which waits for it."""
    import threading

    from groupshard.cli import main as command

    handlers, exits = [], []
    monkeypatch.setattr(command, "main", lambda: 3)
    monkeypatch.setattr(command.atexit, "_run_exitfuncs", lambda: handlers.append("ran"))
    monkeypatch.setattr(command.os, "_exit", exits.append)
    command.run()
    assert handlers == ["ran"] and exits == [3]
    release = threading.Event()
    working = threading.Thread(target=release.wait, name="still-at-work")
    working.start()
    try:
        with pytest.raises(SystemExit) as exit:
            command.run()
    finally:
        release.set()
        working.join()
    assert exit.value.code == 3 and handlers == ["ran"] and exits == [3]


def test_more_processes_than_cores_warns_once(tmp_path, monkeypatch, capsys):
    from groupshard.cli import main

    monkeypatch.setattr(main, "_cpu_cores", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(main, "_launch", lambda config, nproc, stop: 0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for nproc, out in (("3", "over"), ("2", "fits")):
        assert main.main(["train", *TINY, "--nproc", nproc, "--out", str(tmp_path / out)]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "groupshard train: warning: --nproc 3 is more than the 2 CPU cores here: the processes "
        "will share cores, which makes training slower per token (--nproc 2 or less avoids it)"
    ]


def test_freeze_embeddings_until_adds_their_group_mid_run_and_resumes_across_it(tmp_path):
    """--freeze-embeddings-until 6: steps 1-6 train without the embeddings, then gs.regroup
    adds them as a group of their own (logged and plotted from step 7); a run stopped
    before the regroup resumes into it."""
    out = str(tmp_path / "run")
    freeze = ["--freeze-embeddings-until", "6"]
    groupshard("train", *TINY, "--steps", "4", "--out", out, *freeze)
    groupshard("train", *TINY, "--steps", "8", "--out", out, *freeze, "--resume")
    rows = _rows(out)
    assert [row["step"] for row in rows] == list(range(1, 9))
    assert ["grad_norm/embeddings" in row for row in rows] == [False] * 6 + [True] * 2
    assert all(row["lr/embeddings"] == row["lr/decay"] for row in rows[6:])
    assert os.path.exists(os.path.join(out, "training.png"))
    with open(os.path.join(out, "summary.json")) as handle:
        groups = {g["group"]: g for g in json.load(handle)["groups"]}
    assert groups["embeddings"]["tensors"] == 2 and groups["embeddings"]["grad_norm"] > 0
    refused = groupshard("train", *TINY, "--zero", *freeze, "--out", out, check=False)
    assert refused.returncode != 0 and "--freeze-embeddings-until" in refused.stderr


def test_from_starts_at_another_systems_checkpoint(tmp_path, uninterrupted):
    """``--from`` a folder written with torch's idiom by one process (the finished run's
    weights and AdamW state, passed through a plain GPT): the new run's first loss is where
    that run ended, not where a fresh one starts; and a folder of another --model is named."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from groupshard.cli.config import PRESETS
    from groupshard.cli.model import GPT
    from groupshard.cli.train import optimizer_groups

    torch.manual_seed(0)
    plain = GPT(PRESETS["tiny"])
    groups, _ = optimizer_groups("adamw", plain, 0.1)
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    model_state, optim_state = get_state_dict(plain, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=os.path.join(uninterrupted, "checkpoint"), no_dist=True)
    set_state_dict(plain, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])  # fmt: skip
    folder = str(tmp_path / "one-process")
    model_state, optim_state = get_state_dict(plain, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder, no_dist=True)

    out = str(tmp_path / "from")
    groupshard("train", *TINY, "--steps", "3", "--eval-every", "3", "--from", folder, "--out", out)
    fresh_first, trained_last = _losses(uninterrupted)[0], _losses(uninterrupted)[-1]
    assert abs(_losses(out)[0] - trained_last) < 0.25 * (fresh_first - trained_last)
    wrong = groupshard(
        "train", "--model", "small", "--steps", "2", "--from", folder,
        "--out", str(tmp_path / "wrong"), check=False,
    )  # fmt: skip
    assert wrong.returncode != 0
    assert "does not match the model" in wrong.stderr


def test_usage_lists_every_option_help_shows():
    """docs/usage.md's option list names exactly the options ``groupshard train --help``
    shows."""
    from groupshard.cli.main import _parser

    subcommands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    shown = {
        option
        for action in subcommands.choices["train"]._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }
    text = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
    options = text[text.index("Options: `--data`") : text.index("`groupshard train --help` lists")]
    assert set(re.findall(r"`(--[a-z][a-z0-9-]*)", options)) - {"--help"} == shown
