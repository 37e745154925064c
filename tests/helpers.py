"""Models, groups and training loops shared by the multi-process tests (run inside ranks)."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn

import groupshard as gs
from groupshard.cli.model import GPT, Block, GPTConfig

TINY = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
BATCH_PER_RANK = 2


class Shift(nn.Module):
    """A unit made only of biases: a vector and a 0-dim (1-element) offset."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(width) * 0.02)
        self.offset = nn.Parameter(torch.tensor(0.01))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias + self.offset


class EdgeGPT(GPT):
    """GPT plus the awkward cases: a bias-only unit, 1-element parameters, a frozen one."""

    def __init__(self, config: GPTConfig = TINY) -> None:
        super().__init__(config)
        self.shift = Shift(config.n_embd)
        self.logit_scale = nn.Parameter(torch.ones(1))
        self.wpe.weight.requires_grad_(False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.shift(self.ln_f(x))) * self.logit_scale
        if targets is None:
            return logits
        return nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


UNITS = (Block, Shift)
HEAD = ("wte.weight", "shift.offset", "logit_scale")


def three_groups(model: nn.Module, head_lr: float) -> list[dict[str, Any]]:
    """decay / no-decay / head (own lr): the head group is tiny inside the Shift unit."""

    def rule(name: str, param: torch.Tensor) -> str:
        if name in HEAD:
            return "head"
        return "decay" if param.ndim >= 2 else "no_decay"

    return gs.groups_by(
        model,
        rule,
        {
            "decay": {"weight_decay": 0.1},
            "no_decay": {"weight_decay": 0.0},
            "head": {"lr": head_lr},
        },
    )


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=3e-3),
    "adamw_fused": lambda groups: torch.optim.AdamW(groups, lr=3e-3, fused=True),
    "adamw_foreach": lambda groups: torch.optim.AdamW(groups, lr=3e-3, foreach=True),
    "adam_loop": lambda groups: torch.optim.Adam(groups, lr=3e-3, foreach=False),
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=3e-2),
    "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=1e-3, momentum=0.5),
}


