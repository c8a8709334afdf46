"""The lane: a TCP connection beside a learner's websocket that carries its bulk frames' data.

Why: over loopback, aiohttp's websocket costs about 2 ns of CPU per byte, sender and receiver summed
(the client masks every byte, the reader copies each frame several times); a bare socket moves the
same bytes for about 0.3 ns (`ddiloco bench sync`, its wire columns). Pushes and updates are nearly
all of the bytes, and on a CPU-bound sync that CPU is time.

How (docs/protocol.md, "The lane"): the websocket keeps every message and its order. A frame with
at least `LaneLimits.data_bytes_min` bytes of data goes out as its 48-byte header alone on the
websocket, and its data on the lane behind `wire.LANE_PREFIX` (message id, chunk index, data bytes).
The receiver reads the websocket in order; at a header-only frame it reads the prefix and the data
from the lane straight into the message's memory (`wire.Reassembler.lane_chunk`). Both sides send a
frame's header before its data and both streams keep their order, so the lane is never searched and
a control message still overtakes a bulk one only between two frames, as on the websocket alone.

Setup: the learner offers a lane with a random token in its upgrade request's `LANE_HEADER` (so only
an authenticated websocket can have one), asks `GET /lane` for the port after connecting (404: the
syncer has none) and opens it with `LANE_HELLO` (magic, lane version, token); the syncer answers
`LANE_ANSWER` (magic, status) and both sides use the lane from then on. Anything that fails on the
way leaves the connection on its websocket alone; a lane that fails once in use closes the connection
(its bytes and the headers are out of step), and the learner reconnects. A syncer that serves TLS
serves its lane with TLS too, with the same certificate, and a learner checks it as it checks the
websocket's.

I/O: blocking sockets, each direction on a thread of its own: `sendmsg` of the prefix and of the data
as it lies in the encoded frames (two `sendall` over TLS), `recv_into` the message's memory. The event
loop never touches the bulk bytes, and the kernel (or OpenSSL) copies them with the GIL released.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import secrets
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import aiohttp
from yarl import URL

from ddiloco.errors import FaultError
from ddiloco.net import wire

__all__ = [
    "LANE_HEADER",
    "Lane",
    "LaneError",
    "LaneLimits",
    "LaneListener",
    "dial",
    "new_token",
    "open_lane",
    "parse_token",
    "receive_frame",
    "send_frame",
]

log = logging.getLogger("ddiloco.lane")

LANE_HEADER = "X-Ddiloco-Lane"  # the upgrade request's offer: the token, 32 hex characters
LANE_VERSION = 1
TOKEN_BYTES = 16
LANE_HELLO = struct.Struct("<4sI16s8x")  # magic, lane version, token; 32 bytes
LANE_ANSWER = struct.Struct("<4sI")  # magic, status
LANE_MAGIC = b"DDLN"
ATTACHED, UNKNOWN_TOKEN, BAD_HELLO = 0, 1, 2
TLS_HANDSHAKE_THREADS = 4
STATUS_TEXT = {ATTACHED: "attached", UNKNOWN_TOKEN: "unknown token", BAD_HELLO: "bad hello"}


class LaneError(FaultError, ConnectionError):
    """The lane failed: its peer went away, stalled, or sent what the protocol does not allow."""

    what_to_do = "nothing: the learner reconnects; if it repeats, run with --no-lane and report it"


@dataclass(frozen=True)
class LaneLimits:
    # frames with less data stay on the websocket: a lane round trip costs more than it saves there
    data_bytes_min: int = 64 << 10
    handshake_s_max: float = 5.0  # connecting and the hello, on either side
    stall_s_max: float = 30.0  # a send or a receive that makes no progress for this long: the peer is gone
    handshakes_max: int = 64  # lane connections the syncer holds before they name their websocket

    def __post_init__(self) -> None:
        if self.data_bytes_min < 1 or self.handshakes_max < 1:
            raise ValueError("LaneLimits.data_bytes_min and handshakes_max must be at least 1")
        if not (self.handshake_s_max > 0 and self.stall_s_max > 0):
            raise ValueError("LaneLimits.handshake_s_max and stall_s_max must be positive")


def new_token() -> str:
    """A lane offer's token: 16 random bytes as hex."""
    return secrets.token_hex(TOKEN_BYTES)


