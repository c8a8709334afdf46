"""The simulated daemon: the real core behind a shell that does what `net/server.py` does.

Messages from a connection become core events (a hello is a Join keyed by the connection; anything
else carries the learner id the welcome gave that connection); `syncer.handle` runs; the effects are
carried out as the daemon does: welcomes, requests and errors go out as control messages; an update
sends `syncer.update_values` (bf16 decoded as the learner would) to every addressed learner still
connected; timers are armed on the virtual clock and never cancelled; a Drop closes the connection
after its queued control messages; WriteCheckpoint keeps the checkpoint bytes in memory; after an
event that merged, a MergeCost event follows with the (simulated) time the merge took; a reset
connection becomes a Disconnect of its learner.

A restart is the daemon's `stop` then `--resume`: every connection closes (no Disconnect reaches
the core, as in `stop`), a last checkpoint is taken, and after a downtime a new process restores it.
A crash is the same without the last checkpoint: the new process restores the last periodic one
(or starts empty if there is none).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from ddiloco import kernels
from ddiloco.core import checkpoint, codec, syncer
from ddiloco.chaos.invariants import Checker
from ddiloco.chaos.learner import CONTROL_BYTES
from ddiloco.chaos.network import DOWN, Connection, Message, Network, Scheduler
from ddiloco.core.config import SyncerConfig
from ddiloco.core.events import (
    ArmTimer,
    Disconnect,
    Drop,
    Event,
    InitFragment,
    Join,
    Log,
    MergeCost,
    Merged,
    Progress,
    Push,
    SendError,
    SendRequest,
    SendUpdate,
    SendWelcome,
    TimerFired,
    WriteCheckpoint,
)

MERGE_COST_S = (0.0005, 0.005)  # the simulated time one merge takes, drawn uniformly


class SimSyncer:
    def __init__(self, config: SyncerConfig, scheduler: Scheduler, network: Network, rng: np.random.Generator,
                 checker: Checker, trace: Callable[[str], None]):
        self.config = config
        self.scheduler = scheduler
        self.network = network
        self.rng = rng
        self.checker = checker
        self.trace = trace
        self.state = syncer.new_state(config)
        self.incarnation = 0
        self.up = True
        self.learner_of: dict[int, int] = {}  # connection id -> learner id
        self.conn_of: dict[int, Connection] = {}  # learner id -> connection
        self.checkpoint: bytes | None = None
        self.events = 0
        self.checkpoints = 0
        self.restarts = 0

    # ---- messages in ----------------------------------------------------------------------------

    def receive(self, conn: Connection, message: Message) -> None:
        if not self.up:
            return
        event = self._event_for(conn, message)
        if event is not None:
            self.handle(event)

    def _event_for(self, conn: Connection, message: Message) -> Event | None:
        body = message.body
        if message.kind == "hello":
            return Join(conn=conn.id, name=body["name"], tensors=body["tensors"], protocol=body["protocol"])
        learner = self.learner_of.get(conn.id)
        assert learner is not None, f"{message.kind} before the welcome on connection {conn.id}: the learner broke the protocol"
        if message.kind == "progress":
            return Progress(learner=learner, step=body["step"], versions=body["versions"], steps=body["steps"], tokens=body["tokens"])
        expected = self.state.layout.fragments[body["fragment"]].padded_size
        payload = codec.parse(body["payload"], elements=expected)
        if message.kind == "init":
            return InitFragment(learner=learner, fragment=body["fragment"], payload=payload)
        assert message.kind == "push", message.kind
        return Push(learner=learner, fragment=body["fragment"], round=body["round"], base_version=body["base_version"],
                    steps=body["steps"], tokens=body["tokens"], payload=payload)

    def lost(self, conn: Connection, why: str) -> None:
        """The daemon noticed a connection closing: its learner is gone."""
        learner = self.learner_of.pop(conn.id, None)
        if learner is not None and self.conn_of.get(learner) is conn:
            del self.conn_of[learner]
            self.handle(Disconnect(learner=learner, reason=why))

    def handle(self, event: Event) -> None:
        now = self.scheduler.now
        self.state, effects = syncer.handle(self.state, event, now)
        self.events += 1
        self.trace(f"{now:.6f} core {_describe(event)} -> {' '.join(_describe(e) for e in effects if not isinstance(e, Log))}")
        self.checker.after_event(self.state, event, effects, now)
        merged = False
        for effect in effects:
            merged |= isinstance(effect, Merged)
            self._carry_out(effect)
        if merged:
            cost = float(self.rng.uniform(*MERGE_COST_S))
            self._later(cost, "merge cost", lambda: self.handle(MergeCost(seconds=cost)))

    # ---- effects out ----------------------------------------------------------------------------

    def _carry_out(self, effect) -> None:
        if isinstance(effect, SendWelcome):
            conn = self.network.conns.get(effect.conn)
            if conn is not None:
                self.learner_of[conn.id] = effect.learner
                self.conn_of[effect.learner] = conn
                body = {"learner": effect.learner, "layout": effect.layout, "versions": effect.versions,
                        "global_step": effect.global_step, "needs_init": effect.needs_init}
                self.network.send(conn, DOWN, Message("welcome", body, CONTROL_BYTES + 256))
        elif isinstance(effect, SendRequest):
            body = {"fragment": effect.fragment, "round": effect.round, "base_version": effect.base_version}
            self._send(effect.learner, Message("request", body, CONTROL_BYTES))
        elif isinstance(effect, SendError):
            body = {"code": effect.code, "text": effect.text, "fatal": effect.fatal}
            conn = self.network.conns.get(effect.conn) if effect.conn is not None else self.conn_of.get(effect.learner)
            if conn is not None:
                self.network.send(conn, DOWN, Message("error", body, CONTROL_BYTES + len(effect.text)))
        elif isinstance(effect, SendUpdate):
            self._send_update(effect)
        elif isinstance(effect, ArmTimer):
            fired = TimerFired(fragment=effect.fragment, round=effect.round)
            self._later(effect.at - self.scheduler.now, "timer", lambda: self.handle(fired))
        elif isinstance(effect, Drop):
            conn = self.conn_of.get(effect.learner) if effect.learner is not None else self.network.conns.get(effect.conn)
            if conn is not None:
                self.network.close(conn, effect.reason)
        elif isinstance(effect, WriteCheckpoint):
            self._keep_checkpoint()

    def _send(self, learner: int, message: Message) -> None:
        conn = self.conn_of.get(learner)
        if conn is not None:
            self.network.send(conn, DOWN, message)

    def _send_update(self, effect: SendUpdate) -> None:
        name, version, values = syncer.update_values(self.state, effect.fragment)
        # The view is valid only until the next handle(): copy it, as the daemon copies it into frames.
        wire_bytes = values.nbytes
        values = kernels.from_bf16(values) if name == "bf16" else np.array(values, dtype=np.float32)
        self.checker.sent(effect.fragment, version, name, values, self.scheduler.now)
        body = {"fragment": effect.fragment, "version": version, "values": values}
        for learner in effect.learners:
            self._send(learner, Message("update", body, wire_bytes, bulk=True))

    def _later(self, dt: float, label: str, fn) -> None:
        incarnation = self.incarnation

        def run() -> None:
            if self.up and self.incarnation == incarnation:
                fn()

        self.scheduler.after(dt, label, run)

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
        self.incarnation += 1
        self.learner_of.clear()
        self.conn_of.clear()
        self.network.reset_all("syncer shutting down")
        how = "crashed" if crash else "stopped"
        self.trace(f"{self.scheduler.now:.6f} syncer {how} (checkpoint: {'kept' if self.checkpoint else 'none'})")

    def resume(self) -> None:
        """A new daemon process with `--resume`: the state restored from the last checkpoint."""
        if self.up:
            return
        self.state = checkpoint.restore(self.checkpoint) if self.checkpoint is not None else syncer.new_state(self.config)
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
