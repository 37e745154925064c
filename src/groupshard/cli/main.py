"""``groupshard train``: parse, check, launch the workers through torch's elastic launcher."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import uuid
from pathlib import Path

import torch

from groupshard import checkpoint as gs_checkpoint
from groupshard.cli import data as corpus
from groupshard.cli.train import (
    CHECKPOINT,
    OPTIMIZERS,
    PRESETS,
    ZERO_CHECKPOINT,
    TrainConfig,
    worker,
)


class CommandError(Exception):
    """A problem with the user's input: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad option is one line on stderr (no usage block), exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="groupshard", description="Sharded training with param groups.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = commands.add_parser(
        "train",
        help="train a small GPT on text (default: the Python standard library's source)",
        description="Train a GPT-style byte-level model with groupshard. Without torchrun it "
        "starts --nproc local worker processes itself; under torchrun it is one worker.",
    )
    train.add_argument("--data", help="a text file or a folder of text files")
    train.add_argument("--model", choices=sorted(PRESETS), default="small", help="size preset")
    train.add_argument("--steps", type=int, default=300)
    train.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--weight-decay", type=float, default=0.1)
    train.add_argument("--strategy", choices=["full", "grad_op", "no_shard"], default="full")
    train.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    train.add_argument("--zero", action="store_true", help="DDP + the ZeRO-1 optimizer instead")
    train.add_argument("--nproc", type=int, default=2, help="local worker processes")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--out", help="output folder (default: runs/<time>)")
    train.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    train.add_argument("--ckpt-every", type=int, default=0, help="also save every N steps")
    train.add_argument("--eval-every", type=int, default=0, help="validation every N steps")
    train.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0: off)")
    return parser


def _max_processes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2 * (os.cpu_count() or 1)


def _check(args: argparse.Namespace) -> TrainConfig:
    """Validate everything that can be checked before starting workers."""
    for name in ("steps", "batch_size", "nproc"):
        if getattr(args, name) < 1:
            raise CommandError(
                f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
            )
    if not args.lr > 0:
        raise CommandError(f"--lr must be positive, got {args.lr}")
    if "WORLD_SIZE" not in os.environ and args.nproc > _max_processes():
        raise CommandError(
            f"--nproc {args.nproc} is more than this machine can run sensibly ({_max_processes()}: "
            f"{'one per GPU' if torch.cuda.is_available() else 'two per CPU core'})"
        )
    try:
        files = corpus.corpus_files(args.data)
    except ValueError as error:
        raise CommandError(str(error)) from None
    block = PRESETS[args.model].block_size
    if sum(f.stat().st_size for f in files) < 20 * (block + 1):
        raise CommandError(f"--data is too small for --model {args.model} (block size {block})")
    out = args.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
    config = TrainConfig(
        data=args.data, model=args.model, steps=args.steps, batch_size=args.batch_size,
        lr=args.lr, weight_decay=args.weight_decay, strategy=args.strategy,
        optimizer=args.optimizer, zero=args.zero, seed=args.seed, out=out, resume=args.resume,
        ckpt_every=args.ckpt_every, eval_every=args.eval_every, clip=args.clip,
    )  # fmt: skip
    checkpoint = Path(out) / CHECKPOINT
    if args.resume:
        if not args.out:
            raise CommandError("--resume needs --out, the folder of the run to continue")
        _check_resumable(checkpoint, config)
    elif checkpoint.exists():
        raise CommandError(
            f"{out} already holds a run; pass --resume to continue it or choose another --out"
        )
    return config


def _check_resumable(checkpoint: Path, config: TrainConfig) -> None:
    """The checkpoint exists and was written for the same model and optimizer."""
    zero_file = checkpoint / ZERO_CHECKPOINT
    if (checkpoint / gs_checkpoint.META_FILE).exists():
        saved = gs_checkpoint.read_extra(checkpoint)["config"]
    elif zero_file.exists():
        saved = torch.load(zero_file, weights_only=True)["extra"]["config"]
    else:
        raise CommandError(f"--resume: no checkpoint in {checkpoint.parent}")
    for key, value in config.identity().items():
        if saved.get(key) != value:
            raise CommandError(
                f"--resume: the checkpoint in {checkpoint.parent} is from another run "
                f"(--{key} {saved.get(key)}, not {value})"
            )


def _launch(config: TrainConfig, nproc: int) -> int:
    """Start ``nproc`` workers through torch's elastic launcher (as torchrun does)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    launch = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, start_method="spawn",
        monitor_interval=0.2,
    )  # fmt: skip
    try:
        elastic_launch(launch, worker)(config)
    except SignalException:
        print(f"interrupted; checkpoint in {config.out}/{CHECKPOINT}; continue with --resume "
              f"--out {config.out}", file=sys.stderr)  # fmt: skip
        return 130
    except ChildFailedError as error:
        rank, failure = next(iter(sorted(error.failures.items())))
        message = _last_line(failure.message) if isinstance(failure.message, str) else ""
        print(
            f"error: worker {rank} failed: {message or f'exit code {failure.exitcode}'}",
            file=sys.stderr,
        )
        return 1
    return 0


def _last_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = _check(args)
    except CommandError as error:
        print(f"groupshard {args.command}: error: {error}", file=sys.stderr)
        return 2
    Path(config.out).mkdir(parents=True, exist_ok=True)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: one worker
        worker(config)
        return 0
    print(
        f"training {config.model} on {args.nproc} processes, outputs in {config.out}/", flush=True
    )
    return _launch(config, args.nproc)


if __name__ == "__main__":
    sys.exit(main())