def parse_token(text: str | None) -> bytes | None:
    """The token of an offer, or None when there is none or it is not 32 hex characters."""
    if text is None or len(text) != 2 * TOKEN_BYTES:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return None


class Lane:
    """One connected lane: `send` and `receive` frames' data, each direction on a thread of its own."""

    def __init__(self, sock: socket.socket, limits: LaneLimits) -> None:
        sock.settimeout(limits.stall_s_max)  # blocking, each call at most this long
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.limits = limits
        self._sock = sock
        self._sender = _Worker("ddiloco-lane-send")
        self._receiver = _Worker("ddiloco-lane-recv")
        self.closed = False

    def carries(self, frame: bytes | memoryview) -> bool:
        """Whether `frame` goes out as a header on the websocket and its data on the lane."""
        return not self.closed and len(frame) - wire.HEADER_BYTES >= self.limits.data_bytes_min

    async def send(self, frame: memoryview) -> None:
        """Send `frame`'s data behind its prefix (its header goes on the websocket, first)."""
        view = memoryview(frame).cast("B")
        fields = wire.HEADER.unpack_from(view)
        data = view[wire.HEADER_BYTES :]
        prefix = wire.LANE_PREFIX.pack(fields[4], fields[5], len(data))
        await self._sender.run(self._send_blocking, prefix, data)

    def _send_blocking(self, prefix: bytes, data: memoryview) -> None:
        try:
            if isinstance(self._sock, ssl.SSLSocket):  # no sendmsg over TLS: one record each
                self._sock.sendall(prefix)
                self._sock.sendall(data)
                return
            sent = self._sock.sendmsg([prefix, data])
            if sent < len(prefix):
                self._sock.sendall(prefix[sent:])
                sent = len(prefix)
            self._sock.sendall(data[sent - len(prefix) :])
        except OSError as exc:  # socket.timeout included: a stalled peer
            raise LaneError(f"lane send failed: {type(exc).__name__} {exc}") from exc

    async def receive(self, reassembler: wire.Reassembler, header: bytes | memoryview) -> tuple[object, int]:
        """The data of the frame whose `header` came alone on the websocket, read into its message's
        memory: (the message it completes or None, the frame's data bytes). Raises `wire.WireError`
        (the lane's bytes do not match the header) or `LaneError`."""
        # The reassembler is this connection's reader's, and the reader waits here: the thread may use it.
        chunk = await self._receiver.run(self._receive_blocking, reassembler, bytes(header))
        return reassembler.lane_end(chunk), chunk.data_bytes

    def _receive_blocking(self, reassembler: wire.Reassembler, header: bytes) -> wire.LaneChunk:
        prefix = bytearray(wire.LANE_PREFIX.size)
        self._fill(memoryview(prefix))
        chunk = reassembler.lane_chunk(header, prefix)
        for view in chunk.views:
            self._fill(view)
        return chunk

    def _fill(self, view: memoryview) -> None:
        _read_exactly(self._sock, view, "lane receive")

    def close(self) -> None:
        """Shut the socket (a thread blocked on it returns at once) and let the threads end."""
        if self.closed:
            return
        self.closed = True
        _shut(self._sock)
        self._sock.close()
        self._sender.stop()
        self._receiver.stop()


async def send_frame(ws, lane: Lane | None, frame: bytes | memoryview) -> int:
    """Send one frame on a websocket, its data on `lane` when the lane carries it: the bytes that
    went on the lane (0: the whole frame went on the websocket)."""
    if lane is not None and lane.carries(frame):
        await ws.send_bytes(memoryview(frame)[: wire.HEADER_BYTES])
        await lane.send(frame)
        return len(frame) - wire.HEADER_BYTES
    await ws.send_bytes(frame)
    return 0


async def receive_frame(reassembler: wire.Reassembler, data: bytes, lane: Lane | None) -> tuple[object, int]:
    """One websocket message received: (the message it completes or None, the frame's bytes on both
    streams). A header alone is a lane frame where there is a lane; elsewhere the reassembler
    refuses it as a frame without data."""
    if lane is not None and len(data) == wire.HEADER_BYTES:
        message, data_bytes = await lane.receive(reassembler, data)
        return message, wire.HEADER_BYTES + data_bytes
    return reassembler.feed(data), len(data)


