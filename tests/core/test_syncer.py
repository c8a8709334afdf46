"""The syncer core under a virtual clock: events in, effects out, decisions with reasons."""

import numpy as np
import pytest

from ddiloco.core import codec, syncer
from ddiloco.core.config import SyncerConfig
from ddiloco.core.events import (
    ArmTimer,
    Disconnect,
    Drop,
    InitFragment,
    Join,
    Log,
    MergeCost,
    Merged,
    Progress,
    Push,
    SendError,
    SendUpdate,
    SendWelcome,
    TimerFired,
    WriteCheckpoint,
)
from ddiloco.core.grace import GraceConfig
from ddiloco.core.layout import TensorSpec
from ddiloco.core.syncer import STALENESS_MAX, STEP_JUMP_MAX, LearnerStatus
from ddiloco.core.weights import TOKENS_MAX

TENSORS = (
    TensorSpec("embed", (64, 8), embedding=True),
    TensorSpec("blocks/0/w", (8, 32)),
    TensorSpec("blocks/1/w", (8, 32)),
    TensorSpec("head", (8, 16)),
)


class Harness:
    """Drives the real core; the clock is a number we set."""

    def __init__(self, **cfg):
        cfg.setdefault("num_fragments", 2)
        cfg.setdefault("period", 2)
        self.state = syncer.new_state(SyncerConfig(**cfg))
        self.now = 0.0
        self.effects = []
        self.steps = {}

    def send(self, event, dt=0.0):
        self.now += dt
        self.state, effects = syncer.handle(self.state, event, self.now)
        self.effects += effects
        return effects

    def join(self, name, conn):
        (welcome,) = [
            e for e in self.send(Join(conn, name, TENSORS, syncer.PROTOCOL_VERSION)) if isinstance(e, SendWelcome)
        ]
        return welcome

    def init_from(self, learner, seed=0):
        rng = np.random.default_rng(seed)
        for f in self.state.layout.fragments:
            vec = rng.standard_normal(f.padded_size).astype(np.float32)
            self.send(InitFragment(learner, f.index, codec.parse(codec.encode(vec, "fp32"))))

    def progress(self, learner, step, dt=0.0, tokens_per_step=100):
        versions = tuple(f.version for f in self.state.fragments)
        steps = tuple(step - self.steps.get((learner, p), 0) for p in range(len(versions)))
        return self.send(Progress(learner, step, versions, steps, tuple(s * tokens_per_step for s in steps)), dt)

    def push(self, learner, fragment, step, dt=0.0, base=None, tokens=100, steps=1, vec=None, name="int4"):
        spec = self.state.layout.fragments[fragment]
        if vec is None:
            vec = np.random.default_rng(learner).standard_normal(spec.padded_size).astype(np.float32) * 0.01
        base = self.state.fragments[fragment].version if base is None else base
        return self.send(Push(learner, fragment, step, base, steps, tokens, codec.parse(codec.encode(vec, name))), dt)

    def of(self, kind, effects=None):
        return [e for e in (self.effects if effects is None else effects) if isinstance(e, kind)]


def two_live(h):
    w1 = h.join("a", conn=10)
    assert w1.needs_init and w1.learner == 1
    w2 = h.join("b", conn=11)
    assert not w2.needs_init
    h.init_from(1)
    assert h.state.learners[1].status is LearnerStatus.LIVE
    # learner 2 got every fragment and becomes live once it reports holding them
    updates = h.of(SendUpdate)
    assert {u.fragment for u in updates if 2 in u.learners} == {0, 1}
    h.progress(2, 0)
    assert h.state.learners[2].status is LearnerStatus.LIVE
    assert h.state.init_source == "learner 1"


def test_first_learner_seeds_version_zero_and_others_recover_from_syncer():
    h = Harness()
    two_live(h)
    assert syncer.state_hash(h.state)


def test_quorum_one_without_timing_merges_at_once_with_reason():
    h = Harness(quorum=1)
    two_live(h)
    opened = h.progress(1, 1)
    rnd = h.state.fragments[1].open  # step 1 opens fragment 1 (t_1 = 1), asking nobody (protocol 2)
    assert rnd is not None and rnd.asked == (1, 2) and h.state.fragments[0].open is None
    assert not h.of(SendError, opened)
    effects = h.push(1, 1, 1, dt=0.01)
    (merged,) = h.of(Merged, effects)
    assert merged.fragment == 1 and merged.version == 1 and merged.learners == (1,)
    decision = h.state.decisions[-1]
    assert decision.outcome == "merged"
    assert "merged 1/2 (quorum 1)" in decision.reason and "step time not measured" in decision.reason
    assert "missing learner 2" in decision.reason
    (update,) = h.of(SendUpdate, effects)
    assert update.learners == (1, 2) and update.version == 1
    # learner 2's push arrives after the round closed: kept for the next round of the fragment
    late = h.push(2, 1, 1, base=0)
    assert not h.of(SendError, late) and not h.of(Merged, late)
    assert 2 in h.state.fragments[1].kept
    h.progress(1, 2)
    assert not h.of(Merged, h.progress(1, 3))  # the next round of fragment 1 opens with it, waits for learner 1
    on_time = h.push(1, 1, 3, base=1)
    # Learner 2's waiting push is late: it is merged, but it does not count as learner 2 having
    # delivered, so the round waits out its grace window for an on-time push of learner 2.
    assert not h.of(Merged, on_time)
    (timer,) = h.of(ArmTimer, on_time)
    (merged,) = h.of(Merged, h.send(TimerFired(timer.fragment, timer.round), dt=timer.at - h.now))
    assert merged.learners == (1, 2) and merged.version == 2
    assert h.state.ledger.totals["merged_late"] == 100 and h.state.late_pushes == {"carried": 1, "rejected": 0}
    assert "1 late, discounted" in h.state.decisions[-1].reason
    h.state.ledger.check()


