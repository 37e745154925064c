"""What a person sees at the end of a run: a plot and a short summary."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def read_log(out: Path) -> list[dict[str, Any]]:
    """The rows of ``out``'s log.jsonl; a null (a number that was not finite) reads as NaN."""
    lines = (out / "log.jsonl").read_text().splitlines() if (out / "log.jsonl").exists() else []
    rows = [json.loads(line) for line in lines if line.strip()]
    return [{key: math.nan if value is None else value for key, value in r.items()} for r in rows]


def to_json(value: Any, indent: int | None = None) -> str:
    """``value`` as standard JSON. JSON has no NaN or Infinity (Python's json writes them
    anyway, and strict readers reject them), so a non-finite number is written as null."""
    return json.dumps(_nonfinite_to_none(value), indent=indent, allow_nan=False)


def _nonfinite_to_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _nonfinite_to_none(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_nonfinite_to_none(item) for item in value]
    return value


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


def plot(out: Path, rows: list[dict[str, Any]], summary: dict[str, Any] | None = None) -> Path:
    """Three panels over steps: the loss (training, raw and smoothed; validation; the
    baselines), each group's gradient norm with the clipping threshold, and each group's
    learning rate; the run's settings (from ``summary``) in the title."""
    # a Figure of its own, not pyplot's: no GUI backend or global figure list to import
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    summary = summary or {}
    config = summary.get("config", {})
    figure = Figure(figsize=(16, 4.8))
    loss_axis, norm_axis, lr_axis = figure.subplots(1, 3)
    # fixed margins that fit the labels: tight_layout measured every text first, 0.3 s of
    # the 0.7 s this plot took at the end of each run
    figure.subplots_adjust(left=0.045, right=0.99, bottom=0.11, top=0.86, wspace=0.22)
    steps = [r["step"] for r in rows]
    losses = [r["loss"] for r in rows]
    loss_axis.plot(steps, losses, color="C0", alpha=0.3, linewidth=0.8, label="train")
    loss_axis.plot(steps, smoothed(losses), color="C0", label="train, smoothed")
    validation = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    if validation:
        loss_axis.plot(*zip(*validation, strict=True), "o-", color="C1", label="validation")
    for name, value in summary.get("baselines", {}).items():
        style = {"uniform": ":", "bigram": "--"}.get(name, "-.")
        label = f"{name} baseline {value:.2f}"
        loss_axis.axhline(value, color="gray", linestyle=style, label=label)
    loss_axis.set(xlabel="step", ylabel="cross-entropy (nats/byte)", title="loss")
    loss_axis.legend(fontsize="small")

    # a group that gs.regroup added mid-run (--freeze-embeddings-until) appears in later rows
    groups = list(dict.fromkeys(
        k.removeprefix("grad_norm/") for r in rows for k in r if k.startswith("grad_norm/")
    ))  # fmt: skip
    for index, group in enumerate(groups):
        having = [r for r in rows if f"grad_norm/{group}" in r]
        norm_axis.plot([r["step"] for r in having], [r[f"grad_norm/{group}"] for r in having],
                       color=f"C{index}", linewidth=1, label=group)  # fmt: skip
    if len(groups) > 1:
        total = [
            math.sqrt(sum(r[f"grad_norm/{g}"] ** 2 for g in groups if f"grad_norm/{g}" in r))
            for r in rows
        ]
        norm_axis.plot(steps, total, color="0.6", linewidth=2.5, zorder=1, label="all groups")
    if config.get("clip", 0) > 0:
        norm_axis.axhline(config["clip"], color="red", linestyle="--",
                          label=f"clip threshold {config['clip']:g} (all groups)")  # fmt: skip
    norm_axis.set(xlabel="step", ylabel="gradient 2-norm (before clipping)",
                  title="gradient norm per param group", yscale="log")  # fmt: skip
    norm_axis.set_ylim(top=norm_axis.get_ylim()[1] * 4)  # room for the legend
    norm_axis.yaxis.set_minor_formatter(NullFormatter())
    norm_axis.legend(fontsize="small", ncol=2, loc="upper right")

    for index, group in enumerate(groups):
        key = f"lr/{group}" if any(f"lr/{group}" in r for r in rows) else "lr"
        having = [r for r in rows if key in r]
        lr_axis.plot([r["step"] for r in having], [r[key] for r in having], color=f"C{index}",
                     linestyle=("-", "--", ":", "-.")[index % 4], label=group)  # fmt: skip
        if having and having[0]["step"] > steps[0]:  # the group appeared at this step
            first = having[0]["step"]
            norm_axis.axvline(first, color=f"C{index}", linestyle=":", linewidth=1)
            lr_axis.axvline(first, color=f"C{index}", linestyle=":", linewidth=1,
                            label=f"{group} added at step {first} (gs.regroup)")  # fmt: skip
    lr_axis.set(xlabel="step", ylabel="learning rate", title="learning rate per param group")
    lr_axis.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    lr_axis.legend(fontsize="small")
    if config:
        figure.suptitle(settings(summary))
    path = out / "training.png"
    figure.savefig(path, dpi=100)
    return path


