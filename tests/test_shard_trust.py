"""gs.shard keeps torch's semantics: parameters without a gradient do not move, options
that change the collectives must agree between ranks, and conversions are refused."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import groupshard as gs
from groupshard.cli.model import GPT, Block, GPTConfig

from helpers import (
    BATCH_PER_RANK,
    UNITS,
    EdgeGPT,
    global_batches,
    max_difference,
    numbered,
    three_groups,
)

TOLERANCE = 1e-5


class BranchBlock(nn.Module):
    """A unit with a branch that a forward may skip."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.branch = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        x = torch.tanh(self.fc(x))
        return x + self.branch(x) if use_branch else x


class BranchNet(nn.Module):
    """``blocks[0]`` runs twice per forward (its branch only in the second run, if at all)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([BranchBlock(), BranchBlock()])
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, uses: tuple[bool, bool]) -> torch.Tensor:
        x = self.blocks[0](x, False)
        x = self.blocks[0](x, uses[0])
        x = self.blocks[1](x, uses[1])
        return self.head(x).pow(2).mean()


BRANCHES = ("blocks.0.branch", "blocks.1.branch")


def branch_groups(model: nn.Module) -> list[dict[str, Any]]:
    """blocks.0.branch shares its unit's flat shards with used parameters; blocks.1.branch
    is a group of its own, so its shard is either used or not as a whole."""

    def rule(name: str, param: torch.Tensor) -> str:
        if name.startswith(BRANCHES[1]):
            return "own"
        return "decay" if param.ndim >= 2 else "no_decay"

    options = {"decay": {"weight_decay": 0.1}, "no_decay": {"weight_decay": 0.0}, "own": {}}
    return gs.groups_by(model, rule, options)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.05),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.05),
}

# (blocks.0.branch, blocks.1.branch) used in each step, the same on every rank. With
# AdamW blocks.0.branch is not used again after a step without it: its shard's single
# `step` count keeps advancing (see the README), which a later use would show.
SCHEDULES = {
    "sgd": [[(True, False)], [(False, True)], [(False, False)], [(True, True)], [(False, False)]],
    "adamw": [[(True, False)], [(True, True)], [(False, False)], [(False, True)], [(False, False)]],
}


def _per_element_difference(ours: dict[str, Any], theirs: dict[str, Any]) -> float:
    """Largest difference of the per-element optimizer state torch holds."""
    assert set(theirs["state"]) <= set(ours["state"])
    return max(
        (value - ours["state"][index][key]).abs().max().item()
        for index, state in theirs["state"].items()
        for key, value in state.items()
        if key != "step"
    )


def _steps(state_dict: dict[str, Any], group: int) -> list[float]:
    """The ``step`` count of each parameter of ``group`` that has one."""
    states = [state_dict["state"].get(i, {}) for i in state_dict["param_groups"][group]["params"]]
    return [float(state["step"]) for state in states if "step" in state]


def branch_case(
    rank: int, world_size: int, strategy: str, optimizer: str, schedule: list[list[tuple]]
) -> dict[str, Any]:
    """Train BranchNet sharded and on one process; ``schedule[step][rank]`` says which
    branches rank ``rank`` uses (a single entry: every rank the same)."""
    torch.manual_seed(0)
    model = BranchNet()
    reference = copy.deepcopy(model)
    sharded = gs.shard(model, branch_groups(model), unit=BranchBlock, strategy=strategy)
    opt = OPTIMIZERS[optimizer](sharded.optimizer_groups())
    reference_opt = OPTIMIZERS[optimizer](branch_groups(reference))
    generator = torch.Generator().manual_seed(1)
    moved: dict[str, bool] = {}
    unchanged_when_unused = True
    for uses in schedule:
        per_rank = [uses[r % len(uses)] for r in range(world_size)]
        inputs = torch.randn(world_size, 4, 6, generator=generator)
        before = gs.full_state_dict(sharded)
        sharded(inputs[rank], per_rank[rank]).backward()
        opt.step()
        opt.zero_grad()
        after = gs.full_state_dict(sharded)
        for index, branch in enumerate(BRANCHES):
            for name in (f"{branch}.weight", f"{branch}.bias"):
                changed = not torch.equal(before[name], after[name])
                moved[name] = moved.get(name, False) or changed
                if changed and not any(u[index] for u in per_rank):
                    unchanged_when_unused = False
        for r in range(world_size):  # the average of the ranks' losses, as DDP
            (reference(inputs[r], per_rank[r]) / world_size).backward()
        reference_opt.step()
        reference_opt.zero_grad()
    ours, theirs = numbered(gs.optim_state_dict(sharded, opt)), reference_opt.state_dict()
    return {
        "values": max_difference(gs.full_state_dict(sharded), reference.state_dict()),
        "state": _per_element_difference(ours, theirs),
        "own group steps": (_steps(ours, 2), _steps(theirs, 2)),
        "unchanged when unused": unchanged_when_unused,
        "moved": moved,
    }


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("strategy", ["full", "grad_op", "no_shard"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_parameters_without_gradient_do_not_move(run_ranks, world_size, strategy, optimizer):
    """As torch.optim skips a parameter whose .grad is None: same values and per-element
    state as one process, and a step without the branch leaves it exactly as it was."""
    results = run_ranks(world_size, branch_case, strategy, optimizer, SCHEDULES[optimizer])
    for result in results:
        assert result["values"] <= TOLERANCE, result
        assert result["state"] <= TOLERANCE, result
        assert result["unchanged when unused"], result
        ours, theirs = result["own group steps"]
        assert ours == theirs, result  # a flat shard without any gradient is not stepped


@pytest.mark.parametrize("strategy", ["full", "grad_op", "no_shard"])
def test_branch_used_on_one_rank_moves_as_in_ddp(run_ranks, strategy):
    """A parameter used on any rank has a gradient (the average includes the other
    ranks' zeros), so it moves, as with DDP."""
    schedule = [[(True, False), (False, True)], [(False, False), (True, False)]]
    for result in run_ranks(2, branch_case, strategy, "sgd", schedule):
        assert result["values"] <= TOLERANCE, result
        assert result["state"] <= TOLERANCE, result
        assert all(result["moved"].values()), result


def freeze_case(rank: int, world_size: int, strategy: str) -> dict[str, float]:
    """Freeze a parameter (through its name, which outside forward is the user's tensor)
    and a whole unit (through its module) after two steps: as on one process, they stop
    moving and keep their state."""
    torch.manual_seed(0)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    original = model.blocks[1].fc.weight  # the user's tensor, holding its piece after gs.shard
    sharded = gs.shard(model, three_groups(model, 1e-2), unit=UNITS, strategy=strategy)
    opt = torch.optim.AdamW(sharded.optimizer_groups(), lr=1e-2)
    reference_opt = torch.optim.AdamW(three_groups(reference, 1e-2), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    frozen_before: dict[str, torch.Tensor] = {}
    for step in range(5):
        if step == 2:
            assert sharded.blocks[1].fc.weight is original  # outside forward: its piece
            sharded.blocks[1].fc.weight.requires_grad_(False)
            sharded.blocks[0].requires_grad_(False)
            reference.blocks[1].fc.weight.requires_grad_(False)
            reference.blocks[0].requires_grad_(False)
            frozen_before = gs.full_state_dict(sharded)
        inputs = torch.randint(0, 32, (world_size, 2, 8), generator=generator)
        targets = torch.randint(0, 32, (world_size, 2, 8), generator=generator)
        sharded(inputs[rank], targets[rank]).backward()
        reference(inputs.flatten(0, 1), targets.flatten(0, 1)).backward()
        for optimizer in (opt, reference_opt):
            optimizer.step()
            optimizer.zero_grad()
    full = gs.full_state_dict(sharded)
    frozen = [n for n in full if n == "blocks.1.fc.weight" or n.startswith("blocks.0.")]
    ours, theirs = numbered(gs.optim_state_dict(sharded, opt)), reference_opt.state_dict()
    return {
        "values": max_difference(full, reference.state_dict()),
        "state": _per_element_difference(ours, theirs),
        "frozen moved": max((full[n] - frozen_before[n]).abs().max().item() for n in frozen),
    }


def test_parameters_frozen_after_sharding_stop_moving(run_ranks):
    for result in run_ranks(2, freeze_case, "full"):
        assert result["frozen moved"] == 0.0, result
        assert result["values"] <= TOLERANCE, result
        assert result["state"] <= TOLERANCE, result


def _larc_case(rank: int, world_size: int) -> dict[str, Any]:
    """gs.optim.LARC steps its inner optimizer inside its own step: still skipped."""
    return branch_case_with(rank, world_size, lambda groups: gs.optim.LARC(
        torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.05)
    ))  # fmt: skip


def branch_case_with(
    rank: int, world_size: int, make_optimizer: Callable[..., torch.optim.Optimizer]
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = BranchNet()
    reference = copy.deepcopy(model)
    sharded = gs.shard(model, branch_groups(model), unit=BranchBlock)
    opt = make_optimizer(sharded.optimizer_groups())
    reference_opt = make_optimizer(branch_groups(reference))
    generator = torch.Generator().manual_seed(1)
    for uses in [(True, True), (False, False), (False, True), (True, False)]:
        inputs = torch.randn(world_size, 4, 6, generator=generator)
        sharded(inputs[rank], uses).backward()
        reference(inputs.flatten(0, 1), uses).backward()
        for optimizer in (opt, reference_opt):
            optimizer.step()
            optimizer.zero_grad()
    return max_difference(gs.full_state_dict(sharded), reference.state_dict())


def test_wrapped_optimizer_skips_too(run_ranks):
    assert max(run_ranks(2, _larc_case)) <= TOLERANCE


OPTIONS = {
    "reduce_bucket_bytes": (25 * 2**20, 0),
    "first_bucket_bytes": (2**20, 0),
    "prefetch_bytes": (25 * 2**20, 4096),
    "sync_module_states": (True, False),
}


def option_mismatch_case(rank: int, world_size: int, option: str) -> str:
    torch.manual_seed(0)
    model = EdgeGPT()
    value = OPTIONS[option][rank == world_size - 1]
    try:
        gs.shard(model, None, unit=UNITS, **{option: value})
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("option", list(OPTIONS))
def test_options_that_change_collectives_must_agree(run_ranks, option):
    """A different value on one rank is a ValueError naming the option on every rank
    (before: a collective mismatch on some ranks, or a hang until the timeout)."""
    first, last = OPTIONS[option]
    for message in run_ranks(2, option_mismatch_case, option, timeout=60):
        assert f"{option} on rank 0 is {first!r} but on rank 1 is {last!r}" in message


CONVERSIONS: dict[str, Callable[[nn.Module], Any]] = {
    "half": lambda m: m.half(),
    "double": lambda m: m.double(),
    "bfloat16": lambda m: m.bfloat16(),
    "to(float64)": lambda m: m.to(torch.float64),
    "to(dtype=float16)": lambda m: m.to(dtype=torch.float16),
    "type(float64)": lambda m: m.type(torch.float64),
}


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    generator = torch.Generator().manual_seed(2)
    for _ in range(steps):
        inputs, targets = torch.randint(0, 32, (2, 2, 8), generator=generator)
        model(inputs, targets).backward()
        optimizer.step()
        optimizer.zero_grad()


def test_dtype_conversion_is_refused_before_anything_changes():
    torch.manual_seed(0)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    sharded = gs.shard(model, three_groups(model, 1e-2), unit=UNITS)
    shards = [shard.detach().clone() for shard in sharded.parameters()]
    for name, convert in CONVERSIONS.items():
        with pytest.raises(ValueError, match=r"convert or move the model before gs\.shard"):
            convert(sharded)
        for kept, shard in zip(shards, sharded.parameters(), strict=True):
            assert shard.dtype == torch.float32 and torch.equal(kept, shard), name
    for keeps_dtype in (lambda m: m.float(), lambda m: m.to("cpu"), lambda m: m.to(torch.float32)):
        assert keeps_dtype(sharded) is sharded
    optimizer = torch.optim.AdamW(sharded.optimizer_groups(), lr=1e-2)
    _train(sharded, optimizer, 3)
    _train(reference, torch.optim.AdamW(three_groups(reference, 1e-2), lr=1e-2), 3)
    assert max_difference(gs.full_state_dict(sharded), reference.state_dict()) <= 1e-6


def test_converting_a_unit_alone_fails_at_the_next_forward():
    torch.manual_seed(0)
    model = EdgeGPT()
    sharded = gs.shard(model, None, unit=UNITS)
    sharded.blocks[0].double()  # a unit module is a plain nn.Module: its own _apply runs
    inputs = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"unit 'blocks\.0' were replaced"):
        sharded(inputs, inputs)


def test_frozen_parameter_cannot_be_unfrozen_silently():
    torch.manual_seed(0)
    model = EdgeGPT()  # wpe.weight is frozen
    original = model.wpe.weight
    sharded = gs.shard(model, None, unit=UNITS)
    original.requires_grad_(True)
    inputs = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"\['wpe.weight'\] were frozen when the model"):
        sharded(inputs, inputs)


