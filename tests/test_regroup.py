"""gs.regroup: param groups changed after sharding (unfreeze, move, freeze) train as one
process does with torch's idiom (requires_grad_, add_param_group, edited param_groups);
errors on every rank; checkpoints across a regroup."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import groupshard as gs
from groupshard.cli.model import GPT, Block

from helpers import BATCH_PER_RANK, TINY, global_batches, max_difference

STEPS = 8
UNFREEZE_AT, MOVE_AT, FREEZE_AT = 2, 4, 6
NEW_BLOCK = {"lr": 2e-3, "weight_decay": 0.05}
BIASES = {"lr": 5e-3, "weight_decay": 0.0}

OPTIMIZERS: dict[str, Callable[[list[dict[str, Any]]], torch.optim.Optimizer]] = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=3e-3),
    "lamb": lambda groups: gs.optim.LAMB(groups, lr=3e-3),
}
LAYERWISE: dict[str, Callable[[list[dict[str, Any]]], torch.optim.Optimizer]] = {
    "lars": lambda groups: gs.optim.LARS(groups, lr=3e-2),
    "larc": lambda groups: gs.optim.LARC(torch.optim.SGD(groups, lr=3e-2, momentum=0.9)),
    "agc": lambda groups: gs.optim.AGC(torch.optim.AdamW(groups, lr=3e-3)),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = GPT(TINY)
    for param in model.blocks[1].parameters():
        param.requires_grad_(False)  # frozen at shard time, unfrozen after UNFREEZE_AT steps
    return model


def _names(model: nn.Module, prefix: str) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.startswith(prefix)]


def _moves_every_bias(name: str) -> bool:
    return True


def _moved(name: str, moving: Callable[[str], bool]) -> bool:
    """Moved to a group of their own at MOVE_AT: the biases, and one matrix (its flat
    buffer in blocks.0 then merges pieces of two old ones, each with its own moments)."""
    return (name.endswith(".bias") and moving(name)) or name == "blocks.0.fc.weight"


def _phase_groups(
    names: list[str], phase: int, moving: Callable[[str], bool] = _moves_every_bias
) -> list[tuple[list[str], dict[str, Any]]]:
    """The groups by name after ``phase`` changes: 0 decay / no-decay without blocks.1;
    1 plus blocks.1 in a group of its own; 2 the biases moved to a group of their own;
    3 blocks.0 frozen."""
    frozen = {"blocks.1."} if phase == 0 else {"blocks.0."} if phase == 3 else set()
    kept = [n for n in names if not any(n.startswith(f) for f in frozen)]
    new_block = [n for n in kept if n.startswith("blocks.1.")] if phase >= 1 else []
    biases = [n for n in kept if _moved(n, moving)] if phase >= 2 else []
    rest = [n for n in kept if n not in new_block and n not in biases]
    groups = [
        ([n for n in rest if not _is_vector(n)], {"weight_decay": 0.1}),
        ([n for n in rest if _is_vector(n)], {"weight_decay": 0.0}),
    ]
    if phase >= 1:
        groups.append(([n for n in new_block if n not in biases], NEW_BLOCK))
    if phase >= 2:
        groups.append((biases, BIASES))
    return groups


def _is_vector(name: str) -> bool:
    return name.endswith(".bias") or ".ln_" in name


def _as_dicts(groups: list[tuple[list[str], dict[str, Any]]], model: nn.Module) -> list[dict]:
    return [{"params": [model.get_parameter(n) for n in names], **o} for names, o in groups]


def _average_gradients(model, world_size):
    """What DDP does to a plain model's gradients (a gs.ZeroRedundancyOptimizer steps it)."""
    import torch.distributed as dist

    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad /= world_size


def _torch_idiom(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    names: list[str],
    phase: int,
    moving: Callable[[str], bool] = _moves_every_bias,
) -> None:
    """One process changes its groups the way torch users do."""
    params = dict(model.named_parameters())
    if phase == 1:  # unfreeze blocks.1 into a new group
        block = [params[n] for n in _names(model, "blocks.1.")]
        for param in block:
            param.requires_grad_(True)
        opt.add_param_group({"params": block, **NEW_BLOCK})
    if phase == 2:  # move every bias into a new group, keeping its state
        biases = [params[n] for n in names if _moved(n, moving)]
        for group in opt.param_groups:
            group["params"] = [p for p in group["params"] if all(p is not b for b in biases)]
        opt.add_param_group({"params": biases, **BIASES})
    if phase == 3:  # freeze blocks.0, dropping its state
        block = [params[n] for n in _names(model, "blocks.0.")]
        for param in block:
            param.requires_grad_(False)
            opt.state.pop(param, None)
        for group in opt.param_groups:
            group["params"] = [p for p in group["params"] if all(p is not b for b in block)]


