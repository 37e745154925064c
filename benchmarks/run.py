"""The project benchmark: the same training step, every system, interleaved in one run.

    python benchmarks/run.py [--model 4m|small-params|30m|tiny] [--world-size 2] [--rounds 10]
                             [--device cpu|cuda] [--rss]

Systems: DDP, torch ZeroRedundancyOptimizer + DDP, FSDP2 (``fully_shard`` per block
and root), FSDP1 (``use_orig_params``, per block), DeepSpeed ZeRO 1/2/3 (when
installed: ``pip install -e ".[bench]"``), groupshard full / grad_op / no_shard /
ZeRO + DDP / full with 8 groups, and LAMB: groupshard vs FSDP2 + per-parameter
LAMB. All get the same two groups (decay / no decay), AdamW unless named.

Per system: median step time after warm-up and its ratio to FSDP2, tokens/s, the
optimizer step alone, bytes of parameters + gradients + optimizer state held per
rank against the ideal (total / N) and the most unsharded parameter bytes held at
once (groupshard and FSDP2), collectives and bytes per step (the ``c10d::`` ops
torch.profiler records on a warm step), with ``--rss`` the peak RSS per rank (the
peak GPU memory on cuda; each system again in fresh processes, so peaks are its
own), and the largest parameter difference from single-process training after the
run. Output: a table and a JSON file.

On CPU the ranks talk over gloo with one thread each; with ``--device cuda`` (the
default where there are 2 or more GPUs) each rank takes one GPU and NCCL. gloo
carries out a reduce-scatter as a full all-reduce, so on CPU every sharded system
pays more for gradients than it would over NCCL.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import groupshard as gs
from groupshard.model import GPT, Block, GPTConfig

MODELS = {
    "4m": (GPTConfig(vocab_size=4096, block_size=128, n_layer=4, n_head=8, n_embd=256), 8),
    "small-params": (GPTConfig(vocab_size=256, block_size=64, n_layer=16, n_head=4, n_embd=64), 8),
    "30m": (GPTConfig(vocab_size=8192, block_size=256, n_layer=8, n_head=8, n_embd=512), 4),
    "tiny": (GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32), 2),
}
LR = 1e-3


class PerParameterLAMB(torch.optim.Optimizer):
    """A straightforward LAMB, one tensor at a time; on DTensors each norm is a collective."""

    def __init__(self, params: Any, lr: float = LR, eps: float = 1e-6, weight_decay: float = 0.01):
        super().__init__(
            params, dict(lr=lr, betas=(0.9, 0.999), eps=eps, weight_decay=weight_decay)
        )

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat = state["exp_avg"] / (1 - beta1 ** state["step"])
                v_hat = state["exp_avg_sq"] / (1 - beta2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = p.norm(), update.norm()
                if hasattr(w_norm, "full_tensor"):
                    w_norm, u_norm = w_norm.full_tensor(), u_norm.full_tensor()
                trust = (w_norm / u_norm).item() if w_norm > 0 and u_norm > 0 else 1.0
                p.add_(update, alpha=-group["lr"] * trust)


# --- the systems --------------------------------------------------------------------


def _adamw(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=LR)


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    return gs.decay_groups(model, 0.1)


def _eight_groups(model: nn.Module) -> list[dict[str, Any]]:
    order = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    return [
        {**group, "params": [p for p in group["params"]]}
        for group in gs.groups_by(
            model,
            lambda name, p: (p.ndim >= 2, order[name] % 4),
            {(d, k): {"weight_decay": 0.1 if d else 0.0} for d in (True, False) for k in range(4)},
        )
    ]


def ddp(base: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = copy.deepcopy(base)
    return DDP(model), _adamw(_groups(model))


def torch_zero(base: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = copy.deepcopy(base)
    decay, no_decay = _groups(model)
    optimizer = ZeroRedundancyOptimizer(
        decay["params"], torch.optim.AdamW, lr=LR, weight_decay=0.1, parameters_as_bucket_view=True
    )
    optimizer.add_param_group(no_decay)  # its constructor takes one group
    return DDP(model), optimizer


def fsdp2(base: nn.Module, lamb: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(base)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    groups = _groups(model)
    return model, PerParameterLAMB(groups) if lamb else _adamw(groups)


def fsdp1(base: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = FSDP(
        copy.deepcopy(base), auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=True, device_id=_device(),
    )  # fmt: skip
    return model, _adamw(_groups(model))


def groupshard(
    strategy: str,
    lamb: bool = False,
    groups: Callable[[nn.Module], Any] = _groups,
    prefetch_bytes: int = 25 * 2**20,
) -> Callable[[nn.Module], tuple[nn.Module, torch.optim.Optimizer]]:
    def build(base: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = copy.deepcopy(base)
        model = gs.shard(
            model, groups(model), unit=Block, strategy=strategy, prefetch_bytes=prefetch_bytes
        )
        if lamb:
            return model, gs.optim.LAMB(model.optimizer_groups(), lr=LR)
        return model, _adamw(model.optimizer_groups())

    return build


def groupshard_zero(base: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = copy.deepcopy(base)
    optimizer = gs.ZeroRedundancyOptimizer(
        _groups(model), torch.optim.AdamW, lr=LR, parameters_as_bucket_view=True
    )
    return DDP(model), optimizer


def deepspeed_stage(stage: int) -> Callable[[nn.Module], tuple[nn.Module, Any]]:
    def build(base: nn.Module) -> tuple[nn.Module, Any]:
        import deepspeed

        model = copy.deepcopy(base)
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
        }
        groups = _groups(model)
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, config=config, model_parameters=groups, dist_init_required=False
        )
        return engine, optimizer

    return build


def _deepspeed_available() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:
        return False
    return True


def systems(lamb: bool = True) -> dict[str, Callable[[nn.Module], tuple[nn.Module, Any]]]:
    table: dict[str, Callable[[nn.Module], tuple[nn.Module, Any]]] = {
        "DDP": ddp,
        "torch ZeRO + DDP": torch_zero,
        "FSDP2": fsdp2,
        "FSDP1": fsdp1,
    }
    if _deepspeed_available():
        for stage in (1, 2, 3):
            table[f"DeepSpeed ZeRO-{stage}"] = deepspeed_stage(stage)
    table.update({
        "groupshard full": groupshard("full"),
        "groupshard grad_op": groupshard("grad_op"),
        "groupshard no_shard": groupshard("no_shard"),
        "groupshard ZeRO + DDP": groupshard_zero,
        "groupshard full, 8 groups": groupshard("full", groups=_eight_groups),
        "groupshard full, prefetch 0": groupshard("full", prefetch_bytes=0),
    })  # fmt: skip
    if lamb:
        table["groupshard full + LAMB"] = groupshard("full", lamb=True)
        table["FSDP2 + per-parameter LAMB"] = lambda base: fsdp2(base, lamb=True)
    return table


# --- measuring ---------------------------------------------------------------------------


def _batches(config: GPTConfig, batch: int, world_size: int, count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    shape = (batch * world_size, config.block_size + 1)
    return [torch.randint(0, config.vocab_size, shape, generator=generator) for _ in range(count)]


def _device() -> torch.device:
    """Where this rank computes: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _now() -> float:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def _is_deepspeed(model: Any) -> bool:
    return hasattr(model, "zero_optimization_stage")