def open_round(h, step, step_s=0.1):
    """Both learners report `step`; (fragment, round number) of the round it opened."""
    opened = [f.rounds_opened for f in h.state.fragments]
    h.progress(1, step, dt=step_s)
    h.progress(2, step)
    (p,) = [p for p, f in enumerate(h.state.fragments) if f.rounds_opened > opened[p]]
    assert h.state.fragments[p].open is not None, "no round opened"
    return p, h.state.fragments[p].open.number


def measure_timing(h, steps=3):
    """Both learners step every 0.1 s and deliver every round, so the step-time EMA is measured."""
    for step in range(1, steps + 1):
        fragment, rnd = open_round(h, step)
        h.push(1, fragment, rnd)
        h.push(2, fragment, rnd)


def test_grace_window_waits_then_closes_early_when_all_delivered():
    h = Harness(quorum=1, grace=GraceConfig(gamma=0.5, grace_ms_max=1000.0, overlap=2))
    two_live(h)
    measure_timing(h)
    h.effects.clear()
    fragment, rnd = open_round(h, 4)
    eff = h.push(1, fragment, rnd, dt=0.02)
    (timer,) = h.of(ArmTimer, eff)
    t = h.state.timing
    slack = 2 * t.step_s - (t.quorum_s + (t.sync_s or 0))
    assert timer.at - h.now == pytest.approx(0.5 * slack)
    assert not h.of(Merged, eff)
    eff = h.push(2, fragment, rnd, dt=0.01)  # the straggler arrives inside the window
    (merged,) = h.of(Merged, eff)
    assert merged.learners == (1, 2)
    assert "every asked learner delivered within the grace window" in h.state.decisions[-1].reason
    # the timer, when it fires later, finds the round closed and does nothing
    assert h.send(TimerFired(timer.fragment, timer.round), dt=1.0) == []


def test_grace_expiry_excludes_straggler_and_is_capped():
    h = Harness(quorum=1, grace=GraceConfig(gamma=0.9, grace_ms_max=30.0, overlap=2))
    two_live(h)
    measure_timing(h)
    fragment, rnd = open_round(h, 4)
    (timer,) = h.of(ArmTimer, h.push(1, fragment, rnd, dt=0.01))
    assert timer.at - h.now == pytest.approx(0.030)  # 0.9 x slack is above the cap
    eff = h.send(TimerFired(fragment, rnd), dt=0.030)
    (merged,) = h.of(Merged, eff)
    assert merged.learners == (1,)
    assert "grace window of 30 ms expired" in h.state.decisions[-1].reason
    assert "missing learner 2" in h.state.decisions[-1].reason


def test_sync_cost_shrinks_the_window():
    h = Harness(quorum=1, grace=GraceConfig(gamma=0.5, grace_ms_max=10_000.0, overlap=2))
    two_live(h)
    measure_timing(h)
    h.send(MergeCost(seconds=1.0))  # merging takes longer than the whole overlap
    fragment, rnd = open_round(h, 4)
    eff = h.push(1, fragment, rnd)
    assert not h.of(ArmTimer, eff) and h.of(Merged, eff)  # no slack, no grace


def test_quorum_two_waits_for_both_and_skips_when_superseded():
    h = Harness(quorum=2)
    two_live(h)
    fragment, rnd = open_round(h, 1)
    assert not h.of(Merged, h.push(1, fragment, rnd))
    # the next round of the same fragment opens (period 2) before learner 2 delivers: skipped
    open_round(h, 2)
    h.progress(1, 3)
    h.progress(2, 3)
    assert any(d.outcome == "skipped" and d.fragment == fragment for d in h.state.decisions)
    assert "skipped: quorum 1/2" in [d for d in h.state.decisions if d.outcome == "skipped"][0].reason


