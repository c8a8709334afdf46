"""The syncer state machine: `handle(state, event, now) -> (state, effects)`.

docs/algorithm.md, "Syncer: one round of fragment p". The same code runs in the daemon, the simulator and
replay. It is sans-I/O and deterministic: `now` is the syncer's monotonic clock, passed in; ties are
broken by learner id; nothing reads a global RNG.

The state owns the global fragments (tens of millions of floats), so `handle` updates it in place and
returns it rather than copying it per event; everything the syncer knows lives in this one value.

Round life: a round of fragment p opens when the global step (the step of the K-th most advanced live
learner) reaches a step t with t mod H == t_p. Nobody is asked: learners push fragment p on their own
at their steps of that phase (protocol 2, docs/protocol.md "Learner-driven pushes"). The round takes
what arrives: pushes kept while no round of p was open join it when it opens, later ones while it is
open. A push holds the learner's progress since its previous push of the fragment (an increment), so
a learner's pushes waiting for the same round are summed into one, weighted by the tokens they add.
When K have arrived the grace window is
computed, and the round closes when it expires, when every learner live at its opening that is still
connected has delivered, or when the next round of the same fragment opens. Closing merges (mean or
RDA, token weighted, a push s versions behind discounted by 1/(1+s)), applies the outer Nesterov step,
bumps the version and broadcasts the fragment: as the delta that takes the published copy from the
previous version to this one (core.publish, docs/protocol.md "Delta broadcast").
"""

from __future__ import annotations

import enum
import hashlib
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from ddiloco.core import codec as codecs
from ddiloco.core import outer
from ddiloco.core import publish as publishing
from ddiloco.core.config import SyncerConfig
from ddiloco.core.events import (
    ArmTimer,
    Disconnect,
    Drop,
    Effect,
    Event,
    InitFragment,
    Join,
    Log,
    MergeCost,
    Merged,
    Progress,
    Push,
    Rejection,
    SendError,
    SendUpdate,
    SendWelcome,
    TimerFired,
    WriteCheckpoint,
)
from ddiloco.core.grace import Timing, grace_seconds, observe
from ddiloco.core.layout import Layout, LayoutError, TooManyFragments, build_layout
from ddiloco.core.ledger import Ledger
from ddiloco.core.merge import merge_round
from ddiloco.core.schedule import Schedule
from ddiloco.core.shards import owned, owner
from ddiloco.core.weights import TOKENS_MAX

# The largest magnitude a push's values or initial parameters may have. Far above any parameter or
# outer gradient of a model that trains (float32 steps are coarser than 1e-4 beyond it), and far below
# float32's 3.4e38: a round's weighted sum, the RDA norms and factors and the outer step's momentum of
# finite values this size stay finite, where a push of finite values near float32's maximum made the
# merge overflow and the core fail (the fuzzer found it).
PAYLOAD_ABS_MAX = 2.0**40
PROTOCOL_VERSION = 3  # net.wire.PROTOCOL_VERSION: the core speaks the version the wire carries
PEERS_IN_WELCOME_MAX = 8  # a joining learner needs one healthy peer; a few spare cover failures
# The most one progress report may move a learner's step past both its last report and the global
# step (a (re)joining learner starts counting from the global step of its welcome). A learner reports
# at every step that opens a round and at least every half second, so an honest report moves it by a
# few periods at most; a larger jump is a corrupt counter, and taking it would let one message move
# the global step (with quorum 1) arbitrarily far.
STEP_JUMP_MAX = 100_000
# A learner whose progress reports hold a fragment this many versions behind the syncer's is sent
# the current version whole: it is not following the delta broadcast (its copy came from a peer or a
# snapshot without the published copy, or a delta went astray) and would otherwise wait for a push
# refused as stale. Once per version; one round behind is normal (the update is on its way).
WHOLE_RESEND_LAG = 2
# ... and whose held version has not moved for this long (on the syncer's clock). A learner that
# follows the broadcast over a slow link lags too, with the deltas queued to it on their way: a whole
# copy (8x an int4 delta) sent on top of them only slows that link further, and under load every
# learner's lag then grew into a whole copy per version. Measured with 8 learners (`ddiloco bench
# syncer --learners 8 --params 50M`): 6.9 bytes out per byte in without this wait, 5.4 with 1 s, 1.65
# with 5 s (1.62 with no resend at all). A learner that does not follow never moves.
WHOLE_RESEND_STUCK_S = 5.0
# The most versions a push's base may lag behind the version its round merges onto (its staleness s).
# A push s >= 1 behind is merged with its weight times 1/(1+s) (docs/algorithm.md, "Late pushes");
# beyond this it is refused and its tokens booked lost: its outer gradient mostly repeats what the
# versions since have merged, and a learner that far behind recovers faster by taking the new version.
STALENESS_MAX = 8
# Late pushes are summed in one log line at most this often (on the syncer's clock), not one per push.
LATE_LOG_INTERVAL_S = 60.0


class LearnerStatus(str, enum.Enum):
    JOINING = "joining"  # welcomed, waiting for the syncer to hold parameters
    INITIALIZING = "initializing"  # asked to send the initial parameters
    RECOVERING = "recovering"  # holds not yet a received version of every fragment; weight 0
    LIVE = "live"
    GONE = "gone"


