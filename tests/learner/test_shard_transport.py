"""The learner's link to a sharded syncer (net.sharded) against real syncer daemons on 127.0.0.1,
each configured as one shard: what goes where, what comes back, and the shards' welcomes checked."""

import time

import numpy as np
import pytest

from ddiloco.core import codec, syncer
from ddiloco.core.config import SyncerConfig
from ddiloco.core.events import Push
from ddiloco.core.layout import TensorSpec, build_layout, layout_from_description
from ddiloco.net import session
from ddiloco.net.client import ClientConfig, ClientConfigError
from ddiloco.net.sharded import ShardedClient, ShardsDisagree, check_welcomes, merge_welcomes, split_urls

TOKEN = "learner-test-token-0123456789"
FRAGMENTS = 4
TENSORS = tuple(TensorSpec(f"w{i}", (64,), "float32", False) for i in range(FRAGMENTS))
DEADLINE_S = 120


def shard_config(shard, shards=2, **fields):
    return SyncerConfig(num_fragments=FRAGMENTS, period=2, quorum=1, shard=shard, shards=shards, **fields)


def holding(config):
    """A syncer state that holds parameters already (as one resumed from a checkpoint does)."""
    layout = build_layout(TENSORS, FRAGMENTS, config.strategy, config.block)
    params = [np.full(f.padded_size, q, dtype=np.float32) for q, f in enumerate(layout.fragments)]
    return syncer.new_state(config, layout, params)


def connect(*urls):
    return ShardedClient([ClientConfig(url=u, name="a", tensors=TENSORS, token=TOKEN) for u in urls])


def until(what, fn):
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"no {what} within {DEADLINE_S} s")


def outer_gradient(step, fragment, base, size):
    payload = codec.parse(codec.encode(np.full(size, 0.5, np.float32), "int4"))
    return Push(0, fragment, step, base, 1, 64, payload)


class Collector:
    """Takes from the transport and keeps the newest version of each fragment, and the welcomes."""

    def __init__(self, transport):
        self.transport = transport
        self.versions: dict[int, int] = {}
        self.welcomes: list[session.WelcomeInfo] = []
        self.count = 1
        self.errors: list[session.ErrorInfo] = []

    def take(self):
        updates, errors, (count, welcome) = self.transport.take()
        if count != self.count:
            assert count == self.count + 1, "one new welcome per take"
            self.count = count
            self.welcomes.append(welcome)
        for q, chain in updates.items():
            self.versions[q] = chain[-1].version
        self.errors += errors
        return self


def test_inits_go_to_each_fragments_owner_and_progress_to_every_shard(threaded_syncer):
    shard0, shard1 = threaded_syncer(shard_config(0)), threaded_syncer(shard_config(1))
    t = connect(shard1.url, shard0.url)  # in any order: the welcomes say which shard is which
    try:
        welcome = t.wait_welcome(30)
        assert (welcome.shard, welcome.shards, welcome.init_shards) == (0, 2, (0, 1))
        assert welcome.needs_init and welcome.owned == welcome.init_fragments == (0, 1, 2, 3)
        sizes = [f.padded_size for f in layout_from_description(welcome.layout).fragments]
        for q in range(FRAGMENTS):
            t.init(q, codec.encode(np.full(sizes[q], q, np.float32), "fp32"))
        # Each connection carries its inits in order: once a shard holds its last fragment, any
        # init sent to it by mistake has arrived before.
        shard0.wait_for("fragment 2's init", lambda s: s.fragments[2].theta is not None)
        shard1.wait_for("fragment 3's init", lambda s: s.fragments[3].theta is not None)
        held0 = shard0.read(lambda s: [f.theta is not None for f in s.fragments])
        held1 = shard1.read(lambda s: [f.theta is not None for f in s.fragments])
        assert held0 == [True, False, True, False] and held1 == [False, True, False, True]
        assert shard0.read(lambda s: s.rejections) == {} == shard1.read(lambda s: s.rejections)
        t.progress(session.ProgressInfo(3, (0,) * FRAGMENTS, (3,) * FRAGMENTS, (192,) * FRAGMENTS))
        for s in (shard0, shard1):
            s.wait_for("the progress report", lambda st: [r.step for r in st.learners.values()] == [3])
    finally:
        t.close()