def _regroup_case(
    rank: int, world_size: int, strategy: str, optimizer: str, mesh: Any = None
) -> float:
    model = _model()
    reference = copy.deepcopy(model)
    names = [n for n, _ in reference.named_parameters()]
    sharded = gs.shard(model, _as_dicts(_phase_groups(names, 0), model), unit=Block,
                       strategy=strategy, mesh=mesh)  # fmt: skip
    make = {**OPTIMIZERS, **LAYERWISE}[optimizer]
    opt = make(sharded.optimizer_groups())
    reference_opt = make(_as_dicts(_phase_groups(names, 0), reference))
    phase_at = {UNFREEZE_AT: 1, MOVE_AT: 2, FREEZE_AT: 3}
    worst = 0.0
    for step, (inputs, targets) in enumerate(global_batches(STEPS, world_size)):
        if step in phase_at:
            phase = phase_at[step]
            gs.regroup(sharded, opt, _as_dicts(_phase_groups(names, phase), sharded))
            _torch_idiom(reference, reference_opt, names, phase)
            assert len(opt.param_groups) == len(reference_opt.param_groups)
        local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
        loss = sharded(inputs[local], targets[local])
        loss.backward()
        reference(inputs, targets).backward()
        for o in (opt, reference_opt):
            o.step()
            o.zero_grad()
        worst = max(worst, max_difference(gs.full_state_dict(sharded), reference.state_dict()))
    frozen = [n for n, p in reference.named_parameters() if not p.requires_grad]
    assert frozen == _names(reference, "blocks.0.")
    assert [n for n in names if not sharded.get_parameter(n).requires_grad] == frozen
    return worst


@pytest.mark.parametrize("world_size", [2, 3])
def test_regroup_trains_as_torch_idiom(run_ranks, world_size: int) -> None:
    """Unfreeze a block into a new group, move the biases, freeze a block: every step
    equal to one process doing the same with torch's idiom, for every strategy, AdamW and
    LAMB (all cases in one task on the rank pool)."""
    differences = run_ranks(world_size, _all_regroup_cases, timeout=240)
    for case, difference in differences[0].items():
        assert difference < 1e-5, (case, difference)


def test_regroup_under_hybrid_sharding(run_ranks) -> None:
    """The same changes on a 2 x 2 ("replicate", "shard") mesh: the rebuilt storages keep
    the all-reduce across replicas (else the replicas drift apart and from one process)."""
    differences = run_ranks(4, _hybrid_regroup_cases, timeout=240)
    for case, difference in differences[0].items():
        assert difference < 1e-5, (case, difference)


def test_regroup_refuses_gradients_held_for_the_all_reduce_across_replicas(run_ranks):
    """After a backward with set_requires_all_reduce(False) the shards' gradients wait on
    each rank for the all-reduce across replicas; re-laying out would drop them."""
    for message in run_ranks(4, _held_gradients_case, timeout=240):
        assert "gradient accumulation is in progress" in message, message


