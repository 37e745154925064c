"""One rank of a simulated world (torch's ``fake`` backend: collectives do nothing), for
tests/test_scale.py:

    python tests/scale_case.py WORLD [REPLICAS]

Shards a meta-built GPT (``full``, ``Block`` units; on a REPLICAS x WORLD/REPLICAS mesh when
given), steps AdamW, regroups, builds and steps Muon and WholeParamOptimizer, and prints
JSON: the seconds of each part, the peak RSS, and how many times objects were gathered over
the world (every rank receiving every rank's pickle: O(world) per rank).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import groupshard as gs
from groupshard.cli.model import GPT, Block, GPTConfig
from groupshard.mesh import MESH_DIM_NAMES

CONFIG = GPTConfig(vocab_size=1024, block_size=64, n_layer=4, n_head=4, n_embd=128)


def main() -> None:
    world = int(sys.argv[1])
    replicas = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    gathers = {"count": 0}
    original = dist.all_gather_object

    def counted(*args: Any, **kwargs: Any) -> Any:
        gathers["count"] += 1
        return original(*args, **kwargs)

    dist.all_gather_object = counted
    mesh = None
    if replicas > 1:
        mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=MESH_DIM_NAMES)
    seconds: dict[str, float] = {}
    ids = torch.randint(0, CONFIG.vocab_size, (1, 33))

    def timed(name: str, function: Any) -> Any:
        started = time.perf_counter()
        value = function()
        seconds[name] = time.perf_counter() - started
        return value

    def train_step(model: Any, optimizer: torch.optim.Optimizer) -> None:
        model(ids[:, :-1], ids[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()

    with torch.device("meta"):
        meta = GPT(CONFIG)
    model = timed(
        "shard", lambda: gs.shard(meta, gs.decay_groups(meta, 0.1), unit=Block, mesh=mesh)
    )
    adamw = torch.optim.AdamW(model.optimizer_groups(), lr=1e-3)
    timed("adamw_step", lambda: train_step(model, adamw))
    originals = list(model.groupshard.original_params.values())
    groups = [{"params": originals[:2], "lr": 1e-4}, {"params": originals[2:]}]
    timed("regroup", lambda: gs.regroup(model, adamw, groups))

    with torch.device("meta"):
        meta = GPT(CONFIG)
    model = gs.shard(meta, gs.muon_groups(meta), unit=Block, mesh=mesh)
    muon = timed("muon_construction", lambda: gs.optim.Muon(model.optimizer_groups()))
    timed("muon_step", lambda: train_step(model, muon))

    with torch.device("meta"):
        meta = GPT(CONFIG)
    model = gs.shard(meta, gs.decay_groups(meta, 0.1), unit=Block, mesh=mesh)
    whole = timed("whole_construction", lambda: gs.optim.WholeParamOptimizer(
        model.optimizer_groups(), torch.optim.Adafactor, lr=1e-2))  # fmt: skip
    timed("whole_step", lambda: train_step(model, whole))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "peak_rss": peak, "gathers": gathers["count"]}))


if __name__ == "__main__":
    main()
