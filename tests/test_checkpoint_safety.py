"""Checkpoints from untrusted or damaged folders: nothing in them runs, every failure is one
clear error naming the file on every rank, the newest complete checkpoint wins after
interrupted saves, and optimizer state takes the parameters' dtype."""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import groupshard as gs
from test_checkpoint import RESUME_AT, batches, lr_lambda, save_case, sharded, train

from helpers import EdgeGPT, max_difference, three_groups

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-9}


class WritesMarker:
    """Unpickling this creates the file ``path``: it stands for any code an attacker runs."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def saved(run_ranks, tmp_path_factory):
    """A float32 checkpoint saved at world size 2 after RESUME_AT steps (two data files)."""
    path = str(tmp_path_factory.mktemp("saved") / "ckpt")
    run_ranks(2, save_case, path)
    return path


def _copy(saved, tmp_path, name):
    path = str(tmp_path / name)
    shutil.copytree(saved, path)
    return path


def load_case(rank, world_size, path):
    """The error ``load`` raises here: (is a CheckpointError, type name, message, whether
    it hides the chain of causes)."""
    model, optimizer = sharded(rank, world_size)
    try:
        gs.checkpoint.load(path, model, optimizer)
    except Exception as error:
        hidden = error.__cause__ is None and (
            error.__context__ is None or error.__suppress_context__
        )
        return (
            isinstance(error, gs.checkpoint.CheckpointError),
            type(error).__name__,
            str(error),
            hidden,
        )
    return None


def _convert(path, output):
    return subprocess.run(
        [sys.executable, "-m", "groupshard.checkpoint", "convert", path, output],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_crafted_metadata_runs_nothing(run_ranks, saved, tmp_path):
    path, marker = _copy(saved, tmp_path, "ckpt"), str(tmp_path / "marker")
    metadata = FileSystemReader(path).read_metadata()  # trusted: the test wrote it
    metadata.planner_data = {"model.wte.weight": WritesMarker(marker)}
    with open(os.path.join(path, ".metadata"), "wb") as stream:
        pickle.dump(metadata, stream)

    refused = f"{os.path.join(path, '.metadata')} refers to {open.__module__}.open"
    errors = run_ranks(2, load_case, path)
    assert not os.path.exists(marker)
    for ours, name, message, _ in errors:
        assert ours and name == "UnsafeCheckpointError" and refused in message
    with pytest.raises(gs.checkpoint.UnsafeCheckpointError, match=r"\.metadata refers to"):
        gs.checkpoint.read_extra(path)
    assert not os.path.exists(marker)
    converted = _convert(path, str(tmp_path / "plain.pt"))
    assert converted.returncode == 1 and refused in converted.stderr
    assert "Traceback" not in converted.stderr
    assert not os.path.exists(marker) and not os.path.exists(tmp_path / "plain.pt")


def test_crafted_tensor_data_runs_nothing(run_ranks, saved, tmp_path):
    path, marker = _copy(saved, tmp_path, "ckpt"), str(tmp_path / "marker")
    storage = FileSystemReader(path).read_metadata().storage_data  # trusted: the test wrote it
    first = min((i for i in storage.values() if i.relative_path == "__0_0.distcp"),
                key=lambda info: info.offset)  # fmt: skip
    payload = pickle.dumps(WritesMarker(marker), protocol=2)  # no frames: straight to the global
    assert len(payload) < first.length
    data_file = os.path.join(path, "__0_0.distcp")
    with open(data_file, "r+b") as stream:
        stream.seek(first.offset)
        stream.write(payload)

    errors = run_ranks(2, load_case, path)
    assert not os.path.exists(marker)
    for ours, name, message, hidden in errors:
        assert ours and name == "UnsafeCheckpointError" and hidden
        assert data_file in message and "not a plain tensor" in message
    assert gs.checkpoint.read_extra(path)["step"] == RESUME_AT  # reads no tensor data
    converted = _convert(path, str(tmp_path / "plain.pt"))
    assert converted.returncode == 1 and data_file in converted.stderr
    assert not os.path.exists(marker)


def test_damaged_data_files_fail_clearly_on_every_rank(run_ranks, saved, tmp_path):
    names = ("cut", "empty", "gone", "zeroed")
    truncated, empty, missing, zeroed = (_copy(saved, tmp_path, name) for name in names)
    with open(os.path.join(truncated, "__1_0.distcp"), "r+b") as stream:
        stream.truncate(os.path.getsize(stream.name) // 2)
    open(os.path.join(empty, "__0_0.distcp"), "wb").close()
    os.remove(os.path.join(missing, "__1_0.distcp"))
    zeroed_file = os.path.join(zeroed, "__0_0.distcp")  # same size, no longer tensors
    with open(zeroed_file, "r+b") as stream:
        stream.write(bytes(os.path.getsize(zeroed_file)))
    expected = [
        (os.path.join(truncated, "__1_0.distcp"), "is truncated"),
        (os.path.join(empty, "__0_0.distcp"), "is empty"),
        (os.path.join(missing, "__1_0.distcp"), "is missing"),
        (zeroed_file, "is damaged at entry"),
    ]
    for world_size in (1, 2):
        for rank_results in run_ranks(
            world_size, damaged_case, [truncated, empty, missing, zeroed]
        ):
            for (ours, name, message, hidden), (file, what) in zip(
                rank_results, expected, strict=True
            ):
                assert ours and name == "CheckpointError" and hidden
                assert f"The checkpoint file {file} {what}" in message
                assert len(message) < 300 and "Traceback" not in message


def damaged_case(rank, world_size, paths):
    return [load_case(rank, world_size, path) for path in paths]


def interrupted_saves_case(rank, world_size, directory):
    """Saves at steps 6, 8 and 10, then the folders two interrupted saves leave behind: the
    checkpoint moved aside twice and the last one complete but never renamed into place
    (its save was cut between the renames), plus a temporary folder of an unfinished save."""
    model, optimizer = sharded(rank, world_size)
    path, held = os.path.join(directory, "ckpt"), os.path.join(directory, "held")
    expected = None
    for step in (6, 8, 10):
        train(model, optimizer, batches()[:1], rank, world_size)
        gs.checkpoint.save(path, model, optimizer, extra={"step": step})
        shutil.copytree(path, os.path.join(held, str(step)))
        expected = gs.full_state_dict(model)
    shutil.rmtree(path)
    # random-looking names whose sorted order is not the order of the saves
    shutil.copytree(os.path.join(held, "6"), f"{path}.old-ffffffff")
    shutil.copytree(os.path.join(held, "8"), f"{path}.old-00000000")
    shutil.copytree(os.path.join(held, "10"), f"{path}.tmp-00000000")
    shutil.copytree(os.path.join(held, "8"), f"{path}.tmp-ffffffff")
    os.remove(f"{path}.tmp-ffffffff/groupshard.json")  # unfinished: no description yet

    fresh, fresh_optimizer = sharded(rank, world_size, seed=3)
    steps = [gs.checkpoint.read_extra(path)["step"]]
    steps.append(gs.checkpoint.load(path, fresh, fresh_optimizer)["step"])
    difference = max_difference(gs.full_state_dict(fresh), expected)
    found = [gs.checkpoint.exists(path), gs.checkpoint.exists(f"{path}-other")]
    gs.checkpoint.save(path, model, optimizer, extra={"step": 12})
    with open(os.path.join(path, "groupshard.json")) as stream:
        serial = json.load(stream).get("serial")
    steps.append(gs.checkpoint.read_extra(path)["step"])
    return steps, difference, found, sorted(os.listdir(directory)), serial


def test_newest_complete_checkpoint_wins_after_interrupted_saves(run_ranks, tmp_path):
    result = run_ranks(1, interrupted_saves_case, str(tmp_path))[0]
    steps, difference, found, left, serial = result
    assert steps == [10, 10, 12] and difference == 0.0
    assert found == [True, False]  # "ckpt" itself was gone, its newest leftover counts
    assert left == ["ckpt", "held"]  # the completed save removed every leftover
    assert serial == 4  # after the three saves, including the one never renamed into place


def dtype_save_case(rank, world_size, path, dtype_name):
    torch.manual_seed(0)
    model = EdgeGPT().to(getattr(torch, dtype_name))
    model = gs.shard(model, three_groups(model, 1e-2))
    optimizer = torch.optim.AdamW(model.optimizer_groups(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    train(model, optimizer, batches()[:RESUME_AT], rank, world_size, scheduler)
    gs.checkpoint.save(path, model, optimizer)


def dtype_resume_case(rank, world_size, path, plain_file, dtype_name):
    """Load into a model of another dtype and train on; the reference loads the same values
    by hand into a plain model of that dtype (torch's load_state_dict casts the state)."""
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(123)
    model = EdgeGPT().to(dtype)
    reference = copy.deepcopy(model)
    model = gs.shard(model, three_groups(model, 1e-2))
    optimizer = torch.optim.AdamW(model.optimizer_groups(), lr=1.0)
    gs.checkpoint.load(path, model, optimizer)
    state = next(iter(optimizer.state.values()))
    dtypes = (state["exp_avg"].dtype, state["exp_avg_sq"].dtype, state["step"].dtype)
    train(model, optimizer, batches()[RESUME_AT:], rank, world_size)

    plain = torch.load(plain_file, weights_only=True)
    reference.load_state_dict(plain["model"])
    reference_optimizer = torch.optim.AdamW(three_groups(reference, 1e-2), lr=1.0)
    reference_optimizer.load_state_dict(plain["optim"])
    train(reference, reference_optimizer, batches()[RESUME_AT:], 0, 1)
    return dtypes, max_difference(gs.full_state_dict(model), reference.state_dict())


@pytest.mark.parametrize(
    ("saved_dtype", "model_dtype"), [("float32", "float64"), ("float64", "float32")]
)
def test_optimizer_state_takes_the_parameters_dtype(
    run_ranks, saved, tmp_path, saved_dtype, model_dtype
):
    if saved_dtype == "float32":
        path = saved
    else:
        path = str(tmp_path / "ckpt")
        run_ranks(2, dtype_save_case, path, saved_dtype)
    plain_file = str(tmp_path / "plain.pt")
    gs.checkpoint.to_torch_save(path, plain_file)
    results = run_ranks(2, dtype_resume_case, path, plain_file, model_dtype)
    dtype = getattr(torch, model_dtype)
    for dtypes, difference in results:
        assert dtypes == (dtype, dtype, torch.float32)  # step keeps its dtype, as in torch
        assert difference <= TOLERANCE[dtype]
