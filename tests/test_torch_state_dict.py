"""torch's checkpoint idiom on sharded models: ``get_state_dict`` + ``dcp.save``, then
``dcp.load`` + ``set_state_dict``, exact at the same and at other world sizes, strategies
and units, with every option; and its folders and ``gs.checkpoint``'s are one format."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import groupshard as gs
from groupshard.checkpoint import reader
from groupshard.checkpoint.planner import ParamPiece
from groupshard.cli.model import Block
from test_checkpoint import RESUME_AT, batches, lr_lambda, reference_run, sharded, train

from helpers import UNITS, EdgeGPT, max_difference, three_groups

TOLERANCE = 1e-5
UNIT_CHOICES = {"blocks": UNITS, "block only": Block, "root": None}


def torch_save_case(rank, world_size, path, flatten, strategy="full"):
    """Train RESUME_AT steps, save with torch's idiom."""
    model, optimizer = sharded(rank, world_size, strategy=strategy)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    train(model, optimizer, batches()[:RESUME_AT], rank, world_size, scheduler)
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    pieces = [v for v in model_state.values() if isinstance(v, ParamPiece)]
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    return [g["lr"] for g in optimizer.param_groups], len(pieces)


def torch_load_case(rank, world_size, path, flatten, unit_name, strategy):
    """Load with torch's idiom into a differently seeded model, train on, compare."""
    unit = UNIT_CHOICES[unit_name]
    model, optimizer = sharded(rank, world_size, seed=123, unit=unit, strategy=strategy)
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
        options=options,
    )  # fmt: skip
    lrs = [g["lr"] for g in optimizer.param_groups]
    train(model, optimizer, batches()[RESUME_AT:], rank, world_size)
    reference, _ = reference_run()
    return max_difference(gs.full_state_dict(model), reference.state_dict()), lrs


@pytest.mark.parametrize(
    ("save_at", "load_at", "unit", "strategy", "flatten"),
    [
        (2, 2, "blocks", "full", False),
        (2, 3, "block only", "grad_op", True),
        (3, 1, "root", "full", False),
        (4, 2, "blocks", "no_shard", True),
    ],
)
def test_torch_idiom_round_trip_is_exact(
    run_ranks, tmp_path, save_at, load_at, unit, strategy, flatten
):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(save_at, torch_save_case, path, flatten)
    lrs, pieces = saved[0]
    if save_at > 1:  # the parameters are handed to DCP as pieces, not whole tensors
        assert pieces > 0
    for difference, loaded_lrs in run_ranks(
        load_at, torch_load_case, path, flatten, unit, strategy
    ):
        assert loaded_lrs == lrs
        assert difference <= TOLERANCE


def test_every_ranks_optimizer_piece_is_written_once(run_ranks, tmp_path):
    """Each exp_avg is tiled exactly by the blocks of every rank that holds a piece of it:
    dropping any rank's piece (as DCP does with plain per-rank tensors) fails here."""
    path = str(tmp_path / "ckpt")
    run_ranks(3, torch_save_case, path, False)
    metadata = reader.read_metadata(Path(path))
    files_per_entry: dict[str, set[str]] = {}
    for index, info in metadata.storage_data.items():
        files_per_entry.setdefault(index.fqn, set()).add(info.relative_path)
    entries = metadata.state_dict_metadata
    states = [n for n in entries if n.endswith(".exp_avg")]
    assert states
    for name in states:
        entry = entries[name]
        assert isinstance(entry, TensorStorageMetadata)
        assert sum(c.sizes.numel() for c in entry.chunks) == entry.size.numel()
        model_entry = entries["model." + name[len("optim.state.") : -len(".exp_avg")]]
        assert entry.size == model_entry.size  # the parameter's own shape
    # the embedding spans several ranks' shards: its state was written from each of them
    assert len(files_per_entry["optim.state.wte.weight.exp_avg"]) >= 2


