"""Fresh worker processes for a benchmark's rows, started quickly.

Each row runs in new processes, so that none inherits another's memory or threads. They
fork from a server that imported the benchmark script (and ``preload``) once:
multiprocessing's forkserver, whose server never runs torch, only imports it. A spawned
process would import torch anew, seconds per rank on a CPU, for every row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing as mp


def start_processes(
    worker: Callable[..., Any],
    args: tuple[Any, ...],
    nprocs: int,
    preload: Sequence[str] = (),
    join: bool = True,
) -> Any:
    """``torch.multiprocessing.start_processes(worker, args, nprocs, join=join)`` in
    processes forked from the server: ``worker`` is the benchmark script's (``__main__``,
    which the server imports) or ``preload``'s."""
    mp.set_forkserver_preload(["__main__", *preload])
    return mp.start_processes(
        worker, args=args, nprocs=nprocs, join=join, start_method="forkserver"
    )