def test_a_name_outside_forward_is_the_users_parameter():
    """After a forward (with or without grad, and before any), ``model.<module>.<name>``
    is the user's parameter object holding this rank's piece, a leaf: freezing it works."""
    torch.manual_seed(0)
    model = EdgeGPT()
    original = model.blocks[0].fc.weight
    sharded = gs.shard(model, None, unit=UNITS)
    assert sharded.blocks[0].fc.weight is original
    inputs = torch.zeros(1, 8, dtype=torch.long)
    with torch.no_grad():
        sharded(inputs)
    assert sharded.blocks[0].fc.weight is original and original.is_leaf
    sharded.blocks[0].fc.weight.requires_grad_(False)
    assert [
        frozen
        for s in sharded.groupshard.storages
        for frozen, p in zip(s.gradients.frozen_flags(), s.gradients.originals, strict=True)
        if p is original
    ] == [True]


def test_a_step_that_raises_leaves_no_hold_behind():
    """What a step that raised was holding is settled before the next step of the same
    optimizer: a parameter that has a gradient by then moves."""
    torch.manual_seed(0)
    model = gs.shard(BranchNet(), None)
    optimizer = torch.optim.SGD(model.optimizer_groups(), lr=0.1, momentum=0.9)

    def fail(optimizer, args, kwargs):
        raise RuntimeError("boom")

    handle = optimizer.register_step_pre_hook(fail)
    model(torch.randn(4, 6), (False, False)).backward()
    with pytest.raises(RuntimeError, match="boom"):
        optimizer.step()
    handle.remove()
    optimizer.zero_grad()
    model(torch.randn(4, 6), (True, True)).backward()
    before = {k: v.clone() for k, v in gs.full_state_dict(model).items()}
    optimizer.step()
    after = gs.full_state_dict(model)
    for name in ("blocks.0.branch.weight", "blocks.1.branch.weight", "head.weight"):
        assert not torch.equal(before[name], after[name]), name