def full_options_case(rank, world_size, cpu_offload):
    """full_state_dict=True (with and without cpu_offload) equals the unsharded model's."""
    model, optimizer = sharded(rank, world_size)
    train(model, optimizer, batches()[:2], rank, world_size)
    options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    plain_model = gs.full_state_dict(model)  # collectives: on every rank
    plain_optim = gs.optim_state_dict(model, optimizer)
    if cpu_offload and rank != 0:
        return model_state == {} and optim_state == {}
    same_model = max_difference(model_state, plain_model) == 0
    same_keys = set(optim_state["state"]) == set(plain_optim["state"])
    same_state = all(
        torch.equal(optim_state["state"][f][k], v)
        for f, keys in plain_optim["state"].items()
        for k, v in keys.items()
    )
    return (
        same_model
        and same_keys
        and same_state
        and isinstance(next(iter(optim_state["state"])), str)
    )


@pytest.mark.parametrize("cpu_offload", [False, True])
def test_full_state_dict_options(run_ranks, cpu_offload):
    assert all(run_ranks(2, full_options_case, cpu_offload))


def full_set_case(rank, world_size, broadcast):
    """set_*_state_dict with whole tensors (every rank's, or rank 0's broadcast) equals
    loading them with gs.load_full_state_dict / gs.load_optim_state_dict."""
    model, optimizer = sharded(rank, world_size)
    train(model, optimizer, batches()[:RESUME_AT], rank, world_size)
    options = StateDictOptions(full_state_dict=True)
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    target, target_optimizer = sharded(rank, world_size, seed=9)
    set_options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    if broadcast and rank != 0:
        model_state, optim_state = {}, {}
    set_model_state_dict(target, model_state, options=set_options)
    set_optimizer_state_dict(target, target_optimizer, optim_state, options=set_options)
    train(model, optimizer, batches()[RESUME_AT:], rank, world_size)
    train(target, target_optimizer, batches()[RESUME_AT:], rank, world_size)
    return max_difference(gs.full_state_dict(model), gs.full_state_dict(target))


@pytest.mark.parametrize("broadcast", [False, True])
def test_set_state_dict_from_whole_tensors(run_ranks, broadcast):
    for difference in run_ranks(2, full_set_case, broadcast):
        assert difference == 0


