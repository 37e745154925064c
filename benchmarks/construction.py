"""Construction of a model bigger than a rank, and its first training step: peak RSS per rank.

    python benchmarks/construction.py [--model 770m|90m|tiny] [--world-size 4]
                                      [--systems groupshard,FSDP2,DeepSpeed,DDP]
                                      [--memory-budget-gb 18] [--mmap-threshold BYTES]
                                      [--json PATH]

Each system builds the same GPT on the meta device and trains ONE step (forward, backward,
AdamW step with the two groups decay / no decay, as ``benchmarks/run.py``) on a small batch:

- **groupshard**: ``gs.shard(meta_model, gs.decay_groups(model, 0.1), unit=Block,
  param_init_fn=GPT._init_weights)``: materialized and sharded one unit at a time.
- **FSDP2**: ``fully_shard`` per ``Block`` and the root on the meta model, then
  ``to_empty(device="cpu")`` and initialization as torch's docs describe (after
  ``to_empty``), module by module: each module's full parameters are drawn under
  groupshard's seeding rule, in a temporary, and each rank keeps its DTensor piece. So
  FSDP2 starts from bit-for-bit the same weights as groupshard (and pays the same for
  drawing every module's full parameters on every rank), and the first step's losses
  can be compared.
- **DeepSpeed**: ZeRO-3, ``deepspeed.zero.Init`` around the model's constructor, then each
  module initialized gathered, one at a time (``zero.GatheredParameters(...,
  modifier_rank=0)``, DeepSpeed's documented way), under the same rule: the same weights;
  torch's AdamW as a client optimizer. Only when ``import deepspeed`` works (e.g.
  ``PYTHONPATH`` to an install; ``DS_ACCELERATOR=cpu`` is set); otherwise the row says it is
  absent.
- **DDP**: the whole model on every rank (meta, ``to_empty``, the same seeded init, the
  tie re-made), ``DistributedDataParallel(gradient_as_bucket_view=True)`` (its gradients
  are the buckets: 16 bytes per parameter with AdamW, not 20). It needs parameters,
  gradients and both AdamW states on every rank: when that does not fit the memory
  budget, the row says "does not fit" with the bytes it would need, and nothing runs.

Memory safety: a system whose estimated need for all ranks exceeds ``--memory-budget-gb``
(default 18), or what the machine has free, is not started; while ranks run, the launcher
samples their RSS every 0.1 s and ends them if together they pass the budget, or if the
machine's available memory falls below 1 GB (the row then says where it stopped).

**Why fresh processes per system** (and why this is not a row of ``run.py``, which
interleaves every system in one process group): a process's peak RSS is one number for
its whole life, and memory freed by one system stays in the process (allocator caches,
glibc arenas), so systems sharing processes would share peaks. Here every system gets
``--world-size`` new processes; each rank first builds and steps a tiny model with the
same system (imports, lazily loaded kernels, first collectives: not per model), then reads
its **baseline** RSS, resets its peak (``/proc/self/clear_refs``; without it the peak is
the process's lifetime peak, still its own system's) and measures:

- ``construct_peak``: the peak RSS while building, initializing and creating the optimizer;
- ``step_peak``: the peak RSS during the first step (the peak is reset before it), when the
  optimizer state is allocated; ``held_after_step``: the RSS after it;
- ``construct_s``, ``step_s`` and ``time_to_first_step_s`` (their sum), wall-clock;
- ``activation_bytes``: the bytes of the tensors autograd saved in forward (unique
  storages, parameters and their views excluded);
- ``loss``: this rank's loss of the step (each rank its own batch, the same for every
  system; the weights are the same too, so the losses must agree);
- ``held_after_step_trimmed``: the RSS after ``malloc_trim``: the live tensors alone.

Peak RSS is what the operating system sees, so glibc's allocator is part of it: blocks below
its mmap threshold (which rises to 32 MB as blocks are freed) stay in the heap when freed
and are reused only when they fit. ``--mmap-threshold BYTES`` starts the ranks with a fixed
``MALLOC_MMAP_THRESHOLD_``, to see the peaks without that caching.

The **target** (issue 17), per rank and above the baseline: groupshard's step peak at most
FSDP2's, and at most ``1.1 x ((P + G + 2 AdamW states) / N + the largest unit's full
parameters + activations)``, fp32: ``16 x parameters / N + unit + activations``; and
(issue 25) its time to the first step at most FSDP2's (slowest rank each).

The ranks talk over gloo (CPU), one thread each. Output: a table and, with ``--json``, the
report.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import datetime
import faulthandler
import gc
import json
import os
import platform
import re
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fresh
import torch
import torch.distributed as dist
from torch import nn

# imported before any process group exists: torch modules first imported after
# init_process_group can keep the default group alive into interpreter shutdown, where a
# gloo thread aborts the rank ("terminate called without an active exception"; see
# docs/when-something-fails.md)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor
from torch.multiprocessing import ProcessExitedException
from torch.nn.parallel import DistributedDataParallel as DDP

import groupshard as gs
from groupshard.cli.model import GPT, Block, GPTConfig
from groupshard.materialize import module_seed

GB = 1e9
LR = 1e-3
WEIGHT_DECAY = 0.1
SEED = 0
MODELS: dict[str, tuple[GPTConfig, int]] = {
    # ~772M parameters (3.1 GB in fp32) in 15 blocks of 201 MB: 16 bytes a parameter
    # (weights, gradients, two AdamW states) is 12.4 GB over 4 ranks; with baselines and
    # units in flight the 4 ranks peaked at 14.8 GB. 1B would need 16.4 GB + ~3 GB: more
    # than the ~18 GB a 24 GB machine shared with other work can spare
    "770m": (GPTConfig(vocab_size=8192, block_size=64, n_layer=15, n_head=16, n_embd=2048), 1),
    # ~91M parameters (GPT-2 small's shape with an 8192-token vocabulary): DDP fits here
    # (4 ranks x 1.5 GB), so every system runs side by side
    "90m": (GPTConfig(vocab_size=8192, block_size=64, n_layer=12, n_head=12, n_embd=768), 1),
    # ~11M parameters (44 MB): big enough that memory is the model's, not noise; the test's
    "tiny": (GPTConfig(vocab_size=512, block_size=32, n_layer=6, n_head=6, n_embd=384), 2),
}
WARMUP = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
SYSTEMS = ("groupshard", "FSDP2", "DeepSpeed", "DDP")


# --- memory -----------------------------------------------------------------------------


def _status(*fields: str) -> list[int]:
    """Fields of /proc/self/status in bytes, from one read (one moment)."""
    text = Path("/proc/self/status").read_text()
    values = []
    for field in fields:
        match = re.search(rf"{field}:\s+(\d+) kB", text)
        assert match is not None, field
        values.append(int(match.group(1)) * 1024)
    return values


def rss() -> int:
    return _status("VmRSS")[0]


def peak_and_held() -> tuple[int, int]:
    """The peak RSS since the last reset and the RSS now, read together: Linux updates
    VmHWM lazily, so it can trail VmRSS by a few pages; the peak is at least the RSS."""
    peak, held = _status("VmHWM", "VmRSS")
    return max(peak, held), held


def reset_peak() -> bool:
    """Reset the peak RSS (VmHWM) to the current RSS; False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _trim() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


