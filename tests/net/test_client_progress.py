"""ThreadedClient's progress pacing: fewer reports forwarded, never the last one under a version."""

import asyncio
import threading
import time

import pytest

from ddiloco.net import session
from ddiloco.net.client import ClientConfig, SyncerClient, ThreadedClient


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def report(step: int, versions=(0, 0)) -> session.ProgressInfo:
    return session.ProgressInfo(step, tuple(versions), (step, step), (10 * step, 10 * step))


@pytest.fixture
def paced():
    """A client (to a port nobody listens on: it only retries) with a fake clock, and a function
    returning the steps queued for sending so far."""
    clients = []

    def make(interval: float):
        clock = FakeClock()
        tc = ThreadedClient(
            ClientConfig(url="ws://127.0.0.1:9/ws", name="t", tensors=(), progress_interval_s=interval), clock=clock
        )
        clients.append(tc)

        def queued() -> list[int]:
            done = threading.Event()
            tc._loop.call_soon_threadsafe(done.set)  # everything forwarded before this has run
            assert done.wait(5)
            return [p.step for _, p in tc.client._progress]

        return tc, clock, queued

    yield make
    for tc in clients:
        tc.close()


def test_zero_interval_forwards_every_report(paced):
    tc, clock, queued = paced(0.0)
    for step in (1, 2, 3):
        tc.progress(report(step))
    assert queued() == [1, 2, 3]


def test_reports_under_the_same_versions_are_held_and_the_newest_follows(paced):
    tc, clock, queued = paced(0.2)
    tc.progress(report(1))
    for step in (2, 3, 4):
        clock.now += 0.01
        tc.progress(report(step))
    assert queued() == [1]  # 2..4 held back: no wake-up of the network thread for them
    time.sleep(0.3)
    assert queued() == [1]  # the newest is 0.01 s old: it waits for the next call
    clock.now += 0.5  # the training loop went quiet: the loop's timer forwards what it holds
    time.sleep(0.3)
    assert queued() == [1, 4]


def test_after_the_interval_the_next_report_goes_at_once(paced):
    tc, clock, queued = paced(0.2)
    tc.progress(report(1))
    clock.now += 0.01
    tc.progress(report(2))
    clock.now += 0.3
    tc.progress(report(3))  # supersedes the held 2
    assert queued() == [1, 3]


def test_the_last_report_under_old_versions_is_never_dropped(paced):
    tc, clock, queued = paced(5.0)
    tc.progress(report(7, versions=(3, 4)))
    clock.now += 0.01
    tc.progress(report(8, versions=(3, 4)))  # held
    clock.now += 0.01
    tc.progress(report(9, versions=(3, 5)))  # fragment 1 arrived: its counters reset
    # the tokens trained under version 4 (step 8's counters) go out, then the new window's report
    assert queued() == [7, 8, 9]


def test_a_step_where_a_round_opens_is_reported_at_once(paced):
    tc, clock, queued = paced(5.0)
    # rounds open at steps t with t mod 6 in (0, 3): the syncer needs to hear of those on time
    tc._welcome = session.WelcomeInfo(1, {}, "ab" * 32, (0, 0), 0, False, period=6, offsets=(0, 3))
    for step in range(1, 14):
        clock.now += 0.01
        tc.progress(report(step))
    assert queued() == [1, 3, 6, 9, 12]  # the first, then the due steps; the rest held


def test_the_schedule_comes_from_the_welcome():
    """The syncer's welcome carries its round schedule, and the learner reads the same steps."""
    from ddiloco.core.events import SendWelcome
    from ddiloco.net import messages as msg
    from ddiloco.net import wire

    layout = {"fragments": [{}, {}, {}], "block": 128}
    effect = SendWelcome(1, 3, layout, "ab" * 32, (4, 5, 6), 100, False, period=12, offsets=(0, 4, 8))
    (frame,) = session.frames_for(effect, 1, wire.WireLimits())
    m = wire.Reassembler(wire.WireLimits()).feed(frame)
    assert isinstance(m, msg.Welcome)
    info = session.client_view(m)
    assert (info.period, info.offsets) == (12, (0, 4, 8))
    assert [t for t in range(100, 125) if info.opens_round(t)] == [100, 104, 108, 112, 116, 120, 124]
    # A report of the newest computed step moves on by several steps at once (learner.lead): a
    # round opened at any step passed is due; none where no step was reached since.
    assert info.opens_round(107, after=103) and not info.opens_round(107, after=104)
    assert info.opens_round(201, after=101) and not info.opens_round(104, after=104)
    assert info.opens_round(105, after=104) is False and info.opens_round(108, after=107)


def test_interval_is_validated():
    with pytest.raises(ValueError, match="progress_interval_s"):
        ClientConfig(url="ws://h/ws", name="t", tensors=(), progress_interval_s=-1.0)
    with pytest.raises(ValueError, match="progress_interval_s"):
        ClientConfig(url="ws://h/ws", name="t", tensors=(), progress_interval_s=60.0)