def test_the_round_keeps_the_push_it_was_handed_and_merges_from_its_payload():
    h = Harness(quorum=2)
    two_live(h)
    fragment, rnd = open_round(h, 1)
    spec = h.state.layout.fragments[fragment]
    vec = np.linspace(-0.01, 0.01, spec.padded_size, dtype=np.float32)
    push = Push(1, fragment, rnd, 0, 2, 200, codec.parse(codec.encode(vec, "int4")))
    assert not h.of(Merged, h.send(push))
    assert h.state.fragments[fragment].open.pushes[1] is push  # the value itself, no record copied from it
    assert push.weight == 200 * 200 / 2
    theta = h.state.fragments[fragment].theta.copy()
    (merged,) = h.of(Merged, h.push(2, fragment, rnd, vec=vec))
    assert merged.learners == (1, 2)
    assert not np.array_equal(h.state.fragments[fragment].theta, theta)  # merged from the kept payload


def merge_alone(h, learner, versions):
    """Learner `learner` alone merges fragment 1 `versions` times (quorum 1); the other reports its
    steps but still holds version 0 of fragment 1."""
    step = h.state.learners[learner].step
    while h.state.fragments[1].version < versions:
        step += 1
        h.progress(learner, step)
        if h.state.fragments[1].open is not None:
            h.push(learner, 1, step)
    return step


def test_late_push_carried_with_a_harmonic_discount_and_booked_merged_late():
    h = Harness(quorum=1)
    two_live(h)
    step = merge_alone(h, 1, 3)  # fragment 1 at version 3; learner 2 still holds version 0
    h.progress(1, step + 1)  # fragment 0's round
    h.send(Progress(2, step, (0, 0), (step, step), (100 * step, 100 * step)))
    eff = h.push(2, 1, step, base=0, tokens=100 * step, steps=step)  # s = 3 when merged
    assert not h.of(SendError, eff) and 2 in h.state.fragments[1].kept
    on_time_w = 300.0**2 / 3
    h.push(1, 1, step + 2, tokens=300, steps=3, base=3)  # kept too: no round of fragment 1 is open
    (merged,) = h.of(Merged, h.progress(1, step + 2))  # the round opens with both, quorum 1: merged
    late_w = (100.0 * step) ** 2 / step / (1 + 3)
    assert merged.learners == (1, 2)
    assert merged.weights == pytest.approx((on_time_w / (on_time_w + late_w), late_w / (on_time_w + late_w)))
    ledger = h.state.ledger
    assert ledger.of_learner(2)["merged_late"] == 100 * step and ledger.of_learner(1)["merged_late"] == 0
    ledger.check()


def test_push_more_than_staleness_max_behind_rejected_lost_and_current_version_resent():
    h = Harness(quorum=1)
    two_live(h)
    step = merge_alone(h, 1, STALENESS_MAX + 1)
    h.send(Progress(2, step, (0, 0), (step, step), (100 * step, 100 * step)))
    lost = h.state.ledger.totals["lost"]
    eff = h.push(2, 1, step, base=0, tokens=100 * step, steps=step)
    (err,) = h.of(SendError, eff)
    assert err.code == "stale" and f"{STALENESS_MAX + 1} versions behind" in err.text
    # every version was addressed to it as it was merged: on its way, not sent whole again on top
    assert h.of(SendUpdate, eff) == []
    assert h.state.ledger.totals["lost"] == lost + 100 * step and h.state.late_pushes["rejected"] == 1
    assert 2 not in h.state.fragments[1].kept
    # once its version has stood still that long, the next refused push brings the version whole
    eff = h.push(2, 1, step, base=0, tokens=100 * step, steps=step, dt=syncer.WHOLE_RESEND_STUCK_S)
    (resend,) = h.of(SendUpdate, eff)
    assert resend.learners == (2,) and resend.version == STALENESS_MAX + 1 and resend.base_version < 0
    assert h.of(SendUpdate, h.push(2, 1, step, base=0, tokens=100 * step, steps=step)) == []  # once per version
    h.state.ledger.check()


def test_late_pushes_summed_in_one_log_line_per_interval():
    h = Harness(quorum=1)
    two_live(h)
    step = merge_alone(h, 1, STALENESS_MAX + 1)
    lines = []
    for i in range(3):  # three pushes too stale, 30 s apart: one line at the end of the interval
        eff = h.push(2, 1, step, base=0, dt=30.0 if i else 0.0)
        lines += [e.text for e in h.of(Log, eff) if e.text.startswith("late pushes")]
    assert lines == ["late pushes: 0 carried, 3 rejected in the last 60 s"]


