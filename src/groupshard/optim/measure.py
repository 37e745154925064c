"""The owner's work per parameter, timed on this machine: ``cost="measured"`` of
``gs.optim.WholeParamOptimizer``.

A cost by formula misses what the hardware adds: on a CPU, Adafactor's step over a
4096 x 256 matrix (4 MiB, past the cache) takes 2.7 times as long per element as over a
256 x 1024 one, and a 256-element vector costs 40 times its share (the per-tensor work
of a step). Here each distinct (param group, shape, dtype) is stepped by a fresh
instance of the optimizer class on a scratch tensor, a few times after warm-up; every
rank times every one, and the mean over the ranks (one all-reduce) is every rank's cost,
so the owners are the same everywhere. A few small collectives per process group
(failures, a digest of the keys, the timings), none growing with the world size, at
construction and at each ``add_param_group``; the scratch tensors and their state live
one at a time. Only steps that all do the same work are timed right: an optimizer with
periodic work (SOAP's and Shampoo's preconditioner updates every few steps) is timed without it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from groupshard import comm

Key = tuple[int, tuple[int, ...], torch.dtype]
"""(param-group index, shape, dtype) of the parameters that share a cost."""

WARMUP = 2  # steps before timing: the state is created at the first
REPEATS = 5  # timed steps; their median


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(
    optimizer_class: type[torch.optim.Optimizer],
    class_defaults: Mapping[str, Any],
    hyperparameters: Mapping[str, Any],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> float:
    """Seconds of one step of ``optimizer_class`` over one parameter of ``shape``: the
    median of ``REPEATS`` steps after ``WARMUP``, on random values and gradients from a
    private generator; the global random state is restored after (an optimizer may draw
    from it, e.g. for stochastic rounding)."""
    generator = torch.Generator(device=device).manual_seed(0)
    param = torch.nn.Parameter(torch.randn(shape, generator=generator, device=device).to(dtype))
    grad = torch.randn(shape, generator=generator, device=device).to(dtype)
    seconds = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        optimizer = optimizer_class([{**hyperparameters, "params": [param]}], **class_defaults)
        for _ in range(WARMUP + REPEATS):
            param.grad = grad.clone()
            _synchronize(device)
            started = time.perf_counter()
            optimizer.step()
            _synchronize(device)
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[WARMUP:])


def measured_costs(
    keys: Sequence[Key],
    timer: Callable[[Key], float],
    ranks: comm.Ranks,
    who: str,
) -> dict[Key, float]:
    """``timer(key)`` of every key on every rank, the mean over the ranks for each.

    Collective; a rank whose timing fails, or whose keys differ from rank 0's (other
    parameters), makes every rank raise, naming it.
    """
    error: BaseException | None = None
    seconds: list[float] = []
    try:
        seconds = [timer(key) for key in keys]
    except Exception as failure:  # e.g. the class refuses a shape: raise on every rank
        error = failure
    comm.raise_if_any_failed(error, ranks)
    gathered = comm.gather_if_different(list(keys), ranks)
    for rank, other in enumerate(gathered or []):
        if other != gathered[0]:
            raise ValueError(
                f"{who}: ranks hold different parameters to time: {gathered[0][:4]} on rank 0 "
                f"but {other[:4]} on rank {rank}; build the optimizer from the same param "
                "groups on every rank (model.optimizer_groups())."
            )
    # the mean over the ranks, one all-reduce: the same costs on every rank
    total = torch.tensor(seconds, dtype=torch.float64, device=comm.object_device(ranks))
    comm.all_reduce_sum(total, ranks)
    return {key: float(total[index]) / ranks.size for index, key in enumerate(keys)}
