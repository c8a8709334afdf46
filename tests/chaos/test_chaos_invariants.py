"""Each invariant checker catches a deliberately broken history.

The histories start from a real syncer core driven to two live learners; then an effect or a state
change that a broken core could produce is fed to the checker, which must name the invariant."""

import hashlib

import numpy as np
import orjson
import pytest

from ddiloco.chaos.invariants import Checker
from ddiloco.chaos.network import Connection
from ddiloco.chaos.shell import SnapshotMemory
from ddiloco.core import checkpoint, codec, syncer
from ddiloco.core.config import SyncerConfig
from ddiloco.core.events import InitFragment, Join, Merged, Progress, Push, SendWelcome
from ddiloco.core.grace import GraceConfig
from ddiloco.core.layout import TensorSpec
from ddiloco.core.syncer import LearnerStatus
from ddiloco.net import snapshot as snapshots

TENSORS = (TensorSpec("a", (4, 8)), TensorSpec("b", (16,)))


class History:
    """The real core, every step shown to a checker; `feed` shows it a fabricated step."""

    def __init__(self, quorum=1, holds_all=lambda m: True):
        no_grace = GraceConfig(grace_ms_max=0.0)  # a round closes as soon as its quorum is in
        self.state = syncer.new_state(SyncerConfig(num_fragments=1, period=2, block=8, quorum=quorum, grace=no_grace))
        self.checker = Checker(quorum, tokens_trained=lambda: 10**9, holds_all=holds_all)
        self.now = 0.0

    def send(self, event):
        self.now += 0.01
        self.state, effects = syncer.handle(self.state, event, self.now)
        self.checker.after_event(self.state, event, effects, self.now)
        return effects

    def feed(self, event, effects=()):
        self.now += 0.01
        self.checker.after_event(self.state, event, list(effects), self.now)
        return self.checker.violation

    def two_live(self):
        self.send(Join(conn=1, name="a", tensors=TENSORS, protocol=syncer.PROTOCOL_VERSION))
        self.send(Join(conn=2, name="b", tensors=TENSORS, protocol=syncer.PROTOCOL_VERSION))
        size = self.state.layout.fragments[0].padded_size
        values = np.random.default_rng(0).standard_normal(size).astype(np.float32)
        self.send(InitFragment(learner=1, fragment=0, payload=codec.parse(codec.encode(values, "fp32"))))
        self.send(self.progress(2, 0))
        assert self.checker.ok and [r.status for r in self.state.live()] == [LearnerStatus.LIVE] * 2
        return self

    def progress(self, learner, step):
        return Progress(
            learner=learner, step=step, versions=(self.state.fragments[0].version,), steps=(step,), tokens=(100 * step,)
        )

    def push(self, learner, step, tokens=100, steps=1):
        size = self.state.layout.fragments[0].padded_size
        vec = np.full(size, 0.01, dtype=np.float32)
        return Push(
            learner=learner,
            fragment=0,
            step=step,
            base_version=self.state.fragments[0].version,
            steps=steps,
            tokens=tokens,
            payload=codec.parse(codec.encode(vec, "int4", 8)),
        )


def test_a_correct_history_passes():
    h = History().two_live()
    h.send(h.progress(1, 1))
    h.send(h.progress(2, 2))  # step 2 opens fragment 0's round
    rnd = h.state.fragments[0].open.number
    effects = h.send(h.push(1, rnd))
    assert any(isinstance(e, Merged) for e in effects)
    assert h.checker.ok and h.checker.merges_checked == 1


def test_version_going_down_is_caught():
    h = History().two_live()
    h.state.fragments[0].version = -1
    assert h.feed(h.progress(1, 1)).invariant == "versions_grow"


def test_version_bump_without_merge_is_caught():
    h = History().two_live()
    h.state.fragments[0].version += 1
    assert "without one Merged effect" in h.feed(h.progress(1, 1)).detail


def test_values_changing_without_a_version_are_caught():
    h = History().two_live()
    h.state.fragments[0].theta[0] += 1.0
    v = h.feed(h.progress(1, 1))
    assert v.invariant == "versions_grow" and "changed its values" in v.detail


def test_a_version_sent_with_other_values_is_caught():
    h = History().two_live()
    h.checker.sent(0, 3, "fp32", np.zeros(8, np.float32), 1.0)
    h.checker.sent(0, 3, "fp32", np.ones(8, np.float32), 2.0)
    assert h.checker.violation.invariant == "versions_grow"