@dataclass
class LearnerRecord:
    id: int
    name: str
    conn: int
    status: LearnerStatus
    joined_at: float
    last_seen: float
    step: int = 0
    versions: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    caught_up_at: float | None = None
    peer_url: str = ""  # where it serves its state to (re)joining learners; "" if it does not
    # fragment -> the version last sent whole to it because its reports fell behind (WHOLE_RESEND_LAG)
    resent: dict[int, int] = field(default_factory=dict)
    # fragment -> when its reports last held another version (WHOLE_RESEND_STUCK_S)
    held_since: dict[int, float] = field(default_factory=dict)
    # fragment -> the newest version an update effect sent it (whole or delta, `update_effect`)
    addressed: dict[int, int] = field(default_factory=dict)
    # fragment -> (base version, steps, tokens) of its last admitted push: the next push from the same
    # base is an increment over it, and its merge weight counts only the steps and tokens it adds
    pushed: dict[int, tuple[int, int, int]] = field(default_factory=dict)


@dataclass
class Round:
    number: int
    opened_at: float
    opened_step: int
    asked: tuple[int, ...]  # the learners expected to deliver: the live ones when it opened
    pushes: dict[int, Push] = field(default_factory=dict)  # learner -> its admitted push, kept as it arrived
    quorum_at: float | None = None
    grace_s: float = 0.0


@dataclass
class FragmentState:
    theta: np.ndarray | None  # float32[padded], the global copy; None until initialised
    momentum: outer.NesterovState | None
    version: int = 0
    rounds_opened: int = 0
    open: Round | None = None
    # Admitted pushes that arrived while no round of the fragment was open (or whose round was
    # skipped): they join its next round. learner -> push; not in a checkpoint (like an open round).
    kept: dict[int, Push] = field(default_factory=dict)
    # float32[padded], what every learner following the broadcast holds of `version` (core.publish);
    # None while theta is
    published: np.ndarray | None = None
    delta: publishing.Delta | None = None  # the delta to `version` from the one before; None: send whole


@dataclass(frozen=True)
class Decision:
    at: float
    fragment: int
    round: int
    outcome: str  # "merged" | "skipped"
    version: int
    reason: str


@dataclass
class SyncerState:
    config: SyncerConfig
    layout: Layout | None
    schedule: Schedule
    fragments: list[FragmentState]
    learners: dict[int, LearnerRecord] = field(default_factory=dict)
    next_learner: int = 1
    global_step: int = 0
    global_step_at: float | None = None
    timing: Timing = field(default_factory=Timing)
    ledger: Ledger = field(default_factory=Ledger)
    decisions: deque = field(default_factory=deque)
    merges: int = 0
    rejections: dict[str, int] = field(default_factory=dict)
    merges_since_checkpoint: int = 0
    checkpoint_at: float = 0.0
    init_source: str = ""  # "file", or "learner N" when a learner's hello seeded version 0
    # Late pushes (staleness >= 1 at merge): "carried" (merged, discounted) and "rejected" (beyond
    # STALENESS_MAX), since the start; and the same since the last summary log line, written then.
    late_pushes: dict[str, int] = field(default_factory=lambda: {"carried": 0, "rejected": 0})
    late_unlogged: dict[str, int] = field(default_factory=lambda: {"carried": 0, "rejected": 0})
    late_logged_at: float | None = None
    # The fragments this syncer owns (core.shards): every one unless it is one shard of several.
    # The others' FragmentStates stay empty (theta None) for good: no memory, no rounds, no books.
    owned: tuple[int, ...] = ()

    @property
    def holds_parameters(self) -> bool:
        return bool(self.owned) and all(self.fragments[p].theta is not None for p in self.owned)

    def owns(self, p: int) -> bool:
        """Whether fragment p is this shard's (always, unsharded)."""
        return owner(p, self.config.shards) == self.config.shard

    def live(self) -> list[LearnerRecord]:
        return [r for _, r in sorted(self.learners.items()) if r.status is LearnerStatus.LIVE]

    def connected(self) -> list[LearnerRecord]:
        return [r for _, r in sorted(self.learners.items()) if r.status is not LearnerStatus.GONE]


def new_state(
    config: SyncerConfig, layout: Layout | None = None, params: list[np.ndarray] | None = None
) -> SyncerState:
    """A syncer holding `params` (one float32[padded] per fragment of `layout`; the state takes
    ownership of writable contiguous arrays and updates them in place), or nothing yet: then
    the first learner's hello decides the layout and that learner is asked for the initial values."""
    if params is not None and layout is None:
        raise ValueError("initial parameters need their layout")
    num = config.num_fragments
    if layout is not None and layout.num_fragments != num:
        raise ValueError(f"layout has {layout.num_fragments} fragments, config says {num}")
    state = SyncerState(
        config=config,
        layout=layout,
        schedule=Schedule(config.period, num, config.grace.overlap),
        fragments=[FragmentState(theta=None, momentum=None) for _ in range(num)],
        owned=owned(config.shard, config.shards, num),
    )
    if params is not None:
        if len(params) != num:
            raise ValueError(f"initial parameters hold {len(params)} fragments, the layout {num}")
        for p in state.owned:  # a shard takes its own fragments of a whole model and leaves the rest
            if params[p] is None:
                raise ValueError(f"the initial parameters lack fragment {p}, which this syncer owns")
            _hold(state, p, _checked_params(layout, p, params[p]))
        state.init_source = "file"
    return state


def handle(state: SyncerState, event: Event, now: float) -> tuple[SyncerState, list[Effect]]:
    """Advance the syncer by one event. Expected faults are events; a broken invariant asserts."""
    handler = _HANDLERS[type(event)]
    effects: list[Effect] = []
    handler(state, event, now, effects)
    _maybe_checkpoint(state, now, effects)
    return state, effects


# ---- joining and initial parameters ----------------------------------------------------------------