def smoothed(values: list[float], weight: float = 0.9) -> list[float]:
    """The exponential moving average of ``values``, corrected for its start at zero (as
    TensorBoard smooths), so the first points are not pulled down."""
    average, result = 0.0, []
    for count, value in enumerate(values, start=1):
        average = weight * average + (1 - weight) * value
        result.append(average / (1 - weight**count))
    return result


def settings(summary: dict[str, Any]) -> str:
    """The run's settings in one line, for the plot's title."""
    config = summary["config"]
    mode = "DDP + ZeRO-1" if config["zero"] else f"strategy {config['strategy']}"
    if config.get("replicate", 1) > 1:
        mode += f" x {config['replicate']} replicas (HSDP)"
    accum = config.get("grad_accum", 1)
    batch = f"batch {config['batch_size']}" + (f" x {accum} micro-batches" if accum > 1 else "")
    return (
        f"model {config['model']} ({summary['parameters_total']:,} parameters), "
        f"{config['optimizer']}, {mode}, {config.get('precision', 'fp32')}, "
        f"{summary['world_size']} processes, {summary['steps']} steps, lr {config['lr']:g}, "
        f"{batch} per rank, weight decay {config['weight_decay']:g}, clip {config['clip']:g}"
    )


def group_table(groups: list[dict[str, Any]]) -> str:
    """The per-group summary as a small text table (under 80 columns)."""
    lines = [
        f"{'group':<12}{'tensors':>8}{'elements':>11}{'weight decay':>14}{'lr':>10}"
        f"{'grad norm':>11}{'weight norm':>13}"
    ]
    for g in groups:
        grad = "-" if g["grad_norm"] is None else f"{g['grad_norm']:.4g}"
        lines.append(
            f"{g['group']:<12}{g['tensors']:>8}{g['elements']:>11,}{g['weight_decay']:>14g}"
            f"{g['lr']:>10.3g}{grad:>11}{g['weight_norm']:>13.4g}"
        )
    return "\n".join(lines)


def printable(text: str) -> str:
    """``text`` with what a terminal would act on (ESC, BEL, carriage returns and other
    control or unprintable characters, tabs aside) written as Python escapes: ``\\x1b``."""
    return "".join(
        c if c.isprintable() or c == "\t" else c.encode("unicode_escape").decode("ascii")
        for c in text
    )


def finish(out: Path, summary: dict[str, Any]) -> None:
    """Write the CSV and the plot, and print the sample, the per-group table and the summary
    (rank 0)."""
    rows = read_log(out)
    if rows:
        write_csv(out, rows)
        plot(out, rows, summary)
    final = rows[-1] if rows else {}
    validation = next((r["val_loss"] for r in reversed(rows) if "val_loss" in r), None)
    shown = "not measured yet" if validation is None else f"{validation:.4f}"
    baselines = ", ".join(f"{k} {v:.4f}" for k, v in summary.get("baselines", {}).items())
    if baselines:
        shown += f"\nbaselines on the validation data (nats/byte): {baselines}"
    rss = ", ".join(f"{b / 2**20:.0f}" for b in summary["peak_rss_bytes_per_rank"])
    written = summary.get("sample")
    if written is not None:
        lines = written["text"].removesuffix("\n").split("\n")
        print(
            f"sample.txt: {written['prompt_bytes']} bytes of validation text, then "
            f"{written['new_bytes']} bytes the model wrote:\n"
            + "\n".join("    " + printable(line) for line in lines)
            + "\n",
            flush=True,
        )
    if summary.get("groups"):
        print(
            group_table(summary["groups"]) + "\n(grad norm: the last step's, before clipping)\n",
            flush=True,
        )
    outputs = ["log.jsonl", "log.csv", "training.png", "summary.json"]
    outputs += ["sample.txt"] if written is not None else []
    print(
        f"{summary['status']} at step {summary['step']}/{summary['steps']}: loss "
        f"{final.get('loss', float('nan')):.4f}, validation loss "
        f"{shown}\n"
        f"{summary['tokens_per_s']:.0f} tokens/s on {summary['world_size']} ranks, "
        f"peak memory per rank {rss} MiB, parameters per rank "
        f"{summary['parameters_per_rank']:,} of {summary['parameters_total']:,}\n"
        f"outputs in {out}/: {', '.join(outputs)}, checkpoint/",
        flush=True,
    )
