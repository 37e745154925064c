"""Lightning Fabric over groupshard, run as a user runs it (2 processes, gloo on the CPU; the
cases are in fabric_cases.py): Fabric's documented loop under GroupShardStrategy equals the
same loop under strategy="ddp", its checkpoints resume exactly (at another world size too,
and from DDP's), and what it cannot do raises."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import guide_script, run_under_torchrun

CASES = Path(__file__).resolve().parent / "fabric_cases.py"
TOLERANCE = 1e-5
NAMES = ["fit", "setup_module", "precision", "empty_init", "refusals"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, dict]:
    """Every case of fabric_cases.py at world 2, in one torchrun launch."""
    folder = tmp_path_factory.mktemp("fabric")
    run_under_torchrun([str(CASES), str(folder), *NAMES], folder, timeout=300)
    return folder, json.loads((folder / f"result-{'-'.join(NAMES)}.json").read_text())


def case(launched: tuple[Path, dict], name: str) -> dict:
    results = launched[1]
    if "error" in results[name]:
        pytest.fail(f"case {name!r} raised:\n{results[name]['error']}")
    return results[name]["result"]


def test_fabric_loop_equals_ddp_and_resumes_exactly(launched):
    result = case(launched, "fit")
    assert result["sharded"]
    # the optimizer's own two groups, each over its shards of 3 units (root, 2 blocks)
    assert result["groups"] == [[3, 0.1], [3, 0.0]]
    sharded_losses, ddp_losses, resumed_losses = result["losses"]
    assert sharded_losses == pytest.approx(ddp_losses, abs=TOLERANCE)
    assert resumed_losses == sharded_losses  # the resumed run's steps, bit for bit
    assert result["difference"] < TOLERANCE
    assert result["resumed"] == 0.0
    assert result["remainder"] == []  # everything saved was asked for
    assert "groupshard.json" in result["files"] and ".metadata" in result["files"]
    assert result["from_ddp"] < TOLERANCE  # DDP's fabric.save file, continued sharded
    assert result["keys_equal"]  # state_dict(): the full weights under the original names


def test_a_folder_saved_at_world_2_continues_at_world_1(launched):
    folder = launched[0]
    run_under_torchrun([str(CASES), str(folder), "world_one"], folder, nproc=1)
    results = json.loads((folder / "result-world_one.json").read_text())
    assert "error" not in results["world_one"], results["world_one"]["error"]
    assert results["world_one"]["result"]["difference"] < TOLERANCE


def test_setup_module_then_setup_optimizers_equals_ddp(launched):
    result = case(launched, "setup_module")
    assert result["difference"] < TOLERANCE
    assert result["own"] < TOLERANCE  # a model sharded by gs.shard beforehand
    assert "pass the model and the optimizer built on it together to fabric.setup" in (
        result["refused"]
    )


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_mixed_precision_equals_ddp_with_the_same_casts(launched, name):
    result = case(launched, "precision")[name]
    half = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[name]
    assert result["policies"] == [[half, "torch.float32"]]  # half gathers, fp32 reductions
    assert result["shard_dtypes"] == ["torch.float32"]
    assert result["logits_dtype"] == "torch.float32"  # Fabric's output cast, as under DDP
    losses, reference = result["losses"]
    assert losses == pytest.approx(reference, abs=TOLERANCE)
    assert result["difference"] < TOLERANCE
    assert result["difference_to_fp32"] > 1e-3  # it did compute in the half dtype
    assert result["scaler"] == ("GradScaler" if name == "fp16" else None)


def test_empty_init_builds_on_meta_and_loads_exactly(launched):
    result = case(launched, "empty_init")
    assert result["on_meta"]
    assert result["difference"] == 0.0


def test_what_cannot_apply_raises_with_what_to_do(launched):
    result = case(launched, "refusals")
    refused = result["refused"]
    assert "2 optimizers" in refused["two_optimizers"]
    assert "filter=" in refused["filter"] and "gs.full_state_dict" in refused["filter"]
    assert "'fn' cannot be stored" in refused["unstorable"]
    assert "holds no model" in refused["no_model"]
    assert "gs.checkpoint.to_torch_save" in refused["load_without_state"]
    assert "never unpickles" in refused["unpickle"]
    assert "already sharded" in refused["sharded_twice"]
    assert "'optimizer' that does not exist" in refused["strict"]
    assert result["remainder"] == {}  # strict=False: the model loaded, nothing else
    assert ".fabric GroupShardStrategy" in refused["ddp_of_sharded"]


def test_options_and_plugins_that_cannot_apply_raise():
    from lightning.fabric.plugins.precision import FSDPPrecision

    from groupshard.integrations.fabric import GroupShardStrategy

    with pytest.raises(ValueError, match="reduce_bucket_size"):
        GroupShardStrategy(unit=None, reduce_bucket_size=1)
    with pytest.raises(ValueError, match="FSDPPrecision"):
        GroupShardStrategy(precision=FSDPPrecision("bf16-mixed"))
    with pytest.raises(ValueError, match="never unpickles"):
        GroupShardStrategy().load_checkpoint("anything", weights_only=False)


def test_the_guides_script_with_fabrics_own_launcher(tmp_path):
    """``python script.py`` with ``devices=2``: Fabric starts the second process itself, and
    the run trains, saves and loads; it prints what the guide shows."""
    (tmp_path / "script.py").write_text(guide_script("lightning.md", 2))
    result = subprocess.run(
        [sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True,
        timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-6000:]
    printed = re.search(r"fabric: 4 steps, loss [\d.]+; reloaded equals: True", result.stdout)
    assert printed, result.stdout
    guide = (Path(__file__).resolve().parents[1] / "docs" / "lightning.md").read_text()
    assert printed.group(0) in guide  # the guide shows the line the script prints
    assert (tmp_path / "fabric-run" / "last" / "groupshard.json").is_file()
