"""A syncer sharded by fragment: the ownership rule, and the core of one shard (docs/protocol.md,
"A sharded syncer"): it holds, merges and books only its own fragments and refuses the others'."""

import numpy as np
import pytest

from ddiloco.core import codec, shards, syncer
from ddiloco.core.config import ConfigError, SyncerConfig
from ddiloco.core.events import InitFragment, Merged, Progress, Push, SendError, SendUpdate
from ddiloco.core.grace import GraceConfig
from ddiloco.core.syncer import LearnerStatus

from .test_syncer import Harness

FRAGMENTS = 4
PERIOD = 4  # offsets 0, 1, 2, 3: fragment p's round opens at steps t with t mod 4 == p
NO_GRACE = GraceConfig(grace_ms_max=0.0)  # every round closes at quorum: merges follow the events alone


def shard_harness(shard, count=2, **cfg):
    cfg.setdefault("grace", NO_GRACE)
    return Harness(num_fragments=FRAGMENTS, period=PERIOD, shard=shard, shards=count, **cfg)


def fp32(values):
    return codec.parse(codec.encode(values, "fp32"))


def initial(h, p, seed=0):
    return np.random.default_rng([seed, p]).standard_normal(h.state.layout.fragments[p].padded_size).astype(np.float32)


def init_owned(h, learner, seed=0):
    for p in h.state.owned:
        assert not h.of(SendError, h.send(InitFragment(learner, p, fp32(initial(h, p, seed)))))


def report(h, learner, step, versions, tokens=100):
    n = len(versions)
    return h.send(Progress(learner, step, tuple(versions), (1,) * n, (tokens,) * n))


