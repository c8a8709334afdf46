"""A simulated learner: a few small numpy tensors, a deterministic inner step, and the sync hook.

It behaves like `learner/sync.py` on top of `net/client.py`, message for message:

- the *process* waits for its first welcome before it trains (the hook's constructor blocks); a
  restarted process starts from fresh random weights (scaled by FRESH_SCALE, so that if they ever
  leaked into the global state the parameter bound would show it at once);
- each step it trains (pulls its tensors toward its own target, plus noise: a deterministic function
  of its seed), counts steps and tokens for every fragment, takes what arrived, handles a new
  welcome (a rejoin resets versions, bases and counters; a request for the initial parameters sends
  them), pushes the int4 outer gradient `base - theta` of each fragment due at its step (step mod H
  == t_p, the welcome's schedule; protocol 2: nobody asks) once it holds every fragment, applies
  newer fragment versions (overwrite), and reports progress;
- the *client* keeps one connection, says hello, holds what the hook sends until the welcome
  arrives (progress coalesced beyond PROGRESS_QUEUED_MAX, pushes refused beyond PUSHES_QUEUED_MAX)
  and reconnects with jittered exponential backoff; like the real client, the backoff only grows
  (it is reset only by a clean shutdown);
- one deliberate difference, `client_as_is=False`: what the hook produced before it saw the latest
  welcome (progress and pushes of the previous session, queued while disconnected or racing the
  welcome) is dropped instead of being sent under the new learner id. The client in net/client.py
  sends it, and the syncer then takes the old session's versions for the new one: it turns a learner
  live that holds nothing yet and books the old tokens twice. `client_as_is=True` reproduces that
  (docs/chaos-sim.md);
- a second deliberate difference, `local_state_as_is=False`: a local state is a barrier on its
  connection, so that nothing the learner sends after its cut arrives before it. net/client.py sends
  queued progress (control) ahead of queued bulk frames, a local state's included, so a report of a
  later step can reach the syncer before the state and be recorded as in flight: a message from
  after the learner's cut in the snapshot. `local_state_as_is=True` reproduces that;
- consistent snapshots (net.snapshot): the client holds back what arrives after a marker until the
  training loop has taken the marker; at the end of that step the hook sends its local state (its
  learner id, step, versions, counters, and how many messages it has put on the connection) behind
  everything it sent before, as learner/sync.py does;
- faults: `crash` (the process dies, its connection resets), `restart` (a new process), `pause`
  (the process is stopped: it neither trains nor reads, the socket stays up).
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import orjson

from ddiloco.chaos.network import (
    UP,
    Connection,
    LinkProfile,
    Message,
    Network,
    Scheduler,
)
from ddiloco.core import codec
from ddiloco.core.events import Push
from ddiloco.core.layout import Layout, TensorSpec, layout_from_description
from ddiloco.core.syncer import PROTOCOL_VERSION

FRESH_SCALE = 1000.0  # a restarted learner's weights are this large: global values never come near
INIT_SCALE = 0.5  # the first process of every learner starts from small weights
# net/client.py ClientConfig defaults
RECONNECT_S_MIN = 0.05
RECONNECT_S_MAX = 5.0
PROGRESS_QUEUED_MAX = 64
PUSHES_QUEUED_MAX = 2
CONTROL_BYTES = 64  # size of a small control message on the wire


@dataclass(frozen=True)
class LearnerProfile:
    step_s: float  # mean time of one inner step
    step_jitter: float  # each step takes step_s * (1 +- jitter)
    tokens_min: int
    tokens_max: int
    pull: float  # share of the way to its target each inner step covers
    noise: float  # standard deviation of the inner step's noise
    link: LinkProfile
    codec: str = "int4"

    def __post_init__(self) -> None:
        if not (self.step_s > 0 and 0 <= self.step_jitter < 1 and 0 < self.tokens_min <= self.tokens_max):
            raise ValueError(f"bad learner profile {self}")
        if not (0 < self.pull < 1 and self.noise >= 0):
            raise ValueError(f"pull must lie in (0, 1) and noise be >= 0, got {self.pull}, {self.noise}")


@dataclass
class Inbox:
    """What the client has received and the hook not yet taken (net/client.py `Inbox`)."""

    welcome: dict | None = None
    welcomes: int = 0
    session: int | None = None  # the learner id of the latest welcome
    updates: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)
    markers: list = field(default_factory=list)  # snapshot ids the training loop has not taken yet
    held: list = field(default_factory=list)  # updates that arrived after a marker, for the step after it


class SimLearner:
    def __init__(
        self,
        index: int,
        profile: LearnerProfile,
        tensors: tuple[TensorSpec, ...],
        seed: int,
        scheduler: Scheduler,
        network: Network,
        client_as_is: bool = False,
        local_state_as_is: bool = False,
    ):
        self.index = index
        self.profile = profile
        self.tensors = tensors
        self.seed = seed
        self.scheduler = scheduler
        self.network = network
        self.client_as_is = client_as_is
        self.local_state_as_is = local_state_as_is
        self.incarnation = -1
        self.alive = False
        self.paused_until = 0.0
        self.tokens_trained = 0  # over every process, for the ledger's outside check
        self.counted: dict[tuple[int, int, int], int] = {}  # (learner id, fragment, version) -> most tokens counted
        self.steps_trained = 0
        self.refused: str | None = None
        self.quiet = False  # the liveness check's quiescence: keep stepping, stop reporting progress

    # ---- process life ---------------------------------------------------------------------------

    def start(self) -> None:
        """A new process: fresh weights (small for the first one), a fresh client, connect at once."""
        self.incarnation += 1
        self.alive = True
        self.paused_until = 0.0  # a pause stops a process; a new one runs
        self.rng = np.random.default_rng([self.seed, self.index, self.incarnation])
        scale = INIT_SCALE if self.incarnation == 0 else FRESH_SCALE
        self.params = {t.path: (self.rng.standard_normal(t.size) * scale).astype(np.float32) for t in self.tensors}
        target_rng = np.random.default_rng([self.seed, self.index, 1 << 20])  # its data: the same every process
        self.target = {t.path: target_rng.uniform(-1, 1, t.size).astype(np.float32) for t in self.tensors}
        self.started = False  # trains only after its first welcome
        self.layout: Layout | None = None
        self.learner_id: int | None = None
        self.welcomes_seen = 0
        self.inbox = Inbox()
        self.conn: Connection | None = None
        self.welcomed = False
        self.out_progress: deque = deque(maxlen=PROGRESS_QUEUED_MAX)
        self.out_bulk: deque = deque()
        self.backoff_s = RECONNECT_S_MIN
        self._connect()

    def crash(self) -> None:
        if not self.alive:
            return
        self.alive = False
        if self.conn is not None:
            self.network.reset(self.conn, f"learner {self.index} crashed")
            self.conn = None

    def pause(self, until: float) -> None:
        self.paused_until = max(self.paused_until, until)

    def holds_all(self) -> bool:
        """Whether the hook holds a received version of every fragment in the client's session."""
        caught_up = self.started and self.welcomes_seen == self.inbox.welcomes
        return caught_up and all(v >= 0 for v in self.versions)

    def _later(self, dt: float, label: str, fn) -> None:
        """Schedule `fn` for this process: skipped if the process died meanwhile, deferred while paused."""
        incarnation = self.incarnation

        def run() -> None:
            if not self.alive or self.incarnation != incarnation:
                return
            if self.scheduler.now < self.paused_until:
                self.scheduler.at(self.paused_until, label, run)
                return
            fn()

        self.scheduler.after(dt, label, run)

    # ---- the client -----------------------------------------------------------------------------

    def _connect(self) -> None:
        conn = self.network.connect(self.index)
        if conn is None:
            self._retry()
            return
        self.conn, self.welcomed = conn, False
        hello = {"name": f"sim-{self.index}", "tensors": self.tensors, "protocol": PROTOCOL_VERSION}
        self.network.send(conn, UP, Message("hello", hello, CONTROL_BYTES + 32 * len(self.tensors)))

    def _retry(self) -> None:
        delay = self.backoff_s * (0.5 + float(self.rng.random()))
        self.backoff_s = min(self.backoff_s * 2, RECONNECT_S_MAX)
        self._later(delay, f"learner {self.index} reconnects", self._connect)

    def lost(self, conn: Connection) -> None:
        """The client noticed that its connection is gone."""
        if conn is not self.conn:
            return
        self._later(0.0, f"learner {self.index} notices the reset", lambda: self._on_lost(conn))

    def _on_lost(self, conn: Connection) -> None:
        if conn is self.conn and self.refused is None:
            self.conn, self.welcomed = None, False
            self._retry()

    def receive(self, conn: Connection, message: Message) -> None:
        self._later(0.0, f"learner {self.index} reads {message.kind}", lambda: self._on_message(conn, message))

    def _on_message(self, conn: Connection, message: Message) -> None:
        if conn is not self.conn:
            return
        body = message.body
        if message.kind == "welcome":
            self.inbox.welcome, self.inbox.session = body, body["learner"]
            self.inbox.welcomes += 1
            self.welcomed = True
            self._flush()
            if not self.started:
                self._begin(body)
        elif message.kind == "update":
            if self.inbox.markers:  # after a marker: not part of the state the snapshot records
                self.inbox.held.append(body)
            else:
                self._arrived(body)
        elif message.kind == "marker":
            self.inbox.markers.append(body["snapshot"])
        elif message.kind == "error":
            self.inbox.errors.append(body)
            if body["fatal"]:
                self.refused = f"{body['code']}: {body['text']}"
                self.network.reset(conn, "refused")
                self.conn = None

    def _arrived(self, update: dict) -> None:
        # As net/client.py: a whole copy supersedes whatever arrived before it, even a newer version
        # (a syncer restarted from an older checkpoint: what the learner holds beyond it is lost).
        current = self.inbox.updates.get(update["fragment"])
        if current is None or update["whole"] or update["version"] >= current["version"]:
            self.inbox.updates[update["fragment"]] = update

    def _send(self, message: Message) -> None:
        """The hook hands a message to the client, tagged with the session the hook is in."""
        item = (self.welcomes_seen, message)
        if self.conn is not None and self.welcomed:
            self._put(item)
        elif message.kind == "progress":
            self.out_progress.append(item)
        elif message.kind in ("init", "local_state") or len(self.out_bulk) < PUSHES_QUEUED_MAX:
            self.out_bulk.append(item)

    def _flush(self) -> None:
        """After a welcome: what the hook sent meanwhile goes out, progress first (net/client.py)."""
        while self.out_progress:
            self._put(self.out_progress.popleft())
        while self.out_bulk:
            self._put(self.out_bulk.popleft())

    def _put(self, item: tuple[int, Message]) -> None:
        session, message = item
        if session == self.inbox.welcomes or self.client_as_is:
            self.network.send(self.conn, UP, message)

    # ---- the sync hook (learner/sync.py) --------------------------------------------------------

    def _begin(self, welcome: dict) -> None:
        self.started = True
        self.layout = layout_from_description(welcome["layout"])
        self.step_count = welcome["global_step"]
        self.welcomes_seen = 1
        self._reset_session(welcome)
        self._later(self._step_time(), f"learner {self.index} steps", self._step)

    def _reset_session(self, welcome: dict) -> None:
        p = self.layout.num_fragments
        self.learner_id = welcome["learner"]
        self.period, self.offsets = welcome["period"], tuple(welcome["offsets"])
        self.versions = [-1] * p
        self.base: list[np.ndarray | None] = [None] * p
        self.steps = [0] * p
        self.tokens = [0] * p
        self.deferred: dict = {}  # versions arrived with a push of their fragment: applied a step later
        if welcome["needs_init"]:
            for q in range(p):
                values = self._gather(q)
                self._send(
                    Message(
                        "init", {"fragment": q, "payload": codec.encode(values, "fp32")}, 4 * values.size, bulk=True
                    )
                )
                self.base[q], self.versions[q] = values, 0

    def _step_time(self) -> float:
        jitter = self.profile.step_jitter * (2 * float(self.rng.random()) - 1)
        return self.profile.step_s * (1 + jitter)

    def _step(self) -> None:
        tokens = self._train()
        self.step_count += 1
        for q in range(len(self.steps)):
            self.steps[q] += 1
            self.tokens[q] += tokens
            self.counted[(self.learner_id, q, self.versions[q])] = self.tokens[q]
        updates, welcomes = self.inbox.updates, self.inbox.welcomes
        self.inbox.updates, self.inbox.errors = {}, []
        due = all(v >= 0 for v in self.versions)
        if welcomes != self.welcomes_seen:
            self.welcomes_seen = welcomes
            self._reset_session(self.inbox.welcome)
            due = False  # a new session pushes from its next due step
        pushed = set()
        if due:  # before arrived versions overwrite the fragments, as learner/sync.py copies them
            for q, t in enumerate(self.offsets):
                if self.step_count % self.period == t:
                    self._push(q)
                    pushed.add(q)
        # As learner/sync.py: a version that arrives with a push of its fragment waits a step, so
        # that the progress report of the new version follows the push of the old one.
        arrived, self.deferred = self.deferred, {}
        for q, update in updates.items():
            if q in pushed and q not in arrived:
                self.deferred[q] = update
            elif q not in arrived or update["version"] >= arrived[q]["version"]:
                arrived[q] = update
        for q, update in sorted(arrived.items()):
            self._apply(q, update)
        if not self.quiet:
            progress = {
                "step": self.step_count,
                "versions": tuple(self.versions),
                "steps": tuple(self.steps),
                "tokens": tuple(self.tokens),
            }
            self._send(Message("progress", progress, CONTROL_BYTES + 24 * len(self.steps)))
        self._answer_markers()
        self._later(self._step_time(), f"learner {self.index} steps", self._step)

    def _answer_markers(self) -> None:
        """The step boundary is the learner's cut: its local state goes out behind what it sent, and
        what arrived after the marker is the next step's."""
        markers, self.inbox.markers = self.inbox.markers, []
        for snapshot in markers:
            state = {
                "learner": self.learner_id,
                "step": self.step_count,
                "versions": list(self.versions),
                "steps": list(self.steps),
                "tokens": list(self.tokens),
                "sent": self.conn.sent_up if self.conn is not None else 0,
            }
            data = orjson.dumps(state)
            body = {"snapshot": snapshot, "data": data, "sha256": hashlib.sha256(data).hexdigest()}
            barrier = not self.local_state_as_is
            self._send(Message("local_state", body, CONTROL_BYTES + len(data), bulk=True, barrier=barrier))
        held, self.inbox.held = self.inbox.held, []
        for update in held:
            self._arrived(update)

    def _train(self) -> int:
        """One inner step: a pull toward this learner's target plus noise. Returns its tokens."""
        pull, noise = np.float32(self.profile.pull), self.profile.noise
        for t in self.tensors:
            theta = self.params[t.path]
            theta += pull * (self.target[t.path] - theta)
            if noise:
                theta += (self.rng.standard_normal(t.size) * noise).astype(np.float32)
        tokens = int(self.rng.integers(self.profile.tokens_min, self.profile.tokens_max + 1))
        self.tokens_trained += tokens
        self.steps_trained += 1
        return tokens

    def _push(self, q: int) -> None:
        # A push holds the progress since the last push of the fragment (as learner/sync.py): the
        # next one starts from here, until a new version resets the base.
        theta = self._gather(q)
        delta, self.base[q] = self.base[q] - theta, theta
        payload = codec.encode(delta, self.profile.codec, self.layout.block)
        # The core's push value, made once, as learner.sync makes it; the network charges the codec's bytes.
        push = Push(
            self.learner_id, q, self.step_count, self.versions[q], self.steps[q], self.tokens[q], codec.parse(payload)
        )
        self._send(Message("push", push, len(payload), bulk=True))

    def _apply(self, q: int, update: dict) -> None:
        if update["version"] <= self.versions[q]:
            return
        values = update["values"]
        self._scatter(q, values)
        self.base[q], self.versions[q] = values, update["version"]
        self.steps[q], self.tokens[q] = 0, 0

    def _gather(self, q: int) -> np.ndarray:
        spec = self.layout.fragments[q]
        out = np.zeros(spec.padded_size, dtype=np.float32)
        for seg in spec.segments:
            out[seg.offset : seg.stop] = self.params[seg.tensor.path]
        return out

    def _scatter(self, q: int, values: np.ndarray) -> None:
        for seg in self.layout.fragments[q].segments:
            self.params[seg.tensor.path] = values[seg.offset : seg.stop].astype(np.float32, copy=True)