def _open_round(h):
    h.send(h.progress(1, 2))
    h.send(h.progress(2, 2))
    return h.state.fragments[0].open.number


def _merge(h, learners, weights):
    """A broken core's merge: the version goes up and a Merged effect says who took part."""
    h.state.fragments[0].version += 1
    h.state.fragments[0].open = None
    return Merged(
        fragment=0, version=h.state.fragments[0].version, learners=learners, weights=weights, grace_s=0.0, round_s=0.0
    )


def test_merge_below_quorum_is_caught():
    h = History(quorum=2).two_live()
    rnd = _open_round(h)
    event = h.push(1, rnd)
    h.feed(event)  # the push is admissible, but one push is below the quorum of 2
    merged = _merge(h, (1,), (1.0,))
    v = h.feed(h.progress(1, 3), [merged])
    assert v.invariant == "quorum" and "quorum is 2" in v.detail


def test_merge_of_a_learner_that_did_not_push_is_caught():
    h = History().two_live()
    rnd = _open_round(h)
    h.feed(h.push(1, rnd))
    v = h.feed(h.progress(1, 3), [_merge(h, (1, 2), (0.5, 0.5))])
    assert v.invariant == "quorum" and "admissible [1]" in v.detail


def test_weights_not_summing_to_one_are_caught():
    h = History().two_live()
    rnd = _open_round(h)
    h.feed(h.push(1, rnd))
    h.feed(h.push(2, rnd))
    v = h.feed(h.progress(1, 3), [_merge(h, (1, 2), (0.7, 0.7))])
    assert v.invariant == "weights"


def test_weights_other_than_token_weights_are_caught():
    h = History().two_live()
    rnd = _open_round(h)
    h.feed(h.push(1, rnd, tokens=100, steps=1))  # weight 100^2 / 1
    h.feed(h.push(2, rnd, tokens=300, steps=1))  # weight 300^2 / 1
    v = h.feed(h.progress(1, 3), [_merge(h, (1, 2), (0.5, 0.5))])
    assert v.invariant == "weights" and "token weights say" in v.detail


def test_non_finite_parameters_are_caught():
    h = History().two_live()
    h.state.fragments[0].momentum.buf[0] = np.nan
    assert h.feed(h.progress(1, 1)).invariant == "finite"


def test_fresh_weights_beyond_the_bound_are_caught():
    h = History().two_live()
    rnd = _open_round(h)
    h.feed(h.push(1, rnd))
    h.state.fragments[0].theta[:] = 1000.0  # a fresh learner's weights merged in
    v = h.feed(h.progress(1, 3), [_merge(h, (1,), (1.0,))])
    assert v.invariant == "finite" and "parameter bound" in v.detail


def test_unbalanced_ledger_is_caught():
    h = History().two_live()
    h.state.ledger.totals["merged"] += 7
    assert h.feed(h.progress(1, 1)).invariant == "ledger"


def test_ledger_window_of_a_gone_learner_is_caught():
    h = History().two_live()
    h.state.learners[2].status = LearnerStatus.GONE
    h.state.ledger.fate(2, 0, 50, "merged")  # a push of a learner already gone booked in a new window
    v = h.feed(h.progress(1, 1))
    assert v.invariant == "ledger" and "which is gone" in v.detail


def test_ledger_holding_more_than_the_learner_counted_is_caught():
    h = History().two_live()
    h.checker.counted = lambda m, p, version: 10
    h.send(h.progress(2, 1))  # the core books the 100 tokens reported; the learner says it counted 10
    v = h.checker.violation
    assert v.invariant == "ledger" and "the learner counted 10" in v.detail


def test_version_zero_from_a_learner_never_asked_is_caught():
    h = History()
    h.send(Join(conn=1, name="a", tensors=TENSORS, protocol=syncer.PROTOCOL_VERSION))
    size = h.state.layout.fragments[0].padded_size
    # a broken core takes learner 1's weights although its welcome did not ask for them
    h.checker._asked_init.clear()
    h.state.fragments[0].theta = np.ones(size, dtype=np.float32)
    h.state.fragments[0].momentum = syncer.outer.init(h.state.fragments[0].theta)
    v = h.feed(
        InitFragment(learner=1, fragment=0, payload=codec.parse(codec.encode(np.ones(size, np.float32), "fp32")))
    )
    assert v.invariant == "fresh_weights"