class OrderOnRank(GPT):
    """Runs its blocks in reverse on the ranks in ``reversed_on``, from step ``after`` on
    (identical block shapes, so every gather and reduction still matches in size)."""

    def __init__(self, reversed_on: tuple[int, ...], after: int) -> None:
        super().__init__(TINY_FOUR_BLOCKS)
        self.reversed_on, self.after, self.calls = reversed_on, after, 0

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        flip = torch.distributed.get_rank() in self.reversed_on and self.calls > self.after
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in reversed(self.blocks) if flip else self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


TINY_FOUR_BLOCKS = GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)


def order_case(rank: int, world_size: int, strategy: str, after: int) -> dict[str, Any]:
    """Train 3 steps; from step ``after`` on, rank 1 runs the blocks in reverse."""
    torch.manual_seed(0)
    sharded = gs.shard(OrderOnRank((1,), after), None, unit=Block, strategy=strategy)
    optimizer = torch.optim.SGD(sharded.optimizer_groups(), lr=0.1)
    for step, (inputs, targets) in enumerate(global_batches(3, world_size)):
        local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
        try:
            sharded(inputs[local], targets[local]).backward()
        except RuntimeError as error:
            return {"step": step, "error": str(error)}
        optimizer.step()
        optimizer.zero_grad()
    return {"step": None, "error": None}


@pytest.mark.parametrize(
    "strategy, after", [("full", 0), ("grad_op", 0), ("no_shard", 0), ("no_shard", 1)]
)
def test_units_run_in_another_order_on_one_rank_fail_on_every_rank(run_ranks, strategy, after):
    """Gathers and gradient buckets follow each rank's order of units; a rank running them
    in another order exchanges other parameters' data in collectives of matching sizes
    (here every block has the same shape). The end of backward, before any optimizer
    step, raises on every rank. (Once an order is recorded, ``full`` and ``grad_op``
    gather windows of it ahead, so a rank leaving it issues a gather of another size:
    gloo then aborts that rank with its "collective mismatch" error, not tested here.)"""
    for result in run_ranks(2, order_case, strategy, after, timeout=120):
        assert result["step"] == after, result
        assert "differs between ranks" in result["error"], result
