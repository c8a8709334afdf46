"""The simulated world's clock and wires: a virtual clock with a priority queue, and learner links.

Everything that happens in a chaos run is an action on one queue ordered by (virtual time, sequence
number): message deliveries, learner steps, timers, faults. The sequence number is the order in
which actions were scheduled, so two actions due at the same instant always run in the same order
and a seed reproduces its run exactly.

The network carries messages between the syncer and each learner over *connections*. Websockets
ride on TCP, so the model keeps TCP's promises unless a fault lifts them:

- order: each direction of a connection is FIFO per traffic class, and a bulk message never
  overtakes a control message sent before it (the real shells send queued control frames ahead of
  bulk ones, so a request may overtake an update, never the reverse); a *reorder* fault lifts FIFO on
  a link for a while and gives every message a random extra delay of up to `reorder_s`, so later
  messages overtake earlier ones; even then nothing overtakes the welcome that opens a session
  (the session layer would refuse anything before it);
- loss: a message is never silently lost; a *drop* fault resets the whole connection instead, and
  everything not yet delivered on it, in both directions, is gone; each end notices after a short
  detection delay;
- duplicates: a *duplicate* fault delivers some messages twice (a retransmitting proxy); hellos and
  welcomes are never duplicated, since the session layer refuses a second hello before the core;
- a *partition* resets the link's connection and refuses new ones until it heals;
- a *delay* fault adds latency on a link for a while.

Bulk messages also take `nbytes / bytes_per_s` to cross, so big updates trail small control frames.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DETECT_S = 0.002  # how long an end takes to notice that its connection was reset
DUPLICATE_GAP_S = (0.001, 0.3)  # a duplicate trails its original by this much (uniform)


@dataclass(frozen=True)
class LinkProfile:
    latency_s: float  # one-way base latency
    jitter_s: float  # uniform extra latency in [0, jitter_s)
    bytes_per_s: float  # bulk transfer rate

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and self.jitter_s >= 0 and self.bytes_per_s > 0):
            raise ValueError(f"link profile needs latency, jitter >= 0 and a positive rate, got {self}")


@dataclass(frozen=True)
class Message:
    kind: str  # hello | progress | push | init | local_state | welcome | update | error | marker
    body: Any
    nbytes: int
    bulk: bool = False
    barrier: bool = False  # nothing sent after it in its direction arrives before it, control included


UP, DOWN = "up", "down"  # learner -> syncer, syncer -> learner
CORE_KINDS = ("progress", "push", "init")  # what the syncer's core takes from a learner
_NEVER_DUPLICATED = ("hello", "welcome")


class Scheduler:
    """The virtual clock: `at(t, label, fn)` queues an action; `run_next()` runs the earliest."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, str, Callable[[], None]]] = []
        self._seq = 0
        self.actions_run = 0

    def at(self, t: float, label: str, fn: Callable[[], None]) -> None:
        assert t >= self.now, (t, self.now, label)
        heapq.heappush(self._queue, (t, self._seq, label, fn))
        self._seq += 1

    def after(self, dt: float, label: str, fn: Callable[[], None]) -> None:
        self.at(self.now + max(0.0, dt), label, fn)

    def next_time(self) -> float | None:
        return self._queue[0][0] if self._queue else None

    def stop_all(self) -> None:
        """Forget every queued action: the run is over."""
        self._queue.clear()

    def run_next(self) -> str:
        """Run the earliest action; returns its label (for the trace)."""
        t, _, label, fn = heapq.heappop(self._queue)
        self.now = t
        self.actions_run += 1
        fn()
        return label


@dataclass
class LinkFaults:
    """What faults currently do to one learner's link (all off when healed)."""

    extra_latency_s: float = 0.0
    drop_p: float = 0.0
    duplicate_p: float = 0.0
    reorder_s: float = 0.0  # > 0: FIFO lifted, each message delayed by up to this much
    partitioned: bool = False


@dataclass
class Connection:
    id: int
    learner: int  # the learner's index in the plan (not the syncer's learner id)
    open: bool = True
    last_due: dict[tuple[str, bool], float] = field(default_factory=dict)  # FIFO per (direction, bulk)
    welcome_due: float = 0.0  # when the latest welcome arrives: nothing sent after it arrives before
    sent_up: int = 0  # messages the syncer's core takes (progress, push, init) put on it by the learner
    ordered: bool = True  # no message on it was reordered or duplicated: a snapshot's channel is FIFO


