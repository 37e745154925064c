"""Cases of tests/test_lightning_integration.py, each run under torchrun (2 processes, gloo
on the CPU) as a user runs a Lightning Trainer:

    torchrun --standalone --nproc-per-node 2 tests/lightning_cases.py FOLDER [CASE...]

(every case when none is named) in an empty FOLDER; rank 0 writes what the tests check to
FOLDER/result.json, per case its result or its traceback.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import groupshard as gs
from groupshard.cli.model import GPT, Block, GPTConfig
from groupshard.integrations.lightning import GroupShardStrategy, to_lightning_checkpoint

from helpers import max_difference, run_cases, weights

CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
SAMPLES = 24  # 3 optimizer steps an epoch at world 2, batch 2, accumulation 2
BATCH = 2
ACCUMULATION = 2
CLIP = 0.05  # small enough that every step clips


class LanguageModel(L.LightningModule):
    """An unchanged LightningModule: two param groups (decay and no decay) and a schedule."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = GPT(CONFIG)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)

    def loss(self, batch: Any) -> torch.Tensor:
        ids, targets = batch
        logits = self(ids)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_index: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def test_step(self, batch: Any, batch_index: int) -> None:
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> Any:
        decay = [p for name, p in self.named_parameters() if p.dim() >= 2]
        no_decay = [p for name, p in self.named_parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=3e-2,
        )
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class CastModel(LanguageModel):
    """The reference of bf16-mixed under DDP (with its autocast): the same casts as
    gs.MixedPrecision's (the blocks and the root compute with bf16 copies of the fp32
    weights)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        cast = {name: p.to(torch.bfloat16) for name, p in self.model.named_parameters()}
        return torch.func.functional_call(self.model, cast, (ids,))


class RawLoss(LanguageModel):
    """The loss straight from the logits (no ``.float()``), its dtype kept: autocast makes
    it fp32 under bf16-mixed, as a user's logged loss is under DDP."""

    def loss(self, batch: Any) -> torch.Tensor:
        ids, targets = batch
        loss = F.cross_entropy(self(ids).flatten(0, 1), targets.flatten())
        self.loss_dtype = str(loss.dtype)
        return loss


class CastRawLoss(CastModel, RawLoss):
    pass


class LoraModel(L.LightningModule):
    """peft LoRA on a tiny HF Llama inside a LightningModule: only the adapters train."""

    def __init__(self) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=CONFIG.vocab_size, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            max_position_embeddings=CONFIG.block_size,
        )  # fmt: skip
        llama = LlamaForCausalLM(config)
        torch.manual_seed(1)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        self.model = get_peft_model(llama, lora)

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        ids, _ = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> Any:
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.0)


class TwoOptimizers(LanguageModel):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self) -> Any:
        params = list(self.parameters())
        return [torch.optim.SGD(params[:2], lr=0.1), torch.optim.SGD(params[2:], lr=0.1)]


