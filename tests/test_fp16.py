"""fp16: units compute in fp16 from fp32 master shards, and gs.GradScaler scales the loss
with an overflow check agreed across ranks.

The reference does the same casts on one process with torch's own one-process scaler
(``torch.amp.GradScaler``, whose check sees the whole gradient): an fp16 copy of the fp32
master model computes each rank's micro-batch on the scaled loss, the fp16 gradients are
summed in the reduce dtype and averaged, and the scaler unscales them into the fp32
masters, then steps or skips.

An overflow that one rank's gradient holds reaches only the ranks whose slices hold it
(after a reduction, or on one rank after it): a scaler that checks each rank alone
(``torch.amp.GradScaler`` on every rank) lets the others step, which the tests below
catch (``test_a_scaler_without_agreement_lets_the_ranks_part`` shows it).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import groupshard as gs
from groupshard.mesh import MESH_DIM_NAMES

from helpers import (
    OPTIMIZERS,
    UNITS,
    EdgeGPT,
    emulated_cast_step,
    global_batches,
    max_difference,
    three_groups,
)

POLICIES = {
    reduce: gs.MixedPrecision(param_dtype=torch.float16, reduce_dtype=getattr(torch, reduce))
    for reduce in ("float16", "float32")
}
INIT_SCALE = 2.0**10  # the fp16 loss (about ln 32) times the scale stays below fp16's 65504
STEPS = 6
OVERFLOW_STEP = 2  # the step whose gradient overflows on one rank, where a test injects one
HALVED = [INIT_SCALE] * OVERFLOW_STEP + [INIT_SCALE / 2] * (STEPS - OVERFLOW_STEP)  # the scales
CASES = [(w, s) for w in (2, 3) for s in ("full", "grad_op", "no_shard")]


def _scaler(kind: str, model: nn.Module, growth_interval: int) -> torch.amp.GradScaler:
    """The scaler under test: ours, or torch's (which the tests must catch disagreeing)."""
    options = {"init_scale": INIT_SCALE, "growth_interval": growth_interval}
    if kind == "gs":
        return gs.GradScaler(model, **options)
    if kind == "torch":  # checks this rank's gradients alone
        return torch.amp.GradScaler("cpu", **options)
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler("cpu", **options)


def _set_inf(grad: torch.Tensor) -> None:
    with torch.no_grad():
        grad.view(-1)[0] = math.inf


@contextlib.contextmanager
def _poisoned(module: nn.Module) -> Iterator[None]:
    """Inside: the first element of ``module.weight``'s gradient (in the compute dtype,
    before any reduction) is inf, through a hook on the tensor each forward uses."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        _set_inf(grad)
        return grad

    def before_forward(module: nn.Module, args: Any) -> None:
        module.weight.register_hook(hook)

    handle = module.register_forward_pre_hook(before_forward)
    try:
        yield
    finally:
        handle.remove()


def _poisoned_module(model: nn.Module) -> nn.Module:
    return model.blocks[1].fc


def _train_step(
    sharded: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    batch: tuple[torch.Tensor, torch.Tensor],
    poison: str | None,
    clip: bool,
) -> float:
    """One step through the scaler. ``poison``: this rank's gradient overflows, in backward
    (``"backward"``) or in this rank's slice after the reduction (``"gradient"``)."""
    with _poisoned(_poisoned_module(sharded)) if poison == "backward" else contextlib.nullcontext():
        loss = sharded(*batch)
        scaler.scale(loss).backward()
    if poison == "gradient":
        _set_inf(next(p.grad for p in sharded.parameters() if p.grad is not None))
    if clip:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(sharded.parameters(), 1.0)  # exact on shards
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss.item()


def _poison_last_rank(world_size: int) -> Callable[[int, nn.Module], Any]:
    """For ``emulated_cast_step``: the last rank's batch overflows as ``_train_step``'s."""

    def around(index: int, compute: nn.Module) -> Any:
        if index == world_size - 1:
            return _poisoned(_poisoned_module(compute))
        return contextlib.nullcontext()

    return around


