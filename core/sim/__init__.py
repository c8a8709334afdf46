"""Goodput simulator: a cluster of N chips under Poisson chip interruptions, three systems on it.

Pure and deterministic: every run takes a seeded `numpy.random.Generator`; no clock, no I/O (the CLI,
`ddiloco simulate`, prints, plots and writes JSON). Model, calibration and measured figures:
docs/simulator.md.
"""

from ddiloco.core.sim.calibration import CALIBRATED, Calibration, SearchSpace, search
from ddiloco.core.sim.config import (
    ClusterConfig,
    RepairKind,
    RepairTime,
    RunConfig,
    SimConfigError,
    System,
    SystemConfig,
    Timings,
)
from ddiloco.core.sim.grid import CellResult, run_cell, run_table1
from ddiloco.core.sim.mixed import MixedConfig, PolicyResult, simulate_mixed
from ddiloco.core.sim.paper import TABLE1, TABLE1_CHIPS, paper_goodput
from ddiloco.core.sim.run import RunResult, simulate, warm_up
from ddiloco.core.sim.scavenge import ScavengeConfig, ScavengeResult, scavenge

__all__ = [
    "CALIBRATED",
    "Calibration",
    "CellResult",
    "ClusterConfig",
    "MixedConfig",
    "PolicyResult",
    "RepairKind",
    "RepairTime",
    "RunConfig",
    "RunResult",
    "ScavengeConfig",
    "ScavengeResult",
    "SearchSpace",
    "SimConfigError",
    "System",
    "SystemConfig",
    "TABLE1",
    "TABLE1_CHIPS",
    "Timings",
    "paper_goodput",
    "run_cell",
    "run_table1",
    "scavenge",
    "search",
    "simulate",
    "simulate_mixed",
    "warm_up",
]
