"""The hook's pure pieces on their own: the hold-back and in-flight pushes (learner.pushes), the wait
behind a push and the chain of updates (learner.arrivals), the schedule (learner.schedule)."""

import numpy as np
import pytest

from ddiloco.core import codec, publish
from ddiloco.learner import arrivals, pushes, schedule
from ddiloco.learner.fragment import FragmentSync
from ddiloco.net import session


def flight(q, step, frag):
    return pushes.InFlight(q, step, frag, [])


def test_hold_back_counts_skips_until_the_limit():
    frag = FragmentSync(version=3, base=np.zeros(4, np.float32))
    state = pushes.sent(pushes.Pushes(last={}), flight(0, 1, frag), np.ones(4, np.float32))
    fragments = (frag, FragmentSync(version=3))
    for skips in range(2):
        state, held = pushes.hold_back(state, (0, 1), fragments, skips_max=2)
        assert held == (0,) and state.last[0].skips == skips + 1 and state.held == skips + 1
    state, held = pushes.hold_back(state, (0, 1), fragments, skips_max=2)
    assert held == () and state.held == 2
    # a newer version held voids the last push; an error from the syncer ends the wait
    assert not pushes.waits_on_push(state, 0, 4, skips_max=2)
    assert pushes.refused(state, 5).last[0].skips == 5


def test_take_keeps_the_order_started_and_forget_drops_a_session():
    state = pushes.Pushes(last={})
    for q, step in ((1, 1), (0, 1), (1, 2)):
        state = pushes.started(state, flight(q, step, FragmentSync()))
    rest, taken = pushes.take(state, 1)
    assert [(f.fragment, f.step) for f in taken] == [(1, 1), (1, 2)] and [f.fragment for f in rest.in_flight] == [0]
    assert pushes.forget(state, {1}).in_flight == (state.in_flight[1],)


def test_take_judges_each_push_once_where_it_turns_ready_meanwhile():
    """`ready` is read on the training thread while the background thread sends: a push judged not
    ready stays in flight, and is not also taken (it would be booked twice)."""
    state = pushes.started(pushes.Pushes(last={}), flight(0, 1, FragmentSync()))
    answers = iter((False, True))
    rest, taken = pushes.take(state, ready=lambda f: next(answers))
    assert taken == () and rest.in_flight == state.in_flight
    rest, taken = pushes.take(rest, ready=lambda f: True)
    assert taken == state.in_flight and rest.in_flight == ()


def test_an_increment_starts_at_the_last_push_from_the_same_version():
    base, theta0, theta1 = (np.full(256, v, np.float32) for v in (0.0, 1.0, 3.0))
    frag = FragmentSync(version=2, base=base)
    first = pushes.encode_increment(pushes.Pushes(last={}), flight(0, 1, frag), theta0, None, "fp32", False, 64, False)
    state = pushes.sent(pushes.Pushes(last={}), flight(0, 1, frag), theta0)
    second = pushes.encode_increment(state, flight(0, 2, frag), theta1, None, "fp32", False, 64, False)
    assert np.array_equal(codec.parse(first[0]).decode(), base - theta0)
    assert np.array_equal(codec.parse(second[0]).decode(), theta0 - theta1)


def test_defer_waits_behind_a_busy_fragment_at_most_the_limit():
    chain = [object()]
    ready, deferred = arrivals.defer({}, {0: chain, 1: chain}, busy={0})
    assert ready == [(1, chain)] and deferred == {0: (chain, 1)}
    for waited in range(2, arrivals.DEFER_CALLS_MAX + 1):
        ready, deferred = arrivals.defer(deferred, {}, busy={0})
        assert ready == [] and deferred == {0: (chain, waited)}
    ready, deferred = arrivals.defer(deferred, {0: chain}, busy={0})
    assert ready == [(0, chain + chain)] and deferred == {}


