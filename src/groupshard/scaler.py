"""``gs.GradScaler``: fp16 loss scaling whose overflow check is agreed across ranks.

``torch.amp.GradScaler`` with its interface (``scale``, ``unscale_``, ``step``, ``update``,
``state_dict``, ``load_state_dict``), plus one all-reduce (maximum) of the inf/NaN flag
over the model's ranks at each check. A sharded gradient overflows on the ranks whose
slices hold the overflowing elements only, so without it some ranks would step and the
others skip, leaving the shards at different steps and the scales apart.

torch's ``ShardedGradScaler`` all-reduces the flag in ``unscale_`` only, which does for
optimizers without their own unscaling. With a fused optimizer (``fused=True``),
``step`` without ``unscale_`` checks each rank alone, and after ``unscale_`` the fused
step fails (its summed flag has shape ``[1]``, fused Adam's step counts ``[]``). Here the
one check both paths go through agrees, and the flag stays a 0-dim 0 or 1.
"""

from __future__ import annotations

from typing import Any

import torch

from groupshard import comm
from groupshard.sharding import sharding_state


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for a groupshard model: every rank skips a step, and halves
    the scale, when any rank's gradients hold an inf or NaN.

    Use it as torch's, over ``model.optimizer_groups()``'s optimizer, on every rank (each
    ``unscale_``, and each ``step`` without one, is a collective)::

        scaler = gs.GradScaler(model)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)             # agreed check; the gradients' true values
        gs.clip_grad_norm_(model, 1.0)         # or torch.nn.utils.clip_grad_norm_
        scaler.step(optimizer)                 # skipped on every rank after an overflow
        scaler.update()

    Args:
        model: the sharded model (``gs.shard``'s result): its ranks agree, and its shards'
            device is the scaler's. ``None``: ``process_group`` (default: the default
            process group, or one process) and ``device``.
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as
            ``torch.amp.GradScaler``'s, with its defaults.
        device: the device type of the scale (``"cuda"``, ``"cpu"``); default: the model's,
            else ``"cuda"`` where CUDA is available, else ``"cpu"``.
        process_group: the ranks to agree over when there is no ``model``.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        device: str | None = None,
        process_group: Any = None,
    ) -> None:
        if model is not None and process_group is not None:
            raise ValueError("gs.GradScaler takes a model or a process_group, not both")
        if model is not None:
            state = sharding_state(model, "gs.GradScaler")
            # under tensor parallelism the tp ranks hold other pieces of the gradients: the
            # flag is agreed over them too
            tensor_parallel = state.tensor_parallel
            tp = () if tensor_parallel is None else (tensor_parallel.ranks,)
            self._agree_over: tuple[comm.Ranks, ...] = (state.ranks, *tp)
        else:
            self._agree_over = (comm.resolve_ranks(process_group),)
        if device is None:
            if model is not None:
                device = next(model.parameters()).device.type
            else:
                device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """torch's check and unscale of this rank's gradients (``unscale_``; with
        ``inv_scale`` 1, the check alone, for an optimizer that unscales in its step), then
        the flag agreed over the ranks: 1.0 where any rank found an inf or NaN, else 0.0."""
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        agreed = torch.zeros((), dtype=torch.float32, device=found_inf.device)
        for flag in per_device.values():
            torch.maximum(agreed, flag.to(agreed.device), out=agreed)
        for ranks in self._agree_over:
            comm.all_reduce_max(agreed, ranks)
        return {agreed.device: agreed}
