"""The project benchmark: the same training step, every system, interleaved in one run.

    python benchmarks/run.py [--model 4m|small-params|30m|tiny] [--world-size 2] [--rounds 10]
                             [--device cpu|cuda] [--rss] [--muon] [--compile] [--checkpointing]
                             [--rows REGEX|muon-only|compile-only|checkpoint-only]

Systems: DDP, torch ZeroRedundancyOptimizer + DDP, FSDP2 (``fully_shard`` per block
and root), FSDP1 (``use_orig_params``, per block), DeepSpeed ZeRO 1/2/3 (when
installed: ``pip install -e ".[bench]"``), groupshard full / grad_op / no_shard /
ZeRO + DDP / full with 8 groups, and LAMB: groupshard vs FSDP2 + per-parameter
LAMB. All get the same two groups (decay / no decay), AdamW unless named.

Muon (``--muon``; off by default, Newton-Schulz on every rank is slow on CPU): the hidden
matrices (``gs.muon_groups``: the blocks' 2-D weights) in Muon (lr 0.02, weight decay 0.1,
torch.optim.Muon's defaults otherwise), the rest in AdamW in the two groups above (lr 1e-3;
embeddings weight decay 0.1, vectors 0.0); each row is compared with one process doing
torch.optim.Muon + torch.optim.AdamW, its step time with "FSDP2 + torch Muon":
"DDP + torch Muon" (every rank orthogonalizes every matrix: the replicated baseline),
"torch ZeRO + DDP + Muon" (torch's ZeroRedundancyOptimizer with torch.optim.Muon, whole
matrices per rank by its greedy partition, and a second one with AdamW for the rest: both
ZeRO-sharded), "FSDP2 + torch Muon" (torch.optim.Muon straight on FSDP2's DTensors: it
accepts them, and DTensor dispatch redistributes inside Newton-Schulz, with collectives per
matrix and step), "FSDP2 + Muon, full_tensor per matrix" (torch.optim.Muon's math with one
``full_tensor()`` all-gather of each momentum-updated matrix, orthogonalized on every rank,
each keeping its own shard), "groupshard full + Muon" (``gs.shard`` + ``gs.optim.Muon``)
and "groupshard ZeRO + DDP + Muon" (``gs.ZeroRedundancyOptimizer(groups, gs.optim.Muon)`` +
DDP). Where DeepSpeed is installed, "DeepSpeed ZeRO-2 + Muon": DeepSpeed's own Muon
(``"type": "Muon"``, run inside its ZeRO-2 partitioning, its inline AdamW for the rest)
with the ``"standard"`` Newton-Schulz and torch's AdamW betas and eps; its result is not
torch.optim.Muon's, so the row is compared for speed, its difference reported but not
bounded. The Muon table adds each row's optimizer step over "DDP + torch Muon"'s, and each
system's step time with Muon over its AdamW row's (``--rows muon-only``: the Muon rows and
those AdamW rows alone).

Compiled (``--compile``; off by default, inductor's first compile takes a while on CPU):
"DDP, compiled", "FSDP2, compiled", "groupshard full, compiled" and "groupshard no_shard,
compiled" compile each block in place (``Block.compile()``, torch's default backend,
inductor) before DDP, ``fully_shard`` or ``gs.shard``; the root (embeddings, head, loss)
stays eager, as ``torch.compile`` of a whole groupshard model leaves it. The
warm-up steps take the compile; the ratio column is to "FSDP2, compiled", and each row's
eager row is the same name without ", compiled" (``--rows compile-only``: these rows and
their eager rows alone).

Activation checkpointing (``--checkpointing``): "FSDP2, checkpointed" and "groupshard full,
checkpointed" run each block's forward under non-reentrant ``torch.utils.checkpoint``
(recomputed in backward); ``--rows checkpoint-only --rss`` gives their step times and
peak RSS per rank beside the same systems without it.

Mixed precision and gradient accumulation: groupshard full, FSDP2 and DeepSpeed ZeRO-3 in
bf16 (gathered and computing in bf16, gradients reduced in fp32 into fp32 masters:
``gs.MixedPrecision`` / ``MixedPrecisionPolicy``; DeepSpeed's ``"bf16"`` with its own
defaults), and each of them (fp32 and bf16) with ``--micro-batches`` (4) micro-batches per
optimizer step, each as large as a normal step's batch: groupshard under ``no_sync()``
for all but the last, FSDP2 with ``set_requires_gradient_sync(False)`` for all but the
last, DeepSpeed with ``gradient_accumulation_steps``; "kept gathered" rows also keep units
gathered after all but the last backward (``set_reshard_after_backward(False)``). Their
ratio is to the FSDP2 row run the same way; step time is per optimizer step.

Per system: median step time after warm-up and its ratio to FSDP2, tokens/s, the
optimizer step alone, bytes of parameters + gradients + optimizer state held per
rank against the ideal (total / N) and the most unsharded parameter bytes held at
once (groupshard and FSDP2), collectives and bytes per step (the ``c10d::`` ops
torch.profiler records on a warm step), with ``--rss`` the peak RSS per rank (the
peak GPU memory on cuda; each system again in fresh processes, so peaks are its
own), and the largest parameter difference from single-process training after the
run: on the global batch (every rank's micro-batches) in fp32, and for fp32 accumulation
rows also from one process summing the micro-batches in the ranks' order; for bf16 rows
from one process doing the same casts (a bf16 copy computes each rank's micro-batches,
gradients summed and averaged in fp32, fp32 masters step) and, for scale, from the fp32
run. The bf16 and accumulation rows add gathered and reduced bytes apart, reduce-scatters per
optimizer step and the unsharded gradient bytes held while accumulating (after the
next-to-last micro-batch's backward). Before the ranks start, one process times the
model's forward + backward and its matmuls in fp32 and bf16 (one thread, as each rank):
is bf16 faster here? Output: tables and a JSON file.

On CPU the ranks talk over gloo with one thread each; with ``--device cuda`` (the
default where there are 2 or more GPUs) each rank takes one GPU and NCCL. gloo
carries out a reduce-scatter as a full all-reduce, so on CPU every sharded system
pays more for gradients than it would over NCCL.

Code: this file is the driver (timing, measuring, references, tables); one adapter per
system in ``benchmarks/systems/`` (``System`` in ``base.py``), the rows in ``rows.py``, the
optimizers and parameter groups in ``optimizers.py``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import re
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from unittest import mock

import fresh
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from optimizers import LR, adamw, decay_groups, muon_groups, torch_muon
from rows import CHECKPOINT_ROWS, COMPILE_ROWS, MICRO_BATCHES, MUON_PARTNERS, MUON_ROWS, systems
from systems import System, device, unique_bytes
from torch import nn

import groupshard as gs
from groupshard.cli.model import GPT, GPTConfig

MODELS = {
    "4m": (GPTConfig(vocab_size=4096, block_size=128, n_layer=4, n_head=8, n_embd=256), 8),
    "small-params": (GPTConfig(vocab_size=256, block_size=64, n_layer=16, n_head=4, n_embd=64), 8),
    "30m": (GPTConfig(vocab_size=8192, block_size=256, n_layer=8, n_head=8, n_embd=512), 4),
    "tiny": (GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32), 2),
}


# --- measuring ---------------------------------------------------------------------------


def _batches(config: GPTConfig, batch: int, world_size: int, count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    shape = (batch * world_size, config.block_size + 1)
    return [torch.randint(0, config.vocab_size, shape, generator=generator) for _ in range(count)]


def _now() -> float:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def _step(
    system: System,
    model: Any,
    optimizer: Any,
    micro_batches: list[torch.Tensor],
    after_backward: Callable[[int], None] | None = None,
) -> tuple[float, float]:
    """One optimizer step over ``micro_batches`` (``system.micro_batches`` of them, gradients
    synced on the last); returns (total seconds, optimizer seconds). ``after_backward(i)``
    runs after micro-batch ``i``'s backward."""
    started = _now()
    for index, tokens in enumerate(micro_batches):
        with system.micro_batch(model, last=index == len(micro_batches) - 1):
            loss = model(tokens[:, :-1], tokens[:, 1:])
            system.backward(model, loss)
        if after_backward is not None:
            after_backward(index)
    optimizer_started = _now()
    system.optimizer_step(model, optimizer)
    finished = _now()
    return finished - started, finished - optimizer_started


