"""A small GPT-style language model: the command line's model and the tests' workhorse.

Tied input/output embedding, LayerNorm, biases: the parameters that make
per-group hyperparameters matter. The attention projection has no bias, because a
key bias gets no gradient (softmax ignores it) and would train on rounding noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    # the fused projection's output rows head by head ([q, k, v] of head 0, then of head 1, ...,
    # as Megatron-LM orders them), so that a split by rows gives each tp rank whole heads;
    # False: all queries, then all keys, then all values (checkpoints that do not record it)
    qkv_by_head: bool = False


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        self.by_head = config.qkv_by_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        qkv = self.qkv(x)  # under tensor parallelism: this rank's heads only (qkv_by_head)
        if self.by_head:
            q, k, v = qkv.view(batch, time, -1, 3, self.head_dim).unbind(3)
        else:
            q, k, v = qkv.view(batch, time, 3, -1, self.head_dim).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, -1))


class Block(nn.Module):
    """One transformer block: the natural sharding unit."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.out = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.normal_(module.bias, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or the mean cross-entropy (float32) when ``targets`` is given."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        # in float32 whatever the model computes in (bf16 logits would round the loss)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    @torch.no_grad()
    def generate(
        self,
        prompt: torch.Tensor,
        new_tokens: int,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """``prompt`` (token ids, ``(batch, time)``) followed by ``new_tokens`` sampled ones.

        Runs exactly ``new_tokens`` forwards, whatever is sampled, so that the ranks of a
        sharded model stay in step; the context is the last ``block_size`` tokens.
        """
        if temperature <= 0:
            raise ValueError(f"Expects temperature > 0 but got {temperature}")
        tokens = prompt
        for _ in range(new_tokens):
            logits = self(tokens[:, -self.config.block_size :])[:, -1, :]
            probs = F.softmax(logits.float() / temperature, dim=-1)
            following = torch.multinomial(probs, 1, generator=generator)
            tokens = torch.cat([tokens, following], dim=1)
        return tokens


def parallelize_gpt(model: GPT, tp_mesh: Any) -> GPT:
    """torchtitan's tensor-parallel plan on the 1-D mesh ``tp_mesh``: attention by heads (the
    fused projection column-wise, its output projection row-wise) and the MLP column-wise
    then row-wise; the tied embedding and output layer by vocabulary rows (row-wise
    embedding, column-wise output gathered to whole logits). Norms and the position
    embedding are replicated. Every tp rank must see the same tokens.

    A model with the earlier layout (``qkv_by_head=False``: all queries, then all keys, then
    all values) keeps its attention replicated on the tp ranks, as no split by rows gives a
    rank whole heads of it."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {"fc": ColwiseParallel(), "out": RowwiseParallel()}
    if model.config.qkv_by_head:
        if model.config.n_head % tp_mesh.size():
            raise ValueError(
                f"a tensor-parallel degree of {tp_mesh.size()} must divide the model's "
                f"{model.config.n_head} heads"
            )
        plan |= {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)
    parallelize_module(model, tp_mesh, {
        "wte": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    })  # fmt: skip
    model.lm_head.weight = model.wte.weight  # tied again: both are split by vocabulary rows
    return model
