"""``groupshard train``: parse, check, launch the workers through torch's elastic launcher.

Parsing needs no torch: ``--help`` and a mistyped option answer at once, and torch (seconds to
import) is imported only once the arguments are known to be good.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import logging
import math
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from groupshard.cli import DEFAULT_LRS, MODEL_SIZES, OPTIMIZERS, PRECISIONS

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from groupshard.cli.config import TrainConfig

LAUNCHER_LOG = "launcher.log"  # in --out: the launcher's and the workers' logs
WORKER_MODULE = "groupshard.cli.train"  # what the workers run, imported before they fork
# seconds: far above what a healthy rank waits for another here (a step, a checkpoint), far
# below torch's defaults (30 min on gloo, 10 on NCCL) that would leave a hung run silent
DEFAULT_TIMEOUT = 300.0
DEFAULT_PRECISION = "fp32"  # see --precision's help
DEFAULT_LOSS_SCALE = 2.0**16  # torch.amp.GradScaler's init_scale


class CommandError(Exception):
    """A problem with the user's input: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad option is one line on stderr (no usage block), exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, but none for flags and options without one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _finite_float(text: str) -> float:
    """argparse type: a finite number (``float`` would also take ``inf`` and ``nan``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="groupshard", description="Sharded training with param groups.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = commands.add_parser(
        "train",
        help="train a small GPT on text (default: the Python standard library's source)",
        description="Train a GPT-style byte-level model with groupshard. Without torchrun it "
        "starts --nproc local worker processes itself; under torchrun it is one worker.",
        formatter_class=_HelpFormatter,
    )
    train.add_argument(
        "--data",
        help="a text file or a folder of text files (default: the Python standard library's "
        "source)",
    )
    train.add_argument("--model", choices=MODEL_SIZES, default="tiny", help="size preset")
    train.add_argument("--steps", type=int, default=1500, help="optimizer steps")
    train.add_argument(
        "--batch-size", type=int, default=8,
        help="sequences per rank and micro-batch (see --grad-accum)",
    )  # fmt: skip
    train.add_argument(
        "--grad-accum", type=int, default=1, metavar="K",
        help="micro-batches per rank and optimizer step, their losses averaged; the first K-1 "
        "backwards keep their gradients locally (no communication). Each step's global batch "
        "is --batch-size x K x processes (the world size) sequences",
    )  # fmt: skip
    train.add_argument(
        "--precision", choices=PRECISIONS, default=DEFAULT_PRECISION,
        help="bf16: units gathered and computed in bfloat16, gradients reduced in float32 "
        "into the float32 shards the optimizer steps (the loss in float32 either way); fp16: "
        "the same in float16, with a loss scaler (gs.GradScaler) that skips a step whose "
        "gradients overflow on any rank and halves its scale; not with --zero. fp32 is the "
        "default as bf16 was slower for the default run "
        "on a 2-core CPU with AVX512-BF16 (CPU bf16 speed depends on AVX512-BF16/AMX "
        "support and on the model's sizes)",
    )  # fmt: skip
    train.add_argument(
        "--loss-scale", type=_finite_float, default=None, metavar="S",
        help="with --precision fp16: the loss scale to start from (default: 65536, torch's); "
        "halved at each step whose gradients overflow, doubled after 2000 steps without; a "
        "resumed run continues from its checkpoint's",
    )  # fmt: skip
    train.add_argument(
        "--init", choices=("meta", "full"), default=None,
        help="meta (the default without --zero): build the model on the meta device and let "
        "gs.shard initialize it unit by unit, each rank holding only its shards; full: build "
        "it whole on every rank first (the default, and the only choice, with --zero)",
    )  # fmt: skip
    train.add_argument(
        "--lr", type=_finite_float, default=None,
        help="peak learning rate (linear warm-up, cosine decay to a tenth); by default "
        "the --optimizer's own: " + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LRS.items()),
    )  # fmt: skip
    train.add_argument(
        "--weight-decay", type=_finite_float, default=0.1,
        help="decay of matrices; none on biases and norms",
    )  # fmt: skip
    train.add_argument(
        "--strategy", choices=["full", "grad_op", "no_shard"], default="full",
        help="ZeRO-3, ZeRO-2 or DDP-like",
    )  # fmt: skip
    train.add_argument(
        "--freeze-embeddings-until", type=int, default=0, metavar="STEP",
        help="fine-tuning's progressive unfreezing: the embeddings (wte, tied to the output "
        "layer, and wpe) stay frozen for the first STEP steps, then gs.regroup adds them as a "
        "param group of their own, the other groups keeping their optimizer state (the plot "
        "shows the group appearing); 0: trained from the start. Not with --zero",
    )  # fmt: skip
    train.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="optimizer")
    train.add_argument("--zero", action="store_true", help="DDP + the ZeRO-1 optimizer instead")
    train.add_argument("--nproc", type=int, default=2, help="local worker processes")
    train.add_argument(
        "--replicate", type=int, default=1, metavar="R",
        help="hybrid sharding: R replicas, each sharding the model over world size / R ranks "
        "(a 2-D mesh; docs/hybrid-sharding.md)",
    )  # fmt: skip
    train.add_argument(
        "--tp", type=int, default=1, metavar="N",
        help="tensor parallelism: each block's attention (by heads) and MLP and the tied "
        "embedding split over N ranks as torchtitan splits them, the model sharded over the "
        "other world size / N ranks; the global "
        "batch is --batch-size x --grad-accum x world size / N (docs/tensor-parallel.md)",
    )  # fmt: skip
    train.add_argument(
        "--hsdp", action="store_true",
        help="under torchrun on several nodes: shard within each node (LOCAL_WORLD_SIZE "
        "ranks), replicate across the nodes",
    )  # fmt: skip
    train.add_argument("--seed", type=int, default=0, help="seed of the model and the batches")
    train.add_argument("--out", help="output folder (default: runs/<time>)")
    train.add_argument(
        "--resume", action="store_true",
        help="continue from --out's checkpoint, up to a --steps above its step; the LR schedule "
        "stays the first run's (past its end, its final LR)",
    )  # fmt: skip
    train.add_argument(
        "--from", dest="start_from", metavar="CHECKPOINT",
        help="start from a checkpoint folder's weights and optimizer state: one written by "
        "gs.checkpoint, or with torch's idiom (get_state_dict + dcp.save) by FSDP2, DDP, one "
        "process or torchtitan, of the same --model; steps count from 0 and this run's "
        "options set the hyperparameters (a folder of weights only: the optimizer starts "
        "fresh; default: none, a fresh start)",
    )  # fmt: skip
    train.add_argument(
        "--ckpt-every", type=int, default=0, help="also save every N steps (0: at the end only)"
    )
    train.add_argument(
        "--async-checkpoint", action="store_true",
        help="write --ckpt-every's checkpoints in the background (gs.checkpoint.async_save): "
        "training goes on once each rank's part is copied to CPU memory; the last "
        "checkpoint, at the end or at a stop, is written in the foreground after the one in "
        "flight completes. Not with --zero",
    )  # fmt: skip
    train.add_argument(
        "--eval-every", type=int, default=0, help="validation every N steps (0: --steps / 5)"
    )
    train.add_argument(
        "--clip", type=_finite_float, default=1.0, help="gradient norm clip (0: off)"
    )
    train.add_argument(
        "--timeout", type=_finite_float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
        help="fail a collective that waits longer than this for another rank "
        "(a hung or stopped rank; default %(default)g)",
    )  # fmt: skip
    return parser


def _max_processes() -> int:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2 * (os.cpu_count() or 1)


def _cpu_cores() -> int:
    """The CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _oversubscribed(nproc: int) -> str | None:
    """A warning if ``nproc`` CPU workers are more than the cores they would run on (they then
    share cores: slower per token, as measured in docs/when-something-fails.md)."""
    import torch

    cores = _cpu_cores()
    if "WORLD_SIZE" in os.environ or torch.cuda.is_available() or nproc <= cores:
        return None
    return (
        f"--nproc {nproc} is more than the {cores} CPU core{'s' * (cores > 1)} here: the "
        "processes will share cores, which makes training slower per token (--nproc "
        f"{cores} or less avoids it)"
    )


