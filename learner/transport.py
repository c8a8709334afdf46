"""What the sync hook talks to: the syncer (a `Transport`) and the peers it serves (a `SnapshotOutbox`).

Declared as protocols so that anything with these methods works, checked by a type checker rather
than looked up at run time. Three transports satisfy `Transport`: `net.client.ThreadedClient` (a
websocket on its own thread; the default), `experiments.inprocess.InProcessTransport` (the syncer
core on a virtual clock) and full replay's stand-in (what a recorded run's hook took, call by call).
Every method returns at once: the hook runs between two training steps and never waits on the
network, except in `wait_welcome`, which `DilocoSync.join` calls once.

A transport may also offer `sender() -> Callable[[Push], bool]`: `push` for another thread, the push
belonging to the session of the moment `sender` was called. The hook's background thread then sends
each push as soon as it is encoded (learner.background) instead of at the next call. The websocket
clients offer it; the virtual-clock and replay transports do not, so their pushes stay on the calls.
"""

from __future__ import annotations

from typing import Protocol, TypeAlias, runtime_checkable

from ddiloco.core.events import Push
from ddiloco.net import session

__all__ = ["SnapshotOutbox", "Taken", "Transport"]

# What one `take` hands over: the updates of each fragment in arrival order, the syncer's errors,
# and (welcomes seen so far, the newest welcome): a count that changed means a new session.
Taken: TypeAlias = tuple[
    dict[int, list[session.UpdateInfo]],
    list[session.ErrorInfo],
    tuple[int, session.WelcomeInfo | None],
]


@runtime_checkable
class Transport(Protocol):
    """One learner's link to the syncer, as the hook uses it."""

    def wait_welcome(self, timeout_s: float) -> session.WelcomeInfo:
        """Block until the syncer has welcomed this learner; raise TimeoutError after `timeout_s`
        and the syncer's refusal (net.client.SyncerRefused) at once."""
        ...

    def take(self) -> Taken:
        """Everything that arrived since the last call (updates and errors are consumed)."""
        ...

    def progress(self, item: session.ProgressInfo) -> None:
        """Report the learner's step, versions held and counters (only the newest report matters)."""
        ...

    def push(self, item: Push) -> bool:
        """Send an outer gradient (the learner pushes on its own schedule, protocol 2). False: not
        sent (a full queue, counted by the transport): the hook pushes that progress with its next push."""
        ...

    def init(self, fragment: int, payload: bytes) -> None:
        """Send a fragment's initial parameters (the syncer asked this learner for them)."""
        ...

    def take_markers(self) -> list[int]:
        """Consistent snapshots (net.snapshot) whose marker arrived since the last call: the hook
        answers each with its local state at this step boundary. A transport without snapshots: []."""
        ...

    def local_state(self, snapshot: int, data: bytes) -> None:
        """Send this learner's local state for the consistent snapshot `snapshot`."""
        ...

    def close(self) -> None:
        """Say goodbye and stop; the hook calls it once, from `DilocoSync.close`."""
        ...


@runtime_checkable
class SnapshotOutbox(Protocol):
    """Where the hook hands a copy of its state to a (re)joining peer (net.peer.SnapshotBox)."""

    @property
    def wanted(self) -> bool:
        """A peer asked and no copy has been published since."""
        ...

    def publish(self, data: bytes) -> None: ...
