"""A first, rough step-time comparison: groupshard "full" against FSDP2 ``fully_shard``.

Same model, same two param groups (decay / no decay), AdamW and LAMB (FSDP2 gets a
straightforward per-parameter LAMB on its DTensors), world size 2,
gloo on CPU, one thread per rank; the two systems are timed interleaved, round by
round, so machine noise hits both alike. Not the project benchmark (see the issue
on benchmarks): no memory or collective accounting here.

    python benchmarks/rough_step_time.py [--layers 4 --width 256 --seq 128 --batch 8]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import groupshard as gs
from groupshard.model import GPT, Block, GPTConfig


class PerParameterLAMB(torch.optim.Optimizer):
    """A straightforward LAMB, one tensor at a time (on DTensors each norm is a collective)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                state["m"].lerp_(p.grad, 1 - beta1)
                state["v"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat = state["m"] / (1 - beta1 ** state["step"])
                v_hat = state["v"] / (1 - beta2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = p.norm(), update.norm()
                if hasattr(w_norm, "full_tensor"):
                    w_norm, u_norm = w_norm.full_tensor(), u_norm.full_tensor()
                trust = (w_norm / u_norm).item() if w_norm > 0 and u_norm > 0 else 1.0
                p.add_(update, alpha=-group["lr"] * trust)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    started = time.perf_counter()
    model(batch[:, :-1], batch[:, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - started


OPTIMIZERS = {
    "AdamW": lambda groups: torch.optim.AdamW(groups, lr=1e-4),
    "LAMB": lambda groups: gs.optim.LAMB(groups, lr=1e-3),
    "per-parameter LAMB": lambda groups: PerParameterLAMB(groups, lr=1e-3),
}


def _systems(base: GPT) -> list[tuple[str, torch.nn.Module, torch.optim.Optimizer]]:
    systems = []
    for optimizer in ("AdamW", "LAMB"):
        model = copy.deepcopy(base)
        groups = gs.decay_groups(model, 0.1)
        model = gs.shard(model, groups, unit=Block, strategy="full")
        systems.append(
            (f"groupshard {optimizer}", model, OPTIMIZERS[optimizer](model.optimizer_groups()))
        )
    for optimizer in ("AdamW", "per-parameter LAMB"):
        model = copy.deepcopy(base)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        systems.append(
            (f"FSDP2 {optimizer}", model, OPTIMIZERS[optimizer](gs.decay_groups(model, 0.1)))
        )
    for name, zero_class in (
        ("groupshard ZeRO + DDP", gs.ZeroRedundancyOptimizer),
        ("torch ZeRO + DDP", ZeroRedundancyOptimizer),
    ):
        model = copy.deepcopy(base)
        groups = gs.decay_groups(model, 0.1)
        if zero_class is ZeroRedundancyOptimizer:  # torch's takes one group in its constructor
            optimizer = zero_class(
                groups[0]["params"],
                torch.optim.AdamW,
                lr=1e-4,
                weight_decay=0.1,
                parameters_as_bucket_view=True,
            )
            optimizer.add_param_group(groups[1])
        else:
            optimizer = zero_class(
                groups, torch.optim.AdamW, lr=1e-4, parameters_as_bucket_view=True
            )
        systems.append((name, DDP(model), optimizer))
    return systems


def _worker(rank: int, args: argparse.Namespace, store_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    torch.manual_seed(0)
    config = GPTConfig(256, args.seq, args.layers, 8, args.width)
    systems = _systems(GPT(config))
    batch = torch.randint(0, 256, (args.batch, args.seq + 1))
    times: dict[str, list[float]] = {name: [] for name, _, _ in systems}
    for round_index in range(args.warmup + args.rounds):
        for name, model, optimizer in systems:
            dist.barrier()
            elapsed = _step(model, optimizer, batch)
            if round_index >= args.warmup:
                times[name].append(elapsed)
    if rank == 0:
        parameters = sum(p.numel() for p in GPT(config).parameters())
        print(
            f"model: {parameters / 1e6:.1f}M parameters, {args.layers} blocks, d={args.width}, "
            f"2 x {args.batch} x {args.seq} tokens/step, world size 2, gloo, 1 thread/rank"
        )
        medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        for name, median in medians.items():
            print(
                f"{name:26s} median {median:7.1f} ms/step  ratio to FSDP2 AdamW "
                f"{median / medians['FSDP2 AdamW']:.2f}"
            )
        ours = medians["groupshard LAMB"] / medians["groupshard AdamW"]
        theirs = medians["FSDP2 per-parameter LAMB"] / medians["FSDP2 AdamW"]
        print(f"LAMB / AdamW: groupshard {ours:.2f}, FSDP2 {theirs:.2f}")
        zero = medians["groupshard ZeRO + DDP"] / medians["torch ZeRO + DDP"]
        print(f"ZeRO optimizers, groupshard / torch: {zero:.2f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker, args=(args, os.path.join(tmp, "store")), nprocs=2, start_method="spawn"
        )


if __name__ == "__main__":
    main()