def _check_hybrid(args: argparse.Namespace) -> None:
    """--replicate and --hsdp: a mesh that divides the world, with groupshard's sharding."""
    if args.replicate > 1 and args.hsdp:
        raise CommandError("--hsdp takes the replicas from torchrun's nodes; drop --replicate")
    if (args.replicate > 1 or args.hsdp) and args.zero:
        raise CommandError(
            "--replicate and --hsdp need groupshard's sharding (gs.shard on a 2-D mesh); "
            "drop --zero"
        )
    world = int(os.environ.get("WORLD_SIZE") or args.nproc)
    if world % args.replicate:
        raise CommandError(
            f"--replicate {args.replicate} must divide the world size ({world} processes)"
        )
    if args.tp == 1:
        return
    if world % args.tp:
        raise CommandError(f"--tp {args.tp} must divide the world size ({world} processes)")
    refused = [
        (args.zero, "--zero (DDP + the ZeRO-1 optimizer)"),
        (args.replicate > 1 or args.hsdp, "--replicate and --hsdp (a 3-D mesh)"),
        (args.freeze_embeddings_until, "--freeze-embeddings-until (gs.regroup)"),
        (args.optimizer == "adafactor", "--optimizer adafactor (its state is not shared over tp)"),
    ]
    for given, what in refused:
        if given:
            raise CommandError(f"--tp {args.tp} does not work with {what} yet; drop one of them")


