"""gs.ZeroRedundancyOptimizer keeps torch's semantics: changed parameters, missing gradients,
closures, per-parameter step counts on load, ranks that disagree, uneven inputs (Join)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP

import groupshard as gs
from groupshard import comm

from helpers import max_difference

TOLERANCE = 1e-6


def _set_grads(params, grads):
    for param, grad in zip(params, grads, strict=True):
        param.grad = None if grad is None else grad.clone()


def _step_with_unit_gradients(pairs):
    for module, optimizer in pairs:
        _set_grads(module.parameters(), [torch.ones_like(p) for p in module.parameters()])
        optimizer.step()
        optimizer.zero_grad()


def changed_parameters_case(rank, world_size):
    """Parameters changed between steps (in place, by load_state_dict, by replacing .data)
    are where the next step starts, with and without bucket views."""
    results = {}
    for bucket_view in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(4, 3)  # at world size 2 the weight straddles both slices
        reference = copy.deepcopy(model)
        zero = gs.ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.SGD, parameters_as_bucket_view=bucket_view, lr=0.1
        )
        plain = torch.optim.SGD(reference.parameters(), lr=0.1)
        checkpoint = {name: value + 1 for name, value in model.state_dict().items()}
        pairs = ((model, zero), (reference, plain))

        with torch.no_grad():  # the example: set to 5 after construction, grad 1, lr 0.1
            for module in (model, reference):
                module.weight.fill_(5.0)
        _step_with_unit_gradients(pairs)
        set_to_five = model.weight.detach().clone()
        for module in (model, reference):  # every resume
            module.load_state_dict(checkpoint)
        _step_with_unit_gradients(pairs)
        for module in (model, reference):  # a re-initialisation that replaces the tensor
            module.bias.data = torch.full((3,), -2.0)
        _step_with_unit_gradients(pairs)
        with torch.no_grad():  # in place again, after .data was replaced
            for module in (model, reference):
                module.bias.mul_(3.0)
        _step_with_unit_gradients(pairs)
        results[bucket_view] = (
            set_to_five,
            max_difference(model.state_dict(), reference.state_dict()),
        )
    return results


def test_parameters_changed_after_construction_are_kept(run_ranks):
    for result in run_ranks(2, changed_parameters_case):
        for set_to_five, difference in result.values():
            assert torch.allclose(set_to_five, torch.full((3, 4), 4.9))
            assert difference <= TOLERANCE


MISSING_GRADIENT_OPTIMIZERS = {  # a zero gradient would still move each of them
    "adam": (torch.optim.Adam, {"lr": 0.1, "weight_decay": 0.1}),
    "adamw": (torch.optim.AdamW, {"lr": 0.1, "weight_decay": 0.1}),
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}),
}
SHAPES = [(3, 4), (10,), (6,)]  # one bucket; at world size 2 the (10,) straddles both slices
MISSING = {0: 2, 1: 1}  # step -> the parameter without a gradient (its state new, then kept)


def _as_documented(optimizer, params, bucket_steps):
    """torch.optim with the one documented difference: a parameter's ``step`` is its
    bucket's count, and state created while it had no gradient is zero."""
    for param in params:
        if param.grad is None:
            continue
        state = optimizer.state[param]
        if not state:
            state.update(exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))
        state["step"] = torch.tensor(float(bucket_steps))


def missing_gradient_case(rank, world_size):
    results = {}
    for name, (optimizer_class, kwargs) in MISSING_GRADIENT_OPTIMIZERS.items():
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(shape)) for shape in SHAPES]
        documented = [nn.Parameter(p.detach().clone()) for p in params]
        plain = [nn.Parameter(p.detach().clone()) for p in params]
        zero = gs.ZeroRedundancyOptimizer(params, optimizer_class, **kwargs)
        documented_opt = optimizer_class(documented, **kwargs)
        plain_opt = optimizer_class(plain, **kwargs)
        unchanged, differences = [], []
        for step in range(3):
            generator = torch.Generator().manual_seed(step)
            grads = [torch.randn(shape, generator=generator) for shape in SHAPES]
            grads = [None if MISSING.get(step) == i else g for i, g in enumerate(grads)]
            for tensors in (params, documented, plain):
                _set_grads(tensors, grads)
            before = [p.detach().clone() for p in params]
            if optimizer_class is not torch.optim.SGD:
                _as_documented(documented_opt, documented, step)
            for optimizer in (zero, documented_opt, plain_opt):
                optimizer.step()
                optimizer.zero_grad()
            unchanged += [
                torch.equal(b, p)
                for b, p, g in zip(before, params, grads, strict=True)
                if g is None
            ]
            differences.append(
                max((p - d).abs().max().item() for p, d in zip(params, documented, strict=True))
            )
            zero.consolidate_state_dict(to=0)
            if rank == 0:  # per-element state (moments, momentum) exact, zero where never set
                saved = zero.state_dict()["state"]
                for index, param in enumerate(documented):
                    for key, value in saved[index].items():
                        if key != "step":
                            expected = documented_opt.state[param].get(key, torch.zeros_like(value))
                            differences.append((value - expected).abs().max().item())
        steps = None
        if rank == 0 and optimizer_class is not torch.optim.SGD:
            steps = (
                [s["step"].item() for s in zero.state_dict()["state"].values()],
                [plain_opt.state[p]["step"].item() for p in plain],
            )
        results[name] = (unchanged, max(differences), steps)
    return results


