"""The simulated daemon: the real core in the daemon's own shell (`net.shell`), over a simulated network.

Messages from a connection become core events (a hello is a Join keyed by the connection; anything
else carries the learner id the welcome gave that connection); the shell runs the core and carries
out its effects through this link: welcomes, requests and errors go out as control messages; an
update sends the syncer's published copy (what a learner reconstructs from the delta broadcast) to
every addressed learner still connected, the network carrying the delta's bytes; timers fire on the virtual clock (a restart cancels them); a Drop closes the
connection after its queued control messages; WriteCheckpoint keeps the checkpoint bytes in memory;
after an event that merged, a MergeCost event follows with the (simulated) time the merge took; a
reset connection becomes a Disconnect of its learner.

A consistent snapshot runs the daemon's own protocol, `net.snapshot.Taker`, with its files kept in
memory: the cut between two core events, a marker (a control message) to every connected learner,
every core event of a channel recorded until that learner's local state arrives, the learners that
do not answer within the wait left out. The checker is shown the cut and every snapshot completed.

A restart is the daemon's `stop` then `--resume`: every connection closes (no Disconnect reaches
the core, as in `stop`), a last checkpoint is taken, and after a downtime a new process restores it;
a snapshot being taken is abandoned. A crash is the same without the last checkpoint: the new
process restores the last periodic one (or starts empty if there is none).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from ddiloco.chaos.invariants import Checker
from ddiloco.chaos.learner import CONTROL_BYTES
from ddiloco.chaos.network import DOWN, Connection, Message, Network, Scheduler
from ddiloco.core import checkpoint, codec, syncer
from ddiloco.core.config import SyncerConfig
from ddiloco.core.events import (
    Effect,
    Event,
    InitFragment,
    Join,
    Log,
    Merged,
    Progress,
    Push,
    SendError,
    SendWelcome,
)
from ddiloco.net import snapshot as snapshots
from ddiloco.net.shell import Control, Shell

MERGE_COST_S = (0.0005, 0.005)  # the simulated time one merge takes, drawn uniformly
SNAPSHOT_WAIT_S = 2.0  # how long a snapshot waits for the learners' local states (virtual seconds)


class SnapshotMemory:
    """A `net.snapshot.SnapshotStore` in memory: the open snapshot's files, then the last complete one."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.files: dict[str, bytes] = {}
        self.complete: dict[str, bytes] = {}  # the last committed snapshot's files, its manifest included

    def open(self, name: str) -> None:
        self.name, self.files = name, {}

    def put(self, name: str, parts: Sequence[bytes | bytearray | memoryview]) -> None:
        assert self.name is not None, "no snapshot is open"
        self.files[name] = b"".join(bytes(p) for p in parts)

    def commit(self, manifest: bytes) -> str:
        self.complete = {**self.files, snapshots.MANIFEST: manifest}
        name, self.name, self.files = self.name, None, {}
        return name

    def abandon(self) -> None:
        self.name, self.files = None, {}


