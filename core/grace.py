"""The adaptive grace window (docs/algorithm.md, "Syncer: one round of fragment p", item 3).

After the quorum of a round is reached, the syncer waits a little longer for stragglers, but only
inside the slack that overlap leaves before the merged fragment is due back at the learners:

    slack = tau * step_time - (quorum_time + sync_time)
    grace = clamp(gamma * slack, 0, grace_max)

step_time, quorum_time and sync_time are exponential moving averages measured by the syncer on its
own monotonic clock. Until a quantity has been measured the window is 0: no basis, no waiting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ddiloco.errors import UserError


class GraceConfigError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class GraceConfig:
    gamma: float = 0.5  # share of the slack spent waiting; < 1 so some slack is always left
    grace_ms_max: float = 1000.0  # in practice the window is at most about one step
    ema_alpha: float = 0.2  # weight of the newest measurement
    overlap: int = 2  # tau

    def __post_init__(self) -> None:
        if not (math.isfinite(self.gamma) and 0 <= self.gamma < 1):
            raise GraceConfigError(f"grace gamma must lie in [0, 1), got {self.gamma!r}")
        if not (math.isfinite(self.grace_ms_max) and self.grace_ms_max >= 0):
            raise GraceConfigError(f"grace_ms_max must be a non-negative number, got {self.grace_ms_max!r}")
        if not (math.isfinite(self.ema_alpha) and 0 < self.ema_alpha <= 1):
            raise GraceConfigError(f"ema alpha must lie in (0, 1], got {self.ema_alpha!r}")
        if not isinstance(self.overlap, int) or self.overlap < 0:
            raise GraceConfigError(f"overlap tau must be a non-negative integer, got {self.overlap!r}")


@dataclass(frozen=True)
class Timing:
    """EMAs in seconds; None until first measured."""

    step_s: float | None = None
    quorum_s: float | None = None
    sync_s: float | None = None


def ema(previous: float | None, sample: float, alpha: float) -> float:
    if not (math.isfinite(sample) and sample >= 0):
        raise ValueError(f"a duration sample must be finite and non-negative, got {sample!r}")
    return sample if previous is None else (1 - alpha) * previous + alpha * sample


def observe(timing: Timing, config: GraceConfig, **samples: float) -> Timing:
    """Fold new samples (step_s=..., quorum_s=..., sync_s=...) into the EMAs."""
    updated = {name: ema(getattr(timing, name), value, config.ema_alpha) for name, value in samples.items()}
    return replace(timing, **updated)


def grace_seconds(timing: Timing, config: GraceConfig) -> tuple[float, str]:
    """(window in seconds, the reason for it)."""
    if timing.step_s is None:
        return 0.0, "no grace: step time not measured yet"
    slack = config.overlap * timing.step_s - ((timing.quorum_s or 0.0) + (timing.sync_s or 0.0))
    cap = config.grace_ms_max / 1000.0
    grace = min(max(config.gamma * slack, 0.0), cap)
    why = (
        f"grace {grace * 1000:.0f} ms = clamp({config.gamma:g} x slack {slack * 1000:.0f} ms, 0, "
        f"{config.grace_ms_max:g} ms); slack = {config.overlap} x step {timing.step_s * 1000:.0f} ms - "
        f"(quorum {(timing.quorum_s or 0) * 1000:.0f} ms + sync {(timing.sync_s or 0) * 1000:.0f} ms)"
    )
    return grace, why
