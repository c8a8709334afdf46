"""Goodput simulator: a cluster of N chips under Poisson chip interruptions, three systems on it.

Pure and deterministic: every run takes a seeded `numpy.random.Generator`; no clock, no I/O (the CLI,
`ddiloco simulate`, prints, plots and writes JSON). Model, calibration and measured figures:
docs/simulator.md.
"""

from ddiloco.sim.calibration import CALIBRATED, Calibration, SearchSpace, search
from ddiloco.sim.config import (
    ClusterConfig,
    RepairKind,
    RepairTime,
    RunConfig,
    SimConfigError,
    System,
    SystemConfig,
    Timings,
)
from ddiloco.sim.grid import CellResult, run_cell, run_table1
from ddiloco.sim.mixed import MixedConfig, PolicyResult, simulate_mixed
from ddiloco.sim.paper import TABLE1, TABLE1_CHIPS, paper_goodput
from ddiloco.sim.run import RunResult, simulate, warm_up
from ddiloco.sim.scavenge import ScavengeConfig, ScavengeResult, scavenge

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