def test_parameter_without_gradient_keeps_values_and_state(run_ranks):
    for rank, result in enumerate(run_ranks(2, missing_gradient_case)):
        for name, (unchanged, difference, steps) in result.items():
            assert unchanged == [True, True], name
            assert difference <= TOLERANCE, name
            if rank == 0 and name != "sgd":  # the documented difference: one count per bucket
                assert steps == ([3.0, 3.0, 3.0], [3.0, 2.0, 2.0]), name


def _regression_closure(model, optimizer, inputs, targets, calls):
    def closure():
        calls.append(1)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        return loss

    return closure


def test_closure_reaches_the_local_optimizer_lbfgs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
    reference = copy.deepcopy(model)
    inputs, targets = torch.randn(16, 5), torch.randn(16, 1)
    zero = gs.ZeroRedundancyOptimizer(model.parameters(), torch.optim.LBFGS, lr=0.5, max_iter=4)
    plain = torch.optim.LBFGS(reference.parameters(), lr=0.5, max_iter=4)
    ours, theirs = [], []
    for _ in range(3):
        loss = zero.step(_regression_closure(model, zero, inputs, targets, ours))
        reference_loss = plain.step(_regression_closure(reference, plain, inputs, targets, theirs))
        assert loss.item() == pytest.approx(reference_loss.item(), abs=TOLERANCE)
    assert len(ours) == len(theirs) > 3
    assert max_difference(model.state_dict(), reference.state_dict()) <= TOLERANCE


class LookTwice(torch.optim.Optimizer):
    """SGD that evaluates the closure twice per step, stepping after each evaluation."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure):
        for _ in range(2):
            with torch.enable_grad():
                loss = closure()
            for group in self.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.add_(param.grad, alpha=-group["lr"])
        return loss


def _equal_layers(world_size):
    """One parameter of one size per rank: torch's ZeRO gives one to each rank, as ours does
    (the same partition, so the two can be compared where ranks step different things)."""
    torch.manual_seed(0)
    sizes = [(4, 3) if i % 2 == 0 else (3, 4) for i in range(world_size)]
    return nn.Sequential(*(nn.Linear(*size, bias=False) for size in sizes))


def _ours_and_torchs(world_size, optimizer_class, train):
    """``train(ddp, optimizer, calls)`` on one model with ours and on a copy with torch's
    ZeroRedundancyOptimizer: the state dicts' largest difference, and the calls recorded."""
    model = _equal_layers(world_size)
    torch_model = copy.deepcopy(model)
    calls = {}
    for name, module, zero_class in (("ours", model, gs.ZeroRedundancyOptimizer),
                                     ("torch", torch_model, TorchZero)):  # fmt: skip
        calls[name] = []
        train(DDP(module), zero_class(module.parameters(), optimizer_class, lr=0.1), calls[name])
    return max_difference(model.state_dict(), torch_model.state_dict()), calls


def closure_case(rank, world_size):
    inputs = torch.randn(3, 8, 4, generator=torch.Generator().manual_seed(rank))

    def train(ddp, optimizer, calls):
        for x in inputs:
            optimizer.step(_regression_closure(ddp, optimizer, x, x, calls))

    difference, calls = _ours_and_torchs(world_size, LookTwice, train)
    assert len(calls["ours"]) == len(calls["torch"]) == 6
    return difference


def test_closure_evaluated_by_the_local_optimizer_matches_torch_zero(run_ranks):
    assert max(run_ranks(2, closure_case)) <= TOLERANCE


