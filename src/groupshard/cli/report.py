"""What a person sees at the end of a run: a plot and a short summary."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_log(out: Path) -> list[dict[str, Any]]:
    lines = (out / "log.jsonl").read_text().splitlines() if (out / "log.jsonl").exists() else []
    return [json.loads(line) for line in lines if line.strip()]


def write_csv(out: Path, rows: list[dict[str, Any]]) -> None:
    columns = sorted({key for row in rows for key in row}, key=lambda k: (k != "step", k))
    lines = [",".join(columns)]
    lines += [",".join("" if row.get(c) is None else str(row[c]) for c in columns) for row in rows]
    _write_atomically(out / "log.csv", "\n".join(lines) + "\n")


def keep_rows_up_to(out: Path, step: int) -> None:
    """Drop the log rows after ``step``: a run resumed from the checkpoint of ``step`` logs
    them again. A row cut short by a kill can only follow the checkpoint's row."""
    log = out / "log.jsonl"
    if not log.exists():
        return
    kept = []
    for line in log.read_text().splitlines():
        try:
            if json.loads(line)["step"] > step:
                break
        except json.JSONDecodeError:
            break
        kept.append(line + "\n")
    _write_atomically(log, "".join(kept))
    if (out / "log.csv").exists():
        write_csv(out, read_log(out))


def _write_atomically(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never a part (a kill can come any time)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def plot(out: Path, rows: list[dict[str, Any]]) -> Path:
    """Training and validation loss, and the gradient norm of each group, over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_axis, norm_axis) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in rows]
    loss_axis.plot(steps, [r["loss"] for r in rows], label="train")
    validation = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    if validation:
        loss_axis.plot(*zip(*validation, strict=True), "o-", label="validation")
    loss_axis.set(xlabel="step", ylabel="cross-entropy (nats/byte)", title="loss")
    loss_axis.legend()
    for key in sorted(k for k in rows[0] if k.startswith("grad_norm/")):
        norm_axis.plot(steps, [r[key] for r in rows], label=key.removeprefix("grad_norm/"))
    norm_axis.set(xlabel="step", ylabel="gradient 2-norm", title="gradient norm per param group",
                  yscale="log")  # fmt: skip
    norm_axis.legend()
    figure.tight_layout()
    path = out / "training.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def finish(out: Path, summary: dict[str, Any]) -> None:
    """Write the CSV and the plot, and print the summary (rank 0)."""
    rows = read_log(out)
    if rows:
        write_csv(out, rows)
        plot(out, rows)
    final = rows[-1] if rows else {}
    validation = next((r["val_loss"] for r in reversed(rows) if "val_loss" in r), None)
    shown = "not measured yet" if validation is None else f"{validation:.4f}"
    rss = ", ".join(f"{b / 2**20:.0f}" for b in summary["peak_rss_bytes_per_rank"])
    print(
        f"{summary['status']} at step {summary['step']}/{summary['steps']}: loss "
        f"{final.get('loss', float('nan')):.4f}, validation loss "
        f"{shown}\n"
        f"{summary['tokens_per_s']:.0f} tokens/s on {summary['world_size']} ranks, "
        f"peak memory per rank {rss} MiB, parameters per rank "
        f"{summary['parameters_per_rank']:,} of {summary['parameters_total']:,}\n"
        f"outputs in {out}/: log.jsonl, log.csv, training.png, summary.json, checkpoint/",
        flush=True,
    )