def global_batches(
    steps: int, world_size: int, seed: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same global batches on every rank."""
    generator = torch.Generator().manual_seed(seed)
    size = (BATCH_PER_RANK * world_size, TINY.block_size)
    return [
        (
            torch.randint(0, TINY.vocab_size, size, generator=generator),
            torch.randint(0, TINY.vocab_size, size, generator=generator),
        )
        for _ in range(steps)
    ]


def numbered(state_dict: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name (``gs.optim_state_dict``, torch's
    full ``get_optimizer_state_dict``) numbered as ``Optimizer.state_dict()`` numbers it."""
    names = [name for group in state_dict["param_groups"] for name in group["params"]]
    index = {name: position for position, name in enumerate(names)}
    return {
        "state": {index[name]: state for name, state in state_dict["state"].items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]}
            for group in state_dict["param_groups"]
        ],
    }


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model``'s state dict (on a sharded model: the full one, a collective)."""
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def run_cases(cases: dict[str, Callable[[str], Any]], default: list[str] | None = None) -> None:
    """The entry point of a ``*_cases.py`` script run under torchrun: ``script FOLDER
    [CASE...]`` runs the named cases (``default``, else all, when none is named) in this one
    launch (each torchrun start costs seconds), each in its own subfolder of FOLDER; rank 0
    writes each case's result, or its traceback, to FOLDER/result.json (with case names
    given: FOLDER/result-<names>.json). A case that raises leaves the others to run."""
    import traceback
    import warnings

    import torch.distributed as dist

    folder, named = sys.argv[1], sys.argv[2:]
    names = named or default or list(cases)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    results: dict[str, Any] = {}
    for name in names:
        os.makedirs(os.path.join(folder, name), exist_ok=True)
        try:
            results[name] = {"result": cases[name](os.path.join(folder, name))}
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    if int(os.environ.get("RANK", "0")) == 0:
        result_file = f"result-{'-'.join(named)}.json" if named else "result.json"
        with open(os.path.join(folder, result_file), "w") as file:
            json.dump(results, file)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def max_difference(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    assert sorted(first) == sorted(second), (sorted(first), sorted(second))
    return max((first[k].double() - second[k].double()).abs().max().item() for k in first)


def train_side_by_side(
    sharded: nn.Module,
    sharded_opt: torch.optim.Optimizer,
    reference: nn.Module,
    reference_opt: torch.optim.Optimizer,
    steps: int,
    rank: int,
    world_size: int,
) -> None:
    """``steps`` optimizer steps of both: the sharded model on this rank's part of each
    global batch, the unsharded reference on all of it."""
    for inputs, targets in global_batches(steps, world_size):
        local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
        sharded(inputs[local], targets[local]).backward()
        reference(inputs, targets).backward()
        for opt in (sharded_opt, reference_opt):
            opt.step()
            opt.zero_grad()


def train_pair(
    rank: int,
    world_size: int,
    strategy: str,
    optimizer: str,
    steps: int = 10,
    make_groups: Callable[[nn.Module], Any] = lambda m: three_groups(m, head_lr=1e-3),
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    units: Any = UNITS,
    bucket_bytes: int = 25 * 2**20,
) -> tuple[gs.ShardedModule, nn.Module, list[float], list[float]]:
    """Train a sharded model and the unsharded reference side by side."""
    torch.manual_seed(0)
    model = EdgeGPT()
    reference = copy.deepcopy(model)
    sharded = gs.shard(
        model, make_groups(model), unit=units, strategy=strategy,
        reduce_bucket_bytes=bucket_bytes, prefetch_bytes=bucket_bytes,
    )  # fmt: skip
    sharded_opt = OPTIMIZERS[optimizer](sharded.optimizer_groups())
    reference_opt = OPTIMIZERS[optimizer](make_groups(reference))
    schedulers = [scheduler(o) for o in (sharded_opt, reference_opt)] if scheduler else []
    losses: list[float] = []
    reference_losses: list[float] = []
    for inputs, targets in global_batches(steps, world_size):
        local = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
        loss = sharded(inputs[local], targets[local])
        loss.backward()
        sharded_opt.step()
        sharded_opt.zero_grad()
        reference_loss = reference(inputs, targets)
        reference_loss.backward()
        reference_opt.step()
        reference_opt.zero_grad()
        for s in schedulers:
            s.step()
        losses.append(loss.item())
        reference_losses.append(reference_loss.item())
    sharded._lrs = [g["lr"] for g in sharded_opt.param_groups]
    reference._lrs = [g["lr"] for g in reference_opt.param_groups]
    return sharded, reference, losses, reference_losses


UNIT_CHOICES: dict[str, Any] = {
    "blocks": UNITS,
    "nested": (Block, Shift, nn.Linear),  # Linear units inside Block units; lm_head owns nothing
    "root only": None,
}


def equivalence_case(
    rank: int,
    world_size: int,
    strategy: str,
    optimizer: str,
    steps: int = 10,
    units: str = "blocks",
    bucket_bytes: int = 25 * 2**20,
) -> float:
    sharded, reference, _, _ = train_pair(
        rank, world_size, strategy, optimizer, steps, units=UNIT_CHOICES[units],
        bucket_bytes=bucket_bytes,
    )  # fmt: skip
    return max_difference(gs.full_state_dict(sharded), reference.state_dict())


def full_grads(sharded: gs.ShardedModule) -> dict[str, torch.Tensor]:
    """Every original parameter's gradient, gathered from the shard gradients (test-only)."""
    import torch.distributed as dist

    grads: dict[str, torch.Tensor] = {}
    for storage in sharded.groupshard.storages:
        for shard, buffer in zip(storage.shards, storage.layout.buffers, strict=True):
            if shard.grad is None:
                continue
            if storage.replicated:
                unsharded = shard.grad.detach().clone()
            else:
                unsharded = shard.grad.new_empty(buffer.padded_numel)
                dist.all_gather_into_tensor(unsharded, shard.grad.contiguous())
            for slot in buffer.params:
                grads[slot.fqn] = unsharded[slot.offset : slot.offset + slot.numel].view(slot.shape)
    return grads


def set_grad_element(sharded: gs.ShardedModule, fqn: str, index: int, value: float) -> None:
    """Set element ``index`` of ``fqn``'s flattened gradient, on whichever rank holds it."""
    for storage in sharded.groupshard.storages:
        for shard, buffer in zip(storage.shards, storage.layout.buffers, strict=True):
            for slot in buffer.params:
                if slot.fqn != fqn:
                    continue
                start, end = buffer.shard_range(storage.shard_rank)
                position = slot.offset + index
                if start <= position < end:
                    shard.grad.view(-1)[position - start] = value


def emulated_cast_step(
    master: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    dtype: torch.dtype,
    loss_scale: float = 1.0,
    reduce_dtype: torch.dtype = torch.float32,
    around: Callable[[int, nn.Module], AbstractContextManager[Any]] | None = None,
) -> list[float]:
    """Give ``master`` the mean of the ``dtype`` gradients of each batch (one per rank and
    micro-batch), summed in ``reduce_dtype`` in batch order, then divided, as mixed
    precision computes them; each loss is multiplied by ``loss_scale`` before its backward.
    ``around(index, compute_model)``: a context for batch ``index``'s forward and backward."""
    compute = copy.deepcopy(master).to(dtype)
    total = {name: torch.zeros_like(p, dtype=reduce_dtype) for name, p in master.named_parameters()}
    losses = []
    for index, (inputs, targets) in enumerate(batches):
        compute.zero_grad()
        with around(index, compute) if around is not None else contextlib.nullcontext():
            loss = compute(inputs, targets)
            (loss * loss_scale).backward()
        losses.append(loss.item())
        for name, p in compute.named_parameters():
            if p.grad is not None:
                total[name] += p.grad.to(reduce_dtype)
    for name, p in master.named_parameters():
        if p.requires_grad:
            p.grad = (total[name] / len(batches)).to(p.dtype)
    return losses


def run_under_torchrun(
    arguments: list[str], folder: Path, timeout: float = 240, nproc: int = 2
) -> str:
    """``torchrun --standalone --nproc-per-node {nproc} *arguments`` in ``folder``, as a user
    runs a script; its stdout. Fails with the workers' own stderr (their real error), and on
    a hang at ``timeout``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    result = subprocess.run(
        [*command, str(nproc), *arguments], env=env, cwd=folder, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-6000:]
    return result.stdout


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
DOCS = Path(__file__).resolve().parents[1] / "docs"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 now (each bound, then released)."""
    sockets = [socket.socket() for _ in range(count)]
    for each in sockets:
        each.bind(("127.0.0.1", 0))
    ports = [each.getsockname()[1] for each in sockets]
    for each in sockets:
        each.close()
    return ports


def guide_script(guide: str, index: int) -> str:
    """The ``index``-th ```python block of ``docs/<guide>``."""
    blocks = PYTHON_BLOCK.findall((DOCS / guide).read_text())
    assert len(blocks) > index, f"{guide} has {len(blocks)} python blocks"
    return blocks[index]


def run_benchmark(script: str, folder: Path, *arguments: str, timeout: float = 300) -> dict:
    """``python benchmarks/<script> *arguments --out <folder>/r.json`` from the repository
    root (a benchmark's smoke test); its JSON report. Fails with the script's stderr."""
    out = folder / "r.json"
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *arguments, "--out", str(out)],
        cwd=BENCHMARKS.parent, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def rendered_table(kind: str, reports: list[dict]) -> list[str]:
    """benchmarks/tables.py's table of ``kind`` for ``reports``: its markdown lines."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import tables
    finally:
        sys.path.remove(str(BENCHMARKS))
    return tables.KINDS[kind](reports)
