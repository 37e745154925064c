"""Lightning's Trainer over groupshard, run under torchrun as a user runs it (2 processes, gloo
on the CPU; the cases are in lightning_cases.py): an unchanged LightningModule under
GroupShardStrategy equals the same module under strategy="ddp", resumed runs equal whole
ones, and the module is never wrapped."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import guide_script, run_under_torchrun

CASES = Path(__file__).resolve().parent / "lightning_cases.py"
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """Every case of lightning_cases.py, in one torchrun launch."""
    folder = tmp_path_factory.mktemp("lightning")
    run_under_torchrun([str(CASES), str(folder)], folder, timeout=300)
    return json.loads((folder / "result.json").read_text())


def case(results: dict, name: str) -> dict:
    if "error" in results[name]:
        pytest.fail(f"case {name!r} raised:\n{results[name]['error']}")
    return results[name]["result"]


def test_unchanged_module_equals_ddp_with_accumulation_and_clipping(results):
    result = case(results, "fit")
    assert result["sharded"] and result["never_ddp"]
    # the module's own groups and hyperparameters; the step schedule halved the lr once
    assert result["groups"] == [[3, 0.1, 0.015], [3, 0.0, 0.015]]
    assert result["global_step"] == 3
    # accumulation 2: each step's first micro-batch ran without gradient sync
    assert result["unsynced_at"] == [0, 1, 2]
    assert result["difference"] < TOLERANCE
    validation, reference_validation = result["validation"]
    assert validation == pytest.approx(reference_validation, abs=TOLERANCE)
    assert result["test"] == pytest.approx(validation)
    assert result["predictions"] == [6, [2, 8]]  # this rank's half of 24 samples, batch 2
    assert result["keys_equal"]  # state_dict(): the full weights under the original keys


def test_validate_before_fit_then_fit_equals_ddp(results):
    result = case(results, "validate_first")
    assert result["groups"] == [1, 2]  # validate's one group, then configure_optimizers' two
    assert result["difference"] < TOLERANCE


def test_clipping_by_value_equals_ddp(results):
    result = case(results, "clip_value")
    assert result["difference"] < TOLERANCE
    assert result["clipping_changed_it"] > 1e-3  # the clipping did act


def test_resume_from_save_checkpoint_equals_the_whole_run(results):
    result = case(results, "resume")
    assert result["difference"] == 0.0
    assert result["steps"] == [6, 6]  # the loop and the scheduler continued
    assert "groupshard.json" in result["files"] and ".metadata" in result["files"]
    # DDP's own .ckpt file continues under GroupShardStrategy (model and AdamW state)
    assert result["from_ddp_difference"] < TOLERANCE
    # to_lightning_checkpoint: a real Lightning .ckpt, which load_from_checkpoint reads and
    # from which a DDP fit resumes
    assert result["load_from_checkpoint"] == 0.0
    assert result["ddp_from_converted"] < TOLERANCE
    assert result["sharded_vs_ddp"] < TOLERANCE


def test_async_checkpoint_io_writes_in_the_background_and_resumes_exactly(results):
    result = case(results, "async_checkpoint")
    assert result["background_saves"] == 2  # ModelCheckpoint's, one an epoch
    assert result["folders"] == ["epoch=0.ckpt", "epoch=1.ckpt"]
    assert result["checkpointed"] == 0.0 and result["resumed"] == 0.0
    assert result["refused"].startswith(
        "GroupShardStrategy writes gs.checkpoint folders itself and cannot use the "
        "CheckpointIO OwnIO"
    ), result["refused"]


def test_bf16_mixed_equals_ddp_with_the_same_casts(results):
    result = case(results, "bf16")
    assert result["plugin"] == "GroupShardPrecision"
    assert result["policies"] == [["torch.bfloat16", "torch.float32"]]
    assert result["shard_dtypes"] == ["torch.float32"]
    assert result["difference"] < TOLERANCE
    assert result["difference_to_fp32"] > 1e-3  # it did compute in bf16
    # Lightning's autocast computes the loss in fp32, as under DDP
    assert result["loss_dtypes"] == ["torch.float32", "torch.float32"]


def test_fp16_scales_with_groupshards_scaler_and_resumes_its_scale(results):
    result = case(results, "fp16")
    assert result["scaler"] == "GradScaler"
    assert result["scale"] == result["restored_scale"] == 1024.0
    assert 0 < result["difference_to_fp32"] < 0.2


def test_peft_lora_inside_a_lightning_module(results):
    result = case(results, "lora")
    assert result["difference"] < TOLERANCE
    assert result["frozen_with_grad"] == 0 and result["frozen_in_optimizer"] == 0
    # this rank's shards of the trainable weights are half the adapters (world 2), and
    # AdamW keeps its two moments for them only
    assert result["trained_elements"] == result["adapter_elements"] // 2
    assert result["state_elements"] == 2 * result["trained_elements"]


def test_two_optimizers_are_refused(results):
    message = case(results, "refusals")["two_optimizers"]
    assert "2 optimizers" in message and "param groups of one optimizer" in message


def test_a_weight_read_on_rank_zero_alone_is_whole_or_refused(results):
    result = case(results, "refusals")
    assert result["weight_shape"] == [64, 16]  # the whole weight's, not rank 0's piece
    message = result["weight_norm"]  # a value from the piece would be a slice's: refused
    assert message.startswith("'model.blocks.0.fc.weight' belongs to a model sharded by gs.shard")
    assert "summon_full_params" in message and "gs.full_state_dict(model)" in message


def test_options_and_plugins_that_cannot_apply_raise():
    from lightning.pytorch.plugins.precision import FSDPPrecision

    from groupshard.integrations.lightning import GroupShardStrategy, _sharded_precision

    with pytest.raises(ValueError, match="reduce_bucket_size"):
        GroupShardStrategy(unit=None, reduce_bucket_size=1)
    with pytest.raises(ValueError, match="FSDPPrecision"):
        _sharded_precision(FSDPPrecision("bf16-mixed"))
    with pytest.raises(ValueError, match="never unpickles"):
        GroupShardStrategy().load_checkpoint("anything", weights_only=False)


def test_groupshard_imports_without_lightning():
    code = (
        "import sys\n"
        "for name in ('lightning', 'pytorch_lightning'):\n"
        "    sys.modules[name] = None  # import fails, as where it is not installed\n"
        "import groupshard, groupshard.integrations\n"
        "try:\n"
        "    import groupshard.integrations.lightning\n"
        "except ImportError as error:\n"
        "    print('refused:', error)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout


def test_the_guides_script_with_lightnings_own_launcher(tmp_path):
    """``python script.py`` with ``devices=2``: Lightning starts the second process itself
    (its subprocess launcher, as for DDP), and the run trains and checkpoints."""
    (tmp_path / "script.py").write_text(guide_script("lightning.md", 0))
    result = subprocess.run(
        [sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True,
        timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-6000:]
    assert re.search(r"trained 8 steps, loss [\d.]+", result.stdout), result.stdout
    assert (tmp_path / "lightning-run" / "last" / "groupshard.json").is_file()
