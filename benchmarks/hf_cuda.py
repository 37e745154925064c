"""The Hugging Face integrations on a GPU (NCCL, CUDA, bf16, fp16 with gs.GradScaler): the
checks the CPU suite cannot make. One process per GPU:

    torchrun --standalone --nproc-per-node 1 benchmarks/hf_cuda.py [--out FILE]

Each check prints one line and goes into the JSON (``ok`` per check). With one GPU the
world is 1: what is checked is the CUDA path of each door (device spellings, the mixed
precision and loss scaler they choose, checkpoints and resume), not cross-rank
communication, which the CPU suite checks at world 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import groupshard as gs
import hf_cases as cases
from groupshard.integrations.transformers import Trainer
from groupshard.scaler import GradScaler

DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def trainer(folder: str, seed: int = 0, **overrides: Any) -> Trainer:
    return Trainer(
        model=cases.tiny_llama(seed),
        args=cases.arguments(folder, use_cpu=False, **overrides),
        train_dataset=cases.Tokens(),
        groupshard={"unit": cases.decoder_layer(), "strategy": "full"},
    )


def fp32_equals_plain_trainer(folder: str) -> dict[str, Any]:
    from transformers import Trainer as PlainTrainer

    plain = PlainTrainer(
        model=cases.tiny_llama(),
        args=cases.arguments(os.path.join(folder, "plain"), use_cpu=False),
        train_dataset=cases.Tokens(),
    )
    plain.train()
    mine = trainer(os.path.join(folder, "gs"))
    mine.train()
    difference = cases.difference(cases.weights(mine.model), cases.weights(plain.model))
    devices = sorted({str(p.device) for p in mine.model.parameters()})
    return {"difference": difference, "devices": devices,
            "ok": difference < 1e-5 and devices == [str(DEVICE)]}  # fmt: skip


def bf16(folder: str) -> dict[str, Any]:
    run = trainer(folder, bf16=True)
    run.train()
    policies = sorted(
        {str(u.policy.param_dtype) for u in run.model.groupshard.runtime.units if u.policy}
    )
    losses = cases.losses(run)
    finite = bool(torch.isfinite(torch.tensor(losses)).all())
    return {"policies": policies, "losses": losses,
            "ok": policies == ["torch.bfloat16"] and finite and len(losses) == 4}  # fmt: skip


def fp16_resumes_exactly(folder: str) -> dict[str, Any]:
    """fp16 with gs.GradScaler as accelerate's scaler; stopped at its step-2 checkpoint
    and resumed (scaler state included), equal to the whole run."""
    whole = trainer(os.path.join(folder, "whole"), fp16=True)
    whole.train()
    first = trainer(os.path.join(folder, "parts"), fp16=True, save_strategy="steps", save_steps=2)
    first.train()
    resumed = trainer(os.path.join(folder, "parts"), seed=3, fp16=True)
    resumed.train(resume_from_checkpoint=os.path.join(folder, "parts", "checkpoint-2"))
    difference = cases.difference(cases.weights(resumed.model), cases.weights(whole.model))
    scaler = whole.accelerator.scaler
    return {"scaler": type(scaler).__name__, "scale": scaler.get_scale(),
            "difference": difference,
            "ok": isinstance(scaler, GradScaler) and difference == 0.0}  # fmt: skip


def accelerate_loops(precision: str) -> tuple[list[float], list[str]]:
    """The same accelerate loop unsharded and through prepare with a sharded model: the
    weights' difference after each of 4 optimizer steps, and the loss scalers used."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from groupshard.integrations.accelerate import prepare

    runs = []
    for sharded in (False, True):
        AcceleratorState._reset_state(reset_partial_state=False)
        accelerator = Accelerator(mixed_precision=precision, gradient_accumulation_steps=2)
        model = cases.tiny_llama().to(accelerator.device)
        if sharded:
            model = gs.shard(model, gs.decay_groups(model, 0.1), unit=cases.decoder_layer())
            optimizer = torch.optim.AdamW(model.optimizer_groups(), lr=1e-2)
        else:
            optimizer = torch.optim.AdamW(gs.decay_groups(model, 0.1), lr=1e-2)
        loader = torch.utils.data.DataLoader(cases.Tokens(), batch_size=2)
        objects = (model, optimizer, loader)
        model, optimizer, loader = (
            prepare(accelerator, *objects) if sharded else accelerator.prepare(*objects)
        )
        after_steps = []
        for index, batch in enumerate(loader):
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                after_steps.append(cases.weights(model))
            if index == 7:
                break
        scaler = accelerator.scaler
        runs.append((after_steps, f"{type(scaler).__module__}.{type(scaler).__name__}"))
    differences = [cases.difference(a, b) for a, b in zip(runs[0][0], runs[1][0], strict=True)]
    return differences, [scaler for _, scaler in runs]