def _held_gradients_case(rank: int, world_size: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    sharded = gs.shard(model, _as_dicts(_phase_groups(names, 0), model), unit=Block, mesh=mesh)
    opt = torch.optim.AdamW(sharded.optimizer_groups(), lr=3e-3)
    sharded.set_requires_all_reduce(False)
    inputs, targets = global_batches(1, world_size)[0]
    local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    sharded(inputs[local], targets[local]).backward()
    for shard in sharded.parameters():
        shard.grad = None  # only the gradients held for the replicas are left
    with pytest.raises(ValueError) as error:
        gs.regroup(sharded, opt, _as_dicts(_phase_groups(names, 1), sharded))
    return str(error.value)


def test_regroup_with_layerwise_optimizers(run_ranks) -> None:
    """LARS, and the LARC and AGC wrappers (their inner optimizer's groups and state),
    through the same changes at world 2."""
    differences = run_ranks(2, _layerwise_regroup_cases, timeout=240)
    for case, difference in differences[0].items():
        assert difference < 1e-5, (case, difference)


def _layerwise_regroup_cases(rank: int, world_size: int) -> dict[str, float]:
    return {name: _regroup_case(rank, world_size, "full", name) for name in LAYERWISE}


def _hybrid_regroup_cases(rank: int, world_size: int) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return {
        strategy: _regroup_case(rank, world_size, strategy, "adamw", mesh)
        for strategy in ("full", "grad_op")
    }


def _all_regroup_cases(rank: int, world_size: int) -> dict[str, float]:
    return {
        f"{strategy}/{optimizer}": _regroup_case(rank, world_size, strategy, optimizer)
        for strategy in ("full", "grad_op", "no_shard")
        for optimizer in OPTIMIZERS
    }


def _train(sharded: nn.Module, opt: torch.optim.Optimizer, batches: list, rank: int) -> None:
    local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    for inputs, targets in batches:
        sharded(inputs[local], targets[local]).backward()
        opt.step()
        opt.zero_grad()


def _sharded_at(phase: int, names: list[str]) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model sharded with phase ``phase``'s groups (its frozen parameters frozen then)."""
    model = _model()
    groups = _phase_groups(names, phase)
    trainable = {n for group_names, _ in groups for n in group_names}
    for name, param in model.named_parameters():
        param.requires_grad_(name in trainable)
    sharded = gs.shard(model, _as_dicts(groups, model), unit=Block, strategy="full")
    return sharded, torch.optim.AdamW(sharded.optimizer_groups(), lr=3e-3)


def _checkpoint_case(rank: int, world_size: int, folder: str) -> list[float]:
    names = [n for n, _ in _model().named_parameters()]
    batches = global_batches(6, world_size)
    first, second = os.path.join(folder, "before"), os.path.join(folder, "after")
    trained, opt = _sharded_at(0, names)
    _train(trained, opt, batches[:2], rank)
    gs.checkpoint.save(first, trained, opt)
    gs.regroup(trained, opt, _as_dicts(_phase_groups(names, 1), trained))
    _train(trained, opt, batches[2:4], rank)
    gs.checkpoint.save(second, trained, opt)
    _train(trained, opt, batches[4:], rank)
    expected = gs.full_state_dict(trained)
    # saved before the regroup, loaded into a model regrouped the same way
    before, before_opt = _sharded_at(0, names)
    gs.checkpoint.load(first, before, before_opt)
    gs.regroup(before, before_opt, _as_dicts(_phase_groups(names, 1), before))
    _train(before, before_opt, batches[2:], rank)
    # saved after the regroup, loaded into a model sharded with the new groups
    after, after_opt = _sharded_at(1, names)
    gs.checkpoint.load(second, after, after_opt)
    _train(after, after_opt, batches[4:], rank)
    return [max_difference(gs.full_state_dict(model), expected) for model in (before, after)]


def test_checkpoint_across_regroup(run_ranks, tmp_path) -> None:
    """A checkpoint saved before a regroup loads into a model regrouped the same way, one
    saved after it into a model sharded with the new groups: the same training, bit for
    bit (the same layouts, the same arithmetic)."""
    assert run_ranks(2, _checkpoint_case, str(tmp_path), timeout=120)[0] == [0.0, 0.0]


def _expect_error(fn: Callable[[], Any], *needles: str) -> str:
    try:
        fn()
    except (ValueError, TypeError) as error:
        message = str(error)
        assert all(needle in message for needle in needles), message
        return message
    raise AssertionError(f"expected an error naming {needles}")


def _error_cases(rank: int, world_size: int) -> dict[str, str]:
    names = [n for n, _ in _model().named_parameters()]
    batches = global_batches(2, world_size)
    sharded, opt = _sharded_at(0, names)
    _train(sharded, opt, batches[:1], rank)
    seen = {}
    # ranks passing different groups: a ValueError on every rank, nothing changed
    groups = _phase_groups(names, 1)
    if rank == 1:
        groups[2] = (groups[2][0], {**NEW_BLOCK, "lr": 1.0})
    seen["hyperparameters differ"] = _expect_error(
        lambda: gs.regroup(sharded, opt, _as_dicts(groups, sharded)), "gs.regroup", "rank 1"
    )
    groups = _phase_groups(names, 1 if rank == 0 else 3)
    seen["members differ"] = _expect_error(
        lambda: gs.regroup(sharded, opt, _as_dicts(groups, sharded)), "gs.regroup", "rank 1"
    )
    # a parameter frozen by a regroup, then unfrozen into a flat buffer whose parameters
    # have state (its step would not be theirs): refused, naming it
    refrozen = "blocks.0.fc.weight"
    without = [([n for n in g if n != refrozen], o) for g, o in _phase_groups(names, 0)]
    gs.regroup(sharded, opt, _as_dicts(without, sharded))
    assert not sharded.get_parameter(refrozen).requires_grad
    _train(sharded, opt, batches[:1], rank)
    seen["state mixed"] = _expect_error(
        lambda: gs.regroup(sharded, opt, _as_dicts(_phase_groups(names, 0), sharded)),
        refrozen,
        "of their own",
    )
    # torch's idiom: requires_grad_(True) on a parameter frozen at shard time ...
    inputs, targets = batches[1]
    local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    block = [n for n in names if n.startswith("blocks.1.")]
    frozen = sharded.get_parameter(block[0])
    frozen.requires_grad_(True)
    seen["requires_grad_"] = _expect_error(
        lambda: sharded(inputs[local], targets[local]), block[0], "gs.regroup"
    )
    frozen.requires_grad_(False)
    # ... and add_param_group with the user's parameter
    opt.add_param_group({"params": [frozen]})
    sharded(inputs[local], targets[local]).backward()
    seen["add_param_group"] = _expect_error(opt.step, block[0], "gs.regroup")
    del opt.param_groups[-1]
    # gradients would be dropped
    seen["gradients"] = _expect_error(
        lambda: gs.regroup(sharded, opt, _as_dicts(_phase_groups(names, 1), sharded)),
        "zero_grad",
    )
    opt.zero_grad()
    # after every refusal the model still regroups and trains on every rank; the
    # parameter refused above goes in a group of its own
    groups = [([n for n in g if n != refrozen], o) for g, o in _phase_groups(names, 1)]
    gs.regroup(sharded, opt, _as_dicts([*groups, ([refrozen], {})], sharded))
    _train(sharded, opt, batches, rank)
    return seen


def test_regroup_errors_on_every_rank(run_ranks) -> None:
    """Different groups per rank, state that cannot share a flat buffer, gradients that
    would be dropped, and torch's idiom on a sharded model: a clear error on every rank
    (naming gs.regroup where torch's idiom is refused), no hang, nothing half changed."""
    results = run_ranks(2, _error_cases, timeout=120)
    assert results[0].keys() == results[1].keys()


def _muon_groups(names: list[str], model: nn.Module, with_block: bool) -> list[dict]:
    """Blocks' matrices in a Muon group, the rest in an AdamW group; ``with_block``:
    blocks.1 in a Muon group and an AdamW group of its own, other learning rates."""

    def is_matrix(name: str) -> bool:
        return name.startswith("blocks.") and not _is_vector(name)

    block = [n for n in names if n.startswith("blocks.1.")] if with_block else []
    trained = [n for n in names if not n.startswith("blocks.1.")]
    groups = [
        ([n for n in trained if is_matrix(n)], {}),
        ([n for n in trained if not is_matrix(n)], {"use_muon": False}),
        ([n for n in block if is_matrix(n)], {"lr": 0.01}),
        ([n for n in block if not is_matrix(n)], {"use_muon": False, "lr": 2e-3}),
    ]
    return _as_dicts(groups[: 4 if with_block else 2], model)


def _per_rank_mean_backward(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, world_size: int
) -> None:
    """The gradient the ranks reduce: the mean of each rank's batch's, summed in rank
    order (Newton-Schulz in bfloat16 would amplify a whole-batch backward's last bits;
    tests/test_muon.py explains)."""
    grads: dict[str, torch.Tensor] = {}
    for rank in range(world_size):
        local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
        model(inputs[local], targets[local]).backward()
        for name, param in model.named_parameters():
            if param.grad is not None:
                grads[name] = grads[name] + param.grad if name in grads else param.grad
            param.grad = None
    for name, param in model.named_parameters():
        param.grad = grads[name] / world_size if name in grads else None


def _muon_case(rank: int, world_size: int) -> tuple[float, list[str], list[str]]:
    """gs.optim.Muon: blocks.1 unfrozen after 2 steps into a Muon group (its matrices)
    and an AdamW group (its vectors), as one process does with add_param_group; Muon
    re-plans its owners over the new groups."""
    model = _model()
    reference = copy.deepcopy(model)
    names = [n for n, _ in reference.named_parameters()]
    sharded = gs.shard(model, _muon_groups(names, model, False), unit=Block, strategy="full")
    opt = gs.optim.Muon(sharded.optimizer_groups(), lr=0.02)
    reference_opt = gs.optim.Muon(_muon_groups(names, reference, False), lr=0.02)
    owners_before = sorted(opt.ownership()[0].owners)
    local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    for step, (inputs, targets) in enumerate(global_batches(4, world_size)):
        if step == 2:
            refused = _muon_groups(names, sharded, True)
            refused[2]["params"] += refused.pop(3)["params"]  # vectors in a Muon group
            _expect_error(lambda g=refused: gs.regroup(sharded, opt, g), "blocks.1.ln_1.weight")
            gs.regroup(sharded, opt, _muon_groups(names, sharded, True))
            for param in reference.blocks[1].parameters():
                param.requires_grad_(True)
            for group in _muon_groups(names, reference, True)[2:]:
                reference_opt.add_param_group(group)
        sharded(inputs[local], targets[local]).backward()
        _per_rank_mean_backward(reference, inputs, targets, world_size)
        for o in (opt, reference_opt):
            o.step()
            o.zero_grad()
    difference = max_difference(gs.full_state_dict(sharded), reference.state_dict())
    return difference, owners_before, sorted(opt.ownership()[0].owners)


def test_regroup_muon_replans_owners(run_ranks) -> None:
    results = run_ranks(2, _muon_case, timeout=120)
    difference, before, after = results[0]
    assert difference < 1e-5
    assert not any(n.startswith("blocks.1.") for n in before)
    assert sorted(set(after) - set(before)) == ["blocks.1.attn.proj.weight",
        "blocks.1.attn.qkv.weight", "blocks.1.fc.weight", "blocks.1.out.weight"]  # fmt: skip


def _not_in_block_1(name: str) -> bool:
    return not name.startswith("blocks.1.")


def _zero_case(rank: int, world_size: int) -> float:
    """gs.ZeroRedundancyOptimizer over a plain model (gradients averaged by hand, as DDP
    would): the same unfreeze / move / freeze as one process with torch's idiom, but the
    biases of blocks.1 stay (a bucket spans units: its biases' step is not the others')."""
    model = _model()
    reference = copy.deepcopy(model)
    names = [n for n, _ in reference.named_parameters()]
    zero = gs.ZeroRedundancyOptimizer(
        _as_dicts(_phase_groups(names, 0), model), torch.optim.AdamW, lr=3e-3,
        max_slice_numel=512,
    )  # fmt: skip
    reference_opt = torch.optim.AdamW(_as_dicts(_phase_groups(names, 0), reference), lr=3e-3)
    phase_at = {UNFREEZE_AT: 1, MOVE_AT: 2, FREEZE_AT: 3}
    local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    for step, (inputs, targets) in enumerate(global_batches(STEPS, world_size)):
        if step in phase_at:
            groups = _phase_groups(names, phase_at[step], _not_in_block_1)
            gs.regroup(model, zero, _as_dicts([g for g in groups if g[0]], model))
            _torch_idiom(reference, reference_opt, names, phase_at[step], _not_in_block_1)
        model(inputs[local], targets[local]).backward()
        _average_gradients(model, world_size)
        reference(inputs, targets).backward()
        for o in (zero, reference_opt):
            o.step()
            o.zero_grad()
    return max_difference(model.state_dict(), reference.state_dict())


def test_regroup_zero_redundancy_optimizer(run_ranks) -> None:
    """gs.regroup rebuilds gs.ZeroRedundancyOptimizer's buckets (small ones, so moved
    parameters change buckets) and carries each parameter's state."""
    assert run_ranks(2, _zero_case, timeout=120)[0] < 1e-5


# --- the most common loop (zero_grad first) and LR schedulers across a regroup ---------

SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (1 + step)),
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(
        o, T_max=STEPS, eta_min=1e-4
    ),
    "LinearLR": lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.25, total_iters=4),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o, max_lr=[3e-3, 1e-3], total_steps=STEPS
    ),
    "SequentialLR": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o,
        [
            torch.optim.lr_scheduler.LinearLR(o, start_factor=0.25, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8),
        ],
        milestones=[2],
    ),
}


