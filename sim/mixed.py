"""Mixed hardware: fast and slow learners, per-step noise, and what the quorum K and grace buy.

A round-by-round Monte Carlo (no failures). Learner m's step takes base_m * (1 + noise * z), z standard
normal, clipped at STEP_MIN of its base. Three syncer policies:
- K = M: the syncer waits for everyone; once its overlap runs out a learner waits for the merge, so
  each round lasts as long as the slowest step and the others' chips idle for the difference.
- K = 1: nobody waits (goodput 1); a round merges the first arrival only, so the slow learners'
  work lands late, in later rounds (the quality loss the paper measures).
- K = 1 with grace: nobody waits either; after the first arrival the syncer keeps the round open for
  grace = clamp(gamma * (tau * step - quorum_time), 0, grace_max) (docs/algorithm.md, "Syncer: one round of fragment p",
  item 3; sync time taken as 0). A learner delivers at its next step boundary: after a uniform share
  of its current step.
Outputs per policy: goodput (busy chip-time share) and the share of learners merged per round.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddiloco.sim.config import SimConfigError
from ddiloco.sim.paper import MIXED_LEARNERS_FAST, MIXED_LEARNERS_SLOW, MIXED_NOISE, MIXED_SPEED_GAP

STEP_MIN = 0.05  # a noisy step never takes less than this share of its base time
ROUNDS_MAX = 10_000_000


@dataclass(frozen=True)
class MixedConfig:
    fast: int = MIXED_LEARNERS_FAST
    slow: int = MIXED_LEARNERS_SLOW
    speed_gap: float = MIXED_SPEED_GAP  # a slow step takes (1 + gap) fast steps
    noise: float = MIXED_NOISE  # per-step relative standard deviation
    rounds: int = 20_000
    overlap_steps: float = 2.0  # tau
    grace_gamma: float = 0.5
    grace_steps_max: float = 1.0  # grace_max, in fast steps

    def __post_init__(self) -> None:
        for name in ("fast", "slow"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise SimConfigError(f"{name} must be a whole number >= 0, got {v!r}")
        if self.fast + self.slow < 1:
            raise SimConfigError("mixed hardware needs at least one learner")
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or not 1 <= self.rounds <= ROUNDS_MAX:
            raise SimConfigError(f"rounds must be a whole number in [1, {ROUNDS_MAX}], got {self.rounds!r}")
        for name in ("speed_gap", "noise", "overlap_steps", "grace_gamma", "grace_steps_max"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v >= 0):
                raise SimConfigError(f"{name} must be a non-negative number, got {v!r}")
        if self.grace_gamma >= 1:
            raise SimConfigError(f"grace_gamma must be below 1, got {self.grace_gamma}")

    @property
    def learners(self) -> int:
        return self.fast + self.slow


@dataclass(frozen=True)
class PolicyResult:
    policy: str  # "K=M", "K=1", "K=1+grace"
    goodput: float
    merged_share: float  # mean share of the M learners merged in their round


def _step_times(cfg: MixedConfig, rng: np.random.Generator) -> np.ndarray:
    base = np.concatenate([np.ones(cfg.fast), np.full(cfg.slow, 1.0 + cfg.speed_gap)])
    z = rng.standard_normal((cfg.rounds, cfg.learners))
    return base * np.maximum(STEP_MIN, 1.0 + cfg.noise * z)  # (rounds, M) float64


def simulate_mixed(cfg: MixedConfig, rng: np.random.Generator) -> list[PolicyResult]:
    steps = _step_times(cfg, rng)
    m = cfg.learners
    barrier = PolicyResult("K=M", float(steps.sum() / (m * steps.max(axis=1).sum())), 1.0)
    arrivals = rng.random(steps.shape) * steps  # delivered at the next step boundary
    first = arrivals.min(axis=1, keepdims=True)
    alone = PolicyResult("K=1", 1.0, float(((arrivals <= first).sum(axis=1) / m).mean()))
    step_ref = 1.0  # the syncer's step-time estimate: the schedule follows the fastest learners
    grace = np.clip(cfg.grace_gamma * (cfg.overlap_steps * step_ref - first), 0.0, cfg.grace_steps_max * step_ref)
    merged = (arrivals <= first + grace).sum(axis=1) / m
    return [barrier, alone, PolicyResult("K=1+grace", 1.0, float(merged.mean()))]
