"""One simulated run: draw the failures from the injected generator, run the event loop, report.

goodput = useful chip-time / (N chips x wall time); uptime = share of wall time with global progress;
partial = share of the progressing time in which fewer than M learners progressed (for Decoupled
DiLoCo: the share of steps merged with fewer than M learners).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddiloco.sim import engine
from ddiloco.sim.config import ClusterConfig, RunConfig, System, SystemConfig, Timings
from ddiloco.sim.failures import draw_failures, slices_per_learner

SPEED_MIN = 0.05  # a learner's relative speed is clipped here: a spread never makes one stop


@dataclass(frozen=True)
class RunResult:
    goodput: float
    uptime: float
    partial_share: float  # share of progressing time with fewer than M learners progressing
    failures: int  # interruptions drawn over the horizon
    interruptions: int  # of which hit a running chip
    reconfigurations: int  # restarts or scale pauses paid


def draw_speeds(system: SystemConfig, rng: np.random.Generator) -> np.ndarray:
    """Relative speed per learner, 1 + sigma * z, clipped at SPEED_MIN (float64, shape (M,))."""
    if system.speed_sigma == 0:
        return np.ones(system.learners)
    return np.maximum(SPEED_MIN, 1.0 + system.speed_sigma * rng.standard_normal(system.learners))


def simulate(
    cluster: ClusterConfig,
    system: SystemConfig,
    timings: Timings,
    run: RunConfig,
    rng: np.random.Generator,
) -> RunResult:
    """Simulate one run; the same generator state gives the same result."""
    slices = slices_per_learner(cluster.slices, system.learners)
    speed = draw_speeds(system, rng)
    stream = draw_failures(cluster, slices, run.horizon_s, rng)
    chips_per_slice = cluster.chips / cluster.slices
    stats = engine.run_events(
        stream.times_s,
        stream.learner,
        stream.pick,
        stream.repair_s,
        slices,
        speed,
        chips_per_slice,
        system.system is not System.DP,
        system.quorum,
        float(timings.restart_s),
        float(timings.scale_down_s),
        float(timings.scale_up_s),
        float(timings.join_wait_s),
        run.horizon_s,
    )
    up_s = stats[engine.STAT_UP_S]
    return RunResult(
        goodput=float(stats[engine.STAT_USEFUL_CHIP_S] / (cluster.chips * run.horizon_s)),
        uptime=float(up_s / run.horizon_s),
        partial_share=float(stats[engine.STAT_PARTIAL_S] / up_s) if up_s > 0 else 0.0,
        failures=len(stream),
        interruptions=int(stats[engine.STAT_INTERRUPTIONS]),
        reconfigurations=int(stats[engine.STAT_RECONFIGURATIONS]),
    )


def warm_up() -> None:
    """Compile (or load from the disk cache) the event loop with a tiny run; call at start, not import."""
    cluster = ClusterConfig(chips=4096, mtbi_chip_years=0.01, slice_chips=256)
    for system in (SystemConfig.of("dp"), SystemConfig.of("decoupled", 4, 2, 0.1)):
        simulate(cluster, system, Timings(), RunConfig(days=0.05), np.random.default_rng(0))