class CountingStrategy(GroupShardStrategy):
    """Records the global step at each micro-batch run without gradient sync."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.unsynced_at: list[int] = []

    def block_backward_sync(self) -> Any:
        self.unsynced_at.append(self.lightning_module.trainer.global_step)
        return super().block_backward_sync()


def loader(shuffle: bool = False) -> DataLoader:
    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, CONFIG.vocab_size, (SAMPLES, CONFIG.block_size), generator=generator)
    data = TensorDataset(ids, torch.roll(ids, -1, dims=1))
    return DataLoader(data, batch_size=BATCH, shuffle=shuffle)


def trainer(folder: str, strategy: Any, **overrides: Any) -> L.Trainer:
    options = {
        "accelerator": "cpu",
        "devices": 2,
        "strategy": strategy,
        "max_epochs": 1,
        "accumulate_grad_batches": ACCUMULATION,
        "gradient_clip_val": CLIP,
        "gradient_clip_algorithm": "norm",
        "default_root_dir": folder,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
    }
    options.update(overrides)
    return L.Trainer(**options)




def fit_case(folder: str) -> dict[str, Any]:
    """accumulation 2 and clipping by norm equal strategy='ddp'; validate, test, predict."""
    reference = LanguageModel()
    trainer(folder, "ddp").fit(reference, loader(), loader())
    reference_validation = trainer(folder, "ddp").validate(reference, loader(), verbose=False)
    module = LanguageModel()
    strategy = CountingStrategy(unit=Block)
    sharded = trainer(folder, strategy)
    sharded.fit(module, loader(), loader())
    groups = [
        (len(group["params"]), group["weight_decay"], group["lr"])
        for group in sharded.optimizers[0].param_groups
    ]
    validation = sharded.validate(module, loader(), verbose=False)[0]["val_loss"]
    test = sharded.test(module, loader(), verbose=False)[0]["test_loss"]
    predictions = sharded.predict(module, loader())
    return {
        "sharded": isinstance(module, gs.ShardedModule),
        "never_ddp": sharded.strategy.model is module,
        "groups": groups,
        "difference": max_difference(weights(module), weights(reference)),
        "global_step": sharded.global_step,
        "validation": [validation, reference_validation[0]["val_loss"]],
        "test": test,
        "predictions": [len(predictions), list(predictions[0].shape)],
        "unsynced_at": strategy.unsynced_at,
        "keys_equal": list(module.state_dict()) == list(reference.state_dict()),
    }


def validate_first_case(folder: str) -> dict[str, Any]:
    """trainer.validate(module) before trainer.fit(module): validate shards with one group,
    fit then gives the shards configure_optimizers' groups; equal to the same under DDP."""
    reference = LanguageModel()
    ddp = trainer(folder, "ddp")
    ddp.validate(reference, loader(), verbose=False)
    ddp.fit(reference, loader())
    module = LanguageModel()
    sharded = trainer(folder, GroupShardStrategy(unit=Block))
    sharded.validate(module, loader(), verbose=False)
    groups_after_validate = len(module.groupshard.groups.groups)
    sharded.fit(module, loader())
    return {
        "groups": [groups_after_validate, len(module.groupshard.groups.groups)],
        "difference": max_difference(weights(module), weights(reference)),
    }


def clip_value_case(folder: str) -> dict[str, Any]:
    """gradient_clip_algorithm='value' (elementwise) equals strategy='ddp'."""
    options = {"gradient_clip_algorithm": "value", "gradient_clip_val": 0.002}
    reference = LanguageModel()
    trainer(folder, "ddp", **options).fit(reference, loader())
    module = LanguageModel()
    trainer(folder, GroupShardStrategy(unit=Block), **options).fit(module, loader())
    unclipped = LanguageModel()
    trainer(folder, "ddp", gradient_clip_val=None).fit(unclipped, loader())
    return {
        "difference": max_difference(weights(module), weights(reference)),
        "clipping_changed_it": max_difference(weights(reference), weights(unclipped)),
    }


def resume_case(folder: str) -> dict[str, Any]:
    """Two epochs in one run equal one epoch, save_checkpoint, and a fit resumed from it
    (shuffled data: the sampler's epoch; the step schedule; Lightning's loops); and a run
    under DDP resumed with GroupShardStrategy from DDP's .ckpt file."""
    whole = LanguageModel()
    trainer(folder, GroupShardStrategy(unit=Block), max_epochs=2).fit(whole, loader(True))
    first = trainer(folder, GroupShardStrategy(unit=Block), max_epochs=1)
    first.fit(LanguageModel(), loader(True))
    path = os.path.join(folder, "epoch-1")
    first.save_checkpoint(path)
    resumed = LanguageModel(seed=5)  # other weights: all it continues from is the checkpoint
    again = trainer(folder, GroupShardStrategy(unit=Block), max_epochs=2)
    again.fit(resumed, loader(True), ckpt_path=path)

    # the folder as one Lightning .ckpt: load_from_checkpoint, and DDP resumes from it
    converted = os.path.join(folder, "converted.ckpt")
    if dist.get_rank() == 0:
        to_lightning_checkpoint(path, converted)
    dist.barrier()
    loaded = LanguageModel.load_from_checkpoint(converted, seed=5)
    from_converted = LanguageModel(seed=5)
    trainer(folder, "ddp", max_epochs=2).fit(from_converted, loader(True), ckpt_path=converted)

    ddp_whole = LanguageModel()
    trainer(folder, "ddp", max_epochs=2).fit(ddp_whole, loader(True))
    ddp_first = trainer(folder, "ddp", max_epochs=1)
    ddp_first.fit(LanguageModel(), loader(True))
    ddp_file = os.path.join(folder, "ddp.ckpt")
    ddp_first.save_checkpoint(ddp_file)
    from_ddp = LanguageModel(seed=5)
    trainer(folder, GroupShardStrategy(unit=Block), max_epochs=2).fit(
        from_ddp, loader(True), ckpt_path=ddp_file
    )
    return {
        "difference": max_difference(weights(resumed), weights(whole)),
        "steps": [again.global_step, again.lr_scheduler_configs[0].scheduler.last_epoch],
        "files": sorted(os.listdir(path)),
        "from_ddp_difference": max_difference(weights(from_ddp), weights(ddp_whole)),
        "load_from_checkpoint": max_difference(weights(loaded), weights(first.lightning_module)),
        "ddp_from_converted": max_difference(weights(from_converted), weights(whole)),
        "sharded_vs_ddp": max_difference(weights(whole), weights(ddp_whole)),
    }


