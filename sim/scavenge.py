"""Opportunistic compute: temporary learners on spare, slower chips, and the wall time they save.

A closed-form model (no randomness). Base: a cluster at step time 1 and global batch B0. Temporary
capacity adds `extra` x the base chips, on hardware `speed` times as fast (the mixed-hardware gap by
default), present a share `availability` of the time. Training progress per step follows the critical
batch law of McCandlish et al. (2018): reaching a target takes S = S_min (1 + B_noise / B) steps, so
progress per second is (1 / step time) / (1 + beta * B0 / B) with beta = B_noise / B0.
- data-parallel: one lockstep job; with the temporary chips in, every step waits for the slowest chip
  (step time 1 / speed) and the batch is (1 + extra) B0; each arrival and departure of the temporary
  capacity costs one global scale-up or scale-down pause.
- Decoupled DiLoCo: learners run at their own pace; tokens per second grow by extra * speed at step
  time 1; a temporary learner's arrival costs only its own catch-up (scale-up) time.
Output: wall time to the same progress relative to the base cluster alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddiloco.sim.config import SimConfigError
from ddiloco.sim.paper import MIXED_SPEED_GAP

EXTRA_MAX = 1_000.0


@dataclass(frozen=True)
class ScavengeConfig:
    extra: float = 1.0  # temporary chips / base chips
    speed: float = 1.0 / (1.0 + MIXED_SPEED_GAP)
    beta: float = 1.0  # B_noise / B0: the base batch sits at the critical batch
    availability: float = 1.0
    stay_s: float = math.inf  # mean time the temporary capacity stays before it is taken back
    scale_down_s: float = 20.0
    scale_up_s: float = 15.0

    def __post_init__(self) -> None:
        checks = (
            ("extra", 0.0 <= self.extra <= EXTRA_MAX, f"in [0, {EXTRA_MAX:g}]"),
            ("speed", 0.0 < self.speed <= 1.0, "in (0, 1]"),
            ("beta", 0.0 <= self.beta < math.inf, "non-negative"),
            ("availability", 0.0 <= self.availability <= 1.0, "in [0, 1]"),
            ("stay_s", self.stay_s > 0, "positive (inf: never taken back)"),
            ("scale_down_s", 0.0 <= self.scale_down_s < math.inf, "non-negative"),
            ("scale_up_s", 0.0 <= self.scale_up_s < math.inf, "non-negative"),
        )
        for name, ok, what in checks:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not ok:
                raise SimConfigError(f"{name} must be {what}, got {value!r}")


@dataclass(frozen=True)
class ScavengeResult:
    extra: float
    wall_decoupled: float  # relative to the base cluster alone
    wall_dp: float


def _progress_rate(step_time: float, batch: float, beta: float) -> float:
    return (1.0 / step_time) / (1.0 + beta / batch)


def _churn_share(cfg: ScavengeConfig, pause_s: float) -> float:
    """Share of the temporary capacity's stay lost to the pause it costs on arrival and departure."""
    return 0.0 if math.isinf(cfg.stay_s) else min(1.0, pause_s / cfg.stay_s)


def scavenge(cfg: ScavengeConfig) -> ScavengeResult:
    base = _progress_rate(1.0, 1.0, cfg.beta)
    a = cfg.availability if cfg.extra > 0 else 0.0
    dp_with = _progress_rate(1.0 / cfg.speed, 1.0 + cfg.extra, cfg.beta)
    dp_with *= 1.0 - _churn_share(cfg, cfg.scale_up_s + cfg.scale_down_s)  # global pauses stop everyone
    dec_extra = cfg.extra * cfg.speed * (1.0 - _churn_share(cfg, cfg.scale_up_s))  # only its own chips
    dec_with = _progress_rate(1.0, 1.0 + dec_extra, cfg.beta)
    dp = a * dp_with + (1 - a) * base
    dec = a * dec_with + (1 - a) * base
    return ScavengeResult(cfg.extra, base / dec, base / dp)
