"""A sharded model still looks like the user's model: every original name resolves to the
user's parameter holding this rank's live piece outside forward (its shape the whole
parameter's; a computation on a piece raises, naming it), the model prints, and
``state_dict()`` /
``load_state_dict()`` (and torch.distributed.checkpoint.state_dict's functions) speak
the unsharded model's names and shapes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

import groupshard as gs

from helpers import (
    BATCH_PER_RANK,
    UNITS,
    EdgeGPT,
    global_batches,
    max_difference,
    three_groups,
    train_side_by_side,
)

TOLERANCE = 1e-5


def _expected_pieces(sharded: gs.ShardedModule, full: dict[str, torch.Tensor]) -> dict:
    """This rank's slice of each full parameter, by FQN, from the layout."""
    expected = {}
    for storage in sharded.groupshard.storages:
        for buffer in storage.layout.buffers:
            start, end = buffer.shard_range(storage.shard_rank)
            for slot in buffer.params:
                values = full[slot.fqn]
                if storage.replicated:
                    expected[slot.fqn] = values
                    continue
                first = max(slot.offset, start) - slot.offset
                last = max(first, min(slot.offset + slot.numel, end) - slot.offset)
                expected[slot.fqn] = values.reshape(-1)[first:last]
    return expected


def _resolve(model: torch.nn.Module, name: str) -> torch.Tensor:
    module_name, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(module_name), attr)


def names_case(rank: int, world_size: int, strategy: str) -> dict[str, object]:
    torch.manual_seed(0)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    reference_keys = list(reference.state_dict())
    sharded = gs.shard(model, three_groups(model, 1e-3), unit=UNITS, strategy=strategy)
    optimizer = torch.optim.AdamW(sharded.optimizer_groups(), lr=3e-3)
    printed = [repr(sharded)]
    worst = 0.0
    whole_shapes, refused = True, True
    for inputs, targets in global_batches(3, world_size):
        local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
        sharded(inputs[local], targets[local]).backward()
        optimizer.step()
        optimizer.zero_grad()
        printed.append(repr(sharded))
        full = gs.full_state_dict(sharded)
        for name, expected in _expected_pieces(sharded, full).items():
            param = _resolve(sharded, name)
            got = param.data + 0  # its data is the piece: never freed, never stale
            worst = max(worst, (got - expected).abs().max().item() if got.numel() else 0.0)
            # the parameter itself answers for the whole: its shape; a computation on a
            # piece that is not the whole parameter raises, naming it
            whole_shapes &= param.shape == full[name].shape and param.numel() == full[name].numel()
            if expected.shape == full[name].shape:
                refused &= torch.equal(param + 0, full[name])  # whole: a plain parameter
                continue
            try:
                param + 0
                refused = False
            except ValueError as error:  # naming it (a tied parameter: by one of its names)
                named, _, rest = str(error).partition(" belongs to a model sharded by gs.shard")
                refused &= bool(rest) and _resolve(sharded, named.strip("'")) is param
    # tied name (lm_head.weight) resolves too, to the same object as wte.weight
    tied = sharded.lm_head.weight is sharded.wte.weight
    keys = list(sharded.state_dict())
    return {
        "printed": all("Linear(" in text for text in printed),
        "worst": worst,
        "whole_shapes": whole_shapes,
        "refused": refused,
        "keys": keys == reference_keys,
        "tied": tied,
    }


@pytest.mark.parametrize(
    "world_size, strategy",
    [(1, "full"), (2, "full"), (3, "full"), (2, "grad_op"), (3, "grad_op"), (2, "no_shard")],
)
def test_names_resolve_to_live_pieces(run_ranks, world_size, strategy):
    for result in run_ranks(world_size, names_case, strategy):
        assert result == {
            "printed": True, "worst": 0.0, "whole_shapes": True, "refused": True, "keys": True,
            "tied": True,
        }, result  # fmt: skip


def test_prints_before_the_first_forward():
    torch.manual_seed(0)
    sharded = gs.shard(EdgeGPT(), None, unit=UNITS)
    text = repr(sharded.blocks[0].fc)
    assert text.startswith("Linear(in_features=16, out_features=64, bias=True")


def plain_load_case(rank: int, world_size: int) -> float:
    """A plain (unsharded, single-process) state dict loads with model.load_state_dict,
    and training continues equal to one process."""
    torch.manual_seed(0)
    trained = EdgeGPT()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01)
    plain = copy.deepcopy(trained.state_dict())
    torch.manual_seed(1)
    model = EdgeGPT()  # other weights: the load must replace them
    sharded = gs.shard(model, three_groups(model, 1e-3), unit=UNITS)
    result = sharded.load_state_dict(plain)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    reference = copy.deepcopy(trained)
    optimizer = torch.optim.AdamW(sharded.optimizer_groups(), lr=3e-3)
    reference_opt = torch.optim.AdamW(three_groups(reference, 1e-3), lr=3e-3)
    train_side_by_side(sharded, optimizer, reference, reference_opt, 3, rank, world_size)
    return max_difference(sharded.state_dict(), reference.state_dict())


def test_plain_state_dict_loads_and_trains_like_one_process(run_ranks):
    assert max(run_ranks(2, plain_load_case)) <= TOLERANCE


def dcp_state_dict_case(rank: int, world_size: int) -> tuple[bool, bool, bool]:
    torch.manual_seed(0)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    sharded = gs.shard(model, three_groups(model, 1e-3), unit=UNITS)
    options = StateDictOptions(full_state_dict=True)
    got = get_model_state_dict(sharded, options=options)
    full = gs.full_state_dict(sharded)
    same = sorted(got) == sorted(full) and all(torch.equal(got[k], full[k]) for k in full)
    keys = sorted(got) == sorted(reference.state_dict())
    shifted = {name: value + 1 for name, value in reference.state_dict().items()}
    set_model_state_dict(sharded, dict(shifted), options=options)  # it adds entries
    loaded = gs.full_state_dict(sharded)
    return same, keys, all(torch.equal(loaded[k], shifted[k]) for k in shifted)


def test_torch_distributed_checkpoint_state_dict_functions(run_ranks):
    for result in run_ranks(2, dcp_state_dict_case):
        assert result == (True, True, True)


def test_load_state_dict_strictness():
    torch.manual_seed(0)
    model = EdgeGPT()
    plain = copy.deepcopy(model.state_dict())
    sharded = gs.shard(model, None, unit=UNITS)
    partial = {k: v + 1 for k, v in plain.items() if k != "ln_f.bias"}
    with pytest.raises(ValueError, match=r"missing entries: 'ln_f\.bias'"):
        sharded.load_state_dict(partial)
    result = sharded.load_state_dict({**partial, "extra": torch.zeros(1)}, strict=False)
    assert list(result.missing_keys) == ["ln_f.bias"]
    assert list(result.unexpected_keys) == ["extra"]
    loaded = sharded.state_dict()
    assert torch.equal(loaded["ln_f.bias"], plain["ln_f.bias"])  # kept
    assert torch.equal(loaded["ln_f.weight"], plain["ln_f.weight"] + 1)  # loaded
    with pytest.raises(ValueError, match="assign=True"):
        sharded.load_state_dict(plain, assign=True)