@pytest.mark.parametrize(
    "change, code",
    [
        (dict(vec=np.full(256, np.nan, dtype=np.float32), name="fp32"), "non_finite"),
        (dict(vec=np.zeros(128, dtype=np.float32)), "bad_shape"),
        (dict(tokens=5, steps=0), "bad_counters"),
        # token_weight refuses counters above TOKENS_MAX: admission refuses them first
        (dict(tokens=TOKENS_MAX + 1), "bad_counters"),
        (dict(steps=TOKENS_MAX + 1), "bad_counters"),
    ],
)
def test_bad_pushes_rejected_state_untouched(change, code):
    h = Harness(quorum=1)
    two_live(h)
    fragment, rnd = open_round(h, 1)
    before = syncer.state_hash(h.state)
    if change.get("name") == "fp32":
        # encode refuses NaN, so build the payload by hand: a valid fp32 payload with NaNs patched in
        spec = h.state.layout.fragments[fragment]
        raw = bytearray(codec.encode(np.zeros(spec.padded_size, dtype=np.float32), "fp32"))
        raw[codec.HEADER_BYTES :] = np.full(spec.padded_size, np.nan, dtype=np.float32).tobytes()
        eff = h.send(Push(1, fragment, rnd, 0, 1, 100, codec.parse(raw)))
    else:
        eff = h.push(1, fragment, rnd, **change)
    (err,) = h.of(SendError, eff)
    assert err.code == code
    assert syncer.state_hash(h.state) == before
    assert h.state.rejections[code] == 1


def test_a_second_push_from_the_same_base_is_an_increment_summed_with_the_waiting_one():
    h = Harness(quorum=2)
    two_live(h)
    fragment, rnd = open_round(h, 1)
    h.send(Progress(1, 3, (0, 0), (3, 3), (300, 300)))
    size = h.state.layout.fragments[fragment].padded_size
    first, second = (np.random.default_rng(s).standard_normal(size).astype(np.float32) * 0.01 for s in (5, 6))
    h.push(1, fragment, 1, tokens=100, steps=1, vec=first)
    # The same base: the newer push holds only the progress since the first (its counters, grown, say
    # 300 tokens over 3 steps since the version; it adds 200 over 2).
    newer = h.push(1, fragment, 3, tokens=300, steps=3, vec=second)
    assert not h.of(SendError, newer)
    joined = h.state.fragments[fragment].open.pushes[1]
    assert (joined.step, joined.base_version, joined.steps, joined.tokens) == (3, 0, 3, 300)
    want = codec.parse(codec.encode(first, "int4")).decode() + codec.parse(codec.encode(second, "int4")).decode()
    np.testing.assert_array_equal(joined.payload.decode(), want)
    (merged,) = h.of(Merged, h.push(2, fragment, 1))
    assert merged.learners == (1, 2)
    assert h.state.ledger.of_learner(1)["merged"] == 300  # carried over, counted once
    h.state.ledger.check()


def test_a_push_from_a_newer_base_joins_the_waiting_one_and_nothing_is_lost():
    h = Harness(quorum=2)
    two_live(h)
    fragment, _ = open_round(h, 1)
    h.push(1, fragment, 1, tokens=100, steps=1)
    h.push(2, fragment, 1)  # merged: version 1, learner 1's push merged
    h.send(Progress(2, 2, (0, 0), (2, 2), (200, 200)))
    # Late (kept for the next round) and an increment over the merged one: it adds 100 tokens over 1 step.
    h.push(2, fragment, 2, base=0, tokens=200, steps=2)
    h.send(Progress(2, 3, (0, 1), (3, 1), (300, 100)))  # it took version 1: the window of version 0 closed
    lost = h.state.ledger.totals["lost"]
    kept = h.state.fragments[fragment].kept[2].payload.decode()
    newer = h.push(2, fragment, 3, base=1, tokens=100, steps=1)  # from a newer base: not the kept one's progress
    assert not h.of(SendError, newer)
    joined = h.state.fragments[fragment].kept[2]
    assert (joined.base_version, joined.tokens, joined.steps) == (0, 200, 2)  # the older base: discounted as late
    size = h.state.layout.fragments[fragment].padded_size
    newer_vec = np.random.default_rng(2).standard_normal(size).astype(np.float32) * 0.01  # Harness.push's
    np.testing.assert_array_equal(joined.payload.decode(), kept + codec.parse(codec.encode(newer_vec, "int4")).decode())
    assert h.state.ledger.totals["lost"] == lost and h.state.ledger.held[(2, fragment)] == 200
    h.state.ledger.check()


def test_a_push_from_a_newer_base_than_the_syncer_holds_is_refused():
    h = Harness(quorum=1)
    two_live(h)
    (err,) = h.of(SendError, h.push(1, 0, 1, base=5))
    assert err.code == "bad_counters" and "newer than 0" in err.text


def test_disconnect_lets_round_close_and_books_lost_tokens():
    h = Harness(quorum=1, grace=GraceConfig(gamma=0.5, grace_ms_max=1000.0, overlap=2))
    two_live(h)
    measure_timing(h)
    fragment, rnd = open_round(h, 4)
    assert h.of(ArmTimer, h.push(1, fragment, rnd))
    eff = h.send(Disconnect(2, "connection reset"), dt=0.001)
    assert h.of(Merged, eff)
    assert h.state.learners[2].status is LearnerStatus.GONE
    ledger = h.state.ledger
    ledger.check()
    assert ledger.totals["lost"] > 0 and ledger.totals["merged"] > 0


