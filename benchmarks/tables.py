"""Write the tables of benchmarks/README.md from the results JSON files beside it.

Every numeric table in that README sits between two marker lines::

    <!-- table: results-4m.json main -->
    ...generated, do not edit...
    <!-- end table -->

The marker names one or more results files of ``benchmarks/`` and then the table's kind
(one of ``KINDS``). ``python benchmarks/tables.py`` rewrites what is between the markers from
the JSON; ``python benchmarks/tables.py --check`` changes nothing and exits with status 1,
naming each table, where the README differs from what the JSON gives (status 2 for a
malformed marker, an unknown kind or a missing file). ``--dir`` points both at another folder
holding a README.md and the JSON files (the tests use a copy).

MB in the tables are MiB (2**20 bytes), as the benchmark scripts print them; GB in the
construction table are 10**9 bytes, as ``construction.py`` prints them.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

Report = dict[str, Any]
Row = dict[str, Any]
Lines = list[str]

HERE = Path(__file__).resolve().parent
DASH = "–"
MIB = 2**20
GB = 1e9
MARKER = re.compile(
    r"^<!-- table: (?P<spec>[^\n]*?) -->\n(?P<body>.*?)^<!-- end table -->$",
    re.MULTILINE | re.DOTALL,
)


class TableError(ValueError):
    """A marker that cannot be filled: unknown kind, missing file or row, wrong file count."""


# ---------------------------------------------------------------------------- formatting


def fmt(value: float | None, spec: str) -> str:
    """``value`` formatted with ``spec``, or a dash where there is no value."""
    return DASH if value is None else format(value, spec)


def mib(value: float | None, spec: str = ".2f") -> str:
    """Bytes as MiB; a dash for no value or zero (nothing gathered, nothing measured)."""
    return fmt(value / MIB, spec) if value else DASH


def with_paired(ratio: float | None, paired: float | None) -> str:
    """A ratio of medians with the paired ratio (median of per-round ratios) in brackets."""
    if ratio is None:
        return DASH
    return f"{ratio:.2f}" if paired is None else f"{ratio:.2f} ({paired:.2f})"


def markdown(header: list[str], rows: list[list[str]]) -> Lines:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cells) + " |" for cells in rows]


def one(reports: list[Report], kind: str) -> Report:
    """The single report a kind of table is made from."""
    if len(reports) != 1:
        raise TableError(f"a {kind!r} table is made from one results file, not {len(reports)}")
    return reports[0]


def row_of(report: Report, name: str) -> Row:
    """The row ``name`` of a report."""
    try:
        return report["rows"][name]
    except KeyError:
        raise TableError(f"no row {name!r} in the {report['model']} results") from None


def moved_bytes(row: Row) -> float | None:
    """Bytes moved per rank and step: groupshard's own count, else torch.profiler's."""
    return row["collectives"]["groupshard_bytes"] or row["collectives"].get("profiled_bytes")


# ------------------------------------------------------------------- benchmarks/run.py tables


def main_table(reports: list[Report]) -> Lines:
    """One run of ``run.py``: every system's step, memory, communication and accuracy
    (the columns of ``run.py``'s ``print_table``); peak RSS where the run measured it."""
    report = one(reports, "main")
    rss = any(row.get("peak_rss_bytes_per_rank") for row in report["rows"].values())
    header = ["system", "ms/step", "/ FSDP2", "optimizer ms", "params + grads + state MB/rank",
              "most gathered MB", "collectives/step", "MB moved/rank"]  # fmt: skip
    header += ["peak RSS MB/rank"] if rss else []
    header += ["max diff vs 1 process"]
    rows = []
    for name, row in report["rows"].items():
        cells = [
            name,
            f"{row['step_ms']:.0f}",
            fmt(row["ratio_to_fsdp2"], ".2f"),
            f"{row['optimizer_ms']:.1f}",
            mib(max(row["held_bytes_per_rank"]), ".1f"),
            mib(row["held_bytes"].get("gathered_peak")),
            str(row["collectives"]["count"]),
            mib(moved_bytes(row)),
        ]
        if rss:
            cells.append(mib(max(row.get("peak_rss_bytes_per_rank") or [0]), ".0f"))
        cells.append(f"{row['max_difference']:.1e}")
        rows.append(cells)
    return markdown(header, rows)


def present(report: Report, *names: str) -> list[Row] | None:
    """The rows ``names`` of a report, or None where the run lacks one (say, no DeepSpeed)."""
    rows = report["rows"]
    return [rows[name] for name in names] if all(name in rows for name in names) else None


def compared(
    numerator: str, denominator: str, combine: Callable[[Row, Row], str]
) -> Callable[[Report], str]:
    """``combine(row numerator, row denominator)`` of a report, or a dash where one lacks."""

    def value(report: Report) -> str:
        rows = present(report, numerator, denominator)
        return DASH if rows is None else combine(rows[0], rows[1])

    return value


def step_ratio(numerator: str, denominator: str) -> Callable[[Report], str]:
    """Step time of row ``numerator`` over row ``denominator``."""
    return compared(numerator, denominator, lambda a, b: f"{a['step_ms'] / b['step_ms']:.2f}")


def step_change(numerator: str, denominator: str) -> Callable[[Report], str]:
    """Step time of row ``numerator`` against row ``denominator``, in percent."""
    return compared(
        numerator, denominator, lambda a, b: f"{(a['step_ms'] / b['step_ms'] - 1) * 100:+.1f} %"
    )


def optimizer_ratio(numerator: str, denominator: str) -> Callable[[Report], str]:
    """Optimizer step time of row ``numerator`` over row ``denominator``."""
    return compared(
        numerator, denominator, lambda a, b: f"{a['optimizer_ms'] / b['optimizer_ms']:.2f}"
    )


def extra_collectives(numerator: str, denominator: str) -> Callable[[Report], str]:
    """Collectives per step of row ``numerator`` minus those of row ``denominator``."""
    return compared(
        numerator,
        denominator,
        lambda a, b: f"{a['collectives']['count'] - b['collectives']['count']:+d}",
    )


def moved(name: str) -> Callable[[Report], str]:
    """MiB moved per rank and step by row ``name``."""

    def value(report: Report) -> str:
        rows = present(report, name)
        return DASH if rows is None else mib(moved_bytes(rows[0]))

    return value


def held_over_ideal(name: str) -> Callable[[Report], str]:
    """Parameters + gradients + optimizer state per rank of row ``name`` over (total) / N."""

    def value(report: Report) -> str:
        rows = present(report, name)
        if rows is None:
            return DASH
        return f"{max(rows[0]['held_bytes_per_rank']) / rows[0]['ideal_bytes_per_rank']:.3f}"

    return value


def parameter_bound(report: Report) -> str:
    """3 x parameter MiB x (N-1)/N: a gather for forward and backward and a reduce-scatter."""
    parameters = row_of(report, "DDP")["held_bytes"]["params"]  # DDP holds every parameter
    world = report["world_size"]
    return mib(3 * parameters * (world - 1) / world)


FULL, GRAD_OP, ZERO = "groupshard full", "groupshard grad_op", "groupshard ZeRO + DDP"
LAMB, FSDP2_LAMB = "groupshard full + LAMB", "FSDP2 + per-parameter LAMB"
ZERO_2 = "DeepSpeed ZeRO-2"
# (what, goal from the benchmark issue, value): the rows of the "ratios" table
RATIOS: list[tuple[str, str, Callable[[Report], str]]] = [
    ("`full` step / FSDP2's", "≤ 1.0 (4.2M), ≤ 0.5 (small)", step_ratio(FULL, "FSDP2")),
    ("`full` step / DeepSpeed ZeRO-3's", "≤ 0.95 (4.2M)", step_ratio(FULL, "DeepSpeed ZeRO-3")),
    ("`full` step / DDP's", "≤ 1.1 (4.2M), ≤ 1.3 (small)", step_ratio(FULL, "DDP")),
    ("`grad_op` step / DeepSpeed ZeRO-2's", "≤ 1.0 (4.2M)", step_ratio(GRAD_OP, ZERO_2)),
    ("`no_shard` step / DDP's", "", step_ratio("groupshard no_shard", "DDP")),
    ("ZeRO optimizer + DDP step / torch's", "on the line", step_ratio(ZERO, "torch ZeRO + DDP")),
    ("`full` optimizer step / FSDP2's", "≤ 0.5", optimizer_ratio(FULL, "FSDP2")),
    ("`full` + LAMB step / `full` (AdamW)", "≤ 1.1", step_ratio(LAMB, FULL)),
    ("FSDP2 + per-parameter LAMB step / FSDP2 (AdamW)", "", step_ratio(FSDP2_LAMB, "FSDP2")),
    ("collectives per step, LAMB vs AdamW: FSDP2", "", extra_collectives(FSDP2_LAMB, "FSDP2")),
    ("collectives per step, LAMB vs AdamW: `full`", "", extra_collectives(LAMB, FULL)),
    ("`full`, 8 groups step vs 2 groups", "≤ +3 %", step_change(f"{FULL}, 8 groups", FULL)),
    ("`full`, prefetch 0 step / FSDP2's", "", step_ratio(f"{FULL}, prefetch 0", "FSDP2")),
    ("MB moved per rank and step: `full`", "≤ the next row", moved(FULL)),
    ("3 x parameter MB x (N-1)/N", "", parameter_bound),
    ("MB moved per rank and step: FSDP2", "", moved("FSDP2")),
    ("`full` params + grads + state per rank / ((total) / N)", "1", held_over_ideal(FULL)),
]
MODEL_NAMES = {"4m": "4.2M", "small-params": "small params", "30m": "30M", "tiny": "tiny"}


def model_label(report: Report) -> str:
    """A report's model, and its world size where it is not 2."""
    label = MODEL_NAMES.get(report["model"], report["model"])
    return label if report["world_size"] == 2 else f"{label}, {report['world_size']} ranks"


def ratios_table(reports: list[Report]) -> Lines:
    """The benchmark issue's goals: the same ratios of several ``run.py`` runs side by side."""
    header = ["ratio", *(model_label(report) for report in reports), "goal"]
    rows = [[what, *(value(report) for report in reports), goal] for what, goal, value in RATIOS]
    return markdown(header, rows)


# rows of the mixed precision and accumulation table, in order
PRECISION_ROWS = [
    "groupshard full",
    "groupshard full bf16",
    "FSDP2 bf16",
    "DeepSpeed ZeRO-3 bf16",
    "groupshard full, 4 micro-batches",
    "groupshard full, 4 micro-batches, kept gathered",
    "groupshard full bf16, 4 micro-batches",
    "groupshard full bf16, 4 micro-batches, kept gathered",
    "DeepSpeed ZeRO-3 bf16, 4 micro-batches",
]


def accumulated(report: Report, row: Row) -> str:
    """Unsharded gradient bytes held while accumulating, with the FSDP2 baseline's."""
    held = row["held_bytes"].get("accumulated_grads")
    if held is None:
        return DASH
    baseline = row_of(report, row["baseline"])["held_bytes"].get("accumulated_grads")
    return f"{mib(held)} MB (FSDP2: {mib(baseline)})"


def precision_table(reports: list[Report]) -> Lines:
    """Mixed precision and accumulation rows (``run.py``'s ``print_precision_table``): each
    against FSDP2 run the same way (bf16, micro-batches, kept gathered)."""
    report = one(reports, "precision")
    header = ["system", "step ms", "x FSDP2 run alike (paired)", "gathered MB", "reduced MB",
              "reduce-scatters", "unsharded grads held while accumulating",
              "max diff vs 1 process", "same order"]  # fmt: skip
    rows = []
    for name in PRECISION_ROWS:
        row = row_of(report, name)
        collectives = row["collectives"]
        own_baseline = row["baseline"] == name
        rows.append([
            name,
            f"{row['step_ms']:.0f}",
            "1.00" if own_baseline else with_paired(row["ratio_to_fsdp2"],
                                                    row.get("ratio_to_fsdp2_paired")),
            mib(collectives.get("gather_bytes")),
            mib(collectives.get("reduce_bytes")),
            str(collectives.get("reduce_scatters", 0)),
            accumulated(report, row),
            f"{row['max_difference']:.1e}",
            fmt(row.get("max_difference_same_order"), ".1e"),
        ])  # fmt: skip
    return markdown(header, rows)


def bf16_speed_table(reports: list[Report]) -> Lines:
    """bf16 against fp32 compute on one process, one thread (``run.py``'s ``bf16_speed``)."""
    speed = one(reports, "bf16-speed")["bf16_speed"]
    rows = [
        [what, f"{times['float32']:.1f}", f"{times['bfloat16']:.1f}",
         f"{times['bf16_over_fp32']:.2f}"]
        for what, times in (("model forward + backward", speed["model_fwd_bwd_ms"]),
                            ("its Linear layers' matmuls", speed["matmul_ms"]))
    ]  # fmt: skip
    return markdown(["one process, one thread", "fp32 ms", "bf16 ms", "bf16 / fp32"], rows)


def muon_rows(report: Report) -> dict[str, Row]:
    """The Muon systems of a run (those compared with DDP + torch Muon's optimizer step)."""
    return {
        name: row
        for name, row in report["rows"].items()
        if row.get("optimizer_ratio_to_ddp_muon") is not None
    }


def muon_table(reports: list[Report]) -> Lines:
    """Step and optimizer step of the Muon systems (``run.py``'s ``print_muon_table``)."""
    report = one(reports, "muon")
    rows = muon_rows(report)
    if not rows:
        raise TableError(f"no Muon rows in the {report['model']} results")
    rounds = len(next(iter(rows.values()))["step_ms_rounds"])
    header = [f"world {report['world_size']} ({rounds} rounds)", "step ms", "optimizer ms",
              "optimizer / DDP + torch Muon (paired)", "step / FSDP2 + torch Muon (paired)",
              "Muon / AdamW step"]  # fmt: skip
    cells = [
        [name, f"{row['step_ms']:.0f}", f"{row['optimizer_ms']:.0f}",
         with_paired(row["optimizer_ratio_to_ddp_muon"],
                     row.get("optimizer_ratio_to_ddp_muon_paired")),
         with_paired(row["ratio_to_fsdp2"], row.get("ratio_to_fsdp2_paired")),
         fmt(row.get("muon_over_adamw"), ".2f")]
        for name, row in rows.items()
    ]  # fmt: skip
    return markdown(header, cells)


def per_rank_mib(values: list[float] | None) -> str:
    """A per-rank byte count as MiB: one number where the ranks agree, else the range."""
    if not values:
        return DASH
    low, high = min(values), max(values)
    return mib(low) if low == high else f"{mib(low)}-{mib(high)}"


def muon_exchange_table(reports: list[Report]) -> Lines:
    """gs.optim.Muon's exchange and every Muon system's distance from torch's, per run."""
    header = ["world", "system", "all-to-alls/step", "sent MB/rank", "buffers MB/rank",
              "max diff vs 1 process", "summed in rank order", "trained distance"]  # fmt: skip
    rows = []
    for report in reports:
        for name, row in muon_rows(report).items():
            rows.append([
                str(report["world_size"]),
                name,
                fmt(row["collectives"].get("all_to_alls"), "d"),
                per_rank_mib(row.get("all_to_all_bytes_per_rank")),
                per_rank_mib(row.get("all_to_all_buffer_bytes_per_rank")),
                f"{row['max_difference']:.1e}",
                fmt(row.get("max_difference_same_order"), ".1e"),
                fmt(row.get("trained_distance"), ".1e"),
            ])  # fmt: skip
    return markdown(header, rows)


# ---------------------------------------------------------------- benchmarks/overlap.py table

STRATEGIES = ("full", "grad_op", "no_shard")


def overlap_cells(row: Row, strategy: str) -> list[str]:
    """One overlap setting's ratios: to DDP (paired), FSDP2 (``full``), ZeRO-2 (``grad_op``)."""
    return [
        with_paired(row["ratio_to_DDP"], row["ratio_to_DDP_paired"]),
        fmt(row["ratio_to_FSDP2"], ".2f") if strategy == "full" else "",
        fmt(row.get("ratio_to_ZeRO-2"), ".2f") if strategy == "grad_op" else "",
    ]


def overlap_table(reports: list[Report]) -> Lines:
    """Overlap on and off per model and strategy (``overlap.py``'s report): step ratios,
    exposed communication, the fraction hidden, and CPU time against DDP's."""
    header = ["model", "strategy", "overlap on: x DDP (paired)", "x FSDP2", "x ZeRO-2",
              "overlap off: x DDP (paired)", "x FSDP2", "x ZeRO-2",
              "exposed comm ms/step off -> on", "hidden",
              "CPU ms/step: this row / DDP (DDP's step ms)"]  # fmt: skip
    rows = []
    for report in reports:
        ddp = row_of(report, "DDP")
        for strategy in STRATEGIES:
            on = row_of(report, f"groupshard {strategy} overlap on")
            off = row_of(report, f"groupshard {strategy} overlap off")
            hidden = report["hidden"][strategy]
            rows.append([
                report["model"],
                strategy,
                *overlap_cells(on, strategy),
                *overlap_cells(off, strategy),
                f"{hidden['exposed_off_ms']:.1f} -> {hidden['exposed_on_ms']:.1f}",
                fmt(hidden["hidden_fraction"], ".2f"),
                f"{on['cpu_ms']:.0f} / {ddp['cpu_ms']:.0f} ({ddp['step_ms']:.0f})",
            ])  # fmt: skip
    return markdown(header, rows)


def prefetch_table(reports: list[Report]) -> Lines:
    """Prefetching big units (``overlap.py``'s runs, each with its ``label``): per run, the
    overlapped ``full`` and ``grad_op`` rows' all-gathers started ahead, exposed gather time,
    step time and ratios."""
    header = ["run", "strategy", "all-gathers prefetched / all per step",
              "exposed all-gather ms/step", "exposed comm ms/step", "step ms",
              "x FSDP2 (paired)", "x DDP (paired)"]  # fmt: skip
    rows = []
    for report in reports:
        for strategy in ("full", "grad_op"):
            row = row_of(report, f"groupshard {strategy} overlap on")
            rows.append([
                report.get("label") or report["model"],
                strategy,
                f"{row['gathers_async']:.0f} / {row['gathers']:.0f}",
                f"{row['exposed_ms_by_op'].get('all_gather', 0.0):.1f}",
                f"{row['exposed_ms']:.1f}",
                f"{row['step_ms']:.0f}",
                with_paired(row["ratio_to_FSDP2"], row["ratio_to_FSDP2_paired"]),
                with_paired(row["ratio_to_DDP"], row["ratio_to_DDP_paired"]),
            ])  # fmt: skip
    return markdown(header, rows)


# ----------------------------------------------------------- benchmarks/construction.py table

CONSTRUCTION_LABELS = {
    "FSDP2": "FSDP2 (`fully_shard` per block, `to_empty`, init)",
    "DeepSpeed": "DeepSpeed ZeRO-3 (`zero.Init`)",
}


def construction_table(reports: list[Report]) -> Lines:
    """Meta-device construction and one AdamW step per system (``construction.py``): GB of
    RSS above each rank's baseline, the most over ranks; seconds, the slowest rank."""
    report = one(reports, "construction")
    header = ["system", "baseline GB", "construction GB", "first step GB", "/ FSDP2",
              "held after step, freed memory returned GB", "build s", "first step s",
              "time to first step s"]  # fmt: skip
    fsdp2 = report["systems"].get("FSDP2", {}).get("step_peak_above_baseline")
    rows = []
    for name, entry in report["systems"].items():
        label = CONSTRUCTION_LABELS.get(name, name)
        if "ranks" not in entry:
            why = entry.get("does_not_fit") or entry.get("absent") or DASH
            rows.append([label, why] + [""] * (len(header) - 2))
            continue
        ranks = entry["ranks"]
        step = entry["step_peak_above_baseline"]
        held = max(r["held_after_step_trimmed"] - r["baseline"] for r in ranks)
        rows.append([
            label,
            f"{max(r['baseline'] for r in ranks) / GB:.2f}",
            f"{entry['construct_peak_above_baseline'] / GB:.2f}",
            f"{step / GB:.2f}",
            f"{step / fsdp2:.3f}" if fsdp2 else DASH,
            f"{held / GB:.2f}",
            f"{max(r['construct_s'] for r in ranks):.0f}",
            f"{max(r['step_s'] for r in ranks):.0f}",
            f"{entry['time_to_first_step_s']:.0f}",
        ])  # fmt: skip
    return markdown(header, rows)


def hybrid_bytes_table(reports: list[Report]) -> Lines:
    """``hybrid.py``: MiB each rank sends per step within its shard group and across the
    replicas, counted and by the formulas (less the root's second gather, which groupshard
    skips)."""
    report = one(reports, "hybrid-bytes")
    header = ["model", "layout", "parameters", "within, counted MiB", "within, formula MiB",
              "formula less the root's second gather", "across, counted MiB",
              "across, formula MiB", "other (used flags) bytes"]  # fmt: skip
    rows = [
        [
            row["model"], row["layout"], f"{row['parameters']:,}", mib(row["within"]),
            mib(row["formula_within"]),
            mib(row["formula_within"] - row["root_not_regathered"]), mib(row["across"]),
            mib(row["formula_across"]), f"{row['other']:.0f}",
        ]
        for row in report["measured"]
    ]
    return markdown(header, rows)


def hybrid_model_table(reports: list[Report]) -> Lines:
    """``hybrid.py``: modeled communication milliseconds per step, full sharding over every
    GPU against HSDP with one replica per node."""
    report = one(reports, "hybrid-model")
    counts = report["node_counts"]
    header = ["model", "parameter MiB"] + [
        f"{n} nodes: {kind} ms" for n in counts for kind in ("full", "HSDP")
    ]
    rows = [
        [row["model"], mib(row["parameter_bytes"], ",.0f")]
        + [f"{row[str(n)][kind]:.2f}" for n in counts for kind in ("full", "hsdp")]
        for row in report["modeled"]
    ]
    return markdown(header, rows)


def before_after_table(reports: list[Report]) -> Lines:
    """An A/B of two commits, runs interleaved (``{"old": [runs], "new": [runs]}``): each
    row's median step time and median ratio to DDP over the runs, before and after."""
    report = one(reports, "before-after")
    runs = {side: [run["rows"] for run in report[side]] for side in ("old", "new")}
    header = ["system", "ms/step before", "ms/step after", "x DDP before", "x DDP after"]
    rows = []
    for name in runs["old"][0]:

        def median_of(side: str, ratio: bool, name: str = name) -> float:
            values = [
                rows[name]["step_ms"] / (rows["DDP"]["step_ms"] if ratio else 1.0)
                for rows in runs[side]
            ]
            return statistics.median(values)

        rows.append([
            name,
            f"{median_of('old', False):.1f}",
            f"{median_of('new', False):.1f}",
            f"{median_of('old', True):.3f}",
            f"{median_of('new', True):.3f}",
        ])  # fmt: skip
    return markdown(header, rows)


def regroup_table(reports: list[Report]) -> Lines:
    """``gs.regroup`` per call (``regroup_memory.py``): the peak RSS above the RSS before the
    call and the seconds, the most over ranks, beside the bound's parts: the largest unit's
    parameters and AdamW state unsharded (x3 of its fp32 parameters), and its shard."""
    report = one(reports, "regroup-memory")
    ranks = report["ranks"]
    largest = max(ranks[0]["unit_params_bytes"].values())
    world = report["world_size"]
    header = ["call", "peak above before MiB", "s", "largest unit's params + state MiB",
              "+ its shard MiB"]  # fmt: skip
    rows = [
        [
            label,
            mib(max(r["calls"][label]["peak_above_before"] for r in ranks), ".1f"),
            f"{max(r['calls'][label]['seconds'] for r in ranks):.2f}",
            mib(3 * largest, ".1f"),
            mib(3 * largest + largest / world, ".1f"),
        ]
        for label in ranks[0]["calls"]
    ]
    return markdown(header, rows)


def whole_param_table(reports: list[Report]) -> Lines:
    """``benchmarks/whole_param.py``: optimizer step (wall and CPU), the slowest rank's
    computation and the rest of the step (the exchange), the whole training step, state per
    rank, owner balance and distance from DDP, per world size."""
    header = ["world", "system", "optimizer ms", "CPU ms", "/ DDP (paired)", "CPU / DDP",
              "compute / DDP", "exchange ms", "training step / DDP", "state MiB/rank",
              "state / DDP", "owner balance", "max diff vs DDP"]  # fmt: skip
    rows = []
    for report in reports:
        if report.get("kind") != "whole-param":
            raise TableError("expects results of benchmarks/whole_param.py")
        for name, row in report["rows"].items():
            world = str(report["world_size"])
            if row["error"]:
                rows.append([world, name, f"fails: {row['error'][:90]}"] + [DASH] * 10)
                continue
            compute = row.get("compute_ms")
            exchange = None if compute is None else row["optimizer_ms"] - compute
            rows.append([
                world, name, fmt(row["optimizer_ms"], ".1f"), fmt(row["cpu_ms"], ".1f"),
                with_paired(row.get("ratio_to_ddp"), row.get("ratio_to_ddp_paired")),
                fmt(row.get("cpu_ratio_to_ddp"), ".2f"),
                fmt(row.get("compute_ratio_to_ddp"), ".2f"), fmt(exchange, ".1f"),
                fmt(row.get("step_ratio_to_ddp"), ".2f"),
                mib(max(row["state_bytes_per_rank"])), fmt(row.get("state_ratio_to_ddp"), ".2f"),
                fmt(row.get("balance"), ".3f"), fmt(row.get("max_difference_vs_ddp"), ".1e"),
            ])  # fmt: skip
    return markdown(header, rows)


def checkpoint_table(reports: list[Report]) -> Lines:
    """``benchmarks/checkpoint.py``, one results file per model: each row's save and load
    (wall seconds, the slowest rank, median over rounds; CPU seconds, the ranks' mean; the
    peak RSS above the RSS before the call, the most over rounds and ranks), the seconds
    against the FSDP2 row's, and the largest unit's full fp32 parameters, for scale."""
    header = ["model", "row", "save s", "load s", "save CPU s", "load CPU s",
              "save peak MiB above start", "load peak MiB above start", "save x FSDP2",
              "load x FSDP2", "largest unit MiB"]  # fmt: skip
    rows = []
    for report in reports:
        if report.get("kind") != "checkpoint":
            raise TableError("expects results of benchmarks/checkpoint.py")
        fsdp2 = row_of(report, "fsdp2 torch idiom")
        for name, row in report["rows"].items():
            rows.append([
                MODEL_NAMES.get(report["model"], report["model"]), name,
                f"{row['save_s']:.2f}", f"{row['load_s']:.2f}",
                f"{row['save_cpu_s']:.2f}", f"{row['load_cpu_s']:.2f}",
                mib(row["save_peak_above_start"], ".1f"), mib(row["load_peak_above_start"], ".1f"),
                f"{row['save_s'] / fsdp2['save_s']:.2f}", f"{row['load_s'] / fsdp2['load_s']:.2f}",
                mib(report["largest_unit_bytes"], ".1f"),
            ])  # fmt: skip
    return markdown(header, rows)


def async_checkpoint_table(reports: list[Report]) -> Lines:
    """``benchmarks/async_checkpoint.py``, one results file per model: each row's seconds
    the training loop is blocked and until the checkpoint is complete (the slowest rank,
    median over rounds), both against the same system's synchronous save, the peak RSS
    above the start up to completion, and the loaded model's largest difference."""
    header = ["model", "row", "blocked s", "complete s", "blocked / sync save",
              "complete / sync save", "peak MiB above start", "max diff after load"]  # fmt: skip
    rows = []
    for report in reports:
        if report.get("kind") != "async-checkpoint":
            raise TableError("expects results of benchmarks/async_checkpoint.py")
        for name, row in report["rows"].items():
            rows.append([
                MODEL_NAMES.get(report["model"], report["model"]), name,
                f"{row['blocked_s']:.2f}", f"{row['total_s']:.2f}",
                f"{row['blocked_vs_sync']:.2f}", f"{row['total_vs_sync']:.2f}",
                mib(row["peak_above_start"], ".1f"), f"{row['max_difference']:.1e}",
            ])  # fmt: skip
    return markdown(header, rows)


def tensor_parallel_table(reports: list[Report]) -> Lines:
    """``benchmarks/tensor_parallel.py``: each system on the (dp, tp) mesh, its step time
    (median over steps of the slowest rank) against FSDP2 + TP's, collectives per step (tp's
    included), this rank's parameter, gradient and optimizer-state MiB (or the peak CUDA
    MiB allocated) and the final weights' largest difference from FSDP2 + TP's."""
    report = one(reports, "tensor-parallel")
    if report.get("kind") != "tensor-parallel":
        raise TableError("expects results of benchmarks/tensor_parallel.py")
    cuda = report["device"] == "cuda"
    header = ["system", "ms/step", "/ FSDP2 + TP", "collectives/step",
              "peak CUDA MiB/rank" if cuda else "params + grads + state MiB/rank",
              "max diff vs FSDP2 + TP"]  # fmt: skip
    rows = [
        [name, f"{row['ms_per_step']:.0f}", f"{row['vs_fsdp2_tp']:.2f}",
         str(row["collectives_per_step"]),
         f"{row['peak_cuda_mb'] if cuda else row['state_mb_per_rank']:.1f}",
         f"{row['max_diff_vs_fsdp2']:.1e}"]
        for name, row in report["rows"].items()
    ]  # fmt: skip
    return markdown(header, rows)


def fsdp2_row(name: str) -> str:
    """The FSDP2 row a trainer benchmark row is compared with: the one of its kind (LoRA,
    Fabric)."""
    if name.endswith("lora"):
        return "fsdp2 lora"
    return "fabric-fsdp2" if name.startswith("fabric-") else "fsdp2"


def trainer_table(reports: list[Report]) -> Lines:
    """``benchmarks/trainer.py``: Hugging Face's Trainer per system, with and without LoRA
    (step wall seconds, the slowest rank's median, median over rounds; CPU seconds per
    step, the ranks' mean; peak RSS above the start of ``train()``, the most over rounds
    and ranks), step time and peak against the FSDP2 row of the same kind."""
    header = ["model", "row", "step s", "CPU s per step", "peak MiB above start",
              "step x FSDP2", "peak x FSDP2"]  # fmt: skip
    rows = []
    for report in reports:
        if report.get("kind") != "trainer":
            raise TableError("expects results of benchmarks/trainer.py")
        label = f"{report['model']} ({report['parameters'] / 1e6:.0f}M)"
        for name, row in report["rows"].items():
            # a run of some rows (--rows) may lack the FSDP2 row: no ratio then
            fsdp2 = report["rows"].get(fsdp2_row(name))
            rows.append([
                label, name, f"{row['step_s']:.3f}", f"{row['cpu_s']:.3f}",
                mib(row["peak_above_start"], ".1f"),
                f"{row['step_s'] / fsdp2['step_s']:.2f}" if fsdp2 else "–",
                f"{row['peak_above_start'] / fsdp2['peak_above_start']:.2f}" if fsdp2 else "–",
            ])  # fmt: skip
    return markdown(header, rows)


def scale_table(reports: list[Report]) -> Lines:
    """``benchmarks/scale.py``: rank 0 of a simulated world per model and layout: seconds of
    each part, the peak RSS of ``gs.shard`` above its start, the bytes this rank sends in
    an AdamW step against the layout's formula, and FSDP2's ``fully_shard`` beside."""
    report = one(reports, "scale")
    header = ["model", "layout", "gs.shard s", "shard peak MiB", "AdamW step s", "Muon s",
              "WholeParam s", "regroup s", "save plan s", "sent MB / formula",
              "FSDP2 s", "FSDP2 peak MiB"]  # fmt: skip

    def seconds(part: Row, *names: str) -> str:
        if not part or any(f"{name}_s" not in part for name in names):
            return DASH if not part.get("error") else "error"
        return f"{sum(part[f'{name}_s'] for name in names):.2f}"

    rows = []
    for row in report["rows"]:
        shard, fsdp2 = row.get("shard", {}), row.get("fsdp2", {})
        layout = f"{row['world']:,}" if row["replicas"] == 1 else (
            f"{row['replicas']:,} x {row['shard_size']} ({row['world']:,})")  # fmt: skip
        sent = DASH
        if "sent_bytes" in shard:
            total = sum(shard["sent_bytes"].values())
            sent = f"{total / 1e6:.1f} / {shard['formula_bytes'] / 1e6:.1f}"
        rows.append([
            row["model"], layout, seconds(shard, "shard"), fmt(shard.get("shard_peak_mib"), ".0f"),
            seconds(shard, "adamw_step"),
            seconds(row.get("muon", {}), "construction", "first_step"),
            seconds(row.get("whole", {}), "construction", "first_step"),
            seconds(shard, "regroup"), seconds(shard, "save_plan"), sent,
            seconds(fsdp2, "shard"), fmt(fsdp2.get("shard_peak_mib"), ".0f"),
        ])  # fmt: skip
    return markdown(header, rows)


KINDS: dict[str, Callable[[list[Report]], Lines]] = {
    "trainer": trainer_table,
    "tensor-parallel": tensor_parallel_table,
    "async-checkpoint": async_checkpoint_table,
    "scale": scale_table,
    "regroup": regroup_table,
    "checkpoint": checkpoint_table,
    "whole-param": whole_param_table,
    "before-after": before_after_table,
    "main": main_table,
    "ratios": ratios_table,
    "precision": precision_table,
    "bf16-speed": bf16_speed_table,
    "muon": muon_table,
    "muon-exchange": muon_exchange_table,
    "overlap": overlap_table,
    "prefetch": prefetch_table,
    "construction": construction_table,
    "hybrid-bytes": hybrid_bytes_table,
    "hybrid-model": hybrid_model_table,
}


# ------------------------------------------------------------------------------ the README


def render(spec: str, folder: Path) -> str:
    """What belongs between the markers of the table ``spec`` ("FILE [FILE...] KIND")."""
    *files, kind = spec.split()
    if not files or kind not in KINDS:
        raise TableError(f"table {spec!r}: expected 'FILE [FILE...] KIND', KIND one of "
                         f"{', '.join(KINDS)}")  # fmt: skip
    reports = []
    for name in files:
        path = folder / name
        if not path.is_file():
            raise TableError(f"table {spec!r}: no file {path}")
        reports.append(json.loads(path.read_text()))
    return "\n" + "\n".join(KINDS[kind](reports)) + "\n\n"


def regenerate(text: str, folder: Path) -> tuple[str, list[str]]:
    """``text`` with every table regenerated, and the specs of the tables that changed."""
    changed: list[str] = []

    def replace(match: re.Match[str]) -> str:
        body = render(match["spec"], folder)
        if body != match["body"]:
            changed.append(match["spec"])
        return f"<!-- table: {match['spec']} -->\n{body}<!-- end table -->"

    result = MARKER.sub(replace, text)
    opened = len(re.findall(r"^<!-- table:", text, re.MULTILINE))
    if opened != len(MARKER.findall(text)):
        raise TableError("a '<!-- table: ... -->' marker has no '<!-- end table -->' line")
    return result, changed


def show_difference(old: str, new: str, spec: str) -> None:
    """Print the first lines of a table's difference, README against JSON."""
    table = f"<!-- table: {spec} -->"
    start_old, start_new = old.index(table), new.index(table)
    before = old[start_old : old.index("<!-- end table -->", start_old)].splitlines()
    after = new[start_new : new.index("<!-- end table -->", start_new)].splitlines()
    diff = list(difflib.unified_diff(before, after, "README", "JSON", lineterm="", n=0))
    print("\n".join(diff[2:12]))


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or with ``--check``, compare) the README's tables; the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="change nothing; exit 1 if a table differs from the JSON",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=HERE,
        help="folder with README.md and the results JSON (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    readme = args.dir / "README.md"
    text = readme.read_text()
    try:
        new, changed = regenerate(text, args.dir)
    except TableError as error:
        print(f"{readme}: {error}", file=sys.stderr)
        return 2
    if args.check:
        for spec in changed:
            print(f"{readme}: table '{spec}' differs from what its JSON gives "
                  "(run python benchmarks/tables.py)")  # fmt: skip
            show_difference(text, new, spec)
        return 1 if changed else 0
    if changed:
        readme.write_text(new)
    for spec in changed:
        print(f"rewrote table '{spec}'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