def _backward(model: Any, loss: torch.Tensor) -> None:
    """The backward pass (a DeepSpeed engine runs its own, into its own gradient buffers)."""
    if _is_deepspeed(model):
        model.backward(loss)
    else:
        loss.backward()


def _optimizer_step(model: Any, optimizer: Any) -> None:
    if _is_deepspeed(model):
        model.step()
    else:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _step(model: Any, optimizer: Any, tokens: torch.Tensor) -> tuple[float, float]:
    """One training step; returns (total seconds, optimizer seconds)."""
    started = _now()
    _backward(model, model(tokens[:, :-1], tokens[:, 1:]))
    optimizer_started = _now()
    _optimizer_step(model, optimizer)
    finished = _now()
    return finished - started, finished - optimizer_started


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def _fsdp2_unsharded_bytes(model: nn.Module) -> int:
    """Bytes of unsharded parameters FSDP2 holds now (its freed buffers have empty storage)."""
    from torch.distributed.fsdp import FSDPModule

    held = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group is not None else ():
            held += sum(t.untyped_storage().nbytes() for t in fsdp_param.all_gather_outputs)
    return held


@contextlib.contextmanager
def _gathered_peak(model: Any) -> Iterator[Callable[[], int | None]]:
    """The most unsharded parameter bytes held at once while inside: groupshard's own
    count, FSDP2's sampled after each of its unshards (gathered memory only grows there);
    ``None`` for other systems."""
    runtime = model.groupshard.runtime if hasattr(model, "groupshard") else None
    if runtime is not None:
        runtime.peak_gathered_bytes = 0
        yield lambda: runtime.peak_gathered_bytes
        return
    if not hasattr(model, "_get_fsdp_state"):
        yield lambda: None
        return
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    peak = [0]
    original = FSDPParamGroup.wait_for_unshard

    def sampled(self: FSDPParamGroup) -> None:
        original(self)
        peak[0] = max(peak[0], _fsdp2_unsharded_bytes(model))

    with mock.patch.object(FSDPParamGroup, "wait_for_unshard", sampled):
        yield lambda: peak[0]