class Network:
    """Connections between the syncer and learners, with the faults of `links`.

    `on_deliver(conn, direction, message)` and `on_reset(conn, side)` are the two ends' handlers,
    set by the world that owns the network."""

    def __init__(self, scheduler: Scheduler, rng: np.random.Generator, profiles: tuple[LinkProfile, ...]):
        self.scheduler = scheduler
        self.rng = rng
        self.profiles = profiles
        self.faults = [LinkFaults() for _ in profiles]
        self.conns: dict[int, Connection] = {}
        self._next_conn = 1
        self.syncer_up = True
        self.on_deliver: Callable[[Connection, str, Message], None] = lambda c, d, m: None
        self.on_reset: Callable[[Connection, str, str], None] = lambda c, side, why: None
        self.messages_sent = 0
        self.resets = 0

    def connect(self, learner: int) -> Connection | None:
        """A new connection for learner `learner`, or None when the syncer or the link is down."""
        if not self.syncer_up or self.faults[learner].partitioned:
            return None
        conn = Connection(self._next_conn, learner)
        self._next_conn += 1
        self.conns[conn.id] = conn
        return conn

    def send(self, conn: Connection, direction: str, message: Message) -> None:
        if not conn.open:
            return  # the sender has not noticed the reset yet; nothing leaves a dead socket
        faults = self.faults[conn.learner]
        self.messages_sent += 1
        if direction == UP and message.kind in CORE_KINDS:
            conn.sent_up += 1
        if faults.reorder_s or faults.duplicate_p:  # TCP's order (or once-only) promise lifted on it
            conn.ordered = False
        if faults.drop_p and self.rng.random() < faults.drop_p:
            self.reset(conn, f"{message.kind} lost on the wire")
            return
        due = self._due(conn, direction, message, faults)
        self.scheduler.at(
            due, f"deliver {direction} c{conn.id} {message.kind}", lambda: self._deliver(conn, direction, message)
        )
        if faults.duplicate_p and message.kind not in _NEVER_DUPLICATED and self.rng.random() < faults.duplicate_p:
            again = due + float(self.rng.uniform(*DUPLICATE_GAP_S))
            self.scheduler.at(
                again,
                f"duplicate {direction} c{conn.id} {message.kind}",
                lambda: self._deliver(conn, direction, message),
            )

    def _due(self, conn: Connection, direction: str, message: Message, faults: LinkFaults) -> float:
        profile = self.profiles[conn.learner]
        delay = profile.latency_s + faults.extra_latency_s + float(self.rng.random()) * profile.jitter_s
        if message.bulk:
            delay += message.nbytes / profile.bytes_per_s
        if faults.reorder_s:
            delay += float(self.rng.random()) * faults.reorder_s
        due = self.scheduler.now + delay
        key = (direction, message.bulk)
        if not faults.reorder_s:
            due = max(due, conn.last_due.get(key, 0.0))  # TCP: nothing overtakes within a class
            if message.bulk:
                due = max(due, conn.last_due.get((direction, False), 0.0))
        if direction == DOWN:
            due = max(due, conn.welcome_due)
            if message.kind == "welcome":
                conn.welcome_due = due
        conn.last_due[key] = max(due, conn.last_due.get(key, 0.0))
        if message.barrier:
            for k in ((direction, False), (direction, True)):
                conn.last_due[k] = max(due, conn.last_due.get(k, 0.0))
        return due

    def _deliver(self, conn: Connection, direction: str, message: Message) -> None:
        if conn.open:
            self.on_deliver(conn, direction, message)

    def reset(self, conn: Connection, why: str) -> None:
        """Break the connection: undelivered messages are lost; both ends notice a moment later."""
        if not conn.open:
            return
        conn.open = False
        self.resets += 1
        self.conns.pop(conn.id, None)
        for side in ("syncer", "learner"):
            self.scheduler.after(
                DETECT_S, f"reset c{conn.id} noticed by {side}", lambda side=side: self.on_reset(conn, side, why)
            )

    def close(self, conn: Connection, why: str) -> None:
        """The syncer's orderly close (a Drop): like the daemon, it lets the control frames already
        queued (the error that explains the close) arrive first, then breaks the connection."""
        if not conn.open:
            return
        flushed = max(self.scheduler.now, conn.last_due.get((DOWN, False), 0.0))
        self.scheduler.at(flushed, f"close c{conn.id}", lambda: self.reset(conn, why))

    def reset_learner(self, learner: int, why: str) -> None:
        for conn in [c for c in self.conns.values() if c.learner == learner]:
            self.reset(conn, why)

    def reset_all(self, why: str) -> None:
        for conn in list(self.conns.values()):
            self.reset(conn, why)

    def heal(self) -> None:
        self.faults = [LinkFaults() for _ in self.profiles]
