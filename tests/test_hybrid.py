"""Hybrid sharding (HSDP) on a 2-D DeviceMesh at world 4: the same training as one process
on the global batch, 1/S of the model per rank, the collectives as designed, and bad meshes
refused on every rank."""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import groupshard as gs
import test_checkpoint as checkpoints
import test_muon as muon
from groupshard import comm
from groupshard.cli.model import GPT, Block
from groupshard.mesh import MESH_DIM_NAMES

from helpers import (
    BATCH_PER_RANK,
    TINY,
    UNITS,
    EdgeGPT,
    global_batches,
    max_difference,
    three_groups,
    train_side_by_side,
)

SHAPES = ((2, 2), (1, 4), (4, 1))
OPTIMIZERS = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=3e-3),
    "lamb": lambda groups: gs.optim.LAMB(groups, lr=3e-3),
}


def hsdp_mesh(shape: tuple[int, int]) -> DeviceMesh:
    return init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIM_NAMES)


def _train(
    rank: int, world_size: int, mesh: DeviceMesh, strategy: str, optimizer: str, steps: int,
    overlap: bool = True,
) -> tuple[gs.ShardedModule, torch.optim.Optimizer, float]:
    """Train a sharded model on this rank's part of each global batch and the unsharded
    reference on all of it; the largest difference of their weights."""
    torch.manual_seed(0)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    sharded = gs.shard(
        model, three_groups(model, head_lr=1e-3), unit=UNITS, strategy=strategy, mesh=mesh,
        reduce_bucket_bytes=0, prefetch_bytes=0, overlap=overlap,
    )  # fmt: skip
    opt = OPTIMIZERS[optimizer](sharded.optimizer_groups())
    reference_opt = OPTIMIZERS[optimizer](three_groups(reference, head_lr=1e-3))
    train_side_by_side(sharded, opt, reference, reference_opt, steps, rank, world_size)
    return sharded, opt, max_difference(gs.full_state_dict(sharded), reference.state_dict())


def equivalence_case(rank: int, world_size: int) -> dict[str, Any]:
    """Every mesh shape, strategy and optimizer; and each rank's share of the model."""
    differences, shares = {}, {}
    for shape in SHAPES:
        mesh = hsdp_mesh(shape)
        for strategy in ("full", "grad_op"):
            for optimizer in OPTIMIZERS:
                sharded, _, difference = _train(rank, world_size, mesh, strategy, optimizer, 4)
                differences[f"{shape} {strategy} {optimizer}"] = difference
        if shape == (2, 2):  # every collective where it is needed, none in the background
            _, _, difference = _train(rank, world_size, mesh, "full", "adamw", 4, overlap=False)
            differences[f"{shape} full adamw, overlap off"] = difference
        storages = sharded.groupshard.storages
        shares[shape] = (
            sum(s.layout.local_numel for s in storages),
            sum(b.padded_numel for s in storages for b in s.layout.buffers),
            sum(b.padded_numel - b.numel for s in storages for b in s.layout.buffers),
            len([b for s in storages for b in s.layout.buffers]),
        )
    return {"differences": differences, "shares": shares}


def test_hsdp_trains_as_one_process_on_the_global_batch(run_ranks):
    results = run_ranks(4, equivalence_case, timeout=300)
    for rank, result in enumerate(results):
        for case, difference in result["differences"].items():
            assert difference < 1e-5, (rank, case, difference)
        for (replicas, shard_size), (local, padded, padding, buffers) in result["shares"].items():
            assert local * shard_size == padded, (replicas, shard_size)  # exactly 1/S
            assert padding < shard_size * buffers  # less than S elements per flat buffer
    assert len(results[0]["differences"]) == len(SHAPES) * 2 * len(OPTIMIZERS) + 1


