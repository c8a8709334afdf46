"""The numbers of Douillard et al. (2026) the simulator is checked against (docs/algorithm.md, "Goodput").

Table 1: goodput at MTBI = 1 chip-year, as fractions. Rows are systems (None: one job), columns are
cluster sizes in chips.
"""

from __future__ import annotations

from ddiloco.sim.config import System

TABLE1_CHIPS: tuple[float, ...] = (150e3, 300e3, 600e3, 1.2e6, 2.4e6)
TABLE1_MTBI_CHIP_YEARS = 1.0

# (system, learners) -> goodput per cluster size in TABLE1_CHIPS
TABLE1: dict[tuple[System, int], tuple[float, ...]] = {
    (System.DP, 1): (0.72, 0.57, 0.38, 0.27, 0.18),
    (System.ELASTIC_DP, 1): (0.88, 0.80, 0.69, 0.58, 0.40),
    (System.DECOUPLED, 2): (0.94, 0.88, 0.80, 0.70, 0.54),
    (System.DECOUPLED, 4): (0.96, 0.93, 0.89, 0.82, 0.73),
    (System.DECOUPLED, 8): (0.98, 0.96, 0.94, 0.88, 0.80),
    (System.DECOUPLED, 16): (0.99, 0.98, 0.96, 0.93, 0.86),
}

# Mixed hardware: 4 fast + 4 slow learners, about an 18% speed gap plus 10% noise.
MIXED_LEARNERS_FAST = 4
MIXED_LEARNERS_SLOW = 4
MIXED_SPEED_GAP = 0.18
MIXED_NOISE = 0.10
MIXED_GOODPUT = {"K=M": 0.84, "K=1": 1.00, "K=1+grace": 1.00}

# Opportunistic compute: temporary learners adding a share of the base compute, wall time to the same
# training progress relative to the base cluster (the paper gives the two ends of its range).
SCAVENGE_EXTRA = (0.25, 3.00)
SCAVENGE_WALL_DECOUPLED = (0.90, 0.62)
SCAVENGE_WALL_DP = (1.07, 0.80)


def paper_goodput(system: System, learners: int, chips: float) -> float | None:
    """The paper's Table 1 value for a cell, or None where the table has none."""
    row = TABLE1.get((System(system), learners if System(system) is System.DECOUPLED else 1))
    if row is None or chips not in TABLE1_CHIPS:
        return None
    return row[TABLE1_CHIPS.index(chips)]