def _check(args: argparse.Namespace) -> TrainConfig:
    """Validate everything that can be checked before starting workers: the options first,
    before torch is imported, then the machine, the data and ``--out``."""
    _check_options(args)
    return _check_run(args)


def _check_options(args: argparse.Namespace) -> None:
    """The options' numbers and combinations: what needs neither torch nor a file."""
    for name in ("steps", "batch_size", "grad_accum", "nproc", "replicate", "tp"):
        if getattr(args, name) < 1:
            raise CommandError(
                f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
            )
    if args.lr is None:
        args.lr = DEFAULT_LRS[args.optimizer]
    if not args.lr > 0:
        raise CommandError(f"--lr must be positive, got {args.lr}")
    for name in ("weight_decay", "clip"):
        if getattr(args, name) < 0:
            raise CommandError(
                f"--{name.replace('_', '-')} must be 0 or more, got {getattr(args, name)}"
            )
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        raise CommandError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.zero and args.init == "meta":
        raise CommandError(
            "--init meta needs groupshard's sharding; --zero (DDP + the ZeRO-1 optimizer) "
            "builds the whole model on every rank"
        )
    _check_hybrid(args)
    if args.freeze_embeddings_until < 0:
        raise CommandError(
            f"--freeze-embeddings-until must be 0 or more, got {args.freeze_embeddings_until}"
        )
    if args.zero and args.freeze_embeddings_until:
        raise CommandError(
            "--freeze-embeddings-until needs groupshard's sharding (gs.regroup); --zero (DDP + "
            "the ZeRO-1 optimizer) trains every group from the start"
        )
    if args.zero and args.optimizer == "adafactor":
        raise CommandError(
            "--optimizer adafactor steps whole parameters on owner ranks "
            "(gs.optim.WholeParamOptimizer over groupshard's shards); --zero's ZeRO-1 optimizer "
            "would hand Adafactor flat slices: leave out --zero"
        )
    if args.freeze_embeddings_until and args.optimizer in ("muon", "adafactor"):
        raise CommandError(
            "--freeze-embeddings-until works with --optimizer adamw, sgd, lamb or lars, not "
            f"{args.optimizer}: its groups (matrices apart) are not the decay / no-decay "
            "groups the embeddings join"
        )
    if args.loss_scale is not None and args.precision != "fp16":
        raise CommandError(f"--loss-scale needs --precision fp16, got --precision {args.precision}")
    if args.loss_scale is not None and not args.loss_scale > 0:
        raise CommandError(f"--loss-scale must be positive, got {args.loss_scale}")
    if args.zero and args.async_checkpoint:
        raise CommandError(
            "--async-checkpoint needs groupshard's sharding (gs.checkpoint.async_save); "
            "--zero saves a plain checkpoint on rank 0"
        )
    if args.zero and args.precision != "fp32":
        raise CommandError(
            f"--precision {args.precision} needs groupshard's sharding; --zero (DDP + the ZeRO-1 "
            "optimizer) trains in fp32 only"
        )


