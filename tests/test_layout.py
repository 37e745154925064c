"""Layout, groups and units are pure: tested without processes."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import groupshard.groups
import groupshard.layout
import groupshard.units
from groupshard.layout import FROZEN_GROUP, build_flat_buffer, build_storage, padded_size

shapes = st.lists(
    st.lists(st.integers(min_value=1, max_value=7), min_size=0, max_size=3).map(tuple),
    min_size=1,
    max_size=8,
)


@settings(max_examples=200, deadline=None)
@given(shapes=shapes, world_size=st.integers(min_value=1, max_value=9))
def test_every_element_lands_in_exactly_one_shard(shapes, world_size):
    buffer = build_flat_buffer(0, [(f"p{i}", s) for i, s in enumerate(shapes)], world_size)
    assert buffer.padded_numel % world_size == 0
    assert 0 <= buffer.padding_numel < world_size
    seen = {
        f"p{i}": torch.zeros(slot.numel, dtype=torch.int64) for i, slot in enumerate(buffer.params)
    }
    flat_positions = set()
    for rank in range(world_size):
        start, end = buffer.shard_range(rank)
        assert end - start == buffer.shard_numel
        ids = buffer.segment_ids(rank)
        assert ids.numel() == buffer.shard_numel
        covered = torch.zeros(buffer.shard_numel, dtype=torch.bool)
        for segment in buffer.segments(rank):
            slot = buffer.params[segment.param_index]
            assert slot.fqn == segment.fqn
            seen[slot.fqn][segment.param_offset : segment.param_offset + segment.numel] += 1
            span = slice(segment.shard_offset, segment.shard_offset + segment.numel)
            assert not covered[span].any()
            covered[span] = True
            assert (ids[span] == segment.param_index).all()
            # the segment's shard position is the parameter's flat position
            flat_start = start + segment.shard_offset
            assert flat_start == slot.offset + segment.param_offset
            flat_positions.update(range(flat_start, flat_start + segment.numel))
        assert (ids[~covered] == len(buffer.params)).all()  # padding only
    for fqn, counts in seen.items():
        assert (counts == 1).all(), fqn
    assert flat_positions == set(range(buffer.numel))


@given(numel=st.integers(min_value=0, max_value=100), world_size=st.integers(1, 9))
def test_padded_size(numel, world_size):
    padded = padded_size(numel, world_size)
    assert padded % world_size == 0 and padded >= max(numel, 1) and padded - numel < world_size + 1


def test_storage_puts_trainable_groups_first_and_skips_empty_ones():
    storage = build_storage(
        "blocks.0",
        torch.float32,
        4,
        [(FROZEN_GROUP, [("f", (3,))]), (2, [("c", (5,))]), (0, [("a", (2, 3))]), (1, [])],
    )
    assert [b.group_index for b in storage.buffers] == [0, 2, FROZEN_GROUP]
    assert storage.shard_offsets == (0, 2, 4)
    assert storage.local_numel == 5 and storage.trainable_shard_numel == 4
    assert storage.trainable_unsharded_numel == 16 and storage.frozen_unsharded_numel == 4


def _imported_modules(path: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_pure_layers_do_not_import_torch_distributed():
    # `import torch` loads parts of torch.distributed by itself, so check the imports we write.
    for module in (groupshard.layout, groupshard.groups, groupshard.units):
        imported = _imported_modules(module.__file__)
        assert not [name for name in imported if name.startswith("torch.distributed")], module
        upper = {"groupshard.comm", "groupshard.storage", "groupshard.runtime", "groupshard.api"}
        assert not imported & upper, (module.__name__, imported & upper)
