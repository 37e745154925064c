"""One training worker: the loop that ``groupshard train`` runs on every rank."""

from __future__ import annotations

import datetime
import json
import math
import os
import resource
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import groupshard as gs
from groupshard import comm
from groupshard.cli import data as corpus
from groupshard.model import GPT, Block, GPTConfig

PRESETS = {
    "tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64),
    "small": GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128),
    "medium": GPTConfig(vocab_size=256, block_size=256, n_layer=6, n_head=8, n_embd=256),
}
OPTIMIZERS = ("adamw", "sgd", "lamb", "lars")
CHECKPOINT = "checkpoint"
ZERO_CHECKPOINT = "zero.pt"  # inside CHECKPOINT: the --zero run's plain torch.save file


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

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must share with the run that resumes it."""
        return {"model": self.model, "optimizer": self.optimizer, "zero": self.zero}


def optimizer_spec(name: str, lr: float) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The optimizer class and its keyword arguments for ``--optimizer name``."""
    return {
        "adamw": (torch.optim.AdamW, {"lr": lr, "betas": (0.9, 0.95)}),
        "sgd": (torch.optim.SGD, {"lr": lr, "momentum": 0.9}),
        "lamb": (gs.optim.LAMB, {"lr": lr}),
        "lars": (gs.optim.LARS, {"lr": lr, "trust_coefficient": 0.02}),
    }[name]


