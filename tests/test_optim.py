"""LAMB, LARS, LARC and AGC: sharded == unsharded == a straightforward per-tensor version."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

import groupshard as gs
from groupshard import comm

from helpers import BATCH_PER_RANK, UNITS, EdgeGPT, global_batches, max_difference, three_groups

STEPS = 20
TOLERANCE = 1e-5


def exclusion_groups(model, name):
    """decay / no-decay / head groups; no-decay (or, for AGC, the head) is excluded."""
    groups = three_groups(model, head_lr=0.02)
    if name == "agc":
        groups[2]["agc"] = False
    else:
        groups[1]["trust_ratio"] = False
    return groups


def make_optimizer(name, groups):
    if name == "lamb":
        return gs.optim.LAMB(groups, lr=1e-2, weight_decay=0.01)
    if name == "lars":
        return gs.optim.LARS(groups, lr=0.5, weight_decay=1e-4, trust_coefficient=0.01)
    if name == "larc":
        sgd = torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=1e-4)
        return gs.optim.LARC(sgd, trust_coefficient=0.02)
    sgd = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    return gs.optim.AGC(sgd, clipping=0.01)


# --- straightforward per-tensor versions, written from the papers / apex / timm ----------


class PlainLAMB:
    def __init__(self, groups):
        self.groups = groups
        self.state = {}

    @torch.no_grad()
    def step(self):
        for group in self.groups:
            lr, trust = group.get("lr", 1e-2), group.get("trust_ratio", True)
            decay = group.get("weight_decay", 0.01)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state.setdefault(
                    p, {"t": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)}
                )
                state["t"] += 1
                state["m"] = 0.9 * state["m"] + 0.1 * p.grad
                state["v"] = 0.999 * state["v"] + 0.001 * p.grad * p.grad
                m_hat = state["m"] / (1 - 0.9 ** state["t"])
                v_hat = state["v"] / (1 - 0.999 ** state["t"])
                update = m_hat / (v_hat.sqrt() + 1e-6) + decay * p
                ratio = 1.0
                if trust and p.norm() > 0 and update.norm() > 0:
                    ratio = (p.norm() / update.norm()).item()
                p -= lr * ratio * update


class PlainLARS:
    def __init__(self, groups):
        self.groups = groups
        self.buffers = {}

    @torch.no_grad()
    def step(self):
        for group in self.groups:
            lr, trust = group.get("lr", 0.5), group.get("trust_ratio", True)
            decay = group.get("weight_decay", 1e-4)
            for p in group["params"]:
                if p.grad is None:
                    continue
                d = p.grad + decay * p
                w, g = p.norm(), p.grad.norm()
                if trust and w > 0 and g > 0:
                    d = d * (0.01 * w / (g + decay * w + 1e-8))
                if p in self.buffers:
                    self.buffers[p] = 0.9 * self.buffers[p] + d
                else:
                    self.buffers[p] = d.clone()
                p -= lr * self.buffers[p]


class PlainLARC:
    """apex.parallel.LARC around SGD, as apex writes it."""

    def __init__(self, groups):
        self.optim = torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=1e-4)

    @torch.no_grad()
    def step(self):
        decays = []
        for group in self.optim.param_groups:
            decays.append(group["weight_decay"])
            if not group.get("trust_ratio", True):
                continue
            weight_decay = group["weight_decay"]
            group["weight_decay"] = 0
            for p in group["params"]:
                if p.grad is None:
                    continue
                param_norm, grad_norm = torch.norm(p.data), torch.norm(p.grad.data)
                if param_norm != 0 and grad_norm != 0:
                    adaptive_lr = 0.02 * param_norm / (grad_norm + param_norm * weight_decay + 1e-8)
                    adaptive_lr = min(adaptive_lr / group["lr"], 1)
                    p.grad.data += weight_decay * p.data
                    p.grad.data *= adaptive_lr
        self.optim.step()
        for group, decay in zip(self.optim.param_groups, decays, strict=True):
            group["weight_decay"] = decay


class PlainAGC:
    """timm's adaptive_clip_grad before SGD."""

    def __init__(self, groups):
        self.optim = torch.optim.SGD(groups, lr=0.1, momentum=0.9)

    @torch.no_grad()
    def step(self):
        for group in self.optim.param_groups:
            if not group.get("agc", True):
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue

                def unitwise(x):
                    if x.ndim <= 1:
                        return x.norm()
                    return x.norm(dim=tuple(range(1, x.ndim)), keepdim=True)

                max_norm = unitwise(p).clamp(min=1e-3) * 0.01
                grad_norm = unitwise(p.grad)
                clipped = p.grad * (max_norm / grad_norm.clamp(min=1e-6))
                p.grad.copy_(torch.where(grad_norm < max_norm, p.grad, clipped))
        self.optim.step()


