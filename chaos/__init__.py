"""Deterministic simulation test of the syncer core: simulated learners and network, faults from one seed.

`run_seed(seed)` runs one seed (safety phase with faults, liveness phase healed) and returns a
`Result`; docs/chaos-sim.md describes the fault model, the invariants and how to reproduce a seed.
"""

from ddiloco.chaos.faults import FAULT_KINDS, ChaosConfig, Fault, Plan, draw_plan
from ddiloco.chaos.invariants import INVARIANTS, Checker, Violation
from ddiloco.chaos.run import Result, run_seed

__all__ = [
    "FAULT_KINDS",
    "INVARIANTS",
    "ChaosConfig",
    "Checker",
    "Fault",
    "Plan",
    "Result",
    "Violation",
    "draw_plan",
    "run_seed",
]
