"""Models bigger than a rank: built on the meta device, materialized and initialized unit
by unit (the same model at any world size), and pretrained safetensors weights read
slice by slice straight into the shards."""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

import groupshard as gs
from groupshard import comm
from groupshard.cli.model import GPT, Block, GPTConfig
from groupshard.materialize import checksum

from helpers import TINY, UNITS, EdgeGPT, max_difference, train_side_by_side

TOLERANCE = 1e-5


def _meta_gpt(config: GPTConfig = TINY) -> GPT:
    with torch.device("meta"):
        return GPT(config)


def meta_case(rank: int, world_size: int, strategy: str) -> tuple[dict, float]:
    """Shard + initialize a meta-built GPT, then train it beside one process started from
    the same weights."""
    torch.manual_seed(7)  # only the initial seed matters (per-module streams)
    model = _meta_gpt()
    sharded = gs.shard(
        model, gs.decay_groups(model, 0.1), unit=Block, strategy=strategy,
        param_init_fn=GPT._init_weights,
    )  # fmt: skip
    initial = gs.full_state_dict(sharded)
    reference = GPT(TINY)
    reference.load_state_dict(initial)
    optimizer = torch.optim.AdamW(sharded.optimizer_groups(), lr=3e-3)
    reference_opt = torch.optim.AdamW(gs.decay_groups(reference, 0.1), lr=3e-3)
    train_side_by_side(sharded, optimizer, reference, reference_opt, 4, rank, world_size)
    return initial, max_difference(gs.full_state_dict(sharded), reference.state_dict())


def test_meta_init_is_the_same_model_at_any_world_size(run_ranks):
    initial: list[dict[str, torch.Tensor]] = []
    for world_size, strategy in ((1, "full"), (2, "full"), (4, "full"), (2, "no_shard")):
        for state, difference in run_ranks(world_size, meta_case, strategy):
            assert difference <= TOLERANCE, (world_size, strategy, difference)
            initial.append(state)
    first = initial[0]
    for other in initial[1:]:
        assert sorted(other) == sorted(first)
        assert all(torch.equal(other[k], first[k]) for k in first)
    # initialized, as GPT's own init would: normal(0, 0.02) weights, LayerNorm ones
    assert abs(first["blocks.0.fc.weight"].std().item() - 0.02) < 2e-3
    assert torch.equal(first["ln_f.weight"], torch.ones(TINY.n_embd))