def _on_join(state: SyncerState, ev: Join, now: float, out: list[Effect]) -> None:
    cfg = state.config
    if ev.protocol != PROTOCOL_VERSION:
        text = f"syncer speaks protocol {PROTOCOL_VERSION}, learner {ev.protocol}"
        _refuse_join(ev, "protocol_version", text, "protocol version", out)
        return
    if len(state.connected()) >= cfg.learners_max:
        _refuse_join(ev, "overloaded", f"syncer already serves {cfg.learners_max} learners", "learners_max", out)
        return
    try:
        theirs = build_layout(ev.tensors, cfg.num_fragments, cfg.strategy, cfg.block)
    except TooManyFragments as exc:
        # The one layout error a user meets by configuration alone (the README's --fragments 8 and a
        # small model): say which setting to change, on both sides. Refused rather than adapted: P
        # is fixed for the run (schedule, checkpoints, every other learner), docs/learner.md.
        text = (
            f"the syncer splits the model into {exc.fragments} fragments but it has {exc.parts} {exc.unit}: "
            f"start the syncer with --fragments {exc.parts} or fewer"
        )
        _refuse_join(ev, "bad_layout", text, "bad layout", out)
        return
    except LayoutError as exc:
        _refuse_join(ev, "bad_layout", f"cannot lay out the learner's tensors: {exc}", "bad layout", out)
        return
    if state.layout is not None and theirs.digest != state.layout.digest:
        _refuse_join(ev, "bad_layout", _layout_difference(state.layout, theirs), "layout mismatch", out)
        return
    if state.layout is None:
        state.layout = theirs
    learner = state.next_learner
    state.next_learner += 1
    num = cfg.num_fragments
    rec = LearnerRecord(learner, ev.name, ev.conn, LearnerStatus.JOINING, now, now, 0, [-1] * num, [0] * num, [0] * num)
    rec.peer_url = ev.peer_url
    peers = _peers(state)  # before this learner is listed: never itself
    state.learners[learner] = rec
    needs_init = not state.holds_parameters and not any(
        r.status is LearnerStatus.INITIALIZING for r in state.learners.values()
    )
    if needs_init:
        rec.status = LearnerStatus.INITIALIZING
        out.append(
            Log(
                "info", f"learner {learner} ({ev.name}) joined; the syncer holds no parameters, asking it for version 0"
            )
        )
    else:
        rec.status = LearnerStatus.RECOVERING if state.holds_parameters else LearnerStatus.JOINING
        out.append(Log("info", f"learner {learner} ({ev.name}) joined as {rec.status.value}"))
    out.append(_welcome(state, ev.conn, learner, needs_init, peers))
    if rec.status is LearnerStatus.RECOVERING:
        out.extend(_full_update(state, (learner,)))


def _refuse_join(ev: Join, code: str, text: str, reason: str, out: list[Effect]) -> None:
    """Refuse a hello for good: the learner is told why, and so is the syncer's log (the learner's
    process may be on another machine, its output unseen by whoever runs the syncer)."""
    who = f"learner {ev.name!r} (connection {ev.conn}, {len(ev.tensors)} tensors)"
    out.append(Log("warning", f"refused {who}: {code}: {text}"))
    out.append(SendError(code, text, True, conn=ev.conn))
    out.append(Drop(None, ev.conn, reason))


def _welcome(
    state: SyncerState,
    conn: int,
    learner: int,
    needs_init: bool,
    peers: tuple[tuple[int, str, tuple[int, ...]], ...] = (),
) -> SendWelcome:
    """The syncer's layout, versions, global step and round schedule, for one learner."""
    return SendWelcome(
        conn,
        learner,
        state.layout.describe(),
        state.layout.digest,
        _versions(state),
        state.global_step,
        needs_init,
        peers,
        state.schedule.period,
        state.schedule.offsets,
        state.config.shard,
        state.config.shards,
    )


def _peers(state: SyncerState) -> tuple[tuple[int, str, tuple[int, ...]], ...]:
    """Live learners that serve their state, for a (re)joining one to copy.

    docs/algorithm.md, "Recovery, snapshots, replay".
    """
    live = [r for _, r in sorted(state.learners.items()) if r.status is LearnerStatus.LIVE and r.peer_url]
    return tuple((r.id, r.peer_url, tuple(r.versions)) for r in live[:PEERS_IN_WELCOME_MAX])


def _on_init(state: SyncerState, ev: InitFragment, now: float, out: list[Effect]) -> None:
    foreign = _foreign(state, ev.fragment)
    if foreign is not None:
        _reject(state, ev.learner, foreign, out)
        return
    rec = state.learners.get(ev.learner)
    if rec is None or rec.status is not LearnerStatus.INITIALIZING:
        # Only the learner asked may seed the global state: a learner's local weights never become
        # global state otherwise.
        _reject(state, ev.learner, Rejection("not_live", "initial parameters were not asked of this learner"), out)
        return
    try:
        values = _checked_params(
            state.layout, ev.fragment, ev.payload.decode() if ev.payload.codec is codecs.Codec.FP32 else None
        )
    except ValueError as exc:
        _reject(state, ev.learner, Rejection("bad_shape", f"initial fragment {ev.fragment}: {exc}"), out)
        return
    frag = state.fragments[ev.fragment]
    if frag.theta is not None:
        _reject(state, ev.learner, Rejection("duplicate", f"fragment {ev.fragment} is already initialised"), out)
        return
    _hold(state, ev.fragment, values)
    rec.versions[ev.fragment] = 0
    if not state.holds_parameters:
        return
    state.init_source = f"learner {rec.id}"
    rec.status = LearnerStatus.LIVE
    rec.caught_up_at = now
    out.append(Log("info", f"version 0 of every fragment taken from learner {rec.id}'s initial parameters"))
    waiting = tuple(r.id for r in state.connected() if r.status is LearnerStatus.JOINING)
    for r in waiting:
        state.learners[r].status = LearnerStatus.RECOVERING
    if waiting:
        out.extend(_full_update(state, waiting))


