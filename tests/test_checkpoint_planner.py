"""gs.checkpoint on public torch APIs: the DCP planners over explicit per-FQN pieces, the
pieces a save writes (the layout's segments, empty ones included), no torch.distributed._shard
and no private torch names, no deprecation warning from a save or a load."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import WriteItemType

import groupshard as gs
from groupshard.checkpoint import reader
from groupshard.checkpoint.planner import Piece, PieceLoadPlanner, PieceSavePlanner
from test_checkpoint import RESUME_AT, batches, save_case, sharded, train

CHECKPOINT_CODE = Path(gs.checkpoint.__file__).parent
# The one private torch name the checkpoint code uses, and why: torch's FileSystemWriter
# pickles each data file's byte range as this class, so the safe unpickler builds it.
ALLOWED_PRIVATE = {("reader.py", "torch.distributed.checkpoint.filesystem._StorageInfo")}


def _chunks(*bounds):
    return [ChunkStorageMetadata(torch.Size([o]), torch.Size([n])) for o, n in bounds]


def test_save_planner_writes_each_piece_with_its_offsets():
    data = torch.arange(10.0)
    pieces = {
        "model.w": Piece(data[3:8], torch.Size([20]), 11),
        "buffers.b": Piece.whole(torch.ones(2, 3)),
        "model.empty_here": Piece(data[:0], torch.Size([20]), 0),
        "optim.w.step": Piece.whole(torch.tensor(5.0), write=False),  # another rank writes it
    }
    planner = PieceSavePlanner(pieces)
    planner.set_up_planner({}, None, is_coordinator=True)
    items = {item.index.fqn: item for item in planner.create_local_plan().items}
    assert sorted(items) == ["buffers.b", "model.w"]
    piece = items["model.w"]
    assert piece.type == WriteItemType.SHARD and piece.tensor_data.size == torch.Size([20])
    assert piece.tensor_data.chunk == _chunks((11, 5))[0]
    assert piece.index.offset == torch.Size([11])
    assert items["buffers.b"].type == WriteItemType.TENSOR
    assert torch.equal(planner.resolve_data(piece), data[3:8])


def test_save_planner_refuses_a_piece_outside_its_entry():
    with pytest.raises(ValueError, match="outside its entry"):
        PieceSavePlanner({"model.w": Piece(torch.zeros(4), torch.Size([6]), 3)})


def test_load_planner_reads_a_piece_from_every_saved_piece_it_overlaps():
    entry = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size([10]), _chunks((0, 4), (4, 3), (7, 3))
    )
    metadata = Metadata({"model.w": entry})
    target = torch.zeros(5)  # elements 3..7 of the entry
    pieces = {
        "model.w": Piece(target, torch.Size([10]), 3),
        "model.v": Piece(target[:0], entry.size),
    }
    planner = PieceLoadPlanner(pieces)
    planner.set_up_planner({}, metadata, is_coordinator=True)
    items = planner.create_local_plan().items
    reads = sorted(
        (i.storage_index.offset[0], i.storage_offsets[0], i.dest_offsets[0], i.lengths[0])
        for i in items
    )
    # (saved piece, from where in it, to where in the target, how many)
    assert reads == [(0, 3, 0, 1), (4, 0, 1, 3), (7, 0, 4, 1)]
    for item in items:
        planner.resolve_tensor(item).fill_(item.storage_index.offset[0] + 1)
    assert target.tolist() == [1, 5, 5, 5, 8]


def layout_case(rank, world_size, path):
    """Every rank's segments of every parameter, as the layout has them."""
    model, _ = sharded(rank, world_size)
    segments = {}
    for storage in model.groupshard.storages:
        for buffer in storage.layout.buffers:
            for shard_rank in range(buffer.world_size):
                for segment in buffer.segments(shard_rank):
                    segments.setdefault(segment.fqn, []).append(
                        (segment.param_offset, segment.numel)
                    )
    return segments


def test_a_save_writes_the_layout_segments_as_pieces(run_ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(3, save_case, path)
    segments = run_ranks(3, layout_case, path)[0]
    metadata = reader.read_metadata(Path(path))
    entries = metadata.state_dict_metadata
    for fqn, expected in segments.items():
        for name in (f"model.{fqn}", f"optim.{fqn}.exp_avg"):
            if name not in entries:  # the frozen parameter has no optimizer state
                assert name.startswith("optim.wpe.weight")
                continue
            chunks = sorted((c.offsets[0], c.sizes[0]) for c in entries[name].chunks)
            assert chunks == sorted(expected), name
    # most parameters lie in one rank's shard: the other ranks hold empty pieces of them
    assert sum(len(pieces) == 1 for pieces in segments.values()) >= 5
    assert sorted(f for f in os.listdir(path) if f.endswith(".distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
        "__2_0.distcp",
    ]


def test_groupshard_never_imports_torch_distributed_shard():
    """torch's own DCP imports torch.distributed._shard; no groupshard module may."""
    probe = """
import builtins, sys
seen = []
original = builtins.__import__
def spy(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__", "")
    if importer.startswith("groupshard") and "_shard" in name.split("."):
        seen.append((importer, name))
    return original(name, globals, locals, fromlist, level)
builtins.__import__ = spy
import groupshard.checkpoint, groupshard.checkpoint.__main__, groupshard.full_state, groupshard.zero
import groupshard.cli.train
print(seen)
"""
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def _torch_names(tree: ast.Module) -> list[str]:
    """Every torch name a module imports or reaches by attribute (``torch.a.b``)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names if alias.name.startswith("torch")]
        elif isinstance(node, ast.Attribute):
            dotted = ast.unparse(node)
            if dotted.startswith("torch."):
                names.append(dotted)
    return names


def test_checkpoint_code_uses_no_private_torch_name():
    found = set()
    for file in sorted(CHECKPOINT_CODE.glob("*.py")):
        for name in _torch_names(ast.parse(file.read_text())):
            parts = name.split(".")
            if any(p.startswith("_") and not p.startswith("__") for p in parts):
                found.add((file.name, name))
    assert found == ALLOWED_PRIVATE
    source = "".join(f.read_text() for f in Path(gs.__file__).parent.rglob("*.py"))
    assert "torch.distributed._shard" not in source


def no_warnings_case(rank, world_size, path):
    """Deprecation and future warnings seen in a save and a load (the ranks are processes
    of their own: pytest's filters do not reach them, so they are recorded here)."""
    model, optimizer = sharded(rank, world_size)
    train(model, optimizer, batches()[:2], rank, world_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gs.checkpoint.save(path, model, optimizer, extra={"step": RESUME_AT})
        gs.checkpoint.load(path, *sharded(rank, world_size, seed=4))
        if rank == 0:
            gs.checkpoint.to_torch_save(path, path + ".pt")
    return [
        f"{w.category.__name__} at {w.filename}:{w.lineno}: {w.message}"
        for w in caught
        if issubclass(w.category, (DeprecationWarning, FutureWarning))
    ]


def test_save_and_load_emit_no_deprecation_warning(run_ranks, tmp_path):
    for seen in run_ranks(2, no_warnings_case, str(tmp_path / "ckpt")):
        assert seen == []


@pytest.mark.parametrize("category", [DeprecationWarning, FutureWarning])
def test_deprecation_warnings_from_groupshard_fail_the_test_run(category):
    """pyproject's filterwarnings: what our code warns of is an error (in this process)."""
    with pytest.raises(category):
        warnings.warn_explicit("deprecated", category, "x.py", 1, module="groupshard.checkpoint")
