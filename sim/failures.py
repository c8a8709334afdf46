"""The cluster's interruptions as one Poisson stream, drawn from an injected generator.

N chips, each interrupted as an independent Poisson process of rate 1/MTBI, superpose into one
Poisson process of rate N/MTBI, and the chip each interruption hits is uniform over the cluster. So
the stream is drawn at cluster level (memory grows with the number of failures, never with chips x
failures): a Poisson count over the horizon, uniform sorted times, a uniform slice for each (reduced
to the learner owning it), one uniform draw that later picks the state of the slice hit, and one
repair duration.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddiloco.sim.config import FAILURES_MAX, ClusterConfig, RepairKind, RepairTime, SimConfigError


@dataclass(frozen=True)
class FailureStream:
    times_s: np.ndarray  # (n,) float64, sorted
    learner: np.ndarray  # (n,) int64, owner of the slice hit
    pick: np.ndarray  # (n,) float64 in [0, 1): which of that learner's slices (by state) was hit
    repair_s: np.ndarray  # (n,) float64, how long the slice is out if the hit takes it down

    def __len__(self) -> int:
        return int(self.times_s.shape[0])


def slices_per_learner(slices: int, learners: int) -> np.ndarray:
    """Split `slices` as evenly as possible; the first `slices % learners` learners get one more."""
    if learners > slices:
        raise SimConfigError(f"{learners} learners need at least {learners} slices, the cluster has {slices}")
    base, extra = divmod(slices, learners)
    counts = np.full(learners, base, dtype=np.int64)
    counts[:extra] += 1
    return counts


def sample_repair(repair: RepairTime, n: int, rng: np.random.Generator) -> np.ndarray:
    """n repair durations with mean `repair.mean_s` (float64 seconds)."""
    if repair.kind is RepairKind.FIXED:
        return np.full(n, repair.mean_s)
    if repair.kind is RepairKind.EXPONENTIAL:
        return rng.exponential(repair.mean_s, n)
    # Lognormal with the requested mean and coefficient of variation.
    sigma2 = np.log1p(repair.cv**2)
    mu = np.log(repair.mean_s) - sigma2 / 2
    return rng.lognormal(mu, np.sqrt(sigma2), n)


def expected_failures(cluster: ClusterConfig, horizon_s: float) -> float:
    return cluster.failure_rate_per_s * horizon_s


def draw_failures(
    cluster: ClusterConfig, slice_counts: np.ndarray, horizon_s: float, rng: np.random.Generator
) -> FailureStream:
    """The interruptions of one run over [0, horizon_s)."""
    mean = expected_failures(cluster, horizon_s)
    # Six standard deviations above the mean still fits: a run is refused before it is drawn.
    if mean + 6 * np.sqrt(mean) > FAILURES_MAX:
        raise SimConfigError(
            f"{mean:.3g} expected failures over the horizon exceed the limit of {FAILURES_MAX:.3g}: "
            "shorten the run or lower chips / raise mtbi_chip_years"
        )
    n = int(rng.poisson(mean)) if mean > 0 else 0
    times = np.sort(rng.uniform(0.0, horizon_s, n))
    slice_hit = rng.integers(0, int(slice_counts.sum()), n)
    learner = np.searchsorted(np.cumsum(slice_counts), slice_hit, side="right").astype(np.int64)
    pick = rng.random(n)
    repair = sample_repair(cluster.repair, n, rng)
    return FailureStream(times, learner, pick, repair)