def _hold(state: SyncerState, p: int, values: np.ndarray) -> None:
    frag = state.fragments[p]
    frag.theta = values
    frag.momentum = outer.init(values)
    frag.published = values.copy()  # version 0 goes out whole: the learners' copy is exact
    frag.delta = None


def _checked_params(layout: Layout, p: int, values: np.ndarray | None) -> np.ndarray:
    if values is None:
        raise ValueError("initial parameters must be sent as fp32")
    if not 0 <= p < layout.num_fragments:
        raise ValueError(f"fragment index {p} out of range [0, {layout.num_fragments})")
    spec = layout.fragments[p]
    if values.dtype != np.float32 or values.shape != (spec.padded_size,):
        raise ValueError(f"fragment {p} needs {spec.padded_size} float32 values, got {values.dtype} {values.shape}")
    if not codecs.values_within(values, PAYLOAD_ABS_MAX):
        raise ValueError(f"fragment {p} has NaN, Inf or values beyond +-{PAYLOAD_ABS_MAX:.3g}")
    if not values.flags.writeable or not values.flags.c_contiguous:
        values = np.ascontiguousarray(values).copy()  # the syncer owns and updates its fragments in place
    return values


# ---- progress, the global step and opening rounds --------------------------------------------------


def _on_progress(state: SyncerState, ev: Progress, now: float, out: list[Effect]) -> None:
    rec = state.learners.get(ev.learner)
    if rec is None or rec.status is LearnerStatus.GONE:
        return  # a message still in flight from a learner already gone
    num = state.config.num_fragments
    if not (len(ev.versions) == len(ev.steps) == len(ev.tokens) == num) or ev.step < 0:
        _reject(
            state, ev.learner, Rejection("bad_counters", f"progress must carry {num} versions, steps and tokens"), out
        )
        return
    if any(not _counters_valid(s, t) for s, t in zip(ev.steps, ev.tokens)):
        _reject(
            state,
            ev.learner,
            Rejection("bad_counters", f"counters out of [0, {TOKENS_MAX}], or tokens without steps"),
            out,
        )
        return
    carried = ev.carried or (0,) * num
    if len(carried) != num or any(not 0 <= c <= t for c, t in zip(carried, ev.tokens)):
        _reject(
            state,
            ev.learner,
            Rejection("bad_counters", f"carried tokens must be {num} values, each in [0, the fragment's tokens]"),
            out,
        )
        return
    if ev.step < rec.step:
        # An older report overtaken by a newer one (delivered twice or out of order): its versions
        # and counters are out of date, and taking them would move the ledger's windows back.
        return
    base = max(rec.step, state.global_step)
    if ev.step > base + STEP_JUMP_MAX:
        _reject(
            state,
            ev.learner,
            Rejection(
                "bad_counters", f"progress to step {ev.step} jumps more than {STEP_JUMP_MAX} steps past step {base}"
            ),
            out,
        )
        return
    rec.last_seen = now
    rec.step = ev.step
    # A shard gets the same report as every other shard (its counters cover every fragment): it
    # keeps them all, but books, resends and judges only the fragments it owns.
    for p in state.owned:
        held = ev.versions[p]
        if held != rec.versions[p] or p not in rec.held_since:
            rec.held_since[p] = now
        if 0 <= held and _resends_whole(state, rec, p, now, lag=WHOLE_RESEND_LAG, held=held):
            out.append(update_effect(state, p, (rec.id,)))
    for p in state.owned:
        reset = ev.versions[p] != rec.versions[p]
        state.ledger.report(rec.id, p, ev.tokens[p], reset=reset, carried=carried[p])
    rec.versions, rec.steps, rec.tokens = list(ev.versions), list(ev.steps), list(ev.tokens)
    caught_up = all(rec.versions[p] >= 0 for p in state.owned)
    if rec.status is LearnerStatus.RECOVERING and caught_up and state.holds_parameters:
        rec.status = LearnerStatus.LIVE
        rec.caught_up_at = now
        out.append(Log("info", f"learner {rec.id} caught up after {now - rec.joined_at:.3f} s and is live"))
    _advance_global_step(state, now, out)


def _advance_global_step(state: SyncerState, now: float, out: list[Effect]) -> None:
    live = state.live()
    if not live or not state.holds_parameters:
        return
    steps = sorted((r.step for r in live), reverse=True)
    target = steps[min(state.config.quorum, len(steps)) - 1]
    if target <= state.global_step:
        return
    if state.global_step_at is not None:
        per_step = (now - state.global_step_at) / (target - state.global_step)
        state.timing = observe(state.timing, state.config.grace, step_s=per_step)
    previous, state.global_step, state.global_step_at = state.global_step, target, now
    for step, p in state.schedule.opened_between(previous + 1, target + 1):
        if state.owns(p):  # another shard opens its own fragments' rounds at the same global step
            _open_round(state, p, step, now, out)


