"""Consistent snapshots of the whole system (syncer + learners + messages in flight), Chandy-Lamport style.

docs/algorithm.md, "Recovery, snapshots, replay". The topology is a star of FIFO channels (one websocket
per learner, each direction in order). The syncer starts a snapshot between two events of its core
(on a timer, on `POST /snapshot`, or `ddiloco snapshot URL`): it records its own state (a checkpoint)
and sends a marker to every connected learner. A learner records its local state at its next step
boundary (parameters, optimizer state, step, and its sync state: versions held, their bases, counters,
error-feedback residuals) and sends it back, behind every push it made before. Every message the
syncer's core takes from learner i after the cut and before learner i's local state is the state of
the channel i -> syncer: recorded in the snapshot. The channel syncer -> learner i needs no record:
what was in flight on it at the cut is the syncer's newer fragment versions, which a restored syncer
sends to every (re)joining learner anyway (the snapshot notes which). A learner that leaves before its
state arrives, or does not answer within `wait_s_max`, is left out (as if it had failed at the cut).

A snapshot is a directory, written under a temporary name and renamed when complete:

    manifest.json                  what is in it, with the sha256 of every file
    ckpt-....safetensors           the syncer's state (core.checkpoint, of run net.store.NO_RUN;
                                   `ddiloco syncer --resume DIR` reads it and starts a new run from it)
    learner-<id>.ddls              each learner's local state (net.peer snapshot bytes; learner.sync)
    inflight/<sha256>              payloads of the messages in flight (pushes, initial fragments)

`Taker` is the protocol as a state machine without sockets, threads, a clock or a file system: it
keeps the cut, the open channels and the messages in flight, composes the manifest, and hands the
bytes to a `SnapshotStore`. The daemon's core thread drives it between two events (`net.server`)
with a `DirectoryStore` (every file through net.files: atomic, and a failure names the path and the
cause); the chaos simulation drives the same machine over its simulated network with the files kept
in memory (`chaos.shell`), and checks every snapshot it completes (`chaos.invariants`). `read`
checks a snapshot directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import orjson

from ddiloco.core import checkpoint
from ddiloco.core import codec as codecs
from ddiloco.core import events as ev
from ddiloco.core.syncer import SyncerState, state_hash
from ddiloco.errors import UserError
from ddiloco.net import files
from ddiloco.net.store import NO_RUN, checkpoint_name

__all__ = [
    "FORMAT",
    "INFLIGHT_DIR",
    "MANIFEST",
    "SNAPSHOTS_KEPT_DEFAULT",
    "WAIT_S_MAX_DEFAULT",
    "DirectoryStore",
    "Outcome",
    "Snapshot",
    "SnapshotError",
    "SnapshotStore",
    "Taker",
    "local_state_of",
    "read",
]

FORMAT = 1
MANIFEST = "manifest.json"
INFLIGHT_DIR = "inflight"
WAIT_S_MAX_DEFAULT = 120.0  # how long a snapshot waits for the learners' local states
SNAPSHOTS_KEPT_DEFAULT = 5
LOCAL_STATE_BYTES_MAX = 16 << 30


class SnapshotError(UserError, ValueError):
    """A snapshot that cannot be written, or a directory that is not a complete, intact snapshot."""


class SnapshotStore(Protocol):
    """Where the files of the snapshot being taken go. The daemon's is a directory (`DirectoryStore`);
    the chaos simulation keeps them in memory. At most one snapshot is open at a time. `put` and
    `commit` raise OSError when the bytes cannot be kept (the `Taker` decides what that means)."""

    def open(self, name: str) -> None:
        """A new snapshot called `name` (not visible as complete until `commit`)."""

    def put(self, name: str, parts: Sequence[bytes | bytearray | memoryview]) -> None:
        """Keep one file of the open snapshot: the syncer's state, a learner's state, a payload in flight."""

    def commit(self, manifest: bytes) -> str:
        """Keep the manifest and make the snapshot complete; returns where it is now."""

    def abandon(self) -> None:
        """Drop the open snapshot and whatever of it was kept."""


class DirectoryStore:
    """A snapshot per directory under `root`: written under a hidden temporary name through net.files,
    renamed into place when complete; the newest `kept` complete ones stay."""

    def __init__(self, root: Path | str, kept: int = SNAPSHOTS_KEPT_DEFAULT):
        assert kept >= 1, kept
        self.root, self.kept = Path(root), kept
        self._final: Path | None = None

    @property
    def _tmp(self) -> Path:
        assert self._final is not None, "no snapshot is open"
        return self._final.with_name(f".{self._final.name}.tmp")

    def open(self, name: str) -> None:
        self._final = self.root / name
        shutil.rmtree(self._tmp, ignore_errors=True)
        files.make_directory(self._tmp / INFLIGHT_DIR, what="create a snapshot's directory")

    def put(self, name: str, parts: Sequence[bytes | bytearray | memoryview]) -> None:
        files.write_atomic(self._tmp / name, parts, what=f"write snapshot file {name}")

    def commit(self, manifest: bytes) -> str:
        files.write_atomic(self._tmp / MANIFEST, [manifest], what="write a snapshot's manifest")
        final, tmp = self._final, self._tmp
        os.replace(tmp, final)
        self._final = None
        files.fsync_directory(final.parent)
        done = sorted(p for p in final.parent.glob("snap-*") if (p / MANIFEST).exists())
        for old in done[: -self.kept]:
            shutil.rmtree(old, ignore_errors=True)
        return str(final)

    def abandon(self) -> None:
        if self._final is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._final = None


@dataclass
class Snapshot:
    """One snapshot being taken: the cut, and the channels still recording."""

    ident: int
    name: str
    syncer_file: str
    syncer_sha256: str
    versions: tuple[int, ...]
    global_step: int
    learners: dict[int, str]  # learner id -> name, the channels recorded (those connected at the cut)
    started_at: float
    open: set[int] = field(default_factory=set)  # channels still recording
    states: dict[int, dict] = field(default_factory=dict)  # learner id -> file facts
    inflight: list[dict] = field(default_factory=list)
    left_out: dict[int, str] = field(default_factory=dict)  # learner id -> why
    meta: dict = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return not self.open

    def manifest(self, now: float) -> dict:
        """What the snapshot holds, with the sha256 of every file (channels still open: left out)."""
        left_out = dict(self.left_out)
        for learner in sorted(self.open):
            left_out[learner] = "no local state within the snapshot's wait limit"
        digests = {self.syncer_file: self.syncer_sha256}
        digests |= {s["file"]: s["sha256"] for s in self.states.values()}
        for r in self.inflight:
            for value in r["fields"].values():
                if isinstance(value, dict) and "sha256" in value:
                    digests[f"{INFLIGHT_DIR}/{value['sha256']}"] = value["sha256"]
        return {
            "format": FORMAT,
            "snapshot": self.ident,
            "syncer": self.syncer_file,
            **self.meta,
            "versions": list(self.versions),
            "global_step": self.global_step,
            "seconds": round(now - self.started_at, 3),
            "learners": {str(k): v for k, v in sorted(self.states.items())},
            "left_out": {str(k): v for k, v in sorted(left_out.items())},
            "inflight": self.inflight,
            "files": digests,
        }


@dataclass(frozen=True)
class Outcome:
    """A snapshot that ended: its summary, or why it failed."""

    ident: int
    summary: dict | None
    error: SnapshotError | None
    manifest: dict | None = None  # what was committed (None on failure)


class Taker:
    """The snapshot protocol: at most one snapshot at a time, driven between two core events.

    `start` records the syncer's state and names the learners to send a marker to; `record` sees every
    event the core handles after the cut; `local_state` and `timeout` close channels. Each of the last
    two returns an `Outcome` when the snapshot ended with it. The files go to a `SnapshotStore`
    (a directory path makes a `DirectoryStore`; None: no snapshot can be taken). No clock is read
    and no socket or thread is touched: the daemon's core thread and the chaos simulation drive it
    alike."""

    def __init__(self, store: SnapshotStore | Path | str | None, kept: int = SNAPSHOTS_KEPT_DEFAULT):
        if isinstance(store, (str, os.PathLike)):
            store = DirectoryStore(store, kept)
        self.store: SnapshotStore | None = store
        self.taking: Snapshot | None = None
        self._next_ident = 1

    def start(self, state: SyncerState, learners: dict[int, str], vclock: dict[str, int], now: float) -> Snapshot:
        """Begin a snapshot (SnapshotError when none can be taken now): markers go to `learners`."""
        problem = (
            "no snapshot directory configured"
            if self.store is None
            else "the syncer holds no parameters yet"
            if not state.holds_parameters
            else f"snapshot {self.taking.ident} is still being taken"
            if self.taking is not None
            else None
        )
        if problem:
            raise SnapshotError(f"no snapshot: {problem}")
        ident, self._next_ident = self._next_ident, self._next_ident + 1
        chunks = checkpoint.to_chunks(state, run=NO_RUN)
        syncer_file = checkpoint_name(NO_RUN, 1, state.merges, checkpoint.content_hash(chunks))
        digest = hashlib.sha256()
        for chunk in chunks:
            digest.update(chunk)
        name = f"snap-{state.merges:012d}-{ident:06d}"
        try:
            self.store.open(name)
            self.store.put(syncer_file, chunks)
        except OSError as exc:
            self.store.abandon()
            raise SnapshotError(f"snapshot {ident} not taken: {files.describe(exc)}") from exc
        self.taking = Snapshot(
            ident,
            name,
            syncer_file,
            digest.hexdigest(),
            tuple(f.version for f in state.fragments),
            state.global_step,
            dict(learners),
            now,
            open=set(learners),
            meta={"syncer_state_hash": state_hash(state), "syncer_clock": dict(vclock), "merges": state.merges},
        )
        return self.taking

    def record(self, event: ev.Event) -> str | None:
        """The core takes `event`: channel state while its channel is open. A store that fails abandons
        the snapshot (returned: why), never the event."""
        snap = self.taking
        learner = getattr(event, "learner", None)
        if snap is None or learner not in snap.open:
            return None
        if isinstance(event, ev.Disconnect):
            snap.open.discard(learner)
            snap.left_out[learner] = f"left before its local state arrived ({event.reason})"
            return None
        fields = {}
        try:
            for f in dataclasses.fields(event):
                value = getattr(event, f.name)
                if isinstance(value, codecs.Encoded):
                    body = value.body  # scales then codes, as received
                    sha = hashlib.sha256(body).hexdigest()
                    self.store.put(f"{INFLIGHT_DIR}/{sha}", [body])
                    value = {
                        "codec": value.codec.value,
                        "block": value.block,
                        "elements": value.elements,
                        "sha256": sha,
                    }
                elif isinstance(value, tuple):
                    value = list(value)
                fields[f.name] = value
        except OSError as exc:
            self.abandon()
            return f"snapshot {snap.ident} abandoned: {files.describe(exc)}"
        snap.inflight.append({"learner": learner, "kind": type(event).__name__, "fields": fields})
        return None

    def local_state(
        self, learner: int, ident: int, data: bytes, sha256: str, now: float
    ) -> tuple[str | None, Outcome | None]:
        """A learner's local state arrived: (what is wrong with it, if anything; the outcome, if it ended)."""
        snap = self.taking
        if snap is None or snap.ident != ident:
            return f"learner {learner}: a local state for snapshot {ident}, which is not being taken", None
        problem = self._keep_local_state(snap, learner, data, sha256)
        return problem, (self._finish(now) if snap.complete else None)

    def timeout(self, ident: int, now: float) -> Outcome | None:
        """The wait limit of snapshot `ident` passed: the learners not in are left out."""
        if self.taking is None or self.taking.ident != ident:
            return None
        return self._finish(now)

    def abandon(self) -> int | None:
        """The syncer stops: the snapshot being taken (its id returned) is dropped."""
        if self.taking is None:
            return None
        snap, self.taking = self.taking, None
        self.store.abandon()
        return snap.ident

    def _keep_local_state(self, snap: Snapshot, learner: int, data: bytes, sha256: str) -> str | None:
        if learner not in snap.open:
            return f"learner {learner} is not a channel of snapshot {snap.ident} (joined after the cut, or already in)"
        snap.open.discard(learner)
        got = hashlib.sha256(data).hexdigest()
        if got != sha256:
            snap.left_out[learner] = "its local state did not match its sha256 (damaged in transit)"
            return f"learner {learner}: local state hashes {got[:16]}, the message says {sha256[:16]}"
        name = f"learner-{learner}.ddls"
        try:
            self.store.put(name, [data])
        except OSError as exc:  # the disk, not the learner: the snapshot goes on without this state
            snap.left_out[learner] = f"its local state could not be written ({files.cause(exc)})"
            return files.describe(exc)
        snap.states[learner] = {"file": name, "bytes": len(data), "sha256": got, "name": snap.learners[learner]}
        return None

    def _finish(self, now: float) -> Outcome:
        snap, self.taking = self.taking, None
        manifest = snap.manifest(now)
        try:
            where = self.store.commit(orjson.dumps(manifest, option=orjson.OPT_INDENT_2))
        except OSError as exc:
            self.store.abandon()
            error = SnapshotError(f"cannot complete snapshot {snap.ident}: {files.describe(exc)}")
            return Outcome(snap.ident, None, error)
        summary = {
            "snapshot": snap.ident,
            "directory": where,
            "learners": len(snap.states),
            "inflight": len(snap.inflight),
            "left_out": manifest["left_out"],
        }
        return Outcome(snap.ident, summary, None, manifest)


def read(directory: Path | str) -> dict:
    """The manifest of a complete snapshot, every file checked against its sha256."""
    directory = Path(directory)
    try:
        manifest = orjson.loads((directory / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise SnapshotError(f"{directory} is not a complete snapshot: no {MANIFEST}") from None
    except (OSError, orjson.JSONDecodeError) as exc:
        raise SnapshotError(f"{directory / MANIFEST} cannot be read: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SnapshotError(f"{directory / MANIFEST} is not snapshot format {FORMAT}")
    for name, sha in manifest.get("files", {}).items():
        try:
            got = _sha256_file(directory / name)
        except OSError as exc:
            raise SnapshotError(
                f"snapshot {directory.name}: {name} is missing or unreadable ({exc.strerror or exc})"
            ) from exc
        if got != sha:
            raise SnapshotError(
                f"snapshot {directory.name}: {name} hashes {got[:16]}, the manifest says {sha[:16]} (damaged)"
            )
    return manifest


def local_state_of(directory: Path | str, manifest: dict, name: str) -> bytes | None:
    """The local state of the learner called `name` in the snapshot (None: it was left out)."""
    for entry in manifest["learners"].values():
        if entry["name"] == name:
            return (Path(directory) / entry["file"]).read_bytes()
    return None


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