class SimSyncer:
    """The simulated daemon: `net.shell.Shell` around the real core, this class its link."""

    def __init__(
        self,
        config: SyncerConfig,
        scheduler: Scheduler,
        network: Network,
        rng: np.random.Generator,
        checker: Checker,
        trace: Callable[[str], None],
    ):
        self.config = config
        self.scheduler = scheduler
        self.network = network
        self.rng = rng
        self.checker = checker
        self.trace = trace
        self.shell = Shell(
            syncer.new_state(config), self, merge_cost=self._merge_cost, before=self._before, observe=self._observe
        )
        self.snapshot_files = SnapshotMemory()
        self.snapshots = snapshots.Taker(self.snapshot_files)
        self.snapshots_taken = 0
        self.up = True
        self._seen: dict[int, Connection] = {}  # connection id -> connection, while the shell holds it open
        self.checkpoint: bytes | None = None
        self.checkpoints = 0
        self.restarts = 0

    @property
    def state(self) -> syncer.SyncerState:
        return self.shell.state

    @property
    def events(self) -> int:
        return self.shell.steps

    def connection_of(self, learner: int) -> Connection | None:
        """The connection the syncer knows learner `learner` by (its reset may not be noticed yet)."""
        conn = self.shell.conn_of.get(learner)
        return self._seen.get(conn) if conn is not None else None

    # ---- messages in ----------------------------------------------------------------------------

    def receive(self, conn: Connection, message: Message) -> None:
        if not self.up:
            return
        if conn.id not in self._seen:
            self._seen[conn.id] = conn
            self.shell.opened(conn.id)
        if message.kind == "local_state":  # the snapshot's, not the core's (as net.server does)
            self._local_state(conn, message.body)
            return
        event = self._event_for(conn, message)
        if event is not None:
            self.handle(event)

    def _event_for(self, conn: Connection, message: Message) -> Event | None:
        body = message.body
        if message.kind == "hello":
            return Join(conn=conn.id, name=body["name"], tensors=body["tensors"], protocol=body["protocol"])
        learner = self.shell.learner_on(conn.id)
        assert learner is not None, (
            f"{message.kind} before the welcome on connection {conn.id}: the learner broke the protocol"
        )
        if message.kind == "progress":
            return Progress(
                learner=learner,
                step=body["step"],
                versions=body["versions"],
                steps=body["steps"],
                tokens=body["tokens"],
            )
        if message.kind == "push":
            # The learner's push value as it is, its sender the connection's learner (as net.session
            # does: a push queued in an earlier session names the old id).
            assert isinstance(body, Push), body
            assert body.payload.elements == self.state.layout.fragments[body.fragment].padded_size, (
                body.payload.elements
            )
            return replace(body, learner=learner)
        assert message.kind == "init", message.kind
        expected = self.state.layout.fragments[body["fragment"]].padded_size
        payload = codec.parse(body["payload"], elements=expected)
        return InitFragment(learner=learner, fragment=body["fragment"], payload=payload)

    def lost(self, conn: Connection, why: str) -> None:
        """The daemon noticed a connection closing: its learner is gone."""
        if self._seen.pop(conn.id, None) is not None:
            self.shell.closed(conn.id, why, self.scheduler.now)

    def handle(self, event: Event) -> None:
        self.shell.handle(event, self.scheduler.now)

    def _before(self, event: Event, now: float) -> None:
        problem = self.snapshots.record(event)  # after the cut, before the learner's local state: in flight
        assert problem is None, problem  # memory does not fail

    def _observe(self, event: Event, effects: list[Effect], state: syncer.SyncerState, now: float) -> None:
        self.trace(
            f"{now:.6f} core {_describe(event)} -> {' '.join(_describe(e) for e in effects if not isinstance(e, Log))}"
        )
        self.checker.after_event(state, event, effects, now)

    def _merge_cost(self, _spent_s: float) -> tuple[float, float]:
        cost = float(self.rng.uniform(*MERGE_COST_S))
        return cost, cost  # the merge takes that long on the virtual clock, then MergeCost reports it

    # ---- the shell's link (net.shell.Link) ------------------------------------------------------------

    def send(self, conn_id: int, effect: Control) -> None:
        conn = self.network.conns.get(conn_id)
        if conn is None:
            return
        if isinstance(effect, SendWelcome):
            body = {
                "learner": effect.learner,
                "layout": effect.layout,
                "versions": effect.versions,
                "global_step": effect.global_step,
                "needs_init": effect.needs_init,
                "period": effect.period,
                "offsets": effect.offsets,
            }
            message = Message("welcome", body, CONTROL_BYTES + 256)
        else:
            assert isinstance(effect, SendError), f"a control effect the chaos shell does not know: {effect!r}"
            body = {"code": effect.code, "text": effect.text, "fatal": effect.fatal}
            message = Message("error", body, CONTROL_BYTES + len(effect.text))
        self.network.send(conn, DOWN, message)

    def send_update(
        self,
        conns: tuple[int, ...],
        fragment: int,
        name: str,
        version: int,
        values: np.ndarray,
        base_version: int = -1,
        block: int = 0,
        global_step: int = 0,
    ) -> None:
        # The view is valid only until the next handle(): copy it, as the daemon copies it into frames.
        # A simulated learner gets what a real one reconstructs, the published copy (a delta applied
        # onto the copy before it, core.publish, gives exactly its bits); the network carries the
        # delta's bytes.
        wire_bytes = values.nbytes
        values = np.array(self.state.fragments[fragment].published, dtype=np.float32)
        self.checker.sent(fragment, version, name, values, self.scheduler.now)
        # No global step: the simulated learners keep their own step count (they do not move up to it).
        body = {"fragment": fragment, "version": version, "values": values, "whole": base_version < 0}
        for conn_id in conns:
            conn = self.network.conns.get(conn_id)
            if conn is not None:
                self.network.send(conn, DOWN, Message("update", body, wire_bytes, bulk=True))

    def close(self, conn_id: int, reason: str) -> None:
        conn = self.network.conns.get(conn_id)
        if conn is not None:
            self.network.close(conn, reason)

    def wake(self, at: float, token: int) -> None:
        self.scheduler.after(at - self.scheduler.now, "wake", lambda: self.shell.fire(token, self.scheduler.now))

    def write_checkpoint(self, state: syncer.SyncerState, reason: str) -> None:
        self._keep_checkpoint()

    def merged(self, effect: Merged) -> None:
        pass  # the checker reads merges off the effects it observes

    def log(self, effect: Log) -> None:
        pass  # the trace shows every effect but the logs

    def _keep_checkpoint(self) -> None:
        """The daemon writes a checkpoint; here it is kept in memory (and shown to the checker)."""
        if self.state.holds_parameters:
            self.checkpoint = b"".join(bytes(c) for c in checkpoint.to_chunks(self.state))
            self.checkpoints += 1
            self.checker.checkpointed(self.state)

    # ---- consistent snapshots (net.snapshot) ------------------------------------------------------

    def take_snapshot(self) -> None:
        """Start a snapshot between two core events, as the daemon's timer does."""
        state, now = self.state, self.scheduler.now
        if not self.up or not state.holds_parameters or self.snapshots.taking is not None:
            return
        channels = {m: self._seen[c] for m, c in sorted(self.shell.conn_of.items()) if m in state.learners}
        snap = self.snapshots.start(state, {m: state.learners[m].name for m in channels}, {}, now)
        self.checker.snapshot_started(snap.ident, state, channels, now)
        self.trace(f"{now:.6f} snapshot {snap.ident} started: markers to learners {sorted(channels)}")
        for conn in channels.values():
            self.network.send(conn, DOWN, Message("marker", {"snapshot": snap.ident}, CONTROL_BYTES))
        ident = snap.ident
        self.scheduler.after(
            SNAPSHOT_WAIT_S,
            f"snapshot {ident} wait ends",
            lambda: self._snapshot_ended(self.snapshots.timeout(ident, self.scheduler.now)),
        )

    def _local_state(self, conn: Connection, body: dict) -> None:
        learner = self.shell.learner_on(conn.id)
        if learner is None:
            return
        problem, outcome = self.snapshots.local_state(
            learner, body["snapshot"], body["data"], body["sha256"], self.scheduler.now
        )
        if problem:
            self.trace(f"{self.scheduler.now:.6f} snapshot: {problem}")
        self._snapshot_ended(outcome)

    def _snapshot_ended(self, outcome: snapshots.Outcome | None) -> None:
        if outcome is None:
            return
        assert outcome.error is None, outcome.error  # memory does not fail
        m = outcome.manifest
        self.snapshots_taken += 1
        self.trace(
            f"{self.scheduler.now:.6f} snapshot {m['snapshot']} complete: learners {sorted(int(k) for k in m['learners'])}, "
            f"{len(m['inflight'])} in flight, left out {sorted(int(k) for k in m['left_out'])}"
        )
        self.checker.snapshot_complete(m, self.snapshot_files.complete, self.scheduler.now)

    # ---- restart ---------------------------------------------------------------------------------

    def stop(self, crash: bool = False) -> None:
        """`stop()`: close every connection (no Disconnect reaches the core), a last checkpoint.
        A crash writes none: the merges since the last periodic checkpoint are lost."""
        if not self.up:
            return
        self.up = False
        self.network.syncer_up = False
        if not crash:
            self._keep_checkpoint()
        if self.snapshots.abandon() is not None:
            self.checker.snapshot_abandoned()
        self.shell.reset()  # forgets the connections and cancels the timers of this process
        self._seen.clear()
        self.network.reset_all("syncer shutting down")
        how = "crashed" if crash else "stopped"
        self.trace(f"{self.scheduler.now:.6f} syncer {how} (checkpoint: {'kept' if self.checkpoint else 'none'})")

    def resume(self) -> None:
        """A new daemon process with `--resume`: the state restored from the last checkpoint."""
        if self.up:
            return
        self.shell.state = (
            checkpoint.restore(self.checkpoint) if self.checkpoint is not None else syncer.new_state(self.config)
        )
        self.up = True
        self.network.syncer_up = True
        self.restarts += 1
        self.trace(f"{self.scheduler.now:.6f} syncer resumed: {syncer.state_hash(self.state)[:16]}")
        self.checker.after_restart(self.state, self.scheduler.now)


def _describe(item) -> str:
    """A short, deterministic text of an event or effect for the trace (no payloads)."""
    name = type(item).__name__
    fields = []
    for key in ("conn", "learner", "learners", "fragment", "round", "base_version", "version", "step", "code", "at"):
        value = getattr(item, key, None)
        if value is not None:
            fields.append(f"{key}={value:.6f}" if isinstance(value, float) else f"{key}={value}")
    return f"{name}({','.join(fields)})"
