"""The guides' complete scripts run as written: the ```python blocks listed here, under
``torchrun --standalone --nproc-per-node 2`` on CPU, print what the guide shows they print."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import DOCS, free_ports, guide_script, run_under_torchrun

# guide -> a pattern of the line its script prints (the guide shows that line)
SCRIPTS = {
    ("checkpoints.md", 0): r"loss after 9 steps: FSDP2 -> groupshard -> FSDP2 ([\d.]+), "
    r"FSDP2 alone ([\d.]+)",
    ("checkpoints.md", 1): r"saved at step 5 while 5 more steps ran; loaded equals the state "
    r"at the call: True",
    ("integrations.md", 0): r"trained 10 steps, loss ([\d.]+); from_pretrained: (\d+) parameters",
    ("integrations.md", 1): r"LoRA weights (\d+), optimizer elements on this rank (\d+)",
    ("integrations.md", 2): r"32 micro-batches per rank, last loss ([\d.]+)",
    ("lightning.md", 0): r"trained 8 steps, loss ([\d.]+), val_loss ([\d.]+); "
    r"state_dict: 27 tensors",
    ("bigger-than-a-rank.md", 0): r"rank 0 holds (\d+) of (\d+) parameters; "
    r"reloaded from model.safetensors: identical",
    ("hybrid-sharding.md", 0): r"mesh \(1, 2\) \('replicate', 'shard'\): 10 steps, loss ([\d.]+)",
    ("layerwise-optimizers-and-muon.md", 0): r"LAMB: 10 steps, loss ([\d.]+); 0.linear.weight "
    r"norm ([\d.]+), its gradient ([\d.]+); 9 layers reported",
    ("layerwise-optimizers-and-muon.md", 3): r"under tp, one process differs by: LAMB "
    r"([\d.e+-]+) \(1.down.weight norm ([\d.]+)\); Muon ([\d.e+-]+) \(1.down.weight "
    r"norm ([\d.]+)\)",
    ("mixed-precision-and-accumulation.md", 0): r"bf16, 4 micro-batches a step: 10 steps, "
    r"last micro-batch loss ([\d.]+), gradient norm ([\d.]+)",
    ("tensor-parallel.md", 0): r"mesh \(2, 2\) \('dp', 'tp'\): 10 steps, loss ([\d.]+); rank 0 "
    r"holds (\d+) of (\d+) elements; one process differs by ([\d.e+-]+); head.weight norm "
    r"([\d.]+)",
    ("tensor-parallel.md", 1): r"saved at dp 2 x tp 2, resumed on 4 ranks without TP: differs "
    r"by ([\d.e+-]+); one process reads 0.up.weight \(128, 32\)",
    ("tensor-parallel.md", 2): r"rank 0 holds (\d+) of (\d+) elements, read (\d+) bytes of the "
    r"file; the model is the file's: True",
    ("regroup.md", 0): r"10 steps, the backbone unfrozen at step 5: loss ([\d.]+), "
    r"learning rates 1.50e-03, 5.00e-05",
    ("whole-param-optimizers.md", 0): r"Adafactor: 10 steps, loss ([\d.]+); rank 0 steps "
    r"(\d+) of 18 whole parameters",
    ("zero.md", 0): r"loss ([\d.]+); rank 0 holds (\d+) of (\d+) elements of AdamW state",
}
"""(guide, index of its python block) -> a pattern of the line the script prints (the guide
shows that line). Each guide's first block; every block of integrations.md."""
# the scripts run one after another in one launch per number of processes (guide_runner),
# but Lightning's, in a launch of its own: its Trainer keeps process-wide state
OWN_LAUNCH = {"lightning.md"}
# scripts on a 2 x 2 (dp, tp) mesh, on 4 processes; the others run on 2
NPROC = {
    ("tensor-parallel.md", 0): 4,
    ("tensor-parallel.md", 1): 4,
    ("tensor-parallel.md", 2): 4,
    ("layerwise-optimizers-and-muon.md", 3): 4,
}
GUIDES_WITHOUT_CODE = {"muon-design.md", "overlap.md", "usage.md", "when-something-fails.md"}


def run_script(text: str, folder: Path, nproc: int = 2) -> str:
    path = folder / "script.py"
    path.write_text(text)
    return run_under_torchrun([str(path)], folder, nproc=nproc)


def _crossed_equals_alone(crossed: str, alone: str) -> bool:
    """FSDP2 -> groupshard -> FSDP2 through checkpoints ends where FSDP2 alone does."""
    return abs(float(crossed) - float(alone)) <= 1e-5 * max(1.0, abs(float(alone)))


