"""Param-group parsing, presets and unit planning (pure, one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import groupshard as gs
from groupshard.cli.model import Block
from groupshard.groups import resolve_groups
from groupshard.units import plan_units

from helpers import EdgeGPT


@pytest.fixture
def model():
    torch.manual_seed(0)
    return EdgeGPT()


def test_accepts_tensors_dicts_and_existing_param_groups(model):
    trainable = [p for p in model.parameters() if p.requires_grad]
    single = resolve_groups(model, trainable)
    assert len(single.groups) == 1 and single.frozen == ("wpe.weight",)
    generator = resolve_groups(model, (p for p in trainable))
    assert generator.groups == single.groups
    optimizer = torch.optim.AdamW(gs.decay_groups(model, 0.1), lr=1e-3)
    from_optimizer = resolve_groups(model, optimizer.param_groups)
    assert [g.options["weight_decay"] for g in from_optimizer.groups] == [0.1, 0.0]
    assert from_optimizer.groups[0].options["lr"] == 1e-3
    assert resolve_groups(model, None).groups[0].fqns == single.groups[0].fqns


def test_decay_groups_matches_the_usual_rule(model):
    decay, no_decay = gs.decay_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    decayed = {names[id(p)] for p in decay["params"]}
    assert "wte.weight" in decayed and "blocks.0.fc.weight" in decayed
    assert not {n for n in decayed if n.endswith("bias") or "ln" in n}
    assert "wpe.weight" not in decayed  # frozen parameters need no group
    no_embeddings = gs.decay_groups(model, 0.1, decay_embeddings=False)
    assert "wte.weight" in {names[id(p)] for p in no_embeddings[1]["params"]}


def test_groups_by_rule_orders_groups_by_options(model):
    groups = gs.groups_by(
        model,
        lambda name, p: "head" if name == "logit_scale" else "rest",
        {"head": {"lr": 0.5}, "rest": {}},
    )
    assert groups[0]["lr"] == 0.5 and len(groups[0]["params"]) == 1
    with pytest.raises(ValueError, match=r"'logit_scale'.*no entry in options"):
        gs.groups_by(model, lambda name, p: name == "logit_scale", {False: {}})


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize(
    ("make_groups", "error", "message"),
    [
        (lambda m: [], ValueError, "empty list"),
        (lambda m: _trainable(m)[0], TypeError, "single Tensor"),
        (lambda m: {"params": _trainable(m)}, TypeError, "one dict"),
        (
            lambda m: [{"params": _trainable(m)}, {"params": [m.logit_scale]}],
            ValueError,
            "'logit_scale' is in param group 1 and also in group 0",
        ),
        (lambda m: [*_trainable(m), m.logit_scale], ValueError, "'logit_scale'.*twice"),
        (
            lambda m: [{"params": [*_trainable(m), nn.Parameter(torch.ones(3))]}],
            ValueError,
            r"params\[\d+\]: a tensor of shape \(3,\) is not a parameter of the model",
        ),
        (
            lambda m: [{"params": [*_trainable(m), 1.0]}],
            TypeError,
            "expects a Tensor but got float",
        ),
        (lambda m: [{"params": _trainable(m)[1:]}], ValueError, "in no param group: 'logit_scale'"),
        (lambda m: [{"lr": 0.1}], ValueError, "group 0 has no 'params'"),
        (lambda m: [{"params": set(_trainable(m))}], TypeError, "is a set"),
        (lambda m: [{"params": _trainable(m)}, _trainable(m)[0]], TypeError, "not a mix"),
    ],
)
def test_bad_groups_name_the_parameter_or_group(model, make_groups, error, message):
    with pytest.raises(error, match=message):
        resolve_groups(model, make_groups(model))


def test_left_out_parameters_go_to_an_explicit_default_group(model):
    groups = resolve_groups(model, [{"params": [model.logit_scale], "lr": 1.0}], {"lr": 0.1})
    assert groups.groups[1].options == {"lr": 0.1}
    assert "wte.weight" in groups.groups[1].fqns


@pytest.mark.parametrize(
    ("param", "message"),
    [
        (nn.Parameter(torch.zeros(3, dtype=torch.long), requires_grad=False), "dtype torch.int64"),
        (nn.Parameter(torch.eye(3).to_sparse()), "layout torch.sparse_coo"),
    ],
)
def test_non_float_and_sparse_parameters_are_rejected(model, param, message):
    model.extra = nn.Module()
    model.extra.weight = param
    with pytest.raises(ValueError, match=f"'extra.weight'.*{message}"):
        resolve_groups(model, None)


def test_tied_parameter_is_owned_by_the_smallest_common_unit(model):
    plan = plan_units(model, (Block,))
    assert plan.names == ("", "blocks.0", "blocks.1")
    assert plan.owner["wte.weight"] == ""  # wte and lm_head share it
    assert plan.registrations["wte.weight"] == (("wte", "weight"), ("lm_head", "weight"))
    assert plan.owner["blocks.1.fc.bias"] == "blocks.1"
    by_predicate = plan_units(model, lambda module: isinstance(module, nn.LayerNorm))
    assert by_predicate.owner["blocks.0.ln_1.weight"] == "blocks.0.ln_1"
    # a parameter shared by two units belongs to their common parent
    model.blocks[1].fc.weight = model.blocks[0].fc.weight
    assert plan_units(model, Block).owner["blocks.0.fc.weight"] == ""
    with pytest.raises(TypeError, match="unit"):
        plan_units(model, "Block")
