"""Hugging Face's Trainer and an accelerate loop over groupshard, run under torchrun as a
user runs them (2 processes, gloo on the CPU; the cases are in hf_cases.py): equal to the
same run under DDP, resumed runs equal to whole ones, and the model never wrapped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_under_torchrun

CASES = Path(__file__).resolve().parent / "hf_cases.py"
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """Every case of hf_cases.py, in one torchrun launch (each launch costs seconds)."""
    folder = tmp_path_factory.mktemp("hf")
    run_under_torchrun([str(CASES), str(folder)], folder, timeout=420)
    return json.loads((folder / "result.json").read_text())


def case(results: dict, name: str) -> dict:
    if "error" in results[name]:
        pytest.fail(f"case {name!r} raised:\n{results[name]['error']}")
    return results[name]["result"]


def test_trainer_equals_trainer_with_ddp_and_saves_for_from_pretrained(results):
    result = case(results, "trainer")
    assert result["sharded"] and result["never_ddp"]
    # every micro-batch but each step's last under no_sync: one reduction per step
    assert result["no_sync_entered_at_steps"] == [0, 1, 2, 3]
    # Trainer's own groups: decay on the decay names, none on the norms
    assert [decay for _, decay in result["groups"]] == [0.1, 0.0]
    assert result["difference"] < TOLERANCE
    assert result["losses"] == pytest.approx(result["reference_losses"], abs=TOLERANCE)
    assert len(result["losses"]) == 4
    assert result["from_pretrained_difference"] == 0.0
    eval_loss, reference_eval_loss = result["eval_loss"]
    assert eval_loss == pytest.approx(reference_eval_loss, abs=TOLERANCE)
    shape, logits_difference = result["logits"]
    assert shape == [8, 16, 64] and logits_difference < 1e-4
    # parameter counts and FLOPs (the model card's) are the unsharded model's, as under DDP
    for sharded, reference in result["counts"]:
        assert sharded == reference, result["counts"]
    assert result["architectures"] == ["LlamaForCausalLM"]  # a class transformers has


def test_trainer_with_the_users_optimizer_and_scheduler_equals_ddp(results):
    result = case(results, "optimizers")
    assert result["same_optimizer"] and result["scheduler_bound"]
    assert result["difference"] < TOLERANCE
    assert result["lrs"][0] == pytest.approx(result["lrs"][1])


def test_trainer_bf16_computes_in_bf16_and_reduces_in_fp32(results):
    result = case(results, "bf16")
    assert result["policies"] == [["torch.bfloat16", "torch.float32"]]
    assert result["shard_dtypes"] == ["torch.float32"]
    # bf16 compute: near the fp32 run, not equal to it
    assert result["losses"] == pytest.approx(result["reference_losses"], abs=0.05)
    assert 0 < result["difference_to_fp32"] < 0.05


def test_groupshard_imports_without_the_hf_libraries():
    code = (
        "import sys\n"
        "for name in ('transformers', 'accelerate', 'peft'):\n"
        "    sys.modules[name] = None  # import fails, as where they are not installed\n"
        "import groupshard, groupshard.integrations\n"
        "try:\n"
        "    import groupshard.integrations.transformers\n"
        "except ImportError as error:\n"
        "    print('refused:', error)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout


def test_trainer_resumed_from_its_checkpoint_equals_the_whole_run(results):
    result = case(results, "resume")
    assert "groupshard" in result["files"] and "model.safetensors" in result["files"]
    assert result["difference"] < TOLERANCE
    assert result["scheduler_steps"][0] == result["scheduler_steps"][1] == 4
    resumed, whole = result["losses"]  # the resumed run's log starts with the first run's
    assert resumed == pytest.approx(whole, abs=TOLERANCE)


def test_trainer_writes_checkpoints_in_the_background_and_resumes_from_them(results):
    result = case(results, "async_checkpoint")
    assert result["background_saves"] == 2  # save_steps 2 of 4 steps
    assert "groupshard" in result["files"] and "model.safetensors" not in result["files"]
    assert result["checkpointed"] == 0.0  # checkpointing did not change the run
    assert result["difference"] < TOLERANCE
    assert result["refused"].startswith("Trainer(async_checkpoint=True) writes the model"), result
    assert "save_only_model=True" in result["refused"], result


def test_trainer_with_peft_lora_equals_ddp_without_state_for_frozen_weights(results):
    result = case(results, "lora")
    assert result["difference"] < TOLERANCE
    sharded_counts, reference_counts = result["peft_counts"]  # print_trainable_parameters'
    assert sharded_counts == reference_counts
    assert result["lora_b_trained"] > 0  # LoRA's B starts at zero: it trained
    assert result["frozen_grads"] == []
    # optimizer state for the LoRA weights' shards only (padding included)
    assert result["state_elements"] == result["trainable_shard_elements"]
    assert result["lora_elements"] // 2 <= result["state_elements"] <= result["lora_elements"]
    assert "adapter_model.safetensors" in result["files"]
    assert "model.safetensors" not in result["files"]
    assert result["adapter_difference"] == 0.0
    merged_class, merged_difference = result["merged"]
    assert merged_class == "LlamaForCausalLM" and merged_difference < 1e-5


def test_accelerate_loop_equals_ddp_and_resumes_from_save_state(results):
    result = case(results, "accelerate")
    assert result["never_ddp"]
    assert result["difference"] < TOLERANCE
    assert result["resumed_difference"] < TOLERANCE


def test_trainer_refuses_what_cannot_apply():
    from types import SimpleNamespace

    from groupshard.integrations.transformers import Trainer, _refuse_what_cannot_apply

    with pytest.raises(TypeError, match="needs groupshard="):
        Trainer(model=None)
    with pytest.raises(ValueError, match=r"groupshard= has \['units'\], which gs.shard does not"):
        Trainer(model=None, groupshard={"units": "LlamaDecoderLayer"})
    with pytest.raises(ValueError, match="does not take model_init"):
        Trainer(model_init=lambda: None, groupshard={})
    plain = {"fsdp": [], "deepspeed": None, "n_gpu": 1, "parallelism_config": None}
    accelerator = SimpleNamespace(num_processes=1)
    for change, message in [
        ({"fsdp": ["full_shard"]}, "fsdp=...\\) and groupshard both shard"),
        ({"deepspeed": "ds.json"}, "deepspeed=...\\) and groupshard both shard"),
        ({"n_gpu": 2}, "DataParallel"),
        ({"parallelism_config": object()}, "parallelism_config"),
    ]:
        with pytest.raises(ValueError, match=message):
            _refuse_what_cannot_apply(SimpleNamespace(**{**plain, **change}), accelerator)
