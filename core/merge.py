"""Merging the outer gradients of one fragment (docs/algorithm.md, "Syncer: one round of fragment p", item 5).

Given admissible contributions v_m with token weights w_m (normalised here), the merged outer
gradient Delta is, per tensor of the fragment:

    mean:  Delta = sum_m w_m v_m / sum_m w_m
    RDA:   Delta = (sum_m w_m ||v_m|| / sum_m w_m) * unit(sum_m w_m unit(v_m) / sum_m w_m)

with unit(0) = 0. Embedding tensors are always mean-merged. When the RDA mean direction of a tensor
has (almost) vanished, its direction carries no information and the plain mean is used instead.

Contributions are summed in learner-id order, so the result does not depend on arrival order.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ddiloco import kernels
from ddiloco.core.codec import Encoded
from ddiloco.core.layout import FragmentSpec
from ddiloco.core.weights import normalised

# Below this norm the weighted mean of unit vectors (whose norm lies in [0, 1]) is taken to have
# vanished, e.g. two opposite outer gradients of equal weight.
RDA_DIRECTION_NORM_MIN = 1e-6


class MergeMethod(str, enum.Enum):
    MEAN = "mean"
    RDA = "rda"


@dataclass(frozen=True)
class Contribution:
    learner: int
    weight: float  # token weight, not yet normalised
    payload: Encoded


@dataclass(frozen=True)
class MergeInfo:
    learners: tuple[int, ...]  # the ones that took part (positive weight), in summation order
    weights: tuple[float, ...]  # their normalised weights
    mean_fallback_tensors: tuple[str, ...]  # RDA tensors merged by mean because the direction vanished


def merge(
    contributions: Sequence[Contribution], fragment: FragmentSpec, method: MergeMethod | str = MergeMethod.RDA
) -> tuple[np.ndarray, MergeInfo]:
    """float32[padded_size] merged outer gradient. Raises ValueError when no contribution has weight."""
    method = MergeMethod(method)
    parts = sorted((c for c in contributions if c.weight > 0), key=lambda c: c.learner)
    ids = [c.learner for c in parts]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate learner among contributions: {ids}")
    for c in parts:
        if c.payload.elements != fragment.padded_size:
            raise ValueError(
                f"learner {c.learner}: payload of {c.payload.elements} elements, fragment {fragment.index} "
                f"has {fragment.padded_size}"
            )
    weights = normalised([c.weight for c in parts])
    acc = np.zeros(fragment.padded_size, dtype=np.float32)
    fallback: tuple[str, ...] = ()
    if method is MergeMethod.MEAN:
        for c, w in zip(parts, weights):
            c.payload.accumulate_into(acc, w)
    else:
        fallback = _rda(parts, weights, fragment, acc)
    info = MergeInfo(tuple(ids), tuple(weights), fallback)
    return acc, info


def _rda(parts: list[Contribution], weights: list[float], fragment: FragmentSpec, acc: np.ndarray) -> tuple[str, ...]:
    offsets = fragment.offsets
    k = offsets.size - 1
    embedding = fragment.embedding_mask
    radial = np.zeros(k, dtype=np.float64)
    for c, w in zip(parts, weights):
        norms = np.sqrt(c.payload.segment_sumsq(offsets))
        radial += w * norms
        # Embedding tensors take the plain mean: dividing by a norm of 1 turns the RDA accumulation
        # into `acc += w * x` for them, so one pass serves both kinds of tensor.
        norms[embedding] = 1.0
        c.payload.rda_accumulate_into(acc, w, offsets, norms)
    direction = np.sqrt(kernels.segment_sumsq(acc, offsets))
    fallback = []
    for i in range(k):
        if embedding[i]:
            continue
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        if direction[i] < RDA_DIRECTION_NORM_MIN:
            fallback.append(i)
        else:
            acc[lo:hi] *= np.float32(radial[i] / direction[i])
    if fallback:
        _segment_means(parts, weights, offsets, fallback, acc)
    return tuple(fragment.segments[i].tensor.path for i in fallback)


def _segment_means(parts: list[Contribution], weights: list[float], offsets: np.ndarray, segments: list[int],
                   acc: np.ndarray) -> None:
    """The fall-back: plain weighted mean of the given tensors into `acc`, decoding each
    contribution once for all of them (a fragment whose outer gradients are all zero, say frozen
    tensors, falls back on every tensor)."""
    spans = [(int(offsets[i]), int(offsets[i + 1])) for i in segments]
    out = [np.zeros(hi - lo, dtype=np.float64) for lo, hi in spans]
    for c, w in zip(parts, weights):
        values = c.payload.decode()
        for o, (lo, hi) in zip(out, spans):
            o += w * values[lo:hi].astype(np.float64)
    for o, (lo, hi) in zip(out, spans):
        acc[lo:hi] = o.astype(np.float32)
