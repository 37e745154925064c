"""The benchmark's rows, in the order they run and print: each a name and a system with its
options (``benchmarks/systems/``). A new row, or a new system's rows, go here."""

from __future__ import annotations

import re

from optimizers import eight_groups
from systems import (
    DDP,
    FSDP1,
    FSDP2,
    DeepSpeed,
    Groupshard,
    GroupshardZero,
    System,
    TorchZero,
    deepspeed_available,
)

MICRO_BATCHES = 4
"""Micro-batches per optimizer step in the accumulation rows (``--micro-batches``)."""
MUON_PARTNERS = {
    "DDP + torch Muon": "DDP",
    "torch ZeRO + DDP + Muon": "torch ZeRO + DDP",
    "FSDP2 + torch Muon": "FSDP2",
    "FSDP2 + Muon, full_tensor per matrix": "FSDP2",
    "groupshard full + Muon": "groupshard full",
    "groupshard ZeRO + DDP + Muon": "groupshard ZeRO + DDP",
    "DeepSpeed ZeRO-2 + Muon": "DeepSpeed ZeRO-2",
}
"""Each Muon row and the AdamW row of the same system (DeepSpeed's where it is installed)."""
MUON_ROWS = "|".join(
    f"^{re.escape(name)}$" for name in (*MUON_PARTNERS, *dict.fromkeys(MUON_PARTNERS.values()))
)
"""``--rows`` for the Muon rows and their AdamW rows only."""
COMPILE_PARTNERS = {
    f"{name}, compiled": name for name in ("DDP", "FSDP2", "groupshard full", "groupshard no_shard")
}
"""Each compiled row (``--compile``) and the same system eager."""
COMPILE_ROWS = "|".join(
    f"^{re.escape(name)}$" for pair in COMPILE_PARTNERS.items() for name in pair
)
"""``--rows`` for the compiled rows and their eager rows only."""
CHECKPOINT_PARTNERS = {f"{name}, checkpointed": name for name in ("FSDP2", "groupshard full")}
"""Each activation-checkpointed row (``--checkpointing``) and the same system without."""
CHECKPOINT_ROWS = "|".join(
    f"^{re.escape(name)}$" for pair in CHECKPOINT_PARTNERS.items() for name in pair
)
"""``--rows`` for the checkpointed rows and their rows without checkpointing only."""


def _precision_rows(deepspeed: bool, micro_batches: int) -> dict[str, System]:
    """bf16 rows, then fp32 and bf16 rows with gradient accumulation; each is compared
    with the FSDP2 row run the same way."""
    rows: dict[str, System] = {
        "FSDP2 bf16": FSDP2(bf16=True, baseline="FSDP2 bf16"),
        "groupshard full bf16": Groupshard("full", bf16=True, baseline="FSDP2 bf16"),
    }
    if deepspeed:
        rows["DeepSpeed ZeRO-3 bf16"] = DeepSpeed(3, bf16=True, baseline="FSDP2 bf16")
    for bf16 in (False, True):
        suffix = f"{' bf16' if bf16 else ''}, {micro_batches} micro-batches"
        for kept in ("", ", kept gathered"):
            baseline = f"FSDP2{suffix}{kept}"
            options = dict(micro_batches=micro_batches, bf16=bf16, keep_gathered=bool(kept),
                           baseline=baseline)  # fmt: skip
            rows[baseline] = FSDP2(**options)
            rows[f"groupshard full{suffix}{kept}"] = Groupshard("full", **options)
        if deepspeed:
            rows[f"DeepSpeed ZeRO-3{suffix}"] = DeepSpeed(
                3, micro_batches=micro_batches, bf16=bf16, baseline=f"FSDP2{suffix}"
            )
    return rows


def _muon_rows(deepspeed: bool) -> dict[str, System]:
    """Muon for the hidden matrices, AdamW for the rest; step time compared with FSDP2's."""
    options = dict(muon=True, baseline="FSDP2 + torch Muon")
    rows: dict[str, System] = {
        "DDP + torch Muon": DDP(**options),
        "torch ZeRO + DDP + Muon": TorchZero(**options),
        "FSDP2 + torch Muon": FSDP2(**options),
        "FSDP2 + Muon, full_tensor per matrix": FSDP2(full_tensor_muon=True, **options),
        "groupshard full + Muon": Groupshard("full", **options),
        "groupshard ZeRO + DDP + Muon": GroupshardZero(**options),
    }
    if deepspeed:
        rows["DeepSpeed ZeRO-2 + Muon"] = DeepSpeed(2, **options)
    return rows


def _compiled_rows() -> dict[str, System]:
    """Each block compiled (inductor), the root eager; compared with FSDP2 compiled alike."""
    options = dict(compiled=True, baseline="FSDP2, compiled")
    return {
        "DDP, compiled": DDP(**options),
        "FSDP2, compiled": FSDP2(**options),
        "groupshard full, compiled": Groupshard("full", **options),
        "groupshard no_shard, compiled": Groupshard("no_shard", **options),
    }


def _checkpointed_rows() -> dict[str, System]:
    """Each block's forward under torch.utils.checkpoint; compared with FSDP2 alike."""
    options = dict(checkpointed=True, baseline="FSDP2, checkpointed")
    return {
        "FSDP2, checkpointed": FSDP2(**options),
        "groupshard full, checkpointed": Groupshard("full", **options),
    }


def systems(
    lamb: bool = True,
    micro_batches: int = MICRO_BATCHES,
    muon: bool = False,
    compiled: bool = False,
    checkpointed: bool = False,
) -> dict[str, System]:
    """Every row: AdamW in the two groups (decay / no decay) unless named; LAMB rows with
    ``lamb``, Muon rows with ``muon``, compiled rows with ``compiled``, activation-
    checkpointed rows with ``checkpointed``; DeepSpeed's only where it is installed."""
    deepspeed = deepspeed_available()
    table: dict[str, System] = {
        "DDP": DDP(),
        "torch ZeRO + DDP": TorchZero(),
        "FSDP2": FSDP2(),
        "FSDP1": FSDP1(),
    }
    if deepspeed:
        for stage in (1, 2, 3):
            table[f"DeepSpeed ZeRO-{stage}"] = DeepSpeed(stage)
    table.update({
        "groupshard full": Groupshard("full"),
        "groupshard grad_op": Groupshard("grad_op"),
        "groupshard no_shard": Groupshard("no_shard"),
        "groupshard ZeRO + DDP": GroupshardZero(),
        "groupshard full, 8 groups": Groupshard("full", groups=eight_groups),
        "groupshard full, prefetch 0": Groupshard("full", prefetch_bytes=0),
    })  # fmt: skip
    if lamb:
        table["groupshard full + LAMB"] = Groupshard("full", lamb=True)
        table["FSDP2 + per-parameter LAMB"] = FSDP2(lamb=True)
    table.update(_precision_rows(deepspeed, micro_batches))
    if muon:
        table.update(_muon_rows(deepspeed))
    if compiled:
        table.update(_compiled_rows())
    if checkpointed:
        table.update(_checkpointed_rows())
    return table
