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

This module writes and checks those files (every file through net.files: atomic, and a failure
names the path and the cause). `Taker` is the protocol as a state machine without sockets, threads
or a clock: the daemon's core thread drives it (`net.server`) between two events, and a test drives
it directly. No clock is read here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from ddiloco.core import checkpoint
from ddiloco.core import codec as codecs
from ddiloco.core import events as ev
from ddiloco.core.syncer import SyncerState, state_hash
from ddiloco.errors import UserError
from ddiloco.net import files
from ddiloco.net.store import NO_RUN, checkpoint_name

FORMAT = 1
MANIFEST = "manifest.json"
INFLIGHT_DIR = "inflight"
WAIT_S_MAX_DEFAULT = 120.0  # how long a snapshot waits for the learners' local states
SNAPSHOTS_KEPT_DEFAULT = 5
LOCAL_STATE_BYTES_MAX = 16 << 30


class SnapshotError(UserError, ValueError):
    """A snapshot that cannot be written, or a directory that is not a complete, intact snapshot."""


@dataclass
class Snapshot:
    """One snapshot being taken."""

    ident: int
    directory: Path  # the temporary directory until `finish`
    final: Path
    syncer_file: str
    versions: tuple[int, ...]
    global_step: int
    learners: dict[int, str]  # learner id -> name, the channels recorded (those connected at the cut)
    started_at: float
    open: set[int] = field(default_factory=set)  # channels still recording
    states: dict[int, dict] = field(default_factory=dict)  # learner id -> file facts
    inflight: list[dict] = field(default_factory=list)
    left_out: dict[int, str] = field(default_factory=dict)  # learner id -> why
    meta: dict = field(default_factory=dict)


