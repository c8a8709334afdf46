"""A learner's tape: everything its training loop received from the outside, so it can be re-executed.

`ddiloco demo --record DIR` gives every learner process its own tape directory (one per incarnation:
a learner killed and started again writes a new one). Together with the syncer's tape they let
`ddiloco replay DIR --full` re-run the whole system in one process (demo.replay, docs/replay.md).

What a learner's trajectory depends on, and so what is recorded: its configuration and seed (the
header; never the token), the welcome(s) it got, the state it recovered from a peer (the snapshot
bytes, stored), and, per call of the sync hook, what the hook took from the network: arrived
fragment versions (their payloads stored) and errors. The welcome keeps its round schedule (period
and offsets): the learner pushes on it (protocol 2). What it produced is recorded
too, to be checked: its pushes and initial fragments (payload hashes), the snapshots it published for
peers, and at a clean end the hash of its final parameters. Records are written before the message
they describe leaves the process, so a SIGKILL never loses the record of something the syncer saw.

The file format is core.tape's (framed, checksummed JSON records; torn tail cut on reading), written
and read by net.recording, with its own magic, `learner.ddtp` beside a `payloads/` store.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ddiloco.core import codec as codecs
from ddiloco.core import tape as tapes
from ddiloco.core.events import Push
from ddiloco.net import recording, session

__all__ = [
    "KINDS",
    "MAGIC",
    "TAPE_FILE",
    "LearnerTape",
    "LearnerTapeError",
    "LearnerTapeWriter",
    "config_json",
    "payload_body",
    "payload_sha256",
    "read",
    "sha256",
]

MAGIC = b"DDLTAPE\x01"
TAPE_FILE = "learner.ddtp"
KINDS = ("header", "welcome", "recover", "take", "push", "dropped", "init", "publish", "close")


class LearnerTapeError(tapes.TapeError):
    """A learner tape that cannot be read or does not fit the code replaying it."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def payload_body(payload: bytes) -> bytes:
    """The body of codec bytes (header stripped), as the syncer's tape hashes and stores it."""
    return bytes(codecs.parse(payload).body)


def payload_sha256(enc: codecs.Encoded) -> str:
    """sha256 of a payload's codec bytes, header and body (what a push record has always named)."""
    return tapes.sha256_of([enc.header(), enc.body])


def _welcome_json(w: session.WelcomeInfo) -> dict:
    return asdict(w)


def _welcome(d: dict) -> session.WelcomeInfo:
    peers = tuple(session.PeerInfo(p["learner"], p["url"], tuple(p["versions"])) for p in d.get("peers", ()))
    return session.WelcomeInfo(
        d["learner"],
        d["layout"],
        d["digest"],
        tuple(d["versions"]),
        d["global_step"],
        d["needs_init"],
        peers,
        d.get("period", 1),
        tuple(d.get("offsets", ())),
        d.get("shard", 0),
        d.get("shards", 1),
        None if d.get("init_shards") is None else tuple(d["init_shards"]),
    )


class LearnerTapeWriter(recording.RecordWriter):
    """Appends one learner incarnation's records. The training thread owns it."""

    @classmethod
    def create(cls, directory: Path | str, config: dict, options: tapes.TapeOptions | None = None) -> LearnerTapeWriter:
        directory = Path(directory)
        writer = cls(directory, recording.open_record_file(directory, TAPE_FILE, MAGIC), options or tapes.TapeOptions())
        writer._append({"type": "header", "format": tapes.FORMAT, "kind": "learner", "config": config})
        writer.sync()
        return writer

    def welcome(self, count: int, welcome: session.WelcomeInfo) -> None:
        self._append({"type": "welcome", "count": count, "welcome": _welcome_json(welcome)})

    def recovered(self, source: str, step: int, versions: tuple[int, ...], snapshot: bytes | None) -> None:
        sha = self._store([snapshot]) if snapshot is not None else None
        self._append({"type": "recover", "source": source, "step": step, "versions": list(versions), "snapshot": sha})

    def take(
        self,
        call: int,
        updates: dict,
        errors: list,
        welcomes: int,
        welcome: session.WelcomeInfo | None,
        new_welcome: bool,
    ) -> None:
        """What one call of the sync hook took from the network (only written when it took something)."""
        if not (updates or errors or new_welcome):
            return
        self._append(
            {
                "type": "take",
                "call": call,
                # [fragment, version, payload, base version, the syncer's global step] per update,
                # in arrival order
                "updates": [
                    [q, u.version, self._value(u.encoded), u.base_version, u.global_step]
                    for q, chain in sorted(updates.items())
                    for u in chain
                ],
                "errors": [[e.code, e.text, e.fatal] for e in errors],
                "welcomes": welcomes,
                "welcome": _welcome_json(welcome) if new_welcome and welcome is not None else None,
            }
        )

    def push(self, call: int, push: Push) -> None:
        self._append(
            {
                "type": "push",
                "call": call,
                "fragment": push.fragment,
                "step": push.step,
                "base_version": push.base_version,
                "steps": push.steps,
                "tokens": push.tokens,
                "sha256": payload_sha256(push.payload),
            }
        )

    def dropped(self, call: int, fragment: int) -> None:
        """The push recorded just before (of `fragment`, at `call`) was not sent (the transport's
        queue was full). Written right after its push record: a call can push a fragment twice (its
        last step's push and the rest pushed at a graceful close), so only the order names it."""
        self._append({"type": "dropped", "call": call, "fragment": fragment})

    def init(self, call: int, fragment: int, payload: bytes) -> None:
        self._append({"type": "init", "call": call, "fragment": fragment, "sha256": sha256(payload)})

    def published(self, call: int, step: int, snapshot: bytes) -> None:
        self._append({"type": "publish", "call": call, "step": step, "sha256": sha256(snapshot)})

    def close(self, calls: int, step: int, params_sha256: str) -> None:
        self._append({"type": "close", "calls": calls, "step": step, "params_sha256": params_sha256})
        self.sync()
        self._fh.close()


