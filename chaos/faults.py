"""What one seed decides: the world (syncer config, model, learners, links) and its fault plan.

Everything is drawn from the numpy Generator passed in, in a fixed order, so a seed names one run.
Faults fall inside the safety phase, `[FAULTS_START_S, safety_s)`; the liveness phase that follows
has none, and anything still broken when it begins is healed then (see run.py).

Fault kinds (each on one learner's process or link, or on the syncer):

    crash        the learner process dies; a new process with fresh weights starts `duration_s` later
    pause        the process is stopped for `duration_s` (no training, no reading; the socket stays up)
    delay        `amount` seconds of extra latency on the link for `duration_s`
    drop         each message on the link is lost with probability `amount` (a lost message resets
                 the connection: websockets are TCP) for `duration_s`
    duplicate    each message is delivered twice with probability `amount` for `duration_s`
    reorder      messages on the link get up to `amount` seconds of random extra delay, so they
                 overtake each other, for `duration_s`
    partition    the link is cut (its connection resets, new ones fail) for `duration_s`
    syncer_restart  the daemon stops (last checkpoint), and resumes from it `duration_s` later
    syncer_crash    the daemon dies (no last checkpoint) and resumes `duration_s` later from its last
                 periodic checkpoint, losing the merges since (or empty, if it never wrote one)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddiloco.chaos.learner import LearnerProfile
from ddiloco.chaos.network import LinkProfile
from ddiloco.core.config import SyncerConfig
from ddiloco.core.grace import GraceConfig
from ddiloco.core.layout import TensorSpec
from ddiloco.core.merge import MergeMethod
from ddiloco.core.outer import OuterConfig

FAULT_KINDS = ("crash", "pause", "delay", "drop", "duplicate", "reorder", "partition", "syncer_restart", "syncer_crash")
FAULTS_START_S = 1.0  # let the first learner seed version 0 before anything breaks
LEARNERS_MAX = 5
TENSORS_MAX = 5


@dataclass(frozen=True)
class ChaosConfig:
    safety_s: float = 12.0  # virtual seconds with faults on
    faults_max: int = 10  # faults drawn per seed: uniformly 0..faults_max
    fault_s_max: float = 3.0  # longest fault window
    liveness_periods: int = 2  # fragment periods the learners get to agree once all are live again
    rejoin_s_max: float = 15.0  # virtual seconds every learner gets to rejoin after healing
    events_max: int = 400_000  # actions per seed before the run is declared runaway
    client_as_is: bool = False  # learners send an old session's queued messages (learner.py)
    # learners send progress ahead of a local state still queued, as net/client.py's control-first
    # order does (learner.py); off, the local state is a barrier on its connection
    local_state_as_is: bool = False
    # a consistent snapshot (net.snapshot) every this many virtual seconds of the safety phase; 0: none
    snapshot_every_s: float = 3.0

    def __post_init__(self) -> None:
        if not (self.safety_s > FAULTS_START_S and self.fault_s_max > 0 and self.rejoin_s_max > 0):
            raise ValueError(f"safety_s must exceed {FAULTS_START_S} s and durations be positive: {self}")
        if self.snapshot_every_s < 0:
            raise ValueError(f"snapshot_every_s must be >= 0: {self}")
        if self.faults_max < 0 or self.liveness_periods < 1 or self.events_max < 1000:
            raise ValueError(f"faults_max >= 0, liveness_periods >= 1 and events_max >= 1000 needed: {self}")


@dataclass(frozen=True)
class Fault:
    at: float
    kind: str  # one of FAULT_KINDS
    learner: int  # index of the learner it hits; -1 for the syncer
    duration_s: float
    amount: float = 0.0  # seconds of delay, or a probability

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; known: {FAULT_KINDS}")

    def describe(self) -> str:
        who = "syncer" if self.learner < 0 else f"learner {self.learner}"
        extra = f" amount={self.amount:.3g}" if self.amount else ""
        return f"t={self.at:.3f} {self.kind} {who} for {self.duration_s:.3f}s{extra}"


@dataclass(frozen=True)
class Plan:
    seed: int
    syncer: SyncerConfig
    tensors: tuple[TensorSpec, ...]
    learners: tuple[LearnerProfile, ...]
    faults: tuple[Fault, ...]  # in time order

    def describe(self) -> list[str]:
        cfg = self.syncer
        lines = [
            (
                f"seed {self.seed}: {len(self.learners)} learners, {len(self.tensors)} tensors, P={cfg.num_fragments} "
                f"H={cfg.period} tau={cfg.grace.overlap} K={cfg.quorum} merge={cfg.merge.value} "
                f"broadcast={cfg.broadcast_codec.value} block={cfg.block} gamma={cfg.grace.gamma:.2f} "
                f"grace_ms_max={cfg.grace.grace_ms_max:.0f} lr={cfg.outer.lr} mu={cfg.outer.momentum} "
                f"checkpoint_every_merges={cfg.checkpoint_every_merges}"
            ),
        ]
        lines += [f"  fault {f.describe()}" for f in self.faults]
        return lines


def draw_plan(seed: int, rng: np.random.Generator, config: ChaosConfig) -> Plan:
    tensors = _draw_tensors(rng)
    learners = tuple(_draw_learner(rng) for _ in range(int(rng.integers(2, LEARNERS_MAX + 1))))
    syncer = _draw_syncer(rng, len(tensors), len(learners))
    faults = tuple(
        sorted(
            (_draw_fault(rng, config, len(learners)) for _ in range(int(rng.integers(0, config.faults_max + 1)))),
            key=lambda f: (f.at, f.kind, f.learner),
        )
    )
    return Plan(seed, syncer, tensors, learners, faults)


def _draw_tensors(rng: np.random.Generator) -> tuple[TensorSpec, ...]:
    count = int(rng.integers(1, TENSORS_MAX + 1))
    tensors = []
    for i in range(count):
        shape = (int(rng.integers(1, 9)), int(rng.integers(1, 25)))
        tensors.append(TensorSpec(f"layers/{i}/w", shape, embedding=bool(i == 0 and rng.random() < 0.5)))
    return tuple(tensors)


def _draw_learner(rng: np.random.Generator) -> LearnerProfile:
    link = LinkProfile(
        latency_s=float(rng.uniform(0.0005, 0.02)),
        jitter_s=float(rng.uniform(0, 0.01)),
        bytes_per_s=float(10 ** rng.uniform(5, 7)),
    )
    tokens_min = int(rng.integers(32, 257))
    return LearnerProfile(
        step_s=float(rng.uniform(0.04, 0.15)),
        step_jitter=float(rng.uniform(0, 0.3)),
        tokens_min=tokens_min,
        tokens_max=tokens_min + int(rng.integers(0, 129)),
        pull=float(rng.uniform(0.01, 0.2)),
        noise=float(rng.uniform(0, 0.02)),
        link=link,
    )


def _draw_syncer(rng: np.random.Generator, tensors: int, learners: int) -> SyncerConfig:
    fragments = int(rng.integers(1, tensors + 1))
    period = int(rng.integers(max(2, fragments), 2 * fragments + 3))  # H = 1: see docs/chaos-sim.md
    overlap = int(rng.integers(0, min(3, period) + 1))
    grace = GraceConfig(
        gamma=float(rng.uniform(0, 0.9)), grace_ms_max=float(rng.choice([0.0, 50.0, 200.0, 1000.0])), overlap=overlap
    )
    return SyncerConfig(
        num_fragments=fragments,
        period=period,
        block=int(rng.choice([8, 16, 32])),
        quorum=int(rng.integers(1, min(3, learners) + 1)),
        merge=MergeMethod(str(rng.choice(["rda", "mean"]))),
        outer=OuterConfig(lr=float(rng.choice([0.5, 0.7, 1.0])), momentum=float(rng.choice([0.0, 0.9]))),
        grace=grace,
        broadcast_codec=str(rng.choice(["int4", "bf16", "fp32"])),
        checkpoint_every_merges=int(rng.integers(0, 6)),
        checkpoint_every_s=0.0,
    )


def _draw_fault(rng: np.random.Generator, config: ChaosConfig, learners: int) -> Fault:
    kind = str(rng.choice(FAULT_KINDS))
    at = float(rng.uniform(FAULTS_START_S, config.safety_s))
    duration = float(rng.uniform(0.01, config.fault_s_max))
    learner = -1 if kind.startswith("syncer") else int(rng.integers(0, learners))
    amount = {
        "delay": float(rng.uniform(0.01, 0.5)),
        "drop": float(rng.uniform(0.01, 0.3)),
        "duplicate": float(rng.uniform(0.05, 0.5)),
        "reorder": float(rng.uniform(0.05, 0.5)),
    }.get(kind, 0.0)
    return Fault(at, kind, learner, duration, amount)
