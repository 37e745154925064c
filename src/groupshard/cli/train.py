"""One training worker: the loop that ``groupshard train`` runs on every rank."""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import resource
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

import groupshard as gs
from groupshard import comm
from groupshard.cli import data as corpus
from groupshard.cli import report
from groupshard.cli.config import (
    CHECKPOINT,
    ZERO_CHECKPOINT,
    TrainConfig,
)
from groupshard.cli.model import GPT, Block, parallelize_gpt
from groupshard.mesh import MESH_DIM_NAMES

# what gloo raises on a rank whose peer's process is gone, and how long such a rank waits
# before it fails (the launcher checks its workers every 0.2 s, torchrun every 0.1 s)
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
PEER_GONE_GRACE = 1.0  # seconds

# --precision: the dtype units gather and compute in (gradients reduce in fp32 either way)
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def optimizer_spec(name: str, lr: float) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The optimizer class and its keyword arguments for ``--optimizer name``."""
    return {
        "adamw": (torch.optim.AdamW, {"lr": lr, "betas": (0.9, 0.95)}),
        "sgd": (torch.optim.SGD, {"lr": lr, "momentum": 0.9}),
        "lamb": (gs.optim.LAMB, {"lr": lr}),
        "lars": (gs.optim.LARS, {"lr": lr, "trust_coefficient": 0.02}),
        # Muon on the hidden matrices, AdamW on the rest, one learning rate (Moonlight's)
        "muon": (gs.optim.Muon, {"lr": lr, "adjust_lr_fn": "match_rms_adamw"}),
        # Adafactor's factored moments need whole matrices: owner ranks step them
        "adafactor": (
            gs.optim.WholeParamOptimizer,
            {"optimizer_class": torch.optim.Adafactor, "lr": lr},
        ),
    }[name]


def optimizer_groups(
    name: str, model: torch.nn.Module, weight_decay: float
) -> tuple[list[dict[str, Any]], list[str]]:
    """The param groups for ``--optimizer name`` and their names in the log."""
    if name == "muon":  # the AdamW group: embeddings, biases and norms, without decay
        adamw = {"betas": (0.9, 0.95), "weight_decay": 0.0}
        groups = gs.muon_groups(model, {"weight_decay": weight_decay}, adamw)
        return groups, ["muon", "adamw"]
    return with_exclusions(name, gs.decay_groups(model, weight_decay)), ["decay", "no_decay"]


def with_exclusions(name: str, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """LAMB and LARS leave biases and norms (the no-decay group) out of the trust ratio."""
    if name in ("lamb", "lars"):
        for group in groups:
            group["trust_ratio"] = group["weight_decay"] > 0
    return groups


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over the first 10 % of ``steps``, then cosine decay to 10 %, held there
    after ``steps`` (a resumed run that trains past its schedule's end)."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopFlag:
    """Set by SIGINT / SIGTERM, or by ``event`` (set by ``groupshard train``'s launcher when
    it gets one); the loop stops at the next step all ranks agree on.

    The launcher starts its workers with these signals blocked, so that one arriving while a
    worker still imports stays pending (no KeyboardInterrupt traceback): it is delivered here.
    """

    def __init__(self, event: Any = None) -> None:
        self._signal, self._event = 0, event
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._set)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def _set(self, signum: int, frame: Any) -> None:
        self._signal = self._signal or signum

    @property
    def requested(self) -> bool:
        return bool(self._signal) or (self._event is not None and self._event.is_set())

    @property
    def signum(self) -> int:
        """The signal that asked to stop (the first), 0 if none; the launcher's ``event``
        counts as SIGINT (the launcher knows its own signal)."""
        return self._signal or (signal.SIGINT if self.requested else 0)


def hybrid_mesh(replicas: int, device: torch.device) -> DeviceMesh | None:
    """The ``("replicate", "shard")`` mesh of ``replicas`` rows over the world; None for 1
    (shard over the whole world)."""
    if replicas == 1:
        return None
    shape = (replicas, dist.get_world_size() // replicas)
    return init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIM_NAMES)


def tensor_parallel_mesh(tp: int, device: torch.device) -> DeviceMesh | None:
    """The ``("dp", "tp")`` mesh of ``tp`` columns over the world (torchtitan's); None for 1."""
    if tp == 1:
        return None
    shape = (dist.get_world_size() // tp, tp)
    return init_device_mesh(device.type, shape, mesh_dim_names=("dp", "tp"))


EMBEDDINGS = ("wte.weight", "wpe.weight")  # wte's is lm_head's too (tied)


class Run:
    """A worker's model, optimizer and data, built from the config; ``start``: the step it
    resumes from (whether the embeddings are trained yet, --freeze-embeddings-until)."""

    def __init__(
        self, config: TrainConfig, ranks: comm.Ranks, device: torch.device, start: int = 0
    ) -> None:
        self.config, self.ranks, self.device = config, ranks, device
        self.model_config = config.model_config()
        train_data, val_data = corpus.split(corpus.load_corpus(config.data))
        self.train_data, self.val_data = train_data.to(device), val_data.to(device)
        torch.manual_seed(config.seed)
        if config.init == "meta":  # each rank holds only its shards, plus one block at a time
            with torch.device("meta"):
                model = GPT(self.model_config)
            materialize = {"param_init_fn": GPT._init_weights, "device": device}
        else:
            model = GPT(self.model_config).to(device)
            materialize = {}
        self.total_params = sum(p.numel() for p in model.parameters())
        mesh = tensor_parallel_mesh(config.tp, device)
        # the rank's share of the data: its data-parallel rank (tp peers see the same tokens)
        self.data_rank = ranks.rank if mesh is None else mesh["dp"].get_local_rank()
        if mesh is not None:
            model = parallelize_gpt(model, mesh["tp"])
        self.embeddings_frozen = config.freeze_embeddings_until > start
        for name in EMBEDDINGS:
            model.get_parameter(name).requires_grad_(not self.embeddings_frozen)
        names = {id(p): n for n, p in model.named_parameters()}
        # by name, to name the same parameters after gs.shard (--freeze-embeddings-until)
        self.group_params = [[names[id(p)] for p in g["params"] if names[id(p)] not in EMBEDDINGS]
                             for g in gs.decay_groups(model, config.weight_decay)]  # fmt: skip
        if config.freeze_embeddings_until:
            groups = self._groups(model, with_embeddings=not self.embeddings_frozen)
            groups = with_exclusions(config.optimizer, groups)
        else:
            groups, self.group_names = optimizer_groups(
                config.optimizer, model, config.weight_decay
            )
        optimizer_class, kwargs = optimizer_spec(config.optimizer, config.lr)
        if config.zero:
            self.model = DDP(model)
            self.optimizer = gs.ZeroRedundancyOptimizer(
                groups, optimizer_class, parameters_as_bucket_view=True, **kwargs
            )
            self.local_params = self.total_params
        else:
            dtype = COMPUTE_DTYPES.get(config.precision)
            precision = (
                None
                if dtype is None
                else gs.MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32)
            )
            self.model = gs.shard(
                model,
                groups,
                unit=Block,
                strategy=config.strategy,
                mixed_precision=precision,
                mesh=hybrid_mesh(config.replicate, device) if mesh is None else mesh["dp"],
                **materialize,
            )
            self.optimizer = optimizer_class(self.model.optimizer_groups(), **kwargs)
            self.local_params = sum(s.local.numel() for s in self.model.groupshard.storages)
        # fp16: the loss scaler, whose skip-this-step decision all ranks share
        self.scaler = (
            gs.GradScaler(self.model, init_scale=config.loss_scale)
            if config.precision == "fp16"
            else None
        )
        for group in self.optimizer.param_groups:
            group["base_lr"] = group["lr"]
        # the LR schedule's length: the first start's --steps, kept by its checkpoints, so a
        # run resumed with more --steps continues the schedule (then holds its final LR)
        self.schedule_steps = config.steps
        # the step of the newest complete checkpoint (None: none yet), and a write in flight
        self.saved_step: int | None = start if config.resume else None
        self.writing: tuple[int, gs.checkpoint.AsyncSave] | None = None

    def _groups(self, model: torch.nn.Module, with_embeddings: bool) -> list[dict[str, Any]]:
        """decay / no_decay, then the embeddings in a group of their own (decayed) once they
        train: the groups of --freeze-embeddings-until, from the model's own parameters."""
        groups = [
            {"params": [model.get_parameter(n) for n in names], "weight_decay": decay}
            for names, decay in zip(self.group_params, (self.config.weight_decay, 0.0), strict=True)
        ]
        self.group_names = ["decay", "no_decay"]
        if with_embeddings:
            embeddings = [model.get_parameter(n) for n in EMBEDDINGS]
            groups.append({"params": embeddings, "weight_decay": self.config.weight_decay})
            self.group_names.append("embeddings")
        return groups

    def unfreeze_embeddings(self) -> None:
        """--freeze-embeddings-until: from this step on the embeddings train, in a group of
        their own (gs.regroup: the other groups keep their optimizer state)."""
        assert self.sharded is not None
        groups = with_exclusions(self.config.optimizer, self._groups(self.sharded, True))
        gs.regroup(self.sharded, self.optimizer, groups)
        self.embeddings_frozen = False
        for group in self.optimizer.param_groups:  # every group starts from --lr
            group["base_lr"] = self.config.lr

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

    def batch(self, data: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's micro-batch ``index`` (step x --grad-accum + micro-batch; the
        validation batches are negative)."""
        block = self.model_config.block_size
        return corpus.batch(
            data, block, self.config.batch_size, self.config.seed, index, self.data_rank
        )

    def no_sync(self, micro_batch: int) -> contextlib.AbstractContextManager[Any]:
        """No gradient communication for every micro-batch of a step but its last."""
        if micro_batch == self.config.grad_accum - 1:
            return contextlib.nullcontext()
        return self.model.no_sync()

    @torch.no_grad()
    def validation_loss(self, batches: int = 4) -> float:
        losses = [self.model(*self.batch(self.val_data, -1 - i)) for i in range(batches)]
        mean = torch.stack(losses).mean()
        comm.all_reduce_mean(mean, self.ranks)
        return mean.item()

    def parameters_finite(self) -> bool:
        """Whether every rank's optimizer parameters are all finite (one all-reduce)."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        nonfinite = torch.stack([~torch.isfinite(p.detach()).all() for p in params]).any()
        return not _agreed(bool(nonfinite), self.ranks)

    def save(self, step: int, background: bool = False) -> bool:
        """Save a checkpoint of ``step``, unless a parameter is not finite: then the last
        checkpoint stays and this returns False (on every rank). ``background``
        (--async-checkpoint): return once the rank's part is staged, the write going on
        while training does (``finish_write`` waits for it). A write in flight is finished
        first, and its error raised."""
        if not self.parameters_finite():
            return False
        self.finish_write()
        extra = {
            "step": step,
            "config": self.config.identity(),
            "schedule_steps": self.schedule_steps,
        }
        if self.scaler is not None:
            extra["scaler"] = self.scaler.state_dict()
        path = Path(self.config.out) / CHECKPOINT
        if self.sharded is not None and background:
            handle = gs.checkpoint.async_save(path, self.sharded, self.optimizer, extra=extra)
            self.writing = (step, handle)
        elif self.sharded is not None:
            gs.checkpoint.save(path, self.sharded, self.optimizer, extra=extra)
        else:  # ZeRO: a plain checkpoint (full model, consolidated optimizer) on rank 0
            self.optimizer.consolidate_state_dict(to=0)
            space = self._save_zero(path, extra) if self.ranks.rank == 0 else None
            space = comm.broadcast_object(space, self.ranks)  # rank 0's (needed, free) if full
            if space is not None:
                raise gs.checkpoint.NoSpaceError(str(path), *space)
        if not background:
            self.saved_step = step
        return True

    def finish_write(self) -> None:
        """Wait for the checkpoint being written in the background, if any; raise its error
        (the same on every rank) with the step it was of (``error.step``)."""
        if self.writing is None:
            return
        step, handle = self.writing
        self.writing = None
        try:
            handle.result()
        except Exception as error:
            error.step = step  # type: ignore[attr-defined]
            raise
        self.saved_step = step

    def _save_zero(self, path: Path, extra: dict[str, Any]) -> tuple[int, int] | None:
        """Rank 0 of a --zero run: write the plain checkpoint. None if written; (bytes
        needed, bytes free) if the device is full (the previous checkpoint intact)."""
        path.mkdir(parents=True, exist_ok=True)
        state = {"model": self.model.module.state_dict(),
                 "optim": self.optimizer.state_dict(), "extra": extra}  # fmt: skip
        temporary = path / f"{ZERO_CHECKPOINT}.tmp"
        try:
            with open(temporary, "wb") as stream:  # a Python file: its errors keep their errno
                torch.save(state, stream)
            os.replace(temporary, path / ZERO_CHECKPOINT)
        except Exception as error:
            temporary.unlink(missing_ok=True)
            if not gs.checkpoint.folders.no_space(error):
                raise
            previous = path / ZERO_CHECKPOINT
            needed = max(_tensor_bytes(state), previous.stat().st_size if previous.exists() else 0)
            return needed, gs.checkpoint.folders.free_bytes(path)
        return None

    def load_from(self, path: str) -> None:
        """``--from``: another checkpoint's weights, and its optimizer state if it has one.
        The hyperparameters stay this run's (a load takes the folder's, as
        ``Optimizer.load_state_dict`` does: a new run's options win)."""
        with_state = gs.checkpoint.holds_optimizer_state(path)
        if self.sharded is None and not with_state:
            raise ValueError(
                f"--from {path} with --zero: the folder has no optimizer state, and the ZeRO "
                "optimizer loads its model with it; start without --zero, or from a folder "
                "with optimizer state"
            )
        ours = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        model = self.sharded if self.sharded is not None else self.model
        gs.checkpoint.load(path, model, self.optimizer if with_state else None)
        for group, values in zip(self.optimizer.param_groups, ours, strict=True):
            group.update(values)

    def load(self) -> int:
        """Load ``--out``'s checkpoint; return its step. A failure names the checkpoint."""
        path = Path(self.config.out) / CHECKPOINT
        try:
            if self.sharded is not None:
                extra = gs.checkpoint.load(path, self.sharded, self.optimizer)
            else:
                state = torch.load(
                    path / ZERO_CHECKPOINT, weights_only=True, map_location=self.device
                )
                self.model.module.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optim"])
                extra = state["extra"]
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as error:  # DCP's CheckpointException is not an Exception
            cause = root_cause(error)
            if isinstance(cause, Exception) and str(path) in str(cause):
                raise cause from error
            raise RuntimeError(f"cannot resume from {path}: {describe(cause)}") from error
        self.schedule_steps = int(extra.get("schedule_steps", self.config.steps))
        if self.scaler is not None:  # fp16 is in the identity: its checkpoints have one
            self.scaler.load_state_dict(extra["scaler"])
        return int(extra["step"])


def _tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in ``value`` (nested dicts, lists and tuples)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        value = list(value.values())
    return sum(map(_tensor_bytes, value)) if isinstance(value, list | tuple) else 0


def root_cause(error: BaseException) -> BaseException:
    """The exception behind ``error``: DCP's CheckpointException carries each failed rank's."""
    if isinstance(error, CheckpointException) and error.failures:
        failure = error.failures[min(error.failures)]
        return root_cause(failure[0] if isinstance(failure, tuple) else failure)
    return error


def describe(error: BaseException) -> str:
    """``Type: message``, or ``Type`` alone when the message is empty (as for EOFError)."""
    message = str(error)
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def nonfinite(loss: float, grad_norms: dict[str, float]) -> str | None:
    """What is not finite among a step's loss and group gradient norms (None if all are)."""
    if not math.isfinite(loss):
        return f"loss is {loss}"
    for group, norm in grad_norms.items():
        if not math.isfinite(norm):
            return f"the gradient norm of group {group} is {norm}"
    return None


def _save(
    run: Run, step: int | None, status: str, background: bool = False
) -> tuple[str, str | None]:
    """Save the checkpoint of ``step`` (None: only finish the write in flight, if any):
    ``status`` and None if saved (or, ``background``, staged), else the run's new status
    and why not ("diverged": a parameter is not finite; "failed": no space left on the
    device, for this checkpoint or the one written in the background), alike on every
    rank; the last complete checkpoint stays either way."""
    try:
        if step is None:
            run.finish_write()
            return status, None
        if run.save(step, background):
            return status, None
    except gs.checkpoint.NoSpaceError as error:
        return "failed", (
            f"no space left on device in {error.folder} for the checkpoint of step "
            f"{getattr(error, 'step', step)} (it needs about {error.needed:,} bytes, "
            f"{error.free:,} are free)"
        )
    return "diverged", f"a parameter is not finite after step {step}"


def _log(out: Path, row: dict[str, Any]) -> None:
    with open(out / "log.jsonl", "a") as handle:
        handle.write(report.to_json(row) + "\n")


def _step(
    run: Run, step: int, tokens_per_step: int, eval_every: int
) -> tuple[dict[str, Any], str | None]:
    """Train one step (--grad-accum micro-batches, one optimizer step); return its log row
    and what was not finite (then nothing was updated), the same on every rank.

    fp16: the loss is scaled for backward, the gradients unscaled before their norms and
    clipping; a step whose gradients overflowed is skipped and the scale halved (the
    scaler's decision, agreed by all ranks), which is no failure."""
    config, tick, scaler = run.config, time.perf_counter(), run.scaler
    for group in run.optimizer.param_groups:
        group["lr"] = group["base_lr"] * lr_factor(step, run.schedule_steps)
    accum, losses = config.grad_accum, []
    for micro in range(accum):
        with run.no_sync(micro):  # the last backward reduces the sum of all of them
            loss = run.model(*run.batch(run.train_data, step * accum + micro))
            mean_part = loss / accum  # the gradient of the K-times larger batch's mean
            (mean_part if scaler is None else scaler.scale(mean_part)).backward()
        losses.append(loss.detach())
    if scaler is not None:
        loss_scale = scaler.get_scale()
        scaler.unscale_(run.optimizer)
    grad_norms = dict(zip(run.group_names, run.group_grad_norms(), strict=True))
    mean_loss = torch.stack(losses).mean()
    comm.all_reduce_mean(mean_loss, run.ranks)  # not finite on all ranks if on any
    problem = nonfinite(mean_loss.item(), grad_norms if scaler is None else {})
    if problem is None:
        run.clip()
        if scaler is None:
            run.optimizer.step()
        else:
            scaler.step(run.optimizer)  # skipped on every rank if any overflowed
            scaler.update()
    run.optimizer.zero_grad()
    row = {
        "step": step + 1,
        "loss": mean_loss.item(),
        "lr": run.optimizer.param_groups[0]["lr"],
        "tokens_per_s": tokens_per_step / (time.perf_counter() - tick),
        "precision": config.precision,
        "grad_accum": accum,
    }
    if scaler is not None:  # the scale this step's backward used (halved after an overflow)
        row["loss_scale"] = loss_scale
    row.update({f"grad_norm/{name}": norm for name, norm in grad_norms.items()})
    groups = zip(run.group_names, run.optimizer.param_groups, strict=True)
    row.update({f"lr/{name}": group["lr"] for name, group in groups})
    if problem is None and ((step + 1) % eval_every == 0 or step + 1 == config.steps):
        row["val_loss"] = run.validation_loss()
        if not math.isfinite(row["val_loss"]):  # after this step's update: not to be saved
            problem = f"validation loss is {row['val_loss']}"
    return row, problem


def train(
    config: TrainConfig, progress_file: TextIO | None = None, stop: StopFlag | None = None
) -> dict[str, Any]:
    """The training loop of one rank; the process group is initialised.

    Stops on every rank at the first step whose loss, gradient norm or validation loss is not
    finite, and saves no checkpoint whose parameters are not: the summary's status is then
    "diverged" and its "error" says why and which checkpoint is kept; likewise "failed" when
    a checkpoint finds no space left on the device. A ``stop`` request
    (Ctrl-C) ends the run before the next step, status "interrupted", with a checkpoint if it
    trained a step (else the resumed checkpoint, if any, stays the last).
    """
    ranks = comm.resolve_ranks()
    stop = stop or StopFlag()
    if _agreed(stop.requested, ranks):  # Ctrl-C during start-up: build nothing, save nothing
        return {"status": "interrupted", "step": None, "steps": config.steps,
                "signal": _agreed_signal(stop, ranks), "config": asdict(config)}  # fmt: skip
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    out = Path(config.out)
    resumed = (  # --freeze-embeddings-until: whether the checkpoint's groups have them
        int(gs.checkpoint.read_extra(out / CHECKPOINT)["step"])
        if config.resume and config.freeze_embeddings_until
        else 0
    )
    run = Run(config, ranks, device, start=resumed)
    start = run.load() if config.resume else 0
    if config.start_from is not None and not config.resume:
        run.load_from(config.start_from)
    if ranks.rank == 0:  # rows past the checkpoint (all, without one) are logged again
        report.keep_rows_up_to(out, start)
    tokens_per_step = (  # tp peers read the same tokens: the data-parallel ranks' batches
        config.batch_size * config.grad_accum * run.model_config.block_size
        * (ranks.size // config.tp)
    )  # fmt: skip
    eval_every = config.eval_every or max(1, config.steps // 5)
    step, status, failure = start, "finished", None
    last_started = start if config.resume else None  # the newest checkpoint saved or started
    started = time.perf_counter()
    with _progress(config.steps, start, enabled=ranks.rank == 0, file=progress_file) as progress:
        for step in range(start, config.steps):
            if _agreed(stop.requested, ranks):
                status = "interrupted"
                break
            if run.embeddings_frozen and step >= config.freeze_embeddings_until:
                run.unfreeze_embeddings()
            row, problem = _step(run, step, tokens_per_step, eval_every)
            if ranks.rank == 0:
                _log(out, row)
                progress.update(1)
                progress.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
            if problem is not None:
                status, failure = "diverged", f"{problem} at step {step + 1} (lr {row['lr']:g})"
            elif config.ckpt_every and (step + 1) % config.ckpt_every == 0:
                status, failure = _save(run, step + 1, status, config.async_checkpoint)
                last_started = step + 1 if failure is None else last_started
            if failure is not None:
                step += 1
                break
        else:
            step = config.steps
    nothing_new = status == "interrupted" and step == start
    if failure is None and not nothing_new and last_started != step:
        status, failure = _save(run, step, status)  # the last one in the foreground
    elif failure is None:  # the newest checkpoint's write (if in flight) must complete
        status, failure = _save(run, None, status)
    else:  # a failed run keeps its newest complete checkpoint: the one in flight, if it
        # completes (the failure already says what went wrong first)
        with contextlib.suppress(Exception):
            run.finish_write()
    last_saved = run.saved_step
    elapsed = time.perf_counter() - started
    peak_rss = comm.gather_objects(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, ranks)
    summary = {
        "status": status, "start_step": start, "step": step, "steps": config.steps,
        "seconds": elapsed,
        "tokens_per_s": tokens_per_step * (step - start) / max(elapsed, 1e-9),
        "peak_rss_bytes_per_rank": peak_rss, "world_size": ranks.size,
        "parameters_total": run.total_params, "parameters_per_rank": run.local_params,
        "config": asdict(config),
    }  # fmt: skip
    if status == "interrupted":
        summary["signal"] = _agreed_signal(stop, ranks)
    summary.update(end_of_run(run, status, out))
    if failure is not None:
        kept = (
            "no checkpoint was saved"
            if last_saved is None
            else f"the last good checkpoint (step {last_saved}) is kept in {out / CHECKPOINT}"
        )
        summary["error"] = f"{failure}; {kept}"
        if status == "failed" and last_saved is not None:
            summary["error"] += f"; make room, then continue with --resume --out {out}"
    if ranks.rank == 0:
        (out / "summary.json").write_text(report.to_json(summary, indent=1))
    return summary


SAMPLE_FILE = "sample.txt"  # in --out: a prompt from the validation data and its continuation
SAMPLE_BYTES = 200
SAMPLE_TEMPERATURE = 0.8


def end_of_run(run: Run, status: str, out: Path) -> dict[str, Any]:
    """What the summary adds at the end: the baselines, the final validation loss, each
    group's sizes, hyperparameters and norms, and (of a finished run) a sample of text.

    All ranks call it (the norms and the sample are collectives); the parts read from the
    log (final validation loss, last gradient norms) and the sample are rank 0's only.
    """
    rows = report.read_log(out) if run.ranks.rank == 0 else []
    extra: dict[str, Any] = {
        "baselines": baselines(run),
        "val_loss": next((r["val_loss"] for r in reversed(rows) if "val_loss" in r), None),
        "groups": group_summary(run, rows[-1] if rows else {}),
    }
    if status == "finished":
        written = sample(run)
        if written is not None:
            (out / SAMPLE_FILE).write_text(written["text"])
            extra["sample"] = written
    return extra


def baselines(run: Run) -> dict[str, float]:
    """Cross-entropies (nats/byte) a model must beat: guessing every byte uniformly, and a
    byte-bigram table counted on the training data (add-one smoothing)."""
    return {
        "uniform": math.log(run.model_config.vocab_size),
        "bigram": corpus.bigram_loss(run.train_data, run.val_data),
    }


def group_summary(run: Run, last_row: dict[str, Any]) -> list[dict[str, Any]]:
    """Per param group: tensors, elements, weight decay, LR now, the gradient norm of the
    last step (``last_row``'s) and the weight norm now. A collective when sharded."""
    groups = run.optimizer.param_groups
    tensors, elements, squares = [0] * len(groups), [0] * len(groups), [0.0] * len(groups)
    if run.sharded is not None:
        group_of = run.sharded.groupshard.groups.group_of()
        for entry in gs.norm_report(run.sharded):
            index = group_of.get(entry["name"])
            if index is not None:  # not frozen
                tensors[index] += 1
                elements[index] += entry["numel"]
                squares[index] += entry["param_norm"] ** 2
    else:  # ZeRO: every rank holds every parameter
        for index, group in enumerate(groups):
            tensors[index] = len(group["params"])
            elements[index] = sum(p.numel() for p in group["params"])
            squares[index] = sum(float(p.detach().norm()) ** 2 for p in group["params"])
    return [
        {
            "group": name,
            "tensors": tensors[index],
            "elements": elements[index],
            "weight_decay": group["weight_decay"],
            "lr": group["lr"],
            "grad_norm": last_row.get(f"grad_norm/{name}"),
            "weight_norm": math.sqrt(squares[index]),
        }
        for index, (name, group) in enumerate(zip(run.group_names, groups, strict=True))
    ]


def sample(run: Run, new_bytes: int = SAMPLE_BYTES) -> dict[str, Any] | None:
    """A prompt from the validation data and ``new_bytes`` the model writes after it: the
    text and both lengths (rank 0; None on the others, which only help gather parameters)."""
    if run.sharded is None:
        return _generate(run, run.model.module, new_bytes) if run.ranks.rank == 0 else None
    if run.config.tp > 1:
        # summon_full_params is not built for a TP'd model, whose forwards would each gather
        # over dp and reduce over tp on every rank (200 of them took 9 s of a 4-process run on
        # 2 cores): rank 0 writes with the whole weights, gathered once, in a plain copy
        whole = gs.full_state_dict(run.sharded, rank0_only=True)
        if not whole:
            return None
        plain = GPT(run.model_config).to(run.device)
        plain.load_state_dict(whole)
        return _generate(run, plain, new_bytes)
    with run.sharded.summon_full_params():  # forward runs locally inside: no collectives
        return _generate(run, run.sharded, new_bytes) if run.ranks.rank == 0 else None


def _generate(run: Run, model: Any, new_bytes: int) -> dict[str, Any]:
    prompt = _prompt(run.val_data, run.model_config.block_size // 2)
    generator = torch.Generator(device=run.device).manual_seed(run.config.seed)
    tokens = model.generate(prompt[None], new_bytes, SAMPLE_TEMPERATURE, generator)
    text = bytes(tokens[0].tolist()).decode("utf-8", errors="replace")
    return {"text": text, "prompt_bytes": len(prompt), "new_bytes": new_bytes}


def _prompt(data: torch.Tensor, length: int) -> torch.Tensor:
    """``length`` bytes of ``data`` from the first line that starts a function (else the
    first line): a prompt the reader can judge the continuation of."""
    head = data[: 2**16].to("cpu", torch.uint8).numpy().tobytes()
    start = next((head.find(m) + 1 for m in (b"\ndef ", b"\n") if head.find(m) >= 0), 0)
    start = min(start, max(0, len(data) - length))
    return data[start : start + length]


def _agreed(flag: bool, ranks: comm.Ranks) -> bool:
    """Whether ``flag`` is set on any rank (one all-reduce)."""
    value = torch.tensor(float(flag))
    comm.all_reduce_max(value, ranks)
    return bool(value.item())


def _agreed_signal(stop: StopFlag, ranks: comm.Ranks) -> str:
    """The name of the signal that stopped the run: SIGTERM if any rank got one, else
    SIGINT (one all-reduce)."""
    value = torch.tensor(float(stop.signum))
    comm.all_reduce_max(value, ranks)
    return signal.Signals(int(value.item()) or signal.SIGINT).name


def _progress(total: int, initial: int, enabled: bool, file: TextIO | None) -> Any:
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())  # a process lock would be reported leaked after a kill
    return tqdm(
        total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True,
        file=file,
    )  # fmt: skip


@record  # under torchrun, the launcher's error file then carries the real exception
def worker(
    config: TrainConfig, log_file: str | None = None, stop_event: Any = None
) -> dict[str, Any]:
    """Entry point of a launched worker: join the group (env://), train, leave.

    Returns the run's summary. With ``log_file`` (given by ``groupshard train``'s own launcher)
    this process's stderr goes to that file, all but the progress bar; ``stop_event`` (a
    multiprocessing Event, from the same launcher) asks it to stop as Ctrl-C does.
    """
    stop = StopFlag(stop_event)  # first: from here on a Ctrl-C is a request, not an exception
    progress_file = _stderr_to(log_file) if log_file is not None else None
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=config.timeout)
    dist.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo", timeout=timeout, **_restart_store(timeout)
    )
    try:
        summary = train(config, progress_file, stop)
        if dist.get_rank() == 0 and summary["step"]:  # else nothing to plot or show
            report.finish(Path(config.out), summary)
        return summary
    except Exception as error:
        if any(text in str(error) for text in PEER_GONE):
            # a consequence of a peer's death (killed, out of memory): the launcher reports
            # the first worker it sees fail, so let it see that one first
            time.sleep(PEER_GONE_GRACE)
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # torch's error file records only Exceptions: not DCP's
        cause = root_cause(error)
        raise (cause if isinstance(cause, Exception) else RuntimeError(describe(cause))) from error
    finally:
        dist.destroy_process_group()


def _restart_store(timeout: datetime.timedelta) -> dict[str, Any]:
    """``init_process_group``'s store for workers that torchrun restarted on one node: its
    store, under a prefix of its own for each restart (else none: env://, as usual).

    torchrun (torch 2.13, the c10d rendezvous) keeps the store of the first start for every
    restart, with the keys the workers it stopped wrote in it: a restarted worker can read a
    dead one's address and fail to connect (gloo: "Connection refused"). The restart count
    tells the rounds apart on one node only: across nodes it is counted per node."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if restart == 0 or not shared or os.environ.get("GROUP_WORLD_SIZE") != "1":
        return {}
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    return {
        "store": dist.PrefixStore(f"groupshard/restart-{restart}", store),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }


def _stderr_to(log_file: str) -> TextIO:
    """Send this process's stderr (warnings, tracebacks, C++ logs) to the end of ``log_file``;
    return a stream on the former stderr (the terminal), for the progress bar."""
    sys.stderr.flush()
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    log = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 2)
    os.close(log)
    return terminal