def _open_round(state: SyncerState, p: int, step: int, now: float, out: list[Effect]) -> None:
    frag = state.fragments[p]
    if frag.open is not None:
        _close_round(state, p, now, out, why="next round of the fragment opened")
    frag.rounds_opened += 1
    asked = tuple(r.id for r in state.live())
    frag.open = Round(frag.rounds_opened, now, step, asked)
    if frag.kept:  # pushes that arrived between two rounds join this one, in learner order
        frag.open.pushes, frag.kept = dict(sorted(frag.kept.items())), {}
        _after_delivery(state, p, now, out)


# ---- pushes -----------------------------------------------------------------------------------------


def _on_push(state: SyncerState, ev: Push, now: float, out: list[Effect]) -> None:
    rec = state.learners.get(ev.learner)
    if rec is None or rec.status is LearnerStatus.GONE:
        return
    rec.last_seen = now
    rejection = _admit(state, rec, ev)
    # The ledger's open window of (learner, fragment) is the one of the version the learner last
    # reported. A push against another version belongs to a window that is already closed (its
    # progress overtook the push: its tokens were booked as lost then) or not yet opened: booking it
    # here would count its tokens a second time.
    books = (
        _valid_fragment(state, ev.fragment)
        and state.owns(ev.fragment)  # another shard's fragment: its books are that shard's
        and ev.base_version == rec.versions[ev.fragment]
    )
    if rejection is not None:
        if books:
            state.ledger.fate(ev.learner, ev.fragment, ev.tokens, rejection.fate)
        _reject(state, ev.learner, rejection, out)
        if rejection.code == "stale":
            _count_late(state, "rejected", now, out)
            if _resends_whole(state, rec, ev.fragment, now, lag=1):
                # Only where the current version is not on its way to the learner: one that pushes
                # from far behind while the broadcast's deltas queue up to it (a loaded link) would
                # otherwise get a whole copy on top of them, per refused push.
                out.append(update_effect(state, ev.fragment, (ev.learner,)))
        return
    frag = state.fragments[ev.fragment]
    waiting = frag.open.pushes if frag.open is not None else frag.kept
    older = waiting.get(ev.learner)
    if books:
        state.ledger.hold(ev.learner, ev.fragment, ev.tokens)
    ev = _increment(rec, ev)
    if older is not None:
        # A push holds only what the learner trained since its previous push of the fragment
        # (docs/protocol.md, "Learner-driven pushes"), so an older one still waiting is not part of
        # it: both go into the round, summed as one push from the older base.
        ev = _joined_pushes(older, ev)
    waiting[ev.learner] = ev
    if frag.open is not None:
        _after_delivery(state, ev.fragment, now, out)


def _resends_whole(
    state: SyncerState, rec: LearnerRecord, p: int, now: float, lag: int, held: int | None = None
) -> bool:
    """Whether fragment p's current version goes to the learner whole now (and is booked so, once
    per version): the learner holds an older one (its last report's, or `held`), and the current
    version was never addressed to it, or what it holds is `lag` or more behind and has stood still
    for WHOLE_RESEND_STUCK_S."""
    version = state.fragments[p].version
    if rec.resent.get(p, -1) >= version:
        return False
    held = rec.versions[p] if held is None else held
    if held >= version:
        return False  # it holds the current version already
    stuck = held <= version - lag and now - rec.held_since.get(p, now) >= WHOLE_RESEND_STUCK_S
    if rec.addressed.get(p, -1) >= version and not stuck:
        return False
    rec.resent[p] = version
    return True


def _increment(rec: LearnerRecord, ev: Push) -> Push:
    """The push with the counters it adds: a learner's counters run since the version it holds
    (the ledger's window), and a second push from the same base carries them again, grown; its
    outer gradient holds only the progress since the first, and so its weight counts only the steps
    and tokens since. A counter that shrank (a learner bug) adds nothing."""
    last = rec.pushed.get(ev.fragment)
    rec.pushed[ev.fragment] = (ev.base_version, ev.steps, ev.tokens)
    if last is None or last[0] != ev.base_version:
        return ev
    steps = max(0, ev.steps - last[1])
    tokens = max(0, ev.tokens - last[2]) if steps else 0
    return replace(ev, steps=steps, tokens=tokens)


def _joined_pushes(older: Push, newer: Push) -> Push:
    """One push holding the progress of both: the sum of the two outer gradients in fp32, from the
    older base (so the older part's staleness discounts it), with both pushes' counters."""
    total = older.payload.decode(parallel=False)
    total += newer.payload.decode(parallel=False)
    payload = codecs.parse(codecs.encode(total, codecs.Codec.FP32, parallel=False))
    return Push(
        newer.learner,
        newer.fragment,
        newer.step,
        older.base_version,
        min(older.steps + newer.steps, TOKENS_MAX),
        min(older.tokens + newer.tokens, TOKENS_MAX),
        payload,
    )


def _admit(state: SyncerState, rec: LearnerRecord, ev: Push) -> Rejection | None:
    foreign = _foreign(state, ev.fragment)
    if foreign is not None:
        return foreign
    if rec.status is not LearnerStatus.LIVE:
        return Rejection("not_live", f"learner {rec.id} is {rec.status.value}; only live learners contribute")
    if not _valid_fragment(state, ev.fragment):
        return Rejection("bad_shape", f"fragment {ev.fragment} does not exist")
    frag = state.fragments[ev.fragment]
    if ev.base_version > frag.version:
        return Rejection(
            "bad_counters", f"fragment {ev.fragment}: base version {ev.base_version} is newer than {frag.version}"
        )
    if frag.version - ev.base_version > STALENESS_MAX:
        return _too_stale(ev, frag.version)
    padded = state.layout.fragments[ev.fragment].padded_size
    if ev.payload.elements != padded:
        return Rejection("bad_shape", f"fragment {ev.fragment} has {padded} elements, push has {ev.payload.elements}")
    if ev.payload.codec.value not in state.config.push_codecs:
        return Rejection(
            "bad_shape", f"codec {ev.payload.codec.value} not accepted (accepted: {state.config.push_codecs})"
        )
    if not _counters_valid(ev.steps, ev.tokens):
        return Rejection(
            "bad_counters",
            f"counters steps={ev.steps} tokens={ev.tokens}: out of [0, {TOKENS_MAX}], or tokens without steps",
        )
    if not ev.payload.within(PAYLOAD_ABS_MAX):
        return Rejection(
            "non_finite",
            f"outer gradient of fragment {ev.fragment} has NaN, Inf or values beyond +-{PAYLOAD_ABS_MAX:.3g}",
        )
    return None


