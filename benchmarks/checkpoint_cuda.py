"""Checkpoints on the GPU path: NCCL, CUDA tensors, a fused AdamW (``step`` on the device),
bf16 compute. One process per GPU under torchrun (one GPU: world 1):

    torchrun --standalone --nproc-per-node $(nvidia-smi -L | wc -l) benchmarks/checkpoint_cuda.py

A ``gs.shard`` model of GPT-2 124M's shapes trains 2 steps, is saved with torch's idiom
(``get_state_dict`` + ``dcp.save``) and with ``gs.checkpoint``, and each folder is loaded
into a differently seeded model: the loaded weights and optimizer state must equal the
saved ones bit for bit, on the device they started on (``step`` of the fused AdamW on the
GPU as float32, as ``Optimizer.load_state_dict`` places it). ``full_state_dict`` with
``cpu_offload`` must give CPU tensors on rank 0 only. Prints one line per check and the
seconds of each save and load; exits 1 if a check fails.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

import groupshard as gs
from groupshard.cli.model import GPT, Block, GPTConfig

GPT2 = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)


def build(seed: int, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    with torch.device(device):
        model = GPT(GPT2)
    precision = gs.MixedPrecision(param_dtype=torch.bfloat16)
    model = gs.shard(
        model, gs.decay_groups(model, 0.1), unit=Block, mixed_precision=precision
    )
    optimizer = torch.optim.AdamW(model.optimizer_groups(), lr=3e-4, fused=True)
    tokens = torch.randint(0, GPT2.vocab_size, (2, 257), device=device)
    for _ in range(2):
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def snapshot(model, optimizer) -> tuple[dict, dict]:
    optim = gs.optim_state_dict(model, optimizer)
    return gs.full_state_dict(model), {
        fqn: {k: v.clone() for k, v in keys.items()} for fqn, keys in optim["state"].items()
    }


def difference(first, second) -> float:
    (model_a, optim_a), (model_b, optim_b) = first, second
    worst = max((model_a[k].float() - model_b[k].float()).abs().max().item() for k in model_a)
    for fqn, keys in optim_a.items():
        for key, value in keys.items():
            other = optim_b[fqn][key]
            if value.device != other.device or value.dtype != other.dtype:
                return float("inf")
            worst = max(worst, (value.float() - other.float()).abs().max().item())
    return worst


def main() -> int:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    folder = tempfile.mkdtemp() if rank == 0 else None
    shared = [folder]
    dist.broadcast_object_list(shared)
    folder = shared[0]
    failures = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        if rank == 0:
            print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
        if not ok:
            failures.append(name)

    model, optimizer = build(0, device)
    saved = snapshot(model, optimizer)
    step = next(iter(optimizer.state.values()))["step"]
    check("fused AdamW's step is on the GPU", step.device.type == "cuda", str(step.device))

    for how in ("torch idiom", "gs.checkpoint"):
        path = os.path.join(folder, how.replace(" ", "-"))
        torch.cuda.synchronize()
        start = time.perf_counter()
        if how == "torch idiom":
            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
        else:
            gs.checkpoint.save(path, model, optimizer)
        torch.cuda.synchronize()
        saved_s = time.perf_counter() - start
        target, target_optimizer = build(1, device)
        start = time.perf_counter()
        if how == "torch idiom":
            model_state, optim_state = get_state_dict(target, target_optimizer)
            state = {"model": model_state, "optim": optim_state}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(target, target_optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])  # fmt: skip
        else:
            gs.checkpoint.load(path, target, target_optimizer)
        torch.cuda.synchronize()
        loaded_s = time.perf_counter() - start
        found = difference(saved, snapshot(target, target_optimizer))
        check(f"{how}: loaded equals saved, on the same devices", found == 0.0,
              f"(max difference {found}; save {saved_s:.2f} s, load {loaded_s:.2f} s)")  # fmt: skip

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    on_cpu = all(v.device.type == "cpu" for v in full.values())
    check("full_state_dict + cpu_offload: CPU tensors on rank 0, {} elsewhere",
          (on_cpu and len(full) > 0) if rank == 0 else full == {})  # fmt: skip
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
