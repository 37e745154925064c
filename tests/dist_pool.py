"""A pool of long-lived gloo ranks that runs test cases, with a deadline.

Starting ranks costs seconds on a small machine, so one pool per world size lives
for the whole test session. The parent waits with a deadline and kills every rank
on the first failure or time-out (a fresh pool is started for the next case), so
a hang fails the test instead of blocking CI.
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 30


class RankError(AssertionError):
    """A rank raised, died, or missed the deadline."""


def _worker(rank: int, world_size: int, store_path: str, tasks: Any, results: Any) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """``world_size`` ranks in a gloo group, started on first use."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._processes: list[Any] = []

    def _start(self) -> None:
        # forked from a server that imported torch and groupshard once (and never runs
        # them), not each importing them anew: a pool of 8 starts in seconds on 2 cores
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(["dist_pool", "groupshard"])
        self._tmpdir = tempfile.TemporaryDirectory(prefix="groupshard-pool-")
        store_path = os.path.join(self._tmpdir.name, "store")
        self._tasks = [context.Queue() for _ in range(self.world_size)]
        self._results = context.Queue()
        self._processes = [
            context.Process(
                target=_worker,
                args=(rank, self.world_size, store_path, self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for process in self._processes:
            process.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Start ``fn(rank, world_size, *args)`` on every rank without waiting for it (a test
        of a killed job then ends the ranks with ``close``)."""
        if not self._processes:
            self._start()
        for tasks in self._tasks:
            tasks.put((fn, args))

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on every rank; results in rank order."""
        self.submit(fn, *args)
        results: dict[int, Any] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while len(results) < self.world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            try:
                rank, ok, payload = self._results.get(timeout=max(0.1, min(remaining, 1.0)))
            except queue.Empty:
                dead = [p.pid for p in self._processes if not p.is_alive()]
                if dead or remaining <= 0:
                    self.close()
                    why = f"ranks died (pids {dead})" if dead else f"no result within {timeout} s"
                    raise RankError(
                        f"{fn.__name__} at world size {self.world_size}: {why}"
                    ) from None
                continue
            if not ok:
                self.close()
                raise RankError(f"rank {rank} of {self.world_size} failed:\n{payload}")
            results[rank] = payload
        return [results[rank] for rank in range(self.world_size)]

    def close(self) -> None:
        """Stop every rank at once (they may be stuck in a collective)."""
        for process in self._processes:
            if process.is_alive():
                process.kill()
        for process in self._processes:
            process.join(timeout=10)
        self._processes = []