@dataclass(frozen=True)
class LearnerTape:
    directory: Path
    config: dict
    records: list  # every record after the header, in order
    torn: str | None

    @property
    def closed(self) -> dict | None:
        return self.records[-1] if self.records and self.records[-1]["type"] == "close" else None

    def of(self, kind: str) -> list[dict]:
        return [r for r in self.records if r["type"] == kind]

    def welcome(self) -> session.WelcomeInfo:
        first = self.of("welcome")
        if not first:
            raise LearnerTapeError(f"{self.directory}: the learner was never welcomed (nothing to replay)")
        return _welcome(first[0]["welcome"])

    def dropped_pushes(self) -> frozenset[int]:
        """The pushes that were not sent, as their index among the push records (each `dropped`
        record follows its push's record)."""
        out, pushed = set(), -1
        for r in self.records:
            if r["type"] == "push":
                pushed += 1
            elif r["type"] == "dropped":
                if pushed < 0:
                    raise LearnerTapeError(
                        f"{self.directory / TAPE_FILE}: a dropped push at call {r['call']} before any push"
                    )
                out.add(pushed)
        return frozenset(out)

    def takes(self) -> dict[int, tuple[dict, list, tuple[int, session.WelcomeInfo | None]]]:
        """call -> what the hook took then, rebuilt with the session's types and stored payloads."""
        out = {}
        for r in self.of("take"):
            updates: dict[int, list[session.UpdateInfo]] = {}
            # A tape of protocol 1 has no base version (whole), one of protocol 2 no global step.
            for q, v, ref, *rest in r["updates"]:
                base, global_step = (list(rest) + [-1, -1])[:2]
                info = session.UpdateInfo(q, v, self.encoded(ref["$payload"]), base, global_step)
                updates.setdefault(q, []).append(info)
            errors = [session.ErrorInfo(*x) for x in r["errors"]]
            welcome = _welcome(r["welcome"]) if r["welcome"] else None
            out[r["call"]] = (updates, errors, (r["welcomes"], welcome))
        return out

    def encoded(self, ref: dict) -> codecs.Encoded:
        body = recording.load_payload(self.directory, ref["sha256"], f"learner tape {self.directory.name}")
        return codecs.from_body(ref["codec"], ref["block"], ref["elements"], body)

    def snapshot(self, sha: str) -> bytes:
        return recording.load_payload(self.directory, sha, f"learner tape {self.directory.name}: recovered snapshot")

    @property
    def last_call(self) -> int:
        """The last call of the hook the tape knows of (a killed learner may have run a few more)."""
        closed = self.closed
        if closed:
            return closed["calls"]
        return max((r["call"] for r in self.records if "call" in r), default=0)


def read(directory: Path | str, *, cut: bool = False) -> LearnerTape:
    directory = Path(directory)
    records, _, torn = recording.read_record_file(directory / TAPE_FILE, MAGIC, cut=cut)
    if not records or records[0][1].get("type") != "header" or records[0][1].get("kind") != "learner":
        raise LearnerTapeError(f"{directory / TAPE_FILE} has no learner header" + (f" ({torn})" if torn else ""))
    rest = [r for _, r in records[1:]]
    for offset, r in records[1:]:
        if r.get("type") not in KINDS[1:]:
            raise LearnerTapeError(
                f"{directory / TAPE_FILE}: record at offset {offset} has unknown type {r.get('type')!r}"
            )
    return LearnerTape(directory, records[0][1]["config"], rest, torn)


def config_json(cfg: Any) -> dict:
    """A learner config as JSON for the header, without its secret (the token)."""
    d = asdict(cfg)
    d.pop("token", None)
    for key in ("log_file", "cache_dir", "record", "ca_file", "lane"):
        d.pop(key, None)  # where files go, and how bytes travel, are not part of the trajectory
    if isinstance(d.get("peer"), dict):
        d["peer"].pop("token", None)
    return d