def bf16_case(folder: str) -> dict[str, Any]:
    """precision='bf16-mixed' shards with gs.MixedPrecision under Lightning's autocast and
    equals DDP (autocast too) computing with the same bf16 casts; the loss is fp32 in both."""
    reference = CastRawLoss()
    trainer(folder, "ddp", precision="bf16-mixed").fit(reference, loader())
    module = RawLoss()
    sharded = trainer(folder, GroupShardStrategy(unit=Block), precision="bf16-mixed")
    sharded.fit(module, loader())
    fp32 = LanguageModel()
    trainer(folder, "ddp").fit(fp32, loader())
    policies = {
        (str(unit.policy.param_dtype), str(unit.policy.reduce_dtype))
        for unit in module.groupshard.runtime.units
        if unit.policy is not None
    }
    return {
        "plugin": type(sharded.strategy.precision_plugin).__name__,
        "policies": sorted(policies),
        "shard_dtypes": sorted({str(p.dtype) for p in module.parameters()}),
        "difference": max_difference(weights(module), weights(reference)),
        "difference_to_fp32": max_difference(weights(module), weights(fp32)),
        "loss_dtypes": [module.loss_dtype, reference.loss_dtype],
    }


def fp16_case(folder: str) -> dict[str, Any]:
    """GroupShardPrecision('16-mixed') (what precision='16-mixed' becomes on GPUs): fp16
    compute, a gs.GradScaler whose state Lightning's checkpoint keeps."""
    from groupshard.integrations.lightning import GroupShardPrecision

    module = LanguageModel()
    sharded = trainer(
        folder, GroupShardStrategy(unit=Block), plugins=[GroupShardPrecision("16-mixed")]
    )
    sharded.fit(module, loader())
    fp32 = LanguageModel()
    trainer(folder, "ddp").fit(fp32, loader())
    scaler = sharded.strategy.precision_plugin.scaler
    scaler.update(new_scale=1024.0)  # not the initial scale: the checkpoint must keep it
    path = os.path.join(folder, "fp16")
    sharded.save_checkpoint(path)
    restored = trainer(
        folder,
        GroupShardStrategy(unit=Block),
        plugins=[GroupShardPrecision("16-mixed")],
        max_epochs=1,
    )
    restored.fit(LanguageModel(seed=5), loader(), ckpt_path=path)  # already at max_epochs
    return {
        "scaler": type(scaler).__name__,
        "scale": scaler.get_scale(),
        "restored_scale": restored.strategy.precision_plugin.scaler.get_scale(),
        "difference_to_fp32": max_difference(weights(module), weights(fp32)),
    }


