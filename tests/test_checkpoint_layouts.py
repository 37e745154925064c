"""Folders groupshard did not write with today's layout: torchtitan's (the model's names bare,
the optimizer under ``optimizer.`` with flattened param groups, a model-only last step),
and groupshard's first layout (every tensor 1-D), converted offline."""

from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
)

import groupshard as gs
from groupshard.checkpoint import CheckpointError
from groupshard.cli.model import GPTConfig
from test_checkpoint import (
    RESUME_AT,
    batches,
    plain_run_to_resume,
    reference_run,
    resume_case,
    sharded,
    train,
)
from test_checkpoint_safety import WritesMarker, load_case

from helpers import EdgeGPT, max_difference, numbered, three_groups

TOLERANCE = 1e-5
FIRST_LAYOUT = Path(__file__).parent / "data" / "first_layout_checkpoint"


def write_torchtitan_folder(path: str, model_only: bool) -> list[float]:
    """What torchtitan's CheckpointManager writes (components/checkpointer/dcp.py): the
    model's state dict merged in at the top level, the optimizer flattened
    (``optimizer.state.<fqn>.<key>``, ``optimizer.param_groups.<fqn>.<key>``), the
    scheduler's and trainer's state beside; the last step's folder holds the model only.
    One process, as a one-rank torchtitan run writes it."""
    model, optimizer, scheduler = plain_run_to_resume()
    state: dict = dict(get_model_state_dict(model))
    if not model_only:
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        state["optimizer"] = get_optimizer_state_dict(model, optimizer, options=flat)
        state["lr_scheduler"] = {"last_epoch": scheduler.last_epoch}
        state["train_state"] = {"step": RESUME_AT, "ntokens_seen": 0}
    dcp.save(state, checkpoint_id=path, no_dist=True)
    return [group["lr"] for group in optimizer.param_groups]


def test_a_torchtitan_folder_loads_model_and_optimizer(run_ranks, tmp_path):
    path = str(tmp_path / "step-5")
    lrs = write_torchtitan_folder(path, model_only=False)
    names = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert "wte.weight" in names and "optimizer.state.wte.weight.exp_avg" in names
    for difference, loaded_lrs, _, _ in run_ranks(2, torchtitan_resume_case, path):
        assert loaded_lrs == lrs
        assert difference <= TOLERANCE


def torchtitan_resume_case(rank, world_size, path):
    model, optimizer = sharded(rank, world_size, seed=123)
    extra = gs.checkpoint.load(path, model, optimizer)
    lrs = [g["lr"] for g in optimizer.param_groups]
    train(model, optimizer, batches()[RESUME_AT:], rank, world_size)
    reference, _ = reference_run()
    return max_difference(gs.full_state_dict(model), reference.state_dict()), lrs, extra, None


def model_only_case(rank, world_size, path):
    model, optimizer = sharded(rank, world_size, seed=123)
    try:
        gs.checkpoint.load(path, model, optimizer)
    except ValueError as error:
        refused = str(error)
    gs.checkpoint.load(path, model)
    return refused, gs.full_state_dict(model)


def test_a_model_only_torchtitan_folder_loads_the_weights(run_ranks, tmp_path):
    path = str(tmp_path / "step-5")
    write_torchtitan_folder(path, model_only=True)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert all(not name.startswith("optimizer.") for name in saved)
    whole = {name: torch.empty(entry.size) for name, entry in saved.items()}
    dcp.load(whole, checkpoint_id=path, no_dist=True)  # the folder read whole, one process
    for refused, weights in run_ranks(2, model_only_case, path):
        assert "no optimizer state" in refused
        assert max_difference(weights, whole) == 0


def test_the_first_layout_is_refused_with_the_command_that_converts_it(run_ranks, tmp_path):
    folder = tmp_path / "old"
    shutil.copytree(FIRST_LAYOUT, folder)
    with pytest.raises(CheckpointError, match=r"python -m groupshard\.checkpoint convert"):
        gs.checkpoint.load(folder, *sharded(0, 1))


