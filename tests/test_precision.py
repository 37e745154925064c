"""Mixed precision: units compute in bf16 from fp32 master shards, gradients reduce in fp32.

The reference does the same casts on one process: a bf16 copy of the fp32 master model
computes each rank's micro-batch gradient, the gradients are cast to fp32 and averaged,
and the fp32 master takes the optimizer step.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from torch import nn

import groupshard as gs
from groupshard import comm
from groupshard.cli.model import GPT

from helpers import (
    BATCH_PER_RANK,
    TINY,
    UNITS,
    EdgeGPT,
    emulated_cast_step,
    full_grads,
    global_batches,
    max_difference,
    three_groups,
)

BF16 = gs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def precision_case(
    rank: int, world_size: int, strategy: str, steps: int = 6
) -> tuple[float, float, list[str]]:
    torch.manual_seed(0)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    sharded = gs.shard(
        model, three_groups(model, 1e-3), unit=UNITS, strategy=strategy, mixed_precision=BF16
    )
    optimizer = torch.optim.AdamW(sharded.optimizer_groups(), lr=3e-3)
    reference_opt = torch.optim.AdamW(three_groups(reference, 1e-3), lr=3e-3)
    loss_difference = 0.0
    for inputs, targets in global_batches(steps, world_size):
        per_rank = list(zip(inputs.chunk(world_size), targets.chunk(world_size), strict=True))
        loss = sharded(*per_rank[rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reference_losses = emulated_cast_step(reference, per_rank, torch.bfloat16)
        reference_opt.step()
        reference_opt.zero_grad()
        loss_difference = max(loss_difference, abs(loss.item() - reference_losses[rank]))
    state = gs.full_state_dict(sharded)
    dtypes = sorted({str(value.dtype) for value in state.values()})
    return max_difference(state, reference.state_dict()), loss_difference, dtypes


@pytest.mark.parametrize(
    "world_size, strategy", [(1, "full"), (2, "full"), (2, "grad_op"), (2, "no_shard"), (3, "full")]
)
def test_bf16_matches_the_same_casts_on_one_process(run_ranks, world_size, strategy):
    """Same bf16 values, same kernels, fp32 reduction and update: the only difference left
    is the order of the fp32 sum over ranks (none at 2 ranks)."""
    for difference, loss_difference, dtypes in run_ranks(world_size, precision_case, strategy):
        assert dtypes == ["torch.float32"]  # full_state_dict gives the fp32 masters
        assert difference <= 1e-6, difference
        assert loss_difference == 0.0, loss_difference


def fsdp2_case(rank: int, world_size: int, steps: int = 8) -> tuple[list[float], list[float]]:
    """groupshard and FSDP2 with the same policy on the same model and batches: losses."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = GPT(TINY)  # FSDP2 refuses EdgeGPT's 0-dim parameter
    other = copy.deepcopy(model)
    sharded = gs.shard(model, three_groups(model, 1e-3), unit=UNITS, mixed_precision=BF16)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for module in other.modules():
        if isinstance(module, UNITS):
            fully_shard(module, mp_policy=policy)
    fully_shard(other, mp_policy=policy)
    optimizers = [
        torch.optim.AdamW(sharded.optimizer_groups(), lr=3e-3),
        torch.optim.AdamW(three_groups(other, 1e-3), lr=3e-3),
    ]
    losses: list[list[float]] = [[], []]
    for inputs, targets in global_batches(steps, world_size):
        local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
        for model_, optimizer, record in zip((sharded, other), optimizers, losses, strict=True):
            loss = model_(inputs[local], targets[local])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            record.append(loss.item())
    return losses[0], losses[1]


def test_fsdp2_with_the_same_policy_reaches_the_same_loss(run_ranks):
    """FSDP2 scales gradients before and after its reduction and its bf16 casts happen per
    parameter, so its master weights may differ from ours in the last fp32 bit, which can
    flip a bf16 rounding: the losses (bf16, ulp 2**-6 near 3.5) agree to within a few ulps."""
    for ours, fsdp2 in run_ranks(2, fsdp2_case):
        assert ours[0] == fsdp2[0]  # the same weights and batch: the same first loss
        for step, (mine, theirs) in enumerate(zip(ours, fsdp2, strict=True)):
            assert abs(mine - theirs) <= 4 * 2**-6, (step, ours, fsdp2)


