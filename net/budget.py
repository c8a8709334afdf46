"""The bytes of learners' messages read off the sockets and not yet handled by the core.

The core's queue (net.core_loop) is bounded in items, and a push is one item of megabytes: with the
core busy merging, 8 learners pushing a 50M-parameter model queued gigabytes behind it (measured:
`ddiloco bench syncer --learners 8 --params 50M` held 1,909 items at its peak, and the syncer's
resident memory grew past 12x the model). A reader takes a message's bytes from this budget before
it queues the message, and the core gives them back once it has handled it; a reader that finds the
budget spent waits, and with it its socket, so the learners feel the backpressure instead of the
syncer's memory. A message larger than the whole budget is let through alone, never refused.
"""

from __future__ import annotations

import asyncio

__all__ = ["ByteBudget"]


class ByteBudget:
    """Bytes taken and given back on one event loop (the core thread gives back through it)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a byte budget must be positive, got {limit}")
        self.limit = limit
        self.used = 0
        self.waits = 0  # how often a reader had to wait: the backpressure felt
        self._returned = asyncio.Event()

    async def take(self, n: int) -> None:
        """Wait until `n` more bytes fit (or nothing is taken: a message past the limit goes alone)."""
        assert n >= 0, n
        if self.used and self.used + n > self.limit:
            self.waits += 1
            while self.used and self.used + n > self.limit:
                self._returned.clear()
                await self._returned.wait()
        self.used += n

    def give_back(self, n: int) -> None:
        """`n` bytes taken earlier are free again (the message was handled, or never queued)."""
        assert 0 <= n <= self.used, (n, self.used)
        self.used -= n
        self._returned.set()