def test_fragment_p_belongs_to_shard_p_mod_n():
    assert [shards.owner(p, 3) for p in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert shards.owned(1, 3, 7) == (1, 4)
    assert shards.owned(0, 1, 5) == (0, 1, 2, 3, 4)
    assert sorted(p for i in range(3) for p in shards.owned(i, 3, 8)) == list(range(8))


@pytest.mark.parametrize(
    ("shard", "count", "fragments", "says"),
    [
        (2, 2, 4, "shard index must lie in [0, 1]"),
        (-1, 2, 4, "shard index"),
        (0, 5, 4, "5 shards need at least 5 fragments, the syncer has 4"),
        (0, 0, 4, "shard count must lie in [1, 64]"),
        (0, shards.SHARDS_MAX + 1, 1000, "shard count"),
    ],
)
def test_a_shard_that_cannot_exist_is_refused_by_the_config(shard, count, fragments, says):
    with pytest.raises(ConfigError, match=says.replace("[", r"\[").replace("]", r"\]")):
        SyncerConfig(num_fragments=fragments, shard=shard, shards=count)


def test_a_shard_holds_and_initialises_only_its_own_fragments():
    h = shard_harness(1)
    welcome = h.join("a", conn=10)
    assert welcome.needs_init and (welcome.shard, welcome.shards) == (1, 2)
    assert welcome.versions == (-1,) * FRAGMENTS
    assert h.state.owned == (1, 3) and not h.state.holds_parameters
    init_owned(h, 1)
    assert h.state.holds_parameters and h.state.learners[1].status is LearnerStatus.LIVE
    assert [f.theta is not None for f in h.state.fragments] == [False, True, False, True]
    assert all(h.state.fragments[p].momentum is None and h.state.fragments[p].published is None for p in (0, 2))
    # A later learner is sent the owned fragments only, and is told the others are not held here.
    second = h.join("b", conn=11)
    assert second.versions == (-1, 0, -1, 0)
    assert sorted(u.fragment for u in h.of(SendUpdate) if 2 in u.learners) == [1, 3]


def test_an_initial_fragment_for_another_shard_is_refused_naming_its_owner():
    h = shard_harness(0)
    h.join("a", conn=10)
    (err,) = h.of(SendError, h.send(InitFragment(1, 3, fp32(initial(h, 3)))))
    assert err.code == "wrong_shard" and not err.fatal and err.learner == 1
    assert err.text == "fragment 3 belongs to shard 1 of 2; this is shard 0"
    assert h.state.fragments[3].theta is None and h.state.rejections == {"wrong_shard": 1}
    init_owned(h, 1)  # the refusal left the initialisation where it was
    assert h.state.learners[1].status is LearnerStatus.LIVE


def test_a_push_for_another_shards_fragment_is_refused_and_books_nothing():
    h = shard_harness(1)
    h.join("a", conn=10)
    init_owned(h, 1)
    report(h, 1, 0, (-1, 0, -1, 0))
    books = h.state.ledger.summary()
    spec = h.state.layout.fragments[2]
    vec = np.full(spec.padded_size, 0.01, dtype=np.float32)
    effects = h.send(Push(1, 2, 0, 0, 1, 100, codec.parse(codec.encode(vec, "int4"))))
    (err,) = h.of(SendError, effects)
    assert err.code == "wrong_shard" and err.text == "fragment 2 belongs to shard 0 of 2; this is shard 1"
    assert h.state.ledger.summary() == books
    assert h.state.fragments[2].theta is None and h.state.fragments[2].kept == {}
    assert h.state.learners[1].status is LearnerStatus.LIVE  # refused, not dropped


def test_a_shard_opens_rounds_for_its_own_fragments_only():
    h = shard_harness(1)
    h.join("a", conn=10)
    init_owned(h, 1)
    for step in range(0, 2 * PERIOD):
        report(h, 1, step, (-1, 0, -1, 0))
    assert h.state.global_step == 2 * PERIOD - 1
    assert [f.rounds_opened for f in h.state.fragments] == [0, 2, 0, 2]
    assert h.state.fragments[0].open is None and h.state.fragments[2].open is None


def test_books_resends_and_catching_up_look_at_owned_fragments_only():
    h = shard_harness(0, quorum=1)
    h.join("a", conn=10)
    init_owned(h, 1)
    h.join("b", conn=11)  # recovering: it needs fragments 0 and 2 from this shard
    # Fragments 1 and 3 are another shard's: a learner holding none of them yet (-1) has caught
    # up with this one, and a version far ahead of this shard's (never merged here) is no fault.
    report(h, 2, 0, (0, -1, 0, 40))
    assert h.state.learners[2].status is LearnerStatus.LIVE
    assert {p for _, p in h.state.ledger.windows} == {0, 2}
    # Merge fragment 0 three times (a push waits for the round of the next period): a learner still
    # reporting version 0 gets it whole, once, and being far behind on another shard's fragment
    # sends nothing.
    for rnd in range(4):
        step = rnd * PERIOD
        report(h, 1, step, (h.state.fragments[0].version, 7, 0, 7))
        h.push(1, 0, step)
    assert h.state.fragments[0].version == 3
    h.now += syncer.WHOLE_RESEND_STUCK_S  # its version has not moved for that long
    sent = h.of(SendUpdate, report(h, 2, 1, (0, 0, 0, 0)))
    assert [(u.fragment, u.learners, u.base_version) for u in sent] == [(0, (2,), -1)]
    h.state.ledger.check()
    assert {p for _, p in h.state.ledger.windows} == {0, 2}


def test_two_shards_fed_the_same_events_merge_each_fragment_once_as_one_syncer_would():
    """Every shard gets every hello and progress report; pushes and initial fragments go to the
    owner. The pair merges what one unsharded syncer merges, each fragment on one shard only, bit
    for bit, at the same global steps."""
    whole = Harness(num_fragments=FRAGMENTS, period=PERIOD, grace=NO_GRACE)
    pair = [shard_harness(i) for i in range(2)]
    every = [whole, *pair]

    def owner_and_whole(p):
        return [whole, pair[shards.owner(p, 2)]]

    for h in every:
        h.join("a", conn=10)
        h.join("b", conn=11)
    for p in range(FRAGMENTS):
        for h in owner_and_whole(p):
            h.send(InitFragment(1, p, fp32(initial(whole, p))))
    rng = np.random.default_rng(7)
    for step in range(3 * PERIOD + 1):  # a push at step 0 waits for the round of step 4
        for learner in (1, 2):
            versions = tuple(f.version for f in whole.state.fragments)
            for h in every:
                report(h, learner, step, versions)
            p = step % PERIOD
            vec = rng.standard_normal(whole.state.layout.fragments[p].padded_size).astype(np.float32) * 0.01
            for h in owner_and_whole(p):
                h.push(learner, p, step, vec=vec)
        assert all(h.state.global_step == step for h in every)
    merged = [(e.fragment, e.version) for e in whole.of(Merged)]
    assert len(merged) == 3 * FRAGMENTS
    by_shard = [[(e.fragment, e.version) for e in h.of(Merged)] for h in pair]
    assert sorted(by_shard[0] + by_shard[1]) == sorted(merged)
    for i, h in enumerate(pair):
        assert {p for p, _ in by_shard[i]} == set(h.state.owned)
        assert not h.of(SendError)
    for p, frag in enumerate(whole.state.fragments):
        mine = pair[shards.owner(p, 2)].state.fragments[p]
        assert mine.version == frag.version == 3
        assert np.array_equal(mine.theta, frag.theta) and np.array_equal(mine.published, frag.published)
        assert pair[1 - shards.owner(p, 2)].state.fragments[p].theta is None


def test_an_unsharded_syncer_owns_every_fragment_and_refuses_no_index_as_foreign():
    h = Harness(num_fragments=FRAGMENTS, period=PERIOD)
    assert h.state.owned == tuple(range(FRAGMENTS))
    h.join("a", conn=10)
    (err,) = h.of(SendError, h.send(InitFragment(1, FRAGMENTS, fp32(np.ones(8, dtype=np.float32)))))
    assert err.code == "bad_shape"  # a fragment that does not exist is no shard's


def test_initial_parameters_give_a_shard_its_own_fragments_and_must_hold_them():
    h = Harness(num_fragments=FRAGMENTS, period=PERIOD)
    h.join("a", conn=10)  # the first hello decides the layout
    layout = h.state.layout
    values = [np.ones(f.padded_size, np.float32) for f in layout.fragments]
    config = SyncerConfig(num_fragments=FRAGMENTS, period=PERIOD, shard=1, shards=2)
    state = syncer.new_state(config, layout, values)  # a whole model: the shard keeps fragments 1 and 3
    assert state.holds_parameters and [f.theta is not None for f in state.fragments] == [False, True, False, True]
    assert state.init_source == "file"
    only_others = [v if p % 2 == 0 else None for p, v in enumerate(values)]  # shard 0's checkpoint, say
    with pytest.raises(ValueError, match="the initial parameters lack fragment 1, which this syncer owns"):
        syncer.new_state(config, layout, only_others)