def test_a_report_is_held_back_only_where_every_shard_would_hold_it(threaded_syncer, monkeypatch):
    # the hook's calls that only count skip their report only if no shard would have sent it on
    shard0, shard1 = threaded_syncer(holding(shard_config(0))), threaded_syncer(holding(shard_config(1)))
    t = connect(shard0.url, shard1.url)
    try:
        t.wait_welcome(30)
        first, second = (link.client for link in t._by_shard)
        assert not t.holds_report(1)  # nothing reported to either shard yet
        for a, b in ((True, True), (True, False), (False, True)):
            monkeypatch.setattr(first, "holds_report", lambda step, a=a: a)
            monkeypatch.setattr(second, "holds_report", lambda step, b=b: b)
            assert t.holds_report(1) is (a and b)
    finally:
        t.close()


def test_a_push_is_merged_by_its_owner_and_a_shard_down_holds_up_nobody(threaded_syncer):
    shard0 = threaded_syncer(holding(shard_config(0)))
    shard1 = threaded_syncer(holding(shard_config(1)))
    t = connect(shard0.url, shard1.url)
    try:
        welcome = t.wait_welcome(30)
        assert not welcome.needs_init and welcome.init_fragments == () and welcome.versions == (0,) * FRAGMENTS
        sizes = [f.padded_size for f in layout_from_description(welcome.layout).fragments]
        got = Collector(t)
        until("every fragment from its owner", lambda: len(got.take().versions) == FRAGMENTS)
        step = welcome.global_step

        def report():
            nonlocal step
            step += 1
            held = tuple(got.versions[q] for q in range(FRAGMENTS))
            t.progress(session.ProgressInfo(step, held, (1,) * FRAGMENTS, (64,) * FRAGMENTS))
            got.take()

        report()
        for q in (1, 2):
            t.push(outer_gradient(step, q, 0, sizes[q]))
        until("fragments 1 and 2 merged", lambda: report() or (got.versions[1] >= 1 and got.versions[2] >= 1))
        assert shard1.read(lambda s: [f.version for f in s.fragments])[1] >= 1
        assert shard0.read(lambda s: [f.version for f in s.fragments])[1] == 0  # never pushed there
        assert shard0.read(lambda s: [f.version for f in s.fragments])[2] >= 1
        assert shard1.read(lambda s: [f.version for f in s.fragments])[2] == 0

        # Shard 1 goes away: shard 0 goes on merging its fragments.
        port = shard1.server.port
        shard1.stop()
        link1 = next(link for link in t._links if link.url == shard1.url)
        until("the lost connection noticed", lambda: not link1.client.connected)
        merged = got.versions[0]
        t.push(outer_gradient(step, 1, got.versions[1], sizes[1]))
        assert t.pushes_unsent == 1  # not queued for a shard that is away
        t.push(outer_gradient(step, 0, merged, sizes[0]))
        until("fragment 0 merged without shard 1", lambda: report() or got.versions[0] > merged)

        # Shard 1 is back (from its last state: here its initial one): its own welcome is handed
        # over, for its own fragments, and its fragments come again.
        again = threaded_syncer(holding(shard_config(1)), server={"port": port})
        until("shard 1's new welcome", lambda: report() or got.welcomes)
        (w,) = got.welcomes
        assert (w.shard, w.shards, w.owned, w.init_shards) == (1, 2, (1, 3), None)
        until("shard 1's fragments again", lambda: report() or again.read(lambda s: s.live()))
        assert got.errors == []
    finally:
        t.close()


