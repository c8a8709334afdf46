"""The core loop: one queue of typed items, one thread that handles them, in order.

Everything that reads or changes the syncer's state (events from connections, timers, snapshot
steps, checkpoints, the tape) is an item on one bounded queue, handled one at a time on one thread:
the core sees events in one total order (the order the tape records), its state is touched by that
thread only, and the kernels it runs release the GIL, so the event loop keeps reading sockets while
a fragment is merged. A full queue makes the producers wait (backpressure on the sockets).

Faults. `step` decides what a failure of one learner's item means (net.server: that learner is
dropped, the others are served on). What escapes `step` is a failure of the core itself: the loop
logs it once with its traceback, stops taking items, and resolves `failed()` with a `CoreFailed`,
so the daemon stops as a whole rather than stay half-alive (a listening socket, a dead core).

Health. The loop keeps when it last completed an item and since when it has been on the current
one (the injected clock's time), so a health check can tell a core that is stuck from one that is idle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

from ddiloco.errors import FaultError

__all__ = ["CoreFailed", "CoreHealth", "CoreLoop"]

log = logging.getLogger("ddiloco.syncer")
Item = TypeVar("Item")


class CoreFailed(FaultError, RuntimeError):
    """The syncer's core failed (a bug or a broken invariant): the daemon stopped; the message says on what."""

    what_to_do = (
        "restart the syncer with --resume from its checkpoint directory (the learners reconnect), "
        "and report the traceback logged above"
    )


@dataclass(frozen=True)
class CoreHealth:
    """How the core loop is doing at one instant (what /healthz judges)."""

    running: bool
    failure: str | None  # why it stopped, when it failed
    queued: int  # items waiting
    busy_s: float | None  # how long the current item has been running; None when idle
    since_completed_s: float  # since the last item completed (or since the loop started)

    def stalled_s(self) -> float:
        """How long work has waited without the core completing anything: 0 when there is none."""
        return self.since_completed_s if self.queued or self.busy_s is not None else 0.0


class CoreLoop(Generic[Item]):
    """`step(item)` runs on the core thread for every submitted item, in submission order."""

    def __init__(
        self, step: Callable[[Item], None], items_queued_max: int, clock: Callable[[], float] = time.monotonic
    ):
        assert items_queued_max >= 1, items_queued_max
        self._step = step
        self._clock = clock
        self._items: asyncio.Queue = asyncio.Queue(items_queued_max)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddiloco-core")
        self._task: asyncio.Task | None = None
        self._stop = object()
        self._failed: asyncio.Future | None = None
        self._busy_since: float | None = None
        self._completed_at = clock()

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._failed = loop.create_future()
        self._completed_at = self._clock()
        self._task = loop.create_task(self._run(), name="ddiloco-core-loop")

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def failure(self) -> CoreFailed | None:
        if self._failed is None or not self._failed.done():
            return None
        return self._failed.result()

    async def failed(self) -> CoreFailed:
        """Returns when the core has failed (never, for a core that stops cleanly)."""
        assert self._failed is not None, "start the loop first"
        return await asyncio.shield(self._failed)

    def health(self) -> CoreHealth:
        now, failure = self._clock(), self.failure
        busy = None if self._busy_since is None else now - self._busy_since
        return CoreHealth(
            self.running, None if failure is None else str(failure), self._items.qsize(), busy, now - self._completed_at
        )

    async def submit(self, item: Item) -> None:
        if self.failure is not None:
            return  # the daemon is stopping on the core's failure: nothing more is handled
        await self._items.put(item)

    def submit_nowait(self, item: Item) -> bool:
        """Queue without waiting; False when the queue is full (the caller decides what that means)."""
        if self.failure is not None:
            return True  # accepted and dropped, as `submit` does: the daemon is stopping
        try:
            self._items.put_nowait(item)
        except asyncio.QueueFull:
            return False
        return True

    def empty(self) -> bool:
        """Nothing is waiting to be handled (the item being handled may still be running). Read on
        the core thread too, as a hint: the queue's length is one read of its deque."""
        return self._items.empty()

    async def call(self, fn: Callable[[], object]) -> object:
        """Run `fn` on the core thread between two items (after those queued before it)."""
        if self.failure is not None:
            raise self.failure
        done = asyncio.get_running_loop().create_future()
        await self._items.put(_Call(fn, done))
        return await done

    async def stop(self) -> None:
        """Handle what is queued, then end; the thread stays for `run_after_stop`. After a failure:
        at once (what is queued is not handled)."""
        if self._task is None or self._task.done():
            return
        await self._items.put(self._stop)
        await self._task

    async def run_after_stop(self, fn: Callable[[], object]) -> object:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn)

    def close(self) -> None:
        self._thread.shutdown(wait=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            item = await self._items.get()
            if item is self._stop:
                return
            self._busy_since = self._clock()
            try:
                if isinstance(item, _Call):
                    await self._call(loop, item)
                else:
                    await loop.run_in_executor(self._thread, self._step, item)
            except Exception as exc:  # a bug in the core or the shell: log it loudly and stop, never limp on
                log.critical(
                    "syncer core failed on %s: %s: %s", type(item).__name__, type(exc).__name__, exc, exc_info=exc
                )
                self._failed.set_result(
                    CoreFailed(f"the syncer core failed on {type(item).__name__}: {type(exc).__name__}: {exc}")
                )
                self._answer_waiting_calls()
                return
            finally:
                self._busy_since = None
            self._completed_at = self._clock()

    async def _call(self, loop: asyncio.AbstractEventLoop, item: _Call) -> None:
        try:
            result = await loop.run_in_executor(self._thread, item.fn)
        except Exception as exc:  # noqa: BLE001 - raised again in the caller, who handles it
            if not item.done.done():
                item.done.set_exception(exc)
        else:
            if not item.done.done():
                item.done.set_result(result)

    def _answer_waiting_calls(self) -> None:
        """The calls queued behind the failure would wait forever: they fail with it."""
        while not self._items.empty():
            item = self._items.get_nowait()
            if isinstance(item, _Call) and not item.done.done():
                item.done.set_exception(self.failure)


class _Call:
    __slots__ = ("done", "fn")

    def __init__(self, fn: Callable[[], object], done: asyncio.Future):
        self.fn, self.done = fn, done
