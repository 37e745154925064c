"""A collective of a sharded model made on some ranks only (``model.state_dict()`` or a
``generate`` under ``if rank == 0:``, which work under DDP) never hangs silently: after
``comm.WAIT_NOTICE_S`` the rank left waiting says on stderr which call it is in and that
every rank must make it. peft's methods that rewrite a sharded model's modules are refused,
naming what works."""

from __future__ import annotations

import contextlib
import io
import time

import pytest
import torch

import groupshard as gs
from groupshard import comm
from groupshard.cli.model import GPT, Block

from helpers import TINY

LATE_S = 1.5  # how late rank 1 makes the call


def _alone_for_a_while(rank: int, world_size: int, call: str) -> tuple[str, float]:
    """Rank 0 makes ``call`` at once, rank 1 ``LATE_S`` later; rank 0's stderr meanwhile and
    the call's result (a checksum, the same on every rank)."""
    comm.WAIT_NOTICE_S = 0.5
    torch.manual_seed(0)
    model = gs.shard(GPT(TINY), unit=Block)
    ids = torch.arange(8)[None] % TINY.vocab_size
    if rank == 1:
        time.sleep(LATE_S)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), torch.no_grad():
        if call == "state_dict":
            result = sum(value.double().sum().item() for value in model.state_dict().values())
        else:  # what generate does: forwards without gradients
            result = model(ids).double().sum().item()
    comm.WAIT_NOTICE_S = 30.0
    return stderr.getvalue(), result


@pytest.mark.parametrize(
    "call, named",
    [
        ("state_dict", "in model.state_dict() (also called by save_pretrained"),
        ("forward", "in a collective of the sharded model (its forward: model(...) or generate()"),
    ],
)
def test_a_rank_left_waiting_says_which_call_every_rank_must_make(run_ranks, call, named):
    (first, first_result), (second, second_result) = run_ranks(2, _alone_for_a_while, call)
    assert f"groupshard: rank 0 of 2 has waited 0.5 s for the other ranks {named}" in first
    assert "Every rank must make this call: under `if rank == 0:` alone it hangs." in first
    assert first.count("groupshard: rank") == 1  # said once, then it waited on
    assert second == ""  # rank 1 came late: it did not wait
    assert first_result == second_result  # and the call completed as a collective


def test_peft_merge_and_unload_on_a_sharded_model_names_what_works():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, target_modules=["q_proj"]))
    sharded = gs.shard(model)
    for method in ("merge_and_unload", "merge_adapter", "unload"):
        with pytest.raises(TypeError, match=rf"{method}\(\) rewrites the modules .* gs.full_state"):
            getattr(sharded, method)()
    # what the message says works: the full state dict into an unsharded peft model
    unsharded = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, target_modules=["q_proj"]))
    unsharded.load_state_dict(gs.full_state_dict(sharded))
    assert type(unsharded.merge_and_unload()).__name__ == "LlamaForCausalLM"
    assert type(sharded).__name__ == type(unsharded).__name__  # the user's class name kept
