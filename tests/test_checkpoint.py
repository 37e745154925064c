"""Checkpoints: full and sharded, plain torch format, other world sizes, atomic, validated."""

from __future__ import annotations

import contextlib
import copy
import errno
import io
import os
from unittest import mock

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

import groupshard as gs
from groupshard.cli.model import Block

from helpers import UNITS, EdgeGPT, max_difference, numbered, three_groups

GLOBAL_BATCH = 12  # divisible by world sizes 1, 2, 3 and 4
STEPS, RESUME_AT = 10, 5
TOLERANCE = 1e-5


def batches():
    generator = torch.Generator().manual_seed(5)
    size = (GLOBAL_BATCH, 8)
    return [
        (
            torch.randint(0, 32, size, generator=generator),
            torch.randint(0, 32, size, generator=generator),
        )
        for _ in range(STEPS)
    ]


def lr_lambda(step):
    return 1.0 / (1 + step)


def reference_run():
    """Uninterrupted single-process training: the plain AdamW, the LR schedule for 5 steps."""
    torch.manual_seed(0)
    model = EdgeGPT()
    optimizer = torch.optim.AdamW(three_groups(model, 1e-2), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    for step, (inputs, targets) in enumerate(batches()):
        model(inputs, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step < RESUME_AT:
            scheduler.step()
    return model, optimizer


def sharded(rank, world_size, seed=0, unit=UNITS, strategy="full"):
    torch.manual_seed(seed)
    model = EdgeGPT()
    model = gs.shard(model, three_groups(model, 1e-2), unit=unit, strategy=strategy)
    optimizer = torch.optim.AdamW(model.optimizer_groups(), lr=3e-3)
    return model, optimizer


def train(model, optimizer, steps, rank, world_size, scheduler=None):
    for inputs, targets in steps:
        local = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
        model(inputs[local], targets[local]).backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()


def save_case(rank, world_size, path):
    model, optimizer = sharded(rank, world_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    train(model, optimizer, batches()[:RESUME_AT], rank, world_size, scheduler)
    gs.checkpoint.save(path, model, optimizer, extra={"step": RESUME_AT, "seed": torch.arange(3)})
    return [g["lr"] for g in optimizer.param_groups]


def resume_case(rank, world_size, path, unit_name, strategy):
    unit = {"blocks": UNITS, "block only": Block, "root": None}[unit_name]
    model, optimizer = sharded(rank, world_size, seed=123, unit=unit, strategy=strategy)
    extra = gs.checkpoint.load(path, model, optimizer)
    lrs = [g["lr"] for g in optimizer.param_groups]
    train(model, optimizer, batches()[RESUME_AT:], rank, world_size)
    reference, _ = reference_run()
    difference = max_difference(gs.full_state_dict(model), reference.state_dict())
    return difference, lrs, extra["step"], extra["seed"].tolist()


@pytest.mark.parametrize(
    ("save_at", "load_at", "unit", "strategy"),
    [
        (4, 2, "blocks", "full"),
        (3, 2, "blocks", "full"),
        (4, 1, "root", "full"),
        (2, 3, "block only", "grad_op"),
        (2, 2, "blocks", "no_shard"),
    ],
)
def test_save_and_resume_at_another_world_size(
    run_ranks, tmp_path, save_at, load_at, unit, strategy
):
    path = str(tmp_path / "ckpt")
    saved_lrs = run_ranks(save_at, save_case, path)[0]
    assert saved_lrs == pytest.approx([3e-3 / (1 + RESUME_AT)] * 2 + [1e-2 / (1 + RESUME_AT)])
    for difference, lrs, step, seed in run_ranks(load_at, resume_case, path, unit, strategy):
        assert lrs == saved_lrs  # scheduler-modified LRs survive
        assert step == RESUME_AT and seed == [0, 1, 2]
        assert difference <= TOLERANCE


def plain_to_sharded_case(rank, world_size, plain_file):
    saved = torch.load(plain_file, weights_only=True)
    model, optimizer = sharded(rank, world_size, seed=7)
    gs.load_full_state_dict(model, saved["model"])
    gs.load_optim_state_dict(model, optimizer, saved["optim"])
    train(model, optimizer, batches()[RESUME_AT:], rank, world_size)
    reference, _ = reference_run()
    return max_difference(gs.full_state_dict(model), reference.state_dict())


def sharded_to_plain_case(rank, world_size, plain_file):
    model, optimizer = sharded(rank, world_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    train(model, optimizer, batches()[:RESUME_AT], rank, world_size, scheduler)
    full, optim = gs.full_state_dict(model), gs.optim_state_dict(model, optimizer)
    if rank == 0:
        torch.save({"model": full, "optim": optim}, plain_file)
    return sorted(numbered(optim)["state"][1]), len(optim["param_groups"])


def _continue_plain(saved):
    torch.manual_seed(99)
    model = EdgeGPT()
    model.load_state_dict(saved["model"])
    optimizer = torch.optim.AdamW(three_groups(model, 1e-2), lr=1.0)
    optimizer.load_state_dict(saved["optim"])
    for inputs, targets in batches()[RESUME_AT:]:
        model(inputs, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def plain_run_to_resume():
    """Single-process training for RESUME_AT steps with the LR schedule, as the reference's
    first steps: the model, its AdamW and the scheduler."""
    torch.manual_seed(0)
    model = EdgeGPT()
    optimizer = torch.optim.AdamW(three_groups(model, 1e-2), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    for inputs, targets in batches()[:RESUME_AT]:
        model(inputs, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer, scheduler


def test_plain_checkpoint_to_sharded_and_back(run_ranks, tmp_path):
    # plain single-process training for 5 steps, saved with torch.save
    model, optimizer, _ = plain_run_to_resume()
    plain_file = str(tmp_path / "plain.pt")
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, plain_file)
    assert max(run_ranks(2, plain_to_sharded_case, plain_file)) <= TOLERANCE
    # and back: sharded at world size 2, saved in plain format, continued on one process
    back_file = str(tmp_path / "back.pt")
    keys, group_count = run_ranks(2, sharded_to_plain_case, back_file)[0]
    assert keys == ["exp_avg", "exp_avg_sq", "step"] and group_count == 3
    continued = _continue_plain(torch.load(back_file, weights_only=True))
    reference, _ = reference_run()
    assert max_difference(continued.state_dict(), reference.state_dict()) <= TOLERANCE


def test_convert_to_one_torch_save_file(run_ranks, tmp_path):
    path, output = str(tmp_path / "ckpt"), str(tmp_path / "plain.pt")
    run_ranks(4, save_case, path)
    from groupshard.checkpoint.__main__ import main

    assert main(["convert", path, output]) == 0
    saved = torch.load(output, weights_only=True)
    assert "lm_head.weight" in saved["model"] and saved["extra"]["step"] == RESUME_AT
    continued = _continue_plain(saved)
    reference, _ = reference_run()
    assert max_difference(continued.state_dict(), reference.state_dict()) <= TOLERANCE


class WiderGPT(EdgeGPT):
    def __init__(self):
        super().__init__()
        self.extra_head = torch.nn.Linear(16, 4)


def mismatch_case(rank, world_size, path, kind):
    torch.manual_seed(0)
    model = WiderGPT() if kind == "other model" else EdgeGPT()
    groups = three_groups(model, 1e-2)  # the wider model's extra head lands in groups 0 and 1
    if kind == "group missing":
        groups[0]["params"] = [*groups[0]["params"], *groups.pop(2)["params"]]
    model = gs.shard(model, groups, unit=UNITS)
    optimizer = torch.optim.AdamW(model.optimizer_groups(), lr=3e-3)
    try:
        gs.checkpoint.load(path, model, optimizer)
    except ValueError as error:
        return str(error)
    return "no error"


def test_mismatched_checkpoints_fail_clearly(run_ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(2, save_case, path)
    for message in run_ranks(2, mismatch_case, path, "other model"):
        assert (
            "2 parameters missing from the checkpoint: ['extra_head.weight', 'extra_head.bias']"
            in message
        )
    for message in run_ranks(2, mismatch_case, path, "group missing"):
        assert "The checkpoint has 3 param groups but the optimizer has 2" in message


def crash_case(rank, world_size, path):
    model, optimizer = sharded(rank, world_size)
    train(model, optimizer, batches()[:2], rank, world_size)
    gs.checkpoint.save(path, model, optimizer)
    expected = gs.full_state_dict(model)
    train(model, optimizer, batches()[2:4], rank, world_size)
    with mock.patch.object(FileSystemWriter, "finish", side_effect=OSError("disk full")):
        try:
            gs.checkpoint.save(path, model, optimizer)
            crashed = "no error"
        except RuntimeError as error:
            crashed = str(error)
    fresh, fresh_optimizer = sharded(rank, world_size, seed=3)
    gs.checkpoint.load(path, fresh, fresh_optimizer)
    leftovers = sorted(os.listdir(os.path.dirname(path)))
    return crashed, max_difference(gs.full_state_dict(fresh), expected), leftovers


def test_crash_during_save_keeps_previous_checkpoint(run_ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    for crashed, difference, leftovers in run_ranks(2, crash_case, path):
        assert "failed on some rank; the previous checkpoint there (if any) is intact" in crashed
        assert difference == 0.0
        assert leftovers == ["ckpt"]


class _AlmostFullDevice(io.FileIO):
    """A file on a device with 300 bytes left: a longer write fails with ENOSPC (which
    torch.save, writing a tensor, turns into "unexpected pos")."""

    def write(self, data):
        if self.tell() + memoryview(data).nbytes > 300:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)


@contextlib.contextmanager
def _almost_full(filesystem, path, mode):
    with _AlmostFullDevice(path, mode) as stream:
        yield stream


def no_space_case(rank, world_size, path):
    model, optimizer = sharded(rank, world_size)
    train(model, optimizer, batches()[:2], rank, world_size)
    gs.checkpoint.save(path, model, optimizer, extra={"step": 2})
    previous = sum(entry.stat().st_size for entry in os.scandir(path))
    train(model, optimizer, batches()[2:4], rank, world_size)
    errors = []
    full = [  # rank 1's data files; rank 0's description, written last
        mock.patch.object(FileSystem, "create_stream", _almost_full),
        mock.patch.object(gs.checkpoint.folders, "write_meta", side_effect=OSError(
            errno.ENOSPC, os.strerror(errno.ENOSPC))),
    ]  # fmt: skip
    for patch, failing_rank in zip(full, (1, 0), strict=True):
        error = None
        with patch if rank == failing_rank else contextlib.nullcontext():
            try:
                gs.checkpoint.save(path, model, optimizer, extra={"step": 4})
            except gs.checkpoint.NoSpaceError as caught:
                error = (str(caught), caught.errno, caught.needed, isinstance(caught, OSError))
        kept = gs.checkpoint.read_extra(path)["step"], sorted(os.listdir(os.path.dirname(path)))
        errors.append((error, kept))
    gs.checkpoint.save(path, model, optimizer, extra={"step": 4})  # once there is room
    return errors, previous, gs.checkpoint.read_extra(path)["step"]


def test_a_full_device_says_so_on_every_rank_and_keeps_the_previous_checkpoint(run_ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    results = run_ranks(2, no_space_case, path)
    assert results[0] == results[1]  # the same error on both ranks, whichever rank failed
    errors, previous, step = results[0]
    for error, kept in errors:
        assert error is not None and kept == (2, ["ckpt"])  # intact, no leftovers
        message, code, needed, is_os_error = error
        assert (code, needed, is_os_error) == (errno.ENOSPC, previous, True)
        free = int(message.split(" bytes, ")[1].split(" are free")[0].replace(",", ""))
        assert message == (
            f"no space left on device in {tmp_path} to save the checkpoint {path}: it needs "
            f"about {previous:,} bytes, {free:,} are free; the previous checkpoint there (if "
            "any) is intact"
        )
    assert step == 4


PLAIN_OPTIMIZERS = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9),
    "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=1e-3, momentum=0.5),
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=3e-2),
    "lamb": lambda groups: gs.optim.LAMB(groups, lr=1e-2),
    "lars": lambda groups: gs.optim.LARS(groups, lr=0.5, trust_coefficient=0.01),
}


def optimizer_round_trip_case(rank, world_size, name):
    """Sharded -> plain state dicts -> a plain optimizer on one process, which continues
    exactly like the unsharded reference that never stopped."""
    torch.manual_seed(0)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    sharded_model = gs.shard(model, three_groups(model, 1e-2), unit=UNITS)
    optimizer = PLAIN_OPTIMIZERS[name](sharded_model.optimizer_groups())
    reference_optimizer = PLAIN_OPTIMIZERS[name](three_groups(reference, 1e-2))
    train(sharded_model, optimizer, batches()[:RESUME_AT], rank, world_size)
    train(reference, reference_optimizer, batches(), 0, 1)
    full = gs.full_state_dict(sharded_model, rank0_only=True, cpu_offload=True)
    saved = {"model": full, "optim": gs.optim_state_dict(sharded_model, optimizer)}
    if rank != 0:
        return full == {}
    torch.manual_seed(1)
    plain = EdgeGPT()
    plain.load_state_dict(saved["model"])
    plain_optimizer = PLAIN_OPTIMIZERS[name](three_groups(plain, 1e-2))
    plain_optimizer.load_state_dict(saved["optim"])
    train(plain, plain_optimizer, batches()[RESUME_AT:], 0, 1)
    return max_difference(plain.state_dict(), reference.state_dict())


@pytest.mark.parametrize("name", sorted(PLAIN_OPTIMIZERS))
def test_optimizer_state_round_trip_for_other_optimizers(run_ranks, name):
    difference, other_rank_empty = run_ranks(2, optimizer_round_trip_case, name)
    assert other_rank_empty is True  # rank0_only
    assert difference <= TOLERANCE