def _held_bytes(
    system: System, model: Any, optimizer: Any, micro_batches: list[torch.Tensor]
) -> dict[str, int | None]:
    """Bytes of parameters, gradients and optimizer state this rank holds at the end of the
    last backward, the most unsharded parameter bytes held at once during the step, and,
    with accumulation, the unsharded gradient bytes held after the next-to-last backward."""
    count = len(micro_batches)
    held: dict[str, int | None] = {"accumulated_grads": None}

    def measure(index: int) -> None:
        if count > 1 and index == count - 2:
            held["accumulated_grads"] = system.accumulated_grad_bytes(model)
        if index == count - 1:
            tensors = system.held_tensors(model, optimizer)
            held.update({key: unique_bytes(kind) for key, kind in tensors.items()})

    with system.gathered_peak(model) as gathered_peak:
        _step(system, model, optimizer, micro_batches, measure)
        held["gathered_peak"] = gathered_peak()
    return held


def _groupshard_volume() -> tuple[dict[str, Any], dict[str, float], dict[str, int], dict[str, int]]:
    """Patches for groupshard's comm functions that add up the bytes each rank moves, per
    function, with the ideal algorithm for each collective: (N-1)/N of the gathered or
    scattered buffer (in its own dtype: bf16 gathers count 2 bytes an element), twice that
    for an all-reduce, the chunks sent to other ranks for an all-to-all; and how many times
    each runs; and ``held["all_to_all_buffers"]``: the largest send + receive buffers of one
    all-to-all (gs.optim.Muon's, reused for the way back), not counted in the bytes."""
    from groupshard import comm

    moved: dict[str, float] = {}
    calls: dict[str, int] = {}

    def counting(name: str, factor: float, which: int) -> Any:
        original = getattr(comm, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            tensor = args[which]
            ranks = next(a for a in (*args, *kwargs.values()) if isinstance(a, comm.Ranks))
            moved[name] = moved.get(name, 0.0) + (
                factor * tensor.numel() * tensor.element_size() * (ranks.size - 1) / ranks.size
            )
            calls[name] = calls.get(name, 0) + 1
            return original(*args, **kwargs)

        return wrapper

    original_all_to_all = comm.all_to_all

    def all_to_all(output: torch.Tensor, source: torch.Tensor, output_splits: Any,
                   input_splits: Any, ranks: Any, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        sent = sum(n for rank, n in enumerate(input_splits) if rank != ranks.rank)
        moved["all_to_all"] = moved.get("all_to_all", 0.0) + sent * source.element_size()
        calls["all_to_all"] = calls.get("all_to_all", 0) + 1
        buffers = source.numel() * source.element_size() + output.numel() * output.element_size()
        held["all_to_all_buffers"] = max(held.get("all_to_all_buffers", 0), buffers)
        return original_all_to_all(output, source, output_splits, input_splits, ranks, *args,
                                   **kwargs)  # fmt: skip

    held: dict[str, int] = {}
    patches = {
        "all_to_all": all_to_all,
        "all_gather": counting("all_gather", 1.0, 0),
        "reduce_scatter_mean": counting("reduce_scatter_mean", 1.0, 1),
        "all_reduce_mean": counting("all_reduce_mean", 2.0, 0),
        "all_reduce_sum": counting("all_reduce_sum", 2.0, 0),
    }
    return patches, moved, calls, held


SIZED_OPS = {"c10d::_allgather_base_": 0, "c10d::_reduce_scatter_base_": 1}
"""c10d ops whose sizes torch.profiler records: index of the whole (unsharded) buffer
among their inputs. Ops on tensor lists (all-reduce, broadcast) record no shapes."""

DTYPE_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2}
"""Element sizes of the dtype names torch.profiler records."""


def _profiled_bytes(events: list[Any], world_size: int, element_size: int) -> float | None:
    """Bytes per rank the recorded c10d ops move with ideal algorithms ((N-1)/N of each
    gathered or scattered buffer, in the dtype the profiler records, else
    ``element_size``), or None when some op recorded no sizes."""
    moved = 0.0
    for event in events:
        whole = SIZED_OPS.get(event.name)
        if whole is None or not event.input_shapes[whole]:
            return None
        numel = 1
        for dim in event.input_shapes[whole]:
            numel *= dim
        dtypes = getattr(event, "input_dtypes", None) or []
        size = DTYPE_BYTES.get(dtypes[whole], element_size) if len(dtypes) > whole else element_size
        moved += numel * size * (world_size - 1) / world_size
    return moved


@dataclass(frozen=True)
class _Op:
    name: str
    input_shapes: list[list[int]]
    input_dtypes: list[str]


def _c10d_events(prof: Any) -> list[Any]:
    """The profiled ``c10d::`` ops but barriers, read from the raw Kineto events (building
    torch's FunctionEvent tree of every op is slow on an accumulation step)."""
    try:
        raw = [(e.name(), e.shapes(), e.dtypes()) for e in prof.profiler.kineto_results.events()]
    except AttributeError:  # another torch: the public, slower way
        raw = [(e.name, e.input_shapes, getattr(e, "input_dtypes", None) or [])
               for e in prof.events()]  # fmt: skip
    return [
        _Op(name, shapes, dtypes)
        for name, shapes, dtypes in raw
        if name.startswith("c10d::") and not name.startswith("c10d::barrier")
    ]


def _collectives(
    system: System, model: Any, optimizer: Any, micro_batches: list[torch.Tensor]
) -> dict[str, Any]:
    """The c10d ops of one warm optimizer step (all its micro-batches), as torch.profiler
    records them, and the bytes moved per rank: for groupshard counted in its comm
    functions, for others from the sizes the profiler records (all-gather and
    reduce-scatter only; None otherwise). Also apart: gathered bytes, reduced bytes and
    the number of gradient reduce-scatters (groupshard: its ``reduce_scatter_mean`` calls,
    which gloo runs as all-reduces; others: the profiled reduce-scatters)."""
    from torch.profiler import ProfilerActivity, profile

    from groupshard import comm

    patches, moved, calls, held = _groupshard_volume()
    with (
        mock.patch.multiple(comm, **patches),
        profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof,
    ):
        _step(system, model, optimizer, micro_batches)
    events = _c10d_events(prof)
    ops: dict[str, int] = {}
    for event in events:
        ops[event.name] = ops.get(event.name, 0) + 1
    element_size = next(iter(model.parameters())).element_size()
    world_size = dist.get_world_size()
    result = {"count": len(events), "ops": ops, "groupshard_bytes": sum(moved.values()) or None,
              "profiled_bytes": _profiled_bytes(events, world_size, element_size)}  # fmt: skip
    if system.collectives_in_comm:
        result["gather_bytes"] = moved.get("all_gather", 0.0)
        result["reduce_bytes"] = moved.get("reduce_scatter_mean", 0.0) + moved.get(
            "all_reduce_mean", 0.0
        )
        result["reduce_scatters"] = calls.get("reduce_scatter_mean", 0)
    if calls.get("all_to_all"):  # gs.optim.Muon's exchanges
        result["all_to_alls"] = calls["all_to_all"]
        result["all_to_all_bytes"] = moved["all_to_all"]
        result["all_to_all_buffer_bytes"] = held["all_to_all_buffers"]
    if not system.collectives_in_comm:
        # None where some op of the kind recorded no sizes (all-reduces, list all-gathers)
        for key, kinds in (("gather_bytes", ("allgather",)),
                           ("reduce_bytes", ("reduce_scatter", "allreduce"))):  # fmt: skip
            chosen = [event for event in events if any(kind in event.name for kind in kinds)]
            result[key] = _profiled_bytes(chosen, world_size, element_size)
        result["reduce_scatters"] = sum(
            count for op, count in ops.items() if "reduce_scatter" in op
        )
    return result


def _add(total: list[torch.Tensor], more: list[torch.Tensor]) -> list[torch.Tensor]:
    """``total`` + ``more`` element-wise, in place (``more`` itself while ``total`` is empty)."""
    return [a.add_(b) for a, b in zip(total, more, strict=True)] if total else more


def _reference(
    base: nn.Module,
    batches: list[torch.Tensor],
    lamb: bool = False,
    bf16: bool = False,
    world_size: int = 1,
    micro_batches: int = 1,
    same_order: bool = False,
    muon: bool = False,
) -> dict[str, torch.Tensor]:
    """Single-process training on each step's global batch (every rank's micro-batches),
    with AdamW, LAMB or (``muon``) torch.optim.Muon + torch.optim.AdamW.

    fp32: one backward on the whole global batch. bf16 (or ``same_order``): what the
    sharded runs compute, in their order: a bf16 (fp32) copy of the fp32 masters computes
    each rank's micro-batches (rank-major, as the ranks take them), each micro-batch's
    gradient is summed in fp32 per rank, the ranks' sums are averaged in fp32, and the
    fp32 masters step.
    """
    model = copy.deepcopy(base)
    groups = decay_groups(model)
    optimizer: Any = gs.optim.LAMB(groups, lr=LR) if lamb else adamw(groups)
    if muon:
        optimizer = torch_muon(muon_groups(model))
    compute = None
    if bf16 or same_order:
        compute = copy.deepcopy(base).to(torch.bfloat16 if bf16 else torch.float32)
    for tokens in batches:
        if compute is None:
            model(tokens[:, :-1], tokens[:, 1:]).backward()
        else:
            with torch.no_grad():
                for low, master in zip(compute.parameters(), model.parameters(), strict=True):
                    low.copy_(master)
            summed: list[torch.Tensor] = []
            for rank_tokens in tokens.chunk(world_size):
                local: list[torch.Tensor] = []
                for micro in rank_tokens.chunk(micro_batches):
                    loss = compute(micro[:, :-1], micro[:, 1:])
                    (loss / micro_batches if micro_batches > 1 else loss).backward()
                    grads = [p.grad.float() for p in compute.parameters()]
                    compute.zero_grad(set_to_none=True)
                    local = _add(local, grads)
                summed = _add(summed, local)
            for master, grad in zip(model.parameters(), summed, strict=True):
                master.grad = grad.div_(world_size)
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def _init(rank: int, world_size: int, store_path: str, device: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", DS_ACCELERATOR=device)  # fmt: skip
    torch.set_num_threads(1)
    backend = "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
        backend = "nccl"
    store = dist.FileStore(store_path, world_size)
    timeout = datetime.timedelta(seconds=300)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _worker(rank: int, args: argparse.Namespace, store_path: str, result_path: str) -> None:
    _init(rank, args.world_size, store_path, args.device)
    config, batch = MODELS[args.model]
    torch.manual_seed(0)
    base = GPT(config).to(device())
    table = systems(lamb=not args.no_lamb, micro_batches=args.micro_batches, muon=args.muon,
                    compiled=args.compile, checkpointed=args.checkpointing)  # fmt: skip
    if args.only:
        table = {args.only: table[args.only]}
    if args.rows:
        table = {name: system for name, system in table.items() if re.search(args.rows, name)}
    built = {name: system.build(base) for name, system in table.items()}
    steps = args.warmup + args.rounds + 2  # + one profiled step + one measured for memory
    # per step, the global batch: every rank's micro-batches, rank-major
    global_batches = {
        count: [b.to(device()) for b in _batches(config, batch * count, args.world_size, steps)]
        for count in sorted({system.micro_batches for system in table.values()})
    }

    def mine(system: System, step: int) -> list[torch.Tensor]:
        """This rank's micro-batches of a step, each ``batch`` sequences."""
        count = system.micro_batches
        local = global_batches[count][step][rank * batch * count : (rank + 1) * batch * count]
        return list(local.chunk(count))

    times: dict[str, list[tuple[float, float]]] = {name: [] for name in built}
    for index in range(args.warmup + args.rounds):
        for name, (model, optimizer) in built.items():
            dist.barrier()
            elapsed = _step(table[name], model, optimizer, mine(table[name], index))
            if index >= args.warmup:
                times[name].append(elapsed)
    results: dict[str, Any] = {}
    for name, (model, optimizer) in built.items():
        system = table[name]
        dist.barrier()
        results[name] = {
            "micro_batches": system.micro_batches, "bf16": system.bf16,
            "keep_gathered": system.keep_gathered, "baseline": system.baseline, "muon": system.muon,
            "collectives": _collectives(system, model, optimizer, mine(system, steps - 2)),
            "held_bytes": _held_bytes(system, model, optimizer, mine(system, steps - 1)),
        }  # fmt: skip
        if times[name]:
            results[name]["step_ms_rounds"] = [t * 1e3 for t, _ in times[name]]
            results[name]["optimizer_ms_rounds"] = [o * 1e3 for _, o in times[name]]
            results[name]["step_ms"] = statistics.median(t for t, _ in times[name]) * 1e3
            results[name]["optimizer_ms"] = statistics.median(o for _, o in times[name]) * 1e3
        results[name]["tokens_per_s"] = (
            batch
            * system.micro_batches
            * args.world_size
            * config.block_size
            / (results[name].get("step_ms", float("nan")) / 1e3)
        )
    results["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if torch.cuda.is_initialized():
        results["peak_rss_bytes"] = torch.cuda.max_memory_allocated()  # the GPU's, not the host's
    if not args.only:
        references: dict[tuple[bool, bool, int, bool, bool], dict[str, torch.Tensor]] = {}

        def reference(
            lamb: bool, bf16: bool, count: int, same_order: bool = False, muon: bool = False
        ) -> dict[str, torch.Tensor]:
            key = (lamb, bf16, count, same_order, muon)
            if key not in references:
                references[key] = _reference(
                    base, global_batches[count], lamb, bf16, args.world_size, count, same_order,
                    muon,
                )  # fmt: skip
            return references[key]

        def difference(full: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
            return max(
                (full[k].double().cpu() - expected[k].double().cpu()).abs().max().item()
                for k in expected
            )

        for name, (model, _) in built.items():
            system = table[name]
            full = system.full_params(model)
            expected = reference(system.lamb, system.bf16, system.micro_batches, muon=system.muon)
            results[name]["max_difference"] = difference(full, expected)
            if system.muon:
                # bf16 Newton-Schulz amplifies last-bit gradient differences (fp32 sums in
                # another order) to a few percent of an update: for scale, how far the
                # reference trained, and the reference summing each rank's gradient in order
                start = {k: v.detach() for k, v in base.state_dict().items()}
                results[name]["trained_distance"] = difference(expected, start)
                same_order = reference(False, False, 1, True, muon=True)
                results[name]["max_difference_same_order"] = difference(full, same_order)
            if system.bf16:  # for scale: how far bf16 training goes from fp32 training
                fp32 = reference(system.lamb, False, system.micro_batches)
                results[name]["max_difference_from_fp32"] = difference(full, fp32)
            elif system.micro_batches > 1:  # summing micro-batches in the ranks' order
                same_order = reference(system.lamb, False, system.micro_batches, True)
                results[name]["max_difference_same_order"] = difference(full, same_order)
    gathered = [None] * args.world_size
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(result_path, "w") as handle:
            json.dump(gathered, handle)
    dist.destroy_process_group()


def spawn_ranks(
    worker: Callable[..., None], args: argparse.Namespace, world_size: int
) -> list[dict[str, Any]]:
    """Runs ``worker(rank, args, store_path, result_path)`` on ``world_size`` fresh
    processes; rank 0 writes every rank's results as JSON to ``result_path``."""
    with tempfile.TemporaryDirectory(prefix="groupshard-bench-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        try:
            fresh.start_processes(
                worker, (args, os.path.join(tmp, "store"), result_path), world_size
            )
        except mp.ProcessExitedException:
            # Some systems' threads abort the process at exit (after the results are written).
            if not os.path.exists(result_path):
                raise
        with open(result_path) as handle:
            return json.load(handle)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every system interleaved in one process group, then each alone for its peak RSS."""
    load_before = os.getloadavg()
    per_rank = spawn_ranks(_worker, args, args.world_size)
    names = [n for n in per_rank[0] if n != "peak_rss_bytes"]
    report: dict[str, Any] = {"model": args.model, "world_size": args.world_size,
                              "device": args.device,
                              "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                                         f"{platform.python_version()}, torch {torch.__version__}",
                              "load_average": {"before": load_before, "after": os.getloadavg()},
                              "rows": {}}  # fmt: skip
    config, _ = MODELS[args.model]
    total = sum(p.numel() for p in GPT(config).parameters()) * 4
    matrices = sum(p.numel() for p in gs.muon_groups(GPT(config))[0]["params"]) * 4
    if not args.only:
        report["bf16_speed"] = bf16_speed(*MODELS[args.model])
    for name in names:
        row = dict(per_rank[0][name])
        row["held_bytes_per_rank"] = [
            sum(r[name]["held_bytes"][k] for k in ("params", "grads", "state")) for r in per_rank
        ]  # parameters + gradients + optimizer state
        row["ideal_bytes_per_rank"] = 4 * total // args.world_size  # AdamW: 2 states
        if row.get("muon"):  # Muon: 1 state (momentum) for the matrices
            row["ideal_bytes_per_rank"] = (4 * total - matrices) // args.world_size
        if "all_to_all_buffer_bytes" in row["collectives"]:  # gs.optim.Muon's, per rank
            row["all_to_all_buffer_bytes_per_rank"] = [
                r[name]["collectives"]["all_to_all_buffer_bytes"] for r in per_rank
            ]
            row["all_to_all_bytes_per_rank"] = [
                r[name]["collectives"]["all_to_all_bytes"] for r in per_rank
            ]
        report["rows"][name] = row
    if args.rss:
        for name in names:
            single = argparse.Namespace(**{**vars(args), "only": name, "warmup": 1, "rounds": 2})
            report["rows"][name]["peak_rss_bytes_per_rank"] = [
                r["peak_rss_bytes"] for r in spawn_ranks(_worker, single, args.world_size)
            ]
    for row in report["rows"].values():  # to FSDP2 run the same way (precision, accumulation)
        baseline = report["rows"].get(row["baseline"], {})
        fsdp2_ms = baseline.get("step_ms")
        row["ratio_to_fsdp2"] = row["step_ms"] / fsdp2_ms if fsdp2_ms else None
        # the median of each round's ratio: rounds run both one after the other, so a
        # machine busy with other work for a while slows both (steadier than medians' ratio)
        mine, theirs = row.get("step_ms_rounds", []), baseline.get("step_ms_rounds", [])
        ratios = [a / b for a, b in zip(mine, theirs, strict=True)] if theirs else []
        row["ratio_to_fsdp2_paired"] = statistics.median(ratios) if ratios else None
    _muon_ratios(report["rows"])
    return report


def _paired(mine: dict[str, Any], theirs: dict[str, Any] | None, key: str) -> float | None:
    """The median over rounds of the round's ratio of ``key`` (both rows ran one after the
    other in each round), or None without the other row."""
    if not theirs or not theirs.get(key):
        return None
    return statistics.median(a / b for a, b in zip(mine[key], theirs[key], strict=True))


def _muon_ratios(rows: dict[str, dict[str, Any]]) -> None:
    """Muon rows: the optimizer step over "DDP + torch Muon"'s and the step over the same
    system's AdamW row (medians' ratio and paired)."""
    replicated = rows.get("DDP + torch Muon")
    for name, row in rows.items():
        if name not in MUON_PARTNERS:
            continue
        if replicated:
            row["optimizer_ratio_to_ddp_muon"] = row["optimizer_ms"] / replicated["optimizer_ms"]
            row["optimizer_ratio_to_ddp_muon_paired"] = _paired(
                row, replicated, "optimizer_ms_rounds"
            )
        adamw = rows.get(MUON_PARTNERS[name])
        row["muon_over_adamw"] = row["step_ms"] / adamw["step_ms"] if adamw else None
        row["muon_over_adamw_paired"] = _paired(row, adamw, "step_ms_rounds")


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    for _ in range(2):  # warm-up
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def bf16_speed(config: GPTConfig, batch: int, repeats: int = 5) -> dict[str, Any]:
    """Is bf16 compute faster than fp32 here? One process, one thread (as each rank): the
    model's forward + backward on one rank's batch, and the matmuls of its Linear layers
    (forward, input gradient, weight gradient, at that batch's token count, each layer
    once), in float32 and bfloat16: median ms and the bf16 / fp32 ratio."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = GPT(config)
        tokens = torch.randint(0, config.vocab_size, (batch, config.block_size + 1))
        rows = batch * config.block_size
        shapes: dict[tuple[int, int], int] = {}
        for module in model.modules():
            if isinstance(module, nn.Linear):
                key = (module.in_features, module.out_features)
                shapes[key] = shapes.get(key, 0) + 1
        result: dict[str, Any] = {"threads": 1, "tokens": rows, "model_fwd_bwd_ms": {},
                                  "matmul_ms": {}}  # fmt: skip
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            converted = copy.deepcopy(model).to(dtype)

            def forward_backward(model: nn.Module = converted) -> None:
                model(tokens[:, :-1], tokens[:, 1:]).backward()

            result["model_fwd_bwd_ms"][name] = _median_ms(forward_backward, repeats)
            total = 0.0
            for (n_in, n_out), count in shapes.items():
                x = torch.randn(rows, n_in, dtype=dtype)
                w = torch.randn(n_out, n_in, dtype=dtype)
                g = torch.randn(rows, n_out, dtype=dtype)

                def matmuls(x: torch.Tensor = x, w: torch.Tensor = w, g: torch.Tensor = g) -> None:
                    x @ w.t(), g @ w, g.t() @ x

                total += count * _median_ms(matmuls, repeats)
            result["matmul_ms"][name] = total
        for key in ("model_fwd_bwd_ms", "matmul_ms"):
            times = result[key]
            times["bf16_over_fp32"] = times["bfloat16"] / times["float32"]
        return result
    finally:
        torch.set_num_threads(threads)


def _moved_bytes(row: dict[str, Any]) -> float | None:
    return row["collectives"]["groupshard_bytes"] or row["collectives"].get("profiled_bytes")


def print_table(report: dict[str, Any]) -> None:
    nan = float("nan")
    backend = "NCCL" if report.get("device") == "cuda" else "gloo"
    print(f"model {report['model']}, world size {report['world_size']}, {backend}, 1 thread/rank; "
          f"{report['machine']}")  # fmt: skip
    columns = ["step ms", "/FSDP2", "tok/s", "optim ms", "held MB/rank", "gathered MB",
               "coll/step", "moved MB", "peak MB", "max diff"]  # fmt: skip
    widths = [8, 7, 8, 9, 13, 11, 9, 8, 12, 9]
    width = max(28, *(len(name) for name in report["rows"]))
    print(f"{'system':{width}s} "
          + " ".join(f"{c:>{w}s}" for c, w in zip(columns, widths, strict=True)))  # fmt: skip
    for name, row in report["rows"].items():
        held = max(row["held_bytes_per_rank"]) / 2**20
        rss = row.get("peak_rss_bytes_per_rank")
        print(
            f"{name:{width}s} {row['step_ms']:8.1f} {row['ratio_to_fsdp2'] or float('nan'):7.2f} "
            f"{row['tokens_per_s']:8.0f} {row['optimizer_ms']:9.1f} {held:13.2f} "
            f"{(row['held_bytes'].get('gathered_peak') or nan) / 2**20:11.2f} "
            f"{row['collectives']['count']:9d} "
            f"{(_moved_bytes(row) or nan) / 2**20:8.2f} "
            f"{(max(rss) / 2**20) if rss else float('nan'):12.0f} "
            f"{row.get('max_difference', float('nan')):9.1e}"
        )
    print("/FSDP2: step time over FSDP2's, run the same way (bf16, accumulation); step: one "
          "optimizer step (all its micro-batches).\nmoved MB: bytes per rank with ideal "
          "algorithms, through groupshard's collectives or from the sizes torch.profiler "
          "records\n(only all-gathers and reduce-scatters have them); 3 x parameter bytes x "
          "(N-1)/N for full.\ngloo runs a reduce-scatter as a full all-reduce: sharded "
          "systems pay more for gradients on CPU than over NCCL.")  # fmt: skip
    print_precision_table(report)
    print_muon_table(report)


def print_muon_table(report: dict[str, Any]) -> None:
    """The Muon rows: step and optimizer step against the replicated and FSDP2 baselines,
    the Muon exchange, and each system's Muon step over its AdamW step."""
    nan = float("nan")
    rows = {name: row for name, row in report["rows"].items() if name in MUON_PARTNERS}
    if not rows:
        return
    width = max(len(name) for name in rows)
    columns = ["step ms", "optim ms", "optim/DDP", "paired", "/FSDP2", "paired", "Muon/AdamW",
               "paired", "A2A", "A2A MB", "buf MB", "max diff", "in order", "trained"]  # fmt: skip
    widths = [8, 9, 9, 7, 7, 7, 10, 7, 4, 7, 7, 9, 9, 8]
    print("\nMuon (hidden matrices; AdamW for the rest)")
    print(f"{'system':{width}s} "
          + " ".join(f"{c:>{w}s}" for c, w in zip(columns, widths, strict=True)))  # fmt: skip
    for name, row in rows.items():
        collectives = row["collectives"]
        print(
            f"{name:{width}s} {row['step_ms']:8.1f} {row['optimizer_ms']:9.1f} "
            f"{row.get('optimizer_ratio_to_ddp_muon') or nan:9.2f} "
            f"{row.get('optimizer_ratio_to_ddp_muon_paired') or nan:7.2f} "
            f"{row['ratio_to_fsdp2'] or nan:7.2f} {row.get('ratio_to_fsdp2_paired') or nan:7.2f} "
            f"{row.get('muon_over_adamw') or nan:10.2f} "
            f"{row.get('muon_over_adamw_paired') or nan:7.2f} "
            f"{collectives.get('all_to_alls', 0):4d} "
            f"{max(row.get('all_to_all_bytes_per_rank', [nan])) / 2**20:7.2f} "
            f"{max(row.get('all_to_all_buffer_bytes_per_rank', [nan])) / 2**20:7.2f} "
            f"{row.get('max_difference', nan):9.1e} "
            f"{row.get('max_difference_same_order', nan):9.1e} "
            f"{row.get('trained_distance', nan):8.1e}"
        )
    print(
        "optim/DDP: optimizer step over DDP + torch Muon's (every rank orthogonalizes every "
        "matrix); /FSDP2: step over FSDP2 + torch Muon's;\nMuon/AdamW: step over the same "
        "system's AdamW row; paired: median over rounds of the round's ratio;\nA2A: "
        "gs.optim.Muon's all-to-alls per step; A2A MB: sent per rank; buf MB: its send + "
        "receive buffers (bf16, beyond the shards;\nboth the most of any rank); max diff: from "
        "one process with torch.optim.Muon + AdamW on the global batch; in order:\nsumming "
        "each rank's gradient in rank order; trained: how far that reference moved the "
        "parameters. bf16 Newton-Schulz turns\nlast-bit gradient differences into a few "
        "percent of an update (tests/test_muon.py): differences up to 10 % of 'trained' are\n"
        "that, not a bug."
    )


def print_precision_table(report: dict[str, Any]) -> None:
    """The mixed precision and accumulation rows, with the fp32 rows they build on."""
    nan = float("nan")
    rows = {
        name: row
        for name, row in report["rows"].items()
        if row.get("bf16")
        or row.get("micro_batches", 1) > 1
        or name in ("FSDP2", "groupshard full")
    }
    if not rows:
        return
    width = max(len(name) for name in rows)
    columns = ["step ms", "/FSDP2", "paired", "gather MB", "reduce MB", "RS/step", "accum MB",
               "max diff", "in order", "vs fp32"]  # fmt: skip
    widths = [8, 7, 7, 10, 10, 8, 9, 9, 9, 9]
    counts = ", ".join(str(c) for c in sorted({r["micro_batches"] for r in rows.values()} - {1}))
    accumulation = f" ({counts} micro-batches per optimizer step)" if counts else ""
    print(f"\nmixed precision and accumulation{accumulation}")
    print(f"{'system':{width}s} "
          + " ".join(f"{c:>{w}s}" for c, w in zip(columns, widths, strict=True)))  # fmt: skip
    for name, row in rows.items():
        collectives = row["collectives"]
        accumulated = row["held_bytes"].get("accumulated_grads")
        print(
            f"{name:{width}s} {row['step_ms']:8.1f} {row['ratio_to_fsdp2'] or nan:7.2f} "
            f"{row.get('ratio_to_fsdp2_paired') or nan:7.2f} "
            f"{(collectives.get('gather_bytes') or nan) / 2**20:10.2f} "
            f"{(collectives.get('reduce_bytes') or nan) / 2**20:10.2f} "
            f"{collectives.get('reduce_scatters', 0):8d} "
            f"{(nan if accumulated is None else accumulated) / 2**20:9.2f} "
            f"{row.get('max_difference', nan):9.1e} "
            f"{row.get('max_difference_same_order', nan):9.1e} "
            f"{row.get('max_difference_from_fp32', nan):9.1e}"
        )
    notes = (
        "paired: median over rounds of the round's ratio to the FSDP2 row (both ran one after "
        "the other);\ngather / reduce MB: per rank per optimizer step (groupshard's "
        "reduce-scatters run as all-reduces on gloo: RS/step counts them);\naccum MB: "
        "unsharded gradient bytes held after the next-to-last micro-batch;\nmax diff: from one "
        "process on the global batch (bf16: doing the ranks' casts, in their order); in order: "
        "fp32, from one process\nsumming micro-batches in the ranks' order; vs fp32: bf16, from "
        "one process training in fp32. AdamW turns rounding in tiny gradient\nelements into "
        "~lr/10."
    )
    print(notes)
    speed = report.get("bf16_speed")
    if speed:
        model, matmul = speed["model_fwd_bwd_ms"], speed["matmul_ms"]
        print(f"bf16 / fp32 compute time, one process, one thread: model forward + backward "
              f"{model['bf16_over_fp32']:.2f} ({model['bfloat16']:.1f} / {model['float32']:.1f} "
              f"ms), Linear matmuls {matmul['bf16_over_fp32']:.2f} ({matmul['bfloat16']:.1f} / "
              f"{matmul['float32']:.1f} ms)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="4m")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cuda" if torch.cuda.device_count() >= 2 else "cpu",
        help="cuda: one GPU per rank over NCCL (the default with 2 or more GPUs); cpu: gloo",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--no-lamb", action="store_true", help="skip the LAMB rows")
    parser.add_argument(
        "--muon", action="store_true",
        help="add the Muon rows (slow on CPU); --rows muon-only: the Muon rows and the same "
             "systems' AdamW rows only (implies --muon)",
    )  # fmt: skip
    parser.add_argument(
        "--compile", action="store_true",
        help="add the rows with each block compiled (inductor); --rows compile-only: those "
             "rows and the same systems eager only (implies --compile)",
    )  # fmt: skip
    parser.add_argument(
        "--checkpointing", action="store_true",
        help="add the rows with each block's forward under torch.utils.checkpoint; --rows "
             "checkpoint-only: those rows and the same systems without only (implies "
             "--checkpointing); with --rss, each system's peak RSS shows what it saves",
    )  # fmt: skip
    parser.add_argument(
        "--micro-batches", type=int, default=MICRO_BATCHES,
        help="micro-batches per optimizer step in the accumulation rows (at least 2)",
    )  # fmt: skip
    parser.add_argument(
        "--rss", action="store_true", help="also measure each system's peak RSS alone"
    )
    parser.add_argument("--json", default="benchmark.json", help="where to write the results")
    parser.add_argument(
        "--rows", metavar="REGEX", help="only the rows whose name matches (re.search)"
    )
    parser.add_argument("--only", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rows == "muon-only":
        args.rows, args.muon = MUON_ROWS, True
    if args.rows == "compile-only":
        args.rows, args.compile = COMPILE_ROWS, True
    if args.rows == "checkpoint-only":
        args.rows, args.checkpointing = CHECKPOINT_ROWS, True
    if args.micro_batches < 2:
        parser.error(f"--micro-batches must be at least 2, got {args.micro_batches}")
    report = run(args)
    with open(args.json, "w") as handle:
        json.dump(report, handle, indent=1)
    print_table(report)
    print(f"results in {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