def test_recovering_learner_has_no_weight():
    h = Harness(quorum=1)
    two_live(h)
    h.join("c", conn=12)
    fragment, rnd = open_round(h, 1)
    assert 3 not in h.state.fragments[fragment].open.asked
    (err,) = h.of(SendError, h.push(3, fragment, rnd))
    assert err.code == "not_live"


def test_only_the_asked_learner_may_initialise():
    h = Harness()
    h.join("a", conn=10)
    h.join("b", conn=11)
    spec = h.state.layout.fragments[0]
    payload = codec.parse(codec.encode(np.ones(spec.padded_size, dtype=np.float32), "fp32"))
    (err,) = h.of(SendError, h.send(InitFragment(2, 0, payload)))
    assert err.code == "not_live"
    assert h.state.fragments[0].theta is None


def test_initialiser_dying_hands_over_to_next():
    h = Harness()
    h.join("a", conn=10)
    h.join("b", conn=11)
    spec = h.state.layout.fragments[0]
    h.send(InitFragment(1, 0, codec.parse(codec.encode(np.ones(spec.padded_size, dtype=np.float32), "fp32"))))
    eff = h.send(Disconnect(1, "killed"))
    (welcome,) = h.of(SendWelcome, eff)
    assert welcome.learner == 2 and welcome.needs_init
    assert h.state.fragments[0].theta is None  # the half-done init was forgotten


def test_welcome_carries_the_round_schedule():
    """Learners report at once on the steps where a round opens: every welcome says which, the
    first and the one handing the initialisation over alike."""
    h = Harness(num_fragments=2, period=6)
    first = h.join("a", conn=10)
    second = h.join("b", conn=11)
    (handed_over,) = h.of(SendWelcome, h.send(Disconnect(1, "killed")))
    assert handed_over.needs_init
    for welcome in (first, second, handed_over):
        assert (welcome.period, welcome.offsets) == (6, h.state.schedule.offsets) == (6, (0, 3))


def test_layout_mismatch_and_protocol_refused():
    h = Harness()
    h.join("a", conn=10)
    other = TENSORS[:-1] + (TensorSpec("head", (8, 17)),)
    eff = h.send(Join(11, "b", other, syncer.PROTOCOL_VERSION))
    (err,) = h.of(SendError, eff)
    assert err.code == "bad_layout" and "head" in err.text and err.fatal
    eff = h.send(Join(12, "c", TENSORS, 99))
    assert h.of(SendError, eff)[0].code == "protocol_version"


@pytest.mark.parametrize(
    "strategy, parts, unit", [("balanced", 4, "tensors"), ("tensor", 4, "tensors"), ("layer", 4, "layers")]
)
def test_more_fragments_than_the_model_has_is_refused_naming_the_setting(strategy, parts, unit):
    h = Harness(num_fragments=6, period=6, strategy=strategy)
    eff = h.send(Join(10, "small", TENSORS, syncer.PROTOCOL_VERSION))
    (err,) = h.of(SendError, eff)
    assert err.code == "bad_layout" and err.fatal and err.conn == 10
    assert err.text == (
        f"the syncer splits the model into 6 fragments but it has {parts} {unit}: "
        f"start the syncer with --fragments {parts} or fewer"
    )
    (warning,) = [e for e in h.of(Log, eff) if e.level == "warning"]  # the syncer's log says it too
    assert "'small'" in warning.text and "4 tensors" in warning.text and err.text in warning.text
    assert h.of(Drop, eff) and not h.of(SendWelcome, eff) and h.state.layout is None and not h.state.learners


def test_every_refused_hello_is_logged_as_a_warning():
    h = Harness()
    h.join("a", conn=10)
    other = TENSORS[:-1] + (TensorSpec("head", (8, 17)),)
    for event in (Join(11, "b", other, syncer.PROTOCOL_VERSION), Join(12, "c", TENSORS, 99)):
        (err,) = h.of(SendError, eff := h.send(event))
        (warning,) = [e for e in h.of(Log, eff) if e.level == "warning"]
        assert f"'{event.name}'" in warning.text and err.code in warning.text and err.text in warning.text


def test_checkpoint_effect_every_n_merges():
    h = Harness(quorum=1, checkpoint_every_merges=2)
    two_live(h)
    for step in range(1, 5):
        fragment, rnd = open_round(h, step)
        h.push(1, fragment, rnd)
        h.push(2, fragment, rnd)
    assert h.state.merges == 4
    assert len(h.of(WriteCheckpoint)) == 2


def test_token_weights_follow_counters():
    h = Harness(quorum=2)
    two_live(h)
    fragment, rnd = open_round(h, 1)
    h.push(1, fragment, rnd, tokens=200, steps=2)  # 200^2/2 = 20000
    eff = h.push(2, fragment, rnd, tokens=300, steps=2)  # 300^2/2 = 45000: more tokens weigh more
    (merged,) = h.of(Merged, eff)
    assert merged.learners == (1, 2)
    assert merged.weights == pytest.approx((20000 / 65000, 45000 / 65000))
    assert h.state.ledger.totals["merged"] == 500


