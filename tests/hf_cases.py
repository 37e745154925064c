"""Cases of tests/test_hf_integrations.py, each run under torchrun (2 processes, gloo on the
CPU) as a user runs Hugging Face's Trainer or an accelerate loop:

    torchrun --standalone --nproc-per-node 2 tests/hf_cases.py FOLDER [CASE...]

(every case when none is named) in an empty FOLDER; rank 0 writes what the tests check to
FOLDER/result.json, per case its result or its traceback.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import groupshard as gs

from helpers import max_difference, run_cases, weights

STEPS = 4
ACCUMULATION = 2
BATCH = 2
SEQUENCE = 16


class Tokens(Dataset):
    """Random token sequences, the same on every rank (the Trainer splits them)."""

    def __init__(self, count: int = 64, vocab: int = 64) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, vocab, (count, SEQUENCE), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=SEQUENCE,
    )
    return LlamaForCausalLM(config)


def lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def arguments(output_dir: str, **overrides: Any) -> Any:
    from transformers import TrainingArguments

    options = {
        "output_dir": output_dir,
        "use_cpu": True,
        "per_device_train_batch_size": BATCH,
        "gradient_accumulation_steps": ACCUMULATION,
        "max_steps": STEPS,
        "learning_rate": 1e-2,
        "weight_decay": 0.1,
        "lr_scheduler_type": "cosine",
        "warmup_steps": 1,
        "max_grad_norm": 0.5,
        "save_strategy": "no",
        "report_to": [],
        "logging_steps": 1,
        "disable_tqdm": True,
        "seed": 7,
    }
    options.update(overrides)
    return TrainingArguments(**options)


def decoder_layer() -> type:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def losses(trainer: Any) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def ddp_trainer(folder: str, model: torch.nn.Module, **kwargs: Any) -> Any:
    from transformers import Trainer

    return Trainer(model=model, args=arguments(folder), train_dataset=Tokens(), **kwargs)


def ddp_run(folder: str, model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[float]]:
    trainer = ddp_trainer(folder, model)
    trainer.train()
    assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    return weights(trainer.model), losses(trainer)


def evaluated(trainer: Any) -> tuple[float, torch.Tensor]:
    """evaluate()'s loss and predict()'s logits, on 16 sequences split by rank."""
    loss = trainer.evaluate(eval_dataset=Tokens(count=16))["eval_loss"]
    return loss, torch.as_tensor(trainer.predict(Tokens(count=8)).predictions)


def groupshard_trainer(
    folder: str, model: torch.nn.Module, async_checkpoint: bool = False, **overrides: Any
) -> Any:
    from groupshard.integrations.transformers import Trainer

    return Trainer(
        model=model,
        args=arguments(folder, **overrides),
        train_dataset=Tokens(),
        groupshard={"unit": decoder_layer(), "strategy": "full"},
        async_checkpoint=async_checkpoint,
    )


def never_ddp(trainer: Any) -> bool:
    """Neither the Trainer nor accelerate holds a DDP (or any other wrapper) of the model."""
    held = [trainer.model_wrapped, *trainer.accelerator._models]
    return all(model is trainer.model for model in held)


def trainer_case(folder: str) -> dict[str, Any]:
    """Trainer + groupshard equals Trainer + DDP (accumulation, decay groups, cosine with
    warm-up, clipping); save_model loads with from_pretrained."""
    from transformers import LlamaForCausalLM

    ddp = ddp_trainer(os.path.join(folder, "ddp"), tiny_llama())
    ddp.train()
    reference, reference_losses = weights(ddp.model), losses(ddp)
    trainer = groupshard_trainer(os.path.join(folder, "gs"), tiny_llama())
    no_sync, entered = trainer.model.no_sync, []

    def counted_no_sync() -> Any:  # accelerate's accumulate() calls the model's no_sync
        entered.append(trainer.state.global_step)
        return no_sync()

    trainer.model.no_sync = counted_no_sync
    trainer.train()
    mine = weights(trainer.model)
    eval_loss, logits = evaluated(trainer)
    reference_eval_loss, reference_logits = evaluated(ddp)
    saved = os.path.join(folder, "saved")
    trainer.save_model(saved)
    dist.barrier()
    loaded = LlamaForCausalLM.from_pretrained(saved)
    groups = [
        (len(group["params"]), group["weight_decay"]) for group in trainer.optimizer.param_groups
    ]
    with open(os.path.join(saved, "config.json")) as file:
        architectures = json.load(file)["architectures"]
    return {
        # the unsharded model's counts and FLOPs, as under DDP
        "counts": [
            [trainer.model.num_parameters(), ddp.model.num_parameters()],
            [
                trainer.model.num_parameters(only_trainable=True, exclude_embeddings=True),
                ddp.model.num_parameters(only_trainable=True, exclude_embeddings=True),
            ],
            [trainer.get_num_trainable_parameters(), ddp.get_num_trainable_parameters()],
            [trainer.state.total_flos, ddp.state.total_flos],
        ],
        "architectures": architectures,
        "difference": max_difference(mine, reference),
        "losses": losses(trainer),
        "reference_losses": reference_losses,
        "from_pretrained_difference": max_difference(weights(loaded), mine),
        "eval_loss": [eval_loss, reference_eval_loss],
        "logits": [list(logits.shape), (logits - reference_logits).abs().max().item()],
        "never_ddp": never_ddp(trainer),
        "no_sync_entered_at_steps": entered,
        "groups": groups,
        "sharded": isinstance(trainer.model, gs.ShardedModule),
    }


def user_optimizer(model: torch.nn.Module) -> tuple[Any, Any]:
    """A user's own optimizer on the unsharded model: three groups (no decay on norms, a
    higher LR for the head) and a LambdaLR over them."""
    named = list(model.named_parameters())
    head = [p for n, p in named if n.startswith("lm_head")]
    norms = [p for n, p in named if "norm" in n]
    rest = [p for n, p in named if not n.startswith("lm_head") and "norm" not in n]
    optimizer = torch.optim.AdamW(
        [
            {"params": rest, "weight_decay": 0.1},
            {"params": norms, "weight_decay": 0.0},
            {"params": head, "lr": 3e-2, "weight_decay": 0.05},
        ],
        lr=1e-2,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return optimizer, scheduler


def optimizers_case(folder: str) -> dict[str, Any]:
    """Trainer(optimizers=(optimizer, scheduler)) built by the user on the unsharded model:
    sharded with its groups, the scheduler still bound, equal to the same under DDP."""
    from groupshard.integrations.transformers import Trainer

    model = tiny_llama()
    ddp = ddp_trainer(os.path.join(folder, "ddp"), model, optimizers=user_optimizer(model))
    ddp.train()
    model = tiny_llama()
    optimizer, scheduler = user_optimizer(model)
    trainer = Trainer(
        model=model, args=arguments(os.path.join(folder, "gs")), train_dataset=Tokens(),
        optimizers=(optimizer, scheduler), groupshard={"unit": decoder_layer()},
    )  # fmt: skip
    trainer.train()
    return {
        "difference": max_difference(weights(trainer.model), weights(ddp.model)),
        "same_optimizer": trainer.optimizer.optimizer is optimizer,
        "scheduler_bound": trainer.lr_scheduler is scheduler and scheduler.optimizer is optimizer,
        "lrs": [scheduler.get_last_lr(), ddp.lr_scheduler.get_last_lr()],
    }


def bf16_case(folder: str) -> dict[str, Any]:
    """TrainingArguments(bf16=True) shards with gs.MixedPrecision: the units compute in
    bf16 (their gathers move bf16) and reduce in fp32; the shards stay fp32."""
    reference, reference_losses = ddp_run(os.path.join(folder, "ddp"), tiny_llama())
    trainer = groupshard_trainer(os.path.join(folder, "gs"), tiny_llama(), bf16=True)
    trainer.train()
    policies = {
        (str(unit.policy.param_dtype), str(unit.policy.reduce_dtype))
        for unit in trainer.model.groupshard.runtime.units
        if unit.policy is not None
    }
    return {
        "policies": sorted(policies),
        "shard_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
        "losses": losses(trainer),
        "reference_losses": reference_losses,
        "difference_to_fp32": max_difference(weights(trainer.model), reference),
    }


def resume_case(folder: str) -> dict[str, Any]:
    """A run stopped at its step-2 checkpoint and resumed equals the whole run."""
    whole = groupshard_trainer(os.path.join(folder, "whole"), tiny_llama())
    whole.train()
    first = groupshard_trainer(
        os.path.join(folder, "parts"), tiny_llama(), save_strategy="steps", save_steps=2
    )
    first.train()
    checkpoint = os.path.join(folder, "parts", "checkpoint-2")
    # built with other weights: all it trains from comes from the checkpoint
    resumed = groupshard_trainer(os.path.join(folder, "parts"), tiny_llama(seed=3))
    resumed.train(resume_from_checkpoint=checkpoint)
    return {
        "difference": max_difference(weights(resumed.model), weights(whole.model)),
        "scheduler_steps": [resumed.lr_scheduler.last_epoch, whole.lr_scheduler.last_epoch],
        "files": sorted(os.listdir(checkpoint)),
        "losses": [losses(resumed), losses(whole)],
    }


def async_checkpoint_case(folder: str) -> dict[str, Any]:
    """Trainer(async_checkpoint=True): each checkpoint's groupshard/ folder is written in the
    background (gs.checkpoint.async_save) while training goes on; a run resumed from the
    step-2 checkpoint equals the whole run; what such checkpoints cannot serve is refused."""
    from unittest import mock

    whole = groupshard_trainer(os.path.join(folder, "whole"), tiny_llama())
    whole.train()
    parts = os.path.join(folder, "parts")
    first = groupshard_trainer(
        parts, tiny_llama(), async_checkpoint=True, save_strategy="steps", save_steps=2
    )
    with mock.patch.object(gs.checkpoint, "async_save", wraps=gs.checkpoint.async_save) as spy:
        first.train()
    checkpoint = os.path.join(parts, "checkpoint-2")
    resumed = groupshard_trainer(parts, tiny_llama(seed=3))
    resumed.train(resume_from_checkpoint=checkpoint)
    try:
        groupshard_trainer(parts, tiny_llama(), async_checkpoint=True, save_only_model=True)
        refused = "no error"
    except ValueError as error:
        refused = str(error)
    return {
        "background_saves": spy.call_count,
        "files": sorted(os.listdir(checkpoint)),
        "difference": max_difference(weights(resumed.model), weights(whole.model)),
        "checkpointed": max_difference(weights(first.model), weights(whole.model)),
        "refused": refused,
    }


def lora_case(folder: str) -> dict[str, Any]:
    """peft LoRA through the Trainer equals DDP, keeps no state for frozen weights, and
    save_model writes the adapter, which peft loads."""
    from peft import PeftModel

    reference_model = lora(tiny_llama())
    reference_counts = reference_model.get_nb_trainable_parameters()
    reference, _ = ddp_run(os.path.join(folder, "ddp"), reference_model)
    trainer = groupshard_trainer(os.path.join(folder, "gs"), lora(tiny_llama()))
    trainer.train()
    mine = weights(trainer.model)
    optimizer = trainer.optimizer.optimizer
    state_elements = sum(
        value.numel()
        for state in optimizer.state.values()
        for key, value in state.items()
        if key == "exp_avg"
    )
    trainable = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    frozen_grads = [
        name
        for name, p in trainer.model.named_parameters()
        if not p.requires_grad and p.grad is not None
    ]
    saved = os.path.join(folder, "adapter")
    trainer.save_model(saved)
    dist.barrier()
    loaded = PeftModel.from_pretrained(tiny_llama(), saved)
    # gs.full_state_dict loads into an unsharded peft model, which merges as usual
    unsharded = lora(tiny_llama(seed=5))
    unsharded.load_state_dict(mine)
    ids = Tokens()[0]["input_ids"][None]
    with torch.no_grad():
        before = unsharded(input_ids=ids).logits
        merged = unsharded.merge_and_unload()
        after = merged(input_ids=ids).logits
    return {
        "peft_counts": [trainer.model.get_nb_trainable_parameters(), reference_counts],
        "difference": max_difference(mine, reference),
        "state_elements": state_elements,
        "trainable_shard_elements": trainable,
        "lora_elements": sum(v.numel() for k, v in mine.items() if "lora_" in k),
        "lora_b_trained": max(v.abs().max().item() for k, v in mine.items() if "lora_B" in k),
        "frozen_grads": frozen_grads,
        "files": sorted(os.listdir(saved)),
        "adapter_difference": max_difference(weights(loaded), mine),
        "merged": [type(merged).__name__, (before - after).abs().max().item()],
    }


def accelerate_loop(model: torch.nn.Module, folder: str, sharded: bool, resume: str = "") -> Any:
    """A plain accelerate loop: prepare, accumulate, backward, clip, step, schedule."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import get_cosine_schedule_with_warmup

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    set_seed(7)
    if sharded:
        model = gs.shard(model, gs.decay_groups(model, 0.1), unit=decoder_layer())
        optimizer = torch.optim.AdamW(model.optimizer_groups(), lr=1e-2)
    else:
        optimizer = torch.optim.AdamW(gs.decay_groups(model, 0.1), lr=1e-2)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=BATCH)
    scheduler = get_cosine_schedule_with_warmup(optimizer, 1, STEPS)
    objects = (model, optimizer, loader, scheduler)
    if sharded:
        from groupshard.integrations.accelerate import prepare

        model, optimizer, loader, scheduler = prepare(accelerator, *objects)
    else:
        model, optimizer, loader, scheduler = accelerator.prepare(*objects)
    start = 0
    if resume:
        accelerator.load_state(resume)
        start = STEPS // 2 * ACCUMULATION
        loader = accelerator.skip_first_batches(loader, start)
    for index, batch in enumerate(loader, start=start):
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if index + 1 == STEPS // 2 * ACCUMULATION and not resume:
            accelerator.save_state(os.path.join(folder, "state"))
        if index + 1 == STEPS * ACCUMULATION:
            break
    return accelerator, model


def accelerate_case(folder: str) -> dict[str, Any]:
    """An accelerate loop over a sharded model equals the same loop under DDP; save_state
    and load_state in the middle give the whole run."""
    _, reference = accelerate_loop(tiny_llama(), os.path.join(folder, "ddp"), sharded=False)
    accelerator, model = accelerate_loop(tiny_llama(), folder, sharded=True)
    _, resumed = accelerate_loop(
        tiny_llama(), folder, sharded=True, resume=os.path.join(folder, "state")
    )
    return {
        "difference": max_difference(weights(model), weights(reference.module)),
        "resumed_difference": max_difference(weights(resumed), weights(model)),
        "never_ddp": all(m is model for m in accelerator._models),
    }


CASES = {
    "trainer": trainer_case,
    "resume": resume_case,
    "bf16": bf16_case,
    "optimizers": optimizers_case,
    "lora": lora_case,
    "accelerate": accelerate_case,
    "async_checkpoint": async_checkpoint_case,
}


if __name__ == "__main__":
    run_cases(CASES)