def _too_stale(ev: Push, version: int) -> Rejection:
    return Rejection(
        "stale",
        f"fragment {ev.fragment}: base version {ev.base_version} is {version - ev.base_version} versions behind "
        f"{version} (at most {STALENESS_MAX} are merged, discounted); its tokens are lost",
        fate="lost",
    )


def _count_late(state: SyncerState, outcome: str, now: float, out: list[Effect]) -> None:
    """Count a late push; at most once per LATE_LOG_INTERVAL_S, one line sums those since the last."""
    state.late_pushes[outcome] += 1
    state.late_unlogged[outcome] += 1
    if state.late_logged_at is None:
        state.late_logged_at = now  # the first interval starts with the first late push
    if now - state.late_logged_at < LATE_LOG_INTERVAL_S:
        return
    n = state.late_unlogged
    out.append(
        Log(
            "info",
            f"late pushes: {n['carried']} carried, {n['rejected']} rejected in the last {now - state.late_logged_at:.0f} s",
        )
    )
    state.late_unlogged = {"carried": 0, "rejected": 0}
    state.late_logged_at = now


def _counters_valid(steps: int, tokens: int) -> bool:
    """What `token_weight` takes: both in [0, TOKENS_MAX], and no tokens without steps."""
    return 0 <= steps <= TOKENS_MAX and 0 <= tokens <= TOKENS_MAX and not (steps == 0 and tokens > 0)


def _foreign(state: SyncerState, p: int) -> Rejection | None:
    """The refusal of a push or initial fragment sent to the wrong shard, or None (an existing
    fragment this syncer owns, or one that does not exist: refused as such further on). A learner
    routes fragment p to shard p mod N (core.shards); one that does not is a learner bug or a
    shard started with the wrong index, and the text says which shard should have had it."""
    cfg = state.config
    if cfg.shards == 1 or not isinstance(p, int) or not 0 <= p < cfg.num_fragments or state.owns(p):
        return None
    return Rejection(
        "wrong_shard",
        f"fragment {p} belongs to shard {owner(p, cfg.shards)} of {cfg.shards}; this is shard {cfg.shard}",
    )


def _valid_fragment(state: SyncerState, p: int) -> bool:
    return isinstance(p, int) and 0 <= p < state.config.num_fragments and state.layout is not None


def _after_delivery(state: SyncerState, p: int, now: float, out: list[Effect]) -> None:
    """Quorum and grace: decide whether round p closes now, later, or waits. Both count on-time
    pushes only (`_on_time`): a late push rides along, it never closes a round."""
    frag = state.fragments[p]
    rnd = frag.open
    delivered = [m for m, push in rnd.pushes.items() if push.weight > 0 and _on_time(state, p, m)]
    if len(delivered) < state.config.quorum:
        return
    if rnd.quorum_at is None:
        rnd.quorum_at = now
        state.timing = observe(state.timing, state.config.grace, quorum_s=now - rnd.opened_at)
        rnd.grace_s, why = grace_seconds(state.timing, state.config.grace)
        if rnd.grace_s > 0 and not _all_delivered(state, p):
            out.append(ArmTimer(p, rnd.number, now + rnd.grace_s))
            return
        _close_round(state, p, now, out, why=why if rnd.grace_s == 0 else "every asked learner delivered")
    elif _all_delivered(state, p):
        _close_round(state, p, now, out, why="every asked learner delivered within the grace window")


def _on_time(state: SyncerState, p: int, learner: int) -> bool:
    """Whether the learner's newest admitted push of fragment p (`LearnerRecord.pushed`: a push summed
    into an older one waiting takes the older one's base, but its own is recorded there) was computed
    from the version p's round merges onto. A push from an older version (late: carried from an
    earlier round, or sent before the learner held the newest) is merged, discounted, but it counts
    neither for the quorum nor for "every learner delivered": the late pushes of the round before
    would then close each round as it opens, before any learner could push from its newest version,
    and every push would be merged one version late from then on (docs/algorithm.md, "Late pushes")."""
    last = state.learners[learner].pushed.get(p)
    return last is not None and last[0] == state.fragments[p].version


def _all_delivered(state: SyncerState, p: int) -> bool:
    """Every live learner asked in fragment p's open round has delivered an on-time push."""
    rnd = state.fragments[p].open
    waiting = [
        m
        for m in rnd.asked
        if state.learners[m].status is LearnerStatus.LIVE and not (m in rnd.pushes and _on_time(state, p, m))
    ]
    return not waiting


def _on_timer(state: SyncerState, ev: TimerFired, now: float, out: list[Effect]) -> None:
    if not 0 <= ev.fragment < len(state.fragments):
        return
    rnd = state.fragments[ev.fragment].open
    if rnd is None or rnd.number != ev.round or rnd.quorum_at is None:
        return  # the round closed already; timers are never cancelled, they just find nothing to do
    _close_round(state, ev.fragment, now, out, why=f"grace window of {rnd.grace_s * 1000:.0f} ms expired")


