"""Replay: run the real syncer core over a tape and check that it reproduces the recorded run.

docs/algorithm.md, "Event tape": replaying the tape through the same code reproduces the run exactly.
The syncer starts as the tape's header says (empty, or the initial checkpoint, whose state hash is
checked first); every event record goes through `core.syncer.handle` with its recorded `now`; the
merges each event makes must match the check records that follow it (fragment, version and sha256
of the new values, bit for bit), and at a clean end the final state hash must match the close
record. The first difference is returned as a `Divergence` naming the event.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ddiloco.core import checkpoint
from ddiloco.core import syncer as core
from ddiloco.core import tape as tapes
from ddiloco.core.config import from_mapping
from ddiloco.core.events import Merged

EVENT_TEXT_CHARS_MAX = 240  # how much of an event a divergence quotes


@dataclass(frozen=True)
class Divergence:
    index: int  # the event's index on the tape (-1: the initial state)
    event: str  # a short description of the event
    what: str  # what differs
    expected: str
    got: str

    def __str__(self) -> str:
        return f"event {self.index} ({self.event}): {self.what}: expected {self.expected}, got {self.got}"


@dataclass(frozen=True)
class ReplayResult:
    events: int  # events replayed
    merges_checked: int
    final_checked: bool  # False when the tape has no close record (the run did not end cleanly)
    state_hash: str  # the replayed syncer's state hash after the last event replayed
    divergence: Divergence | None
    torn: str | None  # the tape's torn-tail note, if one was cut

    @property
    def ok(self) -> bool:
        return self.divergence is None


def replay(tape: tapes.Tape) -> ReplayResult:
    """Replay `tape` (from `net.recording.read`, or any `tapes.Tape` with its payloads at hand). Raises TapeError when the tape itself cannot be used
    (payloads not kept, a record that does not decode); differences are results, not errors."""
    state, diverged = _initial_state(tape)
    events = merges = 0
    expected_checks: deque = deque()  # computed by replay for the last event, awaiting its records
    last_event = None
    if diverged is None:
        for record in tape.records:
            if record["type"] == "check":
                diverged = _match_check(record, expected_checks, last_event)
                if diverged is not None:
                    break
                merges += 1
                continue
            diverged = _unrecorded_merge(expected_checks, last_event)
            if diverged is not None:
                break
            last_event = record
            diverged = _replay_event(tape, state, record, expected_checks)
            if diverged is not None:
                break
            events += 1
        else:
            # The last event's check records may be what was lost: with a cut tail, and with a run
            # killed between writing an event and writing what it did (no close record).
            if tape.torn is None and tape.close is not None:
                diverged = _unrecorded_merge(expected_checks, last_event)
    final_hash = core.state_hash(state)
    final_checked = False
    if diverged is None and tape.close is not None:
        final_checked = True
        if tape.close["events"] != events:
            diverged = Divergence(events, "close", "events on the tape", str(tape.close["events"]), str(events))
        elif tape.close["state_hash"] != final_hash:
            diverged = Divergence(
                events - 1, "after the last event", "final state hash", tape.close["state_hash"], final_hash
            )
    return ReplayResult(events, merges, final_checked, final_hash, diverged, tape.torn)


def describe(record: dict) -> str:
    """`#i Kind field=value ...`, payloads as codec and hash prefix, bounded in length."""
    parts = [f"#{record.get('i')} {record.get('kind')}"]
    for name, value in record.get("fields", {}).items():
        if isinstance(value, dict) and "$payload" in value:
            ref = value["$payload"]
            value = f"{ref['codec']}[{ref['elements']}]:{ref['sha256'][:12]}"
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            value = f"[{len(value)} items]"
        parts.append(f"{name}={value}")
    text = " ".join(str(p) for p in parts)
    return text if len(text) <= EVENT_TEXT_CHARS_MAX else text[: EVENT_TEXT_CHARS_MAX - 3] + "..."


def _initial_state(tape: tapes.Tape) -> tuple[core.SyncerState, Divergence | None]:
    start = tape.header["start"]
    if start["kind"] == "empty":
        return core.new_state(from_mapping(tape.header["config"])), None
    if start["kind"] != "checkpoint":
        raise tapes.TapeError(f"tape header: unknown start kind {start['kind']!r}")
    body = tape.payload(start["sha256"], "initial checkpoint")
    try:
        state = checkpoint.restore(body)
    except checkpoint.CheckpointError as exc:
        raise tapes.TapeError(f"initial checkpoint: {exc}") from exc
    got = core.state_hash(state)
    if got != start["state_hash"]:
        return state, Divergence(-1, "initial checkpoint", "initial state hash", start["state_hash"], got)
    return state, None


def _replay_event(tape: tapes.Tape, state: core.SyncerState, record: dict, checks: deque) -> Divergence | None:
    index = record["i"]
    try:
        event, now, _ = tapes.decode_event(tape, record)
    except tapes.PayloadMismatch as exc:
        return Divergence(index, describe(record), "payload hash", exc.expected, exc.got)
    try:
        state, effects = core.handle(state, event, now)
    except Exception as exc:  # the recorded run handled this event: a raise here is a divergence
        return Divergence(index, describe(record), "the core raised", "no exception", repr(exc)[:EVENT_TEXT_CHARS_MAX])
    for effect in effects:
        if isinstance(effect, Merged):
            checks.append(tapes.merge_check(index, state, effect.fragment))
    return None


def _match_check(record: dict, checks: deque, event: dict | None) -> Divergence | None:
    text = describe(event) if event else "before any event"
    index = event["i"] if event else -1
    if not checks:
        return Divergence(
            index, text, f"merge of fragment {record['fragment']}", f"version {record['version']}", "no merge"
        )
    got = checks.popleft()
    if (got["fragment"], got["version"]) != (record["fragment"], record["version"]):
        return Divergence(
            index,
            text,
            "merge",
            f"fragment {record['fragment']} version {record['version']}",
            f"fragment {got['fragment']} version {got['version']}",
        )
    if got["sha256"] != record["sha256"]:
        return Divergence(
            index,
            text,
            f"values of fragment {record['fragment']} version {record['version']}",
            record["sha256"],
            got["sha256"],
        )
    for key, what in (("published", "published copy"), ("delta", "broadcast delta")):
        if key in record and got.get(key) != record[key]:  # a tape of protocol 1 has neither
            return Divergence(
                index,
                text,
                f"{what} of fragment {record['fragment']} version {record['version']}",
                record[key],
                got.get(key),
            )
    return None


def _unrecorded_merge(checks: deque, event: dict | None) -> Divergence | None:
    if not checks:
        return None
    got = checks[0]
    return Divergence(
        event["i"], describe(event), f"merge of fragment {got['fragment']}", "no merge", f"version {got['version']}"
    )
