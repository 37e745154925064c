"""The user's parameter objects between forwards, on a sharded model.

Outside forward and backward, ``model.head.weight`` is the user's own parameter object
holding this rank's piece of it (a 1-D view of the live shard, possibly empty), as FSDP1's
``use_orig_params``: the optimizer's groups, freezing (``requires_grad_``) and identity
work on it. But a value read from it would be a slice that looks like the parameter, so
while it holds a piece its class is ``ShardPiece``: its shape, size, dtype, device,
``requires_grad`` and gradient answer for the whole parameter, and any computation on it
raises a ``ValueError`` naming the parameter and how to read it whole
(``summon_full_params``, ``gs.full_state_dict``). Where the piece is the whole parameter
(one process, ``no_shard``) it stays a plain ``nn.Parameter``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

FQN_ATTR = "_groupshard_piece_of"
WHOLE_ATTR = "_groupshard_whole"  # a meta tensor of the whole parameter's shape and dtype
CLASS_ATTR = "_groupshard_class"  # the class to give back while the parameter is whole

# answered by the real (piece) tensor: what a piece shares with the whole parameter
_PASS_THROUGH = {
    torch.Tensor.requires_grad.__get__,
    torch.Tensor.requires_grad.__set__,
    torch.Tensor.requires_grad_,
    torch.Tensor.data.__get__,
    torch.Tensor.data.__set__,
    torch.Tensor.grad.__get__,
    torch.Tensor.grad.__set__,
    torch.Tensor.is_leaf.__get__,
    torch.Tensor.retains_grad.__get__,
    torch.Tensor.grad_fn.__get__,
    torch.Tensor.is_sparse.__get__,
    torch.Tensor.is_quantized.__get__,
    torch.Tensor.is_floating_point,
    torch.Tensor.is_complex,
    torch.Tensor.dtype.__get__,
    torch.Tensor.device.__get__,
    torch.Tensor.is_cuda.__get__,
    torch.Tensor.is_meta.__get__,
    torch.Tensor.layout.__get__,
    torch.Tensor.__hash__,
    torch.Tensor.get_device,
    torch.Tensor.element_size,
}
# answered by a meta tensor of the whole parameter: its shape, not the piece's
_AS_WHOLE = {
    torch.Tensor.shape.__get__,
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.ndim.__get__,
    torch.Tensor.ndimension,
    torch.Tensor.numel,
    torch.Tensor.nelement,
    torch.Tensor.__len__,
}


class ShardPiece(nn.Parameter):
    """A user's parameter holding this rank's piece, between forwards (module docstring)."""

    def __repr__(self) -> str:
        fqn = getattr(self, FQN_ATTR, None)
        if fqn is None:
            return super().__repr__()
        whole = getattr(self, WHOLE_ATTR)
        return (
            f"ShardPiece({fqn!r}, whole shape {tuple(whole.shape)}, dtype {whole.dtype}: this "
            f"rank's piece of a sharded parameter; read it whole in summon_full_params)"
        )

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        piece = next((a for a in args if isinstance(a, ShardPiece)), None)
        fqn = getattr(piece, FQN_ATTR, None)
        with torch._C.DisableTorchFunctionSubclass():
            if fqn is None or func in _PASS_THROUGH:  # a copy (deepcopy) is a plain tensor
                return func(*args, **kwargs)
            if func in _AS_WHOLE and args and args[0] is piece:
                return func(getattr(piece, WHOLE_ATTR), *args[1:], **kwargs)
        name = getattr(func, "__name__", None) or repr(func)
        # a ValueError (the value is a piece), not a TypeError: torch turns a TypeError in an
        # operator (weight + 1) into NotImplemented, and Python's message then hides ours
        raise ValueError(
            f"{fqn!r} belongs to a model sharded by gs.shard: outside forward and backward "
            f"it holds only this rank's piece of the parameter, so {name} on it would compute "
            f"on a slice. Read it whole on every rank: inside `with "
            f"model.summon_full_params():`, or gs.full_state_dict(model)[{fqn!r}] "
            f"(rank0_only=True keeps the result on rank 0 only); during forward it is whole."
        )


def hold_piece(original: nn.Parameter, fqn: str, piece: torch.Tensor, whole: torch.Size) -> None:
    """``original`` holds ``piece`` of the parameter ``fqn`` of shape ``whole``; unless
    the piece is the whole parameter, it becomes a ``ShardPiece``. A parameter of another
    class than ``nn.Parameter`` keeps its class (its piece then reads as it is). Called
    at every reshard: past the first call it only points ``original`` at ``piece``."""
    with torch._C.DisableTorchFunctionSubclass():  # a ShardPiece's own .data, undispatched
        original.data = piece
    if tuple(piece.shape) == tuple(whole):
        release_piece(original)
        return
    if type(original) is nn.Parameter:
        setattr(original, CLASS_ATTR, nn.Parameter)
        original.__class__ = ShardPiece
    if isinstance(original, ShardPiece) and getattr(original, FQN_ATTR, None) != fqn:
        setattr(original, FQN_ATTR, fqn)
        setattr(original, WHOLE_ATTR, torch.empty(whole, dtype=piece.dtype, device="meta"))


def release_piece(original: nn.Parameter) -> None:
    """``original`` is about to hold the whole parameter: its own class again."""
    if isinstance(original, ShardPiece) and hasattr(original, CLASS_ATTR):
        original.__class__ = getattr(original, CLASS_ATTR)
