"""One adapter per benchmarked system, behind ``System`` (``base.py``); the rows that use
them are declared in ``benchmarks/rows.py``."""

from .base import System, device, unique_bytes
from .ddp import DDP
from .deepspeed import DeepSpeed, deepspeed_available
from .fsdp import FSDP1, FSDP2
from .groupshard import Groupshard, GroupshardZero
from .torch_zero import TorchZero

__all__ = [
    "DDP",
    "FSDP1",
    "FSDP2",
    "DeepSpeed",
    "Groupshard",
    "GroupshardZero",
    "System",
    "TorchZero",
    "deepspeed_available",
    "device",
    "unique_bytes",
]
