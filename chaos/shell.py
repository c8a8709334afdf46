"""The simulated daemon: the real core in the daemon's own shell (`net.shell`), over a simulated network.

Messages from a connection become core events (a hello is a Join keyed by the connection; anything
else carries the learner id the welcome gave that connection); the shell runs the core and carries
out its effects through this link: welcomes, requests and errors go out as control messages; an
update sends the syncer's published copy (what a learner reconstructs from the delta broadcast) to
every addressed learner still connected, the network carrying the delta's bytes; timers fire on the virtual clock (a restart cancels them); a Drop closes the
connection after its queued control messages; WriteCheckpoint keeps the checkpoint bytes in memory;
after an event that merged, a MergeCost event follows with the (simulated) time the merge took; a
reset connection becomes a Disconnect of its learner.

A restart is the daemon's `stop` then `--resume`: every connection closes (no Disconnect reaches
the core, as in `stop`), a last checkpoint is taken, and after a downtime a new process restores it.
A crash is the same without the last checkpoint: the new process restores the last periodic one
(or starts empty if there is none).
"""

from __future__ import annotations

from collections.abc import Callable
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
from ddiloco.net.shell import Control, Shell

MERGE_COST_S = (0.0005, 0.005)  # the simulated time one merge takes, drawn uniformly


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
        self.shell = Shell(syncer.new_state(config), self, merge_cost=self._merge_cost, observe=self._observe)
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
    ) -> None:
        # The view is valid only until the next handle(): copy it, as the daemon copies it into frames.
        # A simulated learner gets what a real one reconstructs, the published copy (a delta applied
        # onto the copy before it, core.publish, gives exactly its bits); the network carries the
        # delta's bytes.
        wire_bytes = values.nbytes
        values = np.array(self.state.fragments[fragment].published, dtype=np.float32)
        self.checker.sent(fragment, version, name, values, self.scheduler.now)
        body = {"fragment": fragment, "version": version, "values": values}
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