def lora_case(folder: str) -> dict[str, Any]:
    """peft LoRA inside a LightningModule: equal to DDP, no gradient or state for frozen
    weights."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    reference = LoraModel()
    trainer(folder, "ddp").fit(reference, loader())
    module = LoraModel()
    sharded = trainer(folder, GroupShardStrategy(unit=LlamaDecoderLayer))
    sharded.fit(module, loader())
    optimizer = sharded.optimizers[0]
    frozen = [p for p in module.parameters() if not p.requires_grad]
    trained = [p for p in module.parameters() if p.requires_grad]
    return {
        "difference": max_difference(weights(module), weights(reference)),
        "frozen_with_grad": sum(p.grad is not None for p in frozen),
        "frozen_in_optimizer": sum(
            any(p is q for group in optimizer.param_groups for q in group["params"]) for p in frozen
        ),
        "state_elements": sum(
            v.numel() for s in optimizer.state.values() for v in s.values() if v.dim() > 0
        ),
        "trained_elements": sum(p.numel() for p in trained),
        "adapter_elements": sum(p.numel() for p in reference.parameters() if p.requires_grad),
    }


def refusals_case(folder: str) -> dict[str, Any]:
    """What cannot apply raises with a message (on every rank)."""
    messages = {}
    try:
        two = trainer(
            folder,
            GroupShardStrategy(unit=Block),
            gradient_clip_val=None,
            accumulate_grad_batches=1,
        )
        two.fit(TwoOptimizers(), loader())
    except ValueError as error:
        messages["two_optimizers"] = str(error)
    # a weight read under `if trainer.is_global_zero:` after fit: its shape is the whole
    # weight's, and a computation on this rank's piece of it raises, naming it
    module = LanguageModel()
    fitted = trainer(folder, GroupShardStrategy(unit=Block))
    fitted.fit(module, loader())
    if fitted.is_global_zero:
        weight = module.model.blocks[0].fc.weight
        messages["weight_shape"] = list(weight.shape)
        try:
            messages["weight_norm"] = weight.norm().item()
        except ValueError as error:
            messages["weight_norm"] = str(error)
    return messages


def async_checkpoint_case(folder: str) -> dict[str, Any]:
    """Lightning's AsyncCheckpointIO plugin: ModelCheckpoint's folders are written in the
    background (gs.checkpoint.async_save, training going on), the run is the whole run, and
    a fit resumed from the first epoch's folder ends as it, bit for bit. Another
    CheckpointIO is refused (the strategy writes gs.checkpoint folders itself)."""
    from unittest import mock

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    whole = LanguageModel()
    trainer(folder, GroupShardStrategy(unit=Block), max_epochs=2).fit(whole, loader(True))
    folders = os.path.join(folder, "checkpoints")
    saving = trainer(
        folder, GroupShardStrategy(unit=Block), max_epochs=2, plugins=[AsyncCheckpointIO()],
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=folders, filename="{epoch}", save_top_k=-1)],
    )  # fmt: skip
    checkpointed = LanguageModel()
    with mock.patch.object(gs.checkpoint, "async_save", wraps=gs.checkpoint.async_save) as spy:
        saving.fit(checkpointed, loader(True))
    resumed = LanguageModel(seed=5)
    again = trainer(folder, GroupShardStrategy(unit=Block), max_epochs=2)
    again.fit(resumed, loader(True), ckpt_path=os.path.join(folders, "epoch=0.ckpt"))

    class OwnIO(TorchCheckpointIO):
        pass

    refused = trainer(folder, GroupShardStrategy(unit=Block), plugins=[OwnIO()])
    refused.fit(LanguageModel(), loader())
    try:
        refused.save_checkpoint(os.path.join(folder, "own"))
        message = "no error"
    except TypeError as error:
        message = str(error)
    return {
        "background_saves": spy.call_count,
        "folders": sorted(os.listdir(folders)),
        "checkpointed": max_difference(weights(checkpointed), weights(whole)),
        "resumed": max_difference(weights(resumed), weights(whole)),
        "refused": message,
    }


CASES = {
    "fit": fit_case,
    "clip_value": clip_value_case,
    "validate_first": validate_first_case,
    "resume": resume_case,
    "bf16": bf16_case,
    "fp16": fp16_case,
    "lora": lora_case,
    "refusals": refusals_case,
    "async_checkpoint": async_checkpoint_case,
}


if __name__ == "__main__":
    run_cases(CASES)
