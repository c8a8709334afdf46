"""One learner that spans several JAX processes (hosts): `MultiProcessSync`, called every step on every process.

A learner may be one JAX program over N processes (`jax.distributed`), its parameters global
`jax.Array`s sharded over every process's devices. The syncer sees one learner: process 0, the
*leader*, holds the `DilocoSync` hook and the connection; the others hold none and take part in the
collectives the hook's work needs, in the same order:

    every step       the leader peeks at what arrived (updates, a new welcome, snapshot markers),
                     asks its hook which fragments it may push (`DilocoSync.due_taking`),
                     and broadcasts a header: int32[3 + P], the step, flags, which
                     fragments it must read (one small broadcast; the only cost of a quiet step)
    fragments read   an all-gather of those fragments' leaves (`process_allgather`), so the leader
                     holds host copies of whole leaves to encode an outer gradient from
    fragments set    after the hook's step, a broadcast of which fragments it replaced, then of
                     their values; every process puts them on the old leaves' shardings

The leader's hook never sees a global array: it gets a *host view* of the parameters, a pytree with
the gathered leaves as numpy arrays and `jax.ShapeDtypeStruct` placeholders elsewhere (the hook reads
only the fragments it pushes, and writes only those that arrive). The hook's transport is wrapped
(`HeldTransport`) so that what the leader peeked at is what the hook then takes: both sides take the
same decisions from the same header.

A learner cannot shrink (`jax.distributed` has no way to drop a process): when one process dies, the
learner is dead. A collective that fails (the peer's connection closed) raises `LearnerProcessLost`;
one that does not finish within `collective_timeout_s` (a host gone without closing its sockets)
ends the process from a watchdog thread with the same message, since a thread blocked in a
collective cannot be interrupted. Either way the caller should leave at once with `os._exit`
(`exit_lost`): the interpreter's own exit would run jax.distributed's shutdown barrier, which waits
for the dead process. The syncer sees the learner leave (the leader's goodbye or its dropped
connection) and goes on with the others.

Not supported here yet: serving or adopting peer snapshots (`SyncConfig.peer` must be None, and a
(re)joining multi-process learner takes the syncer's fragments), consistent snapshots' local state
with optimizer state, and learner tapes.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.tree_util import tree_flatten, tree_unflatten

from ddiloco.core import codec
from ddiloco.core.layout import Layout, layout_from_description
from ddiloco.errors import FaultError, UserError
from ddiloco.learner.sync import DilocoSync, SyncConfig, syncer_transport
from ddiloco.learner.transport import Taken, Transport
from ddiloco.learner.tree import TreeFragments, default_is_embedding, tensor_specs
from ddiloco.net import session

__all__ = [
    "COLLECTIVE_TIMEOUT_S",
    "EXIT_LEARNER_LOST",
    "HEADER_FLAG_GATHER_ALL",
    "HEADER_FLAG_UPDATES",
    "INIT_TIMEOUT_S",
    "LAYOUT_BYTES_MAX",
    "PROCESSES_MAX",
    "HeldTransport",
    "LearnerProcessLost",
    "MultiProcessSync",
    "StepHeader",
    "exit_lost",
    "initialize_processes",
]

log = logging.getLogger("ddiloco.learner")

# The longest one of this module's collectives may take once every process has entered it. A
# healthy one takes milliseconds; the bound is for a peer that vanished without closing its sockets
# (a host that lost power), which no collective reports. Join waits longer: see `join`.
COLLECTIVE_TIMEOUT_S = 60.0
# How long jax.distributed.initialize waits for every process to reach the coordinator.
INIT_TIMEOUT_S = 300
PROCESSES_MAX = 4096  # processes of one learner
LAYOUT_BYTES_MAX = 64 << 20  # the syncer's layout description, as JSON, broadcast once at join
EXIT_LEARNER_LOST = 1  # the exit status of a process whose learner lost a process (a fault: cli's 1)

HEADER_FLAG_UPDATES = 1  # fragment versions arrived: a broadcast of which were applied follows
HEADER_FLAG_GATHER_ALL = 2  # every fragment is read (initial parameters asked again, a snapshot marker)
_HEADER_FIXED = 3  # step, flags, fragment count; then one gather flag per fragment


class LearnerProcessLost(FaultError, RuntimeError):
    """Another process of this multi-process learner died or stopped answering: the learner is dead."""

    what_to_do = (
        "a multi-process learner cannot continue without one of its processes: "
        "start all of its processes again (the learner rejoins the syncer as a new learner)"
    )


# ---- starting the processes ------------------------------------------------------------------------


def initialize_processes(
    coordinator: str, num_processes: int, process_id: int, timeout_s: float = COLLECTIVE_TIMEOUT_S
) -> None:
    """`jax.distributed.initialize` with this module's bounds: every process must reach the
    coordinator (process 0's `coordinator` HOST:PORT) within INIT_TIMEOUT_S, and a process that
    stops sending heartbeats for `timeout_s` is declared dead by the coordination service (which then
    ends the others, where none of this module's collectives noticed first). Call before any other JAX call."""
    check_process_args(coordinator, num_processes, process_id)
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=INIT_TIMEOUT_S,
        heartbeat_timeout_seconds=max(1, int(timeout_s)),
    )


def check_process_args(coordinator: str, num_processes: int, process_id: int) -> None:
    """The distributed setup's arguments, checked before any process starts waiting for the others."""
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"the coordinator must be HOST:PORT (process 0's address), got {coordinator!r}")
    if not 1 <= num_processes <= PROCESSES_MAX:
        raise UserError(f"the number of processes must lie in [1, {PROCESSES_MAX}], got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise UserError(f"the process id must lie in [0, {num_processes}), got {process_id}")


def exit_lost(exc: LearnerProcessLost) -> NoReturn:
    """Leave now, with the error on stderr: the interpreter's normal exit would wait in
    jax.distributed's shutdown barrier for the process that died (and then abort)."""
    print(f"ddiloco learner: fault: {exc}; {exc.what_to_do}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_LEARNER_LOST)


class _Watchdog:
    """Ends the process when a collective has not returned by its deadline (a blocked collective
    cannot be interrupted from Python). One thread per MultiProcessSync."""

    def __init__(self, on_expiry: Callable[[str], None]):
        self._on_expiry = on_expiry
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._what = ""
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="ddiloco-multiprocess-watchdog", daemon=True)
        self._thread.start()

    def arm(self, seconds: float, what: str) -> None:
        with self._cond:
            self._deadline, self._what = time.monotonic() + seconds, what
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._deadline = None

    def stop(self) -> None:
        with self._cond:
            self._stopped, self._deadline = True, None
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._on_expiry(self._what)
                self._deadline = None


def _expire(what: str) -> None:
    exit_lost(LearnerProcessLost(f"{what} did not finish in time: another process of this learner is gone or stuck"))


# ---- the header --------------------------------------------------------------------------------------


class StepHeader:
    """What the leader decided for one step, as the small int32 vector every process receives."""

    __slots__ = ("flags", "gather", "step")

    def __init__(self, step: int, flags: int, gather: tuple[bool, ...]):
        self.step, self.flags, self.gather = step, flags, gather

    def encode(self) -> np.ndarray:
        return np.array([self.step, self.flags, len(self.gather), *map(int, self.gather)], dtype=np.int32)

    @classmethod
    def decode(cls, vector: np.ndarray, fragments: int) -> StepHeader:
        values = [int(v) for v in np.asarray(vector).reshape(-1)]
        assert len(values) == _HEADER_FIXED + fragments and values[2] == fragments, (
            f"a step header of {len(values)} values for {fragments} fragments: the processes disagree on the layout"
        )
        return cls(values[0], values[1], tuple(v != 0 for v in values[_HEADER_FIXED:]))

    @classmethod
    def empty(cls, fragments: int) -> np.ndarray:
        """What a non-leader passes to the broadcast (only the leader's values count)."""
        return np.zeros(_HEADER_FIXED + fragments, dtype=np.int32)


# ---- the leader's transport ------------------------------------------------------------------------


class HeldTransport:
    """A `Transport` whose `take` and `take_markers` hand over what the leader already took with
    `peek`: the header is decided from exactly what the hook then acts on. Everything else passes
    through. `wait_welcome` keeps the first welcome (the leader waits for it before the hook exists)."""

    def __init__(self, inner: Transport):
        self.inner = inner
        self._welcome: session.WelcomeInfo | None = None
        self._held: Taken | None = None
        self._markers: list[int] = []

    def wait_welcome(self, timeout_s: float) -> session.WelcomeInfo:
        if self._welcome is None:
            self._welcome = self.inner.wait_welcome(timeout_s)
        return self._welcome

    def peek(self) -> tuple[Taken, list[int]]:
        """Take what arrived from the inner transport and hold it for the hook's next `take`."""
        assert self._held is None, "peeked twice without the hook taking in between"
        self._held, self._markers = self.inner.take(), self.inner.take_markers()
        return self._held, self._markers

    def take(self) -> Taken:
        assert self._held is not None, "the hook took before the leader peeked"
        held, self._held = self._held, None
        return held

    def take_markers(self) -> list[int]:
        markers, self._markers = self._markers, []
        return markers

    def progress(self, item: session.ProgressInfo) -> None:
        self.inner.progress(item)

    def push(self, item: Any) -> bool:
        return self.inner.push(item)

    def init(self, fragment: int, payload: bytes) -> None:
        self.inner.init(fragment, payload)

    def local_state(self, snapshot: int, data: bytes) -> None:
        self.inner.local_state(snapshot, data)

    def close(self) -> None:
        self.inner.close()


# ---- the hook over processes -----------------------------------------------------------------------


class MultiProcessSync:
    """The sync hook of a learner over `jax.process_count()` processes; construct and call `step`
    on every process, in the same order. `params` are the global parameters (jax.Arrays over every
    process's devices, or arrays every process holds whole). `transport` stands in for the leader's
    websocket client (tests)."""

    def __init__(
        self,
        params: Any,
        config: SyncConfig,
        is_embedding: Callable[[str], bool] = default_is_embedding,
        collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
        transport: Transport | None = None,
    ):
        if config.peer is not None:
            raise UserError("a multi-process learner does not serve peer snapshots yet: leave SyncConfig.peer unset")
        if collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s must be positive, got {collective_timeout_s}")
        self.config = config
        self.is_embedding = is_embedding
        self.collective_timeout_s = collective_timeout_s
        self.is_leader = jax.process_index() == 0
        self.processes = jax.process_count()
        self.sync: DilocoSync | None = None
        self.tree: TreeFragments | None = None
        self.calls = 0
        self.fragments_applied = 0  # fragment values broadcast and set, on every process
        self.quiet_steps = 0  # steps whose only collective was the header (nothing read, nothing arrived)
        self.last_step_quiet = False
        self._treedef = tree_flatten(params)[1]
        self._transport = transport
        self._held: HeldTransport | None = None
        self._closed = False
        self._watchdog = _Watchdog(_expire)
        try:
            self._join(params)
        except BaseException:
            self.close()
            raise

    # ---- collectives, bounded --------------------------------------------------------------------------

    def _collective(self, what: str, fn: Callable[[], Any], seconds: float | None = None) -> Any:
        """Run one collective under the watchdog; a failed one (a peer's connection closed) is the learner lost."""
        self._watchdog.arm(self.collective_timeout_s if seconds is None else seconds, what)
        try:
            return fn()
        except jax.errors.JaxRuntimeError as exc:
            raise LearnerProcessLost(f"{what} failed: another process of this learner is gone ({exc})") from exc
        finally:
            self._watchdog.disarm()

    def _broadcast(self, what: str, value: Any, seconds: float | None = None) -> Any:
        return self._collective(what, lambda: multihost_utils.broadcast_one_to_all(value), seconds)

    def _gather_leaves(self, leaves: list[Any]) -> list[np.ndarray]:
        got = self._collective("gathering fragments", lambda: multihost_utils.process_allgather(leaves, tiled=True))
        return [np.asarray(g) for g in got]

    # ---- joining -----------------------------------------------------------------------------------------

    def _join(self, params: Any) -> None:
        """The leader connects and waits for the welcome while the others wait in the first
        broadcast (so that one is bounded by welcome_timeout_s on top of the collective timeout);
        then every process learns the layout, and the initial parameters are gathered if the syncer
        asked for them."""
        leaves = tree_flatten(params)[0]
        # A first collective while every process is here: the collectives' connections are set up
        # on first use, and that setup gives up after 30 s (measured with jax 0.10's gloo), which
        # the leader's wait for the welcome below could exceed. Once set up, a collective waits.
        self._broadcast("starting the learner's processes", np.zeros(1, dtype=np.int32))
        welcome = None
        if self.is_leader:
            codec.warm_up([self.config.codec])  # before connecting: see DilocoSync's constructor
            self._held = HeldTransport(self._transport if self._transport is not None else self._client(params))
            welcome = self._held.wait_welcome(self.config.welcome_timeout_s)
        described = json.dumps(welcome.layout).encode() if welcome is not None else b""
        if len(described) > LAYOUT_BYTES_MAX:
            raise UserError(f"the syncer's layout is {len(described)} bytes of JSON, over {LAYOUT_BYTES_MAX}")
        head = np.array([len(described), int(welcome.needs_init) if welcome is not None else 0], dtype=np.int32)
        head = self._broadcast("joining the syncer", head, self.config.welcome_timeout_s + self.collective_timeout_s)
        size, needs_init = int(head[0]), bool(head[1])
        assert 0 < size <= LAYOUT_BYTES_MAX, f"a layout of {size} bytes was broadcast"
        raw = np.frombuffer(described, dtype=np.uint8) if self.is_leader else np.zeros(size, dtype=np.uint8)
        raw = self._broadcast("receiving the layout", raw)
        layout = layout_from_description(json.loads(np.asarray(raw, dtype=np.uint8).tobytes()))
        self.tree = TreeFragments(params, layout, self.is_embedding)
        initial = self._host_view(leaves, range(len(leaves)) if needs_init else ())
        if self.is_leader:
            assert self._held is not None
            self.sync = DilocoSync(tree_unflatten(self._treedef, initial), self.config, self.is_embedding, self._held)
            self.sync.join()
        log.info(
            "process %d of %d joined as part of one learner (%d fragments)",
            jax.process_index(),
            self.processes,
            layout.num_fragments,
        )

    def _client(self, params: Any) -> Transport:
        """The leader's link to the syncer (or to each of its shards), as the hook's own would be."""
        return syncer_transport(self.config, tensor_specs(params, self.is_embedding))

    @property
    def layout(self) -> Layout:
        assert self.tree is not None, "used before joining"
        return self.tree.layout

    # ---- the step ----------------------------------------------------------------------------------------

    def step(self, params: Any, tokens: int) -> Any:
        """One step of the whole learner (`tokens`: the learner's tokens this step, over all its
        processes; the same on every process). Returns `params` with arrived fragments applied,
        the same global values on every process. Raises LearnerProcessLost when another process is gone."""
        if tokens < 0:
            raise ValueError(f"tokens must be non-negative, got {tokens}")
        assert self.tree is not None and not self._closed, "step on a closed MultiProcessSync"
        # The step boundary: the header's broadcast below waits for every process anyway, and the
        # training step's own collectives finish here, so a process that died during it shows here
        # too (under the same bound).
        self._collective("the training step", lambda: jax.block_until_ready(params))
        self.calls += 1
        fragments = self.layout.num_fragments
        vector = self._leader_header().encode() if self.is_leader else StepHeader.empty(fragments)
        header = StepHeader.decode(self._broadcast("the step header", vector), fragments)
        assert header.step == self.calls, f"process at call {self.calls} got the header of call {header.step}"
        leaves = tree_flatten(params)[0]
        wanted = range(len(leaves)) if header.flags & HEADER_FLAG_GATHER_ALL else self._leaves_of(header.gather)
        self.last_step_quiet = not header.flags and not wanted
        self.quiet_steps += self.last_step_quiet
        view = self._host_view(leaves, wanted)
        changed = np.zeros(fragments, dtype=np.int32)
        if self.is_leader:
            assert self.sync is not None
            after = tree_flatten(self.sync.step(tree_unflatten(self._treedef, view), tokens))[0]
            changed = self._replaced(view, after)
            view = after
        if not header.flags & HEADER_FLAG_UPDATES:
            assert not changed.any(), "the hook replaced fragments on a step whose header announced no update"
            return params
        changed = np.asarray(self._broadcast("the applied fragments", changed)).astype(bool)
        if not changed.any():
            return params
        return tree_unflatten(self._treedef, self._set(leaves, view, changed))

    def _leader_header(self) -> StepHeader:
        """Peek at what arrived and say which fragments the hook will read and whether it may write."""
        assert self._held is not None and self.sync is not None
        (updates, _, (welcomes, welcome)), markers = self._held.peek()
        fragments = self.layout.num_fragments
        rejoin = welcomes != self.sync.welcomes_seen
        gather_all = bool(markers) or (rejoin and welcome is not None and welcome.needs_init)
        gather = set()
        if not rejoin:  # a new session starts no push at its first step (DilocoSync.step)
            gather |= set(self.sync.due_taking(updates))
        # Held back a call (DilocoSync.step); a new welcome voids those of the fragments it speaks
        # for (every fragment, or one shard's of a sharded syncer).
        voided = set(welcome.owned) if rejoin and welcome is not None else set()
        waiting = tuple(q for q in self.sync.updates_waiting if q not in voided)
        if self.config.alpha or self.config.keep_progress:  # mixing and keeping progress read the current values
            gather |= set(updates) | set(waiting)
        flags = (HEADER_FLAG_UPDATES if updates or waiting else 0) | (HEADER_FLAG_GATHER_ALL if gather_all else 0)
        return StepHeader(self.calls, flags, tuple(q in gather for q in range(fragments)))

    def _leaves_of(self, fragments: tuple[bool, ...]) -> list[int]:
        assert self.tree is not None
        return [slot.leaf for q, on in enumerate(fragments) if on for slot in self.tree.slots[q]]

    def _host_view(self, leaves: list[Any], wanted: Any) -> list[Any]:
        """Host copies of the `wanted` leaves (a collective: every process gathers), placeholders
        for the rest; the leader's hook reads and writes only the fragments it was told of."""
        wanted = sorted(set(wanted))
        view: list[Any] = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]
        if wanted:
            for i, host in zip(wanted, self._gather_leaves([leaves[i] for i in wanted])):
                view[i] = host
        return view

    def _replaced(self, before: list[Any], after: list[Any]) -> np.ndarray:
        """Which fragments the hook replaced (it builds a new leaf for every leaf it writes)."""
        assert self.tree is not None
        return np.array(
            [any(after[s.leaf] is not before[s.leaf] for s in slots) for slots in self.tree.slots], dtype=np.int32
        )

    def _set(self, leaves: list[Any], view: list[Any], changed: np.ndarray) -> list[Any]:
        """The leader's new values of the changed fragments, broadcast and put on each old leaf's sharding."""
        idx = self._leaves_of(tuple(bool(c) for c in changed))
        values = [np.asarray(view[i]) if self.is_leader else np.zeros(leaves[i].shape, leaves[i].dtype) for i in idx]
        got = self._broadcast("the applied fragments' values", values)
        out = list(leaves)
        for i, value in zip(idx, got):
            out[i] = _put_like(np.asarray(value, dtype=leaves[i].dtype), leaves[i])
        self.fragments_applied += int(changed.sum())
        return out

    # ---- the end -------------------------------------------------------------------------------------

    def close(self) -> None:
        """The leader closes its hook (queued pushes go out, then a goodbye); no collective. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._watchdog.stop()
        if self.sync is not None:
            self.sync.close()
        elif self._held is not None:
            self._held.close()

    def __enter__(self) -> MultiProcessSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _put_like(value: np.ndarray, old: Any) -> Any:
    """`value` (the whole leaf, the same on every process) placed as `old` is: each process builds
    its own shards of a global array on the old sharding; a host leaf stays on the host."""
    sharding = getattr(old, "sharding", None)
    if sharding is None:
        return value
    if getattr(old, "committed", True):
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
    return jax.device_put(value)  # uncommitted, like a freshly initialised leaf (tree.put_all_like says why)
