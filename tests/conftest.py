from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dist_pool import RankPool


@pytest.fixture(scope="session")
def run_ranks() -> Iterator[Callable[..., list[Any]]]:
    """``run_ranks(world_size, fn, *args)``: run ``fn(rank, world_size, *args)`` on gloo ranks."""
    pools: dict[int, RankPool] = {}

    def run(
        world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0
    ) -> list[Any]:
        pool = pools.setdefault(world_size, RankPool(world_size))
        return pool.run(fn, *args, timeout=timeout)

    yield run
    for pool in pools.values():
        pool.close()