def begin(
    root: Path, ident: int, state: SyncerState, learners: dict[int, str], vclock: dict[str, int], now: float
) -> Snapshot:
    """Record the syncer's state (on the core thread, between two events) and open a channel per learner."""
    final = Path(root) / f"snap-{state.merges:012d}-{ident:06d}"
    tmp = final.with_name(f".{final.name}.tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / INFLIGHT_DIR).mkdir(parents=True)
        chunks = checkpoint.to_chunks(state, run=NO_RUN)
        name = checkpoint_name(NO_RUN, 1, state.merges, checkpoint.content_hash(chunks))
        files.write_atomic(tmp / name, chunks, what=f"write snapshot {ident}'s syncer state")
    except OSError as exc:
        raise SnapshotError(f"snapshot {ident} not taken in {root}: {files.describe(exc)}") from exc
    snap = Snapshot(
        ident,
        tmp,
        final,
        name,
        tuple(f.version for f in state.fragments),
        state.global_step,
        dict(learners),
        now,
        open=set(learners),
        meta={"syncer_state_hash": state_hash(state), "syncer_clock": dict(vclock), "merges": state.merges},
    )
    return snap


def record_inflight(snap: Snapshot, event: ev.Event) -> None:
    """A learner's message taken by the core after the cut: channel state, while its channel is open."""
    learner = getattr(event, "learner", None)
    if learner not in snap.open:
        return
    if isinstance(event, ev.Disconnect):
        snap.open.discard(learner)
        snap.left_out[learner] = f"left before its local state arrived ({event.reason})"
        return
    fields = {}
    for f in dataclasses.fields(event):
        value = getattr(event, f.name)
        if isinstance(value, codecs.Encoded):
            body = value.body  # scales then codes, as received
            sha = hashlib.sha256(body).hexdigest()
            files.write_atomic(
                snap.directory / INFLIGHT_DIR / sha, [body], what=f"write snapshot {snap.ident}'s message in flight"
            )
            value = {"codec": value.codec.value, "block": value.block, "elements": value.elements, "sha256": sha}
        elif isinstance(value, tuple):
            value = list(value)
        fields[f.name] = value
    snap.inflight.append({"learner": learner, "kind": type(event).__name__, "fields": fields})


def local_state(snap: Snapshot, learner: int, data: bytes, sha256: str) -> str | None:
    """Learner `learner`'s state arrived: store it and close its channel. Returns what is wrong, if anything."""
    if learner not in snap.open:
        return f"learner {learner} is not a channel of snapshot {snap.ident} (joined after the cut, or already in)"
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        snap.open.discard(learner)
        snap.left_out[learner] = "its local state did not match its sha256 (damaged in transit)"
        return f"learner {learner}: local state hashes {got[:16]}, the message says {sha256[:16]}"
    name = f"learner-{learner}.ddls"
    snap.open.discard(learner)
    try:
        files.write_atomic(snap.directory / name, [data], what=f"write snapshot {snap.ident}'s learner state")
    except files.FileError as exc:  # the disk, not the learner: the snapshot goes on without this state
        snap.left_out[learner] = f"its local state could not be written ({exc.strerror})"
        return str(exc)
    snap.states[learner] = {"file": name, "bytes": len(data), "sha256": got, "name": snap.learners[learner]}
    return None


def complete(snap: Snapshot) -> bool:
    return not snap.open


def finish(snap: Snapshot, now: float, kept: int = SNAPSHOTS_KEPT_DEFAULT) -> Path:
    """Write the manifest (channels still open are left out, timed out) and rename into place."""
    for learner in sorted(snap.open):
        snap.left_out[learner] = "no local state within the snapshot's wait limit"
    snap.open.clear()
    digests = {snap.syncer_file: _sha256_file(snap.directory / snap.syncer_file)}
    digests |= {s["file"]: s["sha256"] for s in snap.states.values()}
    for r in snap.inflight:
        for value in r["fields"].values():
            if isinstance(value, dict) and "sha256" in value:
                digests[f"{INFLIGHT_DIR}/{value['sha256']}"] = value["sha256"]
    manifest = {
        "format": FORMAT,
        "snapshot": snap.ident,
        "syncer": snap.syncer_file,
        **snap.meta,
        "versions": list(snap.versions),
        "global_step": snap.global_step,
        "seconds": round(now - snap.started_at, 3),
        "learners": {str(k): v for k, v in sorted(snap.states.items())},
        "left_out": {str(k): v for k, v in sorted(snap.left_out.items())},
        "inflight": snap.inflight,
        "files": digests,
    }
    try:
        files.write_atomic(
            snap.directory / MANIFEST,
            [orjson.dumps(manifest, option=orjson.OPT_INDENT_2)],
            what=f"write snapshot {snap.ident}'s manifest",
        )
        os.replace(snap.directory, snap.final)
        files.fsync_directory(snap.final.parent)
        _prune(snap.final.parent, kept)
    except OSError as exc:
        raise SnapshotError(f"cannot complete snapshot {snap.ident}: {files.describe(exc)}") from exc
    return snap.final


@dataclass(frozen=True)
class Outcome:
    """A snapshot that ended: its summary, or why it failed."""

    ident: int
    summary: dict | None
    error: SnapshotError | None


class Taker:
    """At most one snapshot at a time, driven between two core events.

    `start` records the syncer's state and names the learners to send a marker to; `record` sees every
    event the core handles after the cut; `local_state` and `timeout` close channels. Each of the last
    two returns an `Outcome` when the snapshot ended with it."""

    def __init__(self, root: Path | None, kept: int = SNAPSHOTS_KEPT_DEFAULT):
        self.root, self.kept = root, kept
        self.taking: Snapshot | None = None
        self._next_ident = 1

    def start(self, state: SyncerState, learners: dict[int, str], vclock: dict[str, int], now: float) -> Snapshot:
        """Begin a snapshot (SnapshotError when none can be taken now): markers go to `learners`."""
        problem = (
            "no snapshot directory configured"
            if self.root is None
            else "the syncer holds no parameters yet"
            if not state.holds_parameters
            else f"snapshot {self.taking.ident} is still being taken"
            if self.taking is not None
            else None
        )
        if problem:
            raise SnapshotError(f"no snapshot: {problem}")
        ident, self._next_ident = self._next_ident, self._next_ident + 1
        self.taking = begin(self.root, ident, state, learners, vclock, now)
        return self.taking

    def record(self, event: ev.Event) -> str | None:
        """The core takes `event`: channel state while its channel is open. A disk that fails abandons
        the snapshot (returned: why), never the event."""
        if self.taking is None:
            return None
        try:
            record_inflight(self.taking, event)
        except OSError as exc:
            snap, self.taking = self.taking, None
            abandon(snap)
            return f"snapshot {snap.ident} abandoned: {exc}"
        return None

    def local_state(
        self, learner: int, ident: int, data: bytes, sha256: str, now: float
    ) -> tuple[str | None, Outcome | None]:
        """A learner's local state arrived: (what is wrong with it, if anything; the outcome, if it ended)."""
        snap = self.taking
        if snap is None or snap.ident != ident:
            return f"learner {learner}: a local state for snapshot {ident}, which is not being taken", None
        problem = local_state(snap, learner, data, sha256)
        return problem, (self._finish(now) if complete(snap) else None)

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
        abandon(snap)
        return snap.ident

    def _finish(self, now: float) -> Outcome:
        snap, self.taking = self.taking, None
        try:
            path = finish(snap, now, self.kept)
        except SnapshotError as exc:
            abandon(snap)
            return Outcome(snap.ident, None, exc)
        summary = {
            "snapshot": snap.ident,
            "directory": str(path),
            "learners": len(snap.states),
            "inflight": len(snap.inflight),
            "left_out": {str(k): v for k, v in snap.left_out.items()},
        }
        return Outcome(snap.ident, summary, None)


def abandon(snap: Snapshot) -> None:
    shutil.rmtree(snap.directory, ignore_errors=True)


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


def _prune(root: Path, kept: int) -> None:
    done = sorted(p for p in root.glob("snap-*") if (p / MANIFEST).exists())
    for old in done[:-kept]:
        shutil.rmtree(old, ignore_errors=True)
