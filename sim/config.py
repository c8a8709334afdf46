"""What the goodput simulator is asked to simulate: the cluster, its failures, the system, the run.

Four frozen values, validated once when built. Sizes are chips, durations are seconds (the suffix
says so), the failure rate is one mean time between interruptions per chip. Every check raises
`SimConfigError` naming the field, before anything is simulated.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from ddiloco.errors import UserError

YEAR_S = 365.25 * 86_400.0  # a Julian year; "one interruption per chip-year" uses it
DAY_S = 86_400.0

CHIPS_MAX = 1e9  # far past any cluster; keeps counts exact in float64
LEARNERS_MAX = 4_096
HORIZON_S_MAX = 366 * DAY_S
# The failure stream of one run is held in memory (three float64 per failure); this caps it.
FAILURES_MAX = 20_000_000


class SimConfigError(UserError, ValueError):
    """A simulator setting that cannot work; the message names the field."""


class System(str, enum.Enum):
    DP = "dp"  # synchronous data-parallel, no elasticity: any failure stalls the job until it restarts
    ELASTIC_DP = "elastic-dp"  # drops the failed slice, shrinks, grows back after repair
    DECOUPLED = "decoupled"  # M independent elastic learners behind one syncer


class RepairKind(str, enum.Enum):
    FIXED = "fixed"
    EXPONENTIAL = "exponential"
    LOGNORMAL = "lognormal"


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise SimConfigError(f"{name} must be a positive finite number, got {value!r}")


def _non_negative(name: str, value: float, *, allow_inf: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not math.isnan(value) and value >= 0
    if not ok or (math.isinf(value) and not allow_inf):
        raise SimConfigError(f"{name} must be a non-negative number, got {value!r}")


def _whole(name: str, value: int, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SimConfigError(f"{name} must be a whole number in [{low}, {high}], got {value!r}")


@dataclass(frozen=True)
class RepairTime:
    """How long failed capacity takes to come back (repair, or a replacement slice provisioned).

    `cv` is the coefficient of variation of the lognormal kind (std / mean); the other kinds ignore it.
    """

    kind: RepairKind = RepairKind.EXPONENTIAL
    mean_s: float = 600.0
    cv: float = 1.0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", RepairKind(self.kind))
        except ValueError:
            raise SimConfigError(
                f"repair distribution {self.kind!r} is not one of {[k.value for k in RepairKind]}"
            ) from None
        _positive("repair mean_s", self.mean_s)
        _positive("repair cv", self.cv)


@dataclass(frozen=True)
class Timings:
    """The pauses of each system; the calibrated values and their reasoning are in docs/simulator.md.

    restart_s: a synchronous job's whole cost of one incident (detect, reschedule onto a spare slice,
      restore from the last in-memory checkpoint, redo the steps since it).
    scale_down_s: an elastic job's pause to drop a failed slice and re-plan on the survivors.
    scale_up_s: an elastic job's pause to add repaired slices back.
    join_wait_s: how long a repaired slice may wait to join at the next reconfiguration before the job
      pays a scale-up of its own (elastic controllers batch membership changes; inf: never on its own).
    """

    restart_s: float = 80.0
    scale_down_s: float = 20.0
    scale_up_s: float = 15.0
    join_wait_s: float = 120.0

    def __post_init__(self) -> None:
        _non_negative("restart_s", self.restart_s)
        _non_negative("scale_down_s", self.scale_down_s)
        _non_negative("scale_up_s", self.scale_up_s)
        _non_negative("join_wait_s", self.join_wait_s, allow_inf=True)


@dataclass(frozen=True)
class ClusterConfig:
    """N chips in slices of `slice_chips`, each chip interrupted as a Poisson process."""

    chips: float = 1.2e6
    mtbi_chip_years: float = 1.0
    slice_chips: int = 256
    repair: RepairTime = field(default_factory=RepairTime)

    def __post_init__(self) -> None:
        _positive("chips", self.chips)
        if self.chips > CHIPS_MAX:
            raise SimConfigError(f"chips must be at most {CHIPS_MAX:g}, got {self.chips!r}")
        _non_negative("mtbi_chip_years", self.mtbi_chip_years, allow_inf=True)
        if self.mtbi_chip_years == 0:
            raise SimConfigError("mtbi_chip_years must be positive (inf: no failures), got 0")
        _whole("slice_chips", self.slice_chips, 1, int(CHIPS_MAX))
        if self.slice_chips > self.chips:
            raise SimConfigError(f"slice_chips {self.slice_chips} exceeds chips {self.chips:g}")
        if not isinstance(self.repair, RepairTime):
            raise SimConfigError(f"repair must be a RepairTime, got {type(self.repair).__name__}")

    @property
    def slices(self) -> int:
        return max(1, round(self.chips / self.slice_chips))

    @property
    def failure_rate_per_s(self) -> float:
        """Superposed rate of the whole cluster: N chips / MTBI (0 when MTBI is infinite)."""
        return self.chips / (self.mtbi_chip_years * YEAR_S)


@dataclass(frozen=True)
class SystemConfig:
    """Which system runs on the cluster. `learners` and `quorum` matter for Decoupled DiLoCo only
    (the two data-parallel systems are one job); `speed_sigma` is the spread of per-learner speed."""

    system: System = System.DECOUPLED
    learners: int = 8
    quorum: int = 1
    speed_sigma: float = 0.0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "system", System(self.system))
        except ValueError:
            raise SimConfigError(f"system {self.system!r} is not one of {[s.value for s in System]}") from None
        _whole("learners", self.learners, 1, LEARNERS_MAX)
        _whole("quorum", self.quorum, 1, LEARNERS_MAX)
        if self.quorum > self.learners:
            raise SimConfigError(f"quorum K={self.quorum} exceeds the number of learners M={self.learners}")
        if self.system is not System.DECOUPLED and (self.learners != 1 or self.quorum != 1):
            raise SimConfigError(f"{self.system.value} is one job: learners and quorum must be 1")
        _non_negative("speed_sigma", self.speed_sigma)
        if self.speed_sigma >= 1:
            raise SimConfigError(
                f"speed_sigma must be below 1 (a spread of speeds, not a factor), got {self.speed_sigma}"
            )

    @classmethod
    def of(cls, system: System | str, learners: int = 1, quorum: int = 1, speed_sigma: float = 0.0) -> SystemConfig:
        """Build from a system name; the data-parallel systems ignore `learners` and `quorum`."""
        try:
            kind = System(system)
        except ValueError:
            raise SimConfigError(f"system {system!r} is not one of {[s.value for s in System]}") from None
        if kind in (System.DP, System.ELASTIC_DP):
            return cls(kind, 1, 1, speed_sigma)
        return cls(kind, learners, quorum, speed_sigma)

    @property
    def label(self) -> str:
        if self.system is System.DECOUPLED:
            return f"decoupled M={self.learners}" + (f" K={self.quorum}" if self.quorum != 1 else "")
        return self.system.value


@dataclass(frozen=True)
class RunConfig:
    """One simulated run: the horizon of simulated wall time."""

    days: float = 7.0

    def __post_init__(self) -> None:
        _positive("days", self.days)
        if self.days * DAY_S > HORIZON_S_MAX:
            raise SimConfigError(f"days must be at most {HORIZON_S_MAX / DAY_S:g}, got {self.days}")

    @property
    def horizon_s(self) -> float:
        return self.days * DAY_S