def cpu_offload_case(rank, world_size, path):
    """cpu_offload=True alone: pieces in CPU memory, saved and loaded as without it."""
    model, optimizer = sharded(rank, world_size)
    train(model, optimizer, batches()[:RESUME_AT], rank, world_size)
    options = StateDictOptions(cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    target, target_optimizer = sharded(rank, world_size, seed=3)
    model_state, optim_state = get_state_dict(target, target_optimizer, options=options)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(target, target_optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=options)  # fmt: skip
    train(model, optimizer, batches()[RESUME_AT:], rank, world_size)
    train(target, target_optimizer, batches()[RESUME_AT:], rank, world_size)
    return max_difference(gs.full_state_dict(model), gs.full_state_dict(target))


def test_cpu_offload_round_trip(run_ranks, tmp_path):
    for difference in run_ranks(2, cpu_offload_case, str(tmp_path / "ckpt")):
        assert difference == 0


def cross_case(rank, world_size, path, writer):
    """A folder written by torch's idiom loads with gs.checkpoint.load, and one written by
    gs.checkpoint.save loads with torch's idiom."""
    model, optimizer = sharded(rank, world_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    train(model, optimizer, batches()[:RESUME_AT], rank, world_size, scheduler)
    if writer == "torch":
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    else:
        gs.checkpoint.save(path, model, optimizer)
    return path


def load_torch_idiom_folder_case(rank, world_size, path, reader_kind):
    model, optimizer = sharded(rank, world_size, seed=77, unit=Block, strategy="grad_op")
    if reader_kind == "groupshard":
        gs.checkpoint.load(path, model, optimizer)
    else:  # torch's idiom; flattened: the param groups per parameter name (torchtitan's)
        options = StateDictOptions(flatten_optimizer_state_dict=reader_kind == "torch flattened")
        model_state, optim_state = get_state_dict(model, optimizer, options=options)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=options)  # fmt: skip
    train(model, optimizer, batches()[RESUME_AT:], rank, world_size)
    reference, _ = reference_run()
    return max_difference(gs.full_state_dict(model), reference.state_dict())


@pytest.mark.parametrize(
    ("writer", "reader_kind"),
    [("torch", "groupshard"), ("groupshard", "torch"), ("groupshard", "torch flattened")],
)
def test_torch_idiom_and_gs_checkpoint_share_one_format(run_ranks, tmp_path, writer, reader_kind):
    path = str(tmp_path / "ckpt")
    run_ranks(3, cross_case, path, writer)
    for difference in run_ranks(2, load_torch_idiom_folder_case, path, reader_kind):
        assert difference <= TOLERANCE


class VectorOffsetGPT(EdgeGPT):
    """EdgeGPT with its 0-dim offset as a 1-element vector: FSDP2 takes no 0-dim parameter.
    (Plain GPT is no good reference here: Adam's first step on its near-zero gradients
    sets one process apart from any data-parallel run by 1.7e-5, DDP's and FSDP2's too.)"""

    def __init__(self) -> None:
        super().__init__()
        self.shift.offset = nn.Parameter(torch.tensor([0.01]))


def _reference_steps(stop):
    """One process, plain AdamW with the same groups, ``stop`` steps."""
    torch.manual_seed(0)
    model = VectorOffsetGPT()
    optimizer = torch.optim.AdamW(three_groups(model, 1e-2), lr=3e-3)
    for inputs, targets in batches()[:stop]:
        model(inputs, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _other_system(system, seed):
    """The model and AdamW (the same groups) under FSDP2, DDP or one process."""
    torch.manual_seed(seed)
    model = VectorOffsetGPT()
    if system == "fsdp2":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif system == "ddp":
        model = DDP(model)
    groups_of = model.module if system == "ddp" else model
    return model, torch.optim.AdamW(three_groups(groups_of, 1e-2), lr=3e-3)


def _plain_state(model, optimizer, no_dist):
    """The whole model and optimizer state, by parameter name, as torch's API gives it."""
    options = StateDictOptions(full_state_dict=True)
    if no_dist:
        return model.state_dict(), _by_name(model, optimizer)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(
        model, optimizer, options=options
    )["state"]


def _by_name(model, optimizer):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: dict(s) for p, s in optimizer.state.items()}


def other_system_stage(rank, world_size, system, load_from, save_to, start, stop):
    """Train steps [start, stop) under another system, resuming from and saving to folders
    with torch's idiom."""
    no_dist = system == "one process"
    model, optimizer = _other_system(system, seed=11 if load_from else 0)  # 0: the reference's
    if load_from:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=load_from, no_dist=no_dist)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])  # fmt: skip
    train(model, optimizer, batches()[start:stop], rank, world_size)
    if save_to:
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=save_to,
                 no_dist=no_dist)  # fmt: skip
    return _plain_state(model, optimizer, no_dist)


def groupshard_stage(rank, world_size, load_from, save_to, start, stop, strategy):
    torch.manual_seed(13)
    model = VectorOffsetGPT()
    model = gs.shard(model, three_groups(model, 1e-2), unit=UNITS, strategy=strategy)
    optimizer = torch.optim.AdamW(model.optimizer_groups(), lr=3e-3)
    gs.checkpoint.load(load_from, model, optimizer)
    train(model, optimizer, batches()[start:stop], rank, world_size)
    gs.checkpoint.save(save_to, model, optimizer)


def _state_difference(found, reference_model, reference_optimizer):
    model_state, optim_state = found
    difference = max_difference(model_state, reference_model.state_dict())
    for fqn, keys in _by_name(reference_model, reference_optimizer).items():
        for key, value in keys.items():
            difference = max(difference, (optim_state[fqn][key] - value).abs().max().item())
    return difference


@pytest.mark.parametrize(
    ("system", "world_size", "strategy"),
    [("fsdp2", 2, "full"), ("ddp", 2, "grad_op"), ("one process", 1, "full")],
)
def test_another_system_then_groupshard_then_back(
    run_ranks, tmp_path, system, world_size, strategy
):
    """3 steps under FSDP2 / DDP / one process, 3 under groupshard at world 3 (through
    gs.checkpoint), 3 more under the first system (through torch's idiom): equal to one
    process doing all 9, model and optimizer."""
    first, second = str(tmp_path / "first"), str(tmp_path / "second")

    def other(*args):
        if system == "one process":
            return other_system_stage(0, 1, system, *args)
        return run_ranks(world_size, other_system_stage, system, *args)[0]

    other(None, first, 0, 3)
    run_ranks(3, groupshard_stage, first, second, 3, 6, strategy)
    found = other(second, None, 6, 9)
    assert _state_difference(found, *_reference_steps(9)) <= TOLERANCE


