"""The daemon's door: deadlines for slow peers and a limit of connections per remote address.

aiohttp bounds the size of what a peer sends, not its pace: a socket that sends half an HTTP
request, or a websocket frame's header and then nothing, holds a connection (a file descriptor, a
handler, buffers) for as long as the peer likes, and enough of them starve the learners. The guard
sits between the listening socket and aiohttp's protocol (`wrap`) and closes such connections:

- `handshake_s_max`: from connecting, and from the end of each answered request on a kept-alive
  connection, the next HTTP request must have arrived whole (headers parsed, its handler started);
- `frame_s_max`: on a websocket, a frame begun must be complete this long after its first byte.
  The guard follows the frame boundaries itself (RFC 6455, section 5.2: a header of 2 to 14 bytes
  that says how long the payload is); aiohttp's reader does not say whether it is inside a frame.
  An idle websocket (between frames) has no deadline here: the heartbeat (ServerConfig.heartbeat_s)
  is what closes a peer that went away;
- `connections_per_address_max`: one more connection from an address that holds this many is
  answered `429 Too Many Requests` at once, before any of its bytes are read, and closed.

Each closing is one WARNING line naming the address and the limit, and is counted (`closed`,
`refused`). Runs on the event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

__all__ = ["Guard", "GuardLimits"]

log = logging.getLogger("ddiloco.syncer")

HANDSHAKE_S_MAX_DEFAULT = 10.0
FRAME_S_MAX_DEFAULT = 30.0  # a 16 MiB frame (wire.WireLimits' largest) at about 0.5 MiB/s
CONNECTIONS_PER_ADDRESS_MAX_DEFAULT = 64  # learners behind one address and the HTTP clients that watch them
PIPELINED_BYTES_MAX = 64 << 10  # kept of what follows a request's headers before its upgrade (a client that
# sends frames before the 101; aiohttp's does not): more is cut, and the frame bounds may be lost for it


@dataclass(frozen=True)
class GuardLimits:
    handshake_s_max: float = HANDSHAKE_S_MAX_DEFAULT
    frame_s_max: float = FRAME_S_MAX_DEFAULT
    connections_per_address_max: int = CONNECTIONS_PER_ADDRESS_MAX_DEFAULT

    def __post_init__(self) -> None:
        if self.handshake_s_max <= 0 or self.frame_s_max <= 0 or self.connections_per_address_max < 1:
            raise ValueError("handshake_s_max and frame_s_max must be positive, connections_per_address_max at least 1")


class Guard:
    """Wraps aiohttp's protocol factory; the routes tell it where each connection stands (`middleware`,
    `upgrading`)."""

    def __init__(self, limits: GuardLimits, clock: Callable[[], float] = time.monotonic):
        self.limits, self.clock = limits, clock
        self.per_address: dict[str, int] = {}
        self.closed: dict[str, int] = {}  # connections closed, by the limit they broke
        self.refused = 0  # connections refused for their address's count
        self._by_transport: dict[asyncio.BaseTransport, _Guarded] = {}

    def wrap(self, factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """The protocol factory for `loop.create_server`: aiohttp's protocol behind a guard."""
        return lambda: _Guarded(self, factory)

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        """A request arrived whole: no deadline while its handler runs; the next one's starts after."""
        conn = self._by_transport.get(request.transport)
        if conn is not None:
            conn.request_started()
        try:
            return await handler(request)
        finally:
            if conn is not None:
                conn.request_done()

    def upgrading(self, request: web.Request) -> None:
        """Call before the websocket upgrade: from here the bytes are frames."""
        conn = self._by_transport.get(request.transport)
        if conn is not None:
            conn.upgrading()

    # ---- the guarded connections' bookkeeping --------------------------------------------------

    def _admit(self, conn: _Guarded, transport: asyncio.Transport, address: str) -> bool:
        held = self.per_address.get(address, 0)
        if held >= self.limits.connections_per_address_max:
            self.refused += 1
            log.warning("refused a connection from %s: it holds %d (connections_per_address_max)", address, held)
            return False
        self.per_address[address] = held + 1
        self._by_transport[transport] = conn
        return True

    def _release(self, transport: asyncio.BaseTransport, address: str) -> None:
        self._by_transport.pop(transport, None)
        left = self.per_address.get(address, 0) - 1
        if left > 0:
            self.per_address[address] = left
        else:
            self.per_address.pop(address, None)

    def _count_closed(self, limit: str) -> None:
        self.closed[limit] = self.closed.get(limit, 0) + 1