@contextlib.contextmanager
def saved_activation_bytes() -> Iterator[list[int]]:
    """Bytes of the tensors autograd saves for backward (unique storages), parameters and
    views of parameters excluded: the activations a forward keeps."""
    seen: dict[int, int] = {}
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if not (base.is_leaf and base.requires_grad) and t.device.type != "meta":
            storage = t.untyped_storage()
            seen.setdefault(storage.data_ptr(), storage.nbytes())
            total[0] = sum(seen.values())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


# --- the model and its initialization ----------------------------------------------------


def meta_gpt(config: GPTConfig) -> GPT:
    with torch.device("meta"):
        return GPT(config)


def parameter_count(config: GPTConfig) -> int:
    return sum(p.numel() for p in meta_gpt(config).parameters())  # tied: counted once


def largest_unit_bytes(config: GPTConfig) -> int:
    """The largest unit's full fp32 parameters: a Block, or the root (embeddings, ln_f)."""
    model = meta_gpt(config)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    in_blocks = {id(p) for p in model.blocks.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    return 4 * max(block, root)


def _initialize(module: nn.Module, name: str) -> None:
    """groupshard's rule: ``reset_parameters()`` then ``GPT._init_weights``, from a stream
    seeded by the module's name (``groupshard.materialize``)."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(module_seed(SEED, name))
        reset = getattr(module, "reset_parameters", None)
        if reset is not None:
            reset()
        GPT._init_weights(module)


def _modules_to_initialize(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Modules directly holding a parameter no earlier module holds (a tied parameter is
    initialized by its first module, as groupshard does)."""
    done: set[int] = set()
    for name, module in model.named_modules():
        mine = [p for p in module._parameters.values() if p is not None]
        if any(id(p) not in done for p in mine):
            done.update(id(p) for p in mine)
            yield name, module


def init_full(model: GPT) -> None:
    """Materialize a meta GPT whole on the CPU with groupshard's weights (DDP's model)."""
    model.to_empty(device="cpu")
    model.lm_head.weight = model.wte.weight  # to_empty unties the meta parameters
    for name, module in _modules_to_initialize(model):
        _initialize(module, name)


def init_fsdp2(model: GPT) -> None:
    """After ``fully_shard`` and ``to_empty``: each module's full parameters drawn in a
    temporary (groupshard's rule), each rank keeping its DTensor piece."""
    for name, module in _modules_to_initialize(model):
        sharded = {k: p for k, p in module._parameters.items() if p is not None}
        full = {k: nn.Parameter(torch.empty(p.shape, dtype=p.dtype)) for k, p in sharded.items()}
        module._parameters.update(full)
        try:
            _initialize(module, name)
        finally:
            module._parameters.update(sharded)
        with torch.no_grad():
            for k, p in sharded.items():
                piece = distribute_tensor(
                    full[k].data, p.device_mesh, p.placements, src_data_rank=None
                )
                p.to_local().copy_(piece.to_local())
        del full


# --- the systems ---------------------------------------------------------------------------


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    return gs.decay_groups(model, WEIGHT_DECAY)


def build_groupshard(config: GPTConfig) -> tuple[Any, Any]:
    torch.manual_seed(SEED)
    model = meta_gpt(config)
    model = gs.shard(model, _groups(model), unit=Block, param_init_fn=GPT._init_weights)
    return model, torch.optim.AdamW(model.optimizer_groups(), lr=LR)


def build_fsdp2(config: GPTConfig) -> tuple[Any, Any]:
    model = meta_gpt(config)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    assert model.lm_head.weight is model.wte.weight
    init_fsdp2(model)
    return model, torch.optim.AdamW(_groups(model), lr=LR)


def build_ddp(config: GPTConfig) -> tuple[Any, Any]:
    model = meta_gpt(config)
    init_full(model)
    return DDP(model, gradient_as_bucket_view=True), torch.optim.AdamW(_groups(model), lr=LR)


def build_deepspeed(config: GPTConfig) -> tuple[Any, Any]:
    """ZeRO-3 with ``zero.Init``; each module then initialized gathered, one at a time
    (``GatheredParameters``, as DeepSpeed's docs show), with groupshard's rule: the same
    weights. The optimizer is torch's AdamW (a client optimizer), as for the others."""
    import deepspeed

    ds_config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
    }
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = GPT(config)
    for name, module in _modules_to_initialize(model):
        params = [p for p in module._parameters.values() if p is not None]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            _initialize(module, name)
    # partitioned parameters are 1-D placeholders: decide decay from their full shape
    shape = {id(p): getattr(p, "ds_shape", p.shape) for p in model.parameters()}
    norms = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    decay = [p for p in model.parameters() if len(shape[id(p)]) >= 2 and id(p) not in norms]
    rest = [p for p in model.parameters() if not any(p is q for q in decay)]
    groups = [
        {"params": decay, "weight_decay": WEIGHT_DECAY},
        {"params": rest, "weight_decay": 0.0},
    ]
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(groups, lr=LR), config=ds_config,
        dist_init_required=False,
    )  # fmt: skip
    return engine, optimizer


