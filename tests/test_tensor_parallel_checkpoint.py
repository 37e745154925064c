"""Checkpoints of tensor-parallel models (issue 54): a TP'd Llama sharded over ``mesh["dp"]``
saves every parameter and optimizer state in its global shape, through ``gs.checkpoint``
and torch's idiom (``get_state_dict`` + ``dcp.save``), and training after a load equals
the run that never stopped: in the same split, across splits (dp 2 x tp 2 and a 1-D mesh
of 4 without TP, both ways), with FSDP2 + TP both ways, and in one process."""

from __future__ import annotations

import gc
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import groupshard as gs
from test_meta_init import _current_rss_bytes, _peak_rss_bytes
from tp_llama import Block, Llama, LlamaConfig, parallelize_llama

STEPS, SAVE_AT = 4, 2
TOLERANCE = 2e-5  # across splits: TP and dp reorder float sums
LR = 1e-2


def _system(name: str, mesh, seed: int):
    """The Llama and AdamW (decay on matrices) as ``name`` trains them: "gs-tp" (dp 2 x tp 2,
    sequence parallel), "gs-1d" (sharded over all 4 ranks, no TP) or "fsdp2-tp"."""
    torch.manual_seed(seed)
    model = Llama(LlamaConfig())
    if name == "gs-1d":
        model = gs.shard(model, gs.decay_groups(model, 0.1), unit=Block)
        return model, torch.optim.AdamW(model.optimizer_groups(), lr=LR)
    model = parallelize_llama(model, mesh["tp"], sequence_parallel=True)
    if name == "fsdp2-tp":
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model, torch.optim.AdamW(gs.decay_groups(model, 0.1), lr=LR)
    model = gs.shard(model, gs.decay_groups(model, 0.1), unit=Block, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.optimizer_groups(), lr=LR)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    config = LlamaConfig()
    generator = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, config.vocab, (4, config.seq + 1), generator=generator)]
    tokens += [torch.randint(0, config.vocab, (4, config.seq + 1), generator=generator)
               for _ in range(STEPS - 1)]  # fmt: skip
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _train(name: str, model, optimizer, mesh, steps: range) -> None:
    """``steps`` of the global batch of 4 rows, each data-parallel rank on its share."""
    if name == "gs-1d":
        rank = torch.distributed.get_rank()
        mine = slice(rank, rank + 1)
    else:
        dp_rank = mesh["dp"].get_local_rank()
        mine = slice(2 * dp_rank, 2 * dp_rank + 2)
    batches = _batches()
    for step in steps:
        inputs, targets = batches[step]
        logits = model(inputs[mine])
        F.cross_entropy(logits.flatten(0, 1), targets[mine].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()


def _reference(steps: int):
    """The plain Llama and its AdamW after ``steps`` steps of the global batch, on one
    process."""
    torch.manual_seed(0)
    reference = Llama(LlamaConfig())
    optimizer = torch.optim.AdamW(gs.decay_groups(reference, 0.1), lr=LR)
    for inputs, targets in _batches()[:steps]:
        F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return reference, optimizer


def _weights(name: str, model) -> dict[str, torch.Tensor]:
    if name == "fsdp2-tp":
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return gs.full_state_dict(model)


def _save(how: str, path: str, model, optimizer) -> None:
    if how == "gs":
        gs.checkpoint.save(path, model, optimizer)
    else:
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def _load(how: str, path: str, model, optimizer) -> None:
    if how == "gs":
        gs.checkpoint.load(path, model, optimizer)
    else:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )


