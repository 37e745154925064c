"""Text corpora read as bytes: the default is the Python standard library's own source."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".json", ".csv", ".html", ".xml", ".c", ".h"}
DEFAULT_MAX_BYTES = 4_000_000


def default_corpus_files() -> list[Path]:
    """The standard library's ``.py`` files: a real text corpus on every machine."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def corpus_files(path: str | None) -> list[Path]:
    """The text files of ``path`` (a file, or a folder searched recursively)."""
    if path is None:
        return default_corpus_files()
    root = Path(path)
    if not root.exists():
        raise ValueError(f"--data {path}: no such file or folder")
    if root.is_file():
        files = [root]
    else:
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            *others, last = sorted(TEXT_SUFFIXES)
            raise ValueError(
                f"--data {path}: the folder has no text files (files whose names end in "
                f"{', '.join(others)} or {last})"
            )
    if sum(f.stat().st_size for f in files) == 0:
        raise ValueError(f"--data {path}: the data is empty")
    return files


def load_corpus(path: str | None, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """Up to ``max_bytes`` of the corpus as a 1-D int64 tensor of byte values."""
    chunks, total = [], 0
    for file in corpus_files(path):
        data = file.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    joined = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(joined), dtype=torch.uint8).long()


def split(
    corpus: torch.Tensor, validation_fraction: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Train on the head, validate on the tail."""
    cut = int(len(corpus) * (1 - validation_fraction))
    return corpus[:cut], corpus[cut:]


def batch(
    data: torch.Tensor, block_size: int, batch_size: int, seed: int, step: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``rank`` at ``step``: a function of its arguments only, so a resumed
    run sees the same data as an uninterrupted one."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    starts = torch.randint(0, len(data) - block_size - 1, (batch_size,), generator=generator)
    window = torch.stack([data[s : s + block_size + 1] for s in starts.tolist()])
    return window[:, :-1], window[:, 1:]


def bigram_loss(train: torch.Tensor, validation: torch.Tensor, smoothing: float = 1.0) -> float:
    """Cross-entropy (nats/byte) on ``validation`` of a byte-bigram table counted on ``train``
    with ``smoothing`` added to every count: the bar a model that reads context must clear."""
    pairs = torch.bincount(train[:-1].cpu() * 256 + train[1:].cpu(), minlength=256 * 256)
    counts = pairs.view(256, 256).double() + smoothing
    log_probs = counts.log() - counts.sum(dim=1, keepdim=True).log()
    val = validation.cpu()
    return -log_probs[val[:-1], val[1:]].mean().item()
