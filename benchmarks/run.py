"""The project benchmark: the same training step, every system, interleaved in one run.

    python benchmarks/run.py [--model 4m|small-params|30m|tiny] [--world-size 2] [--rounds 10]
                             [--device cpu|cuda] [--rss] [--rows REGEX|muon-only] [--muon]

Systems: DDP, torch ZeroRedundancyOptimizer + DDP, FSDP2 (``fully_shard`` per block
and root), FSDP1 (``use_orig_params``, per block), DeepSpeed ZeRO 1/2/3 (when
installed: ``pip install -e ".[bench]"``), groupshard full / grad_op / no_shard /
ZeRO + DDP / full with 8 groups, and LAMB: groupshard vs FSDP2 + per-parameter
LAMB. All get the same two groups (decay / no decay), AdamW unless named.

Muon (``--muon``; off by default, Newton-Schulz on every rank is slow on CPU): the hidden
matrices (``gs.muon_groups``: the blocks' 2-D weights) in Muon (lr 0.02, weight decay 0.1,
torch.optim.Muon's defaults otherwise), the rest in AdamW in the two groups above (lr 1e-3;
embeddings weight decay 0.1, vectors 0.0); each row is compared with one process doing
torch.optim.Muon + torch.optim.AdamW, its step time with "FSDP2 + torch Muon":
"DDP + torch Muon" (every rank orthogonalizes every matrix: the replicated baseline),
"torch ZeRO + DDP + Muon" (torch's ZeroRedundancyOptimizer with torch.optim.Muon, whole
matrices per rank by its greedy partition, and a second one with AdamW for the rest: both
ZeRO-sharded), "FSDP2 + torch Muon" (torch.optim.Muon straight on FSDP2's DTensors: it
accepts them, and DTensor dispatch redistributes inside Newton-Schulz: per matrix and step
6 all-reduces and 7-8 all-gathers at world size 2 and 4), "FSDP2 + Muon, full_tensor per
matrix" (torch.optim.Muon's math with one ``full_tensor()`` all-gather of each momentum-
updated matrix, orthogonalized on every rank, each keeping its own shard),
"groupshard full + Muon" (``gs.shard`` + ``gs.optim.Muon``) and "groupshard ZeRO + DDP +
Muon" (``gs.ZeroRedundancyOptimizer(groups, gs.optim.Muon)`` + DDP). Where DeepSpeed is
installed, "DeepSpeed ZeRO-2 + Muon": DeepSpeed 0.19.8's own Muon (``"type": "Muon"``, run
inside its ZeRO-2 partitioning, its inline AdamW for the rest) with the ``"standard"``
Newton-Schulz and torch's AdamW betas and eps; its result is not torch.optim.Muon's (on the
tiny model it ends about as far from the torch reference as training moved it), so the row
is compared for speed, its difference reported but not bounded. The Muon table
adds each row's optimizer step over "DDP + torch Muon"'s, and each system's step time
with Muon over its AdamW row's (``--rows muon-only``: the Muon rows and those AdamW rows
alone).

Mixed precision and gradient accumulation: groupshard full, FSDP2 and DeepSpeed ZeRO-3 in
bf16 (gathered and computing in bf16, gradients reduced in fp32 into fp32 masters:
``gs.MixedPrecision`` / ``MixedPrecisionPolicy``; DeepSpeed's ``"bf16"`` with its own
defaults), and each of them (fp32 and bf16) with ``--micro-batches`` (4) micro-batches per
optimizer step, each as large as a normal step's batch: groupshard under ``no_sync()``
for all but the last, FSDP2 with ``set_requires_gradient_sync(False)`` for all but the
last, DeepSpeed with ``gradient_accumulation_steps``; "kept gathered" rows also keep units
gathered after all but the last backward (``set_reshard_after_backward(False)``). Their
ratio is to the FSDP2 row run the same way; step time is per optimizer step.

Per system: median step time after warm-up and its ratio to FSDP2, tokens/s, the
optimizer step alone, bytes of parameters + gradients + optimizer state held per
rank against the ideal (total / N) and the most unsharded parameter bytes held at
once (groupshard and FSDP2), collectives and bytes per step (the ``c10d::`` ops
torch.profiler records on a warm step), with ``--rss`` the peak RSS per rank (the
peak GPU memory on cuda; each system again in fresh processes, so peaks are its
own), and the largest parameter difference from single-process training after the
run: on the global batch (every rank's micro-batches) in fp32, and for fp32 accumulation
rows also from one process summing the micro-batches in the ranks' order; for bf16 rows
from one process doing the same casts (a bf16 copy computes each rank's micro-batches,
gradients summed and averaged in fp32, fp32 masters step) and, for scale, from the fp32
run. The bf16 and accumulation rows add gathered and reduced bytes apart, reduce-scatters per
optimizer step and the unsharded gradient bytes held while accumulating (after the
next-to-last micro-batch's backward). Before the ranks start, one process times the
model's forward + backward and its matmuls in fp32 and bf16 (one thread, as each rank):
is bf16 faster here? Output: tables and a JSON file.

On CPU the ranks talk over gloo with one thread each; with ``--device cuda`` (the
default where there are 2 or more GPUs) each rank takes one GPU and NCCL. gloo
carries out a reduce-scatter as a full all-reduce, so on CPU every sharded system
pays more for gradients than it would over NCCL.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import platform
import re
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import groupshard as gs
from groupshard.cli.model import GPT, Block, GPTConfig

MODELS = {
    "4m": (GPTConfig(vocab_size=4096, block_size=128, n_layer=4, n_head=8, n_embd=256), 8),
    "small-params": (GPTConfig(vocab_size=256, block_size=64, n_layer=16, n_head=4, n_embd=64), 8),
    "30m": (GPTConfig(vocab_size=8192, block_size=256, n_layer=8, n_head=8, n_embd=512), 4),
    "tiny": (GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32), 2),
}
LR = 1e-3
MUON_LR, MUON_WEIGHT_DECAY = 0.02, 0.1
"""The Muon group's hyperparameters in the Muon rows (weight decay: torch.optim.Muon's default)."""
MUON_PARTNERS = {
    "DDP + torch Muon": "DDP",
    "torch ZeRO + DDP + Muon": "torch ZeRO + DDP",
    "FSDP2 + torch Muon": "FSDP2",
    "FSDP2 + Muon, full_tensor per matrix": "FSDP2",
    "groupshard full + Muon": "groupshard full",
    "groupshard ZeRO + DDP + Muon": "groupshard ZeRO + DDP",
    "DeepSpeed ZeRO-2 + Muon": "DeepSpeed ZeRO-2",
}
"""Each Muon row and the AdamW row of the same system (DeepSpeed's where it is installed)."""
MUON_ROWS = "|".join(
    f"^{re.escape(name)}$" for name in (*MUON_PARTNERS, *dict.fromkeys(MUON_PARTNERS.values()))
)
"""``--rows`` for the Muon rows and their AdamW rows only."""
MICRO_BATCHES = 4
"""Micro-batches per optimizer step in the accumulation rows (``--micro-batches``)."""


class PerParameterLAMB(torch.optim.Optimizer):
    """A straightforward LAMB, one tensor at a time; on DTensors each norm is a collective."""

    def __init__(self, params: Any, lr: float = LR, eps: float = 1e-6, weight_decay: float = 0.01):
        super().__init__(
            params, dict(lr=lr, betas=(0.9, 0.999), eps=eps, weight_decay=weight_decay)
        )

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat = state["exp_avg"] / (1 - beta1 ** state["step"])
                v_hat = state["exp_avg_sq"] / (1 - beta2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = p.norm(), update.norm()
                if hasattr(w_norm, "full_tensor"):
                    w_norm, u_norm = w_norm.full_tensor(), u_norm.full_tensor()
                trust = (w_norm / u_norm).item() if w_norm > 0 and u_norm > 0 else 1.0
                p.add_(update, alpha=-group["lr"] * trust)


# --- the systems --------------------------------------------------------------------


def _adamw(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=LR)


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    return gs.decay_groups(model, 0.1)


def _eight_groups(model: nn.Module) -> list[dict[str, Any]]:
    order = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    return [
        {**group, "params": [p for p in group["params"]]}
        for group in gs.groups_by(
            model,
            lambda name, p: (p.ndim >= 2, order[name] % 4),
            {(d, k): {"weight_decay": 0.1 if d else 0.0} for d in (True, False) for k in range(4)},
        )
    ]


def _muon_groups(model: nn.Module) -> list[dict[str, Any]]:
    """The hidden matrices in Muon, the rest in AdamW in the AdamW rows' two groups (2-D
    embeddings with weight decay, vectors without)."""
    muon, rest = gs.muon_groups(model)
    no_decay = {id(p) for p in _groups(model)[1]["params"]}
    adamw = {"use_muon": False, "lr": LR}
    return [
        {**muon, "lr": MUON_LR, "weight_decay": MUON_WEIGHT_DECAY},
        {**adamw, "params": [p for p in rest["params"] if id(p) not in no_decay],
         "weight_decay": 0.1},
        {**adamw, "params": [p for p in rest["params"] if id(p) in no_decay],
         "weight_decay": 0.0},
    ]  # fmt: skip


class _Optimizers:
    """Several torch optimizers stepped as one (torch's Muon takes matrices only)."""

    def __init__(self, *optimizers: Any) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict[Any, Any]:  # the local optimizers' (inside torch's ZeRO)
        return {k: v for o in self.optimizers for k, v in getattr(o, "optim", o).state.items()}

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def _plain(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "use_muon"}


def _torch_muon(groups: list[dict[str, Any]], muon_class: Any = None) -> _Optimizers:
    """torch.optim.Muon (or ``muon_class``) for the Muon group, AdamW for the rest."""
    muon, *rest = groups
    muon_class = muon_class or torch.optim.Muon
    return _Optimizers(muon_class([_plain(muon)]), torch.optim.AdamW(list(map(_plain, rest))))


class FullTensorMuon(torch.optim.Optimizer):
    """torch.optim.Muon's math on FSDP2's DTensors, one matrix at a time: the momentum
    update on the local shard, one ``full_tensor()`` all-gather of the updated matrix,
    Newton-Schulz on every rank, and each rank keeps the rows of its own shard."""

    def __init__(self, params: Any, lr: float = MUON_LR, weight_decay: float = MUON_WEIGHT_DECAY):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=0.95))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        from torch.distributed.tensor import distribute_tensor
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

        from groupshard.optim.muon import NS_COEFFICIENTS, NS_EPS, NS_STEPS

        for group in self.param_groups:
            momentum = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buffer = state["momentum_buffer"]
                buffer.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buffer, momentum).full_tensor()  # nesterov
                update = _zeropower_via_newtonschulz(update, NS_COEFFICIENTS, NS_STEPS, NS_EPS)
                local = distribute_tensor(
                    update, p.device_mesh, p.placements, src_data_rank=None
                )  # this rank's rows, no communication
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(local, alpha=-_adjust_lr(group["lr"], None, p.shape))


