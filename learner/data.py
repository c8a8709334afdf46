"""The vendored training data: Shakespeare's works as bytes, held-out plays, disjoint learner shards.

The texts ship with the package (`learner/data/shakespeare/*.txt.gz`, about 5 MB of ASCII, public
domain; provenance in its MANIFEST.json) and are checked against their sha256 on load, so nothing is
downloaded at run time. The model is byte level: a token is a byte, the vocabulary is 256.

Evaluation uses whole plays the learners never see (`HELD_OUT`). The training text is the rest,
concatenated in name order; learner i of n trains on the i-th of n equal contiguous slices of it,
sampling windows from its slice with its own seeded generator, so shards are disjoint and a run is
reproducible from its seed.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Iterator

import numpy as np

HELD_OUT = ("macbeth", "tempest", "twelfth_night")
VOCAB = 256


class DataError(ValueError):
    """The vendored data is missing or corrupt, or a shard request makes no sense."""


@cache
def corpus() -> dict[str, bytes]:
    """name -> text, every file verified against the manifest."""
    root = resources.files("ddiloco.learner") / "data" / "shakespeare"
    try:
        manifest = json.loads((root / "MANIFEST.json").read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"the vendored Shakespeare manifest cannot be read: {exc}") from exc
    texts = {}
    for entry in manifest["texts"]:
        try:
            raw = gzip.decompress((root / entry["file"]).read_bytes())
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            raise DataError(f"vendored text {entry['file']} cannot be read: {exc}") from exc
        if hashlib.sha256(raw).hexdigest() != entry["sha256"]:
            raise DataError(f"vendored text {entry['file']} does not match its sha256 in MANIFEST.json")
        texts[entry["name"]] = raw
    missing = [name for name in HELD_OUT if name not in texts]
    if missing:
        raise DataError(f"held-out plays {missing} are not in the vendored data")
    return texts


def train_bytes() -> np.ndarray:
    texts = corpus()
    return np.frombuffer(b"\n".join(texts[n] for n in sorted(texts) if n not in HELD_OUT), dtype=np.uint8)


def eval_bytes() -> np.ndarray:
    texts = corpus()
    return np.frombuffer(b"\n".join(texts[n] for n in HELD_OUT), dtype=np.uint8)


@dataclass(frozen=True)
class Shard:
    index: int
    count: int

    def __post_init__(self) -> None:
        if not (isinstance(self.index, int) and isinstance(self.count, int) and 0 <= self.index < self.count):
            raise DataError(f"shard must be I/N with 0 <= I < N, got {self.index}/{self.count}")

    @classmethod
    def parse(cls, text: str) -> "Shard":
        try:
            i, n = (int(part) for part in text.split("/"))
        except ValueError:
            raise DataError(f"shard must look like I/N (e.g. 0/4), got {text!r}") from None
        return cls(i, n)

    def slice(self, data: np.ndarray) -> np.ndarray:
        size = data.size // self.count
        return data[self.index * size : (self.index + 1) * size]


def batches(data: np.ndarray, batch: int, seq: int, rng: np.random.Generator) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Endless (inputs, targets) int32[batch, seq] windows drawn uniformly from `data`."""
    if batch < 1 or seq < 1:
        raise DataError(f"batch and sequence length must be positive, got {batch} and {seq}")
    if data.size < seq + 2:
        raise DataError(f"{data.size} bytes of data cannot fill a window of {seq + 1}")
    offsets = np.arange(seq + 1)
    while True:
        starts = rng.integers(0, data.size - seq - 1, size=batch)
        windows = data[starts[:, None] + offsets].astype(np.int32)
        yield windows[:, :-1], windows[:, 1:]


def eval_windows(seq: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """A fixed set of evenly spaced held-out windows (the same in every run)."""
    data = eval_bytes()
    starts = np.linspace(0, data.size - seq - 2, count).astype(np.int64)
    windows = data[starts[:, None] + np.arange(seq + 1)].astype(np.int32)
    return windows[:, :-1], windows[:, 1:]