FAMILIES = {
    "lamb": lambda groups: gs.optim.LAMB(groups, lr=1e-2),
    "lars": lambda groups: gs.optim.LARS(groups, lr=0.5, trust_coefficient=0.01),
    "larc": lambda groups: gs.optim.LARC(torch.optim.SGD(groups, lr=0.05, momentum=0.9)),
    "agc": lambda groups: gs.optim.AGC(torch.optim.AdamW(groups, lr=3e-3)),
    "muon": lambda groups: gs.optim.Muon(groups, lr=0.02, weight_decay=0.01),
    "whole adafactor": lambda groups: gs.optim.WholeParamOptimizer(
        groups, torch.optim.Adafactor, lr=1e-2
    ),
}


def _family_model(name, seed, mesh_shape=None):
    torch.manual_seed(seed)
    model = EdgeGPT()
    groups = gs.muon_groups(model) if name == "muon" else three_groups(model, 1e-2)
    mesh = None
    if mesh_shape is not None:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    model = gs.shard(model, groups, unit=UNITS, mesh=mesh)
    return model, FAMILIES[name](model.optimizer_groups())


def _full(model, optimizer):
    """Copies: like torch's ``state_dict()``, an owner's state dict holds its live tensors."""
    optim = gs.optim_state_dict(model, optimizer)
    optim = {**optim, "state": copy.deepcopy(optim["state"])}
    return gs.full_state_dict(model), optim


def family_case(rank, world_size, path, name, phase, mesh_shape=None):
    """``save``: 3 steps, saved with torch's idiom; ``load``: another seed, loaded with
    torch's idiom, then 3 more steps; ``whole``: 6 steps uninterrupted. Returns the full
    model and optimizer state after the save or the load, and the model's at the end."""
    model, optimizer = _family_model(name, 123 if phase == "load" else 0, mesh_shape)
    if phase == "load":
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])  # fmt: skip
        loaded = _full(model, optimizer)
    steps = {"save": batches()[:3], "load": batches()[3:6], "whole": batches()[:6]}[phase]
    train(model, optimizer, steps, rank, world_size)
    if phase == "save":
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
        loaded = _full(model, optimizer)
    return (loaded if phase != "whole" else None), gs.full_state_dict(model)


def _same_state(first, second):
    """The largest difference of two (model, optimizer) full states; inf where keys differ."""
    (model_a, optim_a), (model_b, optim_b) = first, second
    if optim_a["state"].keys() != optim_b["state"].keys():
        return float("inf")
    difference = max_difference(model_a, model_b)
    for fqn, keys in optim_a["state"].items():
        for key, value in keys.items():
            other = optim_b["state"][fqn][key]
            if isinstance(value, torch.Tensor):
                difference = max(difference, (value.double() - other.double()).abs().max().item())
            elif value != other:
                return float("inf")
    lrs = [[g["lr"] for g in o["param_groups"]] for o in (optim_a, optim_b)]
    return difference if lrs[0] == lrs[1] else float("inf")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_optimizer_family_round_trips(run_ranks, tmp_path, name):
    """Saved at world 2 with torch's idiom: loaded at world 3 the model and every state
    are bit for bit the saved ones; loaded at world 2, 3 more steps equal 6 uninterrupted
    ones. (Training on at world 3 is not compared with world 2's: Muon's bf16
    Newton-Schulz turns world 2's and 3's gradient rounding into 1.8e-3 apart after 6
    steps without any checkpoint.)"""
    path = str(tmp_path / "ckpt")
    saved, _ = run_ranks(2, family_case, path, name, "save")[0]
    loaded, _ = run_ranks(3, family_case, path, name, "load")[0]
    assert _same_state(loaded, saved) == 0
    _, resumed = run_ranks(2, family_case, path, name, "load")[0]
    _, whole = run_ranks(2, family_case, path, name, "whole")[0]
    assert max_difference(resumed, whole) <= TOLERANCE