def _check_run(args: argparse.Namespace) -> TrainConfig:
    """The machine (processes), the data, the model's shapes and ``--out`` (a run to resume
    or not): the run's configuration."""
    import torch

    from groupshard.cli import data as corpus
    from groupshard.cli.config import CHECKPOINT, PRESETS, TrainConfig

    if "WORLD_SIZE" not in os.environ and args.nproc > _max_processes():
        raise CommandError(
            f"--nproc {args.nproc} is more than this machine can run sensibly ({_max_processes()}: "
            f"{'one per GPU' if torch.cuda.is_available() else 'two per CPU core'})"
        )
    try:
        files = corpus.corpus_files(args.data)
    except ValueError as error:
        raise CommandError(str(error)) from None
    preset = PRESETS[args.model]
    block = preset.block_size
    if preset.n_head % args.tp or (4 * preset.n_embd) % args.tp or preset.vocab_size % args.tp:
        raise CommandError(
            f"--tp {args.tp} must divide --model {args.model}'s heads ({preset.n_head}), MLP "
            f"width ({4 * preset.n_embd}) and vocabulary ({preset.vocab_size})"
        )
    if sum(f.stat().st_size for f in files) < 20 * (block + 1):
        raise CommandError(f"--data is too small for --model {args.model} (block size {block})")
    out = args.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
    checkpoint = Path(out) / CHECKPOINT
    # torchrun restarted the workers (--max-restarts) after one failed: continue from the
    # newest complete checkpoint if there is one, else start again
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    restarted = "WORLD_SIZE" in os.environ and restarts > 0
    resume = args.resume or (restarted and _has_checkpoint(checkpoint))
    config = TrainConfig(
        data=args.data, model=args.model, steps=args.steps, batch_size=args.batch_size,
        lr=args.lr, weight_decay=args.weight_decay, strategy=args.strategy,
        optimizer=args.optimizer, zero=args.zero, seed=args.seed, out=out, resume=resume,
        ckpt_every=args.ckpt_every, eval_every=args.eval_every, clip=args.clip,
        timeout=args.timeout, precision=args.precision, grad_accum=args.grad_accum,
        init=args.init or ("full" if args.zero else "meta"),
        replicate=_replicas(args), tp=args.tp, async_checkpoint=args.async_checkpoint,
        loss_scale=DEFAULT_LOSS_SCALE if args.loss_scale is None else args.loss_scale,
        freeze_embeddings_until=args.freeze_embeddings_until, start_from=args.start_from,
    )  # fmt: skip
    _check_out(out)
    if args.start_from is not None:
        if args.resume:
            raise CommandError("--from starts a new run; --resume continues one: pass one")
        from groupshard import checkpoint as gs_checkpoint

        if not gs_checkpoint.exists(args.start_from):
            raise CommandError(f"--from: no checkpoint at {args.start_from}")
    if resume:
        if not args.out:
            raise CommandError("--resume needs --out, the folder of the run to continue")
        config = _check_resumable(checkpoint, config, finished_is_fine=restarted)
    elif checkpoint.exists() and not restarted:
        raise CommandError(
            f"{out} already holds a run; pass --resume to continue it or choose another --out"
        )
    return config


def _replicas(args: argparse.Namespace) -> int:
    """``--replicate``; with ``--hsdp`` under torchrun, one replica per node."""
    if not args.hsdp:
        return args.replicate
    world = int(os.environ.get("WORLD_SIZE") or args.nproc)
    return world // int(os.environ.get("LOCAL_WORLD_SIZE") or world)


def _has_checkpoint(checkpoint: Path) -> bool:
    """Whether ``checkpoint`` holds one to resume (or a damaged one, for --resume to name)."""
    from groupshard import checkpoint as gs_checkpoint
    from groupshard.cli.config import ZERO_CHECKPOINT

    try:
        return gs_checkpoint.exists(checkpoint) or (checkpoint / ZERO_CHECKPOINT).exists()
    except gs_checkpoint.CheckpointError:
        return True


