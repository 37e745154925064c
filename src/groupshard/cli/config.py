"""What a ``groupshard train`` run is: its configuration, the model presets and where its
checkpoint goes. Light: the launcher imports this, not the training loop (``train``, which
imports torch's checkpoint and DTensor modules), so that its workers start sooner.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from groupshard.cli.model import GPTConfig

PRESETS = {  # the layout new runs use; a resumed one keeps its checkpoint's (TrainConfig)
    "tiny": GPTConfig(256, block_size=64, n_layer=2, n_head=4, n_embd=64, qkv_by_head=True),
    "small": GPTConfig(256, block_size=128, n_layer=4, n_head=4, n_embd=128, qkv_by_head=True),
    "medium": GPTConfig(256, block_size=256, n_layer=6, n_head=8, n_embd=256, qkv_by_head=True),
}
CHECKPOINT = "checkpoint"
ZERO_CHECKPOINT = "zero.pt"  # inside CHECKPOINT: the --zero run's plain torch.save file
# identity keys that older checkpoints lack, with the value every run then had
IDENTITY_BEFORE_RECORDED = {
    "precision": "fp32", "grad_accum": 1, "freeze_embeddings_until": 0, "qkv_by_head": False,
}  # fmt: skip


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run depends on; saved with its checkpoints."""

    data: str | None
    model: str
    steps: int
    batch_size: int
    lr: float
    weight_decay: float
    strategy: str
    optimizer: str
    zero: bool
    seed: int
    out: str
    resume: bool
    ckpt_every: int
    eval_every: int
    clip: float
    timeout: float  # seconds a collective may wait for the other ranks
    precision: str = "fp32"  # "fp32", "bf16" or "fp16" (units compute in it, fp32 masters)
    grad_accum: int = 1  # micro-batches per rank and optimizer step
    init: str = "meta"  # "meta": built on the meta device, initialized by gs.shard; "full"
    loss_scale: float = 2.0**16  # fp16: the scaler's initial scale (a checkpoint's on resume)
    replicate: int = 1  # > 1: hybrid sharding, this many replicas of world / replicate shards
    tp: int = 1  # > 1: tensor parallelism over this many ranks, sharded over world / tp
    async_checkpoint: bool = False  # --ckpt-every's checkpoints written while training goes on
    freeze_embeddings_until: int = 0  # embeddings frozen before this step, then a group (0: off)
    start_from: str | None = None  # --from: a checkpoint folder (any writer) to start from
    qkv_by_head: bool = True  # the attention's layout (GPTConfig); a resumed run keeps its own

    def model_config(self) -> GPTConfig:
        """The model this run trains: its preset, in the attention layout of the run."""
        return dataclasses.replace(PRESETS[self.model], qkv_by_head=self.qkv_by_head)

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must share with the run that resumes it."""
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "zero": self.zero,
            "precision": self.precision,
            "grad_accum": self.grad_accum,
            "freeze_embeddings_until": self.freeze_embeddings_until,
            "qkv_by_head": self.qkv_by_head,
        }