# ---- regressions found by the chaos simulation (docs/chaos-sim.md) ---------------------------------


def test_late_push_after_the_newer_version_was_reported_is_not_booked_twice():
    # Learner 2 answers a request, applies the merged version and reports it: its progress (a
    # control frame) overtakes its push (bulk). The push's window closed with that progress (its
    # tokens were booked as lost then), so the late push must not book them again.
    h = Harness(quorum=1)
    two_live(h)
    fragment, rnd = open_round(h, 1)
    h.push(1, fragment, rnd)  # merged: version 1
    h.progress(2, 2)  # learner 2 holds version 1: a new window for the fragment
    reported = h.state.ledger.reported
    eff = h.push(2, fragment, rnd, base=0, tokens=400, steps=4)
    assert not h.of(SendError, eff)  # late is not lost: kept for the next round, discounted then
    assert h.state.ledger.reported == reported
    h.state.ledger.check()


def test_push_of_a_learner_gone_before_its_round_closed_is_booked_with_the_merge():
    h = Harness(quorum=1, grace=GraceConfig(gamma=0.5, grace_ms_max=1000.0, overlap=2))
    two_live(h)
    measure_timing(h)
    fragment, rnd = open_round(h, 4)
    h.send(
        Progress(
            learner=1, step=4, versions=tuple(f.version for f in h.state.fragments), steps=(1, 1), tokens=(700, 700)
        )
    )
    (timer,) = h.of(ArmTimer, h.push(1, fragment, rnd, tokens=500))
    ledger = h.state.ledger
    lost, merged_tokens = ledger.totals["lost"], ledger.totals["merged"]
    h.send(Disconnect(1, "killed"))  # learner 2 has not delivered: the round waits for its timer
    # its windows close: the 200 tokens trained after its push and the other fragment's 700 are lost;
    # the push's 500 stay held for the round
    assert (1, fragment) not in ledger.windows and (1, 1 - fragment) not in ledger.windows
    assert ledger.totals["lost"] == lost + 700 + 200 and ledger.held[(1, fragment)] == 500
    reported = ledger.reported
    (merged,) = h.of(Merged, h.send(TimerFired(fragment, rnd), dt=timer.at - h.now))
    assert merged.learners == (1,)
    # its push took part in the merge, so its tokens are merged
    assert ledger.totals["merged"] == merged_tokens + 500 and ledger.totals["lost"] == lost + 700 + 200
    assert (1, fragment) not in ledger.held and ledger.reported == reported
    ledger.check()


def test_when_every_learner_has_left_the_pushes_waiting_are_merged_whatever_the_quorum():
    """core.syncer._merge_what_waits: the last pushes of learners that left (one into an open round
    below its quorum, one kept for a round that no live learner will open) are merged once no learner
    is live, and booked merged; while one is live they wait as before."""
    h = Harness(quorum=2)
    two_live(h)
    fragment, rnd = open_round(h, 1)
    other = 1 - fragment
    h.push(1, fragment, rnd, tokens=300)  # into the open round: 1 of the 2 it needs
    h.push(2, other, rnd, tokens=400)  # no round of it is open: kept for the next
    versions = [f.version for f in h.state.fragments]
    assert not h.of(Merged, h.send(Disconnect(1, "bye: done")))  # learner 2 is still live: they wait
    assert [f.version for f in h.state.fragments] == versions
    merged_before = h.state.ledger.totals["merged"]
    merged = h.of(Merged, h.send(Disconnect(2, "bye: done")))
    assert sorted((m.fragment, m.learners) for m in merged) == sorted([(fragment, (1,)), (other, (2,))])
    assert [f.version for f in h.state.fragments] == [v + 1 for v in versions]
    assert all(f.open is None and not f.kept for f in h.state.fragments)
    ledger = h.state.ledger
    assert ledger.totals["merged"] == merged_before + 300 + 400 and not ledger.held
    ledger.check()
    reasons = [d.reason for d in h.state.decisions if d.outcome == "merged"][-2:]
    assert all("every learner left" in r for r in reasons), reasons


def test_progress_overtaken_by_a_newer_one_is_ignored():
    h = Harness(quorum=1)
    two_live(h)
    fragment, rnd = open_round(h, 1)
    h.push(1, fragment, rnd)  # merged: version 1
    held = [f.version for f in h.state.fragments]
    before = [0] * len(held)
    h.send(Progress(learner=2, step=3, versions=tuple(held), steps=(3, 1), tokens=(300, 100)))
    reported = h.state.ledger.reported
    # the report of step 2, delivered late (twice, or out of order), still says version 0
    h.send(Progress(learner=2, step=2, versions=tuple(before), steps=(2, 2), tokens=(200, 200)))
    rec = h.state.learners[2]
    assert rec.step == 3 and rec.versions == held
    assert h.state.ledger.reported == reported
    h.state.ledger.check()