BUILDERS: dict[str, Callable[[GPTConfig], tuple[Any, Any]]] = {
    "groupshard": build_groupshard,
    "FSDP2": build_fsdp2,
    "DeepSpeed": build_deepspeed,
    "DDP": build_ddp,
}


def deepspeed_absent() -> str | None:
    """Why DeepSpeed cannot run, or None when it can."""
    try:
        import deepspeed  # noqa: F401
    except Exception as error:  # ImportError, or its own failures at import
        return f"import deepspeed failed: {type(error).__name__}: {error}"[:300]
    return None


def step(model: Any, optimizer: Any, batch: torch.Tensor) -> tuple[float, int]:
    """One training step: the loss and the activation bytes its forward saved."""
    with saved_activation_bytes() as activations:
        loss = model(batch[:, :-1], batch[:, 1:])
    if hasattr(model, "zero_optimization_stage"):  # a DeepSpeed engine
        model.backward(loss)
        model.step()
    else:
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.item(), activations[0]


def batch_of(config: GPTConfig, batch: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1 + rank)
    return torch.randint(0, config.vocab_size, (batch, config.block_size + 1), generator=generator)


# --- the ranks ------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """A rank whose launcher is gone (killed, timed out) would wait on its peers forever."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").prctl(1, 9)  # SIGKILL


