"""PyTorch FSDP: FSDP2 (``fully_shard`` per block and root) and FSDP1 (``use_orig_params``,
per block)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from optimizers import (
    FullTensorMuon,
    PerParameterLAMB,
    adamw,
    decay_groups,
    muon_groups,
    torch_muon,
)
from torch import nn

from groupshard.cli.model import Block

from .base import System, device, unique_bytes


def _fsdp_params(model: nn.Module) -> Iterator[Any]:
    """FSDP2's ``FSDPParam`` of every parameter, unit by unit."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        yield from group.fsdp_params if group is not None else ()


def _unsharded_bytes(model: nn.Module) -> int:
    """Bytes of unsharded parameters FSDP2 holds now (its freed buffers have empty storage)."""
    return sum(
        t.untyped_storage().nbytes()
        for fsdp_param in _fsdp_params(model)
        for t in fsdp_param.all_gather_outputs
    )


@dataclass(frozen=True)
class FSDP2(System):
    """``fully_shard`` on each block and the root; bf16: ``MixedPrecisionPolicy`` gathering
    and computing in bf16, reducing in fp32. Its optimizers: AdamW, the per-parameter LAMB
    (``lamb``), torch.optim.Muon straight on the DTensors (``muon``: it accepts them, and
    DTensor dispatch redistributes inside Newton-Schulz) or, with ``full_tensor_muon``,
    ``FullTensorMuon`` (one ``full_tensor()`` all-gather per matrix)."""

    full_tensor_muon: bool = False

    accumulates = True
    prepares_blocks = True

    def build(self, base: nn.Module) -> tuple[nn.Module, Any]:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy()  # FSDP2's default: no casts
        if self.bf16:
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = self.prepare_blocks(copy.deepcopy(base))
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        if self.muon:
            muon_class = FullTensorMuon if self.full_tensor_muon else None  # else torch's
            return model, torch_muon(muon_groups(model), muon_class)
        groups = decay_groups(model)
        return model, PerParameterLAMB(groups) if self.lamb else adamw(groups)

    @contextlib.contextmanager
    def micro_batch(self, model: Any, last: bool) -> Iterator[None]:
        """Gradient sync (``set_requires_gradient_sync``) on the last micro-batch only; kept
        gathered: no resharding after the others' backward."""
        if self.micro_batches > 1:
            if self.keep_gathered:
                model.set_reshard_after_backward(last)
            model.set_requires_gradient_sync(last)
        yield

    @contextlib.contextmanager
    def gathered_peak(self, model: Any) -> Iterator[Callable[[], int | None]]:
        """Sampled after each of FSDP2's unshards (gathered memory only grows there)."""
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        peak = [0]
        original = FSDPParamGroup.wait_for_unshard

        def sampled(self: FSDPParamGroup) -> None:
            original(self)
            peak[0] = max(peak[0], _unsharded_bytes(model))

        with mock.patch.object(FSDPParamGroup, "wait_for_unshard", sampled):
            yield lambda: peak[0]

    def accumulated_grad_bytes(self, model: Any) -> int | None:
        """FSDP2's unsharded gradients: ``unsharded_accumulated_grad`` when it accumulates in
        another dtype than it computes, else the unsharded parameters' ``.grad``."""
        grads = []
        for fsdp_param in _fsdp_params(model):
            if fsdp_param.unsharded_accumulated_grad is not None:
                grads.append(fsdp_param.unsharded_accumulated_grad)
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None and unsharded.grad is not None:
                grads.append(unsharded.grad)
        return unique_bytes(grads)


@dataclass(frozen=True)
class FSDP1(System):
    """``FullyShardedDataParallel`` wrapping each block, ``use_orig_params``, AdamW."""

    def build(self, base: nn.Module) -> tuple[nn.Module, Any]:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(
            copy.deepcopy(base), auto_wrap_policy=ModuleWrapPolicy({Block}),
            use_orig_params=True, device_id=device(),
        )  # fmt: skip
        return model, adamw(decay_groups(model))

    def full_params(self, model: Any) -> dict[str, torch.Tensor]:
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model):
            return {k.replace("_fsdp_wrapped_module.", ""): v.detach().clone()
                    for k, v in model.state_dict().items()}  # fmt: skip