def test_progress_that_jumps_too_far_is_refused_and_moves_nothing():
    h = Harness(quorum=1)
    two_live(h)
    h.progress(1, 4)
    assert h.state.global_step == 4
    before = syncer.state_hash(h.state)
    rounds = [f.rounds_opened for f in h.state.fragments]
    eff = h.progress(1, 4 + STEP_JUMP_MAX + 1)
    (err,) = h.of(SendError, eff)
    assert err.code == "bad_counters" and f"more than {STEP_JUMP_MAX} steps past step 4" in err.text
    assert h.state.learners[1].step == 4 and h.state.global_step == 4
    assert [f.rounds_opened for f in h.state.fragments] == rounds and syncer.state_hash(h.state) == before
    # the largest jump allowed is taken, and measured from the global step for a learner behind it
    assert not h.of(SendError, h.progress(1, 4 + STEP_JUMP_MAX))
    assert h.state.global_step == 4 + STEP_JUMP_MAX
    assert not h.of(SendError, h.progress(2, 4 + 2 * STEP_JUMP_MAX))


def test_progress_counters_above_the_weight_limit_are_refused():
    h = Harness(quorum=1)
    two_live(h)
    versions = tuple(f.version for f in h.state.fragments)
    eff = h.send(Progress(1, 1, versions, (1, 1), (TOKENS_MAX + 1, 1)))
    (err,) = h.of(SendError, eff)
    assert err.code == "bad_counters" and str(TOKENS_MAX) in err.text
    assert h.state.learners[1].step == 0


def test_a_learner_reporting_versions_behind_is_sent_the_fragment_whole_once_per_version():
    """Its copy came from a peer without the published copy, or a delta went astray: it cannot follow
    the delta broadcast, and no stale refusal comes while it holds back its pushes."""
    h = Harness(quorum=1)
    two_live(h)

    def merge_round_of_learner_1(step):
        opened = [f.rounds_opened for f in h.state.fragments]
        h.progress(1, step, dt=0.1)  # learner 2 says nothing meanwhile: the global step is learner 1's
        for p, f in enumerate(h.state.fragments):
            if f.rounds_opened > opened[p]:
                h.push(1, p, step)
                return p
        return None

    for step in range(1, 7):  # both fragments merged three times, learner 2 applying none
        merge_round_of_learner_1(step)
    assert min(f.version for f in h.state.fragments) >= syncer.WHOLE_RESEND_LAG

    def whole_to_2(effects):
        return [e for e in h.of(SendUpdate, effects) if e.learners == (2,) and e.base_version < 0]

    behind = Progress(2, 6, (0, 0), (6, 6), (600, 600))
    assert whole_to_2(h.send(behind)) == []  # not yet: its deltas may be on their way
    sent = whole_to_2(h.send(behind, dt=syncer.WHOLE_RESEND_STUCK_S))  # its version has not moved since
    assert [e.fragment for e in sent] == [p for p, f in enumerate(h.state.fragments) if f.version >= 2]
    assert sent and all(e.version == h.state.fragments[e.fragment].version for e in sent)
    assert whole_to_2(h.send(Progress(2, 7, (0, 0), (7, 7), (700, 700)))) == []  # once per version
    versions = [f.version for f in h.state.fragments]
    for step in (7, 8):
        merge_round_of_learner_1(step)
    newer = [p for p, f in enumerate(h.state.fragments) if f.version > versions[p]]
    again = whole_to_2(h.send(Progress(2, 9, (0, 0), (9, 9), (900, 900))))
    previous = {e.fragment: e.version for e in sent}
    assert newer and set(newer) <= {e.fragment for e in again}  # a newer version: sent again
    assert all(e.version > previous[e.fragment] for e in again)  # and only a newer one
    h.state.ledger.check()


def test_a_learner_that_follows_the_broadcast_slowly_is_not_sent_whole_copies():
    """Versions behind but moving on (the deltas queued to it arrive, late): a whole copy on top of
    them would only slow its link further. Once its version stops moving, it gets one."""
    h = Harness(quorum=1)
    two_live(h)
    held = [f.version for f in h.state.fragments]

    def whole_to_2(effects):
        return [e for e in h.of(SendUpdate, effects) if e.learners == (2,) and e.base_version < 0]

    for step in range(1, 41):
        opened = [f.rounds_opened for f in h.state.fragments]
        h.progress(1, step, dt=0.1)
        for p, f in enumerate(h.state.fragments):
            if f.rounds_opened > opened[p]:
                h.push(1, p, step)
        # learner 2 takes each version three merges after it was made: two or more behind
        held = [max(v, f.version - 3) for v, f in zip(held, h.state.fragments)]
        assert whole_to_2(h.send(Progress(2, step, tuple(held), (step, step), (100 * step, 100 * step)))) == []
    assert min(f.version - v for f, v in zip(h.state.fragments, held)) >= syncer.WHOLE_RESEND_LAG
    stuck = Progress(2, 41, tuple(held), (41, 41), (4100, 4100))
    assert whole_to_2(h.send(stuck, dt=syncer.WHOLE_RESEND_STUCK_S)) != []