def _held_bytes(model: Any, optimizer: Any, tokens: torch.Tensor) -> dict[str, int | None]:
    """Bytes of parameters, gradients and optimizer state this rank holds at the end of a
    backward, and the most unsharded parameter bytes held at once during the step."""
    with _gathered_peak(model) as gathered_peak:
        _backward(model, model(tokens[:, :-1], tokens[:, 1:]))
        held = _counted_bytes(model, optimizer)
        _optimizer_step(model, optimizer)
        held["gathered_peak"] = gathered_peak()
    return held


def _counted_bytes(model: Any, optimizer: Any) -> dict[str, int | None]:
    params = [p for p in model.parameters()]
    if hasattr(model, "groupshard"):
        params = [s for storage in model.groupshard.storages for s in storage.shards]
    grads = [p.grad for p in params if p.grad is not None]
    grads += getattr(optimizer, "gradient_slices", [])  # groupshard ZeRO's, kept between steps
    inner = getattr(optimizer, "optim", optimizer)
    states = [
        v
        for state in getattr(inner, "state", {}).values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    if hasattr(optimizer, "fp32_partitioned_groups_flat") or hasattr(
        optimizer, "single_partition_of_fp32_groups"
    ):
        states = [v for state in optimizer.optimizer.state.values() for v in state.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0]  # fmt: skip
    return {"params": _unique_bytes(params), "grads": _unique_bytes(grads),
            "state": _unique_bytes(states)}  # fmt: skip


def _groupshard_volume() -> tuple[dict[str, Any], list[float]]:
    """Patches for groupshard's comm functions that add up the bytes each rank moves,
    with the ideal algorithm for each collective: (N-1)/N of the gathered or scattered
    buffer, twice that for an all-reduce."""
    from groupshard import comm

    moved = [0.0]

    def counting(name: str, factor: float, which: int) -> Any:
        original = getattr(comm, name)

        def wrapper(*args: Any) -> Any:
            tensor, ranks = args[which], args[-1]
            moved[0] += (
                factor * tensor.numel() * tensor.element_size() * (ranks.size - 1) / ranks.size
            )
            return original(*args)

        return wrapper

    patches = {
        "all_gather": counting("all_gather", 1.0, 0),
        "reduce_scatter_mean": counting("reduce_scatter_mean", 1.0, 1),
        "all_reduce_mean": counting("all_reduce_mean", 2.0, 0),
        "all_reduce_sum": counting("all_reduce_sum", 2.0, 0),
    }
    return patches, moved


SIZED_OPS = {"c10d::_allgather_base_": 0, "c10d::_reduce_scatter_base_": 1}
"""c10d ops whose sizes torch.profiler records: index of the whole (unsharded) buffer
among their inputs. Ops on tensor lists (all-reduce, broadcast) record no shapes."""


def _profiled_bytes(events: list[Any], world_size: int, element_size: int) -> float | None:
    """Bytes per rank the recorded c10d ops move with ideal algorithms ((N-1)/N of each
    gathered or scattered buffer), or None when some op recorded no sizes."""
    moved = 0.0
    for event in events:
        whole = SIZED_OPS.get(event.name)
        if whole is None or not event.input_shapes[whole]:
            return None
        numel = 1
        for dim in event.input_shapes[whole]:
            numel *= dim
        moved += numel * element_size * (world_size - 1) / world_size
    return moved


def _collectives(model: Any, optimizer: Any, tokens: torch.Tensor) -> dict[str, Any]:
    """The c10d ops of one warm step, as torch.profiler records them, and the bytes moved
    per rank: for groupshard counted in its comm functions, for others from the sizes
    the profiler records (all-gather and reduce-scatter only; None otherwise)."""
    from torch.profiler import ProfilerActivity, profile

    from groupshard import comm

    patches, moved = _groupshard_volume()
    with (
        mock.patch.multiple(comm, **patches),
        profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof,
    ):
        _step(model, optimizer, tokens)
    events = [
        event
        for event in prof.events()
        if event.name.startswith("c10d::") and not event.name.startswith("c10d::barrier")
    ]
    ops: dict[str, int] = {}
    for event in events:
        ops[event.name] = ops.get(event.name, 0) + 1
    element_size = next(iter(model.parameters())).element_size()
    profiled = _profiled_bytes(events, dist.get_world_size(), element_size)
    return {"count": len(events), "ops": ops, "groupshard_bytes": moved[0] or None,
            "profiled_bytes": profiled}  # fmt: skip


def _full_params(name: str, model: Any) -> dict[str, torch.Tensor]:
    if hasattr(model, "groupshard"):
        return {k: v for k, v in gs.full_state_dict(model).items()}
    if name.startswith("DeepSpeed"):
        import deepspeed

        params = list(model.module.parameters())
        with deepspeed.zero.GatheredParameters(
            params, enabled=model.zero_optimization_stage() == 3
        ):
            return {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    if name == "FSDP1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model):
            return {k.replace("_fsdp_wrapped_module.", ""): v.detach().clone()
                    for k, v in model.state_dict().items()}  # fmt: skip
    state = getattr(model, "module", model).state_dict()
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in state.items()
    }


def _reference(base: nn.Module, batches: list[torch.Tensor], lamb: bool) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(base)
    optimizer = gs.optim.LAMB(_groups(model), lr=LR) if lamb else _adamw(_groups(model))
    for tokens in batches:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
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
    base = GPT(config).to(_device())
    table = systems(lamb=not args.no_lamb)
    if args.only:
        table = {args.only: table[args.only]}
    built = {name: build(base) for name, build in table.items()}
    steps = args.warmup + args.rounds + 2  # + one profiled step + one measured for memory
    batches = [b.to(_device()) for b in _batches(config, batch, args.world_size, steps)]
    local = slice(rank * batch, (rank + 1) * batch)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in built}
    for index in range(args.warmup + args.rounds):
        for name, (model, optimizer) in built.items():
            dist.barrier()
            elapsed = _step(model, optimizer, batches[index][local])
            if index >= args.warmup:
                times[name].append(elapsed)
    results: dict[str, Any] = {}
    for name, (model, optimizer) in built.items():
        dist.barrier()
        results[name] = {"collectives": _collectives(model, optimizer, batches[-2][local])}
        results[name]["held_bytes"] = _held_bytes(model, optimizer, batches[-1][local])
        if times[name]:
            results[name]["step_ms"] = statistics.median(t for t, _ in times[name]) * 1e3
            results[name]["optimizer_ms"] = statistics.median(o for _, o in times[name]) * 1e3
        results[name]["tokens_per_s"] = (
            batch
            * args.world_size
            * config.block_size
            / (results[name].get("step_ms", float("nan")) / 1e3)
        )
    results["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if torch.cuda.is_initialized():
        results["peak_rss_bytes"] = torch.cuda.max_memory_allocated()  # the GPU's, not the host's
    if not args.only:
        references = {lamb: _reference(base, batches, lamb) for lamb in (False, True)}
        for name, (model, _) in built.items():
            full = _full_params(name, model)
            expected = references["LAMB" in name]
            results[name]["max_difference"] = max(
                (full[k].double().cpu() - expected[k].double().cpu()).abs().max().item()
                for k in expected
            )
    gathered = [None] * args.world_size
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(result_path, "w") as handle:
            json.dump(gathered, handle)
    dist.destroy_process_group()


def _spawn(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="groupshard-bench-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        try:
            mp.start_processes(_worker, args=(args, os.path.join(tmp, "store"), result_path),
                               nprocs=args.world_size, start_method="spawn")  # fmt: skip
        except mp.ProcessExitedException:
            # Some systems' threads abort the process at exit (after the results are written).
            if not os.path.exists(result_path):
                raise
        with open(result_path) as handle:
            return json.load(handle)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every system interleaved in one process group, then each alone for its peak RSS."""
    per_rank = _spawn(args)
    names = [n for n in per_rank[0] if n != "peak_rss_bytes"]
    report: dict[str, Any] = {"model": args.model, "world_size": args.world_size,
                              "device": args.device,
                              "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                                         f"{platform.python_version()}, torch {torch.__version__}",
                              "rows": {}}  # fmt: skip
    config, _ = MODELS[args.model]
    total = sum(p.numel() for p in GPT(config).parameters()) * 4
    for name in names:
        row = dict(per_rank[0][name])
        row["held_bytes_per_rank"] = [
            sum(v for k, v in r[name]["held_bytes"].items() if k != "gathered_peak")
            for r in per_rank
        ]  # parameters + gradients + optimizer state
        row["ideal_bytes_per_rank"] = 4 * total // args.world_size  # AdamW: 2 states
        report["rows"][name] = row
    if args.rss:
        for name in names:
            single = argparse.Namespace(**{**vars(args), "only": name, "warmup": 1, "rounds": 2})
            report["rows"][name]["peak_rss_bytes_per_rank"] = [
                r["peak_rss_bytes"] for r in _spawn(single)
            ]
    fsdp2_ms = report["rows"].get("FSDP2", {}).get("step_ms")
    for row in report["rows"].values():
        row["ratio_to_fsdp2"] = row["step_ms"] / fsdp2_ms if fsdp2_ms else None
    return report


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
    print(f"{'system':28s} " + " ".join(f"{c:>{w}s}" for c, w in zip(columns, widths, strict=True)))
    for name, row in report["rows"].items():
        held = max(row["held_bytes_per_rank"]) / 2**20
        rss = row.get("peak_rss_bytes_per_rank")
        print(
            f"{name:28s} {row['step_ms']:8.1f} {row['ratio_to_fsdp2'] or float('nan'):7.2f} "
            f"{row['tokens_per_s']:8.0f} {row['optimizer_ms']:9.1f} {held:13.2f} "
            f"{(row['held_bytes'].get('gathered_peak') or nan) / 2**20:11.2f} "
            f"{row['collectives']['count']:9d} "
            f"{(_moved_bytes(row) or nan) / 2**20:8.2f} "
            f"{(max(rss) / 2**20) if rss else float('nan'):12.0f} "
            f"{row.get('max_difference', float('nan')):9.1e}"
        )
    print("moved MB: bytes per rank with ideal algorithms, through groupshard's collectives or "
          "from the sizes torch.profiler records\n(only all-gathers and reduce-scatters have them);"
          " 3 x parameter bytes x (N-1)/N for full.\ngloo runs a reduce-scatter as a full "
          "all-reduce: sharded systems pay more for gradients on CPU than over NCCL.")  # fmt: skip


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
        "--rss", action="store_true", help="also measure each system's peak RSS alone"
    )
    parser.add_argument("--json", default="benchmark.json", help="where to write the results")
    parser.add_argument("--only", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    report = run(args)
    with open(args.json, "w") as handle:
        json.dump(report, handle, indent=1)
    print_table(report)
    print(f"results in {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