def _extend_as_torch_users_do(scheduler: Any, group: dict[str, Any]) -> None:
    """torch's idiom after ``add_param_group``: the new group as if it had been there from
    the start (OneCycleLR: its keys from its peak ``lr``, with the default factors)."""
    inner = getattr(scheduler, "_schedulers", [])
    if isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR):
        peak = group["lr"]
        group.update(max_lr=peak, initial_lr=peak / 25, min_lr=peak / 25 / 1e4,
                     max_momentum=0.95, base_momentum=0.85)  # fmt: skip
    group.setdefault("initial_lr", group["lr"])
    for each in [scheduler, *inner]:  # SequentialLR keeps no base_lrs of its own
        if hasattr(each, "base_lrs"):
            each.base_lrs.append(group["initial_lr"])
        each._last_lr.append(group["lr"])
        if hasattr(each, "lr_lambdas"):
            each.lr_lambdas.append(each.lr_lambdas[0])


def _scheduled_case(rank: int, world_size: int) -> dict[str, tuple[float, float]]:
    """Per scheduler: the loop ``zero_grad(); backward(); step(); scheduler.step()``, with
    gs.regroup right after a step (no zero_grad) unfreezing blocks.1 into a new group, then
    freezing blocks.0, against one process doing the same with torch's idiom: the largest
    weight difference and the largest relative learning-rate difference over the steps."""
    results = {}
    for kind, make_scheduler in SCHEDULERS.items():
        model = _model()
        reference = copy.deepcopy(model)
        names = [n for n, _ in reference.named_parameters()]
        start = _phase_groups(names, 0)
        sharded = gs.shard(model, _as_dicts(start, model), unit=Block)
        opt = torch.optim.AdamW(sharded.optimizer_groups(), lr=3e-3)
        reference_opt = torch.optim.AdamW(_as_dicts(start, reference), lr=3e-3)
        scheduler, reference_scheduler = make_scheduler(opt), make_scheduler(reference_opt)
        unfrozen = _phase_groups(names, 1)
        block_0 = set(_names(reference, "blocks.0."))
        worst_weight = worst_lr = 0.0
        for step, (inputs, targets) in enumerate(global_batches(STEPS, world_size)):
            if step == UNFREEZE_AT:  # right after the last step: its gradients are consumed
                gs.regroup(sharded, opt, _as_dicts(unfrozen, sharded), schedulers=[scheduler])
                _torch_idiom(reference, reference_opt, names, 1)
                _extend_as_torch_users_do(reference_scheduler, reference_opt.param_groups[-1])
            if step == FREEZE_AT:  # the groups keep their places, blocks.0 leaves them
                kept = [([n for n in g if n not in block_0], o) for g, o in unfrozen]
                gs.regroup(sharded, opt, _as_dicts(kept, sharded), schedulers=[scheduler])
                _torch_idiom(reference, reference_opt, names, 3)
            local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
            for o in (opt, reference_opt):
                o.zero_grad()
            sharded(inputs[local], targets[local]).backward()
            reference(inputs, targets).backward()
            for o, s in ((opt, scheduler), (reference_opt, reference_scheduler)):
                o.step()
                s.step()
            lrs = [g["lr"] for g in opt.param_groups]
            expected = [g["lr"] for g in reference_opt.param_groups]
            assert len(lrs) == len(expected), (kind, step, lrs, expected)
            worst_lr = max(worst_lr, *(abs(a - b) / b for a, b in zip(lrs, expected, strict=True)))
            difference = max_difference(gs.full_state_dict(sharded), reference.state_dict())
            worst_weight = max(worst_weight, difference)
        results[kind] = (worst_weight, worst_lr)
    return results