def test_late_pushes_ride_along_but_never_close_a_round():
    h = Harness(quorum=1, grace=GraceConfig(gamma=0.5, grace_ms_max=1000.0, overlap=2))
    two_live(h)
    measure_timing(h)
    fragment, rnd = open_round(h, 4)
    v = h.state.fragments[fragment].version
    (timer,) = h.of(ArmTimer, h.push(1, fragment, rnd, dt=0.01))
    (merged,) = h.of(Merged, h.send(TimerFired(fragment, rnd), dt=timer.at - h.now))
    assert merged.learners == (1,)  # learner 2 missed the window
    # Both learners then push from version v, which is one behind now: learner 2 its first push,
    # learner 1 an increment over the push just merged. Both are late and wait for the next round.
    h.push(2, fragment, rnd, base=v)
    h.push(1, fragment, rnd, base=v, steps=2, tokens=200)
    assert set(h.state.fragments[fragment].kept) == {1, 2}
    # The next round of the fragment opens with every asked learner's push waiting, all of them late:
    # they count neither for the quorum nor as delivered, so the round stays open for on-time pushes
    # (counting them closed each round as it opened, and every push was merged a version late).
    assert open_round(h, 5)[0] != fragment  # the other fragment's round
    h.effects.clear()
    nxt_fragment, nxt = open_round(h, 6)
    assert nxt_fragment == fragment and h.state.fragments[fragment].open is not None
    assert not h.of(Merged, h.effects) and h.state.fragments[fragment].version == v + 1
    # An on-time push of learner 1 (summed with its late one) makes the quorum; the window waits for
    # learner 2, whose on-time push (summed with its late one) closes the round early.
    eff = h.push(1, fragment, nxt, dt=0.01)
    assert not h.of(Merged, eff) and h.of(ArmTimer, eff)
    (merged,) = h.of(Merged, h.push(2, fragment, nxt, dt=0.01))
    assert merged.learners == (1, 2) and merged.version == v + 2
    assert "every asked learner delivered within the grace window" in h.state.decisions[-1].reason
    assert "2 late, discounted" in h.state.decisions[-1].reason
    h.state.ledger.check()


@pytest.mark.parametrize("merge", ["rda", "mean"])
def test_a_push_of_finite_values_too_large_to_merge_is_refused_and_the_core_lives(merge):
    """Finite float32 values near its maximum made a round's merge overflow and the core fail (the
    fuzzer found it): one message from a peer took the daemon down. Now a push beyond
    PAYLOAD_ABS_MAX is refused as non_finite, and pushes up to it merge into finite parameters."""
    h = Harness(quorum=1, merge=merge)
    two_live(h)
    fragment, rnd = open_round(h, 1)
    n = h.state.layout.fragments[fragment].padded_size
    huge = np.where(np.arange(n) % 2, 3e38, -3e38).astype(np.float32)
    before = syncer.state_hash(h.state)
    eff = h.push(1, fragment, rnd, vec=huge, name="fp32")
    (err,) = h.of(SendError, eff)
    assert err.code == "non_finite" and "beyond" in err.text
    assert syncer.state_hash(h.state) == before
    limit = np.float32(syncer.PAYLOAD_ABS_MAX)
    h.progress(1, 2, dt=1.0)
    h.progress(2, 2)
    for r in range(1, 5):  # at the limit, same and opposite signs, round after round: finite throughout
        fragment, rnd = open_round(h, 1 + 2 * r)
        n = h.state.layout.fragments[fragment].padded_size
        h.push(1, fragment, rnd, vec=np.full(n, limit), name="fp32")
        h.push(2, fragment, rnd, vec=np.full(n, -limit if r % 2 else limit), name="fp32")
        h.progress(1, 2 + 2 * r, dt=1.0)
        h.progress(2, 2 + 2 * r)
    assert h.state.merges >= 4
    assert all(np.isfinite(f.theta).all() and np.isfinite(f.published).all() for f in h.state.fragments)


def test_initial_parameters_beyond_the_limit_are_refused():
    h = Harness()
    h.join("a", conn=10)
    spec = h.state.layout.fragments[0]
    raw = np.full(spec.padded_size, 1e30, dtype=np.float32)
    eff = h.send(InitFragment(1, 0, codec.parse(codec.encode(raw, "fp32"))))
    assert any(isinstance(e, SendError) and "beyond" in e.text for e in eff)
    assert h.state.fragments[0].theta is None or np.abs(h.state.fragments[0].theta).max() < 1e30
