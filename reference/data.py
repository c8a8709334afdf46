"""The vendored training data: Shakespeare's works as bytes, held-out plays, disjoint learner shards.

The texts ship with the package (`reference/data/shakespeare/*.txt.gz`, about 5 MB of ASCII, public
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
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from importlib import resources

import numpy as np

from ddiloco.errors import UserError

HELD_OUT = ("macbeth", "tempest", "twelfth_night")
VOCAB = 256


class DataError(UserError, ValueError):
    """The vendored data is missing or corrupt, or a shard request makes no sense."""


@cache
def corpus() -> dict[str, bytes]:
    """name -> text, every file verified against the manifest."""
    root = resources.files("ddiloco.reference") / "data" / "shakespeare"
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
    def parse(cls, text: str) -> Shard:
        try:
            i, n = (int(part) for part in text.split("/"))
        except ValueError:
            raise DataError(f"shard must look like I/N (e.g. 0/4), got {text!r}") from None
        return cls(i, n)

    def slice(self, data: np.ndarray) -> np.ndarray:
        size = data.size // self.count
        return data[self.index * size : (self.index + 1) * size]


def batches(
    data: np.ndarray, batch: int, seq: int, rng: np.random.Generator
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
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


# ---- multiple-choice continuation items ----

CHOICE_OPTIONS = 4  # the true next line and 3 distractors: chance is 25%
CHOICE_LINE_BYTES_MIN = 12  # shorter lines are mostly speaker names and stage directions
CHOICE_CONTEXT_BYTES_MIN = 16
CHOICE_DISTRACTOR_DISTANCE_LINES = 50  # distractors come from elsewhere, not from the same speech


@dataclass(frozen=True)
class ChoiceItem:
    """A context ending at a line break, candidate lines (each with its newline) and the true one."""

    context: bytes
    options: tuple[bytes, ...]
    answer: int

    def __post_init__(self) -> None:
        if not (0 <= self.answer < len(self.options)) or len(set(self.options)) != len(self.options):
            raise DataError(f"a choice item needs distinct options and an answer among them, got {self}")


def _held_out_lines() -> tuple[list[bytes], list[int]]:
    """The held-out text's lines and the byte offset at which each starts."""
    text = eval_bytes().tobytes()
    lines = text.split(b"\n")
    starts = np.concatenate([[0], np.cumsum([len(line) + 1 for line in lines[:-1]])]).tolist()
    return lines, starts


def choice_items(count: int, seq: int, seed: int = 0) -> list[ChoiceItem]:
    """`count` multiple-choice items from the held-out plays, the same for the same arguments.

    Each item: the bytes before a verse line (as many as fit in one window of `seq` next to the
    longest option; at least 16), the line itself, and 3 other lines drawn from at least 50 lines
    away, the true line at a seeded position. Every option is a line of 12 or more bytes (with its
    newline), so a model cannot win by telling speaker names apart.
    """
    line_max = seq + 1 - CHOICE_CONTEXT_BYTES_MIN - 1  # room for the context and the newline
    if count < 1 or line_max < CHOICE_LINE_BYTES_MIN:
        raise DataError(
            f"need count >= 1 and seq >= {CHOICE_LINE_BYTES_MIN + CHOICE_CONTEXT_BYTES_MIN}, got {count}, {seq}"
        )
    text = eval_bytes().tobytes()
    lines, starts = _held_out_lines()
    eligible = np.array([i for i, line in enumerate(lines) if CHOICE_LINE_BYTES_MIN <= len(line) <= line_max and i > 0])
    rng = np.random.default_rng([seed, count, seq])
    picked = rng.choice(eligible, size=min(count, eligible.size), replace=False)
    items = []
    for i in picked.tolist():
        distractors: list[int] = []
        while len(distractors) < CHOICE_OPTIONS - 1:
            j = int(rng.choice(eligible))
            if (
                abs(j - i) >= CHOICE_DISTRACTOR_DISTANCE_LINES
                and lines[j] != lines[i]
                and lines[j] not in [lines[d] for d in distractors]
            ):
                distractors.append(j)
        answer = int(rng.integers(CHOICE_OPTIONS))
        order = distractors[:answer] + [i] + distractors[answer:]
        options = tuple(lines[k] + b"\n" for k in order)
        room = seq + 1 - max(len(o) for o in options)
        items.append(ChoiceItem(text[max(0, starts[i] - room) : starts[i]], options, answer))
    return items


def choice_arrays(items: list[ChoiceItem], seq: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(inputs, targets, mask) int32/int32/float32 [items * options, seq] and answers int32[items].

    Row r holds context + option, shifted by one for next-byte prediction and padded on the right
    (causal attention never looks right, so padding changes no score); mask is 1 where the target is
    a byte of the option, which is what the option is scored on.
    """
    rows = [(it.context, option) for it in items for option in it.options]
    x = np.zeros((len(rows), seq), np.int32)
    y = np.zeros((len(rows), seq), np.int32)
    mask = np.zeros((len(rows), seq), np.float32)
    for r, (context, option) in enumerate(rows):
        full = np.frombuffer(context + option, np.uint8).astype(np.int32)
        if full.size > seq + 1 or not context:
            raise DataError(f"choice row {r}: {full.size} bytes do not fit a window of {seq} (or no context)")
        n = full.size - 1
        x[r, :n], y[r, :n] = full[:-1], full[1:]
        mask[r, len(context) - 1 : n] = 1.0
    answers = np.array([it.answer for it in items], np.int32)
    return x, y, mask, answers
