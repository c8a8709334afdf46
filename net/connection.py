"""One learner's websocket on the syncer side: two bounded outgoing queues and a writer task.

Control frames (welcome, request, error) go out before any further bulk frame, so a small message
never waits behind a 100 MB fragment update; the wire's per-frame message ids let the learner
reassemble both.

Memory stays bounded whatever the learners do. A queued fragment update that has not started to go
out is replaced by a newer version of the same fragment (the learner would overwrite it anyway), so
a connection holds at most one pending message per fragment, and the frames of one version are
shared by every connection. Both queues have a length limit, and a send that cannot make progress
for `send_stall_s_max` (the peer stopped reading and the socket buffer is full) drops the learner.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from aiohttp import web

from ddiloco.errors import FaultError
from ddiloco.net.lane import Lane, send_frame


class SlowPeerError(FaultError, RuntimeError):
    """The learner does not read fast enough; its queues are full."""


@dataclass(frozen=True)
class QueueLimits:
    control_frames_queued_max: int = 1024
    bulk_messages_queued_max: int = 256  # distinct fragments with an update waiting for one learner
    send_stall_s_max: float = 30.0  # one frame that cannot be written for this long: the peer is gone

    def __post_init__(self) -> None:
        if self.control_frames_queued_max < 1 or self.bulk_messages_queued_max < 1:
            raise ValueError("queue limits must be at least 1")
        if not self.send_stall_s_max > 0:
            raise ValueError("send_stall_s_max must be positive")


@dataclass
class Connection:
    conn_id: int
    ws: web.WebSocketResponse
    limits: QueueLimits
    learner: int | None = None
    control: deque = field(default_factory=deque)
    # each item: [key, source, frames, built]; source is a list of frames or an async builder of an
    # iterable of them; frames (a deque) exists once the item has started to go out, and `built`
    # keeps what the builder returned alive while it does (others may share it)
    bulk: deque = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    in_send: bool = False  # a frame is being written right now
    bytes_out: int = 0
    frames_out: int = 0
    closed: bool = False
    # told the size of every frame written, and how much of it went on the lane (the server's totals)
    sent: Callable[[int, int], None] | None = None
    lane: Lane | None = None  # the bulk frames' data goes there once the learner has opened it (net.lane)

    def send_control(self, frames: Sequence[bytes]) -> None:
        if len(self.control) + len(frames) > self.limits.control_frames_queued_max:
            raise SlowPeerError(f"{len(self.control)} control frames already queued")
        self.control.extend(frames)
        self.wake.set()

    def send_bulk(self, source: Sequence[bytes] | Callable[[], Awaitable[Sequence[bytes]]], key: object = None) -> None:
        """Queue a bulk message: its frames, or an async builder called when the message's turn comes
        (so an update is encoded from the newest version, once, when it is about to go out). One not
        yet started with the same `key` (fragment) is replaced."""
        if key is not None:
            for item in self.bulk:
                if item[0] == key and item[2] is None:
                    item[1] = source
                    self.wake.set()
                    return
        if len(self.bulk) >= self.limits.bulk_messages_queued_max:
            raise SlowPeerError(f"{len(self.bulk)} bulk messages already queued")
        self.bulk.append([key, source, None, None])
        self.wake.set()

    async def flush_control(self, timeout_s: float) -> None:
        """Wait (bounded) until every queued control frame has been written: an error frame that
        explains a close goes out before the close."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (self.control or self.in_send) and not self.closed and loop.time() < deadline:
            await asyncio.sleep(0.001)

    async def _next_bulk_frame(self) -> bytes | None:
        head = self.bulk[0]
        if head[2] is None:
            source = head[1]
            head[3] = await source() if callable(source) else source
            head[2] = deque(head[3])
        frame = head[2].popleft() if head[2] else None
        if not head[2]:
            self.bulk.popleft()
        return frame

    async def write_loop(self) -> None:
        """Send until closed; control frames first, then one bulk frame at a time."""
        while not self.closed:
            await self.wake.wait()
            self.wake.clear()
            while (self.control or self.bulk) and not self.closed:
                frame = self.control.popleft() if self.control else await self._next_bulk_frame()
                if frame is None:
                    continue
                self.in_send = True
                try:
                    on_lane = await asyncio.wait_for(
                        send_frame(self.ws, self.lane, frame), self.limits.send_stall_s_max
                    )
                except TimeoutError:
                    raise SlowPeerError(f"a frame could not be sent for {self.limits.send_stall_s_max} s") from None
                finally:
                    self.in_send = False
                self.bytes_out += len(frame)
                self.frames_out += 1
                if self.sent is not None:
                    self.sent(len(frame), on_lane)