def test_regroup_after_step_carries_lr_schedulers(run_ranks) -> None:
    """gs.regroup right after optimizer.step() (the gradients it consumed are dropped, as
    zero_grad would) with schedulers=[...]: LambdaLR, StepLR, CosineAnnealingLR, LinearLR,
    OneCycleLR and SequentialLR go on over the new group as after torch's add_param_group
    with the scheduler's lists extended by hand; weights and learning rates equal."""
    results = run_ranks(2, _scheduled_case, timeout=240)[0]
    assert sorted(results) == sorted(SCHEDULERS)
    for kind, (weight, lr) in results.items():
        assert weight < 1e-5 and lr < 1e-12, (kind, weight, lr)


def _refusals_case(rank: int, world_size: int) -> list[str]:
    """What gs.regroup says, on every rank, where it cannot go on."""
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    sharded = gs.shard(model, _as_dicts(_phase_groups(names, 0), model), unit=Block)
    opt = torch.optim.AdamW(sharded.optimizer_groups(), lr=3e-3)
    scheduler = SCHEDULERS["LambdaLR"](opt)
    (inputs, targets), *_ = global_batches(2, world_size)
    local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    unfrozen = _as_dicts(_phase_groups(names, 1), sharded)
    messages = []

    def refused(call: Callable[[], None]) -> str:
        with pytest.raises(ValueError) as caught:
            call()
        return str(caught.value)

    with sharded.no_sync():  # an accumulation in progress
        sharded(inputs[local], targets[local]).backward()
    messages.append(refused(lambda: gs.regroup(sharded, opt, unfrozen, schedulers=[scheduler])))
    sharded(inputs[local], targets[local]).backward()  # synced, not yet stepped
    messages.append(refused(lambda: gs.regroup(sharded, opt, unfrozen, schedulers=[scheduler])))
    opt.step()
    scheduler.step()
    # a group added under a scheduler not passed: its next step() would fail
    messages.append(refused(lambda: gs.regroup(sharded, opt, unfrozen)))
    # a group split over two (the biases of group 1 moved): a scheduler cannot follow
    split = _as_dicts(_phase_groups(names, 2), sharded)
    messages.append(refused(lambda: gs.regroup(sharded, opt, split, schedulers=[scheduler])))
    gs.regroup(sharded, opt, unfrozen, schedulers=[scheduler])  # nothing was half changed
    sharded(inputs[local], targets[local]).backward()
    opt.step()
    scheduler.step()
    assert len(scheduler.base_lrs) == len(opt.param_groups) == 3
    return messages