def gathered_bytes_case(rank: int, world_size: int, strategy: str) -> dict[str, int]:
    """Bytes all-gathered in one training step (after a first), fp32 vs bf16 compute."""
    result = {}
    for name, policy in (("fp32", None), ("bf16", BF16)):
        torch.manual_seed(0)
        model = EdgeGPT()
        sharded = gs.shard(model, three_groups(model, 1e-3), unit=UNITS, strategy=strategy,
                           mixed_precision=policy)  # fmt: skip
        optimizer = torch.optim.AdamW(sharded.optimizer_groups(), lr=3e-3)
        inputs, targets = global_batches(1, world_size)[0]
        gathered = [0]
        original = comm.all_gather

        def counting(output, *args, gathered=gathered, original=original, **kwargs):
            gathered[0] += output.numel() * output.element_size()
            return original(output, *args, **kwargs)

        for counted in (False, True):
            with (
                mock.patch.object(comm, "all_gather", counting) if counted else mock.patch.dict({})
            ):
                sharded(inputs[:BATCH_PER_RANK], targets[:BATCH_PER_RANK]).backward()
                optimizer.step()
                optimizer.zero_grad()
        result[name] = gathered[0]
    return result


@pytest.mark.parametrize("strategy", ["full", "grad_op"])
def test_bf16_gathers_half_the_bytes(run_ranks, strategy):
    for counted in run_ranks(2, gathered_bytes_case, strategy):
        assert counted["fp32"] > 0
        assert counted["bf16"] * 2 == counted["fp32"], counted


def norms_case(rank: int, world_size: int) -> tuple[float, list[str], float]:
    torch.manual_seed(0)
    model = EdgeGPT()
    sharded = gs.shard(model, three_groups(model, 1e-3), unit=UNITS, mixed_precision=BF16)
    inputs, targets = global_batches(1, world_size)[0]
    sharded(inputs[:BATCH_PER_RANK], targets[:BATCH_PER_RANK]).backward()
    grads = full_grads(sharded)  # the fp32 shard gradients, gathered
    norms = gs.grad_norms(sharded)
    worst = max(
        abs(norms[name].item() - torch.linalg.vector_norm(grad).item())
        / torch.linalg.vector_norm(grad).item()
        for name, grad in grads.items()
    )
    dtypes = sorted({str(n.dtype) for n in norms.values()} | {str(g.dtype) for g in grads.values()})
    total = gs.clip_grad_norm_(sharded, 1e9)
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
    return worst, dtypes, abs(total.item() - expected.item()) / expected.item()


def test_norms_under_bf16_are_the_fp32_norms(run_ranks):
    for worst, dtypes, total in run_ranks(2, norms_case):
        assert dtypes == ["torch.float32"]
        assert worst <= 1e-6, worst
        assert total <= 1e-6, total


