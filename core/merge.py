"""Merging the outer gradients of one fragment (docs/algorithm.md, "Syncer: one round of fragment p", item 5).

Given admissible contributions v_m with token weights w_m (normalised here), the merged outer
gradient Delta is, per tensor of the fragment:

    mean:  Delta = sum_m w_m v_m / sum_m w_m
    RDA:   Delta = (sum_m w_m ||v_m|| / sum_m w_m) * unit(sum_m w_m unit(v_m) / sum_m w_m)

with unit(0) = 0. Embedding tensors are always mean-merged. When the RDA mean direction of a tensor
has (almost) vanished, its direction carries no information and the plain mean is used instead.
A round of one contribution is merged by the mean whatever the method: RDA of one vector is the
vector itself (its radius is its norm, its direction its own), and the mean gives it exactly, in the
one fused pass of the outer step instead of RDA's three (norms, accumulate, step). Rounds of one push
are what a syncer under load with a small quorum merges most.

Contributions are summed in learner-id order, so the result does not depend on arrival order.

The syncer takes `merge_round`'s MergedGradient to core.outer.update, which fuses what is left of the
merge into the outer step: for the mean, every contribution is decoded, weighted and summed and the step
taken in one pass over the fragment; for RDA, after the norms, one pass accumulates every contribution
(taking the norms of the sum as it goes) and one more scales per tensor and takes the step. `merge`
materialises the same values, bit for bit.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ddiloco import kernels
from ddiloco.core.codec import Codec, Encoded
from ddiloco.core.layout import FragmentSpec
from ddiloco.core.weights import normalised

# Below this norm the weighted mean of unit vectors (whose norm lies in [0, 1]) is taken to have
# vanished, e.g. two opposite outer gradients of equal weight.
RDA_DIRECTION_NORM_MIN = 1e-6


class MergeMethod(str, enum.Enum):
    MEAN = "mean"
    RDA = "rda"


class Contribution(Protocol):
    """What the merge reads of an admitted push: the syncer hands it its kept `core.events.Push`
    values themselves, nothing copied."""

    @property
    def learner(self) -> int: ...

    @property
    def weight(self) -> float:  # token weight, not yet normalised
        ...

    @property
    def payload(self) -> Encoded: ...


@dataclass(frozen=True)
class MergeInfo:
    learners: tuple[int, ...]  # the ones that took part (positive weight), in summation order
    weights: tuple[float, ...]  # their normalised weights
    mean_fallback_tensors: tuple[str, ...]  # RDA tensors merged by mean because the direction vanished


# From this size on, a round is merged by the fused kernels (every contribution read once, in one pass,
# the outer step fused in); below it, one accumulate per contribution (about 0.17 ns per value on one
# thread) costs less than the fused kernels' fixed cost, mostly building their two typed lists (about
# 40 us). Both give the same bits.
FUSED_ELEMENTS_MIN = 1 << 18


@dataclass(frozen=True)
class MergedGradient:
    """A round's merged outer gradient, held so that the outer step can take it in one fused pass.

    mean: the contributions and their normalised weights, nothing summed yet (`summed` is None).
    RDA: `summed` = the weighted sum of unit vectors (fall-back tensors: their plain mean), to be scaled
    per tensor by `factors` (float32[k]; 1 for embedding and fall-back tensors, and for the padding).
    """

    size: int
    weights: tuple[float, ...]
    payloads: tuple[Encoded, ...]
    offsets: np.ndarray
    summed: np.ndarray | None = None
    factors: np.ndarray | None = None

    def values(self) -> np.ndarray:
        """float32[size], the merged outer gradient materialised (a fresh array)."""
        if self.summed is None:
            out = np.zeros(self.size, dtype=np.float32)
            fused = _fused_codec(self.payloads, self.size)
            if fused is Codec.INT4:
                kernels.round_mean_int4(out, _weights(self), *_int4_lists(self.payloads), self.payloads[0].block)
            elif fused is Codec.FP32:
                kernels.round_mean(out, _weights(self), [p.data for p in self.payloads])
            else:
                for payload, w in zip(self.payloads, self.weights):
                    payload.accumulate_into(out, w)
            return out
        out = self.summed.copy()
        for i, f in enumerate(self.factors.tolist()):
            if f != 1.0:
                out[self.offsets[i] : self.offsets[i + 1]] *= np.float32(f)
        return out

    def nesterov_step(self, theta: np.ndarray, buf: np.ndarray, lr: float, mu: float) -> None:
        """The outer step on `theta` and `buf` in place with this gradient (core.outer's update), fused
        with what is left of the merge: the same bits as nesterov_step(theta, buf, values(), lr, mu)."""
        if self.summed is not None:
            kernels.nesterov_step_segments(theta, buf, self.summed, self.offsets, self.factors, lr, mu)
            return
        fused = _fused_codec(self.payloads, self.size)
        if fused is Codec.INT4:
            kernels.round_mean_step_int4(
                theta, buf, _weights(self), *_int4_lists(self.payloads), lr, mu, self.payloads[0].block
            )
        elif fused is Codec.FP32:
            kernels.round_mean_step(theta, buf, _weights(self), [p.data for p in self.payloads], lr, mu)
        else:
            kernels.nesterov_step(theta, buf, self.values(), lr, mu)


def _weights(g: MergedGradient) -> np.ndarray:
    return np.asarray(g.weights, dtype=np.float64)


def _int4_lists(payloads: Sequence[Encoded]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    return [p.data for p in payloads], [p.scales for p in payloads]


def _fused_codec(payloads: Sequence[Encoded], size: int) -> Codec | None:
    """The codec of a round the fused kernels take (int4 of one block, or fp32), or None."""
    codecs = {(p.codec, p.block) for p in payloads}
    if size < FUSED_ELEMENTS_MIN or len(codecs) != 1:
        return None
    codec = payloads[0].codec
    return codec if codec in (Codec.INT4, Codec.FP32) else None


def merge_round(
    contributions: Sequence[Contribution], fragment: FragmentSpec, method: MergeMethod | str = MergeMethod.RDA
) -> tuple[MergedGradient, MergeInfo]:
    """The merged outer gradient as a MergedGradient, for core.outer.update to take in a fused pass (what
    the syncer calls). Raises ValueError when no contribution has weight."""
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
    payloads = tuple(c.payload for c in parts)
    fallback: tuple[str, ...] = ()
    merged = MergedGradient(fragment.padded_size, tuple(weights), payloads, fragment.offsets)
    if method is MergeMethod.RDA and len(parts) > 1:
        summed, factors, fallback = _rda(parts, weights, fragment)
        merged = MergedGradient(fragment.padded_size, tuple(weights), payloads, fragment.offsets, summed, factors)
    return merged, MergeInfo(tuple(ids), tuple(weights), fallback)


def merge(
    contributions: Sequence[Contribution], fragment: FragmentSpec, method: MergeMethod | str = MergeMethod.RDA
) -> tuple[np.ndarray, MergeInfo]:
    """float32[padded_size] merged outer gradient. Raises ValueError when no contribution has weight."""
    merged, info = merge_round(contributions, fragment, method)
    return merged.values(), info


def _rda(
    parts: list[Contribution], weights: list[float], fragment: FragmentSpec
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """(the weighted sum of unit vectors, the per-tensor factors that scale it to the RDA merge, the
    tensors that fell back to the mean). The norms of every contribution (reading codes only), then
    every unit vector accumulated with the norms of the sum taken as it goes (one pass when the codecs
    allow, else one per contribution and one more for the norms); the scaling by the factors is left to
    the caller (fused into the outer step)."""
    offsets = fragment.offsets
    k = offsets.size - 1
    embedding = fragment.embedding_mask
    radial = np.zeros(k, dtype=np.float64)
    norms = np.empty((len(parts), k), dtype=np.float64)
    for m, (c, w) in enumerate(zip(parts, weights)):
        norms[m] = np.sqrt(c.payload.segment_sumsq(offsets))
        radial += w * norms[m]
        # Embedding tensors take the plain mean: dividing by a norm of 1 turns the RDA accumulation
        # into `acc += w * x` for them, so one pass serves both kinds of tensor.
        norms[m, embedding] = 1.0
    acc = np.zeros(fragment.padded_size, dtype=np.float32)
    payloads = [c.payload for c in parts]
    fused = _fused_codec(payloads, fragment.padded_size)
    w64 = np.asarray(weights, dtype=np.float64)
    if fused is Codec.INT4:
        sumsq = kernels.rda_accumulate_round_int4_sumsq(
            acc, w64, *_int4_lists(payloads), offsets, norms, payloads[0].block
        )
    elif fused is Codec.FP32:
        sumsq = kernels.rda_accumulate_round_sumsq(acc, w64, [p.data for p in payloads], offsets, norms)
    else:
        for m, (c, w) in enumerate(zip(parts, weights)):
            c.payload.rda_accumulate_into(acc, w, offsets, norms[m])
        sumsq = kernels.segment_sumsq(acc, offsets)
    direction = np.sqrt(sumsq)
    factors = np.ones(k, dtype=np.float32)
    fallback = []
    for i in range(k):
        if embedding[i]:
            continue
        if direction[i] < RDA_DIRECTION_NORM_MIN:
            fallback.append(i)
        else:
            factors[i] = np.float32(radial[i] / direction[i])
    if fallback:
        _segment_means(parts, weights, offsets, fallback, acc)
    return acc, factors, tuple(fragment.segments[i].tensor.path for i in fallback)


def _segment_means(
    parts: list[Contribution], weights: list[float], offsets: np.ndarray, segments: list[int], acc: np.ndarray
) -> None:
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