def test_regroup_refusals_say_what_to_do(run_ranks) -> None:
    """Pending gradients (an accumulation, or a backward not yet stepped), a scheduler not
    passed, and a split group: a ValueError on every rank that says what to do."""
    results = run_ranks(2, _refusals_case, timeout=120)
    assert results[0] == results[1]
    accumulating, unstepped, not_passed, split = results[0]
    assert "accumulation is in progress" in accumulating and "optimizer.step()" in accumulating
    assert "optimizer.step()" in unstepped and "zero_grad" in unstepped
    assert "schedulers=[scheduler]" in not_passed
    assert "one learning rate per group" in split and "rebuild the scheduler" in split


def _zero_scheduled_case(rank: int, world_size: int) -> tuple[float, float]:
    """gs.ZeroRedundancyOptimizer with a LambdaLR, blocks.1 unfrozen into a new group with
    schedulers=[...], against one process with torch's idiom: weight and lr differences."""
    model = _model()
    reference = copy.deepcopy(model)
    names = [n for n, _ in reference.named_parameters()]
    zero = gs.ZeroRedundancyOptimizer(
        _as_dicts(_phase_groups(names, 0), model), torch.optim.AdamW, lr=3e-3
    )
    reference_opt = torch.optim.AdamW(_as_dicts(_phase_groups(names, 0), reference), lr=3e-3)
    scheduler, reference_scheduler = (SCHEDULERS["LambdaLR"](o) for o in (zero, reference_opt))
    local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    worst_lr = 0.0
    for step, (inputs, targets) in enumerate(global_batches(STEPS, world_size)):
        if step == UNFREEZE_AT:
            unfrozen = _as_dicts(_phase_groups(names, 1), model)
            gs.regroup(model, zero, unfrozen, schedulers=[scheduler])
            _torch_idiom(reference, reference_opt, names, 1)
            _extend_as_torch_users_do(reference_scheduler, reference_opt.param_groups[-1])
        model(inputs[local], targets[local]).backward()
        _average_gradients(model, world_size)
        reference(inputs, targets).backward()
        for o, s in ((zero, scheduler), (reference_opt, reference_scheduler)):
            o.step()
            o.zero_grad()
            s.step()
        lrs, expected = ([g["lr"] for g in o.param_groups] for o in (zero, reference_opt))
        assert len(lrs) == len(expected), (step, lrs, expected)
        worst_lr = max(worst_lr, *(abs(a - b) / b for a, b in zip(lrs, expected, strict=True)))
    return max_difference(model.state_dict(), reference.state_dict()), worst_lr


def test_regroup_zero_redundancy_optimizer_carries_lr_schedulers(run_ranks) -> None:
    weight, lr = run_ranks(2, _zero_scheduled_case, timeout=120)[0]
    assert weight < 1e-5 and lr < 1e-12, (weight, lr)