def same_casts_case(
    rank: int,
    world_size: int,
    strategy: str,
    reduce: str,
    growth_interval: int = 2000,
    overflow: str | None = None,
    scaler: str = "gs",
    optimizer: str = "adamw",
) -> tuple[float, float, list[float], list[float]]:
    """fp16 training beside the same casts on one process, both through a scaler; with
    ``overflow``, the last rank's gradient overflows at ``OVERFLOW_STEP`` (``_train_step``
    says where; the reference's mean gradient gets the inf of a ``"backward"`` one).
    Returns the largest master difference, the largest loss difference, and the scale
    after each step: this rank's, the reference's."""
    torch.manual_seed(0)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    policy = POLICIES[reduce]
    sharded = gs.shard(
        model, three_groups(model, 1e-3), unit=UNITS, strategy=strategy, mixed_precision=policy
    )
    sharded_opt = OPTIMIZERS[optimizer](sharded.optimizer_groups())
    amp = _scaler(scaler, sharded, growth_interval)
    reference_opt = OPTIMIZERS[optimizer](three_groups(reference, 1e-3))
    reference_amp = torch.amp.GradScaler("cpu", INIT_SCALE, growth_interval=growth_interval)
    reference_amp.scale(torch.zeros(()))  # creates its scale tensor, as a first scale() does
    loss_difference, scales, reference_scales = 0.0, [], []
    for step, (inputs, targets) in enumerate(global_batches(STEPS, world_size)):
        per_rank = list(zip(inputs.chunk(world_size), targets.chunk(world_size), strict=True))
        poison = overflow if step == OVERFLOW_STEP else None
        mine = poison if rank == world_size - 1 else None
        loss = _train_step(sharded, sharded_opt, amp, per_rank[rank], mine, clip=False)
        # on one process both overflows are an inf in the mean gradient
        around = _poison_last_rank(world_size) if poison else None
        reference_losses = emulated_cast_step(
            reference, per_rank, torch.float16, reference_amp.get_scale(),
            policy.reduce_dtype, around,
        )  # fmt: skip
        reference_amp.step(reference_opt)
        reference_amp.update()
        reference_opt.zero_grad()
        loss_difference = max(loss_difference, abs(loss - reference_losses[rank]))
        scales.append(amp.get_scale())
        reference_scales.append(reference_amp.get_scale())
    difference = max_difference(gs.full_state_dict(sharded), reference.state_dict())
    return difference, loss_difference, scales, reference_scales


def _tolerances(reduce: str, world_size: int, optimizer: str) -> tuple[float, float]:
    """The largest master and loss differences from the reference that the data allows.

    Exact where the reduction's sum does not depend on its order: two ranks (a + b is
    b + a), and an fp32 reduction (fp16 gradients have 11-bit significands, so three of
    them sum exactly in fp32). An fp16 reduction at 3 ranks rounds each partial sum to
    fp16, in an order gloo's ring picks per chunk of the buffer (at the first step 18 % of
    the elements differ from the reference's 0 + 1 + 2, and from every other fixed order):
    where the ranks' gradients nearly cancel, the averaged gradient differs by a good part
    of itself. SGD moves such an element by lr x that (with momentum: measured 3.1e-5);
    AdamW's normalised step by up to a fraction of lr = 3e-3 (measured 1.7e-4). The losses
    agreed (0.0); one fp16 ulp near ln 32 (2**-9) is allowed for a master that rounds to
    another fp16 value in the next forward.
    """
    if reduce == "float32" or world_size == 2:
        return 0.0, 0.0
    return {"sgd": 5e-5, "adamw": 2.5e-4}[optimizer], 2.0**-9


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("reduce", ["float16", "float32"])
@pytest.mark.parametrize("world_size, strategy", CASES)
def test_fp16_with_the_scaler_matches_the_same_casts_on_one_process(
    run_ranks, world_size, strategy, reduce, optimizer
):
    """Six steps; at the third, one element of the last rank's fp16 gradient of
    blocks.1.fc.weight overflows in backward: every rank skips the step and halves the
    scale, as the reference does. SGD's step is proportional to the gradient, so a wrong
    unscale shows; AdamW's is not (it would hide one) but normalises small differences up.
    Without the agreement, full and grad_op fail here (the rank whose slice holds the inf
    skips, the others step); no_shard's all-reduce hands the inf to every rank."""
    worst, loss_worst = _tolerances(reduce, world_size, optimizer)
    results = run_ranks(
        world_size, same_casts_case, strategy, reduce, 2000, "backward", "gs", optimizer,
        timeout=120,
    )  # fmt: skip
    for difference, loss_difference, scales, reference_scales in results:
        assert difference <= worst, difference
        assert loss_difference <= loss_worst, loss_difference
        assert scales == reference_scales == HALVED, (scales, reference_scales)


