"""Learner <-> learner: a learner serves a snapshot of its state; a (re)joining one fetches it.

docs/algorithm.md, "Recovery, snapshots, replay". The server is a small aiohttp app on its own thread and
event loop (a slow download never delays the syncer connection's heartbeats). It never reads the
training state itself: a request raises a flag in a `SnapshotBox`, the training loop publishes a
snapshot at its next step boundary, and the server sends those bytes. So nothing races the loop.

Snapshot format (no pickle; little-endian):

    0    8    magic b"DDPEER01"
    8    8    manifest bytes M
    16   M    manifest, JSON: {"meta": {...}, "arrays": [{name, dtype, shape, offset, nbytes}]}
    ...       each array's raw bytes at its offset (from the end of the manifest)
    end-32 32 sha256 of every byte before it

Both sides hold the same bearer token as the syncer, and every size and wait has a named limit.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import struct
import threading
from dataclasses import dataclass

import aiohttp
import numpy as np
import orjson
from aiohttp import web

from ddiloco.errors import FaultError
from ddiloco.net.auth import bearer_matches

log = logging.getLogger("ddiloco.peer")

MAGIC = b"DDPEER01"
_HEAD = struct.Struct("<8sQ")
_DIGEST_BYTES = 32
MANIFEST_BYTES_MAX = 16 << 20
ARRAYS_MAX = 100_000
_DTYPES = {
    name: np.dtype(name)
    for name in ("float64", "float32", "float16", "int64", "int32", "uint32", "int8", "uint8", "bool")
}
try:  # bf16 leaves exist only where jax (and so ml_dtypes) does; the base install has neither
    import ml_dtypes

    _DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - the learner extra brings it
    pass


class PeerError(FaultError, RuntimeError):
    """A snapshot could not be had from a peer, or what came is unusable; the text says why."""

    what_to_do = "check that the peer named above is up, reachable and serving an intact snapshot"


@dataclass(frozen=True)
class Snapshot:
    meta: dict  # JSON-able facts (step, versions, the layout digest ...)
    arrays: dict[str, np.ndarray]  # read-only views into the received bytes


# ---- the format ------------------------------------------------------------------------------------


def encode_snapshot(meta: dict, arrays: dict[str, np.ndarray]) -> bytes:
    """One snapshot as bytes (the arrays are copied once, into the result)."""
    if len(arrays) > ARRAYS_MAX:
        raise PeerError(f"a snapshot holds at most {ARRAYS_MAX} arrays, got {len(arrays)}")
    entries, offset = [], 0
    for name, arr in arrays.items():
        dtype = str(arr.dtype)
        if dtype not in _DTYPES:
            raise PeerError(f"array {name!r} has dtype {dtype}, which a snapshot does not carry")
        entries.append({"name": name, "dtype": dtype, "shape": list(arr.shape), "offset": offset, "nbytes": arr.nbytes})
        offset += arr.nbytes
    manifest = orjson.dumps({"meta": meta, "arrays": entries})
    out = bytearray(_HEAD.pack(MAGIC, len(manifest)) + manifest)
    for arr in arrays.values():
        out += np.ascontiguousarray(arr).tobytes()
    out += hashlib.sha256(out).digest()
    return bytes(out)


def decode_snapshot(data: bytes) -> Snapshot:
    """The snapshot in `data`; PeerError naming what is wrong when it is corrupt or truncated."""
    if len(data) < _HEAD.size + _DIGEST_BYTES:
        raise PeerError(f"snapshot of {len(data)} bytes is too short to be one")
    body, digest = memoryview(data)[:-_DIGEST_BYTES], data[-_DIGEST_BYTES:]
    if hashlib.sha256(body).digest() != digest:
        raise PeerError("snapshot content hash does not match: corrupt or truncated")
    magic, manifest_len = _HEAD.unpack_from(body)
    if magic != MAGIC:
        raise PeerError(f"not a peer snapshot (magic {magic!r})")
    if manifest_len > min(MANIFEST_BYTES_MAX, len(body) - _HEAD.size):
        raise PeerError(f"snapshot manifest of {manifest_len} bytes does not fit")
    start = _HEAD.size + manifest_len
    try:
        manifest = orjson.loads(body[_HEAD.size : start])
        arrays = {e["name"]: _array(body, start, e) for e in manifest["arrays"][:ARRAYS_MAX]}
        meta = manifest["meta"]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise PeerError(f"malformed snapshot manifest: {exc}") from exc
    if not isinstance(meta, dict):
        raise PeerError("malformed snapshot manifest: meta is not an object")
    return Snapshot(meta, arrays)


def _array(body: memoryview, start: int, entry: dict) -> np.ndarray:
    dtype = _DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ValueError(f"array {entry['name']!r} has unknown dtype {entry['dtype']!r}")
    shape = tuple(int(d) for d in entry["shape"])
    offset, nbytes = int(entry["offset"]), int(entry["nbytes"])
    if min(shape, default=0) < 0 or nbytes != int(np.prod(shape)) * dtype.itemsize:
        raise ValueError(f"array {entry['name']!r}: {nbytes} bytes do not make {entry['dtype']}{list(shape)}")
    if offset < 0 or start + offset + nbytes > len(body):
        raise ValueError(f"array {entry['name']!r} lies outside the snapshot")
    raw = body[start + offset : start + offset + nbytes]
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


# ---- between the server thread and the training loop -------------------------------------------------


class SnapshotBox:
    """Where the training loop hands a snapshot to the server: the server asks (`wanted` turns
    true), the loop publishes at its next step boundary, the server takes it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._wanted = False
        self._data: bytes | None = None

    @property
    def wanted(self) -> bool:
        return self._wanted

    def publish(self, data: bytes) -> None:
        with self._lock:
            self._data, self._wanted = data, False
            self._ready.set()

    def _ask(self) -> None:
        with self._lock:
            self._data, self._wanted = None, True
            self._ready.clear()

    def _wait(self, timeout_s: float) -> bytes | None:
        if not self._ready.wait(timeout_s):
            with self._lock:
                self._wanted = False
            return None
        with self._lock:
            return self._data


