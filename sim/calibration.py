"""The calibrated free parameters, and the grid search that chose them (docs/simulator.md).

Five physical parameters are shared by all 30 cells of Table 1: the slice size, the repair-time mean,
the elastic scale-down and scale-up pauses and the join wait; the synchronous restart time is the sixth
and only the DP row depends on it. The search minimises the largest absolute error over the cells
(minimax, so no cell is traded away for the average). The DP row and the other rows share no
parameter, so the two searches run separately.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ddiloco.sim.config import RepairKind, RepairTime, System, SystemConfig, Timings
from ddiloco.sim.grid import CellResult, run_table1, table1_systems


@dataclass(frozen=True)
class Calibration:
    slice_chips: int
    repair: RepairTime
    timings: Timings


CALIBRATED = Calibration(
    slice_chips=1024,
    repair=RepairTime(RepairKind.EXPONENTIAL, mean_s=300.0),
    timings=Timings(restart_s=76.0, scale_down_s=20.0, scale_up_s=15.0, join_wait_s=120.0),
)


@dataclass(frozen=True)
class SearchSpace:
    """Candidate values per parameter; the search tries every combination."""

    restart_s: tuple[float, ...] = tuple(float(r) for r in range(60, 96, 4))
    slice_chips: tuple[int, ...] = (64, 256, 1024)
    repair_mean_s: tuple[float, ...] = (300.0, 600.0, 900.0)
    scale_down_s: tuple[float, ...] = (16.0, 18.0, 20.0, 22.0)
    scale_up_s: tuple[float, ...] = (10.0, 15.0, 20.0)
    join_wait_s: tuple[float, ...] = (60.0, 120.0, 240.0)

    @property
    def size(self) -> int:
        elastic = len(self.slice_chips) * len(self.repair_mean_s) * len(self.scale_down_s)
        return len(self.restart_s) + elastic * len(self.scale_up_s) * len(self.join_wait_s)


@dataclass(frozen=True)
class Candidate:
    calibration: Calibration
    error_max: float  # largest |simulated - paper| over the rows searched, as a fraction


def error_max(cells: Sequence[CellResult]) -> float:
    return max(abs(c.error) for c in cells if c.error is not None)


def search(space: SearchSpace, seeds: Sequence[int], days: float = 7.0) -> tuple[Candidate, list[Candidate]]:
    """Return the best calibration (its error over all rows) and every candidate tried, best first.

    The restart time is chosen on the DP row alone; the rest on the five other rows.
    """
    dp_row = [s for s in table1_systems() if s.system is System.DP]
    other_rows = [s for s in table1_systems() if s.system is not System.DP]
    base = CALIBRATED

    def cells(cal: Calibration, rows: list[SystemConfig]) -> list[CellResult]:
        return run_table1(cal.timings, seeds, slice_chips=cal.slice_chips, repair=cal.repair, days=days, systems=rows)

    dp_error, restart = min(
        (error_max(cells(replace(base, timings=replace(base.timings, restart_s=r)), dp_row)), r)
        for r in space.restart_s
    )
    candidates = []
    for sc, rep, down, up, wait in itertools.product(
        space.slice_chips, space.repair_mean_s, space.scale_down_s, space.scale_up_s, space.join_wait_s
    ):
        cal = Calibration(sc, RepairTime(RepairKind.EXPONENTIAL, rep), Timings(restart, down, up, wait))
        candidates.append(Candidate(cal, error_max(cells(cal, other_rows))))
    # Ties broken by the parameters themselves, so the order never depends on float noise alone.
    candidates.sort(key=lambda c: (c.error_max, c.calibration.slice_chips, c.calibration.repair.mean_s))
    best = candidates[0]
    return Candidate(best.calibration, max(best.error_max, dp_error)), candidates