def _state_for_a_shard_of_lora_only(lora: str, on_this_rank: str) -> bool:
    """A rank's optimizer holds about half of the LoRA weights (2 ranks; padding) and
    nothing of the frozen base model."""
    return int(lora) // 2 <= int(on_this_rank) < int(lora) // 2 + 64


def _about_half(held: str, total: str, *rest: str) -> bool:
    """Rank 0 of 2 holds half of the elements (plus its share of the padding)."""
    return int(total) // 2 <= int(held) <= int(total) // 2 + 64


def _a_quarter_and_one_process(loss: str, held: str, total: str, differs: str, norm: str) -> bool:
    """At 2 x 2 a rank holds about a quarter of the model (the norms' weights are split over
    dp only), and the weights are one process's to float precision."""
    return 0.2 <= int(held) / int(total) <= 0.35 and float(differs) < 2e-5


def _a_quarter_held_and_read(held: str, total: str, read: str) -> bool:
    """At 2 x 2 a rank holds and reads about a quarter of the model (the norms' weights are
    split over dp only)."""
    return 0.2 <= int(held) / int(total) <= 0.3 and int(read) <= 0.3 * 4 * int(total)


def _one_process_under_tp(lamb: str, lamb_norm: str, muon: str, muon_norm: str) -> bool:
    """LAMB within float precision of one process (tensor parallelism reorders sums); Muon
    within a few percent of one update (lr 0.02: bf16 Newton-Schulz amplifies the reordered
    gradient sums, 4.8e-4 here)."""
    return float(lamb) < 2e-5 and float(muon) < 1e-3 and float(lamb_norm) > 0


def _some_but_not_all(loss: str, owned: str) -> bool:
    return 0 < int(owned) < 18


# what the printed numbers must show, beside being printed
CHECKS = {
    ("bigger-than-a-rank.md", 0): _about_half,
    ("zero.md", 0): lambda loss, held, total: _about_half(held, total),
    ("whole-param-optimizers.md", 0): _some_but_not_all,
    ("checkpoints.md", 0): _crossed_equals_alone,
    ("integrations.md", 1): _state_for_a_shard_of_lora_only,
    ("tensor-parallel.md", 0): _a_quarter_and_one_process,
    ("tensor-parallel.md", 1): lambda differs: float(differs) < 2e-5,
    ("tensor-parallel.md", 2): _a_quarter_held_and_read,
    ("layerwise-optimizers-and-muon.md", 3): _one_process_under_tp,
}


def _check_printed(guide: str, index: int, printed: str) -> None:
    pattern = SCRIPTS[guide, index]
    found = re.search(pattern, printed)
    assert found is not None, (guide, printed)
    # the guide shows the line it prints (its digits may differ on another CPU)
    assert re.search(pattern, (DOCS / guide).read_text()) is not None, guide
    if (guide, index) in CHECKS:
        assert CHECKS[guide, index](*found.groups()), (guide, found.group(0))


@pytest.mark.parametrize("guide, index", sorted(k for k in SCRIPTS if k[0] in OWN_LAUNCH))
def test_the_guides_scripts_run_as_written(tmp_path, guide, index):
    script = guide_script(guide, index)
    _check_printed(guide, index, run_script(script, tmp_path, NPROC.get((guide, index), 2)))


@pytest.mark.parametrize("nproc", [2, 4])
def test_the_other_guides_scripts_run_as_written_in_one_launch(tmp_path, monkeypatch, nproc):
    """The scripts of every guide but Lightning's that run on ``nproc`` processes, each in
    its own folder with its own rendezvous, in one torchrun launch (tests/guide_runner.py)."""
    keys = sorted(k for k in SCRIPTS if k[0] not in OWN_LAUNCH and NPROC.get(k, 2) == nproc)
    assert keys
    folders = []
    for guide, index in keys:
        folder = tmp_path / f"{guide.removesuffix('.md')}-{index}"
        folder.mkdir()
        (folder / "script.py").write_text(guide_script(guide, index))
        folders.append(str(folder))
    monkeypatch.setenv("GUIDE_PORTS", ",".join(map(str, free_ports(len(keys)))))
    runner = str(Path(__file__).with_name("guide_runner.py"))
    run_under_torchrun([runner, *folders], tmp_path, nproc=nproc)
    for (guide, index), folder in zip(keys, folders, strict=True):
        _check_printed(guide, index, (Path(folder) / "stdout.txt").read_text())

def test_every_guide_with_code_opens_with_a_script_run_here():
    """Each guide in docs/ that shows Python code has its first block in SCRIPTS."""
    for guide in sorted(p.name for p in DOCS.glob("*.md")):
        if guide in GUIDES_WITHOUT_CODE:
            assert "```python" not in (DOCS / guide).read_text(), guide
        else:
            assert (guide, 0) in SCRIPTS, guide