class Scaled(nn.Module):
    """A unit with a frozen parameter and a buffer, recording the dtypes its forward sees."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.frozen = nn.Parameter(torch.ones(4), requires_grad=False)
        self.register_buffer("offset", torch.full((4,), 0.5))
        self.seen: list[tuple[str, ...]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(tuple(str(t.dtype) for t in (x, self.linear.weight, self.frozen)))
        return self.linear(x) * self.frozen + self.offset


def test_frozen_parameters_are_cast_buffers_are_not():
    """As FSDP2: every parameter (frozen ones too) computes in param_dtype; buffers keep
    their dtype (here fp32, so the unit's output is promoted to fp32)."""
    torch.manual_seed(0)
    model = nn.Sequential(Scaled(), nn.Tanh())
    sharded = gs.shard(model, None, unit=Scaled, mixed_precision=BF16)
    out = sharded(torch.randn(3, 4))
    out.float().sum().backward()
    assert sharded[0].seen == [("torch.bfloat16",) * 3]
    assert sharded[0].offset.dtype == torch.float32
    assert {p.dtype for p in sharded.parameters()} == {torch.float32}  # the shards
    assert all(p.grad.dtype == torch.float32 for p in sharded.parameters() if p.requires_grad)
    with sharded.summon_full_params():
        assert {p.dtype for p in sharded.parameters()} == {torch.float32}


def test_one_policy_per_unit():
    """Blocks in bf16 with fp32 outputs; the root (embeddings, final norm) in fp32."""
    torch.manual_seed(0)
    model = EdgeGPT()
    seen: dict[str, set[str]] = {"block input": set(), "block weight": set(), "ln_f": set()}
    model.blocks[0].register_forward_pre_hook(
        lambda m, args: seen["block input"].add(str(args[0].dtype))
    )
    model.ln_f.register_forward_pre_hook(lambda m, args: seen["ln_f"].add(str(m.weight.dtype)))

    def policy(name: str, module: nn.Module) -> gs.MixedPrecision | None:
        if name.startswith("blocks."):
            return gs.MixedPrecision(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
            )
        return None

    sharded = gs.shard(model, three_groups(model, 1e-3), unit=UNITS, mixed_precision=policy)
    sharded.blocks[0].fc.register_forward_pre_hook(
        lambda m, args: seen["block weight"].add(str(m.weight.dtype))
    )
    inputs, targets = global_batches(1, 1)[0]
    loss = sharded(inputs, targets)
    loss.backward()
    assert loss.dtype == torch.float32
    # blocks cast their fp32 input (cast_forward_inputs) and compute in bf16
    assert seen == {
        "block input": {"torch.float32"},  # seen before the unit's own pre-forward cast
        "block weight": {"torch.bfloat16"},
        "ln_f": {"torch.float32"},
    }, seen
    compute = {s.layout.unit_name: s.compute_dtype for s in sharded.groupshard.storages}
    assert compute[""] == torch.float32 and compute["blocks.0"] == torch.bfloat16


def checkpoint_case(rank: int, world_size: int, path: str) -> float:
    torch.manual_seed(0)
    model = EdgeGPT()
    sharded = gs.shard(model, three_groups(model, 1e-3), unit=UNITS, mixed_precision=BF16)
    optimizer = torch.optim.AdamW(sharded.optimizer_groups(), lr=3e-3)
    for inputs, targets in global_batches(2, world_size):
        sharded(inputs[:BATCH_PER_RANK], targets[:BATCH_PER_RANK]).backward()
        optimizer.step()
        optimizer.zero_grad()
    gs.checkpoint.save(path, sharded, optimizer)
    torch.manual_seed(1)
    fresh_model = EdgeGPT()
    fresh = gs.shard(fresh_model, three_groups(fresh_model, 1e-3), unit=UNITS,
                     mixed_precision=BF16)  # fmt: skip
    fresh_opt = torch.optim.AdamW(fresh.optimizer_groups(), lr=3e-3)
    gs.checkpoint.load(path, fresh, fresh_opt)
    saved = gs.full_state_dict(sharded)
    assert all(v.dtype == torch.float32 for v in saved.values())
    return max_difference(gs.full_state_dict(fresh), saved)


def test_checkpoint_holds_the_fp32_masters(run_ranks, tmp_path):
    assert max(run_ranks(2, checkpoint_case, str(tmp_path / "ckpt"))) == 0.0


def test_bad_policies_are_refused():
    with pytest.raises(ValueError, match="param_dtype"):
        gs.MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(ValueError, match="reduce_dtype"):
        gs.MixedPrecision(reduce_dtype="bf16")  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="narrower"):
        gs.MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="mixed_precision"):
        gs.shard(nn.Linear(2, 2), None, mixed_precision="bf16")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="returned"):
        gs.shard(nn.Linear(2, 2), None, mixed_precision=lambda name, module: torch.bfloat16)


def test_accumulation_under_bf16_sums_in_reduce_dtype():
    torch.manual_seed(0)
    model = EdgeGPT()
    sharded = gs.shard(model, None, unit=UNITS, mixed_precision=BF16)
    inputs, targets = global_batches(1, 1)[0]
    with sharded.no_sync():
        sharded(inputs, targets).backward()
    held = [s.gradients.accumulated for s in sharded.groupshard.storages]
    assert held and all(g is not None and g.dtype == torch.float32 for g in held)
    sharded(inputs, targets).backward()
    assert all(s.gradients.accumulated is None for s in sharded.groupshard.storages)
