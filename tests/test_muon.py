"""gs.optim.Muon: torch.optim.Muon + torch.optim.AdamW bit for bit, on shards (gs.shard and
the ZeRO optimizer) and on plain parameters; ownership, collectives, state dicts, errors."""

from __future__ import annotations

import copy
from collections import Counter
from unittest import mock

import pytest
import torch
from torch import nn

import groupshard as gs
from groupshard import comm, flatten
from groupshard.cli.model import GPT, Block, GPTConfig
from groupshard.optim.muon import assign_owners, newton_schulz_cost
from groupshard.segments import segments_of

pytestmark = pytest.mark.skipif(
    not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon (the reference) needs torch 2.9+"
)

LR, WEIGHT_DECAY = 0.02, 0.1
VOCAB, WIDTH, SEQ = 29, 19, 6


class OddBlock(nn.Module):
    """Tall, square and wide matrices of odd sizes, so shard boundaries cut through them."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)  # tall
        self.mix = nn.Linear(hidden, hidden, bias=False)  # square
        self.down = nn.Linear(hidden, width)  # wide
        self.use_mix = True  # False: mix gets no gradient, the rest of its shard does

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.up(self.norm(x)))
        if self.use_mix:
            hidden = torch.tanh(self.mix(hidden))
        return x + self.down(hidden)


class OddNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(OddBlock(WIDTH, hidden) for hidden in (37, 23))
        self.norm = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.skip: int | None = None  # a block left out: none of its parameters has a gradient

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for index, block in enumerate(self.blocks):
            if index != self.skip:
                x = block(x)
        logits = self.lm_head(self.norm(x))
        return nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


GROUP_OPTIONS = {
    "muon0": {"lr": 0.03},  # the other Muon keys from the constructor
    "muon1": {
        "lr": 0.01, "momentum": 0.9, "nesterov": False, "weight_decay": 0.05,
        "adjust_lr_fn": "match_rms_adamw",
    },
    "adamw": {"use_muon": False, "lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.01},
    "adamw_no_decay": {"use_muon": False, "lr": 2e-3, "weight_decay": 0.0},  # eps: AdamW's
}  # fmt: skip


def make_groups(model: nn.Module) -> list[dict]:
    """Two Muon groups (block 0 / block 1 matrices) and two AdamW groups."""

    def key(name: str, param: torch.Tensor) -> str:
        if param.ndim == 2 and name.startswith("blocks."):
            return "muon0" if name.startswith("blocks.0.") else "muon1"
        return "adamw" if param.ndim == 2 else "adamw_no_decay"

    return gs.groups_by(model, key, GROUP_OPTIONS)


def make_muon(params) -> gs.optim.Muon:
    return gs.optim.Muon(params, lr=LR, weight_decay=WEIGHT_DECAY)


def reference_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    """torch.optim.Muon over the Muon groups, torch.optim.AdamW over the others."""
    groups = make_groups(model)

    def plain(group):
        return {k: v for k, v in group.items() if k != "use_muon"}

    muon = [plain(g) for g in groups if g.get("use_muon", True)]
    adamw = [plain(g) for g in groups if not g.get("use_muon", True)]
    return [torch.optim.Muon(muon, lr=LR, weight_decay=WEIGHT_DECAY), torch.optim.AdamW(adamw)]


def full_gradients(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return {
        name: torch.randn(p.shape, generator=generator)
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def set_shard_grads(sharded: gs.ShardedModule, grads: dict[str, torch.Tensor]) -> None:
    """Each shard's slice of the full gradients, as a reduce-scatter would leave it."""
    for storage in sharded.groupshard.storages:
        for shard, buffer in zip(
            storage.trainable_shards, storage.layout.trainable_buffers, strict=True
        ):
            values = [grads[slot.fqn] for slot in buffer.params]
            shard.grad = flatten.shard_of(values, buffer, storage.shard_rank, shard)


def step_with(grads, optimizers, model=None, sharded=None) -> None:
    if model is not None:
        for name, p in model.named_parameters():
            p.grad = grads[name].clone()
    if sharded is not None:
        set_shard_grads(sharded, grads)
    for optimizer in optimizers:
        optimizer.step()


