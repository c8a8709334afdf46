"""Cells over seeds: mean and spread of each output, and the paper's Table 1 as a grid of cells."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ddiloco.sim.config import ClusterConfig, RepairTime, RunConfig, SimConfigError, SystemConfig, Timings
from ddiloco.sim.paper import TABLE1, TABLE1_CHIPS, TABLE1_MTBI_CHIP_YEARS, paper_goodput
from ddiloco.sim.run import simulate

SEEDS_MAX = 10_000


@dataclass(frozen=True)
class CellResult:
    """One (system, cluster) over seeds. Spreads are the sample standard deviation (0 for one seed)."""

    system: SystemConfig
    chips: float
    seeds: int
    goodput: float
    goodput_std: float
    uptime: float
    uptime_std: float
    partial_share: float
    partial_share_std: float
    paper: float | None

    @property
    def error(self) -> float | None:
        return None if self.paper is None else self.goodput - self.paper


def seed_generator(seed: int, chips: float, system: SystemConfig) -> np.random.Generator:
    """A generator per (seed, cell): runs are independent of which other cells share the grid."""
    key = [seed, int(chips), list(type(system.system)).index(system.system), system.learners, system.quorum]
    return np.random.default_rng(key)


def run_cell(
    cluster: ClusterConfig, system: SystemConfig, timings: Timings, run: RunConfig, seeds: Sequence[int]
) -> CellResult:
    if not seeds:
        raise SimConfigError("seeds is empty: give at least one seed")
    if len(seeds) > SEEDS_MAX:
        raise SimConfigError(f"at most {SEEDS_MAX} seeds per cell, got {len(seeds)}")
    results = [simulate(cluster, system, timings, run, seed_generator(s, cluster.chips, system)) for s in seeds]
    g = np.array([r.goodput for r in results])
    u = np.array([r.uptime for r in results])
    p = np.array([r.partial_share for r in results])
    ddof = 1 if len(seeds) > 1 else 0
    return CellResult(
        system=system,
        chips=cluster.chips,
        seeds=len(seeds),
        goodput=float(g.mean()),
        goodput_std=float(g.std(ddof=ddof)),
        uptime=float(u.mean()),
        uptime_std=float(u.std(ddof=ddof)),
        partial_share=float(p.mean()),
        partial_share_std=float(p.std(ddof=ddof)),
        paper=_paper(cluster, system),
    )


def _paper(cluster: ClusterConfig, system: SystemConfig) -> float | None:
    """The paper's value only for its own setting: MTBI 1 chip-year, K = 1, no speed spread."""
    if cluster.mtbi_chip_years != TABLE1_MTBI_CHIP_YEARS or system.quorum != 1 or system.speed_sigma != 0:
        return None
    return paper_goodput(system.system, system.learners, cluster.chips)


def table1_systems() -> list[SystemConfig]:
    return [SystemConfig.of(system, learners) for system, learners in TABLE1]


def run_table1(
    timings: Timings,
    seeds: Sequence[int],
    *,
    slice_chips: int,
    repair: RepairTime,
    days: float = 7.0,
    chips: Iterable[float] = TABLE1_CHIPS,
    systems: Iterable[SystemConfig] | None = None,
) -> list[CellResult]:
    """The paper's grid (6 systems x 5 sizes at MTBI 1 chip-year, or the rows given), row by row."""
    run = RunConfig(days=days)
    cells = []
    for system in table1_systems() if systems is None else systems:
        for n in chips:
            cluster = ClusterConfig(n, TABLE1_MTBI_CHIP_YEARS, slice_chips, repair)
            cells.append(run_cell(cluster, system, timings, run, seeds))
    return cells