def test_the_first_layout_converts_and_resumes_at_another_world_size(run_ranks, tmp_path):
    """A folder written by groupshard's first layout (world 2, 5 steps with LambdaLR, extras),
    converted offline, resumes at world 3 like one uninterrupted process."""
    converted = tmp_path / "new"
    command = [sys.executable, "-m", "groupshard.checkpoint", "convert"]
    result = subprocess.run(
        [*command, str(FIRST_LAYOUT), str(converted)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    names = dcp.FileSystemReader(str(converted)).read_metadata().state_dict_metadata
    assert names["model.blocks.0.fc.weight"].size == torch.Size([64, 16])  # its own shape
    assert names["optim.state.blocks.0.fc.weight.exp_avg"].size == torch.Size([64, 16])
    for difference, lrs, step, seed in run_ranks(3, resume_case, str(converted), "blocks", "full"):
        assert difference <= TOLERANCE
        assert step == RESUME_AT and seed == [0, 1, 2]
        assert lrs == [0.0005, 0.0005, 0.0016666666666666666]


def write_plain_folder(path: str, config=None) -> None:
    """torch's idiom on one process: ``get_state_dict`` + ``dcp.save``."""
    torch.manual_seed(0)
    model = EdgeGPT() if config is None else EdgeGPT(config)
    optimizer = torch.optim.AdamW(three_groups(model, 1e-2), lr=3e-3)
    train(model, optimizer, batches()[:1], 0, 1)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path, no_dist=True)


def mismatch_case(rank, world_size, path):
    model, optimizer = sharded(rank, world_size)
    try:
        gs.checkpoint.load(path, model, optimizer)
    except ValueError as error:
        return type(error).__name__, str(error)
    return None


def test_a_folder_of_another_model_is_named_on_every_rank(run_ranks, tmp_path):
    """A folder written with torch's idiom for a wider model: a ValueError listing the
    shapes that differ, on every rank, before any reads."""
    path = str(tmp_path / "wider")
    write_plain_folder(path, GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=24))
    for name, message in run_ranks(2, mismatch_case, path):
        assert name == "ValueError"
        assert "does not match the model" in message
        assert "parameter 'wte.weight' has shape [32, 24] in the checkpoint but [32, 16]" in message


def test_a_crafted_plain_value_runs_nothing(run_ranks, tmp_path):
    """A hyperparameter's bytes replaced by a pickle that would run code: refused, naming
    the entry, on every rank; nothing runs."""
    path, marker = str(tmp_path / "ckpt"), str(tmp_path / "marker")
    write_plain_folder(path)
    metadata = dcp.FileSystemReader(path).read_metadata()  # trusted: the test wrote it
    index = next(i for i in metadata.storage_data if i.fqn == "optim.param_groups.0.lr")
    info = metadata.storage_data[index]
    payload = pickle.dumps(WritesMarker(marker), protocol=2)
    assert len(payload) <= info.length
    with open(Path(path) / info.relative_path, "r+b") as stream:
        stream.seek(info.offset)
        stream.write(payload)
    for ours, name, message, _ in run_ranks(2, load_case, path):
        assert ours and name == "UnsafeCheckpointError", message
        assert "optim.param_groups.0.lr" in message
    assert not Path(marker).exists()


def names_case(rank, world_size):
    """gs.load_optim_state_dict takes gs.optim_state_dict's names and a plain optimizer's
    numbers alike."""
    model, optimizer = sharded(rank, world_size)
    train(model, optimizer, batches()[:2], rank, world_size)
    by_name = gs.optim_state_dict(model, optimizer)
    results = []
    for form in (by_name, numbered(by_name)):
        target, target_optimizer = sharded(rank, world_size, seed=3)
        gs.load_optim_state_dict(target, target_optimizer, form)
        again = gs.optim_state_dict(target, target_optimizer)
        results.append(
            all(
                torch.equal(again["state"][fqn][key], value)
                for fqn, keys in by_name["state"].items()
                for key, value in keys.items()
            )
        )
    return results, isinstance(next(iter(by_name["state"])), str)


def test_optim_state_dict_is_keyed_by_name_and_loads_either_form(run_ranks):
    for results, named in run_ranks(2, names_case):
        assert named and results == [True, True]


def write_regrouped_folder(path: str) -> None:
    """One process whose groups split the model otherwise than three_groups: one group
    each for the head's embedding and for everything else."""
    torch.manual_seed(0)
    model = EdgeGPT()
    head = [model.wte.weight]
    rest = [p for p in model.parameters() if p is not model.wte.weight and p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": rest}, {"params": head, "lr": 0.5}], lr=3e-3)
    train(model, optimizer, batches()[:1], 0, 1)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path, no_dist=True)


def intact_case(rank, world_size, path):
    """A folder whose groups do not fit the optimizer's fails on every rank before the
    model or the optimizer changes."""
    model, optimizer = sharded(rank, world_size)
    train(model, optimizer, batches()[:1], rank, world_size)
    before = (gs.full_state_dict(model), numbered(gs.optim_state_dict(model, optimizer)))
    try:
        gs.checkpoint.load(path, model, optimizer)
    except ValueError as error:
        message = str(error)
    after = (gs.full_state_dict(model), numbered(gs.optim_state_dict(model, optimizer)))
    same_model = max_difference(before[0], after[0]) == 0
    same_state = all(
        torch.equal(value, after[1]["state"][index][key])
        for index, keys in before[1]["state"].items()
        for key, value in keys.items()
    )
    return message, same_model and same_state


def test_a_folder_with_other_groups_fails_before_anything_changes(run_ranks, tmp_path):
    path = str(tmp_path / "regrouped")
    write_regrouped_folder(path)
    for message, intact in run_ranks(2, intact_case, path):
        assert "different hyperparameters" in message
        assert intact