_TOO_MANY = (
    b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Connection: close\r\nRetry-After: 1\r\nContent-Length: %d\r\n\r\n%s"
)


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, with the guard's deadlines around it."""

    def __init__(self, guard: Guard, factory: Callable[[], asyncio.Protocol]):
        self.guard = guard
        self.inner: asyncio.Protocol | None = None
        self._factory = factory
        self._transport: asyncio.Transport | None = None
        self._address = "?"
        self._timer: asyncio.TimerHandle | None = None
        self._waiting_since: float | None = None  # for an HTTP request; None while one is being handled
        self._frames: _FrameBounds | None = None  # once upgraded to a websocket
        self._tail = _AfterHeaders()

    # ---- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        peer = transport.get_extra_info("peername")
        self._address = str(peer[0]) if peer else "?"
        if not self.guard._admit(self, transport, self._address):
            text = f"too many connections from {self._address}\n".encode()
            transport.write(_TOO_MANY % (len(text), text))
            transport.close()
            return
        self.inner = self._factory()
        self.inner.connection_made(transport)
        self._waiting_since = self.guard.clock()
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return  # refused: its bytes are not read
        if self._frames is not None:
            self._frames.feed(data, self.guard.clock())
            self._arm()
        else:
            self._tail.feed(data)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self.inner is None else self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.inner is None:
            return
        self.guard._release(self._transport, self._address)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    # ---- where the connection stands -------------------------------------------------------------

    def request_started(self) -> None:
        self._waiting_since = None

    def request_done(self) -> None:
        if self._frames is None:
            self._waiting_since = self.guard.clock()
            self._tail = _AfterHeaders()
            self._arm()

    def upgrading(self) -> None:
        """The bytes after the upgrade request's headers (a peer may send frames before the 101) are
        the first frames' bytes."""
        self._frames = _FrameBounds()
        self._frames.feed(self._tail.bytes(), self.guard.clock())
        self._arm()

    # ---- the deadline ----------------------------------------------------------------------------

    def _deadline(self) -> tuple[float, str] | None:
        limits = self.guard.limits
        if self._frames is not None:
            if self._frames.inside:
                return self._frames.started_at + limits.frame_s_max, "frame_s_max"
            return None
        if self._waiting_since is not None:
            return self._waiting_since + limits.handshake_s_max, "handshake_s_max"
        return None

    def _arm(self) -> None:
        """One timer per connection, armed for the earliest deadline; a deadline that moved later
        is found when the timer fires (cheaper than re-arming on every frame)."""
        if self._timer is None and self._deadline() is not None:
            due = self._deadline()[0]
            self._timer = asyncio.get_running_loop().call_later(max(0.0, due - self.guard.clock()), self._fire)

    def _fire(self) -> None:
        self._timer = None
        deadline = self._deadline()
        if deadline is None or self._transport is None or self._transport.is_closing():
            return
        due, limit = deadline
        if self.guard.clock() < due:
            self._arm()
            return
        what = "a websocket frame begun" if limit == "frame_s_max" else "an HTTP request"
        seconds = getattr(self.guard.limits, limit)
        log.warning(
            "closing the connection from %s: %s not complete within %g s (%s)", self._address, what, seconds, limit
        )
        self.guard._count_closed(limit)
        self._transport.abort()


class _AfterHeaders:
    """The bytes received after the last end of HTTP headers ("\\r\\n\\r\\n") so far (before the upgrade)."""

    MARK = b"\r\n\r\n"

    def __init__(self) -> None:
        self._recent = b""  # the last bytes, to find a mark split across two reads
        self._after = bytearray()

    def feed(self, data: bytes) -> None:
        joined = self._recent + data
        end = joined.rfind(self.MARK)
        if end >= 0:
            self._after = bytearray(joined[end + len(self.MARK) :])
        else:
            self._after += data
        del self._after[:-PIPELINED_BYTES_MAX]
        self._recent = joined[-(len(self.MARK) - 1) :]

    def bytes(self) -> bytes:
        return bytes(self._after)


class _FrameBounds:
    """Where a websocket byte stream stands: between two frames or inside one, and since when."""

    def __init__(self) -> None:
        self.inside = False
        self.started_at = 0.0
        self._head = bytearray()  # the header read so far
        self._head_bytes = 2  # how long the header is (known once its first 2 bytes are in)
        self._payload_left = 0

    def feed(self, data: bytes, now: float) -> None:
        i, n = 0, len(data)
        while i < n:
            if self._payload_left:
                take = min(self._payload_left, n - i)
                self._payload_left -= take
                i += take
                self.inside = self._payload_left > 0
                continue
            if not self.inside:
                self.inside, self.started_at = True, now
            take = min(self._head_bytes - len(self._head), n - i)
            self._head += data[i : i + take]
            i += take
            if len(self._head) == 2:
                self._head_bytes = _header_bytes(self._head)
            if len(self._head) == self._head_bytes:
                self._payload_left = _payload_bytes(self._head)
                self._head.clear()
                self._head_bytes = 2
                self.inside = self._payload_left > 0


def _header_bytes(first_two: bytes | bytearray) -> int:
    """2, then 2 or 8 for an extended length, then 4 for a mask key."""
    length7, masked = first_two[1] & 0x7F, first_two[1] & 0x80
    return 2 + (2 if length7 == 126 else 8 if length7 == 127 else 0) + (4 if masked else 0)


def _payload_bytes(header: bytes | bytearray) -> int:
    length7 = header[1] & 0x7F
    if length7 == 126:
        return int.from_bytes(header[2:4], "big")
    if length7 == 127:
        return int.from_bytes(header[2:10], "big")
    return length7