def _counted(counts: Counter[str], mesh_of: dict[int, str], name: str) -> Any:
    """``comm.name`` counting the calls that communicate, by group: shard, replicate, world."""
    original = getattr(comm, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ranks = next(a for a in [*args, *kwargs.values()] if isinstance(a, comm.Ranks))
        if not ranks.is_local:  # a group of the whole world counts as "world"
            group = "world" if ranks.size == 4 else mesh_of[id(ranks.group)]
            counts[f"{name} {group}"] += 1
        return original(*args, **kwargs)

    return wrapper


def count_case(rank: int, world_size: int, shape: tuple[int, int], strategy: str) -> dict:
    torch.manual_seed(0)
    mesh = hsdp_mesh(shape)
    model = EdgeGPT()
    sharded = gs.shard(
        model, three_groups(model, 1e-3), unit=UNITS, strategy=strategy, mesh=mesh,
        reduce_bucket_bytes=0, prefetch_bytes=0,
    )  # fmt: skip
    optimizer = gs.optim.LAMB(sharded.optimizer_groups(), lr=1e-3)
    inputs, targets = global_batches(1, world_size)[0]
    sharded(inputs, targets).backward()  # a first step records the order units run in
    optimizer.step()
    optimizer.zero_grad()
    mesh_of = {id(mesh.get_group(dim)): dim for dim in MESH_DIM_NAMES}
    counts: Counter[str] = Counter()
    names = ("all_gather", "reduce_scatter_mean", "all_reduce_mean", "all_reduce_max",
             "all_reduce_sum", "broadcast", "gather_objects")  # fmt: skip
    with mock.patch.multiple(comm, **{n: _counted(counts, mesh_of, n) for n in names}):
        sharded(inputs, targets).backward()
        gs.clip_grad_norm_(sharded, 1.0)
        optimizer.step()
        optimizer.zero_grad()
    units = sum(1 for u in sharded.groupshard.runtime.units if u.storages)
    return {"counts": dict(counts), "units": units}


def test_collectives_per_step_as_designed(run_ranks):
    """HSDP: gathers and reduce-scatters within the shard group, one all-reduce per bucket
    across replicas, norms (clipping, LAMB's trust ratios) over the shard group only."""
    for shape, strategy in (((2, 2), "full"), ((2, 2), "grad_op"), ((4, 1), "full"),
                            ((2, 2), "no_shard")):  # fmt: skip
        result = run_ranks(4, count_case, shape, strategy)[0]
        units = result["units"]
        gathers = {"full": 2 * units - 1, "grad_op": units, "no_shard": 0}[strategy]
        if shape == (4, 1) or strategy == "no_shard":  # nothing sharded: DDP over the world
            expected = {"all_reduce_mean world": units}
        else:
            expected = {
                "all_gather shard": gathers,
                "reduce_scatter_mean shard": units,
                "all_reduce_mean replicate": units,
                "all_reduce_sum shard": 2,  # clipping's norm, LAMB's norms (one each)
            }
        expected["all_reduce_max world"] = 1  # used flags and orders, over every rank
        counts = {k: v for k, v in result["counts"].items() if v}
        assert counts == {k: v for k, v in expected.items() if v}, (shape, strategy, counts)


def bad_mesh_case(rank: int, world_size: int) -> dict[str, str]:
    """Each bad mesh on every rank: the error's type and message, per case."""
    two_by_two = hsdp_mesh((2, 2))
    transposed = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=MESH_DIM_NAMES)
    meshes = {
        "wrong names": DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "fsdp")),
        "3-D": init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", *MESH_DIM_NAMES)),
        "not the world": DeviceMesh("cpu", [0, 1]),
        "different meshes": transposed if rank == 0 else two_by_two,
        "mesh and process group": two_by_two,
    }
    errors = {}
    for case, mesh in meshes.items():
        torch.manual_seed(0)
        model = EdgeGPT()
        extra = {"process_group": None if case != "mesh and process group" else
                 torch.distributed.group.WORLD}  # fmt: skip
        try:
            gs.shard(model, three_groups(model, 1e-3), unit=UNITS, mesh=mesh, **extra)
            errors[case] = "no error"
        except (ValueError, TypeError) as error:
            errors[case] = f"{type(error).__name__}: {error}"
    return errors