def test_live_before_caught_up_is_caught():
    holds = {1: True, 2: True, 3: False}
    h = History(holds_all=lambda m: holds[m]).two_live()
    welcome = h.send(Join(conn=3, name="c", tensors=TENSORS, protocol=syncer.PROTOCOL_VERSION))
    assert any(isinstance(e, SendWelcome) for e in welcome) and h.state.learners[3].status is LearnerStatus.RECOVERING
    h.send(h.progress(3, 1))
    v = h.checker.violation
    assert v.invariant == "caught_up" and "learner 3" in v.detail


def test_the_syncer_recording_older_versions_is_caught():
    h = History().two_live()
    h.state.learners[2].versions = [-1]
    assert h.feed(h.progress(1, 1)).invariant == "versions_grow"


@pytest.mark.parametrize("tamper", [None, "version", "values", "books"])
def test_a_resumed_syncer_must_hold_its_checkpoint(tamper):
    h = History().two_live()
    h.send(h.progress(2, 1))
    h.checker.checkpointed(h.state)
    state = checkpoint.restore(b"".join(bytes(c) for c in checkpoint.to_chunks(h.state)))
    if tamper == "version":
        state.fragments[0].version = 5
    elif tamper == "values":
        state.fragments[0].theta[3] += 1.0
    elif tamper == "books":
        state.ledger.totals["lost"] -= 1
    h.checker.after_restart(state, 1.0)
    expected = {None: None, "version": "versions_grow", "values": "versions_grow", "books": "ledger"}[tamper]
    assert (h.checker.violation and h.checker.violation.invariant) == expected


def test_parameters_from_no_checkpoint_are_caught():
    h = History().two_live()  # never checkpointed: a resumed syncer must start empty
    state = syncer.new_state(h.state.config, h.state.layout, [f.theta.copy() for f in h.state.fragments])
    h.checker.after_restart(state, 1.0)
    assert h.checker.violation.invariant == "versions_grow"


@pytest.mark.parametrize(
    "tamper", [None, "message_after_its_cut", "version_after_the_cut", "syncer_state", "unordered"]
)
def test_a_snapshot_must_be_a_consistent_cut(tamper):
    """The daemon's snapshot protocol (net.snapshot.Taker) over the real core, its files in memory:
    learner 1 has a progress report in flight at the cut, learner 2 nothing."""
    h = History().two_live()  # the core took learner 1's InitFragment and learner 2's Progress
    memory = SnapshotMemory()
    taker = snapshots.Taker(memory)
    channels = {1: Connection(1, 0), 2: Connection(2, 1)}
    snap = taker.start(h.state, {1: "a", 2: "b"}, {}, now=h.now)
    h.checker.snapshot_started(snap.ident, h.state, channels, h.now)
    in_flight = h.progress(1, 1)
    assert taker.record(in_flight) is None
    h.send(in_flight)
    sent = {1: 2, 2: 1}  # what each learner had put on its connection when it recorded its state
    versions = {1: [0], 2: [0]}
    if tamper == "message_after_its_cut":  # the report left learner 1 after its local state
        sent[1] = 1
    elif tamper == "version_after_the_cut":
        versions[2] = [1]
    elif tamper == "syncer_state":  # the state after the report, not at the cut
        memory.files[snap.syncer_file] = b"".join(bytes(c) for c in checkpoint.to_chunks(h.state))
    elif tamper == "unordered":  # a reorder fault lifted FIFO on learner 1's link: its channel is not judged
        channels[1].ordered = False
        sent[1] = 1
    outcome = None
    for m in (1, 2):
        data = orjson.dumps({"learner": m, "versions": versions[m], "sent": sent[m]})
        problem, outcome = taker.local_state(m, snap.ident, data, hashlib.sha256(data).hexdigest(), h.now)
        assert problem is None
    assert outcome.manifest["inflight"][0]["learner"] == 1
    h.checker.snapshot_complete(outcome.manifest, memory.complete, h.now)
    expected = None if tamper in (None, "unordered") else "snapshot"
    assert (h.checker.violation and h.checker.violation.invariant) == expected
    assert h.checker.channels_checked == (1 if tamper == "unordered" else 2)
