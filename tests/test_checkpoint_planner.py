"""gs.checkpoint on public torch APIs: a rank's piece of a parameter as the blocks it
covers (DCP's default planners), the blocks a save writes (the layout's segments), no
torch.distributed._shard and no private torch names but the listed ones, no deprecation
warning from a save or a load."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import WriteItemType

import groupshard as gs
from groupshard.checkpoint import reader
from groupshard.checkpoint.planner import ParamPiece, Piece, SafeLoadPlanner
from groupshard.layout import flat_range_boxes
from test_checkpoint import RESUME_AT, batches, save_case, sharded, train

CHECKPOINT_CODE = Path(gs.checkpoint.__file__).parent
# The private torch names the checkpoint code uses, and why: torch's FileSystemWriter
# pickles each data file's byte range as _StorageInfo, so the safe unpickler builds it;
# a ParamPiece is a wrapper tensor (whole size, a rank's data) made as DTensor is made;
# torch_api returns what torch's own load_state_dict does (_IncompatibleKeys) from the
# function of torch's it wraps (torch_hook: torch's state-dict API has no extension point).
ALLOWED_PRIVATE = {
    ("torch_api.py", "torch.nn.modules.module._IncompatibleKeys"),
    ("reader.py", "torch.distributed.checkpoint.filesystem._StorageInfo"),
    ("planner.py", "torch.Tensor._make_wrapper_subclass"),
    ("planner.py", "torch._C._disabled_torch_function_impl"),
    ("planner.py", "torch._C"),
}


def _chunks(*bounds):
    return [ChunkStorageMetadata(torch.Size([o]), torch.Size([n])) for o, n in bounds]


def test_a_piece_of_a_matrix_is_written_as_the_blocks_it_covers():
    """Elements [11, 27) of a 5x6 matrix: the rest of row 1, rows 2-3, the start of row 4."""
    data = torch.arange(16.0)
    state_dict = {
        "model.w": ParamPiece(Piece(data, torch.Size([5, 6]), 11)),
        "model.b": torch.ones(2, 3),
        "model.empty_here": ParamPiece(Piece(data[:0], torch.Size([20]), 0)),
    }
    planner = DefaultSavePlanner(flatten_state_dict=False)
    planner.set_up_planner(state_dict, None, is_coordinator=True)
    items = planner.create_local_plan().items
    blocks = [
        (tuple(i.tensor_data.chunk.offsets), tuple(i.tensor_data.chunk.sizes))
        for i in items
        if i.index.fqn == "model.w"
    ]
    assert blocks == [((1, 5), (1, 1)), ((2, 0), (2, 6)), ((4, 0), (1, 3))]
    assert {i.index.fqn for i in items} == {"model.w", "model.b"}  # none of empty_here
    for item in items:
        if item.index.fqn == "model.w":
            assert item.type == WriteItemType.SHARD and item.tensor_data.size == (5, 6)
    whole_rows = next(i for i in items if tuple(i.index.offset) == (2, 0))
    assert torch.equal(planner.resolve_data(whole_rows), data[1:13].view(2, 6))
    assert state_dict["model.w"].size() == (5, 6)  # DCP compares the whole entry's size


def test_a_piece_outside_its_entry_is_refused():
    with pytest.raises(ValueError, match="outside a tensor"):
        Piece(torch.zeros(4), torch.Size([6]), 3)


def test_a_piece_is_no_tensor_to_compute_with():
    piece = ParamPiece(Piece(torch.zeros(4), torch.Size([2, 3]), 1))
    with pytest.raises(TypeError, match="full_state_dict=True"):
        piece.sum()
    assert "elements [1, 5)" in repr(piece)


def test_load_reads_a_piece_from_every_saved_block_it_overlaps():
    entry = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size([10]), _chunks((0, 4), (4, 3), (7, 3))
    )
    metadata = Metadata({"model.w": entry})
    target = torch.zeros(5)  # elements 3..7 of the entry
    state_dict = {
        "model.w": ParamPiece(Piece(target, torch.Size([10]), 3)),
        "model.v": ParamPiece(Piece(target[:0], entry.size)),
    }
    metadata.state_dict_metadata["model.v"] = entry
    planner = SafeLoadPlanner()
    planner.set_up_planner(state_dict, metadata, is_coordinator=True)
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
        for name in (f"model.{fqn}", f"optim.state.{fqn}.exp_avg"):
            if name not in entries:  # the frozen parameter has no optimizer state
                assert name.startswith("optim.state.wpe.weight")
                continue
            shape = entries[name].size
            blocks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in entries[name].chunks)
            expected_blocks = sorted(
                (tuple(o), tuple(n))
                for start, numel in expected
                for o, n in flat_range_boxes(shape, start, start + numel)
            )
            assert blocks == expected_blocks, name
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