def ddp(base: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = copy.deepcopy(base)
    return DDP(model), _adamw(_groups(model))


def torch_zero(base: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = copy.deepcopy(base)
    decay, no_decay = _groups(model)
    optimizer = ZeroRedundancyOptimizer(
        decay["params"], torch.optim.AdamW, lr=LR, weight_decay=0.1, parameters_as_bucket_view=True
    )
    optimizer.add_param_group(no_decay)  # its constructor takes one group
    return DDP(model), optimizer


def ddp_muon(base: nn.Module) -> tuple[nn.Module, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = copy.deepcopy(base)
    return DDP(model), _torch_muon(_muon_groups(model))


def torch_zero_muon(base: nn.Module) -> tuple[nn.Module, Any]:
    """torch's ZeroRedundancyOptimizer with torch.optim.Muon (whole matrices per rank, by
    its greedy partition), and another with AdamW for the rest (also ZeRO-sharded)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = copy.deepcopy(base)
    muon, decay, no_decay = map(_plain, _muon_groups(model))
    muon_optimizer = ZeroRedundancyOptimizer(
        muon["params"], torch.optim.Muon, lr=MUON_LR, weight_decay=MUON_WEIGHT_DECAY,
        parameters_as_bucket_view=True,
    )  # fmt: skip
    adamw = ZeroRedundancyOptimizer(
        decay["params"], torch.optim.AdamW, lr=LR, weight_decay=0.1,
        parameters_as_bucket_view=True,
    )  # fmt: skip
    adamw.add_param_group(no_decay)  # its constructor takes one group
    return DDP(model), _Optimizers(muon_optimizer, adamw)


def fsdp2(
    base: nn.Module, lamb: bool = False, bf16: bool = False, muon: str | None = None
) -> tuple[nn.Module, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()  # FSDP2's default: no casts
    if bf16:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = copy.deepcopy(base)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if muon == "torch":  # torch.optim.Muon on the DTensors as they are
        return model, _torch_muon(_muon_groups(model))
    if muon == "full_tensor":
        return model, _torch_muon(_muon_groups(model), FullTensorMuon)
    groups = _groups(model)
    return model, PerParameterLAMB(groups) if lamb else _adamw(groups)


def fsdp1(base: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = FSDP(
        copy.deepcopy(base), auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=True, device_id=_device(),
    )  # fmt: skip
    return model, _adamw(_groups(model))


def groupshard(
    strategy: str,
    lamb: bool = False,
    groups: Callable[[nn.Module], Any] = _groups,
    prefetch_bytes: int = 25 * 2**20,
    bf16: bool = False,
    muon: bool = False,
) -> Callable[[nn.Module], tuple[nn.Module, torch.optim.Optimizer]]:
    policy = gs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def build(base: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = copy.deepcopy(base)
        model = gs.shard(
            model, (_muon_groups if muon else groups)(model), unit=Block, strategy=strategy,
            prefetch_bytes=prefetch_bytes, mixed_precision=policy if bf16 else None,
        )  # fmt: skip
        if lamb:
            return model, gs.optim.LAMB(model.optimizer_groups(), lr=LR)
        if muon:
            return model, gs.optim.Muon(
                model.optimizer_groups(), lr=MUON_LR, weight_decay=MUON_WEIGHT_DECAY
            )
        return model, _adamw(model.optimizer_groups())

    return build


def groupshard_zero(base: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = copy.deepcopy(base)
    optimizer = gs.ZeroRedundancyOptimizer(
        _groups(model), torch.optim.AdamW, lr=LR, parameters_as_bucket_view=True
    )
    return DDP(model), optimizer


def groupshard_zero_muon(base: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = copy.deepcopy(base)
    optimizer = gs.ZeroRedundancyOptimizer(
        _muon_groups(model), gs.optim.Muon, lr=MUON_LR, weight_decay=MUON_WEIGHT_DECAY,
        parameters_as_bucket_view=True,
    )  # fmt: skip
    return DDP(model), optimizer


def deepspeed_stage(
    stage: int, bf16: bool = False, micro_batches: int = 1, muon: bool = False
) -> Callable[[nn.Module], tuple[nn.Module, Any]]:
    """DeepSpeed ZeRO-``stage``; with ``muon``, DeepSpeed's own Muon (``"type": "Muon"``,
    its inline AdamW for the rest) on the Muon rows' groups, with its ``"standard"``
    Newton-Schulz (torch.optim.Muon's bf16 quintic iteration; its default, ``"gram"``,
    is another algorithm)."""

    def build(base: nn.Module) -> tuple[nn.Module, Any]:
        import deepspeed

        model = copy.deepcopy(base)
        optimizer: dict[str, Any] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}}
        groups = _groups(model)
        if muon:
            groups = _muon_groups(model)
            for group in groups:
                for param in group["params"]:
                    param.use_muon = group["use_muon"]
            groups = [{k: v for k, v in g.items() if k != "use_muon"} for g in groups]
            optimizer = {"type": "Muon", "params": {
                "lr": LR, "momentum": 0.95, "ns_method": "standard",
                "betas": [0.9, 0.999], "eps": 1e-8,  # torch.optim.AdamW's (not Muon's own)
            }}  # fmt: skip
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": micro_batches,
            "zero_optimization": {"stage": stage},
            "optimizer": optimizer,
        }
        if bf16:
            config["bf16"] = {"enabled": True}
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, config=config, model_parameters=groups, dist_init_required=False
        )
        return engine, optimizer

    return build


def _deepspeed_available() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:
        return False
    return True


Builder = Callable[[nn.Module], tuple[nn.Module, Any]]


@dataclass(frozen=True)
class System:
    """One row: how to build the system, and how it trains one optimizer step."""

    build: Builder
    micro_batches: int = 1  # micro-batches per optimizer step, each a normal step's batch
    bf16: bool = False  # computes in bf16 (fp32 masters): compared with a bf16 reference
    keep_gathered: bool = False  # units stay gathered after the accumulating backwards
    lamb: bool = False  # compared with a LAMB reference
    muon: bool = False  # compared with a torch.optim.Muon + AdamW reference
    baseline: str = "FSDP2"  # the row its step time is compared with

    def __call__(self, base: nn.Module) -> tuple[nn.Module, Any]:
        return self.build(base)


def _precision_rows(deepspeed: bool, micro_batches: int) -> dict[str, System]:
    """bf16 rows, then fp32 and bf16 rows with gradient accumulation; each is compared
    with the FSDP2 row run the same way."""
    rows: dict[str, System] = {}

    def fsdp2_bf16(bf16: bool) -> Builder:
        return lambda base: fsdp2(base, bf16=bf16)

    rows["FSDP2 bf16"] = System(fsdp2_bf16(True), bf16=True, baseline="FSDP2 bf16")
    rows["groupshard full bf16"] = System(
        groupshard("full", bf16=True), bf16=True, baseline="FSDP2 bf16"
    )
    if deepspeed:
        rows["DeepSpeed ZeRO-3 bf16"] = System(
            deepspeed_stage(3, bf16=True), bf16=True, baseline="FSDP2 bf16"
        )
    for bf16 in (False, True):
        suffix = f"{' bf16' if bf16 else ''}, {micro_batches} micro-batches"
        for kept in ("", ", kept gathered"):
            baseline = f"FSDP2{suffix}{kept}"
            options = dict(micro_batches=micro_batches, bf16=bf16, keep_gathered=bool(kept),
                           baseline=baseline)  # fmt: skip
            rows[baseline] = System(fsdp2_bf16(bf16), **options)
            rows[f"groupshard full{suffix}{kept}"] = System(
                groupshard("full", bf16=bf16), **options
            )
        if deepspeed:
            rows[f"DeepSpeed ZeRO-3{suffix}"] = System(
                deepspeed_stage(3, bf16=bf16, micro_batches=micro_batches),
                micro_batches=micro_batches, bf16=bf16, baseline=f"FSDP2{suffix}",
            )  # fmt: skip
    return rows


def _muon_rows() -> dict[str, System]:
    """Muon for the hidden matrices, AdamW for the rest; step time compared with FSDP2's."""
    options = dict(muon=True, baseline="FSDP2 + torch Muon")
    rows = {
        "DDP + torch Muon": System(ddp_muon, **options),
        "torch ZeRO + DDP + Muon": System(torch_zero_muon, **options),
        "FSDP2 + torch Muon": System(lambda base: fsdp2(base, muon="torch"), **options),
        "FSDP2 + Muon, full_tensor per matrix": System(
            lambda base: fsdp2(base, muon="full_tensor"), **options
        ),
        "groupshard full + Muon": System(groupshard("full", muon=True), **options),
        "groupshard ZeRO + DDP + Muon": System(groupshard_zero_muon, **options),
    }
    if _deepspeed_available():
        rows["DeepSpeed ZeRO-2 + Muon"] = System(deepspeed_stage(2, muon=True), **options)
    return rows


def systems(
    lamb: bool = True, micro_batches: int = MICRO_BATCHES, muon: bool = False
) -> dict[str, System]:
    deepspeed = _deepspeed_available()
    table: dict[str, System] = {
        "DDP": System(ddp),
        "torch ZeRO + DDP": System(torch_zero),
        "FSDP2": System(fsdp2),
        "FSDP1": System(fsdp1),
    }
    if deepspeed:
        for stage in (1, 2, 3):
            table[f"DeepSpeed ZeRO-{stage}"] = System(deepspeed_stage(stage))
    table.update({
        "groupshard full": System(groupshard("full")),
        "groupshard grad_op": System(groupshard("grad_op")),
        "groupshard no_shard": System(groupshard("no_shard")),
        "groupshard ZeRO + DDP": System(groupshard_zero),
        "groupshard full, 8 groups": System(groupshard("full", groups=_eight_groups)),
        "groupshard full, prefetch 0": System(groupshard("full", prefetch_bytes=0)),
    })  # fmt: skip
    if lamb:
        table["groupshard full + LAMB"] = System(groupshard("full", lamb=True), lamb=True)
        table["FSDP2 + per-parameter LAMB"] = System(lambda base: fsdp2(base, lamb=True), lamb=True)
    table.update(_precision_rows(deepspeed, micro_batches))
    if muon:
        table.update(_muon_rows())
    return table


# --- measuring ---------------------------------------------------------------------------


def _batches(config: GPTConfig, batch: int, world_size: int, count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    shape = (batch * world_size, config.block_size + 1)
    return [torch.randint(0, config.vocab_size, shape, generator=generator) for _ in range(count)]


def _device() -> torch.device:
    """Where this rank computes: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _now() -> float:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def _is_deepspeed(model: Any) -> bool:
    return hasattr(model, "zero_optimization_stage")


def _backward(model: Any, loss: torch.Tensor) -> None:
    """The backward pass (a DeepSpeed engine runs its own, into its own gradient buffers)."""
    if _is_deepspeed(model):
        model.backward(loss)
    else:
        loss.backward()


def _optimizer_step(model: Any, optimizer: Any) -> None:
    if _is_deepspeed(model):
        model.step()
    else:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _micro_batch(system: System, model: Any, last: bool) -> Iterator[None]:
    """One micro-batch's forward and backward: gradients synced on the last one only
    (groupshard: ``no_sync``; FSDP2: ``set_requires_gradient_sync``; DeepSpeed counts
    micro-batches itself). Kept gathered: units stay gathered after the other backwards."""
    if system.micro_batches == 1 or _is_deepspeed(model):
        yield
        return
    if system.keep_gathered:
        model.set_reshard_after_backward(last)
    if hasattr(model, "groupshard"):
        with contextlib.nullcontext() if last else model.no_sync():
            yield
        return
    model.set_requires_gradient_sync(last)  # FSDP2
    yield


def _step(
    system: System,
    model: Any,
    optimizer: Any,
    micro_batches: list[torch.Tensor],
    after_backward: Callable[[int], None] | None = None,
) -> tuple[float, float]:
    """One optimizer step over ``micro_batches`` (the loss of each divided by their number,
    so that the step sees the mean gradient); returns (total seconds, optimizer seconds).
    ``after_backward(i)`` runs after micro-batch ``i``'s backward."""
    started = _now()
    count = len(micro_batches)
    for index, tokens in enumerate(micro_batches):
        last = index == count - 1
        with _micro_batch(system, model, last):
            loss = model(tokens[:, :-1], tokens[:, 1:])
            if count > 1 and not _is_deepspeed(model):  # DeepSpeed divides by itself
                loss = loss / count
            _backward(model, loss)
        if after_backward is not None:
            after_backward(index)
        if not last and _is_deepspeed(model):
            model.step()  # DeepSpeed wants a step per micro-batch; it steps on the last
    optimizer_started = _now()
    _optimizer_step(model, optimizer)
    finished = _now()
    return finished - started, finished - optimizer_started


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def _fsdp2_unsharded_bytes(model: nn.Module) -> int:
    """Bytes of unsharded parameters FSDP2 holds now (its freed buffers have empty storage)."""
    from torch.distributed.fsdp import FSDPModule

    held = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group is not None else ():
            held += sum(t.untyped_storage().nbytes() for t in fsdp_param.all_gather_outputs)
    return held


@contextlib.contextmanager
def _gathered_peak(model: Any) -> Iterator[Callable[[], int | None]]:
    """The most unsharded parameter bytes held at once while inside: groupshard's own
    count, FSDP2's sampled after each of its unshards (gathered memory only grows there);
    ``None`` for other systems."""
    runtime = model.groupshard.runtime if hasattr(model, "groupshard") else None
    if runtime is not None:
        runtime.peak_gathered_bytes = 0
        yield lambda: runtime.peak_gathered_bytes
        return
    if not hasattr(model, "_get_fsdp_state"):
        yield lambda: None
        return
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    peak = [0]
    original = FSDPParamGroup.wait_for_unshard

    def sampled(self: FSDPParamGroup) -> None:
        original(self)
        peak[0] = max(peak[0], _fsdp2_unsharded_bytes(model))

    with mock.patch.object(FSDPParamGroup, "wait_for_unshard", sampled):
        yield lambda: peak[0]


def _held_bytes(
    system: System, model: Any, optimizer: Any, micro_batches: list[torch.Tensor]
) -> dict[str, int | None]:
    """Bytes of parameters, gradients and optimizer state this rank holds at the end of the
    last backward, the most unsharded parameter bytes held at once during the step, and,
    with accumulation, the unsharded gradient bytes held after the next-to-last backward."""
    count = len(micro_batches)
    held: dict[str, int | None] = {"accumulated_grads": None}

    def measure(index: int) -> None:
        if count > 1 and index == count - 2:
            held["accumulated_grads"] = _accumulated_grad_bytes(model)
        if index == count - 1:
            held.update(_counted_bytes(model, optimizer))

    with _gathered_peak(model) as gathered_peak:
        _step(system, model, optimizer, micro_batches, measure)
        held["gathered_peak"] = gathered_peak()
    return held


def _accumulated_grad_bytes(model: Any) -> int | None:
    """Bytes of the unsharded gradients a rank holds between backwards without gradient
    sync: groupshard's local sums (``storage.accumulated_grad``); FSDP2's unsharded
    gradients (``unsharded_accumulated_grad`` when it accumulates in another dtype than
    it computes, else the unsharded parameters' ``.grad``); None for other systems."""
    if hasattr(model, "groupshard"):
        sums = [s.accumulated_grad for s in model.groupshard.storages]
        return _unique_bytes([g for g in sums if g is not None])
    if not hasattr(model, "_get_fsdp_state"):
        return None
    from torch.distributed.fsdp import FSDPModule

    grads = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group is not None else ():
            if fsdp_param.unsharded_accumulated_grad is not None:
                grads.append(fsdp_param.unsharded_accumulated_grad)
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None and unsharded.grad is not None:
                grads.append(unsharded.grad)
    return _unique_bytes(grads)


def _counted_bytes(model: Any, optimizer: Any) -> dict[str, int | None]:
    params = [p for p in model.parameters()]
    if hasattr(model, "groupshard"):
        params = [s for storage in model.groupshard.storages for s in storage.shards]
    grads = [p.grad for p in params if p.grad is not None]
    grads += getattr(optimizer, "gradient_slices", [])  # groupshard ZeRO's, kept between steps
    inner = getattr(optimizer, "optim", optimizer)
    states = [
        v
        for state in getattr(inner, "state", {}).values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    if hasattr(optimizer, "fp32_partitioned_groups_flat") or hasattr(
        optimizer, "single_partition_of_fp32_groups"
    ):
        states = [v for state in optimizer.optimizer.state.values() for v in state.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0]  # fmt: skip
    return {"params": _unique_bytes(params), "grads": _unique_bytes(grads),
            "state": _unique_bytes(states)}  # fmt: skip


def _groupshard_volume() -> tuple[dict[str, Any], dict[str, float], dict[str, int], dict[str, int]]:
    """Patches for groupshard's comm functions that add up the bytes each rank moves, per
    function, with the ideal algorithm for each collective: (N-1)/N of the gathered or
    scattered buffer (in its own dtype: bf16 gathers count 2 bytes an element), twice that
    for an all-reduce, the chunks sent to other ranks for an all-to-all; and how many times
    each runs; and ``held["all_to_all_buffers"]``: the largest send + receive buffers of one
    all-to-all (gs.optim.Muon's, reused for the way back), not counted in the bytes."""
    from groupshard import comm

    moved: dict[str, float] = {}
    calls: dict[str, int] = {}

    def counting(name: str, factor: float, which: int) -> Any:
        original = getattr(comm, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            tensor = args[which]
            ranks = next(a for a in (*args, *kwargs.values()) if isinstance(a, comm.Ranks))
            moved[name] = moved.get(name, 0.0) + (
                factor * tensor.numel() * tensor.element_size() * (ranks.size - 1) / ranks.size
            )
            calls[name] = calls.get(name, 0) + 1
            return original(*args, **kwargs)

        return wrapper

    original_all_to_all = comm.all_to_all

    def all_to_all(output: torch.Tensor, source: torch.Tensor, output_splits: Any,
                   input_splits: Any, ranks: Any, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        sent = sum(n for rank, n in enumerate(input_splits) if rank != ranks.rank)
        moved["all_to_all"] = moved.get("all_to_all", 0.0) + sent * source.element_size()
        calls["all_to_all"] = calls.get("all_to_all", 0) + 1
        buffers = source.numel() * source.element_size() + output.numel() * output.element_size()
        held["all_to_all_buffers"] = max(held.get("all_to_all_buffers", 0), buffers)
        return original_all_to_all(output, source, output_splits, input_splits, ranks, *args,
                                   **kwargs)  # fmt: skip

    held: dict[str, int] = {}
    patches = {
        "all_to_all": all_to_all,
        "all_gather": counting("all_gather", 1.0, 0),
        "reduce_scatter_mean": counting("reduce_scatter_mean", 1.0, 1),
        "all_reduce_mean": counting("all_reduce_mean", 2.0, 0),
        "all_reduce_sum": counting("all_reduce_sum", 2.0, 0),
    }
    return patches, moved, calls, held


SIZED_OPS = {"c10d::_allgather_base_": 0, "c10d::_reduce_scatter_base_": 1}
"""c10d ops whose sizes torch.profiler records: index of the whole (unsharded) buffer
among their inputs. Ops on tensor lists (all-reduce, broadcast) record no shapes."""

DTYPE_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2}
"""Element sizes of the dtype names torch.profiler records."""


def _profiled_bytes(events: list[Any], world_size: int, element_size: int) -> float | None:
    """Bytes per rank the recorded c10d ops move with ideal algorithms ((N-1)/N of each
    gathered or scattered buffer, in the dtype the profiler records, else
    ``element_size``), or None when some op recorded no sizes."""
    moved = 0.0
    for event in events:
        whole = SIZED_OPS.get(event.name)
        if whole is None or not event.input_shapes[whole]:
            return None
        numel = 1
        for dim in event.input_shapes[whole]:
            numel *= dim
        dtypes = getattr(event, "input_dtypes", None) or []
        size = DTYPE_BYTES.get(dtypes[whole], element_size) if len(dtypes) > whole else element_size
        moved += numel * size * (world_size - 1) / world_size
    return moved


@dataclass(frozen=True)
class _Op:
    name: str
    input_shapes: list[list[int]]
    input_dtypes: list[str]


def _c10d_events(prof: Any) -> list[Any]:
    """The profiled ``c10d::`` ops but barriers, read from the raw Kineto events (building
    torch's FunctionEvent tree of every op costs seconds on an accumulation step)."""
    try:
        raw = [(e.name(), e.shapes(), e.dtypes()) for e in prof.profiler.kineto_results.events()]
    except AttributeError:  # another torch: the public, slower way
        raw = [(e.name, e.input_shapes, getattr(e, "input_dtypes", None) or [])
               for e in prof.events()]  # fmt: skip
    return [
        _Op(name, shapes, dtypes)
        for name, shapes, dtypes in raw
        if name.startswith("c10d::") and not name.startswith("c10d::barrier")
    ]


def _collectives(
    system: System, model: Any, optimizer: Any, micro_batches: list[torch.Tensor]
) -> dict[str, Any]:
    """The c10d ops of one warm optimizer step (all its micro-batches), as torch.profiler
    records them, and the bytes moved per rank: for groupshard counted in its comm
    functions, for others from the sizes the profiler records (all-gather and
    reduce-scatter only; None otherwise). Also apart: gathered bytes, reduced bytes and
    the number of gradient reduce-scatters (groupshard: its ``reduce_scatter_mean`` calls,
    which gloo runs as all-reduces; others: the profiled reduce-scatters)."""
    from torch.profiler import ProfilerActivity, profile

    from groupshard import comm

    patches, moved, calls, held = _groupshard_volume()
    with (
        mock.patch.multiple(comm, **patches),
        profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof,
    ):
        _step(system, model, optimizer, micro_batches)
    events = _c10d_events(prof)
    ops: dict[str, int] = {}
    for event in events:
        ops[event.name] = ops.get(event.name, 0) + 1
    element_size = next(iter(model.parameters())).element_size()
    world_size = dist.get_world_size()
    result = {"count": len(events), "ops": ops, "groupshard_bytes": sum(moved.values()) or None,
              "profiled_bytes": _profiled_bytes(events, world_size, element_size)}  # fmt: skip
    if hasattr(model, "groupshard"):
        result["gather_bytes"] = moved.get("all_gather", 0.0)
        result["reduce_bytes"] = moved.get("reduce_scatter_mean", 0.0) + moved.get(
            "all_reduce_mean", 0.0
        )
        result["reduce_scatters"] = calls.get("reduce_scatter_mean", 0)
    if calls.get("all_to_all"):  # gs.optim.Muon's exchanges
        result["all_to_alls"] = calls["all_to_all"]
        result["all_to_all_bytes"] = moved["all_to_all"]
        result["all_to_all_buffer_bytes"] = held["all_to_all_buffers"]
    if not hasattr(model, "groupshard"):
        # None where some op of the kind recorded no sizes (all-reduces, list all-gathers)
        for key, kinds in (("gather_bytes", ("allgather",)),
                           ("reduce_bytes", ("reduce_scatter", "allreduce"))):  # fmt: skip
            chosen = [event for event in events if any(kind in event.name for kind in kinds)]
            result[key] = _profiled_bytes(chosen, world_size, element_size)
        result["reduce_scatters"] = sum(
            count for op, count in ops.items() if "reduce_scatter" in op
        )
    return result


def _full_params(name: str, system: System, model: Any) -> dict[str, torch.Tensor]:
    """The trained parameters, unsharded: the fp32 masters where the model computes in bf16."""
    if hasattr(model, "groupshard"):
        return {k: v for k, v in gs.full_state_dict(model).items()}
    if name.startswith("DeepSpeed") and system.bf16:
        from deepspeed.utils import safe_get_full_fp32_param

        return {
            k: safe_get_full_fp32_param(v).detach().clone()
            for k, v in model.module.named_parameters(remove_duplicate=False)
        }
    if name.startswith("DeepSpeed"):
        import deepspeed

        params = list(model.module.parameters())
        with deepspeed.zero.GatheredParameters(
            params, enabled=model.zero_optimization_stage() == 3
        ):
            return {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    if name == "FSDP1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model):
            return {k.replace("_fsdp_wrapped_module.", ""): v.detach().clone()
                    for k, v in model.state_dict().items()}  # fmt: skip
    state = getattr(model, "module", model).state_dict()
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in state.items()
    }


def _add(total: list[torch.Tensor], more: list[torch.Tensor]) -> list[torch.Tensor]:
    """``total`` + ``more`` element-wise, in place (``more`` itself while ``total`` is empty)."""
    return [a.add_(b) for a, b in zip(total, more, strict=True)] if total else more


def _reference(
    base: nn.Module,
    batches: list[torch.Tensor],
    lamb: bool = False,
    bf16: bool = False,
    world_size: int = 1,
    micro_batches: int = 1,
    same_order: bool = False,
    muon: bool = False,
) -> dict[str, torch.Tensor]:
    """Single-process training on each step's global batch (every rank's micro-batches),
    with AdamW, LAMB or (``muon``) torch.optim.Muon + torch.optim.AdamW.

    fp32: one backward on the whole global batch. bf16 (or ``same_order``): what the
    sharded runs compute, in their order: a bf16 (fp32) copy of the fp32 masters computes
    each rank's micro-batches (rank-major, as the ranks take them), each micro-batch's
    gradient is summed in fp32 per rank, the ranks' sums are averaged in fp32, and the
    fp32 masters step.
    """
    model = copy.deepcopy(base)
    optimizer: Any = gs.optim.LAMB(_groups(model), lr=LR) if lamb else _adamw(_groups(model))
    if muon:
        optimizer = _torch_muon(_muon_groups(model))
    compute = None
    if bf16 or same_order:
        compute = copy.deepcopy(base).to(torch.bfloat16 if bf16 else torch.float32)
    for tokens in batches:
        if compute is None:
            model(tokens[:, :-1], tokens[:, 1:]).backward()
        else:
            with torch.no_grad():
                for low, master in zip(compute.parameters(), model.parameters(), strict=True):
                    low.copy_(master)
            summed: list[torch.Tensor] = []
            for rank_tokens in tokens.chunk(world_size):
                local: list[torch.Tensor] = []
                for micro in rank_tokens.chunk(micro_batches):
                    loss = compute(micro[:, :-1], micro[:, 1:])
                    (loss / micro_batches if micro_batches > 1 else loss).backward()
                    grads = [p.grad.float() for p in compute.parameters()]
                    compute.zero_grad(set_to_none=True)
                    local = _add(local, grads)
                summed = _add(summed, local)
            for master, grad in zip(model.parameters(), summed, strict=True):
                master.grad = grad.div_(world_size)
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def _init(rank: int, world_size: int, store_path: str, device: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", DS_ACCELERATOR=device)  # fmt: skip
    torch.set_num_threads(1)
    backend = "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
        backend = "nccl"
    store = dist.FileStore(store_path, world_size)
    timeout = datetime.timedelta(seconds=300)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _worker(rank: int, args: argparse.Namespace, store_path: str, result_path: str) -> None:
    _init(rank, args.world_size, store_path, args.device)
    config, batch = MODELS[args.model]
    torch.manual_seed(0)
    base = GPT(config).to(_device())
    table = systems(lamb=not args.no_lamb, micro_batches=args.micro_batches, muon=args.muon)
    if args.only:
        table = {args.only: table[args.only]}
    if args.rows:
        table = {name: system for name, system in table.items() if re.search(args.rows, name)}
    built = {name: system(base) for name, system in table.items()}
    steps = args.warmup + args.rounds + 2  # + one profiled step + one measured for memory
    # per step, the global batch: every rank's micro-batches, rank-major
    global_batches = {
        count: [b.to(_device()) for b in _batches(config, batch * count, args.world_size, steps)]
        for count in sorted({system.micro_batches for system in table.values()})
    }

    def mine(system: System, step: int) -> list[torch.Tensor]:
        """This rank's micro-batches of a step, each ``batch`` sequences."""
        count = system.micro_batches
        local = global_batches[count][step][rank * batch * count : (rank + 1) * batch * count]
        return list(local.chunk(count))

    times: dict[str, list[tuple[float, float]]] = {name: [] for name in built}
    for index in range(args.warmup + args.rounds):
        for name, (model, optimizer) in built.items():
            dist.barrier()
            elapsed = _step(table[name], model, optimizer, mine(table[name], index))
            if index >= args.warmup:
                times[name].append(elapsed)
    results: dict[str, Any] = {}
    for name, (model, optimizer) in built.items():
        system = table[name]
        dist.barrier()
        results[name] = {
            "micro_batches": system.micro_batches, "bf16": system.bf16,
            "keep_gathered": system.keep_gathered, "baseline": system.baseline, "muon": system.muon,
            "collectives": _collectives(system, model, optimizer, mine(system, steps - 2)),
            "held_bytes": _held_bytes(system, model, optimizer, mine(system, steps - 1)),
        }  # fmt: skip
        if times[name]:
            results[name]["step_ms_rounds"] = [t * 1e3 for t, _ in times[name]]
            results[name]["optimizer_ms_rounds"] = [o * 1e3 for _, o in times[name]]
            results[name]["step_ms"] = statistics.median(t for t, _ in times[name]) * 1e3
            results[name]["optimizer_ms"] = statistics.median(o for _, o in times[name]) * 1e3
        results[name]["tokens_per_s"] = (
            batch
            * system.micro_batches
            * args.world_size
            * config.block_size
            / (results[name].get("step_ms", float("nan")) / 1e3)
        )
    results["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if torch.cuda.is_initialized():
        results["peak_rss_bytes"] = torch.cuda.max_memory_allocated()  # the GPU's, not the host's
    if not args.only:
        references: dict[tuple[bool, bool, int, bool, bool], dict[str, torch.Tensor]] = {}

        def reference(
            lamb: bool, bf16: bool, count: int, same_order: bool = False, muon: bool = False
        ) -> dict[str, torch.Tensor]:
            key = (lamb, bf16, count, same_order, muon)
            if key not in references:
                references[key] = _reference(
                    base, global_batches[count], lamb, bf16, args.world_size, count, same_order,
                    muon,
                )  # fmt: skip
            return references[key]

        def difference(full: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
            return max(
                (full[k].double().cpu() - expected[k].double().cpu()).abs().max().item()
                for k in expected
            )

        for name, (model, _) in built.items():
            system = table[name]
            full = _full_params(name, system, model)
            expected = reference(system.lamb, system.bf16, system.micro_batches, muon=system.muon)
            results[name]["max_difference"] = difference(full, expected)
            if system.muon:
                # bf16 Newton-Schulz amplifies last-bit gradient differences (fp32 sums in
                # another order) to a few percent of an update: for scale, how far the
                # reference trained, and the reference summing each rank's gradient in order
                start = {k: v.detach() for k, v in base.state_dict().items()}
                results[name]["trained_distance"] = difference(expected, start)
                same_order = reference(False, False, 1, True, muon=True)
                results[name]["max_difference_same_order"] = difference(full, same_order)
            if system.bf16:  # for scale: how far bf16 training goes from fp32 training
                fp32 = reference(system.lamb, False, system.micro_batches)
                results[name]["max_difference_from_fp32"] = difference(full, fp32)
            elif system.micro_batches > 1:  # summing micro-batches in the ranks' order
                same_order = reference(system.lamb, False, system.micro_batches, True)
                results[name]["max_difference_same_order"] = difference(full, same_order)
    gathered = [None] * args.world_size
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(result_path, "w") as handle:
            json.dump(gathered, handle)
    dist.destroy_process_group()


def spawn_ranks(
    worker: Callable[..., None], args: argparse.Namespace, world_size: int
) -> list[dict[str, Any]]:
    """Runs ``worker(rank, args, store_path, result_path)`` on ``world_size`` fresh
    processes; rank 0 writes every rank's results as JSON to ``result_path``."""
    with tempfile.TemporaryDirectory(prefix="groupshard-bench-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        try:
            mp.start_processes(worker, args=(args, os.path.join(tmp, "store"), result_path),
                               nprocs=world_size, start_method="spawn")  # fmt: skip
        except mp.ProcessExitedException:
            # Some systems' threads abort the process at exit (after the results are written).
            if not os.path.exists(result_path):
                raise
        with open(result_path) as handle:
            return json.load(handle)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every system interleaved in one process group, then each alone for its peak RSS."""
    load_before = os.getloadavg()
    per_rank = spawn_ranks(_worker, args, args.world_size)
    names = [n for n in per_rank[0] if n != "peak_rss_bytes"]
    report: dict[str, Any] = {"model": args.model, "world_size": args.world_size,
                              "device": args.device,
                              "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                                         f"{platform.python_version()}, torch {torch.__version__}",
                              "load_average": {"before": load_before, "after": os.getloadavg()},
                              "rows": {}}  # fmt: skip
    config, _ = MODELS[args.model]
    total = sum(p.numel() for p in GPT(config).parameters()) * 4
    matrices = sum(p.numel() for p in gs.muon_groups(GPT(config))[0]["params"]) * 4
    if not args.only:
        report["bf16_speed"] = bf16_speed(*MODELS[args.model])
    for name in names:
        row = dict(per_rank[0][name])
        row["held_bytes_per_rank"] = [
            sum(r[name]["held_bytes"][k] for k in ("params", "grads", "state")) for r in per_rank
        ]  # parameters + gradients + optimizer state
        row["ideal_bytes_per_rank"] = 4 * total // args.world_size  # AdamW: 2 states
        if row.get("muon"):  # Muon: 1 state (momentum) for the matrices
            row["ideal_bytes_per_rank"] = (4 * total - matrices) // args.world_size
        if "all_to_all_buffer_bytes" in row["collectives"]:  # gs.optim.Muon's, per rank
            row["all_to_all_buffer_bytes_per_rank"] = [
                r[name]["collectives"]["all_to_all_buffer_bytes"] for r in per_rank
            ]
            row["all_to_all_bytes_per_rank"] = [
                r[name]["collectives"]["all_to_all_bytes"] for r in per_rank
            ]
        report["rows"][name] = row
    if args.rss:
        for name in names:
            single = argparse.Namespace(**{**vars(args), "only": name, "warmup": 1, "rounds": 2})
            report["rows"][name]["peak_rss_bytes_per_rank"] = [
                r["peak_rss_bytes"] for r in spawn_ranks(_worker, single, args.world_size)
            ]
    for row in report["rows"].values():  # to FSDP2 run the same way (precision, accumulation)
        baseline = report["rows"].get(row["baseline"], {})
        fsdp2_ms = baseline.get("step_ms")
        row["ratio_to_fsdp2"] = row["step_ms"] / fsdp2_ms if fsdp2_ms else None
        # the median of each round's ratio: rounds run both one after the other, so a
        # machine busy with other work for a while slows both (steadier than medians' ratio)
        mine, theirs = row.get("step_ms_rounds", []), baseline.get("step_ms_rounds", [])
        ratios = [a / b for a, b in zip(mine, theirs, strict=True)] if theirs else []
        row["ratio_to_fsdp2_paired"] = statistics.median(ratios) if ratios else None
    _muon_ratios(report["rows"])
    return report


def _paired(mine: dict[str, Any], theirs: dict[str, Any] | None, key: str) -> float | None:
    """The median over rounds of the round's ratio of ``key`` (both rows ran one after the
    other in each round), or None without the other row."""
    if not theirs or not theirs.get(key):
        return None
    return statistics.median(a / b for a, b in zip(mine[key], theirs[key], strict=True))


def _muon_ratios(rows: dict[str, dict[str, Any]]) -> None:
    """Muon rows: the optimizer step over "DDP + torch Muon"'s and the step over the same
    system's AdamW row (medians' ratio and paired)."""
    replicated = rows.get("DDP + torch Muon")
    for name, row in rows.items():
        if name not in MUON_PARTNERS:
            continue
        if replicated:
            row["optimizer_ratio_to_ddp_muon"] = row["optimizer_ms"] / replicated["optimizer_ms"]
            row["optimizer_ratio_to_ddp_muon_paired"] = _paired(
                row, replicated, "optimizer_ms_rounds"
            )
        adamw = rows.get(MUON_PARTNERS[name])
        row["muon_over_adamw"] = row["step_ms"] / adamw["step_ms"] if adamw else None
        row["muon_over_adamw_paired"] = _paired(row, adamw, "step_ms_rounds")


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    for _ in range(2):  # warm-up
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def bf16_speed(config: GPTConfig, batch: int, repeats: int = 5) -> dict[str, Any]:
    """Is bf16 compute faster than fp32 here? One process, one thread (as each rank): the
    model's forward + backward on one rank's batch, and the matmuls of its Linear layers
    (forward, input gradient, weight gradient, at that batch's token count, each layer
    once), in float32 and bfloat16: median ms and the bf16 / fp32 ratio."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = GPT(config)
        tokens = torch.randint(0, config.vocab_size, (batch, config.block_size + 1))
        rows = batch * config.block_size
        shapes: dict[tuple[int, int], int] = {}
        for module in model.modules():
            if isinstance(module, nn.Linear):
                key = (module.in_features, module.out_features)
                shapes[key] = shapes.get(key, 0) + 1
        result: dict[str, Any] = {"threads": 1, "tokens": rows, "model_fwd_bwd_ms": {},
                                  "matmul_ms": {}}  # fmt: skip
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            converted = copy.deepcopy(model).to(dtype)

            def forward_backward(model: nn.Module = converted) -> None:
                model(tokens[:, :-1], tokens[:, 1:]).backward()

            result["model_fwd_bwd_ms"][name] = _median_ms(forward_backward, repeats)
            total = 0.0
            for (n_in, n_out), count in shapes.items():
                x = torch.randn(rows, n_in, dtype=dtype)
                w = torch.randn(n_out, n_in, dtype=dtype)
                g = torch.randn(rows, n_out, dtype=dtype)

                def matmuls(x: torch.Tensor = x, w: torch.Tensor = w, g: torch.Tensor = g) -> None:
                    x @ w.t(), g @ w, g.t() @ x

                total += count * _median_ms(matmuls, repeats)
            result["matmul_ms"][name] = total
        for key in ("model_fwd_bwd_ms", "matmul_ms"):
            times = result[key]
            times["bf16_over_fp32"] = times["bfloat16"] / times["float32"]
        return result
    finally:
        torch.set_num_threads(threads)


def _moved_bytes(row: dict[str, Any]) -> float | None:
    return row["collectives"]["groupshard_bytes"] or row["collectives"].get("profiled_bytes")


def print_table(report: dict[str, Any]) -> None:
    nan = float("nan")
    backend = "NCCL" if report.get("device") == "cuda" else "gloo"
    print(f"model {report['model']}, world size {report['world_size']}, {backend}, 1 thread/rank; "
          f"{report['machine']}")  # fmt: skip
    columns = ["step ms", "/FSDP2", "tok/s", "optim ms", "held MB/rank", "gathered MB",
               "coll/step", "moved MB", "peak MB", "max diff"]  # fmt: skip
    widths = [8, 7, 8, 9, 13, 11, 9, 8, 12, 9]
    width = max(28, *(len(name) for name in report["rows"]))
    print(f"{'system':{width}s} "
          + " ".join(f"{c:>{w}s}" for c, w in zip(columns, widths, strict=True)))  # fmt: skip
    for name, row in report["rows"].items():
        held = max(row["held_bytes_per_rank"]) / 2**20
        rss = row.get("peak_rss_bytes_per_rank")
        print(
            f"{name:{width}s} {row['step_ms']:8.1f} {row['ratio_to_fsdp2'] or float('nan'):7.2f} "
            f"{row['tokens_per_s']:8.0f} {row['optimizer_ms']:9.1f} {held:13.2f} "
            f"{(row['held_bytes'].get('gathered_peak') or nan) / 2**20:11.2f} "
            f"{row['collectives']['count']:9d} "
            f"{(_moved_bytes(row) or nan) / 2**20:8.2f} "
            f"{(max(rss) / 2**20) if rss else float('nan'):12.0f} "
            f"{row.get('max_difference', float('nan')):9.1e}"
        )
    print("/FSDP2: step time over FSDP2's, run the same way (bf16, accumulation); step: one "
          "optimizer step (all its micro-batches).\nmoved MB: bytes per rank with ideal "
          "algorithms, through groupshard's collectives or from the sizes torch.profiler "
          "records\n(only all-gathers and reduce-scatters have them); 3 x parameter bytes x "
          "(N-1)/N for full.\ngloo runs a reduce-scatter as a full all-reduce: sharded "
          "systems pay more for gradients on CPU than over NCCL.")  # fmt: skip
    print_precision_table(report)
    print_muon_table(report)


def print_muon_table(report: dict[str, Any]) -> None:
    """The Muon rows: step and optimizer step against the replicated and FSDP2 baselines,
    the Muon exchange, and each system's Muon step over its AdamW step."""
    nan = float("nan")
    rows = {name: row for name, row in report["rows"].items() if name in MUON_PARTNERS}
    if not rows:
        return
    width = max(len(name) for name in rows)
    columns = ["step ms", "optim ms", "optim/DDP", "paired", "/FSDP2", "paired", "Muon/AdamW",
               "paired", "A2A", "A2A MB", "buf MB", "max diff", "in order", "trained"]  # fmt: skip
    widths = [8, 9, 9, 7, 7, 7, 10, 7, 4, 7, 7, 9, 9, 8]
    print("\nMuon (hidden matrices; AdamW for the rest)")
    print(f"{'system':{width}s} "
          + " ".join(f"{c:>{w}s}" for c, w in zip(columns, widths, strict=True)))  # fmt: skip
    for name, row in rows.items():
        collectives = row["collectives"]
        print(
            f"{name:{width}s} {row['step_ms']:8.1f} {row['optimizer_ms']:9.1f} "
            f"{row.get('optimizer_ratio_to_ddp_muon') or nan:9.2f} "
            f"{row.get('optimizer_ratio_to_ddp_muon_paired') or nan:7.2f} "
            f"{row['ratio_to_fsdp2'] or nan:7.2f} {row.get('ratio_to_fsdp2_paired') or nan:7.2f} "
            f"{row.get('muon_over_adamw') or nan:10.2f} "
            f"{row.get('muon_over_adamw_paired') or nan:7.2f} "
            f"{collectives.get('all_to_alls', 0):4d} "
            f"{max(row.get('all_to_all_bytes_per_rank', [nan])) / 2**20:7.2f} "
            f"{max(row.get('all_to_all_buffer_bytes_per_rank', [nan])) / 2**20:7.2f} "
            f"{row.get('max_difference', nan):9.1e} "
            f"{row.get('max_difference_same_order', nan):9.1e} "
            f"{row.get('trained_distance', nan):8.1e}"
        )
    print(
        "optim/DDP: optimizer step over DDP + torch Muon's (every rank orthogonalizes every "
        "matrix); /FSDP2: step over FSDP2 + torch Muon's;\nMuon/AdamW: step over the same "
        "system's AdamW row; paired: median over rounds of the round's ratio;\nA2A: "
        "gs.optim.Muon's all-to-alls per step; A2A MB: sent per rank; buf MB: its send + "
        "receive buffers (bf16, beyond the shards;\nboth the most of any rank); max diff: from "
        "one process with torch.optim.Muon + AdamW on the global batch; in order:\nsumming "
        "each rank's gradient in rank order; trained: how far that reference moved the "
        "parameters. bf16 Newton-Schulz turns\nlast-bit gradient differences into a few "
        "percent of an update (tests/test_muon.py): differences up to 10 % of 'trained' are\n"
        "that, not a bug."
    )


def print_precision_table(report: dict[str, Any]) -> None:
    """The mixed precision and accumulation rows, with the fp32 rows they build on."""
    nan = float("nan")
    rows = {
        name: row
        for name, row in report["rows"].items()
        if row.get("bf16")
        or row.get("micro_batches", 1) > 1
        or name in ("FSDP2", "groupshard full")
    }
    if not rows:
        return
    width = max(len(name) for name in rows)
    columns = ["step ms", "/FSDP2", "paired", "gather MB", "reduce MB", "RS/step", "accum MB",
               "max diff", "in order", "vs fp32"]  # fmt: skip
    widths = [8, 7, 7, 10, 10, 8, 9, 9, 9, 9]
    counts = ", ".join(str(c) for c in sorted({r["micro_batches"] for r in rows.values()} - {1}))
    accumulation = f" ({counts} micro-batches per optimizer step)" if counts else ""
    print(f"\nmixed precision and accumulation{accumulation}")
    print(f"{'system':{width}s} "
          + " ".join(f"{c:>{w}s}" for c, w in zip(columns, widths, strict=True)))  # fmt: skip
    for name, row in rows.items():
        collectives = row["collectives"]
        accumulated = row["held_bytes"].get("accumulated_grads")
        print(
            f"{name:{width}s} {row['step_ms']:8.1f} {row['ratio_to_fsdp2'] or nan:7.2f} "
            f"{row.get('ratio_to_fsdp2_paired') or nan:7.2f} "
            f"{(collectives.get('gather_bytes') or nan) / 2**20:10.2f} "
            f"{(collectives.get('reduce_bytes') or nan) / 2**20:10.2f} "
            f"{collectives.get('reduce_scatters', 0):8d} "
            f"{(nan if accumulated is None else accumulated) / 2**20:9.2f} "
            f"{row.get('max_difference', nan):9.1e} "
            f"{row.get('max_difference_same_order', nan):9.1e} "
            f"{row.get('max_difference_from_fp32', nan):9.1e}"
        )
    notes = (
        "paired: median over rounds of the round's ratio to the FSDP2 row (both ran one after "
        "the other);\ngather / reduce MB: per rank per optimizer step (groupshard's "
        "reduce-scatters run as all-reduces on gloo: RS/step counts them);\naccum MB: "
        "unsharded gradient bytes held after the next-to-last micro-batch;\nmax diff: from one "
        "process on the global batch (bf16: doing the ranks' casts, in their order); in order: "
        "fp32, from one process\nsumming micro-batches in the ranks' order; vs fp32: bf16, from "
        "one process training in fp32. AdamW turns rounding in tiny gradient\nelements into "
        "~lr/10."
    )
    print(notes)
    speed = report.get("bf16_speed")
    if speed:
        model, matmul = speed["model_fwd_bwd_ms"], speed["matmul_ms"]
        print(f"bf16 / fp32 compute time, one process, one thread: model forward + backward "
              f"{model['bf16_over_fp32']:.2f} ({model['bfloat16']:.1f} / {model['float32']:.1f} "
              f"ms), Linear matmuls {matmul['bf16_over_fp32']:.2f} ({matmul['bfloat16']:.1f} / "
              f"{matmul['float32']:.1f} ms)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="4m")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cuda" if torch.cuda.device_count() >= 2 else "cpu",
        help="cuda: one GPU per rank over NCCL (the default with 2 or more GPUs); cpu: gloo",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--no-lamb", action="store_true", help="skip the LAMB rows")
    parser.add_argument(
        "--muon", action="store_true",
        help="add the Muon rows (slow on CPU); --rows muon-only: the Muon rows and the same "
             "systems' AdamW rows only (implies --muon)",
    )  # fmt: skip
    parser.add_argument(
        "--micro-batches", type=int, default=MICRO_BATCHES,
        help="micro-batches per optimizer step in the accumulation rows (at least 2)",
    )  # fmt: skip
    parser.add_argument(
        "--rss", action="store_true", help="also measure each system's peak RSS alone"
    )
    parser.add_argument("--json", default="benchmark.json", help="where to write the results")
    parser.add_argument(
        "--rows", metavar="REGEX", help="only the rows whose name matches (re.search)"
    )
    parser.add_argument("--only", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rows == "muon-only":
        args.rows, args.muon = MUON_ROWS, True
    if args.micro_batches < 2:
        parser.error(f"--micro-batches must be at least 2, got {args.micro_batches}")
    report = run(args)
    with open(args.json, "w") as handle:
        json.dump(report, handle, indent=1)
    print_table(report)
    print(f"results in {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