def _check_resumable(checkpoint: Path, config: TrainConfig, finished_is_fine: bool) -> TrainConfig:
    """The checkpoint exists and was written for the same model and optimizer (and, unless
    ``finished_is_fine``, before the last of ``config.steps``). Returns ``config`` with what a
    run takes from its checkpoint rather than its options: the attention's layout."""
    import torch

    from groupshard import checkpoint as gs_checkpoint
    from groupshard.cli.config import IDENTITY_BEFORE_RECORDED, ZERO_CHECKPOINT
    from groupshard.cli.train import describe

    zero_file = checkpoint / ZERO_CHECKPOINT
    sharded = gs_checkpoint.exists(checkpoint)  # also one an interrupted save left beside it
    if not sharded and not zero_file.exists():
        raise CommandError(
            f"--resume: no checkpoint in {checkpoint.parent}, so nothing to resume (the run "
            "stopped before saving one); start it again without --resume"
        )
    try:
        if sharded:
            extra = gs_checkpoint.read_extra(checkpoint)
        else:
            extra = torch.load(zero_file, weights_only=True)["extra"]
        saved, step = extra["config"], int(extra["step"])
    except Exception as error:
        source = checkpoint if sharded else zero_file
        raise CommandError(f"--resume: cannot read {source}: {describe(error)}") from None
    # a checkpoint from before a key was recorded was written with its value then
    saved = IDENTITY_BEFORE_RECORDED | saved
    config = dataclasses.replace(config, qkv_by_head=saved["qkv_by_head"])
    for key, value in config.identity().items():
        was = saved.get(key)
        if was != value:
            raise CommandError(
                f"--resume: the checkpoint in {checkpoint.parent} is from another run "
                f"(--{key.replace('_', '-')} {was}, not {value})"
            )
    if config.steps <= step and not finished_is_fine:
        raise CommandError(
            f"--resume: the run in {checkpoint.parent} is at step {step} already; pass a "
            f"--steps above {step} to train on"
        )
    return config


def _check_out(out: str) -> None:
    """``--out`` is a folder this process can write into, or can be made one: found here, in
    one line, rather than in a worker's first write."""
    path = Path(out)
    existing = path
    try:
        existing = next(folder for folder in (path, *path.parents) if folder.exists())
        if not existing.is_dir():
            where = "a file" if existing == path else f"under {existing}, a file"
            raise CommandError(f"--out {out} is {where}, not a folder; choose another --out")
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as error:  # also a folder on the way that this user may not enter
        raise CommandError(
            f"--out {out} is not writable ({existing}: {error.strerror}); choose another --out"
        ) from None