def _state(sharded: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The unsharded model and optimizer state, flat: ``{path: tensor or value}``."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{prefix}/{index}", item)
        else:
            flat[prefix] = value.clone() if isinstance(value, torch.Tensor) else value

    walk("model", gs.full_state_dict(sharded))
    walk("optim", gs.optim_state_dict(sharded, optimizer))
    return flat


def _differences(first: dict[str, Any], second: dict[str, Any]) -> list[str]:
    """The paths whose values differ (bit for bit), or that only one side has."""
    differing = sorted(set(first) ^ set(second))
    for path in sorted(set(first) & set(second)):
        a, b = first[path], second[path]
        same = torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        if not same:
            differing.append(path)
    return differing


def overflow_case(
    rank: int, world_size: int, strategy: str, where: str, optimizer: str, clip: bool,
    scaler: str = "gs", mesh_shape: tuple[int, int] | None = None,
) -> tuple[list[str], int, list[float], list[float], list[str]]:  # fmt: skip
    """Train through an overflow in the last rank's gradient at ``OVERFLOW_STEP``, and again
    with that step's batch left out (the scale halved by hand). Returns what the overflow
    step changed in the model and optimizer state, the growth tracker after it, the scales
    of both runs, and where the two runs end apart. ``mesh_shape``: on a ("replicate",
    "shard") mesh (HSDP)."""
    ends, scales = [], []
    for skip in (False, True):
        torch.manual_seed(0)
        model = EdgeGPT()
        mesh = None
        if mesh_shape is not None:
            mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=MESH_DIM_NAMES)
        sharded = gs.shard(
            model, three_groups(model, 1e-3), unit=UNITS, strategy=strategy,
            mixed_precision=POLICIES["float32"], mesh=mesh,
        )  # fmt: skip
        opt = OPTIMIZERS[optimizer](sharded.optimizer_groups())
        amp = _scaler(scaler, sharded, growth_interval=2000)
        run_scales = []
        for step, (inputs, targets) in enumerate(global_batches(STEPS, world_size)):
            mine = (inputs.chunk(world_size)[rank], targets.chunk(world_size)[rank])
            if step == OVERFLOW_STEP and skip:
                halved = {"scale": amp.get_scale() / 2, "_growth_tracker": 0}
                amp.load_state_dict({**amp.state_dict(), **halved})
            elif step == OVERFLOW_STEP:
                before = _state(sharded, opt)
                poison = where if rank == world_size - 1 else None
                _train_step(sharded, opt, amp, mine, poison, clip)
                changed = _differences(before, _state(sharded, opt))
                tracker = amp.state_dict()["_growth_tracker"]
            else:
                _train_step(sharded, opt, amp, mine, None, clip)
            run_scales.append(amp.get_scale())
        ends.append(_state(sharded, opt))
        scales.append(run_scales)
    return changed, tracker, scales[0], scales[1], _differences(ends[0], ends[1])


# "gradient": an inf in the last rank's slice after the reduction (only that rank sees it,
# whatever the strategy); "backward": one element of blocks.1.fc.weight's fp16 gradient on
# the last rank before the reduction, which full and grad_op leave on the rank whose slice
# holds it (no_shard's all-reduce hands it to every rank: any scaler would agree there).
OVERFLOWS = [
    ("gradient", "adamw", True),
    ("backward", "adamw_fused", False),
    ("gradient", "adamw_fused", True),
]