def welcome(shard=0, shards=2, **changes):
    fields = dict(
        learner=7, layout={}, digest="ab" * 32, versions=(3, 4, 5, 6), global_step=10, needs_init=False, period=2
    )
    fields.update(offsets=(0, 1, 0, 1), shard=shard, shards=shards)
    fields.update(changes)
    return session.WelcomeInfo(**fields)


def test_merging_takes_each_fragments_version_from_its_owner():
    merged = merge_welcomes(
        [welcome(0, versions=(3, 0, 5, 0), learner=7), welcome(1, versions=(0, 4, 0, 6), global_step=12, learner=2)]
    )
    assert merged.versions == (3, 4, 5, 6) and merged.global_step == 12 and merged.learner == 7
    assert merged.init_shards == () and not merged.needs_init and merged.owned == (0, 1, 2, 3)
    asked = merge_welcomes([welcome(0), welcome(1, needs_init=True)])
    assert asked.needs_init and asked.init_shards == (1,) and asked.init_fragments == (1, 3)


@pytest.mark.parametrize(
    "welcomes, message",
    [
        (
            [("ws://a/ws", welcome(0)), ("ws://b/ws", welcome(0))],
            "ws://b/ws says it is shard 0 of 2, as ws://a/ws does",
        ),
        ([("ws://a/ws", welcome(0, 1)), ("ws://b/ws", welcome(0, 1))], r"shard 0 of 1, but 2 syncer URLs were given"),
        ([("ws://a/ws", welcome(0, 3)), ("ws://b/ws", welcome(1, 3))], r"shard 0 of 3, but 2 syncer URLs were given"),
        ([("ws://a/ws", welcome(0)), ("ws://b/ws", welcome(1, digest="cd" * 32))], "ws://b/ws says its layout digest"),
        ([("ws://a/ws", welcome(0)), ("ws://b/ws", welcome(1, period=4))], "round period is 4, ws://a/ws says 2"),
        ([("ws://a/ws", welcome(0)), ("ws://b/ws", welcome(1, offsets=(0, 0, 1, 1)))], "fragment offsets"),
    ],
)
def test_welcomes_that_are_not_one_syncers_shards_are_refused(welcomes, message):
    with pytest.raises(ShardsDisagree, match=message):
        check_welcomes(welcomes)


def test_two_syncers_claiming_the_same_shard_are_refused_naming_both(threaded_syncer):
    a, b = threaded_syncer(shard_config(0)), threaded_syncer(shard_config(0))
    t = connect(a.url, b.url)
    try:
        with pytest.raises(ShardsDisagree, match=f"{b.url} says it is shard 0 of 2, as {a.url} does"):
            t.wait_welcome(30)
    finally:
        t.close()


def test_a_shard_that_does_not_answer_is_named():
    t = connect("ws://127.0.0.1:1/ws", "ws://127.0.0.1:2/ws")
    try:
        with pytest.raises(TimeoutError, match=r"from 2 syncer shard\(s\): ws://127.0.0.1:1/ws .*ws://127.0.0.1:2/ws"):
            t.wait_welcome(0.2)
    finally:
        t.close()


@pytest.mark.parametrize(
    "value, urls",
    [
        ("ws://a/ws", ("ws://a/ws",)),
        ("ws://a/ws, ws://b/ws", ("ws://a/ws", "ws://b/ws")),
        (("ws://a/ws",), ("ws://a/ws",)),
    ],
)
def test_urls_are_one_or_several(value, urls):
    assert split_urls(value) == urls


@pytest.mark.parametrize(
    "value, message",
    [
        ("ws://a/ws,", "an empty syncer URL"),
        ("ws://a/ws,ws://a/ws", "given twice: ws://a/ws"),
        (",".join(f"ws://h{i}/ws" for i in range(65)), "65 syncer URLs"),
    ],
)
def test_bad_url_lists_are_refused(value, message):
    with pytest.raises(ClientConfigError, match=message):
        split_urls(value)