def straddling(sharded: gs.ShardedModule, group_indices=(0, 1)) -> list[str]:
    """The Muon matrices whose elements lie on more than one rank."""
    found = []
    for storage in sharded.groupshard.storages:
        for buffer in storage.layout.trainable_buffers:
            if buffer.group_index not in group_indices:
                continue
            for slot in buffer.params:
                touched = [
                    r
                    for r in range(buffer.world_size)
                    if max(slot.offset, buffer.shard_range(r)[0])
                    < min(slot.offset + slot.numel, buffer.shard_range(r)[1])
                ]
                if len(touched) > 1:
                    found.append(slot.fqn)
    return found


def mismatches(first: dict, second: dict) -> list[str]:
    assert sorted(first) == sorted(second)
    return [k for k in first if not torch.equal(first[k], second[k])]


# --- one process ------------------------------------------------------------------


def test_plain_parameters_equal_torch_muon_and_adamw_bitwise():
    torch.manual_seed(0)
    model = OddNet()
    reference = copy.deepcopy(model)
    ours = [make_muon(make_groups(model))]
    theirs = reference_optimizers(reference)
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        idx = torch.randint(0, VOCAB, (4, SEQ), generator=generator)
        for net, optimizers in ((model, ours), (reference, theirs)):
            net(idx, idx.roll(1, dims=1)).backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
    assert not mismatches(model.state_dict(), reference.state_dict())
    assert (model.blocks[1].mix.weight != OddNet().blocks[1].mix.weight).any()


def test_one_scheduler_drives_muon_and_adamw_groups():
    model = OddNet()
    optimizer = make_muon(make_groups(model))
    assert [g["use_muon"] for g in optimizer.param_groups] == [True, True, False, False]
    assert optimizer.param_groups[3]["eps"] == 1e-8  # AdamW's default, not Newton-Schulz's
    assert optimizer.param_groups[0]["eps"] == 1e-7
    assert "momentum" not in optimizer.param_groups[2] and "betas" not in optimizer.param_groups[0]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    optimizer.step()  # no gradients: nothing moves
    scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == [0.015, 0.005, 1.5e-3, 1e-3]


def direct_case(
    rank: int, world_size: int, steps: int = 3, strategy: str = "full"
) -> tuple[list[str], list[str]]:
    """Sharded Muon vs torch Muon + AdamW with the same full gradients set directly."""
    torch.manual_seed(0)
    model = OddNet()
    reference = copy.deepcopy(model)
    sharded = gs.shard(model, make_groups(model), unit=OddBlock, strategy=strategy)
    ours = [make_muon(sharded.optimizer_groups())]
    theirs = reference_optimizers(reference)
    for step in range(steps):
        grads = full_gradients(reference, step)
        step_with(grads, ours, sharded=sharded)
        step_with(grads, theirs, model=reference)
    full = gs.full_state_dict(sharded)
    return mismatches(full, reference.state_dict()), straddling(sharded)


def test_one_process_shards_equal_torch_bitwise():
    different, _ = direct_case(0, 1)
    assert not different


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sharded_step_equals_torch_muon_bitwise(run_ranks, world_size):
    results = run_ranks(world_size, direct_case)
    for different, crossing in results:
        assert not different
        assert len(crossing) >= 2, crossing  # matrices cut by shard boundaries


@pytest.mark.parametrize("strategy", ["grad_op", "no_shard"])
def test_other_strategies_equal_torch_muon_bitwise(run_ranks, strategy):
    # grad_op: the same exchange as full; no_shard: every rank holds every matrix whole and
    # orthogonalizes it itself (as DDP + torch.optim.Muon would), no all-to-all
    for different, _ in run_ranks(2, direct_case, 3, strategy):
        assert not different


