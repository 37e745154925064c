"""The interface every benchmarked system implements: build, train one micro-batch and step,
and the hooks the measurements read (unsharded parameters, held bytes)."""

from __future__ import annotations

import contextlib
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint


def device() -> torch.device:
    """Where this rank computes: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def unique_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages under ``tensors`` (DTensors: their local shards'), each once."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def state_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The optimizer state tensors (not the scalar steps) of ``optimizer``."""
    return [
        v
        for state in getattr(optimizer, "state", {}).values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]


@dataclass(frozen=True, kw_only=True)
class System(ABC):
    """One row of the benchmark: a system and how it trains one optimizer step.

    The fields are the row's options, which the driver also reads (the reference a row is
    compared with, its baseline); a subclass adds the system's own options and overrides
    the hooks where the system differs from plain torch (``loss.backward()``,
    ``optimizer.step()``, parameters held as tensors or DTensors)."""

    micro_batches: int = 1  # micro-batches per optimizer step, each a normal step's batch
    bf16: bool = False  # computes in bf16 (fp32 masters): compared with a bf16 reference
    keep_gathered: bool = False  # units stay gathered after the accumulating backwards
    lamb: bool = False  # the system's LAMB: compared with a LAMB reference
    muon: bool = False  # Muon + AdamW: compared with a torch.optim.Muon + AdamW reference
    baseline: str = "FSDP2"  # the row its step time is compared with
    compiled: bool = False  # each block's forward compiled (``Block.compile()``, inductor)
    checkpointed: bool = False  # each block's forward under torch.utils.checkpoint

    accumulates: ClassVar[bool] = False
    """Whether ``micro_batch`` can accumulate gradients without syncing them."""
    prepares_blocks: ClassVar[bool] = False
    """Whether ``build`` applies ``compiled`` and ``checkpointed`` (``prepare_blocks``)."""
    collectives_in_comm: ClassVar[bool] = False
    """Whether its gathered and reduced bytes are counted in groupshard's comm functions
    (else read from the sizes torch.profiler records)."""

    def __post_init__(self) -> None:
        if self.micro_batches > 1 and not self.accumulates:
            raise ValueError(f"{type(self).__name__} has no gradient accumulation rows")
        if (self.compiled or self.checkpointed) and not self.prepares_blocks:
            raise ValueError(f"{type(self).__name__} has no compiled or checkpointed rows")

    @abstractmethod
    def build(self, base: nn.Module) -> tuple[Any, Any]:
        """(model, optimizer) for this rank, from a copy of ``base``."""

    def prepare_blocks(self, model: nn.Module) -> nn.Module:
        """Before the system wraps or shards the model: with ``checkpointed``, each block's
        forward runs under non-reentrant ``torch.utils.checkpoint`` (its activations are
        recomputed in backward; names and results unchanged); with ``compiled``, each block
        is compiled in place (``nn.Module.compile``, torch's default backend), the root
        (embeddings, head, loss) eager, as ``torch.compile`` of a whole groupshard model
        leaves it (docs/usage.md#torchcompile)."""
        for block in model.blocks:
            if self.checkpointed:
                block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
            if self.compiled:
                block.compile()
        return model

    @contextlib.contextmanager
    def micro_batch(self, model: Any, last: bool) -> Iterator[None]:
        """One micro-batch's forward and backward: gradients synced on the last one only."""
        yield

    def backward(self, model: Any, loss: torch.Tensor) -> None:
        """The backward pass of one micro-batch's loss, divided by the number of micro-batches
        so that the step sees the mean gradient."""
        (loss / self.micro_batches if self.micro_batches > 1 else loss).backward()

    def optimizer_step(self, model: Any, optimizer: Any) -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def full_params(self, model: Any) -> dict[str, torch.Tensor]:
        """The trained parameters, unsharded: the fp32 masters where the model computes in bf16."""
        state = getattr(model, "module", model).state_dict()
        return {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in state.items()
        }

    def local_params(self, model: Any) -> list[torch.Tensor]:
        """The parameters this rank holds (DTensors: counted by their local shards)."""
        return list(model.parameters())

    def held_tensors(self, model: Any, optimizer: Any) -> dict[str, list[torch.Tensor]]:
        """The parameters, gradients and optimizer state this rank holds."""
        params = self.local_params(model)
        return {
            "params": params,
            "grads": [p.grad for p in params if p.grad is not None],
            "state": state_tensors(getattr(optimizer, "optim", optimizer)),  # inside a ZeRO
        }

    @contextlib.contextmanager
    def gathered_peak(self, model: Any) -> Iterator[Callable[[], int | None]]:
        """The most unsharded parameter bytes held at once while inside; None where the
        system does not gather parameters (or is not measured)."""
        yield lambda: None

    def accumulated_grad_bytes(self, model: Any) -> int | None:
        """Bytes of the unsharded gradients held between backwards without gradient sync;
        None where not measured."""
        return None
