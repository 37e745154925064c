"""Hugging Face's Trainer over groupshard, beside Trainer + DDP and Trainer + FSDP2: step
seconds, CPU seconds per step and peak RSS, world 2.

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/trainer.py [--model llama|tiny]
                                                              [--rounds 3] [--out FILE]

One HF ``LlamaForCausalLM`` (``--model llama``: d 512, 6 layers, 8 heads, MLP 1376, vocab
8192, 128 positions: 27M parameters, each decoder layer 12.6 MB in fp32; ``tiny``: the
suite's smoke test, whose numbers are noise), trained by ``transformers.Trainer`` with
the same TrainingArguments in every row (AdamW, lr 3e-4, weight decay 0.1 on Trainer's
decay names, cosine schedule with warm-up, ``max_grad_norm`` 1.0, 2 micro-batches of 2 x 128
tokens per rank per step, ``use_cpu=True``: gloo on these 2 cores, one thread per rank):

- **ddp**: ``transformers.Trainer`` as it is (accelerate wraps the model in DDP);
- **fsdp2**: ``transformers.Trainer`` over the model loaded with transformers' own FSDP2,
  ``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))``
  (``fully_shard`` on every decoder layer and the model; the Trainer then neither wraps
  it nor shards it again). accelerate's FSDP plugin (``fsdp=...``, ``fsdp_version=2``)
  turns FSDP on only in its GPU modes: on the CPU the Trainer runs DDP instead;
- **groupshard**: ``groupshard.integrations.transformers.Trainer`` with
  ``groupshard={"unit": LlamaDecoderLayer, "strategy": "full"}``;

and the same three with a peft LoRA model (r 16 on q/k/v/o). Every (round, row) runs in
two fresh processes (accelerate keeps one state per process), rows in an order that
rotates from round to round. A callback times each optimizer step (``on_step_begin`` to
``on_step_end``, wall and ``time.process_time``); the first step (warm-up) is left out.
Peak RSS: above the RSS just before ``train()`` (after ``malloc_trim`` and a reset of the
peak). JSON per row: medians over rounds of the slowest rank's median step seconds and of
the ranks' mean CPU seconds per step, the most peak over rounds and ranks, and every raw
value.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import fresh
import torch
from construction import _die_with_parent, _trim, peak_and_held, reset_peak, rss
from tables import fsdp2_row

HERE = Path(__file__).resolve().parent
WORLD_SIZE = 2
STEPS = 6  # the first is warm-up
ACCUMULATION = 2
BATCH = 2
MODELS = {
    "llama": {"hidden": 512, "layers": 6, "heads": 8, "mlp": 1376, "vocab": 8192, "seq": 128},
    "tiny": {"hidden": 32, "layers": 2, "heads": 2, "mlp": 64, "vocab": 64, "seq": 16},
}
SYSTEMS = ("ddp", "fsdp2", "groupshard")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
ROWS = [*SYSTEMS, *(f"{system} lora" for system in SYSTEMS)]


def build_model(shape: dict[str, int], lora: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"],
        intermediate_size=shape["mlp"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["heads"],
        max_position_embeddings=shape["seq"],
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))
    return model


class Tokens(torch.utils.data.Dataset):
    def __init__(self, shape: dict[str, int]) -> None:
        count = WORLD_SIZE * BATCH * ACCUMULATION * STEPS
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, shape["vocab"], (count, shape["seq"]), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def fsdp2_model(shape: dict[str, int], lora: bool, folder: str) -> torch.nn.Module:
    """The same model through transformers' own FSDP2: saved by rank 0, loaded with
    ``from_pretrained(distributed_config=DistributedConfig(fsdp_size=2))`` (``fully_shard``
    on every decoder layer and the model, the model's ``base_model_fsdp_plan``)."""
    import torch.distributed as dist
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    initial = os.path.join(folder, "initial")
    if dist.get_rank() == 0:
        build_model(shape, lora=False).save_pretrained(initial)
    dist.barrier()
    config = DistributedConfig(fsdp_size=WORLD_SIZE)
    model = LlamaForCausalLM.from_pretrained(initial, distributed_config=config)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))
    return model


def trainer_for(row: str, shape: dict[str, int], folder: str) -> Any:
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from groupshard.integrations import transformers as gs_transformers

    system, lora = row.split()[0], row.endswith("lora")
    args = transformers.TrainingArguments(
        output_dir=folder, use_cpu=True, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS, learning_rate=3e-4,
        weight_decay=0.1, lr_scheduler_type="cosine", warmup_steps=1, max_grad_norm=1.0,
        save_strategy="no", report_to=[], disable_tqdm=True, logging_strategy="no", seed=0,
    )  # fmt: skip
    dataset = Tokens(shape)
    if system == "fsdp2":
        model = fsdp2_model(shape, lora, folder)
        return transformers.Trainer(model=model, args=args, train_dataset=dataset)
    model = build_model(shape, lora)
    if system == "groupshard":
        return gs_transformers.Trainer(
            model=model, args=args, train_dataset=dataset,
            groupshard={"unit": LlamaDecoderLayer, "strategy": "full"},
        )  # fmt: skip
    return transformers.Trainer(model=model, args=args, train_dataset=dataset)