def _worker(rank: int, args: argparse.Namespace, system: str, store: str, result: str) -> None:
    _die_with_parent()
    faulthandler.enable(all_threads=True)  # an abort or a hang shows every thread's stack
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", DS_ACCELERATOR="cpu")  # fmt: skip
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # DeepSpeed's deprecated calls
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, args.world_size), rank=rank,
        world_size=args.world_size, timeout=datetime.timedelta(seconds=900),
    )  # fmt: skip
    config, batch = MODELS[args.model]
    build = BUILDERS[system]
    # warm-up: imports, kernels and first collectives, not per model
    model, optimizer = build(WARMUP)
    step(model, optimizer, batch_of(WARMUP, 1, rank))
    del model, optimizer
    _trim()
    dist.barrier()
    data = batch_of(config, batch, rank)
    row: dict[str, Any] = {"rank": rank, "baseline": rss(), "peak_reset": reset_peak()}
    start = time.perf_counter()
    model, optimizer = build(config)
    dist.barrier()
    built = time.perf_counter()
    row["construct_peak"], row["held_after_construct"] = peak_and_held()
    reset_peak()
    loss, activations = step(model, optimizer, data)
    dist.barrier()
    done = time.perf_counter()
    row["step_peak"], row["held_after_step"] = peak_and_held()
    row.update(
        loss=loss, activation_bytes=activations,
        construct_s=built - start, step_s=done - built, time_to_first_step_s=done - start,
    )  # fmt: skip
    _trim()  # what stays after giving the allocator's free memory back: live tensors
    row["held_after_step_trimmed"] = rss()
    rows: list[Any] = [None] * args.world_size
    dist.all_gather_object(rows, row)
    if rank == 0:
        Path(result).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


