"""Per-parameter norms from flat shards equal torch's norms of the unsharded tensors."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import groupshard as gs

from helpers import (
    BATCH_PER_RANK,
    UNITS,
    EdgeGPT,
    full_grads,
    global_batches,
    set_grad_element,
    three_groups,
)

RTOL = 1e-6


def _backward_pair(rank, world_size, strategy, groups=None):
    torch.manual_seed(0)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    groups = groups or (lambda m: three_groups(m, 0.1))
    sharded = gs.shard(model, groups(model), unit=UNITS, strategy=strategy)
    inputs, targets = global_batches(1, world_size)[0]
    local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    sharded(inputs[local], targets[local]).backward()
    reference(inputs, targets).backward()
    return sharded, reference


def norms_case(rank: int, world_size: int, strategy: str) -> dict[str, object]:
    sharded, reference = _backward_pair(rank, world_size, strategy)
    result: dict[str, object] = {}
    for norm_type in (2.0, math.inf, 1.0, 3.0):
        result[f"param {norm_type}"] = {
            n: v.item() for n, v in gs.param_norms(sharded, norm_type).items()
        }
        result[f"grad {norm_type}"] = {
            n: v.item() for n, v in gs.grad_norms(sharded, norm_type).items()
        }
        result[f"expected param {norm_type}"] = {
            n: torch.linalg.vector_norm(p, norm_type).item()
            for n, p in reference.named_parameters()
        }
        result[f"expected grad {norm_type}"] = {
            n: torch.linalg.vector_norm(p.grad, norm_type).item()
            for n, p in reference.named_parameters()
            if p.grad is not None
        }
        # the same gradients, gathered: isolates the norm arithmetic from reduction order
        result[f"gathered grad {norm_type}"] = {
            n: torch.linalg.vector_norm(g, norm_type).item() for n, g in full_grads(sharded).items()
        }
    straddling = [
        slot.fqn
        for storage in sharded.groupshard.storages
        for buffer in storage.layout.buffers
        for slot in buffer.params
        if sum(1 for r in range(buffer.world_size) for s in buffer.segments(r) if s.fqn == slot.fqn)
        > 1
    ]
    result["straddling"] = straddling
    return result


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_norms_equal_torch_on_unsharded_tensors(run_ranks, world_size):
    results = run_ranks(world_size, norms_case, "full")
    for result in results:
        assert result == results[0]  # identical on every rank, bit for bit
    result = results[0]
    if world_size > 1:
        assert len(result["straddling"]) >= 3  # parameters cut by a shard boundary
    for norm_type in (2.0, math.inf, 1.0, 3.0):
        params, expected = result[f"param {norm_type}"], result[f"expected param {norm_type}"]
        assert params.keys() == expected.keys()  # tied weight once, frozen included
        for name, value in expected.items():
            assert params[name] == pytest.approx(value, rel=RTOL, abs=1e-12), (norm_type, name)
        grads = result[f"grad {norm_type}"]
        assert "wpe.weight" not in grads and "wte.weight" in grads  # frozen: no grad norm
        assert grads.keys() == result[f"expected grad {norm_type}"].keys()
        for name, value in result[f"gathered grad {norm_type}"].items():
            assert grads[name] == pytest.approx(value, rel=RTOL, abs=1e-12), (norm_type, name)
        for name, value in result[f"expected grad {norm_type}"].items():
            assert grads[name] == pytest.approx(value, rel=1e-5, abs=1e-9), (norm_type, name)


def test_norms_with_replicated_storage(run_ranks):
    result = run_ranks(2, norms_case, "no_shard")[0]
    for name, value in result["expected param 2.0"].items():
        assert result["param 2.0"][name] == pytest.approx(value, rel=RTOL)


def clip_case(rank: int, world_size: int, norm_type: float, poison: bool, error: bool):
    sharded, reference = _backward_pair(rank, world_size, "full")
    if poison:
        set_grad_element(sharded, "blocks.1.fc.weight", 7, math.inf)
        reference.blocks[1].fc.weight.grad.view(-1)[7] = math.inf
    try:
        total = gs.clip_grad_norm_(sharded, 0.05, norm_type, error_if_nonfinite=error)
    except RuntimeError as caught:
        return "raised", str(caught)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05, norm_type)
    clipped = full_grads(sharded)
    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    differences = {
        n: (torch.nan_to_num(clipped[n], nan=7.0) - torch.nan_to_num(g, nan=7.0)).abs().max().item()
        for n, g in grads.items()
    }
    return total.item(), expected.item(), max(differences.values())


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("world_size", [2, 3])
def test_clip_grad_norm_matches_torch(run_ranks, world_size, norm_type):
    for total, expected, difference in run_ranks(world_size, clip_case, norm_type, False, False):
        assert total == pytest.approx(expected, rel=1e-5)
        assert total > 0.05  # the gradients really were clipped
        assert difference <= 1e-7


def test_clip_grad_norm_non_finite(run_ranks):
    for total, expected, difference in run_ranks(2, clip_case, 2.0, True, False):
        assert math.isinf(total) and math.isinf(expected)
        assert difference == 0.0  # nan where torch has nan, zero elsewhere
    for outcome, message in run_ranks(2, clip_case, 2.0, True, True):
        assert outcome == "raised" and "non-finite" in message


def per_group_case(rank: int, world_size: int) -> tuple[dict, dict, float]:
    def groups(model):
        listed = three_groups(model, 0.1)
        listed[0]["max_grad_norm"] = 0.02
        listed[2]["max_grad_norm"] = 0.5
        return listed

    sharded, reference = _backward_pair(rank, world_size, "full", groups)
    optimizer = torch.optim.SGD(sharded.optimizer_groups(), lr=0.1)
    norms = gs.clip_grad_norm_per_group_(optimizer)
    expected = {}
    for index, group in enumerate(groups(reference)):
        if "max_grad_norm" in group:
            params = group["params"]
            expected[index] = torch.nn.utils.clip_grad_norm_(params, group["max_grad_norm"]).item()
    clipped = full_grads(sharded)
    difference = max(
        (clipped[n] - p.grad).abs().max().item()
        for n, p in reference.named_parameters()
        if p.grad is not None
    )
    return {k: v.item() for k, v in norms.items()}, expected, difference


def test_clip_grad_norm_per_group(run_ranks):
    for norms, expected, difference in run_ranks(3, per_group_case):
        assert norms.keys() == expected.keys() == {0, 2}
        for index in norms:
            assert norms[index] == pytest.approx(expected[index], rel=1e-5)
        assert difference <= 1e-7


def report_case(rank: int, world_size: int) -> tuple[list, list, dict]:
    sharded, reference = _backward_pair(rank, world_size, "full")
    expected = {
        n: (p.norm().item(), None if p.grad is None else p.grad.norm().item())
        for n, p in reference.named_parameters()
    }
    return gs.norm_report(sharded), gs.norm_report(sharded, by="layer"), expected


def test_norm_report(run_ranks):
    rows, layers, expected = run_ranks(2, report_case)[0]
    assert {row["name"] for row in rows} == expected.keys()
    for row in rows:
        param_norm, grad_norm = expected[row["name"]]
        assert row["param_norm"] == pytest.approx(param_norm, rel=RTOL)
        if grad_norm is None:
            assert row["grad_norm"] is None
        else:
            assert row["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    by_layer = {row["name"]: row for row in layers}
    fc = [expected["blocks.0.fc.weight"][0], expected["blocks.0.fc.bias"][0]]
    assert by_layer["blocks.0.fc"]["param_norm"] == pytest.approx(math.hypot(*fc), rel=RTOL)
    assert by_layer["blocks.0.fc"]["numel"] == 16 * 64 + 64