@pytest.mark.parametrize("where, optimizer, clip", OVERFLOWS)
@pytest.mark.parametrize("world_size, strategy", CASES)
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(
    run_ranks, world_size, strategy, where, optimizer, clip
):
    """Every rank skips the step and halves the scale; the model and optimizer state
    (moments and step counts: fused AdamW's step runs and must undo its count) stay as
    they were, and the run goes on as one that never saw that step's batch. With
    ``clip``: ``unscale_`` then torch's ``clip_grad_norm_`` on the shards (no effect on an
    overflowed step, since it is skipped); without: the fused optimizer's own unscale."""
    results = run_ranks(world_size, overflow_case, strategy, where, optimizer, clip, timeout=120)
    for changed, tracker, scales, skipped_scales, apart in results:
        assert changed == [], changed
        assert tracker == 0
        assert scales == skipped_scales == HALVED, (scales, skipped_scales)
        assert apart == [], apart


def test_an_overflow_on_one_rank_skips_the_step_on_every_replica_under_hsdp(run_ranks):
    """On a 2 x 2 mesh the last rank's inf is in its slice only, after the all-reduce
    across replicas: the ranks of the other shard group (the other replica of that slice
    and the ranks holding other slices) must skip too, so the agreement spans the world."""
    results = run_ranks(
        4, overflow_case, "full", "gradient", "adamw", True, "gs", (2, 2), timeout=120
    )
    for changed, tracker, scales, skipped_scales, apart in results:
        assert changed == [], changed
        assert tracker == 0
        assert scales == skipped_scales == HALVED, (scales, skipped_scales)
        assert apart == [], apart


@pytest.mark.parametrize("world_size, strategy", CASES)
def test_the_scale_grows_back_after_growth_interval_good_steps(run_ranks, world_size, strategy):
    """growth_interval 2, an overflow on one rank at step 2: the scale doubles after steps
    1 and 4, halves at 2, on every rank as torch's one-process scaler does, and training
    equals the reference's."""
    results = run_ranks(
        world_size, same_casts_case, strategy, "float32", 2, "gradient", timeout=120
    )
    s = INIT_SCALE
    for difference, loss_difference, scales, reference_scales in results:
        assert scales == reference_scales == [s, 2 * s, s, s, 2 * s, 2 * s], scales
        assert (difference, loss_difference) == (0.0, 0.0)  # fp32 reduction: exact


def test_a_scaler_without_agreement_lets_the_ranks_part(run_ranks):
    """What the agreement is for: torch.amp.GradScaler on each rank checks that rank's
    gradients alone, so after an overflow on one rank the others step and keep their
    scale."""
    results = run_ranks(2, overflow_case, "full", "gradient", "adamw", True, "torch")
    (changed, _, first, _, _), (_, _, second, _, _) = results
    assert changed  # the state moved: a rank stepped
    assert first[OVERFLOW_STEP] != second[OVERFLOW_STEP]


def test_gs_grad_scaler_interface_and_state():
    """torch.amp.GradScaler's interface and state dict; the device comes from the model;
    bad arguments are refused."""
    torch.manual_seed(0)
    model = gs.shard(nn.Linear(4, 2), None, mixed_precision=POLICIES["float32"])
    scaler = gs.GradScaler(model, init_scale=8.0, growth_interval=3)
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
    assert scaler.state_dict() == {
        "scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3,
        "_growth_tracker": 0,
    }  # fmt: skip
    other = gs.GradScaler(model)
    other.load_state_dict({**scaler.state_dict(), "_growth_tracker": 2})
    assert other.get_scale() == 8.0 and other.state_dict()["_growth_tracker"] == 2
    with pytest.raises(TypeError, match=r"gs\.shard"):
        gs.GradScaler(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="not both"):
        gs.GradScaler(model, process_group=object())