def test_bad_meshes_fail_on_every_rank(run_ranks):
    expected = {
        "wrong names": "mesh_dim_names=('replicate', 'shard')",
        "3-D": "but got a 3-D mesh",
        "not the world": "every rank of the world (4 ranks)",
        "different meshes": "mesh on rank 0 is",
        "mesh and process group": "either process_group or mesh",
    }
    for rank, errors in enumerate(run_ranks(4, bad_mesh_case)):
        for case, phrase in expected.items():
            assert errors[case].startswith("ValueError") and phrase in errors[case], (
                rank, case, errors[case])  # fmt: skip


def layout_case(
    rank: int, world_size: int, shape: tuple[int, int], load: str | None, save: str
) -> dict[str, torch.Tensor]:
    """Under a ``shape`` mesh: train the first steps (``load`` None) or load ``load``; save
    to ``save``; the full state dict as loaded or trained."""
    torch.manual_seed(0 if load is None else 123)
    model = EdgeGPT()
    model = gs.shard(model, three_groups(model, 1e-2), unit=UNITS, mesh=hsdp_mesh(shape))
    optimizer = torch.optim.AdamW(model.optimizer_groups(), lr=3e-3)
    if load is None:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, checkpoints.lr_lambda)
        steps = checkpoints.batches()[: checkpoints.RESUME_AT]
        checkpoints.train(model, optimizer, steps, rank, world_size, scheduler)
        extra = {"step": checkpoints.RESUME_AT, "seed": torch.arange(3)}
    else:
        extra = gs.checkpoint.load(load, model, optimizer)
    gs.checkpoint.save(save, model, optimizer, extra=extra)
    return gs.full_state_dict(model)