PLAIN = {"lamb": PlainLAMB, "lars": PlainLARS, "larc": PlainLARC, "agc": PlainAGC}


def _train(model, optimizer, batches, rank=0, world_size=1):
    for inputs, targets in batches:
        local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
        if world_size == 1:
            local = slice(None)
        model(inputs[local], targets[local]).backward()
        optimizer.step()
        for p in model.parameters():
            p.grad = None


@pytest.mark.parametrize("name", ["lamb", "lars", "larc", "agc"])
def test_unsharded_matches_a_plain_per_tensor_version(name):
    torch.manual_seed(0)
    model = EdgeGPT()
    plain = copy.deepcopy(model)
    start = copy.deepcopy(model.state_dict())
    batches = global_batches(STEPS, 1)
    _train(model, make_optimizer(name, exclusion_groups(model, name)), batches)
    _train(plain, PLAIN[name](exclusion_groups(plain, name)), batches)
    assert max_difference(model.state_dict(), plain.state_dict()) <= TOLERANCE
    assert max_difference(model.state_dict(), start) > 1e-3  # it trained


def sharded_case(rank: int, world_size: int, name: str, strategy: str) -> float:
    torch.manual_seed(0)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    sharded = gs.shard(model, exclusion_groups(model, name), unit=UNITS, strategy=strategy)
    batches = global_batches(STEPS, world_size)
    _train(sharded, make_optimizer(name, sharded.optimizer_groups()), batches, rank, world_size)
    _train(reference, make_optimizer(name, exclusion_groups(reference, name)), batches)
    return max_difference(gs.full_state_dict(sharded), reference.state_dict())


@pytest.mark.parametrize("name", ["lamb", "lars", "larc", "agc"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sharded_matches_unsharded(run_ranks, world_size, name):
    assert max(run_ranks(world_size, sharded_case, name, "full")) <= TOLERANCE


@pytest.mark.parametrize("strategy", ["grad_op", "no_shard"])
def test_other_strategies(run_ranks, strategy):
    assert max(run_ranks(2, sharded_case, "lamb", strategy)) <= TOLERANCE


def count_case(rank: int, world_size: int, name: str) -> tuple[int, int, int]:
    torch.manual_seed(0)
    model = EdgeGPT()
    sharded = gs.shard(model, exclusion_groups(model, name), unit=UNITS)
    optimizer = make_optimizer(name, sharded.optimizer_groups())
    inputs, targets = global_batches(1, world_size)[0]
    sharded(inputs, targets).backward()
    calls = []
    real_sum, real_max = comm.all_reduce_sum, comm.all_reduce_max
    with mock.patch.multiple(
        comm,
        all_reduce_sum=lambda *a: calls.append("sum") or real_sum(*a),
        all_reduce_max=lambda *a: calls.append("max") or real_max(*a),
    ):
        optimizer.step()
    parameters = len(list(EdgeGPT().parameters()))
    return len(calls), parameters, len(sharded.groupshard.storages)


@pytest.mark.parametrize("name", ["lamb", "lars", "larc", "agc"])
def test_one_all_reduce_per_step(run_ranks, name):
    calls, parameters, storages = run_ranks(2, count_case, name)[0]
    assert parameters >= 20 and storages >= 3
    assert calls == 1


def test_wrappers_are_optimizers_for_schedulers_and_state_dicts():
    model = EdgeGPT()
    sgd = torch.optim.SGD(exclusion_groups(model, "larc"), lr=0.1, momentum=0.9)
    larc = gs.optim.LARC(sgd, trust_coefficient=0.02)
    scheduler = torch.optim.lr_scheduler.StepLR(larc, step_size=1, gamma=0.5)
    inputs, targets = global_batches(1, 1)[0]
    model(inputs, targets).backward()
    larc.step()
    scheduler.step()
    assert [g["lr"] for g in sgd.param_groups] == [0.05, 0.05, 0.01]
    assert larc.state_dict() == sgd.state_dict() and len(sgd.state) > 0
    larc.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    larc.load_state_dict(larc.state_dict())
    assert larc.param_groups is sgd.param_groups and larc.state is sgd.state
    extra = torch.nn.Parameter(torch.ones(2))
    larc.add_param_group({"params": [extra], "lr": 0.3})
    assert sgd.param_groups[-1]["params"] == [extra]