# ---- closing a round: merge, outer step, broadcast -------------------------------------------------------


def _close_round(
    state: SyncerState, p: int, now: float, out: list[Effect], why: str, quorum: int | None = None
) -> None:
    """Close fragment p's open round: merge its pushes if `quorum` of them (the config's unless
    given) have weight, else keep them for the next round."""
    quorum = state.config.quorum if quorum is None else quorum
    frag = state.fragments[p]
    rnd = frag.open
    frag.open = None
    kept: dict[int, Push] = {}
    for m, push in sorted(rnd.pushes.items()):
        if frag.version - push.base_version > STALENESS_MAX:  # grew stale while it waited
            state.ledger.decide(m, p, "lost")
            _count_late(state, "rejected", now, out)
        else:
            kept[m] = push
    positive = [_Discounted(c, frag.version - c.base_version) for c in kept.values() if c.weight > 0]
    missing = [m for m in rnd.asked if m not in rnd.pushes]
    if len(positive) < quorum:
        # Nothing merged: the pushes are as good for the next round of the fragment as they were for this.
        frag.kept = kept | frag.kept
        _decide(state, now, p, rnd, "skipped", f"skipped: quorum {len(positive)}/{quorum} ({why})", out)
        return
    spec = state.layout.fragments[p]
    delta, info = merge_round(positive, spec, state.config.merge)
    frag.theta, frag.momentum = outer.update(frag.momentum, frag.theta, delta, state.config.outer, donate=True)
    for m, push in kept.items():
        late = push.base_version != frag.version
        state.ledger.decide(m, p, ("merged_late" if late else "merged") if push.weight > 0 else "late")
        if late and push.weight > 0:
            _count_late(state, "carried", now, out)
    frag.version += 1
    body, block = publishing.publish(frag.published, frag.theta, state.config.broadcast_codec, state.layout.block)
    frag.delta = publishing.Delta(state.config.broadcast_codec, block, frag.version - 1, body)
    state.merges += 1
    state.merges_since_checkpoint += 1
    late_text = f"; missing {', '.join(f'learner {m}' for m in missing)}" if missing else ""
    stale = sum(1 for c in positive if c.staleness)
    stale_text = f"; {stale} late, discounted" if stale else ""
    waited = (now - rnd.quorum_at) * 1000 if rnd.quorum_at is not None else 0.0
    fallback = f"; mean fallback for {len(info.mean_fallback_tensors)} tensors" if info.mean_fallback_tensors else ""
    reason = (
        f"merged {len(positive)}/{len(rnd.asked)} (quorum {state.config.quorum}) after {waited:.0f} ms of grace: "
        f"{why}{late_text}{stale_text}{fallback}"
    )
    _decide(state, now, p, rnd, "merged", reason, out)
    receivers = tuple(r.id for r in state.connected() if r.status in _RECEIVERS)
    out.append(update_effect(state, p, receivers, base_version=frag.version - 1))
    out.append(Merged(p, frag.version, info.learners, info.weights, rnd.grace_s, now - rnd.opened_at))


@dataclass(frozen=True)
class _Discounted:
    """A push as the merge reads it (core.merge.Contribution): its token weight times 1/(1+s) for a
    staleness of s versions (docs/algorithm.md, "Late pushes"). On time (s = 0) the weight is the
    push's own, bit for bit."""

    push: Push
    staleness: int

    @property
    def learner(self) -> int:
        return self.push.learner

    @property
    def payload(self) -> codecs.Encoded:
        return self.push.payload

    @property
    def weight(self) -> float:
        w = self.push.weight
        return w if self.staleness == 0 else w / (1 + self.staleness)


_RECEIVERS = (LearnerStatus.LIVE, LearnerStatus.RECOVERING)


def _decide(state: SyncerState, now: float, p: int, rnd: Round, outcome: str, reason: str, out: list[Effect]) -> None:
    decision = Decision(now, p, rnd.number, outcome, state.fragments[p].version, reason)
    state.decisions.append(decision)
    while len(state.decisions) > state.config.decisions_kept:
        state.decisions.popleft()
    out.append(Log("info", f"fragment {p} round {rnd.number}: {reason}"))


def update_effect(state: SyncerState, p: int, learners: tuple[int, ...], base_version: int = -1) -> SendUpdate:
    """The effect that sends the current version of fragment p to `learners`: as the delta from
    `base_version` to those the shell knows hold it (net.shell), whole to the others; whole to all
    with base_version -1. Each learner's record keeps the version as addressed to it."""
    frag = state.fragments[p]
    block = frag.delta.block if base_version >= 0 else 0
    for m in learners:
        rec = state.learners.get(m)
        if rec is not None:
            rec.addressed[p] = frag.version
    return SendUpdate(learners, p, frag.version, base_version, block)


def update_values(state: SyncerState, p: int, whole: bool) -> tuple[str, int, int, int, np.ndarray]:
    """(codec, version, base version, block, values) of fragment p as broadcast: with `whole` (or
    when there is no delta to the current version) the published copy in fp32, base version -1, a
    read-only view of the syncer's own array (no copy); else the delta's codec body, which applies
    onto the published copy of the version before. Valid only until the next `handle` call, which
    may publish into the array in place: copy it into frames before then."""
    frag = state.fragments[p]
    if whole or frag.delta is None:
        values = frag.published.view()
        values.flags.writeable = False
        return codecs.Codec.FP32.value, frag.version, -1, 0, values
    delta = frag.delta
    return delta.codec.value, frag.version, delta.base_version, delta.block, delta.body