def with_exclusions(name: str, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """LAMB and LARS leave biases and norms (the no-decay group) out of the trust ratio."""
    if name in ("lamb", "lars"):
        for group in groups:
            group["trust_ratio"] = group["weight_decay"] > 0
    return groups


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over the first 10 % of steps, then cosine decay to 10 %."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


class StopFlag:
    """Set by SIGINT / SIGTERM; the loop stops at the next step all ranks agree on."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._set)

    def _set(self, signum: int, frame: Any) -> None:
        self.requested = True


class Run:
    """A worker's model, optimizer and data, built from the config."""

    def __init__(self, config: TrainConfig, ranks: comm.Ranks, device: torch.device) -> None:
        self.config, self.ranks, self.device = config, ranks, device
        self.model_config = PRESETS[config.model]
        train_data, val_data = corpus.split(corpus.load_corpus(config.data))
        self.train_data, self.val_data = train_data.to(device), val_data.to(device)
        torch.manual_seed(config.seed)
        model = GPT(self.model_config).to(device)
        self.total_params = sum(p.numel() for p in model.parameters())
        groups = with_exclusions(config.optimizer, gs.decay_groups(model, config.weight_decay))
        self.group_names = ["decay", "no_decay"]
        optimizer_class, kwargs = optimizer_spec(config.optimizer, config.lr)
        if config.zero:
            self.model = DDP(model)
            self.optimizer = gs.ZeroRedundancyOptimizer(
                groups, optimizer_class, parameters_as_bucket_view=True, **kwargs
            )
            self.local_params = self.total_params
        else:
            self.model = gs.shard(model, groups, unit=Block, strategy=config.strategy)
            self.optimizer = optimizer_class(self.model.optimizer_groups(), **kwargs)
            self.local_params = sum(s.local.numel() for s in self.model.groupshard.storages)
        for group in self.optimizer.param_groups:
            group["base_lr"] = group["lr"]

    @property
    def sharded(self) -> gs.ShardedModule | None:
        return None if self.config.zero else self.model  # type: ignore[return-value]

    def group_grad_norms(self) -> list[float]:
        """The gradient 2-norm of each group (one all-reduce when sharded)."""
        if self.sharded is not None:
            norms = gs.grad_norms(self.sharded)
            by_group = self.sharded.groupshard.groups.group_of()
            squares = [0.0] * len(self.group_names)
            for fqn, value in norms.items():
                squares[by_group[fqn]] += value.item() ** 2
            return [math.sqrt(s) for s in squares]
        return [
            math.sqrt(sum(float(p.grad.norm()) ** 2 for p in g["params"] if p.grad is not None))
            for g in self.optimizer.param_groups
        ]

    def clip(self) -> None:
        if self.config.clip <= 0:
            return
        if self.sharded is not None:
            gs.clip_grad_norm_(self.sharded, self.config.clip)
        else:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip)

    def batch(self, data: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        block = self.model_config.block_size
        return corpus.batch(
            data, block, self.config.batch_size, self.config.seed, step, self.ranks.rank
        )

    @torch.no_grad()
    def validation_loss(self, batches: int = 4) -> float:
        losses = [self.model(*self.batch(self.val_data, -1 - i)) for i in range(batches)]
        mean = torch.stack(losses).mean()
        comm.all_reduce_mean(mean, self.ranks)
        return mean.item()

    def save(self, step: int) -> None:
        extra = {"step": step, "config": self.config.identity()}
        path = Path(self.config.out) / CHECKPOINT
        if self.sharded is not None:
            gs.checkpoint.save(path, self.sharded, self.optimizer, extra=extra)
        else:  # ZeRO: a plain checkpoint (full model, consolidated optimizer) on rank 0
            self.optimizer.consolidate_state_dict(to=0)
            if self.ranks.rank == 0:
                path.mkdir(parents=True, exist_ok=True)
                state = {"model": self.model.module.state_dict(),
                         "optim": self.optimizer.state_dict(), "extra": extra}  # fmt: skip
                temporary = path / f"{ZERO_CHECKPOINT}.tmp"
                torch.save(state, temporary)
                os.replace(temporary, path / ZERO_CHECKPOINT)
            comm.gather_objects(None, self.ranks)

    def load(self) -> int:
        path = Path(self.config.out) / CHECKPOINT
        if self.sharded is not None:
            extra = gs.checkpoint.load(path, self.sharded, self.optimizer)
        else:
            state = torch.load(path / ZERO_CHECKPOINT, weights_only=True, map_location=self.device)
            self.model.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optim"])
            extra = state["extra"]
        return int(extra["step"])


def _log(out: Path, row: dict[str, Any]) -> None:
    with open(out / "log.jsonl", "a") as handle:
        handle.write(json.dumps(row) + "\n")


def train(config: TrainConfig) -> dict[str, Any]:
    """The training loop of one rank; the process group is initialised."""
    ranks = comm.resolve_ranks()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    run = Run(config, ranks, device)
    out = Path(config.out)
    start = run.load() if config.resume else 0
    stop = StopFlag()
    tokens_per_step = config.batch_size * run.model_config.block_size * ranks.size
    progress = _progress(config.steps, start, enabled=ranks.rank == 0)
    eval_every = config.eval_every or max(1, config.steps // 5)
    step, status = start, "finished"
    started = time.perf_counter()
    for step in range(start, config.steps):
        tick = time.perf_counter()
        for group in run.optimizer.param_groups:
            group["lr"] = group["base_lr"] * lr_factor(step, config.steps)
        loss = run.model(*run.batch(run.train_data, step))
        loss.backward()
        grad_norms = run.group_grad_norms()
        run.clip()
        run.optimizer.step()
        run.optimizer.zero_grad()
        mean_loss = loss.detach().clone()
        comm.all_reduce_mean(mean_loss, ranks)
        row = {
            "step": step + 1,
            "loss": mean_loss.item(),
            "lr": run.optimizer.param_groups[0]["lr"],
            "tokens_per_s": tokens_per_step / (time.perf_counter() - tick),
        }
        row.update({f"grad_norm/{n}": v for n, v in zip(run.group_names, grad_norms, strict=True)})
        if (step + 1) % eval_every == 0 or step + 1 == config.steps:
            row["val_loss"] = run.validation_loss()
        if ranks.rank == 0:
            _log(out, row)
            progress.update(1)
            progress.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
        if config.ckpt_every and (step + 1) % config.ckpt_every == 0:
            run.save(step + 1)
        flag = torch.tensor(float(stop.requested))
        comm.all_reduce_max(flag, ranks)
        if flag.item():
            step, status = step + 1, "interrupted"
            break
    else:
        step = config.steps
    progress.close()
    run.save(step)
    elapsed = time.perf_counter() - started
    peak_rss = comm.gather_objects(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, ranks)
    summary = {
        "status": status, "step": step, "steps": config.steps, "seconds": elapsed,
        "tokens_per_s": tokens_per_step * (step - start) / max(elapsed, 1e-9),
        "peak_rss_bytes_per_rank": peak_rss, "world_size": ranks.size,
        "parameters_total": run.total_params, "parameters_per_rank": run.local_params,
        "config": asdict(config),
    }  # fmt: skip
    if ranks.rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _progress(total: int, initial: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True)


def worker(config: TrainConfig) -> None:
    """Entry point of a launched worker: join the group (env://), train, leave."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo", timeout=datetime.timedelta(seconds=120)
    )
    try:
        summary = train(config)
        if dist.get_rank() == 0:
            from groupshard.cli.report import finish

            finish(Path(config.out), summary)
    finally:
        dist.destroy_process_group()
