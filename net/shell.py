"""The one shell around the syncer core: effects routed to connections, the tables, the timers.

Every syncer (the daemon, the in-process hub, the chaos simulation) hands its events to a `Shell`,
which calls `core.syncer.handle` and carries out the effects through a `Link`, the small interface
the surrounding I/O provides: send a control message on a connection, send one fragment update to
some connections, close a connection, wake the shell at a time, write a checkpoint. The shell keeps
what every syncer needs and no protocol change should have to repeat:

- the connection and learner tables (a welcome binds a connection to its learner; a closed
  connection's learner becomes a Disconnect, once);
- the timers (an `ArmTimer` becomes a wake-up; a wake-up after `reset` is ignored, so a restarted
  syncer never sees a timer of the process before it);
- the Merged -> MergeCost feedback: after an event that merged, a MergeCost follows with what the
  merge cost (measured by the daemon, modelled by the simulations);
- the delta broadcast's table `sent[conn][p]`, the version of fragment p last sent on a connection:
  a connection that was sent the version a new one's delta applies onto gets the delta, any other
  (joining, rejoining, after a restart) the published copy whole (docs/protocol.md, "Delta broadcast").

No socket, no asyncio, no clock: `now` comes with each call. Nested calls (a link that reports a
closed connection while effects are being carried out) are queued and handled after the current
event's effects, so the core always sees one event at a time, in one order.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from typing import Protocol

import numpy as np

from ddiloco.core import syncer as core
from ddiloco.core.events import (
    ArmTimer,
    Disconnect,
    Drop,
    Effect,
    Event,
    Log,
    MergeCost,
    Merged,
    SendError,
    SendUpdate,
    SendWelcome,
    TimerFired,
    WriteCheckpoint,
)

__all__ = ["Control", "Link", "Shell", "no_cost"]

Control = SendWelcome | SendError  # the effects that go out as one control message
Observer = Callable[[Event, list[Effect], core.SyncerState, float], None]
Preparer = Callable[[Event, float], None]
NESTED_EVENTS_MAX = 1024  # events queued by a link while one is carried out; more is a loop (a bug)


class Link(Protocol):
    """What a shell needs of the I/O around it. Every method is called between two core steps."""

    def send(self, conn: int, effect: Control) -> None:
        """Queue the message of a control effect on connection `conn`."""

    def send_update(
        self,
        conns: tuple[int, ...],
        fragment: int,
        codec: str,
        version: int,
        values: np.ndarray,
        base_version: int = -1,
        block: int = 0,
        global_step: int = 0,
    ) -> None:
        """Send a fragment update to these connections: the published copy whole (base_version -1,
        fp32 values) or the delta onto the published copy of `base_version` (its codec body, block
        0 for fp32 and bf16), with the syncer's global step now. `values` is a view into the core
        state, valid until the next core step: copy it (into frames) before returning. The updates of
        one connection must arrive in the order they are sent, none left out (a delta is never
        replaced by a newer one)."""

    def close(self, conn: int, reason: str) -> None:
        """Close the connection; report it with `Shell.closed` once it is gone."""

    def wake(self, at: float, token: int) -> None:
        """Call `Shell.fire(token, now)` at time `at` (the syncer's clock)."""

    def write_checkpoint(self, state: core.SyncerState, reason: str) -> None:
        """Keep the state durably (or in memory, for a simulation)."""

    def merged(self, effect: Merged) -> None:
        """A fragment got a new version (metrics, records)."""

    def log(self, effect: Log) -> None: ...


def no_cost(spent_s: float) -> tuple[float, float]:
    """The daemon's merge cost: what the core step measurably took, reported at once."""
    return spent_s, 0.0


class Shell:
    """The core's state, the connection and learner tables, the timers; effects routed through a Link.

    `merge_cost(spent_s) -> (seconds, delay_s)`: what MergeCost reports after an event that merged and
    how long after that event it arrives (a simulation lets its modelled merge time pass; the daemon's
    has passed already). `stopwatch` measures the core step (the daemon's is `time.perf_counter`).
    `before(event, now)` sees every event before the core does (the daemon's clock and tape);
    `observe(event, effects, state, now)` sees every step before its effects are carried out."""

    def __init__(
        self,
        state: core.SyncerState,
        link: Link,
        *,
        merge_cost: Callable[[float], tuple[float, float]] = no_cost,
        stopwatch: Callable[[], float] | None = None,
        before: Preparer | None = None,
        observe: Observer | None = None,
    ):
        self.state = state
        self.link = link
        self.merge_cost = merge_cost
        self.stopwatch = stopwatch
        self.before = before
        self.observe = observe
        self.learner_of: dict[int, int] = {}  # connection -> the learner its welcome named
        self.conn_of: dict[int, int] = {}  # learner -> its connection
        self.open: set[int] = set()
        self.sent: dict[int, dict[int, int]] = {}  # connection -> fragment -> version last sent on it
        self.core_s = 0.0  # time spent inside the core (with a stopwatch), for the bench and metrics
        self.steps = 0
        self._timers: dict[int, Event] = {}
        self._tokens = itertools.count(1)
        self._queued: deque[Event] = deque()
        self._busy = False

    # ---- connections ----------------------------------------------------------------------------

    def opened(self, conn: int) -> None:
        assert conn not in self.open, f"connection {conn} opened twice"
        self.open.add(conn)

    def learner_on(self, conn: int) -> int | None:
        return self.learner_of.get(conn)

    def closed(self, conn: int, reason: str, now: float) -> None:
        """The connection is gone: its learner (if the connection still speaks for it) disconnects."""
        self.open.discard(conn)
        self.sent.pop(conn, None)
        learner = self.learner_of.pop(conn, None)
        if learner is not None and self.conn_of.get(learner) == conn:
            del self.conn_of[learner]
            self.handle(Disconnect(learner, reason), now)

    def reset(self) -> None:
        """The syncer stops (or crashes): every connection is forgotten without a Disconnect reaching
        the core (a restarted syncer learns of its learners when they join again) and every timer
        is cancelled."""
        self.learner_of.clear()
        self.conn_of.clear()
        self.open.clear()
        self.sent.clear()
        self._timers.clear()
        self._queued.clear()

    # ---- events ---------------------------------------------------------------------------------

    def handle(self, event: Event, now: float) -> None:
        """Run the core on `event` and carry out its effects (events a link raises meanwhile follow)."""
        self._queued.append(event)
        if self._busy:
            assert len(self._queued) <= NESTED_EVENTS_MAX, (
                "events keep raising events: a loop between a link and the shell"
            )
            return
        self._busy = True
        try:
            while self._queued:
                self._step(self._queued.popleft(), now)
        finally:
            self._busy = False

    def fire(self, token: int, now: float) -> None:
        """A wake-up asked for with `Link.wake`: its event, unless cancelled by a reset."""
        event = self._timers.pop(token, None)
        if event is not None:
            self.handle(event, now)

    def _step(self, event: Event, now: float) -> None:
        if self.before is not None:
            self.before(event, now)
        started = self.stopwatch() if self.stopwatch else 0.0
        self.state, effects = core.handle(self.state, event, now)
        spent = self.stopwatch() - started if self.stopwatch else 0.0
        self.core_s += spent
        self.steps += 1
        if self.observe is not None:
            self.observe(event, effects, self.state, now)
        merged = False
        for effect in effects:
            merged |= isinstance(effect, Merged)
            self._route(effect)
        if merged:  # the merge's cost is the sync time of the grace formula (core.grace)
            seconds, delay_s = self.merge_cost(spent)
            self._wake(now + delay_s, MergeCost(seconds))

    def _wake(self, at: float, event: Event) -> None:
        token = next(self._tokens)
        self._timers[token] = event
        self.link.wake(at, token)

    # ---- effects --------------------------------------------------------------------------------

    def _route(self, effect: Effect) -> None:
        if isinstance(effect, SendWelcome):
            if effect.conn in self.open:
                self.learner_of[effect.conn] = effect.learner
                self.conn_of[effect.learner] = effect.conn
                self.link.send(effect.conn, effect)
        elif isinstance(effect, SendError):
            conn = self._conn(effect.learner, getattr(effect, "conn", None))
            if conn is not None:
                self.link.send(conn, effect)
        elif isinstance(effect, SendUpdate):
            self._send_update(effect)
        elif isinstance(effect, ArmTimer):
            self._wake(effect.at, TimerFired(effect.fragment, effect.round))
        elif isinstance(effect, Drop):  # by learner when it has one: its connection may be a newer one
            conn = self.conn_of.get(effect.learner) if effect.learner is not None else self._conn(None, effect.conn)
            if conn is not None:
                self.link.close(conn, effect.reason)
        elif isinstance(effect, WriteCheckpoint):
            self.link.write_checkpoint(self.state, effect.reason)
        elif isinstance(effect, Merged):
            self.link.merged(effect)
        else:
            assert isinstance(effect, Log), f"an effect the shell does not know: {effect!r}"
            self.link.log(effect)

    def _send_update(self, effect: SendUpdate) -> None:
        """The delta to the connections last sent its base version, the published copy whole to the
        others: encoded at most once each per effect, and only when some connection needs it (the
        whole copy is a view of the published array: the link copies it into frames once for all)."""
        p = effect.fragment
        conns = tuple(self.conn_of[lid] for lid in effect.learners if lid in self.conn_of)
        if not conns:
            return
        current = self.state.fragments[p].version
        chained = effect.base_version >= 0 and effect.version == current
        deltas = tuple(c for c in conns if chained and self.sent.get(c, {}).get(p) == effect.base_version)
        wholes = tuple(c for c in conns if c not in deltas)
        for group, whole in ((deltas, False), (wholes, True)):
            if not group:
                continue
            codec, version, base_version, block, values = core.update_values(self.state, p, whole)
            self.link.send_update(
                group,
                p,
                codec,
                version,
                values,
                base_version=base_version,
                block=block,
                global_step=self.state.global_step,
            )
            for c in group:
                self.sent.setdefault(c, {})[p] = version

    def _conn(self, learner: int | None, conn: int | None) -> int | None:
        """The connection an effect names: by connection id before a learner id exists, else by learner."""
        if conn is not None:
            return conn if conn in self.open else None
        return self.conn_of.get(learner) if learner is not None else None