def _full_update(state: SyncerState, learners: tuple[int, ...]) -> list[Effect]:
    return [update_effect(state, p, learners) for p in state.owned]


# ---- learners leaving, costs, checkpoints, rejections --------------------------------------------------


def _on_disconnect(state: SyncerState, ev: Disconnect, now: float, out: list[Effect]) -> None:
    rec = state.learners.get(ev.learner)
    if rec is None or rec.status is LearnerStatus.GONE:
        return
    was = rec.status
    rec.status = LearnerStatus.GONE
    state.ledger.learner_gone(rec.id)
    out.append(Log("warning", f"learner {rec.id} ({rec.name}) gone: {ev.reason}"))
    if was is LearnerStatus.INITIALIZING:
        _hand_over_init(state, out)
    # Its delivered pushes stay valid; rounds that only waited for it may close now.
    for p, frag in enumerate(state.fragments):
        if frag.open is not None and frag.open.quorum_at is not None and _all_delivered(state, p):
            _close_round(state, p, now, out, why=f"learner {rec.id} left, every other asked learner delivered")
    if not state.live():
        _merge_what_waits(state, now, out)


def _merge_what_waits(state: SyncerState, now: float, out: list[Effect]) -> None:
    """No learner is live any more: the pushes that wait for a round (the last ones of learners that
    left, `close(params)` pushing all they trained) are merged now, one round per fragment, whatever
    the quorum. No one is left to push more or to move the global step to the next round, and the
    training they hold would be missing from the model (and from a checkpoint written at the end of
    a job), booked as neither merged nor lost. Learners that join later start from the result."""
    for p, frag in enumerate(state.fragments):
        if not state.owns(p) or frag.theta is None:
            continue
        if frag.open is None and frag.kept:
            _open_round(state, p, state.global_step, now, out)  # the kept pushes join it, and may close it
        if frag.open is not None and frag.open.pushes:
            _close_round(state, p, now, out, why="every learner left", quorum=1)


def _hand_over_init(state: SyncerState, out: list[Effect]) -> None:
    """The learner asked for version 0 died half-way: forget its partial fragments, ask the next."""
    for frag in state.fragments:
        frag.theta, frag.momentum, frag.published, frag.delta = None, None, None, None
    nxt = next((r for r in state.connected() if r.status is LearnerStatus.JOINING), None)
    if nxt is None:
        return
    nxt.status = LearnerStatus.INITIALIZING
    nxt.versions = [-1] * state.config.num_fragments
    out.append(Log("info", f"asking learner {nxt.id} for the initial parameters instead"))
    out.append(_welcome(state, nxt.conn, nxt.id, True))


def _on_cost(state: SyncerState, ev: MergeCost, now: float, out: list[Effect]) -> None:
    state.timing = observe(state.timing, state.config.grace, sync_s=ev.seconds)


def _maybe_checkpoint(state: SyncerState, now: float, out: list[Effect]) -> None:
    cfg = state.config
    if not state.merges_since_checkpoint:
        return
    by_count = cfg.checkpoint_every_merges and state.merges_since_checkpoint >= cfg.checkpoint_every_merges
    by_time = cfg.checkpoint_every_s and now - state.checkpoint_at >= cfg.checkpoint_every_s
    if by_count or by_time:
        out.append(WriteCheckpoint(f"{state.merges_since_checkpoint} merges since the last checkpoint"))
        state.merges_since_checkpoint = 0
        state.checkpoint_at = now


def _reject(state: SyncerState, learner: int, rejection: Rejection, out: list[Effect]) -> None:
    state.rejections[rejection.code] = state.rejections.get(rejection.code, 0) + 1
    out.append(SendError(rejection.code, rejection.text, False, learner=learner))
    out.append(Log("warning", f"learner {learner}: rejected ({rejection.code}): {rejection.text}"))


def _versions(state: SyncerState) -> tuple[int, ...]:
    return tuple(f.version if f.theta is not None else -1 for f in state.fragments)


def _layout_difference(ours: Layout, theirs: Layout) -> str:
    mine = {t.path: t for t in ours.tensors}
    other = {t.path: t for t in theirs.tensors}
    only_ours = sorted(set(mine) - set(other))[:3]
    only_theirs = sorted(set(other) - set(mine))[:3]
    changed = sorted(p for p in set(mine) & set(other) if mine[p] != other[p])[:3]
    return (
        f"layout digest {theirs.digest[:12]} does not match the syncer's {ours.digest[:12]}: "
        f"missing {only_ours}, unexpected {only_theirs}, different shape/dtype/embedding {changed}"
    )


def state_hash(state: SyncerState) -> str:
    """A hash of everything a resumed syncer must reproduce: layout, versions, parameters, momentum,
    the published copies."""
    h = hashlib.sha256()
    h.update((state.layout.digest if state.layout else "").encode())
    for frag in state.fragments:
        h.update(f"{frag.version}:{frag.rounds_opened};".encode())
        if frag.theta is not None:
            h.update(frag.theta.tobytes())
            h.update(frag.momentum.buf.tobytes())
            h.update(frag.published.tobytes())
    h.update(f"step={state.global_step};merges={state.merges}".encode())
    return h.hexdigest()


_HANDLERS = {
    Join: _on_join,
    InitFragment: _on_init,
    Progress: _on_progress,
    Push: _on_push,
    TimerFired: _on_timer,
    Disconnect: _on_disconnect,
    MergeCost: _on_cost,
}