def _difference(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    assert ours.keys() == theirs.keys(), sorted(ours.keys() ^ theirs.keys())
    return max((ours[n].float() - theirs[n].float()).abs().max().item() for n in ours)


SAVERS = [("gs-tp", "gs"), ("gs-tp", "torch"), ("gs-1d", "gs"), ("fsdp2-tp", "torch")]
RESUMES = [  # (saved by, how), loaded by, how
    (("gs-tp", "gs"), "gs-tp", "gs"),
    (("gs-tp", "torch"), "gs-tp", "torch"),
    (("gs-tp", "torch"), "fsdp2-tp", "torch"),  # FSDP2 + TP loads ours
    (("fsdp2-tp", "torch"), "gs-tp", "gs"),  # we load FSDP2 + TP's
    (("fsdp2-tp", "torch"), "gs-tp", "torch"),
    (("gs-tp", "gs"), "gs-1d", "gs"),  # dp 2 x tp 2 -> 1-D mesh of 4
    (("gs-1d", "gs"), "gs-tp", "torch"),  # and back
]


def resume_case(rank: int, world_size: int, folder: str) -> dict[str, float]:
    """Every saver trains, saves at step 2 and trains on; every resume loads into a model
    seeded otherwise and trains on: each final state's largest difference from the plain
    model trained on one process, and a resume's from its saver's uninterrupted run; one
    process's conversions of the TP run's folders, from what that run held when it saved."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    expected = _reference(STEPS)[0].state_dict()
    result: dict[str, float] = {}
    finals, saved_weights = {}, {}
    for saver, how in SAVERS:
        model, optimizer = _system(saver, mesh, seed=0)
        _train(saver, model, optimizer, mesh, range(SAVE_AT))
        _save(how, f"{folder}/{saver}-{how}", model, optimizer)
        saved_weights[saver, how] = _weights(saver, model)
        _train(saver, model, optimizer, mesh, range(SAVE_AT, STEPS))
        finals[saver, how] = _weights(saver, model)
        result[f"{saver} by {how}, uninterrupted"] = _difference(finals[saver, how], expected)
    for (saver, saved_how), loader, how in RESUMES:
        model, optimizer = _system(loader, mesh, seed=7)
        _load(how, f"{folder}/{saver}-{saved_how}", model, optimizer)
        _train(loader, model, optimizer, mesh, range(SAVE_AT, STEPS))
        final = _weights(loader, model)
        name = f"{saver} by {saved_how} -> {loader} by {how}"
        result[name] = _difference(final, expected)
        if loader == saver:
            uninterrupted = finals[saver, saved_how]
            result[f"{name}, from its uninterrupted run"] = _difference(final, uninterrupted)
    if rank == 0:  # one process reads the folders into the plain model
        for how in ("gs", "torch"):
            dcp_to_torch_save(f"{folder}/gs-tp-{how}", f"{folder}/{how}.pt")
            saved = torch.load(f"{folder}/{how}.pt", weights_only=True)
            if "model" not in saved:  # a folder of entries by their full names (gs.checkpoint)
                saved = {"model": {n[6:]: t for n, t in saved.items() if n.startswith("model.")}}
            exact = saved_weights["gs-tp", how]  # what the TP run held when it saved
            result[f"dcp_to_torch_save of gs-tp by {how}"] = _difference(saved["model"], exact)
        gs.checkpoint.to_torch_save(f"{folder}/gs-tp-gs", f"{folder}/converted.pt")
        saved = torch.load(f"{folder}/converted.pt", weights_only=True)["model"]
        result["gs.checkpoint.to_torch_save of gs-tp"] = _difference(
            saved, saved_weights["gs-tp", "gs"]
        )
    return result


def test_checkpoints_cross_splits_and_systems_and_resume_exactly(run_ranks, tmp_path):
    for rank, result in enumerate(run_ranks(4, resume_case, str(tmp_path))):
        for name, difference in result.items():
            exact = "from its uninterrupted run" in name or "to_torch_save" in name
            limit = 0.0 if exact else TOLERANCE
            assert difference <= limit, (rank, name, difference, result)
        same_system = sum(loader == saved[0] for saved, loader, _ in RESUMES)
        wanted = len(SAVERS) + len(RESUMES) + same_system + (3 if rank == 0 else 0)
        assert len(result) == wanted, result


def full_state_case(rank: int, world_size: int) -> dict[str, float]:
    """Whole tensors under TP: torch's full state dicts (``full_state_dict=True``) and
    ``gs.optim_state_dict`` equal the plain model's and optimizer's after 2 steps; loaded
    into a model seeded otherwise (torch's ``set_state_dict`` with and without
    ``broadcast_from_rank0``, ``model.load_state_dict`` + ``gs.load_optim_state_dict``),
    training on equals the run that never stopped, bit for bit."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    reference, reference_optimizer = _reference(SAVE_AT)
    names = {id(p): n for n, p in reference.named_parameters()}
    expected_state = {names[id(p)]: s for p, s in reference_optimizer.state.items()}
    model, optimizer = _system("gs-tp", mesh, seed=0)
    _train("gs-tp", model, optimizer, mesh, range(SAVE_AT))
    whole = StateDictOptions(full_state_dict=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=whole)
    ours = gs.optim_state_dict(model, optimizer)["state"]
    result = {
        "model": _difference(model_state, reference.state_dict()),
        "optimizer": max(
            (state[fqn][key] - expected[key]).abs().max().item()
            for state in (optim_state["state"], ours)
            for fqn, expected in expected_state.items()
            for key in ("exp_avg", "exp_avg_sq", "step")
        ),
    }
    gs_optim_state = gs.optim_state_dict(model, optimizer)
    _train("gs-tp", model, optimizer, mesh, range(SAVE_AT, STEPS))
    uninterrupted = gs.full_state_dict(model)
    for how in ("set_state_dict", "broadcast_from_rank0", "gs"):
        resumed, resumed_optimizer = _system("gs-tp", mesh, seed=7)
        if how == "gs":
            resumed.load_state_dict(model_state)
            gs.load_optim_state_dict(resumed, resumed_optimizer, gs_optim_state)
        elif how == "set_state_dict":
            set_state_dict(
                resumed, resumed_optimizer, model_state_dict=model_state,
                optim_state_dict=optim_state, options=whole,
            )  # fmt: skip
        else:  # rank 0's dicts only (set_state_dict would take the others' {} for no model)
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            given = rank == 0
            set_model_state_dict(resumed, model_state if given else {}, options=options)
            set_optimizer_state_dict(
                resumed, resumed_optimizer, optim_state if given else {}, options=options
            )
        _train("gs-tp", resumed, resumed_optimizer, mesh, range(SAVE_AT, STEPS))
        result[f"{how}, from the uninterrupted run"] = _difference(
            gs.full_state_dict(resumed), uninterrupted
        )
    return result


def test_whole_state_dicts_under_tp_are_the_plain_models_and_resume_exactly(run_ranks):
    for rank, result in enumerate(run_ranks(4, full_state_case)):
        assert result["model"] < TOLERANCE and result["optimizer"] < TOLERANCE, (rank, result)
        for how in ("set_state_dict", "broadcast_from_rank0", "gs"):
            assert result[f"{how}, from the uninterrupted run"] == 0.0, (rank, how, result)


WIDE = LlamaConfig(vocab=256, dim=512, heads=8, hidden=2048, layers=8)
"""About 34M parameters (134 MB in fp32), in 8 blocks of 17 MB."""


def meta_case(rank: int, world_size: int, path: str) -> dict[str, float]:
    """Build the wide Llama on the meta device, parallelize it (dp 2 x tp 2) and shard it:
    the peak memory of construction and what a rank holds; then the safetensors file
    loaded into it (this rank's slices only): its largest difference from the file, and
    the bytes read."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to now
    baseline = _current_rss_bytes()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(WIDE)
    model = parallelize_llama(model, mesh["tp"], sequence_parallel=True)
    model = gs.shard(model, gs.decay_groups(model, 0.1), unit=Block, mesh=mesh["dp"])
    peak = _peak_rss_bytes() - baseline
    held = sum(s.local.numel() * s.local.element_size() for s in model.groupshard.storages)
    unit = max(u.unsharded_bytes for u in model.groupshard.runtime.units)
    initialized = gs.full_state_dict(model)
    torch.manual_seed(0)  # the same model built on meta without TP, over the 4 ranks
    with torch.device("meta"):
        plain = Llama(WIDE)
    plain = gs.shard(plain, unit=Block)
    without_tp = gs.full_state_dict(plain)
    del plain
    read = gs.load_full_state_dict(model, path)
    return {
        "peak": peak, "held": held, "unit": unit, "read": read,
        "initialized as without TP": _difference(initialized, without_tp),
        "initialized": min(t.abs().max().item() for t in initialized.values()),
        "difference from the file": _difference(gs.full_state_dict(model), load_file(path)),
    }  # fmt: skip


def test_meta_construction_allocates_slices_and_loads_safetensors_slices(run_ranks, tmp_path):
    """At 2 x 2 a rank holds a quarter of the model (33 MB of 134 MB), plus the norms split
    over dp only; while a block is built, that block whole (initialized as without TP, then
    each rank keeps its pieces) and its local pieces. The values are those of the same model
    built on meta without TP. Loaded from a safetensors file, each rank reads about its
    quarter and the model is the file's."""
    torch.manual_seed(3)
    plain = Llama(WIDE)
    path = str(tmp_path / "model.safetensors")
    save_file(plain.state_dict(), path)
    total = sum(p.numel() * 4 for p in plain.parameters())
    del plain
    for rank, result in enumerate(run_ranks(4, meta_case, path, timeout=300)):
        assert result["initialized"] > 0, (rank, result)  # reset_parameters ran on the pieces
        assert result["held"] <= total / 4 + 2**20, (rank, result)
        assert result["peak"] < total / 2, (rank, result)
        # the unit's local pieces and, while it is initialized, the whole unit (2 x pieces)
        assert result["peak"] <= result["held"] + 3 * result["unit"] + 16 * 2**20, (rank, result)
        assert result["read"] <= total / 4 * 1.1, (rank, result)
        assert result["initialized as without TP"] == 0.0, (rank, result)
        assert result["difference from the file"] == 0.0, (rank, result)


def _adafactor(mesh, seed: int):
    """The TP'd Llama sharded over dp with torch's Adafactor on whole parameters."""
    torch.manual_seed(seed)
    model = parallelize_llama(Llama(LlamaConfig()), mesh["tp"], sequence_parallel=True)
    model = gs.shard(model, gs.decay_groups(model, 0.1), unit=Block, mesh=mesh["dp"])
    optimizer = gs.optim.WholeParamOptimizer(
        model.optimizer_groups(), torch.optim.Adafactor, lr=1e-2
    )
    return model, optimizer


def whole_param_case(rank: int, world_size: int, folder: str) -> dict[str, float]:
    """gs.optim.WholeParamOptimizer (Adafactor's factored moments of whole matrices) under
    TP: saved by gs.checkpoint, or as whole state dicts, and loaded into a model seeded
    otherwise, training on equals the run that never stopped."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, optimizer = _adafactor(mesh, seed=0)
    _train("gs-tp", model, optimizer, mesh, range(SAVE_AT))
    gs.checkpoint.save(f"{folder}/adafactor", model, optimizer)
    model_state = gs.full_state_dict(model)
    optim_state = gs.optim_state_dict(model, optimizer)
    _train("gs-tp", model, optimizer, mesh, range(SAVE_AT, STEPS))
    uninterrupted = gs.full_state_dict(model)
    result = {}
    for how in ("gs.checkpoint", "state dicts"):
        resumed, resumed_optimizer = _adafactor(mesh, seed=7)
        if how == "gs.checkpoint":
            gs.checkpoint.load(f"{folder}/adafactor", resumed, resumed_optimizer)
        else:
            resumed.load_state_dict(model_state)
            gs.load_optim_state_dict(resumed, resumed_optimizer, optim_state)
        _train("gs-tp", resumed, resumed_optimizer, mesh, range(SAVE_AT, STEPS))
        result[how] = _difference(gs.full_state_dict(resumed), uninterrupted)
    return result


def test_whole_param_optimizer_state_under_tp_saves_and_resumes_exactly(run_ranks, tmp_path):
    for rank, result in enumerate(run_ranks(4, whole_param_case, str(tmp_path))):
        assert result == {"gs.checkpoint": 0.0, "state dicts": 0.0}, (rank, result)