class Normalized(nn.Module):
    """A unit with BatchNorm (running-stat buffers) and a parameter without reset."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))


def test_buffers_are_materialized_and_initialized():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(Normalized(4), Normalized(4))
    sharded = gs.shard(model, None, unit=Normalized)
    for unit in sharded:
        assert torch.equal(unit.norm.running_mean, torch.zeros(4))
        assert torch.equal(unit.norm.running_var, torch.ones(4))
        assert not unit.norm.running_mean.is_meta
    sharded(torch.randn(3, 4)).sum().backward()
    assert all(torch.isfinite(v).all() for v in gs.full_state_dict(sharded).values())


def test_meta_misuse_is_refused():
    with torch.device("meta"):
        edge = EdgeGPT()  # its root holds logit_scale and has no reset_parameters
    with pytest.raises(ValueError, match=r"Module '<root>' \(EdgeGPT\).*param_init_fn"):
        gs.shard(edge, None, unit=UNITS)
    with torch.device("meta"):
        mixed = nn.Sequential(nn.Linear(2, 2))
    mixed.append(nn.Linear(2, 2))  # real parameters beside meta ones
    with pytest.raises(ValueError, match="meta device but"):
        gs.shard(mixed, None)
    with pytest.raises(ValueError, match="param_init_fn and device are for a model built"):
        gs.shard(nn.Linear(2, 2), None, device="cpu")


def _peak_rss_bytes() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def _current_rss_bytes() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


BIG = GPTConfig(vocab_size=256, block_size=16, n_layer=20, n_head=4, n_embd=720)
"""About 125M parameters (0.5 GB in fp32), in 20 units of 25 MB."""


def memory_case(rank: int, world_size: int) -> dict[str, int]:
    import gc

    gs.shard(_meta_gpt(), None, unit=Block)  # imports and first collectives: not per model
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to now
    baseline = _current_rss_bytes()
    torch.manual_seed(0)
    model = _meta_gpt(BIG)
    sharded = gs.shard(model, gs.decay_groups(model, 0.1), unit=Block,
                       param_init_fn=GPT._init_weights)  # fmt: skip
    peak = _peak_rss_bytes() - baseline
    local = sum(s.local.numel() * s.local.element_size() for s in sharded.groupshard.storages)
    total = sum(
        slot.numel * 4
        for s in sharded.groupshard.storages
        for b in s.layout.buffers
        for slot in b.params
    )
    unit = max(u.unsharded_bytes for u in sharded.groupshard.runtime.units)
    del sharded, model
    gc.collect()
    return {"peak": peak, "local": local, "total": total, "unit": unit}


def test_construction_memory_stays_per_rank(run_ranks):
    """At world 4 a rank holds its shards (total / 4, 125 MB) plus, while one unit is
    built, that unit's parameters, laid out as its flat buffer (25 MB): measured 151 MB of
    a 499 MB model. Asserted: below half the model (a 4-rank DDP holds all of it), and
    within the shards + two units + 16 MB (allocator slack)."""
    for result in run_ranks(4, memory_case, timeout=300):
        assert result["total"] > 450 * 2**20, result
        assert result["local"] <= result["total"] / 4 + 2**20, result
        assert result["peak"] < result["total"] / 2, result
        assert result["peak"] <= result["local"] + 2 * result["unit"] + 16 * 2**20, result


def safetensors_case(
    rank: int, world_size: int, path: str, mesh_shape: tuple[int, int] | None = None
) -> dict[str, object]:
    """Load a file written by an unsharded model into a meta-built sharded one (on a
    ("replicate", "shard") mesh: HSDP), then write it back with gs.save_safetensors."""
    torch.manual_seed(0)
    model = _meta_gpt()
    mesh = None
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    sharded = gs.shard(model, gs.decay_groups(model, 0.1), unit=Block, mesh=mesh)
    read = gs.load_full_state_dict(sharded, path)
    expected = load_file(path)
    full = gs.full_state_dict(sharded)
    local = sum(s.local.numel() * s.local.element_size() for s in sharded.groupshard.storages)
    largest = max(t.numel() * t.element_size() for t in expected.values())
    written = f"{path}.written"
    gs.save_safetensors(sharded, written)  # collective: rank 0 writes, then every rank agrees
    saved = load_file(written)
    return {
        "equal": all(torch.equal(full[k], expected[k]) for k in expected),
        "saved": saved.keys() == expected.keys()
        and all(torch.equal(saved[k], expected[k]) for k in expected),
        "read": read,
        "bound": local + largest,
        "total": sum(t.numel() * t.element_size() for t in expected.values()),
    }


@pytest.mark.parametrize("world_size, mesh_shape", [(2, None), (4, None), (4, (2, 2))])
def test_safetensors_loads_slice_by_slice(run_ranks, tmp_path, world_size, mesh_shape):
    """Each rank reads its shards' rows only, HSDP too (1/2 of the model per rank on a 2 x 2
    mesh), and gs.save_safetensors writes the same file back."""
    torch.manual_seed(3)
    plain = GPT(TINY).state_dict()
    path = tmp_path / "model.safetensors"
    save_file({k: v for k, v in plain.items() if k != "lm_head.weight"}, path)  # tied: once
    for result in run_ranks(world_size, safetensors_case, str(path), mesh_shape):
        assert result["equal"] and result["saved"], result
        assert result["read"] <= result["bound"], result  # its shards + one tensor at most
        assert result["read"] < result["total"], result


def bad_file_case(rank: int, world_size: int, path: str) -> str:
    torch.manual_seed(0)
    model = _meta_gpt()
    sharded = gs.shard(model, None, unit=Block)
    try:
        gs.load_full_state_dict(sharded, path)
    except ValueError as error:
        return str(error)
    return ""


def test_wrong_names_or_shapes_fail_on_every_rank(run_ranks, tmp_path):
    plain = {k: v for k, v in GPT(TINY).state_dict().items() if k != "lm_head.weight"}
    plain["wpe.weight"] = torch.zeros(3, 3)
    plain["decoder.extra"] = torch.zeros(2)
    del plain["ln_f.bias"]
    path = tmp_path / "bad.safetensors"
    save_file(plain, path)
    for message in run_ranks(2, bad_file_case, str(path)):
        assert "missing parameters: ['ln_f.bias']" in message, message
        assert "wpe.weight has shape [3, 3], expects [8, 16]" in message, message
        assert "unexpected entries: ['decoder.extra']" in message, message


def save_case(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(TINY)
    sharded = gs.shard(model, gs.decay_groups(model, 0.1), unit=Block)
    gs.save_safetensors(sharded, path)
    return gs.full_state_dict(sharded)


def test_save_safetensors_unit_by_unit(run_ranks, tmp_path):
    path = tmp_path / "out.safetensors"
    full = run_ranks(2, save_case, str(path))[0]
    written = load_file(path)
    assert sorted(written) == sorted(k for k in full if k != "lm_head.weight")
    assert all(torch.equal(written[k], full[k]) for k in written)
    reference = GPT(TINY)
    missing, unexpected = reference.load_state_dict(written, strict=False)
    assert list(missing) == ["lm_head.weight"] and not unexpected  # tied to wte.weight


def test_load_full_state_dict_says_what_it_accepts(tmp_path):
    sharded = gs.shard(copy.deepcopy(GPT(TINY)), None, unit=Block)
    with pytest.raises(ValueError, match=r"not a \.safetensors file or a folder"):
        gs.load_full_state_dict(sharded, str(tmp_path / "missing.safetensors"))
    with pytest.raises(TypeError, match="state dict"):
        gs.load_full_state_dict(sharded, 42)  # type: ignore[arg-type]


def broadcast_case(rank: int, world_size: int) -> bool:
    """Only rank 0 has the state dict: one broadcast per flat buffer gives every rank its
    slices."""
    torch.manual_seed(3)
    plain = GPT(TINY).state_dict()
    torch.manual_seed(0)
    model = _meta_gpt()
    sharded = gs.shard(model, gs.decay_groups(model, 0.1), unit=Block)
    gs.load_full_state_dict(sharded, plain if rank == 0 else {}, broadcast_from_rank0=True)
    full = gs.full_state_dict(sharded)
    return all(torch.equal(full[k], plain[k]) for k in plain)


def test_load_from_rank0_only(run_ranks):
    assert all(run_ranks(3, broadcast_case))


def _init_reading_the_rank(module: nn.Module) -> None:
    """GPT's init, but a marked module's weight is the rank: ranks initialize it differently."""
    GPT._init_weights(module)
    if getattr(module, "marked", False):
        module.weight.fill_(dist.get_rank() if dist.is_initialized() else 0)


def _first_build(init: str) -> GPT:
    model = _meta_gpt()
    model.blocks[1].fc.marked = True
    return gs.shard(
        model, None, unit=Block,
        param_init_fn=GPT._init_weights if init == "deterministic" else _init_reading_the_rank,
    )  # fmt: skip


def first_build_case(rank: int, world_size: int, init: str) -> dict[str, Any]:
    """A meta-built GPT sharded by ranks seeded differently: the bytes each broadcast moved,
    the warnings, and the initial weights."""
    torch.manual_seed(100 + rank)  # sync_module_states: rank 0's seed decides
    broadcasts: list[int] = []
    original = comm.broadcast

    def counted(tensor: torch.Tensor, ranks: comm.Ranks, src_rank: int = 0) -> None:
        broadcasts.append(tensor.numel() * tensor.element_size())
        original(tensor, ranks, src_rank)

    with (
        mock.patch.object(comm, "broadcast", counted),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        sharded = _first_build(init)
    return {
        "broadcasts": broadcasts,
        "warnings": [str(w.message) for w in caught],
        "state": gs.full_state_dict(sharded),
        "block_bytes": sum(p.numel() * 4 for p in GPT(TINY).blocks[1].parameters()),
    }


def test_a_deterministic_init_is_not_broadcast(run_ranks):
    """Initialized from rank 0's seed, every rank builds rank 0's model itself: the ranks
    compare checksums instead of broadcasting each unit; a unit initialized differently
    (an init reading the rank) is broadcast from rank 0 alone, with a warning, so the ranks
    still end with rank 0's values (sync_module_states' promise)."""
    torch.manual_seed(100)
    reference = gs.full_state_dict(_first_build("deterministic"))
    for result in run_ranks(2, first_build_case, "deterministic"):
        assert result["broadcasts"] == [8], result["broadcasts"]  # rank 0's seed alone
        assert result["warnings"] == []
        assert max_difference(result["state"], reference) == 0
    for result in run_ranks(2, first_build_case, "reading the rank"):
        # the seed, then block 1 (padded to a multiple of the world size)
        seed, *unit = result["broadcasts"]
        assert seed == 8 and len(unit) == 1, result["broadcasts"]
        assert result["block_bytes"] <= unit[0] < result["block_bytes"] + 64
        assert len(result["warnings"]) == 1 and "['blocks.1']" in result["warnings"][0]
        assert torch.equal(result["state"]["blocks.1.fc.weight"], torch.zeros(64, 16))  # rank 0's
        rest = {k: v for k, v in result["state"].items() if k != "blocks.1.fc.weight"}
        assert max_difference(rest, {k: reference[k] for k in rest}) == 0


def test_checksum_sees_every_word_and_its_place():
    torch.manual_seed(0)
    values = torch.randn(1000)
    base = checksum([values])
    changed = values.clone()
    changed[500] = torch.nextafter(changed[500], torch.tensor(1.0))  # one bit
    swapped = values.clone()
    swapped[[0, 999]] = values[[999, 0]]  # the same words in other places
    for other in (changed, swapped):
        assert not torch.equal(checksum([other]), base)
    # odd byte counts and dtypes, empty and 0-dim tensors, a view at an odd offset
    odd = torch.randn(7, dtype=torch.bfloat16)
    parts = [odd, torch.empty(0), torch.tensor(3.0), values[1:], torch.ones(3, dtype=torch.bool)]
    assert torch.equal(checksum(parts), checksum([p.clone() for p in parts]))
    assert not torch.equal(checksum(parts), checksum(parts[:-1]))