def test_shard_optimizer_rebuilds_muon_over_the_shards():
    torch.manual_seed(0)
    model = OddNet()
    reference = copy.deepcopy(model)
    existing = make_muon(make_groups(model))
    sharded = gs.shard(model, existing.param_groups, unit=OddBlock)
    rebuilt = gs.shard_optimizer(existing, sharded)
    assert type(rebuilt) is gs.optim.Muon
    assert [g["use_muon"] for g in rebuilt.param_groups] == [True, True, False, False]
    theirs = reference_optimizers(reference)
    grads = full_gradients(reference, 0)
    step_with(grads, [rebuilt], sharded=sharded)
    step_with(grads, theirs, model=reference)
    assert not mismatches(gs.full_state_dict(sharded), reference.state_dict())


def trained_case(rank: int, world_size: int, steps: int = 6) -> tuple[list[str], dict]:
    """Through backward, against two one-process runs of torch.optim.Muon + AdamW: one whose
    gradient is the mean of the per-rank gradients summed in rank order (what the gradient
    reduction computes), one on the whole batch at once (fp32 sums in another order)."""
    torch.manual_seed(0)
    model = OddNet()
    per_rank_mean, whole_batch = copy.deepcopy(model), copy.deepcopy(model)
    start = copy.deepcopy(model.state_dict())
    sharded = gs.shard(model, make_groups(model), unit=OddBlock)
    optimizer = make_muon(sharded.optimizer_groups())
    emulated, theirs = reference_optimizers(per_rank_mean), reference_optimizers(whole_batch)
    generator = torch.Generator().manual_seed(1)
    per_rank = 2
    for step in range(steps):
        idx = torch.randint(0, VOCAB, (per_rank * world_size, SEQ), generator=generator)
        targets = idx.roll(1, dims=1)
        for net in (sharded, per_rank_mean, whole_batch):  # parameters without gradient
            net.blocks[0].use_mix = step != 2
            net.skip = 1 if step == 3 else None
        chunks = [slice(r * per_rank, (r + 1) * per_rank) for r in range(world_size)]
        sharded(idx[chunks[rank]], targets[chunks[rank]]).backward()
        grads: dict[str, torch.Tensor] = {}
        for chunk in chunks:
            per_rank_mean(idx[chunk], targets[chunk]).backward()
            for name, p in per_rank_mean.named_parameters():
                if p.grad is not None:
                    grads[name] = grads[name] + p.grad if name in grads else p.grad.clone()
                p.grad = None
        for name, p in per_rank_mean.named_parameters():
            p.grad = grads[name] / world_size if name in grads else None
        whole_batch(idx, targets).backward()
        for o in [optimizer, *emulated, *theirs]:
            o.step()
            o.zero_grad()
    full, emulation = gs.full_state_dict(sharded), per_rank_mean.state_dict()
    reference = whole_batch.state_dict()

    def distance(first, second):
        return max((first[k] - second[k]).abs().max().item() for k in reference)

    return mismatches(full, emulation), {
        "from per-rank mean": distance(full, emulation),
        "from whole batch": distance(full, reference),
        "torch's own": distance(emulation, reference),
        "trained": distance(start, reference),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_trained_steps_equal_one_process(run_ranks, world_size):
    """Six steps through backward, with a step where a matrix has no gradient (the rest of
    its shard has) and one where a whole unit has none.

    Given the same fp32 gradients, sharded training is torch's bit for bit: at world 2 the
    reduction sums the two ranks' gradients as the one-process emulation does (a + b ==
    b + a). Otherwise the gradients differ in their last bits (gloo's 3-rank all-reduce,
    or one whole-batch backward, sums in another order), which can flip a bfloat16
    rounding before Newton-Schulz; the quintic's slope at 0 (a = 3.4445, a**5 ~ 490 over 5
    steps) amplifies components along small singular values, and one such flip moved the
    orthogonalized 37x37 matrix here by ~0.04 (~10 bf16 ulps at |O| ~ 1, ~4 % of that
    step's update). Later gradients see the changed weights, so the runs drift apart by a
    few percent of an update per step at most: the tolerance is 10 % of the distance
    trained, and torch.optim.Muon on one process drifts as far when only its gradient
    summation order changes ("torch's own", measured beside it).
    """
    for different, d in run_ranks(world_size, trained_case):
        if world_size == 2:
            assert not different, different
        tolerance = 0.1 * d["trained"]
        assert d["from per-rank mean"] <= tolerance, d
        assert d["from whole batch"] <= tolerance, d
        assert d["torch's own"] <= tolerance, d


# --- collectives, ownership -----------------------------------------------------------


def count_case(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = OddNet()
    reference = copy.deepcopy(model)
    sharded = gs.shard(model, make_groups(model), unit=OddBlock)
    optimizer = make_muon(sharded.optimizer_groups())
    step_with(full_gradients(reference, 0), [optimizer], sharded=sharded)  # checks once
    counts: Counter[str] = Counter()
    real_all_to_all = comm.all_to_all

    def all_to_all(output, source, output_splits, input_splits, ranks, *args, **kwargs):
        counts["all_to_all"] += 1
        size = source.element_size()
        counts["bytes sent"] += size * sum(s for r, s in enumerate(input_splits) if r != rank)
        counts["bytes received"] += size * sum(s for r, s in enumerate(output_splits) if r != rank)
        return real_all_to_all(output, source, output_splits, input_splits, ranks, *args, **kwargs)

    def counted(name):
        real = getattr(comm, name)

        def wrapper(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)

        return wrapper

    others = (
        "all_gather", "reduce_scatter_mean", "all_reduce_mean", "all_reduce_sum",
        "all_reduce_max", "broadcast", "gather_objects",
    )  # fmt: skip
    with mock.patch.multiple(
        comm, all_to_all=all_to_all, **{name: counted(name) for name in others}
    ):
        step_with(full_gradients(reference, 1), [optimizer], sharded=sharded)
    # independently of the optimizer: this rank's elements of matrices owned elsewhere
    ownership = optimizer.ownership()
    assert len(ownership) == 1
    owners = ownership[0].owners
    mine_elsewhere = owned_elsewhere = 0
    for storage in sharded.groupshard.storages:
        for shard in storage.trainable_shards:
            segments = segments_of(shard)
            if segments.buffer.group_index not in (0, 1):
                continue
            for r in range(world_size):
                for piece in segments.buffer.segments(r):
                    owner = owners[piece.fqn]
                    if r == rank and owner != rank:
                        mine_elsewhere += piece.numel
                    if owner == rank and r != rank:
                        owned_elsewhere += piece.numel
    muon_numel = sum(p.numel() for g in make_groups(OddNet())[:2] for p in g["params"])
    return {
        **counts,
        "expected bytes": 2 * (mine_elsewhere + owned_elsewhere),  # bfloat16
        "reported bytes": ownership[0].bytes_per_step,
        "muon numel": muon_numel,
    }


def test_two_all_to_alls_per_step_and_their_volume(run_ranks):
    world_size = 3
    results = run_ranks(world_size, count_case)
    for counts in results:
        assert counts["all_to_all"] == 2, counts  # there and back, for every matrix at once
        assert not any(counts.get(name) for name in ("all_gather", "gather_objects")), counts
        assert set(counts) <= {
            "all_to_all", "bytes sent", "bytes received", "expected bytes", "reported bytes",
            "muon numel",
        }, counts  # fmt: skip
        assert counts["bytes sent"] == counts["expected bytes"] == counts["reported bytes"]
        assert counts["bytes received"] == counts["bytes sent"]  # both trips together
    # over all ranks, bfloat16 out and back: at most 2 * 2 bytes per Muon element
    total = sum(c["bytes sent"] for c in results)
    assert 0 < total <= 4 * results[0]["muon numel"]


def mismatch_case(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    model = OddNet()
    sharded = gs.shard(model, make_groups(model), unit=OddBlock)
    groups = sharded.optimizer_groups()
    optimizer = make_muon(groups[:1] if rank == 1 else groups[:2])  # rank 1 leaves one out
    set_shard_grads(sharded, full_gradients(OddNet(), 0))
    with pytest.raises(ValueError, match="ranks hold different Muon matrices") as error:
        optimizer.step()
    return str(error.value)


def test_ranks_with_different_muon_matrices_fail_instead_of_hanging(run_ranks):
    messages = run_ranks(2, mismatch_case)
    assert "'blocks.1.up.weight'" in messages[0] and messages[0] == messages[1]


BENCHMARK = GPTConfig(vocab_size=4096, block_size=128, n_layer=4, n_head=8, n_embd=256)


def balance_case(rank: int, world_size: int) -> tuple[float, list[int], dict[str, int]]:
    torch.manual_seed(0)
    model = GPT(BENCHMARK)
    sharded = gs.shard(model, gs.muon_groups(model), unit=Block)
    report = make_muon(sharded.optimizer_groups()).ownership()[0]
    return report.balance, report.cost_per_rank, report.owners


@pytest.mark.parametrize("world_size", [2, 4])
def test_ownership_of_the_benchmark_model_is_balanced(run_ranks, world_size):
    results = run_ranks(world_size, balance_case)
    balance, costs, owners = results[0]
    assert all(r[1:] == (costs, owners) for r in results)  # the same on every rank
    assert len(owners) == 4 * BENCHMARK.n_layer and set(owners.values()) == set(range(world_size))
    print(f"world {world_size}: NS cost per rank {costs}, max/mean {balance:.3f}")
    assert balance <= 1.1


def test_assign_owners_is_greedy_by_cost():
    assert assign_owners([5, 9, 2, 9, 1], 2) == [0, 0, 1, 1, 1]  # 9,9 -> 0,1; 5 -> 0; 2,1 -> 1
    assert assign_owners([], 3) == []
    assert assign_owners([4, 4, 4], 3) == [0, 1, 2]
    assert newton_schulz_cost(768, 256) == 768 * 256 * 256


# --- the ZeRO optimizer -------------------------------------------------------------


def zero_case(rank: int, world_size: int) -> tuple[list[str], list[str]]:
    torch.manual_seed(0)
    model = OddNet()
    reference = copy.deepcopy(model)
    zero = gs.ZeroRedundancyOptimizer(
        make_groups(model), gs.optim.Muon, lr=LR, weight_decay=WEIGHT_DECAY,
        max_slice_numel=500,
    )  # fmt: skip
    theirs = reference_optimizers(reference)
    for step in range(3):
        grads = full_gradients(reference, step)
        step_with(grads, [zero], model=model)
        step_with(grads, theirs, model=reference)
    different = mismatches(model.state_dict(), reference.state_dict())
    zero.consolidate_state_dict(to=0)
    state_different = []
    if rank == 0:
        muon, adamw = gs.optim.split_state_dict(zero.state_dict())
        for ours, optimizer in zip((muon, adamw), theirs, strict=True):
            expected = optimizer.state_dict()["state"]
            assert sorted(ours["state"]) == sorted(expected)
            state_different += [
                f"{i}.{k}"
                for i, entry in expected.items()
                for k, value in entry.items()
                if not torch.equal(ours["state"][i][k], value)
            ]
    return different, state_different


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_zero_optimizer_with_muon_equals_torch_bitwise(run_ranks, world_size):
    results = [zero_case(0, 1)] if world_size == 1 else run_ranks(world_size, zero_case)
    for different, state_different in results:
        assert not different and not state_different, (different, state_different)


# --- state dicts ----------------------------------------------------------------------


def state_dict_case(rank: int, world_size: int) -> list[str]:
    torch.manual_seed(0)
    model = OddNet()
    reference = copy.deepcopy(model)
    sharded = gs.shard(model, make_groups(model), unit=OddBlock)
    optimizer = make_muon(sharded.optimizer_groups())
    theirs = reference_optimizers(reference)
    for step in range(2):
        grads = full_gradients(reference, step)
        step_with(grads, [optimizer], sharded=sharded)
        step_with(grads, theirs, model=reference)
    problems = []
    # sharded -> plain torch.optim.Muon + torch.optim.AdamW
    saved = gs.optim_state_dict(sharded, optimizer)  # keyed by name, as torch's full one
    first, last = saved["param_groups"][0]["params"][0], saved["param_groups"][-1]["params"][-1]
    assert sorted(saved["state"][first]) == ["momentum_buffer"]
    assert sorted(saved["state"][last]) == ["exp_avg", "exp_avg_sq", "step"]
    plain_model = copy.deepcopy(reference)
    plain = reference_optimizers(plain_model)
    for part, target, expected in zip(gs.optim.split_state_dict(saved), plain, theirs, strict=True):
        target.load_state_dict(part)
        ours, want = target.state_dict(), expected.state_dict()
        problems += [
            f"plain {i}.{k}"
            for i, entry in want["state"].items()
            for k, value in entry.items()
            if not torch.equal(ours["state"][i][k], value)
        ]
        if [g["lr"] for g in ours["param_groups"]] != [g["lr"] for g in want["param_groups"]]:
            problems.append("plain lrs")
    # plain -> a fresh sharded model and optimizer; then one more step everywhere
    fresh_model = copy.deepcopy(plain_model)
    fresh = gs.shard(fresh_model, make_groups(fresh_model), unit=OddBlock)
    fresh_optimizer = make_muon(fresh.optimizer_groups())
    merged = gs.optim.merge_state_dicts(
        plain[0].state_dict(),
        plain[1].state_dict(),
        [g["use_muon"] for g in fresh_optimizer.param_groups],
    )
    gs.load_optim_state_dict(fresh, fresh_optimizer, merged)
    grads = full_gradients(reference, 2)
    step_with(grads, [fresh_optimizer], sharded=fresh)
    step_with(grads, theirs, model=reference)
    problems += [
        f"after load: {k}" for k in mismatches(gs.full_state_dict(fresh), reference.state_dict())
    ]
    return problems


def test_state_dict_round_trip_with_plain_muon_and_adamw(run_ranks):
    for problems in run_ranks(2, state_dict_case):
        assert not problems


def test_momentum_state_is_laid_out_like_the_shard():
    torch.manual_seed(0)
    model = OddNet()
    sharded = gs.shard(model, make_groups(model), unit=OddBlock)
    optimizer = make_muon(sharded.optimizer_groups())
    step_with(full_gradients(OddNet(), 0), [optimizer], sharded=sharded)
    for group in optimizer.param_groups:
        for shard in group["params"]:
            state = optimizer.state[shard]
            keys = ["momentum_buffer"] if group["use_muon"] else ["exp_avg", "exp_avg_sq"]
            assert all(flatten.is_per_element(state[k], shard) for k in keys)


# --- presets and bad input --------------------------------------------------------------


def test_muon_groups_preset():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))
    names = {id(p): n for n, p in model.named_parameters()}
    muon, adamw = gs.muon_groups(model, muon={"lr": 0.02}, adamw={"lr": 3e-4})
    assert muon["use_muon"] and not adamw["use_muon"] and muon["lr"] == 0.02
    hidden = {names[id(p)] for p in muon["params"]}
    assert hidden == {
        f"blocks.{i}.{n}.weight" for i in range(2) for n in ("attn.qkv", "attn.proj", "fc", "out")
    }
    rest = {names[id(p)] for p in adamw["params"]}
    assert {"wte.weight", "wpe.weight", "blocks.0.fc.bias", "ln_f.weight"} <= rest  # tied head
    both = gs.muon_groups(model, embeddings_to_muon=True, head_to_muon=True)
    assert "wte.weight" in {names[id(p)] for p in both[0]["params"]}
    ruled = gs.muon_groups(model, rule=lambda name, p: False if "qkv" in name else None)
    assert "blocks.0.attn.qkv.weight" not in {names[id(p)] for p in ruled[0]["params"]}
    untied = OddNet()  # a head found by its name
    untied_names = {id(p): n for n, p in untied.named_parameters()}
    rest = {untied_names[id(p)] for p in gs.muon_groups(untied)[1]["params"]}
    assert {"lm_head.weight", "embed.weight"} <= rest
    optimizer = make_muon(gs.muon_groups(model))
    assert [g["use_muon"] for g in optimizer.param_groups] == [True, False]


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3)
        self.classifier = nn.Linear(5, 4)