def test_load_refuses_different_steps_in_one_bucket():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3))]
    plain = torch.optim.Adam(params, lr=1e-3)
    for grads in ([torch.ones(4, 3), torch.ones(3)], [None, torch.ones(3)]):
        _set_grads(params, grads)
        plain.step()
    saved = plain.state_dict()  # steps [1, 2]
    zero = gs.ZeroRedundancyOptimizer(params, torch.optim.Adam, lr=1e-3)
    with pytest.raises(
        ValueError,
        match=r"'step' differs between parameters that share one flat buffer \(1\.0 for "
        r"param_groups\[0\]\['params'\]\[0\]; 2\.0 for param_groups\[0\]\['params'\]\[1\]\)",
    ):
        zero.load_state_dict(saved)
    separate = gs.ZeroRedundancyOptimizer(params, torch.optim.Adam, lr=1e-3, max_slice_numel=1)
    separate.load_state_dict(saved)  # one bucket per parameter: each keeps its own count
    separate.consolidate_state_dict()
    assert [s["step"].item() for s in separate.state_dict()["state"].values()] == [1.0, 2.0]


def _message(action):
    try:
        action()
    except ValueError as error:
        return str(error)
    return "no error"


def disagreement_case(rank, world_size):
    torch.manual_seed(0)
    a, b, c = (nn.Parameter(torch.randn(shape)) for shape in ((3, 2), (3, 2), (4,)))
    zero_class, sgd = gs.ZeroRedundancyOptimizer, torch.optim.SGD
    messages = {
        "lr": _message(lambda: zero_class([a, b], sgd, lr=0.1 * (rank + 1))),
        "shapes": _message(lambda: zero_class([a, c] if rank == 0 else [c, a], sgd, lr=0.1)),
    }
    same_shapes_other_order = zero_class([a, b] if rank == 0 else [b, a], sgd, lr=0.1)
    _set_grads([a, b], [torch.ones(3, 2), torch.ones(3, 2)])
    messages["order"] = _message(same_shapes_other_order.step)
    zero = zero_class([a, b], sgd, lr=0.1)
    messages["add_param_group"] = _message(
        lambda: zero.add_param_group({"params": [c], "lr": 0.1 * (rank + 1)})
    )
    groups_after_failed_add = len(zero.param_groups), len(zero.optim.param_groups)
    calls = {"gather_objects": 0, "all_gather": 0}
    originals = {name: getattr(comm, name) for name in calls}

    def counting(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    counts = []
    try:
        for name in calls:
            setattr(comm, name, counting(name))
        for _ in range(3):
            _set_grads([a, b], [torch.ones(3, 2), torch.ones(3, 2)])
            zero.step()
            counts.append(dict(calls))
    finally:
        for name, original in originals.items():
            setattr(comm, name, original)
    return messages, groups_after_failed_add, counts


def test_ranks_that_disagree_fail_on_every_rank(run_ranks):
    for messages, groups_after_failed_add, counts in run_ranks(2, disagreement_case):
        assert "param_groups[0]['lr'] is 0.1 on rank 0 but 0.2 on rank 1" in messages["lr"]
        assert (
            "param_groups[0]['params'][0] is ((3, 2), 'torch.float32') on rank 0 but "
            "((4,), 'torch.float32') on rank 1" in messages["shapes"]
        )
        assert messages["order"].startswith(
            "param_groups[0]['params'][0] has different values on rank 0 and rank 1"
        )
        added = messages["add_param_group"]
        assert "param_groups[1]['lr'] is 0.1 on rank 0 but 0.2 on rank 1" in added
        assert groups_after_failed_add == (1, 1)
        # replicas that agree are checked with one all-reduce of a checksum, no objects
        # gathered, at the first step only: steady-state steps only all-gather
        assert counts == [{"gather_objects": 0, "all_gather": n} for n in (1, 2, 3)]


def join_case(rank, world_size):
    """Uneven inputs: rank r has 2 + r batches; Join shadows the steps of those that ran out."""
    model = _equal_layers(world_size)
    torch_model = copy.deepcopy(model)
    inputs = torch.randn(2 + rank, 8, 4, generator=torch.Generator().manual_seed(rank))
    for module, zero_class in ((model, gs.ZeroRedundancyOptimizer), (torch_model, TorchZero)):
        ddp = DDP(module)
        optimizer = zero_class(module.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
        assert isinstance(optimizer, Joinable)
        with Join([ddp, optimizer]):
            for x in inputs:
                ddp(x).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
    return max_difference(model.state_dict(), torch_model.state_dict()), model.state_dict()


def test_uneven_inputs_with_join_match_torch_zero(run_ranks):
    results = run_ranks(3, join_case)
    assert all(difference <= TOLERANCE for difference, _ in results)
    assert all(max_difference(state, results[0][1]) == 0 for _, state in results)


def test_overlap_with_ddp_says_what_to_use_instead():
    params = [nn.Parameter(torch.randn(3))]
    with pytest.raises(NotImplementedError, match=r'strategy="grad_op"'):
        gs.ZeroRedundancyOptimizer(params, torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    zero = gs.ZeroRedundancyOptimizer(params, torch.optim.SGD, None, False, False, lr=0.1)
    assert "overlap_with_ddp" not in zero.optim.defaults


# A rank's slice of a bucket that holds padding only: one scalar at world size 2, a few
# elements at world size 4 (torch's test file steps a [1] parameter at world size 2).
PADDING_ONLY = [(2, [1]), (4, [3]), (4, [5]), (4, [6]), (4, [1, 1, 1])]


def padding_only_case(rank, world_size, sizes):
    differences = []
    for bucket_view in (False, True):
        for optimizer_class, kwargs in MISSING_GRADIENT_OPTIMIZERS.values():
            torch.manual_seed(0)
            params = [nn.Parameter(torch.randn(n)) for n in sizes]
            twins = [nn.Parameter(p.detach().clone()) for p in params]
            plain = [nn.Parameter(p.detach().clone()) for p in params]
            zero = gs.ZeroRedundancyOptimizer(
                params, optimizer_class, parameters_as_bucket_view=bucket_view, **kwargs
            )
            theirs = TorchZero(twins, optimizer_class, **kwargs)
            reference = optimizer_class(plain, **kwargs)
            for step in range(3):
                generator = torch.Generator().manual_seed(step)
                grads = [torch.randn(n, generator=generator) for n in sizes]
                for tensors, optimizer in ((params, zero), (twins, theirs), (plain, reference)):
                    _set_grads(tensors, grads)
                    optimizer.step()
            differences += [(p - q).abs().max().item() for p, q in zip(params, plain, strict=True)]
            differences += [(p - q).abs().max().item() for p, q in zip(params, twins, strict=True)]
            zero.consolidate_state_dict(to=0)
            if rank == 0:
                saved, expected = zero.state_dict()["state"], reference.state_dict()["state"]
                differences += [
                    (saved[i][key] - value).abs().max().item()
                    for i, state in expected.items()
                    for key, value in state.items()
                ]
            zero.load_state_dict(reference.state_dict())  # each rank keeps its slice, or none
    return max(differences)


@pytest.mark.parametrize(("world_size", "sizes"), PADDING_ONLY)
def test_slice_of_padding_only_steps_as_torch(run_ranks, world_size, sizes):
    assert max(run_ranks(world_size, padding_only_case, sizes)) <= TOLERANCE


class IgnoresClosure(torch.optim.SGD):
    """torch's test file: a local optimizer whose ``step`` takes a keyword and ignores the
    closure it is given, stepping from the gradients already there."""

    def step(self, closure=None, calls=None):
        super().step()
        calls.append(5)


def closure_ignored_case(rank, world_size):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))

    def train(ddp, optimizer, calls):
        for _ in range(2):
            ddp(x).square().mean().backward()
            optimizer.step(_regression_closure(ddp, optimizer, x, x, []), calls=calls)

    difference, calls = _ours_and_torchs(world_size, IgnoresClosure, train)
    assert calls == {"ours": [5, 5], "torch": [5, 5]}
    return difference


def test_local_optimizer_that_ignores_the_closure_steps_from_the_gradients(run_ranks):
    calls = []
    x = nn.Parameter(torch.tensor([1.0]))
    zero = gs.ZeroRedundancyOptimizer([x], IgnoresClosure, lr=0.1)
    x.backward()
    zero.step(0, calls=calls)  # torch's test_step_with_kwargs, closure and all
    assert calls == [5]
    assert x.item() == pytest.approx(0.9)
    assert max(run_ranks(2, closure_ignored_case)) <= TOLERANCE


def test_parameter_in_a_group_of_its_own_keeps_its_own_step():
    """docs/zero.md's remedy for the one difference: Adam over a parameter that misses
    gradients, given a param group of its own, matches torch.optim exactly."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    plain = [nn.Parameter(p.detach().clone()) for p in params]
    groups = [{"params": params[:1]}, {"params": params[1:]}]
    zero = gs.ZeroRedundancyOptimizer(groups, torch.optim.Adam, lr=0.1)
    reference = torch.optim.Adam([{"params": plain[:1]}, {"params": plain[1:]}], lr=0.1)
    for step in range(4):
        grads = [torch.randn(shape) for shape in SHAPES]
        grads[0] = None if step % 2 else grads[0]
        for tensors, optimizer in ((params, zero), (plain, reference)):
            _set_grads(tensors, grads)
            optimizer.step()
    assert max((p - q).abs().max().item() for p, q in zip(params, plain, strict=True)) <= 1e-7
    zero.consolidate_state_dict()
    assert [s["step"].item() for s in zero.state_dict()["state"].values()] == [2.0, 4.0, 4.0]