async def dial(
    http: aiohttp.ClientSession,
    ws_url: str,
    headers: dict[str, str],
    token: str,
    limits: LaneLimits,
    tls: ssl.SSLContext | None = None,
) -> Lane | None:
    """The learner's side of the setup: ask the syncer of `ws_url` where its lane listens (`GET
    /lane` with the websocket's `headers`; None when it answers 404: no lane) and open it with
    `token` on a thread (`open_lane`). Raises `aiohttp.ClientError`, `LaneError`, and ValueError,
    KeyError or TypeError for an answer it cannot read."""
    url = URL(ws_url)
    where = url.with_scheme("https" if url.scheme == "wss" else "http").with_path("/lane")
    # Connection: close, else the session would keep an idle HTTP connection to the daemon
    ask = headers | {"Connection": "close"}
    async with http.get(where, headers=ask, ssl=tls if tls is not None else True) as answer:
        if answer.status == 404:
            return None
        answer.raise_for_status()
        port = int((await answer.json())["port"])
    return await asyncio.to_thread(open_lane, url.host, port, token, limits, tls)


def open_lane(host: str, port: int, token: str, limits: LaneLimits, tls: ssl.SSLContext | None = None) -> Lane:
    """Connect to the syncer's lane and present `token` (blocking: run it on a thread), over TLS
    with `tls` (the websocket's context: the same certificate checks). Raises `LaneError` when the
    lane cannot be had; the caller goes on without one."""
    try:
        sock = socket.create_connection((host, port), timeout=limits.handshake_s_max)
    except OSError as exc:
        raise LaneError(f"cannot connect to the lane at {host}:{port}: {exc}") from exc
    try:
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=host)
        sock.sendall(LANE_HELLO.pack(LANE_MAGIC, LANE_VERSION, bytes.fromhex(token)))
        answer = bytearray(LANE_ANSWER.size)
        _read_exactly(sock, memoryview(answer), f"the answer of the lane at {host}:{port}")
        magic, status = LANE_ANSWER.unpack(answer)
        if magic != LANE_MAGIC or status != ATTACHED:
            raise LaneError(f"the lane at {host}:{port} refused: {STATUS_TEXT.get(status, status)}")
    except OSError as exc:
        sock.close()
        if isinstance(exc, LaneError):
            raise
        raise LaneError(f"lane handshake with {host}:{port} failed: {exc}") from exc
    return Lane(sock, limits)