def test_conv_weights_need_flatten_conv():
    torch.manual_seed(0)
    net = ConvNet()
    groups = gs.muon_groups(net)
    assert [len(g["params"]) for g in groups] == [0, 4]  # conv weight and head to AdamW
    flat_groups = gs.muon_groups(net, flatten_conv=True)
    assert flat_groups[0]["params"] == [net.conv.weight] and flat_groups[0]["flatten_conv"]
    with pytest.raises(ValueError, match=r"\(5, 3, 3, 3\).*flatten_conv=True.*\(5, 27\)"):
        make_muon([net.conv.weight])
    # flatten_conv=True: the same as torch's Muon on the weight viewed as (5, 27)
    optimizer = gs.optim.Muon([net.conv.weight], lr=LR, flatten_conv=True)
    matrix = nn.Parameter(net.conv.weight.detach().reshape(5, 27).clone())
    reference = torch.optim.Muon([matrix], lr=LR)
    for step in range(2):
        grad = torch.randn(5, 3, 3, 3, generator=torch.Generator().manual_seed(step))
        net.conv.weight.grad, matrix.grad = grad, grad.reshape(5, 27).clone()
        optimizer.step()
        reference.step()
    assert torch.equal(net.conv.weight.detach().reshape(5, 27), matrix.detach())