class OverBudgetError(RuntimeError):
    """The ranks together went over the memory budget (or the machine ran short)."""


def _rss_of(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    match = re.search(r"VmRSS:\s+(\d+) kB", text)
    return int(match.group(1)) * 1024 if match else 0


def run_system(args: argparse.Namespace, system: str) -> list[dict[str, Any]]:
    """Start the ranks and watch them: if their RSS together exceeds the budget, or the
    machine's available memory falls below 1 GB, end them (raises ``OverBudgetError``)."""
    budget = args.memory_budget_gb * GB
    with tempfile.TemporaryDirectory(prefix="groupshard-construction-") as tmp:
        result = os.path.join(tmp, "result.json")
        context = fresh.start_processes(
            _worker, (args, system, os.path.join(tmp, "store"), result), args.world_size,
            # never a fork of this process: a forked rank hung at its start in 2 of 16 runs
            # (this process had run torch before); the forkserver's server only imports it
            join=False,
        )  # fmt: skip
        most, started, finished = 0, time.monotonic(), None
        while not _joined(context, result, system):
            total = sum(_rss_of(process.pid) for process in context.processes)
            most = max(most, total)
            if finished is None and os.path.exists(result):  # every rank has measured
                finished = time.monotonic()
            if finished is not None and time.monotonic() - finished > EXIT_GRACE_S:
                _end_lingering(context.processes, f"{system}'s ranks measured but did not exit")
                break
            if finished is None and time.monotonic() - started > args.rank_timeout:
                _end_lingering(context.processes, f"{system}'s ranks did not finish")
                raise TimeoutError(
                    f"{system}'s ranks did not finish within --rank-timeout "
                    f"{args.rank_timeout:g} s (their stacks are above)"
                )
            if total > budget or _available_bytes() < 1 * GB:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                for process in context.processes:
                    process.join()
                raise OverBudgetError(
                    f"ended at {total / GB:.1f} GB for {args.world_size} ranks (budget "
                    f"{budget / GB:g} GB, {_available_bytes() / GB:.1f} GB available)"
                )
        rows = json.loads(Path(result).read_text())
        for row in rows:
            row["all_ranks_rss_sampled_max"] = most
        return rows


def _joined(context: Any, result: str, system: str) -> bool:
    """Whether every rank has exited; a rank that aborted at exit after the results were
    written (torch's gloo threads, docs/when-something-fails.md) is said, not raised."""
    try:
        return context.join(timeout=0.1)
    except ProcessExitedException as error:
        if not os.path.exists(result):
            raise
        print(f"{system}: a rank ended after measuring: {error}", file=sys.stderr)
        return True


EXIT_GRACE_S = 30.0
"""How long ranks that wrote their results may take to exit before they are ended."""


def _end_lingering(processes: list[Any], what: str) -> None:
    """End the ranks still alive, each first asked for its threads' stacks (SIGABRT: the
    ranks' faulthandler prints them on this stderr), and say so."""
    alive = [process for process in processes if process.is_alive()]
    print(f"{what}: pids {[p.pid for p in alive]}; their stacks follow", file=sys.stderr)
    for process in alive:
        os.kill(process.pid, signal.SIGABRT)
    time.sleep(2)
    for process in alive:
        if process.is_alive():
            process.kill()
        process.join()


def needed_bytes(system: str, params: int, unit: int, world_size: int) -> int:
    """A rough estimate of the memory all ranks together need (fp32, AdamW), to refuse
    what would not fit: 16 bytes a parameter sharded or not, 3 units in flight, 0.6 GB of
    baseline a rank."""
    state = 16 * params if system == "DDP" else 16 * params // world_size
    in_flight = 4 * params if system == "DDP" else 3 * unit  # DDP: its broadcast, temporaries
    return world_size * (state + in_flight + int(0.6 * GB))


def _available_bytes() -> int:
    match = re.search(r"MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text())
    return int(match.group(1)) * 1024 if match else 0


def target_bytes(params: int, unit: int, activations: int, world_size: int) -> float:
    return 1.1 * (16 * params / world_size + unit + activations)


def run(args: argparse.Namespace) -> dict[str, Any]:
    config, batch = MODELS[args.model]
    params = parameter_count(config)
    unit = largest_unit_bytes(config)
    report: dict[str, Any] = {
        "model": args.model, "config": vars(config), "batch_per_rank": batch,
        "world_size": args.world_size, "parameters": params, "parameter_bytes": 4 * params,
        "largest_unit_bytes": unit, "memory_budget_bytes": int(args.memory_budget_gb * GB),
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc default"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "systems": {},
    }  # fmt: skip
    for system in args.systems:
        entry: dict[str, Any] = {}
        need = needed_bytes(system, params, unit, args.world_size)
        absent = deepspeed_absent() if system == "DeepSpeed" else None
        if absent is not None:
            entry["absent"] = absent
        elif need > args.memory_budget_gb * GB:
            entry["does_not_fit"] = (
                f"needs ~{need / GB:.1f} GB for {args.world_size} ranks (budget "
                f"{args.memory_budget_gb:g} GB)"
            )
        elif need > _available_bytes() - int(1 * GB):
            entry["does_not_fit"] = (
                f"needs ~{need / GB:.1f} GB but {_available_bytes() / GB:.1f} GB are free now"
            )
        else:
            print(f"{system}: {args.world_size} ranks ...", file=sys.stderr, flush=True)
            try:
                entry["ranks"] = run_system(args, system)
            except OverBudgetError as error:
                entry["does_not_fit"] = str(error)
        entry["estimated_need_bytes"] = need
        report["systems"][system] = entry
    _summarize(report)
    return report


def _summarize(report: dict[str, Any]) -> None:
    params, unit, world = report["parameters"], report["largest_unit_bytes"], report["world_size"]
    for entry in report["systems"].values():
        ranks = entry.get("ranks")
        if not ranks:
            continue
        entry["construct_peak_above_baseline"] = max(
            r["construct_peak"] - r["baseline"] for r in ranks
        )
        entry["step_peak_above_baseline"] = max(r["step_peak"] - r["baseline"] for r in ranks)
        entry["time_to_first_step_s"] = max(r["time_to_first_step_s"] for r in ranks)
        entry["activation_bytes"] = max(r["activation_bytes"] for r in ranks)
    systems = report["systems"]
    mine = systems.get("groupshard", {})
    if "ranks" in mine:
        target = target_bytes(params, unit, mine["activation_bytes"], world)
        report["target"] = {
            "bound_bytes": target,
            "formula": "1.1 x (16 x parameters / N + largest unit + activations), above baseline",
            "groupshard_step_peak_above_baseline": mine["step_peak_above_baseline"],
            "met_bound": mine["step_peak_above_baseline"] <= target,
        }
        if "ranks" in systems.get("FSDP2", {}):
            fsdp2 = systems["FSDP2"]
            report["target"]["groupshard_over_fsdp2_step_peak"] = (
                mine["step_peak_above_baseline"] / fsdp2["step_peak_above_baseline"]
            )
            report["target"]["met_fsdp2"] = (
                mine["step_peak_above_baseline"] <= fsdp2["step_peak_above_baseline"]
            )
            # issue 25: no slower to the first step than FSDP2 (slowest rank's)
            report["target"]["groupshard_over_fsdp2_time_to_first_step"] = (
                mine["time_to_first_step_s"] / fsdp2["time_to_first_step_s"]
            )
        # the same weights (same seeding rule) and batches: the first losses must agree
        report["max_loss_difference_vs_groupshard"] = {
            name: max(
                abs(a["loss"] - b["loss"])
                for a, b in zip(mine["ranks"], entry["ranks"], strict=True)
            )
            for name, entry in systems.items()
            if "ranks" in entry and name != "groupshard"
        }


def print_table(report: dict[str, Any]) -> None:
    gb = lambda b: f"{b / GB:7.2f}"  # noqa: E731
    print(
        f"model {report['model']}: {report['parameters'] / 1e6:.0f}M parameters "
        f"({report['parameter_bytes'] / GB:.2f} GB fp32), largest unit "
        f"{report['largest_unit_bytes'] / GB:.3f} GB, world {report['world_size']}, "
        f"{report['batch_per_rank']} x {report['config']['block_size']} tokens a rank"
    )
    print("per rank, the most over ranks; GB above each rank's baseline RSS (baseline: absolute)")
    header = (
        f"{'system':<11} {'baseline':>8} {'constr.':>8} {'step':>8} {'held':>8} "
        f"{'/FSDP2':>7} {'build s':>8} {'1st step s':>10} {'loss (rank 0)':>14}"
    )
    print(header)
    print("-" * len(header))
    fsdp2 = report["systems"].get("FSDP2", {}).get("step_peak_above_baseline")
    for name, entry in report["systems"].items():
        if "ranks" not in entry:
            why = entry.get("absent") or entry.get("does_not_fit")
            print(f"{name:<11} {why}")
            continue
        ranks = entry["ranks"]
        held = max(r["held_after_step"] - r["baseline"] for r in ranks)
        ratio = f"{entry['step_peak_above_baseline'] / fsdp2:7.2f}" if fsdp2 else f"{'':>7}"
        print(
            f"{name:<11} {gb(max(r['baseline'] for r in ranks))} "
            f"{gb(entry['construct_peak_above_baseline'])} {gb(entry['step_peak_above_baseline'])} "
            f"{gb(held)} {ratio} {max(r['construct_s'] for r in ranks):8.1f} "
            f"{entry['time_to_first_step_s']:10.1f} {ranks[0]['loss']:14.6f}"
        )
    target = report.get("target")
    if target:
        peak, bound = target["groupshard_step_peak_above_baseline"], target["bound_bytes"]
        verdict = "met" if target["met_bound"] else "NOT met"
        print(
            f"target: groupshard step peak {peak / GB:.2f} GB <= {bound / GB:.2f} GB "
            f"({target['formula']}): {verdict}"
        )
        if "met_fsdp2" in target:
            verdict = "met" if target["met_fsdp2"] else "NOT met"
            ratio = target["groupshard_over_fsdp2_step_peak"]
            print(f"target: groupshard / FSDP2 step peak = {ratio:.3f}: {verdict}")
            ratio = target["groupshard_over_fsdp2_time_to_first_step"]
            verdict = "met" if ratio <= 1 else "NOT met"
            print(f"target: groupshard / FSDP2 time to first step = {ratio:.3f}: {verdict}")
    for name, difference in report.get("max_loss_difference_vs_groupshard", {}).items():
        print(
            f"first-step loss, most different from groupshard's over ranks: {name} {difference:.3g}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="770m")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS),
        help=f"comma-separated, in order (default: {','.join(SYSTEMS)})",
    )  # fmt: skip
    parser.add_argument(
        "--memory-budget-gb", type=float, default=18.0,
        help="refuse a system whose estimated need for all ranks exceeds this",
    )  # fmt: skip
    parser.add_argument(
        "--mmap-threshold", type=int, metavar="BYTES",
        help="start the ranks with glibc's MALLOC_MMAP_THRESHOLD_=BYTES: a fixed "
        "threshold, so freed blocks above it go back to the system at once",
    )  # fmt: skip
    parser.add_argument(
        "--rank-timeout", type=float, default=3600.0, metavar="SECONDS",
        help="end a system's ranks (their stacks printed) if they have not finished by then",
    )  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="write the report here")
    args = parser.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {SYSTEMS}")
    if args.mmap_threshold is not None:  # the spawned ranks' glibc reads it at their start
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    report = run(args)
    print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