class LaneListener:
    """The syncer's lane port: accepts connections, reads their hello within the limits, and hands
    each to `attach(token, sock) -> bool` (False: no websocket offered that token). Bad input
    closes that one connection and nothing else."""

    def __init__(
        self,
        host: str,
        port: int,
        limits: LaneLimits,
        attach: Callable[[bytes, socket.socket], bool],
        tls: ssl.SSLContext | None = None,
    ):
        self.limits = limits
        self._attach = attach
        self._tls = tls
        # TLS handshakes are blocking calls, each on a thread of this pool (at most handshakes_max wait)
        self._tls_pool = ThreadPoolExecutor(TLS_HANDSHAKE_THREADS, thread_name_prefix="ddiloco-lane-tls")
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]
        self._handshakes: set[asyncio.Task] = set()
        self._accepting: asyncio.Task | None = None

    def start(self) -> None:
        self._accepting = asyncio.get_running_loop().create_task(self._accept(), name="ddiloco-lane-accept")

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(self._sock)
            except OSError as exc:  # out of file descriptors, say: the next accept may work
                log.warning("lane: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            if len(self._handshakes) >= self.limits.handshakes_max:
                log.warning("lane: %s refused, %d handshakes already open", addr, len(self._handshakes))
                conn.close()
                continue
            task = loop.create_task(self._handshake(conn, addr))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _hello(self, conn: socket.socket) -> tuple[socket.socket, bytes]:
        """The connection (wrapped in TLS where the lane has it) and its hello's bytes."""
        loop = asyncio.get_running_loop()
        if self._tls is None:
            conn.setblocking(False)
            hello = await asyncio.wait_for(_recv_exactly(loop, conn, LANE_HELLO.size), self.limits.handshake_s_max)
            return conn, hello
        conn.setblocking(True)
        conn.settimeout(self.limits.handshake_s_max)
        work = loop.run_in_executor(self._tls_pool, _tls_hello, self._tls, conn)
        try:
            return await asyncio.wait_for(asyncio.shield(work), self.limits.handshake_s_max)
        except TimeoutError:
            _shut(conn)  # the thread's blocking read returns now
            raise

    async def _handshake(self, conn: socket.socket, addr) -> None:
        loop = asyncio.get_running_loop()
        try:
            conn, hello = await self._hello(conn)
            magic, version, token = LANE_HELLO.unpack(hello)
            if (magic, version) != (LANE_MAGIC, LANE_VERSION):
                status = BAD_HELLO
            elif self._attach(token, conn):
                # Attached before the answer, in one step of the loop: the learner sends lane frames
                # once it has the answer, and its websocket must find the lane there. Eight bytes
                # into a fresh socket's empty buffer (the lane's, blocking now) do not wait.
                conn.sendall(LANE_ANSWER.pack(LANE_MAGIC, ATTACHED))
                return
            else:
                status = UNKNOWN_TOKEN
            answer = LANE_ANSWER.pack(LANE_MAGIC, status)
            if self._tls is None:
                await asyncio.wait_for(loop.sock_sendall(conn, answer), self.limits.handshake_s_max)
            else:
                conn.sendall(answer)  # eight bytes, one record, into an empty buffer
        except (OSError, TimeoutError, EOFError) as exc:
            log.info("lane: handshake with %s failed: %s", addr, exc)
            conn.close()
            return
        log.warning("lane: %s refused: %s", addr, STATUS_TEXT[status])
        conn.close()

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        for task in list(self._handshakes):
            task.cancel()
        await asyncio.gather(*self._handshakes, *([self._accepting] if self._accepting else []), return_exceptions=True)
        self._sock.close()
        self._tls_pool.shutdown(wait=False)


class _Worker:
    """One daemon thread that runs blocking calls for the event loop, one at a time, in order. Not a
    ThreadPoolExecutor: its threads are joined at interpreter exit, and a lane's, blocked on a peer
    that went silent, would hold the process's exit for `stall_s_max`."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    async def run(self, fn: Callable, *args: object) -> object:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._jobs.put((fn, args, loop, done))
        return await done

    def stop(self) -> None:
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, loop, done = job
            try:
                outcome, value = True, fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine, raised there
                outcome, value = False, exc
            try:
                loop.call_soon_threadsafe(_settle, done, outcome, value)
            except RuntimeError:
                return  # the loop closed: nobody waits any more


def _settle(done: asyncio.Future, outcome: bool, value: object) -> None:
    if not done.done():  # else cancelled meanwhile (a send past its stall limit)
        if outcome:
            done.set_result(value)
        else:
            done.set_exception(value)


def _tls_hello(tls: ssl.SSLContext, conn: socket.socket) -> tuple[ssl.SSLSocket, bytes]:
    """The server's side of a TLS lane's handshake and its hello, blocking (on a pool thread)."""
    wrapped = tls.wrap_socket(conn, server_side=True)
    hello = bytearray(LANE_HELLO.size)
    _read_exactly(wrapped, memoryview(hello), "the lane's hello")
    return wrapped, bytes(hello)


def _read_exactly(sock: socket.socket, view: memoryview, what: str) -> None:
    """Fill `view` from `sock` (blocking, within the socket's timeout); `LaneError` when the peer
    closes first or the socket fails."""
    got = 0
    try:
        while got < len(view):
            n = sock.recv_into(view[got:])
            if n == 0:
                raise LaneError(f"{what}: closed by the peer after {got} of {len(view)} bytes")
            got += n
    except LaneError:
        raise
    except OSError as exc:  # socket.timeout included: a stalled peer
        raise LaneError(f"{what} failed: {type(exc).__name__} {exc}") from exc


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected any more


async def _recv_exactly(loop: asyncio.AbstractEventLoop, conn: socket.socket, nbytes: int) -> bytes:
    out = bytearray()
    while len(out) < nbytes:
        piece = await loop.sock_recv(conn, nbytes - len(out))
        if not piece:
            raise EOFError(f"closed after {len(out)} of {nbytes} bytes")
        out += piece
    return bytes(out)
