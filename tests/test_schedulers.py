"""groupshard.schedulers, without processes: how new param groups are matched to the old ones,
and how a scheduler's lists follow (gs.regroup's tests run it on sharded models)."""

from __future__ import annotations

import pytest
import torch

from groupshard.schedulers import match_groups, plan_schedulers

A, B, C, D = (frozenset({name}) for name in "abcd")


def test_groups_match_by_the_parameters_they_hold():
    assert match_groups([A, B], [A, B]) == [0, 1]
    assert match_groups([A, B], [B, A]) == [1, 0]  # reordered
    assert match_groups([A, B], [A | C, B]) == [0, 1]  # grown
    assert match_groups([A | C, B], [B]) == [1]  # one removed
    assert match_groups([A, B], [A, B, C]) == [0, 1, None]  # one added
    with pytest.raises(ValueError, match=r"old groups \[0, 1\].*merge"):
        match_groups([A, B], [A | B])
    with pytest.raises(ValueError, match=r"param group 0 went to the new groups \[0, 1\]"):
        match_groups([A | B], [A, B])


def _optimizer(lrs: list[float]) -> torch.optim.Optimizer:
    groups = [{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9)


def test_a_new_group_takes_the_shared_lambda_and_its_own_lr():
    opt = _optimizer([0.1, 0.2])
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    opt.step()  # no gradients: nothing moves
    scheduler.step()
    plan = plan_schedulers([scheduler], opt, [A, B], [B, A, C], [{}, {}, {"lr": 0.4}])
    opt.add_param_group({"params": [torch.zeros(1, requires_grad=True)], "lr": 0.4})
    opt.param_groups[:] = [opt.param_groups[1], opt.param_groups[0], opt.param_groups[2]]
    plan.apply(opt.param_groups)
    assert scheduler.base_lrs == [0.2, 0.1, 0.4]
    opt.step()
    scheduler.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.05, 0.025, 0.1])


def test_lambdas_that_differ_leave_a_new_group_unknown():
    opt = _optimizer([0.1, 0.2])
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0, lambda s: 0.5])
    with pytest.raises(ValueError, match=r"lr_lambdas differs.*rebuild the scheduler"):
        plan_schedulers([scheduler], opt, [A, B], [A, B, C], [{}, {}, {"lr": 0.4}])
    # the same groups in another order need no new entry
    plan_schedulers([scheduler], opt, [A, B], [B, A], [{}, {}])


def test_one_cycle_ratios_shared_up_to_rounding():
    opt = _optimizer([0.1, 0.2])
    scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.3, 0.7], total_steps=10)
    plan = plan_schedulers([scheduler], opt, [A, B], [A, B, C], [{}, {}, {"lr": 0.5}])
    assert plan.new_keys[2]["max_lr"] == 0.5
    assert plan.new_keys[2]["initial_lr"] == pytest.approx(0.5 / 25)
    assert plan.new_keys[2]["min_lr"] == pytest.approx(0.5 / 25 / 1e4)