def test_non_matrices_in_muon_groups_are_refused_by_name():
    model = OddNet()
    block = model.blocks[0]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] of shape \(37,\)"):
        make_muon([block.up.weight, block.up.bias])
    optimizer = make_muon([block.up.weight])
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] of shape \(19,\)"):
        optimizer.add_param_group({"params": [block.down.bias]})
    assert len(optimizer.param_groups) == 1  # the refused group is not kept
    optimizer.add_param_group({"params": [block.down.bias], "use_muon": False})
    groups = [
        {"params": [block.up.weight, block.up.bias]},
        {"params": [p for n, p in model.named_parameters() if n not in ("blocks.0.up.weight",
                                                                          "blocks.0.up.bias")],
         "use_muon": False},
    ]  # fmt: skip
    sharded = gs.shard(model, groups, unit=OddBlock)
    with pytest.raises(ValueError, match=r"'blocks\.0\.up\.bias' of shape \(37,\)"):
        make_muon(sharded.optimizer_groups())
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        gs.optim.Muon([block.mix.weight], adjust_lr_fn="nope")
    with pytest.raises(TypeError, match="use_muon"):
        gs.optim.Muon([{"params": [block.mix.weight], "use_muon": "yes"}])


def checkpoint_save_case(rank: int, world_size: int, path: str) -> tuple[dict, dict]:
    """Two steps at this world size, then a gs.checkpoint of model and Muon + AdamW state."""
    torch.manual_seed(0)
    model = OddNet()
    shapes = copy.deepcopy(model)  # names and shapes of the gradients
    sharded = gs.shard(model, make_groups(model), unit=OddBlock)
    optimizer = make_muon(sharded.optimizer_groups())
    for step in range(2):
        step_with(full_gradients(shapes, step), [optimizer], sharded=sharded)
    gs.checkpoint.save(path, sharded, optimizer)
    return gs.full_state_dict(sharded), gs.optim_state_dict(sharded, optimizer)


def checkpoint_load_case(rank: int, world_size: int, path: str) -> tuple[dict, dict]:
    torch.manual_seed(1)  # other weights: the load must replace them
    model = OddNet()
    sharded = gs.shard(model, make_groups(model), unit=OddBlock)
    optimizer = make_muon(sharded.optimizer_groups())
    gs.checkpoint.load(path, sharded, optimizer)  # ownership is recomputed, not saved
    return gs.full_state_dict(sharded), gs.optim_state_dict(sharded, optimizer)


def test_checkpoint_saved_at_three_ranks_loads_at_two(run_ranks, tmp_path):
    path = str(tmp_path / "muon")
    saved_model, saved_optim = run_ranks(3, checkpoint_save_case, path)[0]
    for model, optim in run_ranks(2, checkpoint_load_case, path):
        assert not mismatches(model, saved_model)
        assert optim["param_groups"] == saved_optim["param_groups"]
        for index, entry in saved_optim["state"].items():
            assert sorted(optim["state"][index]) == sorted(entry)
            for key, value in entry.items():
                assert torch.equal(
                    torch.as_tensor(optim["state"][index][key]), torch.as_tensor(value)
                ), (index, key)