def test_a_report_of_a_version_below_0_is_refused_where_it_is_handed_over(paced):
    """The wire carries held versions >= 0: a report of -1 is the caller's error, said at the call.
    Found in the writer instead, it ended the connection's task and left the learner unconnected."""
    tc, _, queued = paced(0.0)
    with pytest.raises(ValueError, match="holds versions >= 0 only"):
        tc.progress(report(1, versions=(-1, 0)))
    with pytest.raises(ValueError, match="holds versions >= 0 only"):
        SyncerClient(ClientConfig(url="ws://127.0.0.1:9/ws", name="t", tensors=())).queue_progress(
            report(1, versions=(0, -1))
        )
    tc.progress(report(2))  # the client goes on
    assert queued() == [2]


def test_a_report_that_moves_past_a_round_opening_goes_at_once_and_a_repeat_is_held(paced):
    """Reports name the newest computed step (learner.lead): it may stay a few calls, then jump."""
    tc, clock, queued = paced(5.0)
    tc._welcome = session.WelcomeInfo(1, {}, "ab" * 32, (0, 0), 0, False, period=6, offsets=(0, 3))
    for step in (1, 1, 1, 2, 5, 5, 7, 7, 7, 8):
        clock.now += 0.01
        tc.progress(report(step))
    assert queued() == [1, 5, 7]  # 5 passed step 3, 7 passed step 6; 1, 5 and 7 again opened nothing new


def test_the_client_loop_is_uvloops_so_a_hand_over_keeps_the_gil(monkeypatch):
    # asyncio's loop wakes with the GIL released and its thread takes the GIL from the training
    # thread at every report or push handed over; uvloop's wakes with it held (net.client._new_loop)
    import sys

    import uvloop  # a dependency of the package wherever it runs (pyproject.toml)

    tc = ThreadedClient(ClientConfig(url="ws://127.0.0.1:9/ws", name="t", tensors=()))
    try:
        assert isinstance(tc._loop, uvloop.Loop)
    finally:
        tc.close()
    # not installed: asyncio's own (whatever its policy makes: a test before may have set uvloop's)
    monkeypatch.setitem(sys.modules, "uvloop", None)
    made = []
    new_event_loop = asyncio.new_event_loop
    monkeypatch.setattr(asyncio, "new_event_loop", lambda: made.append(new_event_loop()) or made[-1])
    tc = ThreadedClient(ClientConfig(url="ws://127.0.0.1:9/ws", name="t", tensors=()))
    try:
        assert made == [tc._loop]
        tc.progress(report(1))
    finally:
        tc.close()


def test_holds_report_says_whether_a_report_would_be_held_without_one_being_made(paced):
    # learner.sync skips building the report of a call that only counts where this says it would be
    # held back: never before the first report, at a step where a round opens (since the last report)
    # or once the interval since the last one forwarded has passed; and asking changes nothing
    tc, clock, queued = paced(0.2)
    tc._welcome = session.WelcomeInfo(1, {}, "ab" * 32, (0, 0), 0, False, period=6, offsets=(0, 3))
    assert not tc.holds_report(1)  # nothing forwarded yet: the first report goes out
    tc.progress(report(1))
    assert queued() == [1]
    assert tc.holds_report(2) and tc.holds_report(2)
    assert not tc.holds_report(3)  # fragment 1's round opens at 3
    assert not tc.holds_report(7)  # and another at 6, between the last report and 7
    clock.now += 0.25
    assert not tc.holds_report(2)  # the interval has passed: the report goes out
    tc.progress(report(2))
    assert queued() == [1, 2]
    clock.now += 0.1
    assert tc.holds_report(2)
    tc._markers = [5]  # a snapshot's marker taken from the inbox: the call that hands it out reports
    assert not tc.holds_report(2)
    assert tc.take_markers() == [5] and tc.holds_report(2)
    tc.progress(report(2))  # held, as holds_report said
    assert queued() == [1, 2]
    every, _, _ = paced(0.0)
    every.progress(report(1))
    assert not every.holds_report(2)  # an interval of 0 forwards every report


def test_calm_says_what_keeps_a_report_held_until_something_arrives_or_the_interval_ends(paced):
    # learner.sync's quiet calls ask nothing of the client while what `calm` gave holds: the
    # inbox's deliveries as of the last take, and the clock below the interval's end
    tc, clock, queued = paced(0.2)
    assert tc.calm() is None  # nothing taken yet
    tc.take()
    assert tc.calm() is None  # nothing forwarded yet: the first report goes out
    clock.now = 10.0
    tc.progress(report(1))
    calm = tc.calm()
    assert calm is not None and calm.report_by == pytest.approx(10.2) and calm.clock is clock
    assert calm.inbox is tc.client.inbox and calm.deliveries == tc.client.inbox.deliveries
    tc.client._deliver(session.ErrorInfo("stale", "x", False))  # anything arriving ends the calm
    assert calm.inbox.deliveries != calm.deliveries
    assert tc.calm().deliveries == calm.deliveries  # still as of the last take: it is not taken yet
    tc.take()
    assert tc.calm().deliveries == calm.deliveries + 1
    tc._markers = [5]
    assert tc.calm() is None  # a marker waits: the next call hands it out and reports
    tc.take_markers()
    assert tc.calm() is not None
    tc._stopped = True
    assert tc.calm() is None  # a stopped client is the next call's to tell