def _launch(config: TrainConfig, nproc: int, stop: _StopRequests) -> int:
    """Start ``nproc`` workers through torch's elastic launcher (as torchrun does), forked
    from the server ``_worker_server`` started; ``stop`` takes the signals meanwhile.

    The launcher's and the workers' logs go to ``--out``'s launcher.log; the terminal keeps
    the progress bar, the summary and, last, one line on the outcome.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    log_file = Path(config.out) / LAUNCHER_LOG
    with _log_to(log_file), tempfile.TemporaryDirectory(prefix="groupshard-") as error_files:
        launch = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
            rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
            start_method="forkserver", monitor_interval=0.2,
            logs_specs=DefaultLogsSpecs(log_dir=error_files),  # each worker's error.json
        )  # fmt: skip
        try:
            summaries = stop.run(elastic_launch(launch, _worker), config, str(log_file), stop.event)
        except ChildFailedError as error:
            if stop.forced:
                _interrupted(config.out, None, stop.signum)
                return 128 + stop.signum
            rank, cause = _blame(error)
            if "timeout" in cause.lower() and "timed out" not in cause.lower():
                # gloo's asynchronous collectives say "Application timeout caused pair
                # closure" where its synchronous ones say "Timed out waiting ..."
                cause += f" (a collective timed out after --timeout {config.timeout:g} s)"
            _error(f"worker {rank} failed: {cause} (logs in {log_file})")
            return 1
    return _outcome(summaries[0], signum=stop.signum)


@contextlib.contextmanager
def _worker_server() -> Iterator[None]:
    """Start the server the workers will fork from, now: it imports the training loop (and
    torch) while this process imports torch for its checks and torch's launcher, on another
    core. The workers fork from it rather than each importing torch anew as spawned ones do
    (on CPU, 4 workers start 3 s sooner); it imports no CUDA state, so forking from it is
    safe on GPUs too. Started with SIGINT and
    SIGTERM blocked, which the workers it forks inherit (``_StopRequests.run`` says why).

    Once the workers have ended, the server is killed: left to exit when this process does,
    it would spend about a second tearing its imports down while holding this command's
    stdout and stderr open, and whoever reads them to the end (a pipe, a CI log, a test)
    would wait for it."""
    import multiprocessing
    import multiprocessing.forkserver

    # the server and its pid are private to multiprocessing (3.9-3.13 keep them here);
    # without them the server still exits by itself, only later
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    running = getattr(server, "_forkserver_pid", None)  # one this process started earlier
    multiprocessing.set_forkserver_preload([WORKER_MODULE])
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _StopRequests.REQUESTS)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    try:
        yield
    finally:
        pid = getattr(server, "_forkserver_pid", None)
        if isinstance(pid, int) and pid != running:  # ours: not one main() found running
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # SIGTERM: blocked there, as said above
            with contextlib.suppress(OSError):
                server._stop()  # reaped, and forgotten: a later ensure_running starts anew


def _worker(config: TrainConfig, log_file: str, stop_event: Any) -> dict[str, Any]:
    """The launched workers' entry point: ``train.worker``, imported by the server they fork
    from, not by the launcher (0.4 s less before they start: it needs none of the loop's
    imports)."""
    from groupshard.cli.train import worker

    return worker(config, log_file, stop_event)


class _StopRequests:
    """The launcher's signals while its workers run. The first SIGINT (Ctrl-C) or SIGTERM asks
    the workers to stop (``event``): they agree on a step, save a checkpoint and return, and
    the launcher exits as soon as they have. Another one within ``SAME_REQUEST`` seconds is
    the same request delivered twice (``timeout``, as SLURM or Kubernetes may, signals the
    launcher and its whole process group); a later one, or SIGHUP or SIGQUIT, kills them.

    torch's launcher would instead stop the workers itself and wait 30 s for them to exit,
    while each finished worker waits for it to read the result; it registers its handlers only
    on the main thread, so ``run`` starts it on another thread and leaves the signals here.
    """

    REQUESTS = (signal.SIGINT, signal.SIGTERM)
    _KILL = (signal.SIGHUP, signal.SIGQUIT)
    SAME_REQUEST = 1.0  # seconds
    _clock = staticmethod(time.monotonic)

    def __init__(self) -> None:
        import multiprocessing

        # created here, on the main thread, as it starts multiprocessing's resource tracker,
        # which would unblock the signals of the thread that started it (see run)
        self.event = multiprocessing.get_context("spawn").Event()
        self.forced = False
        self.signum = 0  # the first signal received
        self._requested_at = 0.0
        self._saved: dict[int, Any] = {}

    def __enter__(self) -> _StopRequests:
        for sig in (*self.REQUESTS, *self._KILL):
            self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        now = self._clock()
        self.signum = self.signum or signum
        if signum in self.REQUESTS:
            if not self.event.is_set():
                self.event.set()
                self._requested_at = now
                return
            if now - self._requested_at < self.SAME_REQUEST:
                return
        self.forced = True
        self._kill_workers()

    def _kill_workers(self) -> None:
        import multiprocessing

        for child in multiprocessing.active_children():
            child.kill()

    def run(self, function: Any, *args: Any) -> Any:
        """``function(*args)`` on a thread that blocks SIGINT and SIGTERM: the workers it starts
        inherit the block, so a Ctrl-C while one still imports waits for its StopFlag instead
        of raising KeyboardInterrupt there (tracebacks, no checkpoint)."""
        outcome: dict[str, Any] = {}

        def target() -> None:
            signal.pthread_sigmask(signal.SIG_BLOCK, self.REQUESTS)
            try:
                outcome["value"] = function(*args)
            except BaseException as error:
                outcome["error"] = error

        thread = threading.Thread(target=target, name="groupshard-launcher")
        thread.start()
        while thread.is_alive():
            thread.join(0.1)  # returns to the main thread's signal handlers in between
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]


def _blame(error: ChildFailedError) -> tuple[int, str]:
    """The failed worker to blame, and why: the earliest one whose error file recorded an
    exception, else the earliest to fail (killed by a signal, or exited)."""
    rank, failure = min(
        error.failures.items(),
        key=lambda item: (not isinstance(item[1].message, dict), item[1].timestamp, item[0]),
    )
    message = failure.message
    if isinstance(message, dict):  # the error file of torch.distributed.elastic's @record
        message = message.get("message", "")
    return rank, " ".join(str(message).split()) or f"exit code {failure.exitcode}"


def _outcome(summary: dict[str, Any], show: bool = True, signum: int = 0) -> int:
    """The exit status of a run whose workers returned ``summary``; prints a failed run's
    error or an interrupted run's checkpoint (if ``show``). An interrupted run exits with
    128 + the signal that stopped it: ``signum`` (the launcher's), else the workers'."""
    if summary["status"] == "interrupted":
        signum = signum or signal.Signals[summary.get("signal", "SIGINT")]
        if show:
            _interrupted(summary["config"]["out"], summary["step"], signum)
        return 128 + signum
    if "error" not in summary:
        return 0
    if show:
        _error(summary["error"])
    return 1


def _interrupted(out: str, step: int | None, signum: int) -> None:
    """One line: where the run stopped (and by which signal, but for Ctrl-C's SIGINT), and
    its checkpoint if there is one."""
    from groupshard import checkpoint as gs_checkpoint
    from groupshard.cli.config import CHECKPOINT, ZERO_CHECKPOINT

    checkpoint = Path(out) / CHECKPOINT
    by = "" if signum in (0, signal.SIGINT) else f" by {signal.Signals(signum).name}"
    at = "" if step is None else f" at step {step}"
    if gs_checkpoint.exists(checkpoint) or (checkpoint / ZERO_CHECKPOINT).exists():
        then = f"checkpoint in {checkpoint}; continue with --resume --out {out}"
    else:
        then = "no checkpoint was saved, so there is nothing to resume"
    print(f"groupshard train: interrupted{by}{at}; {then}", file=sys.stderr, flush=True)


def _error(message: str) -> None:
    print(f"groupshard train: error: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _log_to(log_file: Path) -> Iterator[None]:
    """Send torch's launcher logging to ``log_file`` instead of the terminal."""
    handler = logging.FileHandler(log_file)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    names = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    loggers = [logging.getLogger(name) for name in names]
    saved = [(logger.propagate, logger.level) for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.propagate = False
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        for logger, (propagate, level) in zip(loggers, saved, strict=True):
            logger.removeHandler(handler)
            logger.propagate = propagate
            logger.setLevel(level)
        handler.close()


def run() -> NoReturn:
    """The command's entry point (``groupshard``, ``python -m groupshard``): ``main()``, then
    exit at once, the exit handlers run and the output flushed, without unloading torch's
    modules and libraries, which took the launcher about 0.4 s after its workers (and the
    server they forked from) had ended (a 1-step tiny run: 4.50 -> 4.08 s, A/B). Only the
    main thread is left by then (else the normal exit waits for the others); a caller of
    ``main()`` in its own process keeps its exit."""
    status = main()
    working = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if any(not thread.daemon for thread in working):
        sys.exit(status)  # a thread still at work: the normal exit waits for it
    atexit._run_exitfuncs()  # what a normal exit runs first (multiprocessing's children alike)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: as at a normal exit
            stream.flush()
    os._exit(status)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _train(args)
    except KeyboardInterrupt:  # before _launch handles Ctrl-C itself (while torch imports)
        print("groupshard train: interrupted before training started; nothing was saved",
              file=sys.stderr)  # fmt: skip
        return 130


def _train(args: argparse.Namespace) -> int:
    try:
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: one worker
            config = _check(args)
            Path(config.out).mkdir(parents=True, exist_ok=True)
            from groupshard.cli.train import worker

            return _outcome(worker(config), show=os.environ["RANK"] == "0")
        _check_options(args)
        # the server the workers fork from imports torch and the training loop while this
        # process imports torch for the checks below, on another core (a 1-step tiny run:
        # 1.1 s less than starting it after them); Ctrl-C is a stop request from here on
        with _StopRequests() as stop, _worker_server():
            config = _check_run(args)
            if stop.event.is_set():  # Ctrl-C while checking: no workers to start and stop
                _interrupted(config.out, None, stop.signum)
                return 128 + stop.signum
            Path(config.out).mkdir(parents=True, exist_ok=True)
            warning = _oversubscribed(args.nproc)
            if warning is not None:
                print(f"groupshard train: warning: {warning}", file=sys.stderr, flush=True)
            print(
                f"training {config.model} on {args.nproc} processes, outputs in {config.out}/",
                flush=True,
            )
            return _launch(config, args.nproc, stop)
    except CommandError as error:
        print(f"groupshard {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    run()
