"""One learner's websocket on the syncer side: two bounded outgoing queues and a writer task.

Control frames (welcome, request, error) go out before any further bulk frame, so a small message
never waits behind a 100 MB fragment update; the wire's per-frame message ids let the learner
reassemble both. Both queues are bounded: a learner that stops reading fills them and is dropped
rather than allowed to grow the syncer's memory.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from aiohttp import web


class SlowPeerError(RuntimeError):
    """The learner does not read fast enough; its queues are full."""


@dataclass(frozen=True)
class QueueLimits:
    control_frames_queued_max: int = 1024
    bulk_messages_queued_max: int = 4  # whole fragment updates waiting for one learner

    def __post_init__(self) -> None:
        if self.control_frames_queued_max < 1 or self.bulk_messages_queued_max < 1:
            raise ValueError("queue limits must be at least 1")


@dataclass
class Connection:
    conn_id: int
    ws: web.WebSocketResponse
    limits: QueueLimits
    learner: int | None = None
    control: deque = field(default_factory=deque)
    bulk: deque = field(default_factory=deque)  # each item: a deque of frames of one message
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    bytes_out: int = 0
    frames_out: int = 0
    closed: bool = False

    def send_control(self, frames: Sequence[bytes]) -> None:
        if len(self.control) + len(frames) > self.limits.control_frames_queued_max:
            raise SlowPeerError(f"{len(self.control)} control frames already queued")
        self.control.extend(frames)
        self.wake.set()

    def send_bulk(self, frames: Sequence[bytes]) -> None:
        if len(self.bulk) >= self.limits.bulk_messages_queued_max:
            raise SlowPeerError(f"{len(self.bulk)} bulk messages already queued")
        self.bulk.append(deque(frames))
        self.wake.set()

    async def write_loop(self) -> None:
        """Send until closed; control frames first, then one bulk frame at a time."""
        while not self.closed:
            await self.wake.wait()
            self.wake.clear()
            while (self.control or self.bulk) and not self.closed:
                if self.control:
                    frame = self.control.popleft()
                else:
                    current = self.bulk[0]
                    frame = current.popleft()
                    if not current:
                        self.bulk.popleft()
                await self.ws.send_bytes(frame)
                self.bytes_out += len(frame)
                self.frames_out += 1
