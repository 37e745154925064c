"""gs.ZeroRedundancyOptimizer: torch's API, param groups in the constructor, element balance."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP

import groupshard as gs
from groupshard.checkpoint import reader
from test_checkpoint import RESUME_AT, batches, lr_lambda, train

from helpers import BATCH_PER_RANK, UNITS, EdgeGPT, global_batches, max_difference

TOLERANCE = 1e-5


def two_groups(model):
    """gain/bias without decay, the rest with decay and another lr."""
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    return [
        {"params": no_decay, "weight_decay": 0.0},
        {"params": rest, "weight_decay": 0.1, "lr": 2e-3},
    ]


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "lamb": (gs.optim.LAMB, {"lr": 1e-2}),
}


def _local(rank, inputs, targets):
    local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    return inputs[local], targets[local]


def _step_both(ddp, zero, reference, reference_opt, batch, rank):
    ddp(*_local(rank, *batch)).backward()
    zero.step()
    zero.zero_grad()
    reference(*batch).backward()
    reference_opt.step()
    reference_opt.zero_grad()


def equivalence_case(
    rank, world_size, name, bucket_view, schedule=False, add_group_at=None, slice_numel=None
):
    torch.manual_seed(0)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    optimizer_class, kwargs = OPTIMIZERS[name]
    groups, reference_groups = two_groups(model), two_groups(reference)
    if add_group_at is not None:  # the 1-D group joins later
        late, reference_late = groups.pop(0), reference_groups.pop(0)
    zero = gs.ZeroRedundancyOptimizer(
        groups,
        optimizer_class,
        parameters_as_bucket_view=bucket_view,
        max_slice_numel=slice_numel,
        **kwargs,
    )
    assert len(zero.optim.param_groups) == len(groups)
    if slice_numel is not None:  # small buckets: several per group, each slice within bounds
        sizes = [p.numel() for g in zero.optim.param_groups for p in g["params"]]
        assert len(sizes) > 2 * len(groups) and max(sizes) <= max(
            slice_numel, max(-(-p.numel() // world_size) for p in model.parameters())
        )
    reference_opt = optimizer_class(reference_groups, **kwargs)
    schedulers = []
    if schedule:
        schedulers = [torch.optim.lr_scheduler.StepLR(o, 3, 0.5) for o in (zero, reference_opt)]
    ddp = DDP(model)
    for step, batch in enumerate(global_batches(10, world_size)):
        if step == add_group_at:
            zero.add_param_group({**late, "lr": 5e-3})
            reference_opt.add_param_group({**reference_late, "lr": 5e-3})
        _step_both(ddp, zero, reference, reference_opt, batch, rank)
        for scheduler in schedulers:
            scheduler.step()
    lrs = [g["lr"] for g in zero.param_groups], [g["lr"] for g in reference_opt.param_groups]
    return max_difference(model.state_dict(), reference.state_dict()), lrs


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ["adamw", "sgd"])
@pytest.mark.parametrize("bucket_view", [False, True])
def test_matches_single_process(run_ranks, world_size, name, bucket_view):
    for difference, _ in run_ranks(world_size, equivalence_case, name, bucket_view):
        assert difference <= TOLERANCE


def test_layer_wise_optimizer_is_exact_on_slices(run_ranks):
    for difference, _ in run_ranks(3, equivalence_case, "lamb", False):
        assert difference <= TOLERANCE


@pytest.mark.parametrize(("world_size", "name"), [(2, "adamw"), (3, "lamb"), (4, "sgd")])
def test_small_buckets_match_single_process(run_ranks, world_size, name):
    """Groups split into many buckets (each its own slice, all-gather and state)."""
    for difference, _ in run_ranks(world_size, equivalence_case, name, True, False, None, 40):
        assert difference <= TOLERANCE


def test_add_param_group_mid_training(run_ranks):
    for difference, (lrs, reference_lrs) in run_ranks(
        2, equivalence_case, "adamw", False, False, 4
    ):
        assert difference <= TOLERANCE
        assert lrs == reference_lrs == [2e-3, 5e-3]


def test_lr_scheduler(run_ranks):
    for difference, (lrs, reference_lrs) in run_ranks(2, equivalence_case, "adamw", True, True):
        assert difference <= TOLERANCE
        assert lrs == reference_lrs and lrs[0] == pytest.approx(1e-3 * 0.5**3)


def test_inner_defaults_show_through_and_generators_are_accepted():
    model = EdgeGPT()
    zero = gs.ZeroRedundancyOptimizer(
        (p for p in model.parameters() if p.requires_grad), torch.optim.AdamW, lr=1e-3
    )
    assert len(zero.param_groups) == 1 and zero.param_groups[0]["amsgrad"] is False
    assert zero.param_groups[0]["weight_decay"] == 0.01  # AdamW's own default


def missing_gradient_case(rank, world_size):
    """A parameter whose gradient is there in one step and missing in the next is left
    alone then, momentum included, as torch.optim does (the slice's gradient buffer is
    reused between steps)."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(7, 5)), nn.Parameter(torch.randn(3))]
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    zero = gs.ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1, momentum=0.9)
    reference_opt = torch.optim.SGD(reference, lr=0.1, momentum=0.9)
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=generator) for p in params]
        if step == 1:
            grads[0] = None
        for param, ref, grad in zip(params, reference, grads, strict=True):
            param.grad = None if grad is None else grad.clone()
            ref.grad = None if grad is None else grad.clone()
        zero.step()
        zero.zero_grad()
        reference_opt.step()
        reference_opt.zero_grad()
    assert [t.numel() for t in zero.gradient_slices] == [-(-38 // world_size)]
    return max((p - r).abs().max().item() for p, r in zip(params, reference, strict=True))


@pytest.mark.parametrize("world_size", [1, 2])
def test_gradient_missing_in_one_step_leaves_the_parameter_alone(run_ranks, world_size):
    assert max(run_ranks(world_size, missing_gradient_case)) <= TOLERANCE


def empty_group_case(rank, world_size):
    """An empty param group (torch.optim accepts one) has no bucket; the others step as
    torch's AdamW."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(7, 5)), nn.Parameter(torch.randn(3))]
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    groups = [{"params": []}, {"params": params[:1]}, {"params": params[1:], "lr": 0.1}]
    reference_groups = [
        {"params": []}, {"params": reference[:1]}, {"params": reference[1:], "lr": 0.1}
    ]
    zero = gs.ZeroRedundancyOptimizer(groups, torch.optim.AdamW, lr=0.01)
    reference_opt = torch.optim.AdamW(reference_groups, lr=0.01)
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        for param, ref in zip(params, reference, strict=True):
            param.grad = torch.randn(param.shape, generator=generator)
            ref.grad = param.grad.clone()
        zero.step()
        reference_opt.step()
    assert [len(g["params"]) for g in zero.param_groups] == [0, 1, 1]
    return max((p - r).abs().max().item() for p, r in zip(params, reference, strict=True))


@pytest.mark.parametrize("world_size", [1, 2])
def test_an_empty_param_group_is_accepted(run_ranks, world_size):
    assert max(run_ranks(world_size, empty_group_case)) <= TOLERANCE


@pytest.mark.parametrize(
    ("params", "error", "message"),
    [
        (lambda m: [], ValueError, "empty parameter list"),
        (lambda m: m.logit_scale, TypeError, "iterable of Tensors"),
        (lambda m: 1.0, TypeError, "iterable of Tensors or dicts"),
        (lambda m: [m.logit_scale, 3], TypeError, "contains a int"),
        (lambda m: [{"params": [m.logit_scale, "x"]}], TypeError, r"\['params'\]\[1\] is a str"),
        (lambda m: [nn.Parameter(torch.eye(2).to_sparse())], ValueError, "sparse"),
        (
            lambda m: [
                {"params": [m.logit_scale, nn.Parameter(torch.ones(2, dtype=torch.float64))]}
            ],
            ValueError,
            "Param group 0 mixes dense types",
        ),
    ],
)
def test_constructor_errors(params, error, message):
    with pytest.raises(error, match=message):
        gs.ZeroRedundancyOptimizer(params(EdgeGPT()), torch.optim.AdamW, lr=1e-3)


def error_on_one_rank_case(rank, world_size):
    model = EdgeGPT()
    params = [] if rank == world_size - 1 else list(model.parameters())
    try:
        gs.ZeroRedundancyOptimizer(params, torch.optim.AdamW, lr=1e-3)
    except ValueError as error:
        return str(error)
    return "no error"


def test_error_on_one_rank_fails_every_rank(run_ranks):
    messages = run_ranks(3, error_on_one_rank_case)
    assert "rank 2 failed: ZeroRedundancyOptimizer got an empty parameter list" in messages[0]
    assert messages[2] == "ZeroRedundancyOptimizer got an empty parameter list"


def _plain_continue(model, state_dict, batches, groups_of):
    optimizer = torch.optim.AdamW(groups_of(model), **OPTIMIZERS["adamw"][1])
    optimizer.load_state_dict(state_dict)
    for batch in batches:
        model(*batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def state_dict_case(rank, world_size, slice_numel=None):
    """ZeRO at this world size -> plain AdamW on one process, and plain -> ZeRO."""
    torch.manual_seed(0)
    batches = global_batches(10, world_size)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    plain_first = copy.deepcopy(model)
    zero = gs.ZeroRedundancyOptimizer(
        two_groups(model), torch.optim.AdamW, max_slice_numel=slice_numel, **OPTIMIZERS["adamw"][1]
    )
    reference_opt = torch.optim.AdamW(two_groups(reference), **OPTIMIZERS["adamw"][1])
    ddp = DDP(model)
    for batch in batches[:5]:
        _step_both(ddp, zero, reference, reference_opt, batch, rank)
    zero.consolidate_state_dict(to=0)
    if rank == 0:
        saved = zero.state_dict()
        resumed = _plain_continue(copy.deepcopy(model), saved, batches[5:], two_groups)
    # plain for 5 steps, then ZeRO continues from its state dict
    plain_opt = torch.optim.AdamW(two_groups(plain_first), **OPTIMIZERS["adamw"][1])
    for batch in batches[:5]:
        plain_first(*batch).backward()
        plain_opt.step()
        plain_opt.zero_grad()
    continued = copy.deepcopy(plain_first)
    zero_after = gs.ZeroRedundancyOptimizer(
        two_groups(continued), torch.optim.AdamW, lr=0.5, max_slice_numel=slice_numel
    )
    zero_after.load_state_dict(plain_opt.state_dict())
    assert zero_after.param_groups[1]["lr"] == 2e-3  # hyperparameters come from the state dict
    ddp_after = DDP(continued)
    for batch in batches[5:]:
        _step_both(ddp, zero, reference, reference_opt, batch, rank)
        ddp_after(*_local(rank, *batch)).backward()
        zero_after.step()
        zero_after.zero_grad()
    results = {"plain -> zero": max_difference(continued.state_dict(), reference.state_dict())}
    if rank == 0:
        results["zero -> plain"] = max_difference(resumed.state_dict(), reference.state_dict())
        results["state keys"] = sorted(saved["state"][0])
    return results


@pytest.mark.parametrize(("world_size", "slice_numel"), [(2, None), (4, None), (3, 40)])
def test_state_dict_round_trips(run_ranks, world_size, slice_numel):
    results = run_ranks(world_size, state_dict_case, slice_numel)
    assert results[0]["state keys"] == ["exp_avg", "exp_avg_sq", "step"]
    assert results[0]["zero -> plain"] <= TOLERANCE
    for result in results:
        assert result["plain -> zero"] <= TOLERANCE


def test_load_state_dict_with_state_for_some_parameters_of_a_bucket_names_the_rest():
    params = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3))]
    plain = torch.optim.AdamW(params, lr=1e-3)
    params[0].grad = torch.ones(4, 3)  # only the first gets a step, hence state
    plain.step()
    zero = gs.ZeroRedundancyOptimizer(params, torch.optim.AdamW, lr=1e-3)
    with pytest.raises(ValueError, match=r"no state for param_groups\[0\]\['params'\]\[1\]"):
        zero.load_state_dict(plain.state_dict())


class HugeAndTiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.huge = nn.Linear(300, 300)
        self.tiny = nn.ParameterList(nn.Parameter(torch.randn(3)) for _ in range(40))

    def forward(self, x):
        return self.huge(x) + sum(self.tiny).sum()


def _state_bytes(optimizer):
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )


def balance_case(rank, world_size):
    torch.manual_seed(0)
    model = HugeAndTiny()
    torch_model = copy.deepcopy(model)
    ours = gs.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    theirs = TorchZero(torch_model.parameters(), torch.optim.AdamW, lr=1e-3)
    inputs = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    for m, optimizer in ((DDP(model), ours), (DDP(torch_model), theirs)):
        for _ in range(3):
            m(inputs).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    difference = max_difference(model.state_dict(), torch_model.state_dict())
    return _state_bytes(ours.optim), _state_bytes(theirs.optim), difference


@pytest.mark.parametrize("world_size", [2, 3])
def test_balance_by_element_and_same_result_as_torch(run_ranks, world_size):
    results = run_ranks(world_size, balance_case)
    ours = [r[0] for r in results]
    theirs = [r[1] for r in results]
    assert max(ours) / min(ours) <= 1.01, ours
    print(f"\nworld size {world_size}: state bytes per rank groupshard {ours}, torch {theirs}")
    assert max(theirs) / min(theirs) > 1.5  # torch's whole-parameter partition, for comparison
    assert all(r[2] <= TOLERANCE for r in results)


def test_zero_imports_neither_the_model_front_end_nor_state_dicts():
    probe = "import sys, groupshard.zero; print(sorted(m for m in sys.modules if 'group' in m))"
    command = [sys.executable, "-c", probe]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "groupshard.api" not in result.stdout and "groupshard.full_state" not in result.stdout


# --- sharded checkpoints: gs.checkpoint.save(path, ddp_model, zero) ---------------------


def _zero_run(rank, world_size, seed, slice_numel=None, bucket_view=False, **overrides):
    torch.manual_seed(seed)
    model = EdgeGPT()
    zero = gs.ZeroRedundancyOptimizer(
        two_groups(model), torch.optim.AdamW, parameters_as_bucket_view=bucket_view,
        max_slice_numel=slice_numel, **{**OPTIMIZERS["adamw"][1], **overrides},
    )  # fmt: skip
    return model, DDP(model), zero


def _plain_reference():
    """One process, torch's AdamW, never interrupted (the LR schedule for RESUME_AT steps)."""
    torch.manual_seed(0)
    model = EdgeGPT()
    optimizer = torch.optim.AdamW(two_groups(model), **OPTIMIZERS["adamw"][1])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    train(model, optimizer, batches()[:RESUME_AT], 0, 1, scheduler)
    train(model, optimizer, batches()[RESUME_AT:], 0, 1)
    return model


def zero_save_case(rank, world_size, path):
    _, ddp, zero = _zero_run(rank, world_size, seed=0, slice_numel=40)  # several buckets a group
    scheduler = torch.optim.lr_scheduler.LambdaLR(zero, lr_lambda)
    train(ddp, zero, batches()[:RESUME_AT], rank, world_size, scheduler)
    gs.checkpoint.save(path, ddp, zero, extra={"step": RESUME_AT})
    return [group["lr"] for group in zero.param_groups]


def zero_resume_case(rank, world_size, path, into):
    """Load into ZeRO at this world size (other buckets, bucket views), or into a gs.shard
    model with the same groups; train on; compare with a ZeRO run that never stopped and
    with one process and torch's AdamW."""
    if into == "zero":
        model, trained, optimizer = _zero_run(rank, world_size, seed=123, bucket_view=True, lr=1.0)
    else:
        torch.manual_seed(123)
        model = EdgeGPT()
        trained = gs.shard(model, two_groups(model), unit=UNITS)
        optimizer = torch.optim.AdamW(trained.optimizer_groups(), lr=1.0)
    extra = gs.checkpoint.load(path, trained, optimizer)
    lrs = [group["lr"] for group in optimizer.param_groups]
    train(trained, optimizer, batches()[RESUME_AT:], rank, world_size)
    state = model.state_dict() if into == "zero" else gs.full_state_dict(trained)
    _, ddp, zero = _zero_run(rank, world_size, seed=0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(zero, lr_lambda)
    train(ddp, zero, batches()[:RESUME_AT], rank, world_size, scheduler)
    train(ddp, zero, batches()[RESUME_AT:], rank, world_size)
    uninterrupted = max_difference(state, ddp.module.state_dict())
    return extra["step"], lrs, uninterrupted, max_difference(state, _plain_reference().state_dict())


@pytest.mark.parametrize("into", ["zero", "shard"])
def test_sharded_checkpoint_at_another_world_size(run_ranks, tmp_path, into):
    path = str(tmp_path / "ckpt")
    saved_lrs = run_ranks(3, zero_save_case, path)[0]
    # each rank wrote its slices: a third of the elements of the model and of each state
    metadata = reader.read_metadata(Path(path))
    written: dict[tuple[str, str], int] = {}
    for index, info in metadata.storage_data.items():
        entry = metadata.state_dict_metadata[index.fqn]
        if not isinstance(entry, TensorStorageMetadata):  # a param group's hyperparameter
            continue
        kind = "model" if index.fqn.startswith("model.") else index.fqn.rsplit(".", 1)[-1]
        chunk = entry.chunks[index.index]
        key = (kind, info.relative_path)
        written[key] = written.get(key, 0) + chunk.sizes.numel()
    for kind in ("model", "exp_avg", "exp_avg_sq"):
        per_rank = [written.get((kind, f"__{rank}_0.distcp"), 0) for rank in range(3)]
        assert max(per_rank) - min(per_rank) <= 0.2 * sum(per_rank) / 3, (kind, per_rank)
    for step, lrs, uninterrupted, plain in run_ranks(2, zero_resume_case, path, into):
        assert step == RESUME_AT and lrs == saved_lrs
        assert uninterrupted <= TOLERANCE and plain <= TOLERANCE
    if into == "zero":  # and one plain file for one process, which trains on equally
        gs.checkpoint.to_torch_save(path, str(tmp_path / "plain.pt"))
        saved = torch.load(str(tmp_path / "plain.pt"), weights_only=True)
        torch.manual_seed(7)
        continued = EdgeGPT()
        continued.load_state_dict(saved["model"])
        full_batches = [(inputs, targets) for inputs, targets in batches()[RESUME_AT:]]
        _plain_continue(continued, saved["optim"], full_batches, two_groups)
        assert max_difference(continued.state_dict(), _plain_reference().state_dict()) <= TOLERANCE