def test_hybrid_mesh_round_trip(run_ranks, tmp_path):
    """HSDP (2 replicas x 2 shards) saves with torch's idiom (the replicas' identical
    blocks written once) and loads into a 1-D world of 3 bit for bit; saved at world 2,
    it loads onto the mesh and trains on like 6 uninterrupted steps there."""
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    saved, _ = run_ranks(4, family_case, first, "lamb", "save", (2, 2))[0]
    loaded, _ = run_ranks(3, family_case, first, "lamb", "load")[0]
    assert _same_state(loaded, saved) == 0
    run_ranks(2, family_case, second, "lamb", "save")
    _, resumed = run_ranks(4, family_case, second, "lamb", "load", (2, 2))[0]
    _, whole = run_ranks(4, family_case, second, "lamb", "whole", (2, 2))[0]
    assert max_difference(resumed, whole) <= TOLERANCE


def zero_case(rank, world_size, path, phase):
    """DDP + gs.ZeroRedundancyOptimizer through torch's idiom: its state by parameter name,
    each rank's slices as pieces."""
    torch.manual_seed(123 if phase == "load" else 0)
    model = EdgeGPT()
    zero = gs.ZeroRedundancyOptimizer(three_groups(model, 1e-2), torch.optim.AdamW, lr=3e-3)
    ddp = DDP(model)
    if phase == "load":
        model_state, optim_state = get_state_dict(ddp, zero)
        assert any(
            isinstance(v, ParamPiece) for s in optim_state["state"].values() for v in s.values()
        )
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(ddp, zero, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])  # fmt: skip
    steps = {"save": batches()[:3], "load": batches()[3:6], "whole": batches()[:6]}[phase]
    train(ddp, zero, steps, rank, world_size)
    if phase == "save":
        model_state, optim_state = get_state_dict(ddp, zero)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_ddp_with_zero_round_trips_through_torch_idiom(run_ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(3, zero_case, path, "save")
    resumed = run_ranks(2, zero_case, path, "load")[0]
    whole = run_ranks(2, zero_case, path, "whole")[0]
    assert max_difference(resumed, whole) <= TOLERANCE


def refusal_case(rank, world_size):
    """What torch's state-dict API cannot be given for a sharded model, refused on every
    rank with what to do instead."""
    model, optimizer = sharded(rank, world_size)
    parent = nn.Sequential(model)
    messages = []
    for call in (
        lambda: get_model_state_dict(parent),
        lambda: get_optimizer_state_dict(parent, optimizer),
        lambda: get_optimizer_state_dict(model, [optimizer, optimizer]),
    ):
        try:
            call()
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_what_cannot_apply_is_refused_on_every_rank(run_ranks):
    for messages in run_ranks(2, refusal_case):
        assert len(messages) == 3
        assert "Pass the sharded module itself" in messages[0]
        assert "Pass the sharded module itself" in messages[1]
        assert "one optimizer over all its groups" in messages[2]


def compiled_case(rank, world_size, path):
    """torch.compile's wrapper around a sharded model: the same names, and a round trip."""
    model, optimizer = sharded(rank, world_size)
    train(model, optimizer, batches()[:2], rank, world_size)
    compiled = torch.compile(model, backend="eager")
    model_state, optim_state = get_state_dict(compiled, optimizer)
    plain_names = set(get_model_state_dict(model))
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    target, target_optimizer = sharded(rank, world_size, seed=8)
    target_compiled = torch.compile(target, backend="eager")
    model_state, optim_state = get_state_dict(target_compiled, target_optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(target_compiled, target_optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])  # fmt: skip
    same = _same_state(_full(model, optimizer), _full(target, target_optimizer))
    return set(model_state) == plain_names, same


def test_a_compiled_sharded_model(run_ranks, tmp_path):
    for same_names, difference in run_ranks(2, compiled_case, str(tmp_path / "ckpt")):
        assert same_names and difference == 0
