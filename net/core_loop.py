"""The core loop: one queue of typed items, one thread that handles them, in order.

Everything that reads or changes the syncer's state (events from connections, timers, snapshot
steps, checkpoints, the tape) is an item on one bounded queue, handled one at a time on one thread:
the core sees events in one total order (the order the tape records), its state is touched by that
thread only, and the kernels it runs release the GIL, so the event loop keeps reading sockets while
a fragment is merged. A full queue makes the producers wait (backpressure on the sockets).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

__all__ = ["CoreLoop"]

log = logging.getLogger("ddiloco.syncer")
Item = TypeVar("Item")


class CoreLoop(Generic[Item]):
    """`step(item)` runs on the core thread for every submitted item, in submission order."""

    def __init__(self, step: Callable[[Item], None], items_queued_max: int):
        assert items_queued_max >= 1, items_queued_max
        self._step = step
        self._items: asyncio.Queue = asyncio.Queue(items_queued_max)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddiloco-core")
        self._task: asyncio.Task | None = None
        self._stop = object()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="ddiloco-core-loop")

    async def submit(self, item: Item) -> None:
        await self._items.put(item)

    def submit_nowait(self, item: Item) -> bool:
        """Queue without waiting; False when the queue is full (the caller decides what that means)."""
        try:
            self._items.put_nowait(item)
        except asyncio.QueueFull:
            return False
        return True

    def empty(self) -> bool:
        """Nothing is waiting to be handled (the item being handled may still be running)."""
        return self._items.empty()

    async def call(self, fn: Callable[[], object]) -> object:
        """Run `fn` on the core thread between two items (after those queued before it)."""
        done = asyncio.get_running_loop().create_future()
        await self._items.put(_Call(fn, done))
        return await done

    async def stop(self) -> None:
        """Handle what is queued, then end; the thread stays for `run_after_stop`."""
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
            if isinstance(item, _Call):
                try:
                    result = await loop.run_in_executor(self._thread, item.fn)
                except Exception as exc:  # noqa: BLE001 - raised again in the caller, who handles it
                    if not item.done.done():
                        item.done.set_exception(exc)
                else:
                    if not item.done.done():
                        item.done.set_result(result)
                continue
            try:
                await loop.run_in_executor(self._thread, self._step, item)
            except Exception:  # a bug in the core or the shell: log it loudly and stop, never limp on
                log.exception("syncer core failed on %s", type(item).__name__)
                raise


class _Call:
    __slots__ = ("done", "fn")

    def __init__(self, fn: Callable[[], object], done: asyncio.Future):
        self.fn, self.done = fn, done