def _bytes_of(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def test_checkpoints_across_layouts(run_ranks, tmp_path):
    """2x2 -> 1x4 -> 4x1 -> 2 ranks (full) and one process, each continuing the same run."""
    paths = [str(tmp_path / name) for name in ("2x2", "1x4", "4x1")]
    trained = run_ranks(4, layout_case, (2, 2), None, paths[0])[0]
    for shape, load, save in (((1, 4), paths[0], paths[1]), ((4, 1), paths[1], paths[2])):
        loaded = run_ranks(4, layout_case, shape, load, save)[0]
        assert max_difference(loaded, trained) == 0, shape
    # each piece written once: the 2x2 checkpoint is no larger than the 1x4 one
    assert _bytes_of(Path(paths[0])) <= 1.05 * _bytes_of(Path(paths[1]))
    expected_lrs = [3e-3 / (1 + checkpoints.RESUME_AT)] * 2 + [1e-2 / (1 + checkpoints.RESUME_AT)]
    results = [*run_ranks(2, checkpoints.resume_case, paths[2], "blocks", "full"),
               checkpoints.resume_case(0, 1, paths[2], "blocks", "full")]  # fmt: skip
    for difference, lrs, step, seed in results:
        assert lrs == pytest.approx(expected_lrs)
        assert step == checkpoints.RESUME_AT and seed == [0, 1, 2]
        assert difference <= 1e-5


def _accumulation_difference(rank: int, world_size: int, mode: str) -> dict[str, Any]:
    """Two micro-batches per step, the first without gradient sync (``no_sync``) or without
    the all-reduce across replicas (``set_requires_all_reduce(False)``), against one process
    on both global micro-batches; per-parameter gradient norms and clipping on the way."""
    torch.manual_seed(0)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    sharded = gs.shard(model, three_groups(model, 1e-3), unit=UNITS, mesh=hsdp_mesh((2, 2)))
    opt = gs.optim.LAMB(sharded.optimizer_groups(), lr=3e-3)
    reference_opt = gs.optim.LAMB(three_groups(reference, 1e-3), lr=3e-3)
    batches = global_batches(6, world_size)
    local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    refused, norms = False, 0.0
    for first, second in zip(batches[::2], batches[1::2], strict=True):
        if mode == "no_sync":
            with sharded.no_sync():
                sharded(first[0][local], first[1][local]).backward()
        else:
            sharded.set_requires_all_reduce(False)
            sharded(first[0][local], first[1][local]).backward()
            try:
                opt.step()  # the gradients are not averaged across replicas yet
            except RuntimeError as error:
                refused = "set_requires_all_reduce(False)" in str(error)
            sharded.set_requires_all_reduce(True)
        sharded(second[0][local], second[1][local]).backward()
        for inputs, targets in (first, second):
            reference(inputs, targets).backward()
        ours, theirs = gs.grad_norms(sharded), {
            name: torch.linalg.vector_norm(p.grad) for name, p in reference.named_parameters()
            if p.grad is not None
        }  # fmt: skip
        norms = max(norms, max(abs(ours[k] - theirs[k]).item() for k in theirs))
        total = gs.clip_grad_norm_(sharded, 0.5)
        reference_total = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        norms = max(norms, abs(total - reference_total).item())
        for o in (opt, reference_opt):
            o.step()
            o.zero_grad()
    weights = max_difference(gs.full_state_dict(sharded), reference.state_dict())
    return {"weights": weights, "norms": norms, "refused": refused}


def _bf16_state(mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = EdgeGPT()
    policy = gs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    sharded = gs.shard(model, three_groups(model, 1e-3), unit=UNITS, mesh=mesh,
                       mixed_precision=policy)  # fmt: skip
    opt = torch.optim.AdamW(sharded.optimizer_groups(), lr=3e-3)
    rank = torch.distributed.get_rank()
    local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    for inputs, targets in global_batches(3, 4):
        sharded(inputs[local], targets[local]).backward()
        opt.step()
        opt.zero_grad()
    return gs.full_state_dict(sharded)


def meta_state(mesh: DeviceMesh | None) -> dict[str, torch.Tensor]:
    """A GPT built on the meta device, sharded and initialized by gs.shard."""
    torch.manual_seed(7)
    with torch.device("meta"):
        model = GPT(TINY)
    sharded = gs.shard(model, gs.decay_groups(model, 0.1), unit=Block, mesh=mesh,
                       param_init_fn=GPT._init_weights)  # fmt: skip
    return gs.full_state_dict(sharded)


def muon_case(rank: int, world_size: int) -> list[str]:
    """gs.optim.Muon under HSDP, owners within each shard group, against torch's Muon with
    the same full gradients: the parameters that differ at all."""
    torch.manual_seed(0)
    model = muon.OddNet()
    reference = copy.deepcopy(model)
    groups, mesh = muon.make_groups(model), hsdp_mesh((2, 2))
    sharded = gs.shard(model, groups, unit=muon.OddBlock, mesh=mesh)
    ours = [muon.make_muon(sharded.optimizer_groups())]
    theirs = muon.reference_optimizers(reference)
    for step in range(3):
        grads = muon.full_gradients(reference, step)
        muon.step_with(grads, ours, sharded=sharded)
        muon.step_with(grads, theirs, model=reference)
    return muon.mismatches(gs.full_state_dict(sharded), reference.state_dict())


def exactness_case(rank: int, world_size: int) -> dict[str, Any]:
    bf16 = max_difference(_bf16_state(hsdp_mesh((2, 2))), _bf16_state(hsdp_mesh((1, 4))))
    return {
        **{
            mode: _accumulation_difference(rank, world_size, mode)
            for mode in ("no_sync", "no_all_reduce")
        },
        "bf16 2x2 vs 1x4": bf16,
        "meta": meta_state(hsdp_mesh((2, 2))),
        "muon": muon_case(rank, world_size),
    }


def test_what_is_exact_stays_exact(run_ranks):
    """Under a 2x2 mesh: accumulation both ways, per-parameter norms and clipping, LAMB,
    bf16, meta-device init (the same weights as one process) and Muon (torch's, bitwise)."""
    single = meta_state(None)
    for result in run_ranks(4, exactness_case, timeout=240):
        for mode in ("no_sync", "no_all_reduce"):
            assert result[mode]["weights"] < 1e-5 and result[mode]["norms"] < 1e-5, result
        assert result["no_all_reduce"]["refused"]
        assert result["bf16 2x2 vs 1x4"] < 1e-5
        assert max_difference(result["meta"], single) == 0
        assert result["muon"] == []


def zero_case(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """gs.ZeroRedundancyOptimizer over each shard group of a 2x2 mesh (ZeRO-1 within, DDP
    across, as torch's with a process_group), beside one process on the global batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = hsdp_mesh((2, 2)).get_group("shard")
    torch.manual_seed(0)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    zero = gs.ZeroRedundancyOptimizer(
        three_groups(model, 1e-3), torch.optim.AdamW, process_group=group, lr=3e-3
    )
    reference_opt = torch.optim.AdamW(three_groups(reference, 1e-3), lr=3e-3)
    ddp = DDP(model)
    local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    for inputs, targets in global_batches(4, world_size):
        ddp(inputs[local], targets[local]).backward()
        zero.step()
        zero.zero_grad()
        reference(inputs, targets).backward()
        reference_opt.step()
        reference_opt.zero_grad()
    zero.consolidate_state_dict(to=0)  # group rank 0 of each shard group
    held = len(zero.state_dict()["state"]) if zero.rank == 0 else None
    gs.checkpoint.save(path, ddp, zero)  # by the whole world, each piece once
    return {
        "reference": (reference.state_dict(), reference_opt.state_dict()),
        "difference": max_difference(model.state_dict(), reference.state_dict()),
        "group rank": zero.rank,
        "group size": zero.world_size,
        "consolidated states": held,
        "parameters": len([p for p in model.parameters() if p.requires_grad]),
    }


def test_zero_optimizer_within_a_process_group(run_ranks, tmp_path):
    path, output = str(tmp_path / "zero"), str(tmp_path / "plain.pt")
    results = run_ranks(4, zero_case, path)
    assert [(r["group rank"], r["group size"]) for r in results] == [(0, 2), (1, 2)] * 2
    for result in results:
        assert result["difference"] < 1e-5
        if result["group rank"] == 0:  # every parameter's state, gathered within the group
            assert result["consolidated states"] == result["parameters"]
    gs.checkpoint.to_torch_save(path, output)
    saved = torch.load(output, weights_only=True)
    model_state, optimizer_state = results[0]["reference"]
    assert max_difference(saved["model"], model_state) < 1e-5
    states = saved["optim"]["state"]
    assert sorted(states) == sorted(optimizer_state["state"])
    for index, state in optimizer_state["state"].items():
        assert max_difference(states[index], state) < 1e-5, index


def used_on_one_rank_case(rank: int, world_size: int, accumulate: bool) -> dict[str, Any]:
    """A matrix that only rank 3 (in the second replica) uses: every replica must step it
    (it had a gradient on some rank), else the replicas part ways. With ``accumulate``,
    every rank uses it in the first of two micro-batches, reduced without the all-reduce
    across replicas (``set_requires_all_reduce(False)``): it had a gradient in that step."""
    torch.manual_seed(0)
    model = muon.OddNet()
    before = model.blocks[0].mix.weight.detach().clone()
    sharded = gs.shard(model, muon.make_groups(model), unit=muon.OddBlock, mesh=hsdp_mesh((2, 2)))
    optimizer = torch.optim.AdamW(sharded.optimizer_groups(), lr=1e-2, weight_decay=0.1)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(2):
        for micro_batch in range(2 if accumulate else 1):
            sharded.set_requires_all_reduce(not accumulate or micro_batch == 1)
            sharded.blocks[0].use_mix = micro_batch == 0 if accumulate else rank == 3
            idx = torch.randint(0, muon.VOCAB, (2, muon.SEQ), generator=generator)
            sharded(idx, idx.roll(1, dims=1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    state = gs.full_state_dict(sharded)
    return {"state": state, "moved": not torch.equal(state["blocks.0.mix.weight"], before)}


def test_a_parameter_used_on_one_rank_moves_on_every_replica(run_ranks):
    for accumulate in (False, True):
        results = run_ranks(4, used_on_one_rank_case, accumulate)
        for result in results:
            assert result["moved"], accumulate
            assert max_difference(result["state"], results[0]["state"]) == 0