# ---- the server -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerConfig:
    host: str = "127.0.0.1"  # where to listen; a multi-host cluster listens on "0.0.0.0"
    port: int = 0  # 0: any free port
    advertise_host: str | None = None  # what peers dial (default: host)
    token: str | None = None  # the syncer's bearer token
    snapshot_wait_s_max: float = 60.0  # how long a request waits for the loop's next step boundary

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must lie in [0, 65536), got {self.port}")
        if self.snapshot_wait_s_max <= 0:
            raise ValueError("snapshot_wait_s_max must be positive")


class PeerServer:
    """GET /snapshot on its own thread; `url` is what goes into the hello."""

    def __init__(self, box: SnapshotBox, config: PeerConfig):
        self.box, self.config = box, config
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._serving = asyncio.Lock()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.port = 0
        self.served = 0
        self._thread = threading.Thread(target=self._main, name="ddiloco-peer", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise PeerError(f"cannot serve snapshots on {config.host}:{config.port}: {self._error}") from self._error

    @property
    def url(self) -> str:
        return f"http://{self.config.advertise_host or self.config.host}:{self.port}/snapshot"

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start())
        except OSError as exc:
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/snapshot", self._snapshot)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _snapshot(self, request: web.Request) -> web.Response:
        if not bearer_matches(request.headers.get("Authorization"), self.config.token):
            return web.Response(status=401, text="missing or wrong token")
        async with self._serving:  # one snapshot at a time: each one is a full copy of the state
            self.box._ask()
            data = await asyncio.to_thread(self.box._wait, self.config.snapshot_wait_s_max)
        if data is None:
            return web.Response(status=503, text="the training loop published no snapshot in time")
        self.served += 1
        return web.Response(body=data, content_type="application/octet-stream")

    def close(self, timeout_s: float = 5.0) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)


# ---- the client -----------------------------------------------------------------------------------------


async def fetch_snapshot_async(url: str, token: str | None, timeout_s: float, snapshot_bytes_max: int) -> Snapshot:
    """The peer's snapshot, checked; PeerError on any failure (translated here, once)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
            async with http.get(url, headers=headers) as resp:
                if resp.status != 200:
                    text = (await resp.content.read(200)).decode(errors="replace")
                    raise PeerError(f"peer {url} answered HTTP {resp.status}: {text}")
                if (resp.content_length or 0) > snapshot_bytes_max:
                    raise PeerError(
                        f"peer {url} offers {resp.content_length} bytes, above snapshot_bytes_max {snapshot_bytes_max}"
                    )
                data = await resp.content.read(snapshot_bytes_max + 1)
                while len(data) <= snapshot_bytes_max and not resp.content.at_eof():
                    more = await resp.content.read(snapshot_bytes_max + 1 - len(data))
                    if not more:
                        break
                    data += more
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise PeerError(f"cannot fetch a snapshot from {url}: {type(exc).__name__}: {exc}") from exc
    if len(data) > snapshot_bytes_max:
        raise PeerError(f"snapshot from {url} is above snapshot_bytes_max {snapshot_bytes_max}")
    return decode_snapshot(data)


def fetch_snapshot(url: str, token: str | None, timeout_s: float, snapshot_bytes_max: int) -> Snapshot:
    """`fetch_snapshot_async` for a thread without a running event loop (a training loop at start)."""
    return asyncio.run(fetch_snapshot_async(url, token, timeout_s, snapshot_bytes_max))
