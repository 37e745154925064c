"""The end of a `groupshard train` run, piece by piece, without processes."""

from __future__ import annotations

import math

import pytest
import torch

from groupshard.cli import data as corpus
from groupshard.cli import report
from groupshard.cli.model import GPT, GPTConfig


def test_bigram_loss_is_the_smoothed_pair_counts_cross_entropy():
    train = torch.tensor([1, 2, 1, 2, 1, 3])  # after 1: 2 twice, 3 once
    validation = torch.tensor([1, 2, 5])
    after_1 = (2 + 1) / (3 + 256)  # add-one smoothing over 256 following bytes
    after_2 = (0 + 1) / (2 + 256)  # 5 never followed 2
    expected = -(math.log(after_1) + math.log(after_2)) / 2
    assert corpus.bigram_loss(train, validation) == pytest.approx(expected)
    exact = corpus.bigram_loss(torch.tensor([7, 8] * 500), torch.tensor([7, 8, 7]), 1e-6)
    assert exact == pytest.approx(0.0, abs=1e-5)  # a predictable text costs nothing


def test_generate_keeps_the_prompt_and_samples_the_same_bytes_from_the_same_seed():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=16))
    prompt = torch.randint(0, 256, (1, 12))  # longer than the context: cropped
    first = model.generate(prompt, 5, 0.8, torch.Generator().manual_seed(3))
    again = model.generate(prompt, 5, 0.8, torch.Generator().manual_seed(3))
    assert first.shape == (1, 17) and torch.equal(first[:, :12], prompt)
    assert torch.equal(first, again)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompt, 1, 0.0)


def test_smoothed_loss_follows_a_constant_from_the_first_step():
    assert report.smoothed([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
    values = report.smoothed([4.0] + [1.0] * 60)
    assert values[0] == 4.0 and 1.0 < values[10] < values[5] < 4.0
    assert values[-1] == pytest.approx(1.0, abs=0.01)


def test_group_table_is_narrow_and_has_a_row_per_group():
    groups = [
        {"group": "decay", "tensors": 18, "elements": 835_584, "weight_decay": 0.1,
         "lr": 3e-4, "grad_norm": 0.87, "weight_norm": 33.0},
        {"group": "no_decay", "tensors": 30, "elements": 5_376, "weight_decay": 0.0,
         "lr": 3e-4, "grad_norm": None, "weight_norm": 33.66},
    ]  # fmt: skip
    lines = report.group_table(groups).splitlines()
    assert lines[0].split()[:3] == ["group", "tensors", "elements"]
    assert lines[1].split() == ["decay", "18", "835,584", "0.1", "0.0003", "0.87", "33"]
    assert lines[2].split() == ["no_decay", "30", "5,376", "0", "0.0003", "-", "33.66"]
    assert max(len(line) for line in lines) < 100


def test_the_printed_sample_escapes_what_a_terminal_would_act_on(tmp_path, capsys):
    text = "def f():\n\treturn '\x1b[2J\x07'\r\x00 é\n"
    summary = {"status": "finished", "step": 1, "steps": 1, "tokens_per_s": 1.0,
               "world_size": 1, "peak_rss_bytes_per_rank": [2**20], "parameters_per_rank": 1,
               "parameters_total": 1,
               "sample": {"text": text, "prompt_bytes": 8, "new_bytes": 12}}  # fmt: skip
    report.finish(tmp_path, summary)
    printed = capsys.readouterr().out
    assert "    def f():\n    \treturn '\\x1b[2J\\x07'\\r\\x00 é\n" in printed
    assert not any(ord(c) < 32 and c not in "\n\t" for c in printed), repr(printed)


def test_a_folder_without_text_files_says_which_names_count(tmp_path):
    (tmp_path / "notes.bin").write_bytes(b"not text")
    with pytest.raises(ValueError) as error:
        corpus.corpus_files(str(tmp_path))
    assert str(error.value) == (
        f"--data {tmp_path}: the folder has no text files (files whose names end in .c, .csv, "
        ".h, .html, .json, .md, .py, .rst, .txt or .xml)"
    )