def check_wrapping(row: str, trainer: Any) -> None:
    """Each row runs what it says: DDP, FSDP2's DTensors, or groupshard's shards unwrapped."""
    from torch.distributed.tensor import DTensor

    system = row.split()[0]
    if system == "ddp":
        assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    elif system == "fsdp2":
        assert any(isinstance(p, DTensor) for p in trainer.model.parameters()), row
    else:
        wrapped = [trainer.model_wrapped, *trainer.accelerator._models]
        assert all(m is trainer.model for m in wrapped), "groupshard's model was wrapped"


def step_timer() -> Any:
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.cpu_seconds: list[float] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._start = (time.perf_counter(), time.process_time())

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            wall, cpu = self._start
            self.seconds.append(time.perf_counter() - wall)
            self.cpu_seconds.append(time.process_time() - cpu)

    return StepTimer()


def _worker(rank: int, row: str, model: str, port: int, folder: str, out: str) -> None:
    _die_with_parent()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    trainer = trainer_for(row, MODELS[model], folder)
    timer = step_timer()
    trainer.add_callback(timer)
    _trim()
    before = rss()
    reset_peak()
    trainer.train()
    peak, _ = peak_and_held()
    check_wrapping(row, trainer)
    result = {
        "step_s": statistics.median(timer.seconds[1:]),
        "cpu_s": statistics.median(timer.cpu_seconds[1:]),
        "peak_above_start": peak - before,
        "steps": len(timer.seconds),
        "parameters": sum(p.numel() for p in build_model(MODELS[model], False).parameters()),
    }
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_row(worker: Any, row: str, model: str, preload: tuple[str, ...]) -> list[dict[str, Any]]:
    """``worker(rank, row, model, port, folder, out)`` in two fresh processes, forked from a
    server that imported ``preload`` once for every row; each rank's JSON result
    (``out.<rank>``)."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "result")
        fresh.start_processes(
            worker, (row, model, free_port(), os.path.join(folder, "run"), out), WORLD_SIZE,
            preload=preload,
        )  # fmt: skip
        return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(WORLD_SIZE)]


def summary(per_round: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "step_s": statistics.median(max(r["step_s"] for r in ranks) for ranks in per_round),
        "cpu_s": statistics.median(
            statistics.mean(r["cpu_s"] for r in ranks) for ranks in per_round
        ),
        "peak_above_start": max(max(r["peak_above_start"] for r in ranks) for ranks in per_round),
        "per_round": per_round,
    }


def measure(
    worker: Any,
    rows: list[str],
    model: str,
    rounds: int,
    preload: tuple[str, ...] = ("transformers", "peft"),
) -> dict[str, Any]:
    """Each row ``rounds`` times, in an order that rotates from round to round; per row
    its summary over rounds. ``preload``: what the server the rows' workers fork from
    imports, once for all of them."""
    measured: dict[str, list[Any]] = {row: [] for row in rows}
    for r in range(rounds):
        for i in range(len(rows)):
            row = rows[(r + i) % len(rows)]
            measured[row].append(run_row(worker, row, model, preload))
            print(f"round {r} {row}: {measured[row][-1][0]['step_s']:.3f} s/step", flush=True)
    return {row: summary(per_round) for row, per_round in measured.items()}


def write_report(out: str, rows: dict[str, Any], **fields: Any) -> None:
    """The JSON report (kind "trainer") at ``out``, and the rows against FSDP2 printed."""
    report = {
        "kind": "trainer",
        **fields,
        "parameters": next(iter(rows.values()))["per_round"][0][0]["parameters"],
        "world_size": WORLD_SIZE,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc default"),
        "torch": torch.__version__,
        "rows": rows,
    }
    Path(out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'row':<18} {'step s':>7} {'cpu s':>7} {'peak MiB':>9} {'x fsdp2':>8}")
    for row, values in rows.items():
        base = rows.get(fsdp2_row(row))
        ratio = values["step_s"] / base["step_s"] if base else float("nan")
        print(f"{row:<18} {values['step_s']:7.3f} {values['cpu_s']:7.3f} "
              f"{values['peak_above_start'] / 2**20:9.1f} {ratio:8.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", nargs="*", default=ROWS, choices=ROWS)
    parser.add_argument("--out", help="default: benchmarks/results-<model>-trainer.json")
    args = parser.parse_args()
    rows = measure(_worker, args.rows, args.model, args.rounds)
    out = args.out or str(HERE / f"results-{args.model}-trainer.json")
    write_report(out, rows, model=args.model, shape=MODELS[args.model], rounds=args.rounds)


if __name__ == "__main__":
    main()
