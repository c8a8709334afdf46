"""Safety invariants, checked from outside the core after every event it handles.

The checker sees what a spectator of the daemon would: each event going in, the effects coming out,
and the syncer state between two events (read only). It keeps its own books and never calls the
code under test to decide whether the code under test was right. The first broken invariant is
kept with the virtual time and a description; the run stops there.

- versions_grow: a fragment's version never goes down, goes up by exactly one per `Merged` effect
  and only with one; a resumed syncer holds exactly its last checkpoint (after a stop, that is the
  state at the stop: nothing is lost; after a crash, the merges since are lost by design); its values never change without a new version
  (or before version 0 is complete); a version, once sent, always means the same values; what the
  syncer records a learner as holding never goes back within its session.
- quorum: a merge takes exactly the admissible pushes that waited for it with positive token weight
  (a live learner when it pushed, a base version at most STALENESS_MAX behind, the newest push of
  each learner since the fragment's last merge), and there are at least K of them.
- weights: the merge weights are positive, sum to 1 and are the normalised token weights
  tokens^2 / steps of those pushes, each divided by 1 + its staleness (protocol 2).
- finite: every parameter and momentum value is finite and inside the parameter bound (a hundred
  times the largest initial value, at least 100): a restarted learner's fresh weights (FRESH_SCALE)
  would blow through it if they ever leaked into a merge.
- ledger: `reported == merged + merged_late + late + stale + rejected + lost + open`, no total ever shrinks, the
  books never hold more tokens than the learners trained (each step's tokens count once in the
  window of every fragment, so at most P x tokens trained), no window stays open for a learner that
  is gone, and an open window never holds more tokens than the learner itself counted for that
  fragment and version in that session.
- fresh_weights: version 0 comes only from a learner the syncer asked for it (a welcome with
  needs_init), and the syncer's copy equals what that learner sent.
- caught_up: a learner turns live only while it holds a received version of every fragment in its
  current session (a learner that is behind has weight 0 until then).
- snapshot: a consistent snapshot (net.snapshot) holds the syncer's state at the cut, every channel
  of the cut either recorded or left out; on a channel that kept TCP's order, the learner's local
  state holds no version made after the cut, and the messages of it the core took before the cut
  plus those recorded in flight are exactly the messages the learner had sent when it recorded its
  state (none lost, none from after its cut: Chandy-Lamport's channel state).
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import orjson

from ddiloco.chaos.network import Connection
from ddiloco.core import checkpoint
from ddiloco.core.events import Effect, Event, InitFragment, Merged, Progress, Push, SendWelcome
from ddiloco.core.ledger import FATES
from ddiloco.core.syncer import STALENESS_MAX, LearnerStatus, SyncerState, state_hash
from ddiloco.core.weights import token_weight

INVARIANTS = ("versions_grow", "quorum", "weights", "finite", "ledger", "fresh_weights", "caught_up", "snapshot")
BOUND_FACTOR = 100.0  # the parameter bound, in multiples of the largest initial value
BOUND_MIN = 100.0
WEIGHT_TOLERANCE = 1e-9


@dataclass(frozen=True)
class Violation:
    invariant: str  # one of INVARIANTS
    detail: str
    at: float  # virtual time


@dataclass(frozen=True)
class _Cut:
    ident: int
    versions: tuple[int, ...]  # the syncer's, at the cut
    state_hash: str
    channels: dict[int, Connection]  # learner id -> its connection at the cut
    taken: dict[int, int]  # learner id -> its messages the core had taken at the cut


def digest(values: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()[:16]


class Checker:
    """Feed it every core step with `after_event`, restarts with `after_restart`."""

    def __init__(
        self,
        quorum: int,
        tokens_trained: Callable[[], int],
        holds_all: Callable[[int], bool],
        counted: Callable[[int, int, int], int | None] = lambda m, p, v: None,
    ):
        self.quorum = quorum
        self.tokens_trained = tokens_trained  # tokens trained by every learner process so far
        self.holds_all = holds_all  # does the learner behind this core id hold every fragment?
        self.counted = counted  # the most tokens learner m counted for fragment p at version v (None: unknown)
        self.violation: Violation | None = None
        self._versions: list[int] | None = None
        self._theta: list[str | None] = []
        self._status: dict[int, LearnerStatus] = {}
        # fragment -> learner -> (base version, token weight, steps, tokens) of its admitted push waiting for a merge
        self._waiting: dict[int, dict[int, tuple[int, float, int, int]]] = {}
        # (learner, fragment) -> (base, steps, tokens) of its last admissible push (core.syncer._increment)
        self._pushed: dict[tuple[int, int], tuple[int, int, int]] = {}
        self._sent: dict[tuple[int, int, str], str] = {}  # (fragment, version, codec) -> digest of values
        self._asked_init: set[int] = set()
        self._held: dict[int, list[int]] = {}
        self._totals = {f: 0 for f in FATES}
        self._reported = 0
        self._bound: float | None = None
        self._checkpoint: tuple | None = None  # what the last checkpoint held (checkpointed)
        self.merges_checked = 0
        self._taken: Counter[int] = Counter()  # learner -> its messages the core took (progress, push, init)
        self._cut: _Cut | None = None  # the snapshot being taken, as seen at its cut
        self.snapshots_checked = 0
        self.channels_checked = 0  # learner states of a snapshot held to the cut (on an ordered channel)

    @property
    def ok(self) -> bool:
        return self.violation is None

    def fail(self, invariant: str, detail: str, at: float) -> None:
        assert invariant in INVARIANTS, invariant
        if self.violation is None:
            self.violation = Violation(invariant, detail, at)

    # ---- the entry points -----------------------------------------------------------------------

    def after_event(self, state: SyncerState, event: Event, effects: Sequence[Effect], now: float) -> None:
        if self._versions is None:
            self._snapshot(state)
        self._note_event(state, event)
        if isinstance(event, (Progress, Push, InitFragment)):
            self._taken[event.learner] += 1
        merged = {e.fragment: e for e in effects if isinstance(e, Merged)}
        for e in effects:
            if isinstance(e, SendWelcome) and e.needs_init:
                self._asked_init.add(e.learner)
        self._check_fragments(state, event, merged, now)
        for e in merged.values():
            self._check_merge(e, now)
        self._check_numbers(state, now)
        self._check_ledger(state, now)
        self._check_live(state, now)
        self._check_held(state, now)
        self._snapshot(state)

    def checkpointed(self, state: SyncerState) -> None:
        """The shell wrote a checkpoint of `state`: what a resumed syncer must hold exactly."""
        books = state.ledger
        self._checkpoint = (
            [f.version for f in state.fragments],
            [digest(f.theta) for f in state.fragments],
            books.reported,
            dict(books.totals),
            books.open,
        )

    def after_restart(self, state: SyncerState, now: float) -> None:
        """A syncer resumed from its last checkpoint, or started empty when it never wrote one.

        It must hold exactly that checkpoint: versions, values, and the books (the windows open then
        are booked as lost: their learners come back under new ids). After a stop the checkpoint is
        the state at the stop, so nothing is lost; after a crash the merges since the checkpoint are
        lost by design, and those versions will be merged again with other values."""
        versions = [f.version for f in state.fragments]
        if self._checkpoint is None:
            if state.holds_parameters:
                self.fail("versions_grow", "the resumed syncer holds parameters no checkpoint had", now)
            self._sent.clear()  # a new lineage: version 0 is asked of a learner again
            self._bound = None
        else:
            held, thetas, reported, totals, open_ = self._checkpoint
            mine = [digest(f.theta) if f.theta is not None else None for f in state.fragments]
            if versions != held or mine != thetas:
                self.fail(
                    "versions_grow",
                    f"the resumed syncer holds versions {versions}, its checkpoint {held} (or other values)",
                    now,
                )
            books = state.ledger
            if books.reported != reported or books.totals != {**totals, "lost": totals["lost"] + open_}:
                self.fail(
                    "ledger",
                    f"the resumed books {books.summary()} are not the checkpoint's {totals}, open {open_}",
                    now,
                )
            self._sent = {k: d for k, d in self._sent.items() if k[1] <= versions[k[0]]}
        self._totals, self._reported = dict(state.ledger.totals), state.ledger.reported
        self._check_ledger(state, now)
        self._waiting.clear()
        self._pushed.clear()
        self._asked_init.clear()
        self._taken.clear()  # every learner rejoins, under an id a crashed syncer may hand out again
        self._snapshot(state)

    def sent(self, fragment: int, version: int, codec: str, values: np.ndarray, now: float) -> None:
        """The shell sends `values` as `version` of `fragment`: a version always means the same values."""
        key, d = (fragment, version, codec), digest(values)
        known = self._sent.setdefault(key, d)
        if known != d:
            self.fail("versions_grow", f"fragment {fragment} version {version} was sent with two different values", now)

    def snapshot_started(self, ident: int, state: SyncerState, channels: Mapping[int, Connection], now: float) -> None:
        """A snapshot's cut, between two core events: markers go to the learners of `channels`."""
        versions = tuple(f.version for f in state.fragments)
        taken = {m: self._taken[m] for m in channels}
        self._cut = _Cut(ident, versions, state_hash(state), dict(channels), taken)

    def snapshot_abandoned(self) -> None:
        self._cut = None

    def snapshot_complete(self, manifest: dict, files: Mapping[str, bytes], now: float) -> None:
        """A snapshot ended: `manifest` and its `files` (name -> bytes) as the syncer stored them."""
        cut, self._cut = self._cut, None
        self.snapshots_checked += 1
        if cut is None or manifest["snapshot"] != cut.ident:
            self.fail("snapshot", f"snapshot {manifest['snapshot']} completed, but no cut of it was seen", now)
            return
        where = f"snapshot {cut.ident}"
        if state_hash(checkpoint.restore(files[manifest["syncer"]])) != cut.state_hash:
            self.fail("snapshot", f"{where}: the syncer state it holds is not the state at the cut", now)
        recorded = {int(k) for k in manifest["learners"]} | {int(k) for k in manifest["left_out"]}
        if recorded != set(cut.channels) or set(manifest["learners"]) & set(manifest["left_out"]):
            self.fail(
                "snapshot", f"{where}: channels {sorted(cut.channels)}, but in or left out {sorted(recorded)}", now
            )
        inflight = Counter(r["learner"] for r in manifest["inflight"])
        for key, entry in manifest["learners"].items():
            m, local = int(key), orjson.loads(files[entry["file"]])
            if local["learner"] != m:
                self.fail("snapshot", f"{where}: learner {m}'s file holds the state of learner {local['learner']}", now)
                continue
            if m not in cut.channels or not cut.channels[m].ordered:
                continue  # (not a channel: failed above) a reorder or duplicate fault lifted the FIFO order the protocol stands on
            self.channels_checked += 1
            if any(v > c for v, c in zip(local["versions"], cut.versions)):
                self.fail(
                    "snapshot",
                    f"{where}: learner {m} holds versions {local['versions']}, made after the cut at {list(cut.versions)}",
                    now,
                )
            elif cut.taken[m] + inflight[m] != local["sent"]:
                self.fail(
                    "snapshot",
                    f"{where}: learner {m} had sent {local['sent']} messages at its cut; the core took "
                    f"{cut.taken[m]} before the syncer's and {inflight[m]} are recorded in flight",
                    now,
                )

    # ---- bookkeeping ----------------------------------------------------------------------------

    def _snapshot(self, state: SyncerState) -> None:
        self._versions = [f.version for f in state.fragments]
        self._theta = [digest(f.theta) if f.theta is not None else None for f in state.fragments]
        self._status = {m: r.status for m, r in state.learners.items()}
        self._held = {m: list(r.versions) for m, r in state.learners.items() if r.status is not LearnerStatus.GONE}

    def _note_event(self, state: SyncerState, event: Event) -> None:
        """Remember every push that is admissible by the rules, judged with the state before it: it
        waits for the next merge of its fragment, counted by what it adds over the learner's previous push
        from the same base, and joined with the learner's push still waiting (the older base, the
        counters summed)."""
        if not isinstance(event, Push) or not 0 <= event.fragment < len(self._versions):
            return
        p = event.fragment
        admissible = (
            self._status.get(event.learner) is LearnerStatus.LIVE
            and 0 <= self._versions[p] - event.base_version <= STALENESS_MAX
            and event.payload.elements == state.layout.fragments[p].padded_size
            and event.payload.all_finite()
            and 0 <= event.steps
            and 0 <= event.tokens
            and (event.steps > 0 or event.tokens == 0)
        )
        if admissible:
            waiting = self._waiting.setdefault(p, {})
            base, steps, tokens = event.base_version, event.steps, event.tokens
            last = self._pushed.get((event.learner, p))
            self._pushed[(event.learner, p)] = (base, steps, tokens)
            if last is not None and last[0] == base:  # an increment: its counters add only what is new
                steps = max(0, steps - last[1])
                tokens = max(0, tokens - last[2]) if steps else 0
            older = waiting.get(event.learner)
            if older is not None:
                base, steps, tokens = older[0], older[2] + steps, older[3] + tokens
            waiting[event.learner] = (base, token_weight(tokens, steps), steps, tokens)

    # ---- the checks -----------------------------------------------------------------------------

    def _check_fragments(self, state: SyncerState, event: Event, merged: dict[int, Merged], now: float) -> None:
        held_before = all(t is not None for t in self._theta)
        for p, frag in enumerate(state.fragments):
            before, after = self._versions[p], frag.version
            theta = digest(frag.theta) if frag.theta is not None else None
            if after < before:
                self.fail("versions_grow", f"fragment {p} went from version {before} to {after}", now)
            elif after > before and (after != before + 1 or p not in merged or merged[p].version != after):
                self.fail(
                    "versions_grow",
                    f"fragment {p} went from version {before} to {after} without one Merged effect",
                    now,
                )
            elif after == before and p in merged:
                self.fail("versions_grow", f"Merged effect for fragment {p} but its version stayed {after}", now)
            elif after == before and theta != self._theta[p] and held_before:
                self.fail(
                    "versions_grow",
                    f"fragment {p} changed its values without a new version ({type(event).__name__})",
                    now,
                )
        if not held_before and state.holds_parameters:
            self._check_version_zero(state, event, now)

    def _check_version_zero(self, state: SyncerState, event: Event, now: float) -> None:
        if not isinstance(event, InitFragment) or event.learner not in self._asked_init:
            self.fail(
                "fresh_weights", f"version 0 completed by {type(event).__name__} of a learner never asked for it", now
            )
            return
        largest = max(float(np.max(np.abs(f.theta))) if f.theta.size else 0.0 for f in state.fragments)
        self._bound = max(BOUND_MIN, BOUND_FACTOR * largest)

    def _check_merge(self, e: Merged, now: float) -> None:
        self.merges_checked += 1
        before = self._versions[e.fragment]  # the version the merge applied to
        waiting = self._waiting.pop(e.fragment, {})
        # Staleness s = before - base: at most STALENESS_MAX, weight discounted by 1/(1+s).
        pushes = {
            m: w / (1 + before - b) if before > b else w
            for m, (b, w, *_) in waiting.items()
            if before - b <= STALENESS_MAX
        }
        expected = sorted(m for m, w in pushes.items() if w > 0)
        if len(set(e.learners)) != len(e.learners) or sorted(e.learners) != expected:
            self.fail(
                "quorum",
                f"fragment {e.fragment} onto version {before}: merged {list(e.learners)}, admissible {expected}",
                now,
            )
            return
        if len(e.learners) < self.quorum:
            self.fail("quorum", f"fragment {e.fragment} merged {len(e.learners)} pushes, quorum is {self.quorum}", now)
            return
        total = math.fsum(pushes[m] for m in e.learners)
        want = [pushes[m] / total for m in e.learners]
        if not all(w > 0 and math.isfinite(w) for w in e.weights) or abs(math.fsum(e.weights) - 1.0) > WEIGHT_TOLERANCE:
            self.fail("weights", f"fragment {e.fragment} weights {e.weights} do not sum to 1", now)
        elif any(abs(a - b) > WEIGHT_TOLERANCE for a, b in zip(e.weights, want)):
            self.fail("weights", f"fragment {e.fragment} weights {e.weights}, token weights say {want}", now)

    def _check_numbers(self, state: SyncerState, now: float) -> None:
        for p, frag in enumerate(state.fragments):
            if frag.theta is None:
                continue
            if not (np.isfinite(frag.theta).all() and np.isfinite(frag.momentum.buf).all()):
                self.fail("finite", f"fragment {p} holds NaN or Inf", now)
            elif self._bound is not None and float(np.max(np.abs(frag.theta), initial=0.0)) > self._bound:
                self.fail(
                    "finite",
                    f"fragment {p} has a value beyond the parameter bound {self._bound:g}: fresh weights leaked?",
                    now,
                )

    def _check_ledger(self, state: SyncerState, now: float) -> None:
        books = state.ledger
        reported, totals, open_ = books.reported, dict(books.totals), books.open
        if reported != sum(totals.values()) + open_:
            self.fail("ledger", f"reported {reported} != fated {sum(totals.values())} + open {open_}", now)
        shrunk = [f for f in FATES if totals[f] < self._totals[f]]
        if shrunk or reported < self._reported:
            self.fail("ledger", f"the books shrank: {shrunk or 'reported'} ({self._totals} -> {totals})", now)
        ceiling = len(state.fragments) * self.tokens_trained()
        if reported > ceiling:
            self.fail(
                "ledger",
                f"{reported} tokens reported, but the learners trained only {ceiling // len(state.fragments)} (x{len(state.fragments)} fragments)",
                now,
            )
        self._totals, self._reported = totals, reported
        for (m, p), window in books.windows.items():
            rec = state.learners.get(m)
            if rec is None or rec.status is LearnerStatus.GONE:  # its waiting pushes' tokens are held, not in windows
                self.fail("ledger", f"a ledger window of fragment {p} is open for learner {m}, which is gone", now)
                return
            most = self.counted(m, p, rec.versions[p])
            if most is not None and window.tokens > most:
                self.fail(
                    "ledger",
                    f"learner {m} fragment {p} version {rec.versions[p]}: the window holds {window.tokens} tokens, the learner counted {most}",
                    now,
                )
                return

    def _check_held(self, state: SyncerState, now: float) -> None:
        for m, before in self._held.items():
            rec = state.learners[m]
            if rec.status is not LearnerStatus.GONE and any(a < b for a, b in zip(rec.versions, before)):
                self.fail(
                    "versions_grow",
                    f"the syncer now records learner {m} as holding {rec.versions}, before {before}",
                    now,
                )

    def _check_live(self, state: SyncerState, now: float) -> None:
        for m, rec in state.learners.items():
            if (
                rec.status is LearnerStatus.LIVE
                and self._status.get(m) is not LearnerStatus.LIVE
                and not self.holds_all(m)
            ):
                self.fail("caught_up", f"learner {m} turned live while it does not hold every fragment", now)