def test_reach_applies_deltas_onto_exactly_the_version_held():
    whole = np.arange(8, dtype=np.float32)
    encode = lambda values: codec.parse(codec.encode(values, "fp32"))
    frag = FragmentSync(version=-1)
    chain = [
        session.UpdateInfo(0, 5, encode(np.ones(8, np.float32)), base_version=4),  # onto nothing held: ignored
        session.UpdateInfo(0, 4, encode(whole)),
        session.UpdateInfo(0, 5, encode(np.ones(8, np.float32)), base_version=4),
    ]
    reached = arrivals.reach(frag, chain, parallel=False)
    assert reached.version == 5 and np.array_equal(reached.published, whole + 1)
    kept = arrivals.kept_progress(FragmentSync(4, whole, 3, 30), None, keep_progress=True, alpha=0.0)
    assert kept is not None and (kept.steps, kept.tokens) == (3, 30)
    new = arrivals.received(FragmentSync(4, whole, 3, 30), 5, reached.published, kept)
    assert (new.version, new.steps, new.tokens, new.carried) == (5, 3, 30, 30)
    assert arrivals.kept_progress(FragmentSync(4, whole, 3, 30), None, keep_progress=True, alpha=0.5) is None


def _published_versions(n: int, versions: int, seed: int = 0):
    """The syncer's side of the broadcast (core.publish), as it keeps it: version 0's published copy,
    then each version's int4 delta onto the one before; -> (each version's published copy, the
    delta updates 1..versions-1)."""
    rng = np.random.default_rng(seed)
    published = rng.standard_normal(n).astype(np.float32)
    copies, deltas = [published.copy()], []
    for v in range(1, versions):
        theta = (copies[-1] + 0.1 * rng.standard_normal(n)).astype(np.float32)
        body, block = publish.publish(published, theta, codec.Codec.INT4, 128, parallel=False)
        encoded = publish.Delta(codec.Codec.INT4, block, v - 1, body).encoded(n)
        deltas.append(session.UpdateInfo(0, v, encoded, base_version=v - 1))
        copies.append(published.copy())
    return copies, deltas


@pytest.mark.parametrize("calls", [1, 3])
def test_a_version_adopted_from_a_peer_gets_the_published_copy_from_an_older_whole_one_and_its_deltas(calls):
    # The syncer sent this learner version 1 whole when it joined, then deltas 2, 3 and 4; the peer
    # it recovered from held version 3 already. Version 3's published copy is followed up from the
    # whole version 1, and the delta onto it applies: the learner holds version 4, the syncer's bits.
    copies, deltas = _published_versions(1024, 5)
    whole = session.UpdateInfo(0, 1, codec.parse(codec.encode(copies[1], "fp32")))
    peer_values = copies[3] + np.float32(0.5)  # the peer's parameters: its own progress on top
    frag = FragmentSync(3, peer_values)
    chain = [whole, deltas[1], deltas[2], deltas[3]]  # versions 1 (whole), 2, 3, 4
    cuts = np.array_split(np.arange(len(chain)), calls)  # the same chain taken over several calls
    for cut in cuts:  # only the last call reaches a newer version: the state carries over between calls
        reached = arrivals.reach(frag, [chain[i] for i in cut], parallel=False)
        frag = reached.frag
    assert reached.version == 4
    assert reached.published.tobytes() == copies[4].tobytes()
    assert reached.frag.base is peer_values  # the outer gradient still starts from what was adopted


def test_a_trail_that_misses_a_delta_waits_for_a_whole_copy():
    copies, deltas = _published_versions(256, 4)
    whole = session.UpdateInfo(0, 1, codec.parse(codec.encode(copies[1], "fp32")))
    frag = FragmentSync(3, copies[3].copy())
    reached = arrivals.reach(frag, [whole, deltas[2]], parallel=False)  # delta 2 went astray
    assert reached.version == 3 and reached.published is None and reached.frag.trail[0] == 1
    # the syncer's whole copy of the version held ends the wait, and the trail with it
    again = arrivals.reach(
        reached.frag, [session.UpdateInfo(0, 3, codec.parse(codec.encode(copies[3], "fp32")))], False
    )
    assert again.version == 3 and again.frag.published.tobytes() == copies[3].tobytes() and again.frag.trail is None