def accelerate_fp32(folder: str) -> dict[str, Any]:
    """An accelerate loop over a sharded model equals the same loop unsharded on CUDA."""
    differences, _ = accelerate_loops("no")
    return {"differences": differences, "ok": max(differences) < 1e-5}


def accelerate_fp16(folder: str) -> dict[str, Any]:
    """With mixed_precision="fp16": autocast (the model has no gs.MixedPrecision) and
    gs.GradScaler as the loss scaler. The first step equals the unsharded loop's to fp32's
    last bit, as in fp32; after it fp16's rounding of the activations amplifies that bit
    (measured: 7e-9 after step 1, then 3e-6, 3e-5, 6e-5, where fp32 stays at 5e-7), so
    the check is the first step's."""
    differences, scalers = accelerate_loops("fp16")
    ours = scalers[1] == "groupshard.scaler.GradScaler"
    return {"differences": differences, "scalers": scalers,
            "ok": ours and differences[0] < 1e-7}  # fmt: skip


def device_spellings(folder: str) -> dict[str, Any]:
    """.to() / .cuda() to the shards' own GPU in every spelling: no-ops; a real move raises;
    DDP around the sharded model raises."""
    model = cases.tiny_llama().to(DEVICE)
    model = gs.shard(model, gs.decay_groups(model, 0.1), unit=cases.decoder_layer())
    pointers = [s.local.data_ptr() for s in model.groupshard.storages]
    for move in ("cuda", f"cuda:{DEVICE.index}", DEVICE, torch.device("cuda")):
        model.to(move)
    model.cuda()
    model.cuda(DEVICE.index)
    kept = [s.local.data_ptr() for s in model.groupshard.storages] == pointers
    refused = []
    for call in (lambda: model.to("cpu"), lambda: model.cpu(),
                 lambda: torch.nn.parallel.DistributedDataParallel(model)):  # fmt: skip
        try:
            call()
            refused.append(False)
        except (ValueError, TypeError):
            refused.append(True)
    ids = cases.Tokens()[0]["input_ids"][None].to(DEVICE)
    loss = model(input_ids=ids, labels=ids).loss
    return {"kept": kept, "refused": refused, "loss": loss.item(),
            "ok": kept and all(refused) and bool(torch.isfinite(loss))}  # fmt: skip


CHECKS = {
    "fp32 equals the plain Trainer": fp32_equals_plain_trainer,
    "bf16 computes in bf16": bf16,
    "fp16 with gs.GradScaler resumes exactly": fp16_resumes_exactly,
    "accelerate fp32 equals unsharded": accelerate_fp32,
    "accelerate fp16 with gs.GradScaler": accelerate_fp16,
    "device spellings and guards": device_spellings,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="hf-cuda.json")
    parser.add_argument("--only", nargs="*", default=list(CHECKS))
    args = parser.parse_args()
    torch.cuda.set_device(DEVICE)
    dist.init_process_group("nccl", device_id=DEVICE)
    results = {"torch": torch.__version__, "device": torch.cuda.get_device_name(DEVICE)}
    import accelerate
    import transformers

    results["transformers"] = transformers.__version__
    results["accelerate"] = accelerate.__version__
    for name in args.only:
        with tempfile.TemporaryDirectory() as folder:
            try:
                results[name] = CHECKS[name](folder)
            except Exception as error:  # one check's failure must not hide the others
                results[name] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        print(f"{name}: {'ok' if results[name]['ok'] else 'FAILED'} {results[name]}", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1, default=str) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
