"""Tensor parallelism (torch's ``parallelize_module`` on ``mesh["tp"]``) with groupshard's
data-parallel sharding over ``mesh["dp"]`` (issue 52): at world 4 as a 2 x 2 mesh, training
equals one process training the plain model on the global batch (tp peers see the same
data), with torchtitan's Llama plan, with and without sequence parallelism."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    apply_activation_checkpointing,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import groupshard as gs
from groupshard import comm
from groupshard.cli.model import parallelize_gpt
from test_muon import set_shard_grads
from tp_llama import Block, Llama, LlamaConfig, parallelize_llama

STEPS = 4
MAX_NORM = 0.5
TOLERANCE = 2e-5  # fp32 after 4 steps: TP reorders float sums


def _mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _plain_and_parallelized(tp_mesh, sequence_parallel: bool = True):
    """The plain Llama (seeded, the one-process reference) and a copy split over
    ``tp_mesh`` by torchtitan's plan."""
    torch.manual_seed(0)
    plain = Llama(LlamaConfig())
    return plain, parallelize_llama(copy.deepcopy(plain), tp_mesh, sequence_parallel)


@contextlib.contextmanager
def _counting(counts: dict[str, int], *names: str):
    """Inside the block, each call of ``comm``'s collectives ``names`` adds 1 to
    ``counts[name]`` (comm is the only caller of collectives)."""
    saved = {name: getattr(comm, name) for name in names}

    def counter(name, original):
        def counted(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return original(*args, **kwargs)

        return counted

    for name, original in saved.items():
        setattr(comm, name, counter(name, original))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(comm, name, original)


def _same_gradients(step: int, reference: nn.Module, model: nn.Module) -> None:
    """Random full gradients for ``step`` on the plain model's parameters, and this rank's
    slices of them on the sharded model's shards, as a reduction would leave them."""
    generator = torch.Generator().manual_seed(100 + step)
    grads = {n: torch.randn(p.shape, generator=generator) for n, p in reference.named_parameters()}
    for name, param in reference.named_parameters():
        param.grad = grads[name].clone()
    set_shard_grads(model, _local_gradients(model, grads))


def training_case(rank: int, world_size: int, strategy: str, sequence_parallel: bool) -> dict:
    """Four AdamW steps (decay on matrices, none on norms) of the TP'd Llama sharded over dp,
    clipped by torch's clip_grad_norm_ twice then by gs.clip_grad_norm_, and of the plain
    model on one process: the largest differences, and what the norms cost."""
    mesh = _mesh()
    dp_rank = mesh["dp"].get_local_rank()
    config = LlamaConfig()
    reference, model = _plain_and_parallelized(mesh["tp"], sequence_parallel)
    model = gs.shard(model, gs.decay_groups(model, 0.1), unit=Block, strategy=strategy,
                     mesh=mesh["dp"])  # fmt: skip
    optimizer = torch.optim.AdamW(model.optimizer_groups(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(gs.decay_groups(reference, 0.1), lr=1e-2)
    result = {"loss": 0.0, "total_norm": 0.0, "grad_norms": 0.0, "param_norms": 0.0}
    generator = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        tokens = torch.randint(0, config.vocab, (4, config.seq + 1), generator=generator)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        mine = slice(2 * dp_rank, 2 * dp_rank + 2)  # this dp rank's half of the global batch
        loss = F.cross_entropy(model(inputs[mine]).flatten(0, 1), targets[mine].flatten())
        loss.backward()
        expected = F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten())
        expected.backward()
        local_loss = loss.detach().clone()
        torch.distributed.all_reduce(local_loss, group=mesh["dp"].get_group())
        result["loss"] = max(result["loss"], abs(local_loss.item() / 2 - expected.item()))
        if step == 0:  # per parameter, whole-parameter values, one all-reduce per mesh dim
            counts: dict[str, int] = {}
            with _counting(counts, "all_reduce_sum"):
                grads = gs.grad_norms(model)
            result["norm_all_reduces"] = counts.get("all_reduce_sum", 0)
            wanted = {n: p.grad.norm() for n, p in reference.named_parameters()}
            assert grads.keys() == wanted.keys(), sorted(grads.keys() ^ wanted.keys())
            result["grad_norms"] = max(abs(grads[n] - wanted[n]).item() for n in wanted)
        if step < 2:
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        else:
            total = gs.clip_grad_norm_(model, MAX_NORM)
        wanted_total = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        assert wanted_total > MAX_NORM  # it clips
        result["total_norm"] = max(result["total_norm"], abs(total - wanted_total).item())
        optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    norms = gs.param_norms(model)
    result["param_norms"] = max(
        abs(norms[n] - p.detach().norm()).item() for n, p in reference.named_parameters()
    )
    full = gs.full_state_dict(model)
    plain = Llama(config)
    plain.load_state_dict(full, strict=True)  # global shapes, plain tensors
    assert not any(isinstance(t, DTensor) for t in full.values())
    result["weights"] = max(
        (full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters()
    )
    local = sum(s.local.numel() for s in model.groupshard.storages)
    total = sum(p.numel() for p in reference.parameters())
    result["elements"] = local / total
    assert model.num_unsharded_parameters() == total  # whole parameters, as before gs.shard
    report = {row["name"]: row for row in gs.norm_report(model)}
    for name, param in reference.named_parameters():
        assert report[name]["numel"] == param.numel(), name
        assert abs(report[name]["param_norm"] - param.norm().item()) < TOLERANCE, name
    return result


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("strategy", ["full", "grad_op", "no_shard"])
def test_llama_under_torchtitans_plan_trains_as_one_process(run_ranks, strategy, sequence_parallel):
    for rank, result in enumerate(run_ranks(4, training_case, strategy, sequence_parallel)):
        for key in ("loss", "total_norm", "grad_norms", "param_norms", "weights"):
            assert result[key] < TOLERANCE, (rank, key, result)
        assert result["norm_all_reduces"] == (1 if strategy == "no_shard" else 2), result
        if strategy != "no_shard":  # 2 x 2: matrices in quarters, norms in halves
            assert 0.2 <= result["elements"] <= 0.35, result


def _tp_sequential(tp_mesh, out_features: int = 16) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, out_features), nn.ReLU(), nn.Linear(out_features, 8))
    return parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _error_of(build) -> str:
    try:
        build()
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def bad_input_case(rank: int, world_size: int) -> dict[str, str]:
    """Each thing gs.shard cannot take with tensor parallelism, and what the sharded model
    refuses until the later parts: the error this rank saw."""
    mesh = _mesh()
    dp, tp = mesh["dp"], mesh["tp"]

    def with_parameter(tensor):
        module = nn.Module()
        module.weight = nn.Parameter(tensor)
        return lambda: gs.shard(module, mesh=dp)

    def sharded():
        model = _tp_sequential(tp)
        return gs.shard(model, gs.decay_groups(model, 0.1), unit=nn.Linear, mesh=dp)

    def parallelized_after_sharding():
        torch.manual_seed(0)
        model = gs.shard(Llama(LlamaConfig()), unit=Block)  # the whole world, no tp
        # (a plan that reaches a unit's flat shards may fail inside torch first: an
        # IndexError splitting a 1-D shard along dimension 1)
        parallelize_module(
            model, tp, {"tok_embeddings": RowwiseParallel(), "output": ColwiseParallel()}
        )
        model(torch.zeros(2, 4, dtype=torch.long))

    cases = {
        "placement": with_parameter(distribute_tensor(torch.randn(2, 2, 4), tp, [Shard(2)])),
        "2-D mesh": with_parameter(
            distribute_tensor(torch.randn(4, 4), mesh, [Shard(0), Shard(1)])
        ),
        "uneven": lambda: gs.shard(_tp_sequential(tp, out_features=5), mesh=dp),
        "process group": lambda: gs.shard(_tp_sequential(tp), process_group=dp.get_group()),
        "tp as dp": lambda: gs.shard(_tp_sequential(tp), mesh=tp),
        "parallelized after": parallelized_after_sharding,
        "regroup": lambda: gs.regroup(sharded(), None, []),
    }
    return {name: _error_of(build) for name, build in cases.items()}


EXPECTED_ERRORS = {
    "placement": "ValueError: Parameter 'weight' is a DTensor on a mesh of shape (2,) (dims "
    "('tp',)) with placements (Shard(dim=2),): gs.shard takes tensor-parallel placements "
    "Shard(0), Shard(1) or Replicate()",
    "2-D mesh": "ValueError: Parameter 'weight' is a DTensor on a mesh of shape (2, 2) (dims "
    "('dp', 'tp')) with placements (Shard(dim=0), Shard(dim=1)): gs.shard takes parameters "
    "split over one tensor-parallel dimension",
    "uneven": "ValueError: Parameter '0.weight' is a DTensor on a mesh of shape (2,) (dims "
    "('tp',)) with placements (Shard(dim=0),): its dimension 0 (5) does not divide evenly",
    "process group": "ValueError: Parameter '0.weight' is split over the tensor-parallel mesh "
    "('tp',) (ranks [{tp}]); gs.shard then needs the data-parallel dimension of the same mesh",
    "tp as dp": "ValueError: mesh= holds ranks [{tp}] and parameter '0.weight' is split over "
    "ranks [{tp}] (tp): the data-parallel and tensor-parallel dimensions must be the two",
    "parallelized after": "ValueError: Module 'tok_embeddings' was parallelized "
    "(parallelize_module or distribute_module) after gs.shard",
    "regroup": "ValueError: gs.regroup with tensor parallelism",
}


def test_what_it_cannot_take_is_refused_naming_the_parameter_on_every_rank(run_ranks):
    for rank, errors in enumerate(run_ranks(4, bad_input_case)):
        tp = ", ".join(map(str, (rank - rank % 2, rank - rank % 2 + 1)))  # this rank's tp peers
        for case, expected in EXPECTED_ERRORS.items():
            assert errors[case].startswith(expected.format(tp=tp)), (rank, case, errors[case])


def _optimizers(name: str, model: nn.Module, reference: nn.Module):
    """The same optimizer over the sharded model's groups and over the plain model's."""

    def build(groups):
        if name == "lamb":
            return gs.optim.LAMB(groups, lr=1e-2, weight_decay=0.01)
        if name == "lars":
            return gs.optim.LARS(groups, lr=0.5, weight_decay=1e-4, trust_coefficient=0.01)
        if name == "larc":
            return gs.optim.LARC(torch.optim.SGD(groups, lr=0.5), trust_coefficient=0.02)
        if name == "agc":
            return gs.optim.AGC(torch.optim.SGD(groups, lr=0.5), clipping=0.01)
        return torch.optim.AdamW(groups, lr=1e-2)

    return build(model.optimizer_groups()), build(gs.decay_groups(reference, 0.1))


class _EmbeddingsCopied(Llama):
    """The Llama with a copy of the embeddings' output before the first block. With torch
    2.13, a compiled block whose input is a TP style's local output as it is (here the
    row-wise embedding's ``to_local``) fails in backward, with or without groupshard
    (``'Tensor' object has no attribute '_local_tensor'`` in DTensor's redistribution);
    an eager op between them avoids it (docs/tensor-parallel.md)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens).clone()
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def regime_case(rank: int, world_size: int, name: str) -> dict:
    """Four steps under sequence parallelism with ``name``: a layer-wise optimizer (its trust
    ratios from whole-parameter norms), 2 micro-batches under ``no_sync``, activation
    checkpointing of every block, or every block compiled (aot_eager: torch's autograd
    graphs without generating C++); the largest difference of the weights from one process,
    and the gradient reductions started during the micro-batch without sync."""
    mesh = _mesh()
    dp_rank = mesh["dp"].get_local_rank()
    config = LlamaConfig()
    reference, model = _plain_and_parallelized(mesh["tp"])
    unit = Block
    if name == "checkpointing":  # torchtitan's order: TP, then activation checkpointing
        apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, Block))
        unit = CheckpointWrapper
    graphs: list[torch.fx.GraphModule] = []
    if name == "compile":  # torchtitan's order: TP, then each block compiled, then sharding

        def recording(graph, inputs):
            graphs.append(graph)
            return torch._dynamo.lookup_backend("aot_eager")(graph, inputs)

        model.__class__ = _EmbeddingsCopied
        for block in model.layers:
            block.compile(backend=recording)
    model = gs.shard(model, gs.decay_groups(model, 0.1), unit=unit, mesh=mesh["dp"])
    optimizer, reference_optimizer = _optimizers(name, model, reference)
    micro_batches = 2 if name == "accumulation" else 1
    counts: dict[str, int] = {}
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        # 4 rows, as training_case: with 8 AdamW turns the float noise of splitting the batch
        # over dp (TP or not) into 5e-5 at 4 steps, which LAMB's trust ratios keep at 5e-7
        tokens = torch.randint(0, config.vocab, (4, config.seq + 1), generator=generator)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        mine = range(2 * dp_rank, 2 * dp_rank + 2)  # this dp rank's half of the global batch
        for micro, rows in enumerate(torch.tensor(mine).chunk(micro_batches)):
            last = micro == micro_batches - 1
            with contextlib.ExitStack() as stack:
                if not last:
                    stack.enter_context(model.no_sync())
                    stack.enter_context(
                        _counting(counts, "reduce_scatter_mean", "all_reduce_mean")
                    )
                logits = model(inputs[rows])
                loss = F.cross_entropy(logits.flatten(0, 1), targets[rows].flatten())
                (loss / micro_batches).backward()
        F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten()).backward()
        gs.clip_grad_norm_(model, MAX_NORM)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        for each in (optimizer, reference_optimizer):
            each.step()
            each.zero_grad()
    full = gs.full_state_dict(model)  # checkpoint_wrapper's state-dict hook drops its prefix
    weights = max(
        (full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters()
    )
    return {
        "weights": weights,
        "reductions without sync": sum(counts.values()),
        "compiled graphs": len(graphs),
    }


@pytest.mark.parametrize(
    "name", ["lamb", "lars", "larc", "agc", "accumulation", "checkpointing", "compile"]
)
def test_layerwise_optimizers_and_the_regime_under_sequence_parallelism(run_ranks, name):
    for rank, result in enumerate(run_ranks(4, regime_case, name)):
        assert result["weights"] < TOLERANCE, (rank, result)
        assert result["reductions without sync"] == 0, (rank, result)
        assert (result["compiled graphs"] > 0) == (name == "compile"), (rank, result)


def three_d_case(rank: int, world_size: int) -> dict:
    """A (replicate, shard, tp) = (2, 2, 2) mesh at world 8, gs.shard over
    ``mesh["replicate", "shard"]``: four AdamW steps under sequence parallelism clipped by
    torch's clip_grad_norm_, against one process; the share of the model a rank holds."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    data_rank = mesh["replicate"].get_local_rank() * 2 + mesh["shard"].get_local_rank()
    config = LlamaConfig()
    reference, model = _plain_and_parallelized(mesh["tp"])
    model = gs.shard(model, gs.decay_groups(model, 0.1), unit=Block,
                     mesh=mesh["replicate", "shard"])  # fmt: skip
    optimizer, reference_optimizer = _optimizers("adamw", model, reference)
    generator = torch.Generator().manual_seed(1)
    totals = 0.0
    for _ in range(STEPS):
        tokens = torch.randint(0, config.vocab, (4, config.seq + 1), generator=generator)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        mine = slice(data_rank, data_rank + 1)  # a row per data-parallel rank
        F.cross_entropy(model(inputs[mine]).flatten(0, 1), targets[mine].flatten()).backward()
        F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten()).backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        wanted = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        totals = max(totals, abs(total - wanted).item())
        for each in (optimizer, reference_optimizer):
            each.step()
            each.zero_grad()
    full = gs.full_state_dict(model)
    weights = max(
        (full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters()
    )
    local = sum(s.local.numel() for s in model.groupshard.storages)
    total_elements = sum(p.numel() for p in reference.parameters())
    return {"weights": weights, "total_norm": totals, "elements": local / total_elements}


def test_three_d_mesh_replicates_shards_and_splits_as_one_process(run_ranks):
    for rank, result in enumerate(run_ranks(8, three_d_case)):
        assert result["weights"] < TOLERANCE and result["total_norm"] < TOLERANCE, (rank, result)
        assert 0.2 <= result["elements"] <= 0.35, (rank, result)  # 1 / (shard x tp), near


def _local_gradients(model, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full gradients ``grads`` cut to this tp rank's pieces (a DTensor parameter's)."""
    tensor_parallel = model.groupshard.tensor_parallel
    local = {}
    for name, grad in grads.items():
        param = tensor_parallel.params.get(name)
        if param is None or param.shard_dim is None:
            local[name] = grad
        else:
            size, rank = tensor_parallel.ranks.size, tensor_parallel.ranks.rank
            local[name] = grad.chunk(size, dim=param.shard_dim)[rank].contiguous()
    return local


def muon_case(rank: int, world_size: int, strategy: str, adjust_lr_fn: str | None) -> dict:
    """gs.optim.Muon over the TP'd Llama (sequence parallel) sharded over dp, and torch's
    Muon + AdamW on the plain model, with the same full gradients each step (as a reduction
    would leave them): the parameters that differ, and the optimizer's collectives."""
    mesh = _mesh()
    reference, model = _plain_and_parallelized(mesh["tp"])
    options = {
        "muon": {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": adjust_lr_fn},
        "adamw": {"lr": 3e-3, "weight_decay": 0.01, "betas": (0.9, 0.95), "eps": 1e-8},
    }
    model = gs.shard(model, gs.muon_groups(model, **options), unit=Block, strategy=strategy,
                     mesh=mesh["dp"])  # fmt: skip
    ours = gs.optim.Muon(model.optimizer_groups())
    plain = gs.muon_groups(reference, **options)
    groups = [{k: v for k, v in g.items() if k != "use_muon"} for g in plain]
    theirs = [torch.optim.Muon([groups[0]]), torch.optim.AdamW([groups[1]])]
    assert len(groups[0]["params"]) == 2 * 7  # every block matrix, row- and column-split
    counts: dict[str, int] = {}
    for step in range(3):
        _same_gradients(step, reference, model)
        for optimizer in theirs:
            optimizer.step()
        with _counting(counts, "all_gather", "all_to_all"), _counting_newton_schulz(counts):
            ours.step()
    full = gs.full_state_dict(model)
    different = [n for n, p in reference.state_dict().items() if not torch.equal(full[n], p)]
    newton_schulz = counts.pop("newton_schulz") / 3
    return {
        "different": different,
        "collectives": {k: v / 3 for k, v in counts.items()},
        "newton_schulz": newton_schulz,
    }


@contextlib.contextmanager
def _counting_newton_schulz(counts: dict[str, int]):
    """Inside the block, each Newton-Schulz iteration Muon runs adds 1 to counts."""
    from groupshard.optim import muon

    original = muon._newton_schulz

    def counted(*args, **kwargs):
        counts["newton_schulz"] = counts.get("newton_schulz", 0) + 1
        return original(*args, **kwargs)

    muon._newton_schulz = counted
    try:
        yield
    finally:
        muon._newton_schulz = original


@pytest.mark.parametrize(
    "strategy, adjust_lr_fn", [("full", None), ("no_shard", "match_rms_adamw")]
)
def test_muon_orthogonalizes_whole_matrices_gathered_over_tp_bitwise(
    run_ranks, strategy, adjust_lr_fn
):
    results = run_ranks(4, muon_case, strategy, adjust_lr_fn)
    for rank, result in enumerate(results):
        assert result["different"] == [], (rank, result)
        if strategy == "full":
            # per step: the dp exchange's two all-to-alls, then over tp one all-gather of the
            # owned matrices' pieces and one all-to-all of the results' pieces; the 14
            # matrices' Newton-Schulz shared by the 4 ranks
            assert result["collectives"] == {"all_to_all": 3, "all_gather": 1}, result
            assert 2 <= result["newton_schulz"] <= 5, (rank, result)
        else:  # every rank holds every matrix: no exchange over dp; over tp as above, each
            # tp pair sharing its 14 matrices
            assert result["collectives"] == {"all_to_all": 1, "all_gather": 1}, result
            assert 5 <= result["newton_schulz"] <= 9, (rank, result)
    orthogonalized = sum(r["newton_schulz"] for r in results)
    assert orthogonalized == (14 if strategy == "full" else 28), results


def bf16_case(rank: int, world_size: int) -> dict:
    """bf16 compute from fp32 masters, gradients reduced in fp32, under sequence
    parallelism: groupshard over dp and FSDP2's fully_shard over dp with the same policy,
    the same TP plan, batches and AdamW: the largest difference of their weights and
    losses (the same casts in the same places)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = _mesh()
    dp_rank = mesh["dp"].get_local_rank()
    config = LlamaConfig()
    _, ours = _plain_and_parallelized(mesh["tp"])
    _, theirs = _plain_and_parallelized(mesh["tp"])
    bf16 = gs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ours = gs.shard(ours, gs.decay_groups(ours, 0.1), unit=Block, mesh=mesh["dp"],
                    mixed_precision=bf16)  # fmt: skip
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in theirs.layers:
        fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(theirs, mesh=mesh["dp"], mp_policy=policy)
    optimizers = [
        torch.optim.AdamW(ours.optimizer_groups(), lr=1e-2),
        torch.optim.AdamW(gs.decay_groups(theirs, 0.1), lr=1e-2),
    ]
    losses = 0.0
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        tokens = torch.randint(0, config.vocab, (4, config.seq + 1), generator=generator)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        mine = slice(2 * dp_rank, 2 * dp_rank + 2)
        step_losses = []
        for model, optimizer in zip((ours, theirs), optimizers, strict=True):
            logits = model(inputs[mine]).float()
            loss = F.cross_entropy(logits.flatten(0, 1), targets[mine].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step_losses.append(loss.item())
        losses = max(losses, abs(step_losses[0] - step_losses[1]))
    full = gs.full_state_dict(ours)
    weights = max(
        (full[name] - param.full_tensor()).abs().max().item()
        for name, param in theirs.named_parameters()
    )
    dtypes = sorted({str(t.dtype) for t in full.values()})
    return {"weights": weights, "losses": losses, "dtypes": dtypes}


def test_bf16_under_sequence_parallelism_equals_fsdp2_with_the_same_policy(run_ranks):
    for rank, result in enumerate(run_ranks(4, bf16_case)):
        assert result["dtypes"] == ["torch.float32"], result  # the fp32 masters
        assert result["weights"] <= 1e-6 and result["losses"] == 0.0, (rank, result)


def adafactor_case(rank: int, world_size: int, strategy: str) -> list[str]:
    """gs.optim.WholeParamOptimizer with torch's Adafactor over the TP'd Llama sharded over
    dp, and Adafactor on the plain model, with the same full gradients each step: the
    parameters that differ (its factored moments need each whole matrix)."""
    mesh = _mesh()
    reference, model = _plain_and_parallelized(mesh["tp"])
    model = gs.shard(model, gs.decay_groups(model, 0.1), unit=Block, strategy=strategy,
                     mesh=mesh["dp"])  # fmt: skip
    ours = gs.optim.WholeParamOptimizer(
        model.optimizer_groups(), torch.optim.Adafactor, lr=1e-2
    )
    theirs = torch.optim.Adafactor(gs.decay_groups(reference, 0.1), lr=1e-2)
    for step in range(3):
        _same_gradients(step, reference, model)
        theirs.step()
        ours.step()
    full = gs.full_state_dict(model)
    return [n for n, p in reference.state_dict().items() if not torch.equal(full[n], p)]


@pytest.mark.parametrize("strategy", ["full", "no_shard"])
def test_whole_param_optimizer_steps_adafactor_on_whole_matrices_bitwise(run_ranks, strategy):
    for rank, different in enumerate(run_ranks(4, adafactor_case, strategy)):
        assert different == [], (rank, different)


def scaler_case(rank: int, world_size: int) -> dict:
    """gs.GradScaler under sequence parallelism, with an overflow in one rank's piece of one
    gradient only: every rank skips the step (no weight changes) and halves the scale; the
    next step, without one, moves the weights."""
    mesh = _mesh()
    _, model = _plain_and_parallelized(mesh["tp"])
    model = gs.shard(model, gs.decay_groups(model, 0.1), unit=Block, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.optimizer_groups(), lr=1e-2)
    scaler = gs.GradScaler(model, init_scale=2.0**4)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    moved = []
    for step in range(2):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        scaler.scale(loss).backward()
        if step == 0 and rank == 1:  # dp rank 0, tp rank 1: the others hold no inf
            model.optimizer_groups()[0]["params"][0].grad[0] = float("inf")
        before = gs.full_state_dict(model)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        after = gs.full_state_dict(model)
        moved.append(any(not torch.equal(before[n], after[n]) for n in before))
    return {"moved": moved, "scale": scaler.get_scale()}


def test_grad_scaler_agrees_on_an_overflow_over_dp_and_tp(run_ranks):
    for rank, result in enumerate(run_ranks(4, scaler_case)):
        assert result == {"moved": [False, True], "scale": 8.0}, (rank, result)


def gpt_case(rank: int, world_size: int, qkv_by_head: bool) -> dict:
    """The command line's GPT split by ``parallelize_gpt`` over tp and sharded over dp: three
    AdamW steps against the plain model on one process; which projections are split."""
    from groupshard.cli.model import GPT, GPTConfig
    from groupshard.cli.model import Block as GPTBlock

    mesh = _mesh()
    dp_rank = mesh["dp"].get_local_rank()
    config = GPTConfig(block_size=16, n_layer=2, n_head=4, n_embd=32, qkv_by_head=qkv_by_head)
    torch.manual_seed(0)
    reference = GPT(config)
    model = parallelize_gpt(copy.deepcopy(reference), mesh["tp"])
    split = sorted(
        n for n, p in model.named_parameters()
        if isinstance(p, DTensor) and any(each.is_shard() for each in p.placements)
    )  # fmt: skip
    model = gs.shard(model, gs.decay_groups(model, 0.1), unit=GPTBlock, mesh=mesh["dp"])
    # eps 1e-6: the query and key weights' gradients start near 0 (near-uniform attention),
    # where the default 1e-8 would scale TP's float reordering up to lr-sized differences
    optimizer = torch.optim.AdamW(model.optimizer_groups(), lr=1e-2, eps=1e-6)
    reference_optimizer = torch.optim.AdamW(gs.decay_groups(reference, 0.1), lr=1e-2, eps=1e-6)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        tokens = torch.randint(0, 256, (4, config.block_size + 1), generator=generator)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        mine = slice(2 * dp_rank, 2 * dp_rank + 2)
        model(inputs[mine], targets[mine]).backward()
        reference(inputs, targets).backward()
        for each in (optimizer, reference_optimizer):
            each.step()
            each.zero_grad()
    full = gs.full_state_dict(model)
    weights = {n: (full[n] - p).abs().max().item() for n, p in reference.named_parameters()}
    return {"weights": max(weights.values()), "worst": max(weights, key=weights.get),
            "split": split}  # fmt: skip


@pytest.mark.parametrize("qkv_by_head", [True, False], ids=["by-head", "earlier-layout"])
def test_the_command_lines_gpt_splits_attention_by_heads_and_trains_as_one_process(
    run_ranks, qkv_by_head
):
    """``groupshard train --tp``'s plan: with the fused projection laid out head by head,
    attention is split as the MLP is; with the earlier layout it stays replicated."""
    per_block = ["fc.bias", "fc.weight", "out.weight"]
    if qkv_by_head:
        per_block += ["attn.proj.weight", "attn.qkv.weight"]
    split = sorted(["wte.weight"] + [f"blocks.{i}.{n}" for i in range(2) for n in per_block])
    for result in run_ranks(4, gpt_case, qkv_by_head):
        assert result["split"] == split, result
        assert result["weights"] < TOLERANCE, result


def test_the_head_by_head_layout_is_the_earlier_one_with_its_rows_reordered():
    """Same function, rows permuted: [q; k; v] of head 0, then of head 1, ..."""
    from groupshard.cli.model import CausalSelfAttention, GPTConfig

    torch.manual_seed(0)
    earlier = CausalSelfAttention(GPTConfig(n_head=4, n_embd=32))
    by_head = CausalSelfAttention(GPTConfig(n_head=4, n_embd=32, qkv_by_head=True))
    by_head.load_state_dict(earlier.state_dict())
    with torch.no_grad():
        rows = earlier.qkv.weight.view(3, 4, 8, 32).transpose(0, 1).reshape(96, 32)
        by_head.qkv.weight.copy_(rows)
    x = torch.randn(2, 16, 32)
    assert torch.equal(by_head(x), earlier(x))