def test_schedule_serves_a_shard_once_its_fragments_are_held():
    welcome = session.WelcomeInfo(1, {}, "ab" * 32, (0, 0, 0, 0), 0, False, period=2, offsets=(0, 1, 0, 1))
    sched = schedule.schedule_of(welcome, 4)
    held = (FragmentSync(version=0),) * 4
    assert schedule.scheduled_at(sched, held, 2) == (0, 2) and schedule.scheduled_at(sched, held, 3) == (1, 3)
    assert schedule.scheduled_at(sched, (FragmentSync(),) + held[1:], 2) == ()
    assert schedule.scheduled_at(sched, (), 2) == ()
    # the next step at a phase (some fragment due, a round opening): where a quiet call stops
    sparse = schedule.schedule_of(session.WelcomeInfo(1, {}, "ab" * 32, (0, 0), 0, False, period=8, offsets=(2, 5)), 2)
    assert [schedule.next_phase_step(sparse, s) for s in (0, 1, 2, 4, 5, 6, 9, 13)] == [2, 2, 5, 5, 10, 10, 10, 18]
    assert schedule.next_phase_step(schedule.Schedule(period=4), 6) == 10  # no phase: a period on


def test_a_learner_reports_to_a_sharded_syncer_once_it_holds_one_whole_shard():
    # Two shards over 4 fragments: shard 0 owns fragments 0 and 2, shard 1 owns 1 and 3.
    welcome = session.WelcomeInfo(1, {}, "ab" * 32, (0, 0, 0, 0), 0, False, period=2, offsets=(0, 1, 0, 1), shards=2)
    sched = schedule.schedule_of(welcome, 4)
    for versions in [(-1,) * 4, (0, -1, -1, -1), (0, 3, -1, 2), (0, -1, 5, -1), (-1, 1, -1, 1), (2, 2, 2, 2)]:
        fragments = tuple(FragmentSync(version=v) for v in versions)
        by_fragment = any(schedule.holds_shard_of(sched, fragments, q) for q in range(4))
        assert schedule.serves_any(sched, versions) == by_fragment, versions
    assert not schedule.serves_any(sched, (0, -1, -1, -1)) and schedule.serves_any(sched, (0, -1, 5, -1))
    assert not schedule.serves_any(sched, ())


def test_a_learner_behind_the_global_step_moves_up_and_pushes_what_fell_due_in_between():
    welcome = session.WelcomeInfo(1, {}, "ab" * 32, (0, 0, 0, 0), 0, False, period=12, offsets=(0, 3, 6, 9))
    sched = schedule.schedule_of(welcome, 4)
    held = (FragmentSync(version=0),) * 4
    # at step 10 it hears of global step 14: steps 11 to 14 are skipped, fragment 0 fell due at 12
    assert schedule.caught_up(sched, held, 10, 14) == (14, (0,))
    assert schedule.caught_up(sched, held, 10, 16) == (16, (0, 1))
    # not behind: nothing moves
    assert schedule.caught_up(sched, held, 14, 14) == (14, ())
    assert schedule.caught_up(sched, held, 20, 14) == (20, ())
    # more than a period behind: every fragment is due once, in the order of the steps skipped
    assert schedule.caught_up(sched, held, 4, 40) == (40, (2, 3, 0, 1))
    # a fragment whose shard it does not serve yet is not pushed
    assert schedule.caught_up(sched, (FragmentSync(),) + held[1:], 10, 16) == (16, ())


def test_the_newest_global_step_of_the_updates_taken():
    body = codec.parse(codec.encode(np.ones(8, np.float32), "fp32"))
    updates = {
        0: [session.UpdateInfo(0, 1, body, global_step=7), session.UpdateInfo(0, 2, body, global_step=9)],
        2: [session.UpdateInfo(2, 1, body, global_step=8)],
    }
    assert schedule.newest_global_step(updates) == 9
    assert schedule.newest_global_step({0: [session.UpdateInfo(0, 1, body)]}) == -1  # an older tape's
    assert schedule.newest_global_step({}) == -1
