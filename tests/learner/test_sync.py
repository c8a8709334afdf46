"""The learner hook with a real syncer on 127.0.0.1: JAX pytrees in, fragments over real sockets."""

import logging
import threading
import time
import traceback
import urllib.error
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddiloco.core import syncer
from ddiloco.core.layout import LayoutError, build_layout
from ddiloco.core.outer import OuterConfig
from ddiloco.errors import UserError
from ddiloco.learner.sync import DilocoSync, FragmentSync, NotJoinedError, SyncConfig
from ddiloco.learner.tree import TreeFragments, tensor_specs
from ddiloco.net.client import SyncerRefused
from ddiloco.net.peer import PeerConfig

TOKEN = "learner-test-token-0123456789"


def model(seed):
    rng = np.random.default_rng(seed)
    return {
        "embed": jnp.asarray(rng.standard_normal((16, 4)), dtype=jnp.float32),
        "blocks": [{"w": jnp.asarray(rng.standard_normal((4, 4)), dtype=jnp.float32)} for _ in range(2)],
        "head": jnp.asarray(rng.standard_normal((4, 8)), dtype=jnp.bfloat16),
    }


def test_a_push_copies_no_cpu_leaf_to_the_host_it_is_in_already():
    """learner.tree.TreeFragments.start_gather starts no copy of a CPU leaf: its host copy is its
    own buffer (the premise, checked here against the JAX in use), and only a leaf on another
    platform's devices has one started."""
    from ddiloco.learner import tree as trees

    params = {"w": jnp.arange(8.0, dtype=jnp.float32) * 2, "b": jnp.ones(4, jnp.bfloat16)}
    tree = TreeFragments(params, build_layout(tensor_specs(params), 1))
    assert trees._in_host_memory(params["w"].sharding)
    leaves = tree.start_gather(params, 0)
    assert np.asarray(leaves[0]).ctypes.data == leaves[0].unsafe_buffer_pointer()  # no copy made
    assert np.array_equal(tree.finish_gather(0, leaves)[:12], np.r_[np.ones(4), np.arange(8.0) * 2])

    class Device:
        def __init__(self, platform):
            self.platform = platform

    class Sharding:
        def __init__(self, *platforms):
            self.device_set = frozenset(Device(p) for p in platforms)

    assert not trees._in_host_memory(Sharding("gpu")) and not trees._in_host_memory(Sharding("cpu", "tpu"))


def test_tree_round_trip_and_layout_check():
    params = model(0)
    specs = tensor_specs(params)
    assert {s.path for s in specs} == {"embed", "blocks/0/w", "blocks/1/w", "head"}
    assert [s.embedding for s in specs if s.path == "embed"] == [True]
    layout = build_layout(specs, 3)
    tree = TreeFragments(params, layout)
    rebuilt = params
    for p in range(3):
        values = tree.gather(params, p)
        assert values.shape == (layout.fragments[p].padded_size,)
        rebuilt = tree.scatter(rebuilt, p, values)
    for a, b in zip(np.asarray(rebuilt["blocks"][1]["w"]), np.asarray(params["blocks"][1]["w"])):
        np.testing.assert_array_equal(a, b)
    assert rebuilt["head"].dtype == jnp.bfloat16
    other = dict(params, head=jnp.zeros((4, 9), dtype=jnp.bfloat16))
    with pytest.raises(LayoutError, match="different shape"):
        TreeFragments(other, layout)


def inner_step(params, target, lr=0.2):
    """A stand-in for an AdamW step: pull every leaf towards this learner's own target."""
    return {
        "embed": params["embed"] - lr * (params["embed"] - target["embed"]),
        "blocks": [{"w": b["w"] - lr * (b["w"] - t["w"])} for b, t in zip(params["blocks"], target["blocks"])],
        "head": (params["head"] - lr * (params["head"] - target["head"])).astype(jnp.bfloat16),
    }


def train(learners, steps, pause_s=0.01):
    for _ in range(steps):
        for lr in learners:
            lr["params"] = lr["sync"].step(inner_step(lr["params"], lr["target"]), tokens=128)
        time.sleep(pause_s)


def two_learners(url):
    """Learners a and b joined to the syncer at `url`, each with its own model and target."""
    out = []
    for seed, name in ((1, "a"), (2, "b")):
        lr = {"params": model(seed), "target": model(10 * seed)}
        lr["sync"] = DilocoSync.connect(lr["params"], SyncConfig(url=url, name=name, token=TOKEN))
        out.append(lr)
    return out


def test_two_learners_merge_and_a_replacement_recovers_from_the_syncer(threaded_syncer):
    s = threaded_syncer(num_fragments=2, period=2, quorum=1, token=TOKEN)
    try:
        a, b = two_learners(s.url)
        train([a, b], 40)
        state = s.server.state
        assert state.merges >= 5, state.merges
        assert state.init_source == "learner 1"  # b's own random weights never became global state
        assert a["sync"].merged_versions_applied > 0 and b["sync"].merged_versions_applied > 0
        b["sync"].close()  # b dies
        c = {"params": model(3), "target": model(30)}
        c["sync"] = DilocoSync.connect(c["params"], SyncConfig(url=s.url, name="c", token=TOKEN))
        merges = state.merges
        train([a, c], 40)
        # On a loaded machine c may need more steps to hold every fragment: train on until it is
        # live (the condition, not a step count, is what the test is about).
        deadline = time.monotonic() + 120
        while (
            state.learners[c["sync"].learner_id].status is not syncer.LearnerStatus.LIVE and time.monotonic() < deadline
        ):
            train([a, c], 5)
        assert state.merges > merges
        rec = state.learners[c["sync"].learner_id]
        assert rec.status is syncer.LearnerStatus.LIVE and rec.caught_up_at is not None
        assert all(v >= 1 for v in c["sync"].versions)  # it holds merged versions, not its init
        a["sync"].close()
        c["sync"].close()
        state.ledger.check()
    finally:
        s.stop()


def test_the_hook_waits_on_nothing_at_a_step_with_nothing_due_or_arrived(threaded_syncer, monkeypatch):
    """No per-step device sync: a step with no fragment due, no push in flight and no version
    arriving only counts. Due steps start host copies that the next call collects and pushes."""
    s = threaded_syncer(num_fragments=2, period=8, quorum=1, token=TOKEN)  # due at steps 0 and 4 mod 8
    try:
        a = {"params": model(1), "target": model(10)}
        a["sync"] = sync = DilocoSync.connect(a["params"], SyncConfig(url=s.url, name="a", token=TOKEN))
        deadline = time.monotonic() + 120
        while s.server.state.merges < 2 and time.monotonic() < deadline:
            train([a], 4)
        assert s.server.state.merges >= 2
        waits, elsewhere = [], []  # calls on the training thread; on the hook's background thread
        training = threading.current_thread()

        def counting(fn, name):
            def counted(*args, **kwargs):
                (waits if threading.current_thread() is training else elsewhere).append(name)
                return fn(*args, **kwargs)

            return counted

        monkeypatch.setattr(jax, "block_until_ready", counting(jax.block_until_ready, "block_until_ready"))
        monkeypatch.setattr(jax, "device_get", counting(jax.device_get, "device_get"))
        monkeypatch.setattr(TreeFragments, "start_gather", counting(TreeFragments.start_gather, "start_gather"))
        quiet, due = 0, 0
        for _ in range(32):
            was_due = sync.due_next
            idle = not was_due and not sync.pushes_in_flight and not sync.updates_waiting
            before, applied = len(waits), sync.merged_versions_applied
            a["params"] = sync.step(inner_step(a["params"], a["target"]), tokens=128)
            if idle and sync.merged_versions_applied == applied:
                assert waits[before:] == [], f"an idle step waited on the device: {waits[before:]}"
                quiet += 1
            if was_due:  # copies started, not waited for: the next call pushes them
                due += 1
                assert sync.pushes_in_flight == was_due and "device_get" not in waits[before:]
            time.sleep(0.005)
        assert quiet >= 8 and due >= 4
        assert waits.count("start_gather") >= 4 and "block_until_ready" not in waits
        # the copies were collected, and the pushes encoded, off the training thread
        assert "device_get" not in waits and elsewhere.count("device_get") >= 4
        sync.close()
        assert not sync.pushes_in_flight
        s.server.state.ledger.check()
    finally:
        s.stop()


def _joined_past_two_merges(s, **config):
    """A learner of the syncer `s`, its reports at most every 5 s, trained until the syncer merged
    twice: (its hook, its parameters, their target)."""
    params, target = model(1), model(10)
    sync = DilocoSync.connect(params, SyncConfig(url=s.url, name="a", token=TOKEN, progress_interval_s=5.0, **config))
    deadline = time.monotonic() + 120
    while s.server.state.merges < 2 and time.monotonic() < deadline:
        params = sync.step(inner_step(params, target), tokens=7)
        time.sleep(0.003)
    assert s.server.state.merges >= 2
    return sync, params, target


def test_a_call_with_nothing_to_do_only_counts_and_its_counts_reach_the_next_report(threaded_syncer, monkeypatch):
    """learner.sync._counts_only: where the websocket client would hold the report back (no round
    opens, within its interval), a call with nothing due, taken or to book builds and hands over no
    report; the next report handed over counts every call since the one before."""
    s = threaded_syncer(num_fragments=2, period=16, quorum=1, token=TOKEN)  # due at steps 0 and 8 mod 16
    try:
        sync, params, target = _joined_past_two_merges(s)
        handed = []  # (calls so far, versions applied so far, the report)
        forward = sync.client.progress
        monkeypatch.setattr(
            sync.client,
            "progress",
            lambda item: (handed.append((sync.calls, sync.merged_versions_applied, item)), forward(item))[1],
        )
        for _ in range(64):
            params = sync.step(inner_step(params, target), tokens=7)
            time.sleep(0.003)
        assert 4 <= len(handed) <= 40, len(handed)  # at least each round's opening; far from every call
        pairs = 0
        for (calls0, applied0, a), (calls1, applied1, b) in zip(handed, handed[1:]):
            for q in range(2):
                if applied1 == applied0 and a.versions[q] == b.versions[q]:
                    assert b.steps[q] - a.steps[q] == calls1 - calls0
                    assert b.tokens[q] - a.tokens[q] == 7 * (calls1 - calls0)
                    pairs += calls1 - calls0 > 1  # calls between them handed over nothing
        assert pairs >= 2
        assert all(t == 7 * n for t, n in zip(sync.tokens, sync.steps))
        sync.close(params)
        s.server.state.ledger.check()
    finally:
        s.stop()


def test_a_quiet_call_asks_nothing_and_the_first_news_ends_the_quiet(threaded_syncer, monkeypatch):
    """learner.sync._quiet_call: after a call that only counted, the calls before the schedule's next
    phase step ask the client nothing (not even `take`), while nothing arrived and no background job
    ended since; a call that finds an arrival, a job ended or a phase step goes the whole way."""
    s = threaded_syncer(num_fragments=2, period=16, quorum=1, token=TOKEN)  # phases 0 and 8 mod 16
    try:
        sync, params, target = _joined_past_two_merges(s)
        tc = sync.client
        took = []
        take = tc.take
        monkeypatch.setattr(tc, "take", lambda: (took.append(sync.calls), take())[1])
        quiet, whole, news_taken = [], [], 0
        for _ in range(96):
            arrived = tc.client.inbox.deliveries != tc._taken[0]  # not taken yet
            ended = sync._quiet is not None and sync._background.finished != sync._quiet.finished
            params = sync.step(inner_step(params, target), tokens=7)
            if took and took[-1] == sync.calls:
                whole.append(sync.step_count)
                news_taken += arrived
            else:
                quiet.append(sync.step_count)
                assert not arrived and not ended, "a quiet call let news wait"
            time.sleep(0.002)
        assert len(quiet) >= 24, (len(quiet), len(whole))  # most calls between two phases
        assert all(step % 8 != 0 for step in quiet)  # a phase step goes the whole way
        assert news_taken >= 1  # versions arrived meanwhile, each taken at the first call after
        assert all(t == 7 * n for t, n in zip(sync.tokens, sync.steps))
        sync.close(params)
        s.server.state.ledger.check()
    finally:
        s.stop()


def test_a_call_that_books_a_push_and_applies_nothing_hands_over_no_report(threaded_syncer, monkeypatch):
    """learner.sync._report_held: a call that books a push the background thread sent, applies no
    version and opens no round leaves the report to the next call that changes what it says."""
    s = threaded_syncer(num_fragments=2, period=16, quorum=1, token=TOKEN)  # phases 0 and 8 mod 16
    try:
        sync, params, target = _joined_past_two_merges(s)
        handed = []
        forward = sync.client.progress
        monkeypatch.setattr(sync.client, "progress", lambda item: (handed.append(sync.calls), forward(item))[1])
        booked_only, reported = 0, 0
        for _ in range(160):
            flying, applied = set(sync.pushes_in_flight), sync.merged_versions_applied
            params = sync.step(inner_step(params, target), tokens=7)
            booked = flying - set(sync.pushes_in_flight)
            if booked and sync.merged_versions_applied == applied and sync.step_count % 8 != 0:
                booked_only += 1
                reported += bool(handed) and handed[-1] == sync.calls
            time.sleep(0.003)
        assert booked_only >= 3, booked_only
        assert reported == 0
        assert len(handed) >= 10  # the rounds' openings and the versions applied still report
        assert all(t == 7 * n for t, n in zip(sync.tokens, sync.steps))
        sync.close(params)
        s.server.state.ledger.check()
    finally:
        s.stop()


def test_a_learner_that_overwrites_its_progress_reports_at_every_call(threaded_syncer, monkeypatch):
    """keep_progress off: the tokens trained after a push are lost with the next version, and the
    syncer books them only from the report of the last step before it (the client forwards it ahead
    of the new version's). So no call skips its report: none only counts, none is quiet."""
    s = threaded_syncer(num_fragments=2, period=16, quorum=1, token=TOKEN)
    try:
        sync, params, target = _joined_past_two_merges(s, keep_progress=False)
        handed = []
        forward = sync.client.progress
        monkeypatch.setattr(sync.client, "progress", lambda item: (handed.append(item.step), forward(item))[1])
        calls = 0
        for _ in range(48):
            params = sync.step(inner_step(params, target), tokens=7)
            calls += 1
            time.sleep(0.003)
        assert len(handed) == calls and sync._quiet is None
        sync.close(params)
    finally:
        s.stop()


def _step_until_a_push_starts(sync, params, target, deadline):
    """Train until a call starts a push while every fragment's version is held; (params, fragment)."""
    while not (sync.pushes_in_flight and min(sync.versions) >= 0):
        assert time.monotonic() < deadline, "no push started"
        params = sync.step(inner_step(params, target), tokens=128)
        time.sleep(0.003)
    return params, sync.pushes_in_flight[-1]


def test_a_push_goes_out_as_soon_as_its_bytes_exist_not_at_the_next_call(threaded_syncer):
    """The background thread sends the push it encoded: the syncer has it while the training loop
    has not called the hook again, and the next call books it, once."""
    s = threaded_syncer(num_fragments=2, period=8, quorum=1, token=TOKEN)
    params, target = model(1), model(10)
    sync = DilocoSync.connect(params, SyncConfig(url=s.url, name="a", token=TOKEN))
    try:
        deadline = time.monotonic() + 60
        for _ in range(3):
            params, q = _step_until_a_push_starts(sync, params, target, deadline)
            frag, learner = sync.fragments[q], sync.learner_id
            want = (frag.version, frag.steps, frag.tokens)  # what the push carries

            def arrived(state, q=q, want=want, learner=learner):
                return state.learners[learner].pushed.get(q) == want

            while not s.read(arrived):  # no call of the hook meanwhile
                assert time.monotonic() < deadline, f"the push of fragment {q} did not leave before the next call"
                time.sleep(0.01)
            assert sync.pushes_in_flight  # still to be booked by the training thread
            params = sync.step(inner_step(params, target), tokens=128)
            assert q not in sync.pushes_in_flight
        sync.close()
        s.server.state.ledger.check()
    finally:
        s.stop()


class _SlowSender:
    """The hook's transport, whose pushes from the background thread wait until `release` is set
    (fault injection: a host or link slower than the training step)."""

    def __init__(self, inner):
        self.inner, self.release, self.waiting = inner, threading.Event(), threading.Event()

    def sender(self):
        send = self.inner.sender()

        def slow(push):
            self.waiting.set()
            assert self.release.wait(120), "never released"
            return send(push)

        return slow

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _merged_back(state, sync) -> bool:
    """Whether the syncer holds no push undecided and the learner holds every version it made."""
    return not state.ledger.held and all(f.version == v for f, v in zip(state.fragments, sync.versions))


def test_a_call_never_waits_for_a_push_the_background_thread_has_not_sent(threaded_syncer):
    """A push whose host work is not done stays in flight while the calls go on (they wait for
    nothing); its fragment's due step meanwhile is skipped (one push of a fragment at a time) and
    that progress goes with its next push; once sent, a later call books it, and nothing is counted
    twice or lost."""
    s = threaded_syncer(num_fragments=2, period=8, quorum=1, token=TOKEN)
    params, target = model(1), model(10)
    sync = DilocoSync.connect(params, SyncConfig(url=s.url, name="a", token=TOKEN))
    try:
        deadline = time.monotonic() + 60
        params, _ = _step_until_a_push_starts(sync, params, target, deadline)
        # Quiet first: every push booked and merged back, so that no version arrives while the
        # thread is held up (its decode would wait behind the push, and after DEFER_CALLS_MAX calls
        # the call would wait for it).
        while sync.pushes_in_flight or sync.updates_waiting or not s.read(lambda st: _merged_back(st, sync)):
            assert time.monotonic() < deadline, "the learner never came to rest"
            params = sync.step(params, tokens=0)
            time.sleep(0.01)
        slow = sync.client = _SlowSender(sync.client)
        params, q = _step_until_a_push_starts(sync, params, target, deadline)
        assert slow.waiting.wait(60), "the background thread did not come to send"
        held, tokens_before = sync.pushes_held, sync.fragments[q].tokens
        for _ in range(10):  # more than a period: fragment q falls due again
            params = sync.step(inner_step(params, target), tokens=128)
            assert not slow.release.is_set() and q in sync.pushes_in_flight
        assert sync.pushes_in_flight.count(q) == 1 and sync.pushes_held > held
        slow.release.set()
        while q in sync.pushes_in_flight:
            assert time.monotonic() < deadline, "the push sent was never booked"
            params = sync.step(inner_step(params, target), tokens=128)
            time.sleep(0.003)
        assert sync.fragments[q].tokens > tokens_before  # the skipped due step's progress is still to push
        version = sync.fragments[q].version
        while sync.fragments[q].version < version + 2:  # merged, and pushed from the version after
            assert time.monotonic() < deadline, "fragment q stopped merging"
            params = sync.step(inner_step(params, target), tokens=128)
            time.sleep(0.003)
        assert s.read(lambda st: st.ledger.totals["lost"]) == 0
        sync.close()
        s.read(lambda st: st.ledger.check())
    finally:
        s.stop()


def test_a_version_the_background_thread_is_still_decoding_is_applied_at_a_later_call(threaded_syncer, monkeypatch):
    """Learner a's background thread is slow to decode (fault injection) while b's pushes make new
    versions: a's calls take them and leave them waiting rather than wait for the decode, and apply
    them once decoded."""
    from ddiloco.learner import arrivals

    s = threaded_syncer(num_fragments=2, period=8, quorum=1, token=TOKEN)
    a, b = two_learners(s.url)
    release, slowed = threading.Event(), threading.Event()
    decode = arrivals.apply_update_kept

    def slow_decode(*args, **kwargs):
        if threading.current_thread().name.startswith("ddiloco-sync") and slowed.is_set():
            assert release.wait(120), "never released"
        return decode(*args, **kwargs)

    monkeypatch.setattr(arrivals, "apply_update_kept", slow_decode)
    try:
        deadline = time.monotonic() + 60
        while min(a["sync"].versions + b["sync"].versions) < 1:
            assert time.monotonic() < deadline, "the learners did not get going"
            train([a, b], 1, pause_s=0.003)
        slowed.set()
        held, waited = a["sync"].versions, 0
        while True:  # b's pushes merge; a takes the new versions and waits for nothing
            assert time.monotonic() < deadline, "no version arrived at a"
            train([a, b], 1, pause_s=0.003)
            if [p for p in a["sync"].updates_waiting if p not in a["sync"].pushes_in_flight]:
                waited += 1
            if waited == 3:  # three calls found the decode under way and none waited for it
                break
        assert a["sync"].versions == held and not release.is_set()
        release.set()
        while a["sync"].updates_waiting or a["sync"].versions == held:
            assert time.monotonic() < deadline, "the waiting version was never applied"
            train([a, b], 1, pause_s=0.003)
        for lr in (a, b):
            lr["sync"].close()
        s.read(lambda st: st.ledger.check())
    finally:
        release.set()
        s.stop()


def test_wrong_token_is_a_clear_error(threaded_syncer):
    s = threaded_syncer(token=TOKEN)
    try:
        with pytest.raises(Exception, match="refused the token"):
            DilocoSync.connect(model(0), SyncConfig(url=s.url, name="x", token="wrong-token-0123456789"))
    finally:
        s.stop()


def test_more_fragments_than_tensors_is_one_clear_error_on_both_sides(threaded_syncer, caplog):
    s = threaded_syncer(num_fragments=8, period=8, token=TOKEN)
    caplog.set_level(logging.WARNING, logger="ddiloco.syncer")
    sync = DilocoSync(model(0), SyncConfig(url=s.url, name="small", token=TOKEN))  # 4 tensors
    with pytest.raises(SyncerRefused) as refused:
        sync.join()
    assert isinstance(refused.value, UserError)
    assert (
        "the syncer splits the model into 8 fragments but it has 4 tensors: "
        "start the syncer with --fragments 4 or fewer" in str(refused.value)
    )
    # one error, raised where join was called: no chained exception, no frames of the client's thread
    assert refused.value.__cause__ is None and refused.value.__suppress_context__
    frames = [f.name for f in traceback.extract_tb(refused.value.__traceback__)]
    assert "_read_loop" not in frames and "_deliver" not in frames, frames
    warned = [r.getMessage() for r in caplog.records if r.name == "ddiloco.syncer" and r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert "'small'" in warned[0] and "4 tensors" in warned[0] and "--fragments 4 or fewer" in warned[0]
    assert s.read(lambda st: st.layout is None and not st.learners)  # nothing of it was kept


def test_error_feedback_needs_a_lossy_codec():
    with pytest.raises(ValueError, match="lossy codec"):
        SyncConfig(url="ws://127.0.0.1:1/ws", name="x", codec="fp32", error_feedback=True)
    assert SyncConfig(url="ws://127.0.0.1:1/ws", name="x", codec="int4", error_feedback=True).error_feedback


def test_the_constructor_touches_no_network_and_the_first_step_joins(threaded_syncer):
    s = threaded_syncer(num_fragments=2, period=2, quorum=1, token=TOKEN)
    params = model(1)
    sync = DilocoSync(params, SyncConfig(url=s.url, name="a", token=TOKEN))
    try:
        # nothing started: no client, so the syncer cannot have heard of it
        assert sync.client is None and not sync.joined and s.read(lambda st: len(st.learners)) == 0
        with pytest.raises(NotJoinedError, match="join"):
            _ = sync.layout
        with pytest.raises(NotJoinedError, match="join"):
            _ = sync.learner_id
        params = sync.step(params, tokens=8)  # joins first: waits for the welcome, sends version 0
        assert sync.joined and sync.step_count == 1 and sync.versions == [0, 0]
        assert s.wait_for("the learner's initial fragments", lambda st: st.init_source == f"learner {sync.learner_id}")
        assert sync.join() is sync.welcome  # joining again is a no-op
    finally:
        sync.close()


def test_join_against_no_syncer_times_out_and_closes_the_hook():
    sync = DilocoSync(model(0), SyncConfig(url="ws://127.0.0.1:1/ws", name="x", token=TOKEN, welcome_timeout_s=0.5))
    with pytest.raises(TimeoutError):
        sync.join()
    with pytest.raises(RuntimeError, match="closed"):
        sync.join()
    sync.close()  # closing twice is fine


def test_with_closes_the_client_and_the_peer_server(threaded_syncer):
    s = threaded_syncer(num_fragments=2, period=2, quorum=1, token=TOKEN)
    with DilocoSync.connect(model(1), SyncConfig(url=s.url, name="a", token=TOKEN, peer=PeerConfig())) as sync:
        me, peer_url = sync.learner_id, sync.peer_server.url
        assert s.wait_for("the learner", lambda st: me in st.learners)
        assert peer_answers(peer_url)
    assert s.wait_for(
        "the learner's goodbye", lambda st: me not in st.learners or st.learners[me].status is syncer.LearnerStatus.GONE
    )
    assert not peer_answers(peer_url)


def peer_answers(url):
    """Whether a peer server listens at `url` (a request without the token: refused with 401)."""
    try:
        urllib.request.urlopen(url, timeout=10)
    except urllib.error.HTTPError as exc:
        assert exc.code == 401
        return True
    except OSError:
        return False
    raise AssertionError("a snapshot was served without the token")


def test_fragment_sync_is_a_value():
    f = FragmentSync()
    assert (f.version, f.base, f.steps, f.tokens, f.feedback) == (-1, None, 0, 0, None)
    g = f.counted(5).counted(7)
    assert (g.steps, g.tokens) == (2, 12) and (f.steps, f.tokens) == (0, 0)  # f itself is unchanged
    values = np.ones(4, dtype=np.float32)
    h = g.received(3, values)
    assert (h.version, h.steps, h.tokens) == (3, 0, 0) and h.base is values


def test_a_peer_server_needs_the_hooks_own_snapshot_box():
    class Outbox:
        wanted = False

        def publish(self, data):
            raise AssertionError("never asked")

    with pytest.raises(ValueError, match="SnapshotBox"):
        DilocoSync(model(0), SyncConfig(url="ws://127.0.0.1:1/ws", name="x", peer=PeerConfig()), snapshots=Outbox())


def model32(seed):
    rng = np.random.default_rng(seed)
    return {
        "a": jnp.asarray(rng.standard_normal((8, 8)), jnp.float32),
        "b": jnp.asarray(rng.standard_normal(40), jnp.float32),
    }


def _run_alone(threaded_syncer, keep_progress):
    """One learner, quorum 1, stepping while its pushes travel; every arrival of a version checked."""
    s = threaded_syncer(num_fragments=2, period=8, quorum=1, token=TOKEN)
    params, target = model32(1), model32(10)
    config = SyncConfig(url=s.url, name="a", token=TOKEN, keep_progress=keep_progress)
    sync = DilocoSync.connect(params, config)
    tree = sync.tree
    stepped_at: dict[int, dict] = {}  # step -> the parameters handed to the hook then
    copied_at: dict[int, int] = {}  # fragment -> step of its last host copy (its push)
    arrivals = 0
    deadline = time.monotonic() + 120
    try:
        while (s.server.state.merges < 8 or arrivals < 4) and time.monotonic() < deadline:
            due = sync.due_next
            stepped = jax.tree.map(lambda x, t: x - 0.2 * (x - t), params, target)
            before = sync.fragments
            params = sync.step(stepped, tokens=128)
            stepped_at[sync.step_count] = stepped
            for q in due:
                copied_at[q] = sync.step_count
            for q, (old, new) in enumerate(zip(before, sync.fragments)):
                if new.version == old.version or old.version < 0 or q not in copied_at:
                    continue
                arrivals += 1
                if not keep_progress:
                    np.testing.assert_array_equal(tree.gather(params, q), new.published)
                    assert new.tokens == new.carried == 0
                    continue
                since = copied_at[q]  # the push of the version held was computed from this step's input
                assert new.carried == new.tokens == 128 * (sync.step_count - since)
                want = new.published + (tree.gather(stepped, q) - tree.gather(stepped_at[since], q))
                np.testing.assert_allclose(tree.gather(params, q), want, rtol=1e-6, atol=1e-6)
            time.sleep(0.003)
        assert arrivals >= 4, arrivals
        ledger = s.server.state.ledger
        lost_while_training = ledger.totals["lost"]  # before the learner leaves with its unpushed tokens
        sync.close()
        ledger.check()
        return lost_while_training, ledger.totals["merged"] / ledger.reported
    finally:
        s.stop()


def test_a_version_arriving_after_the_push_keeps_what_was_trained_since(threaded_syncer):
    """keep_progress: the new version plus the progress since the push, its tokens carried to the next
    window, none booked lost; overwriting (the paper's learner) loses them."""
    lost_while_training, merged_share = _run_alone(threaded_syncer, keep_progress=True)
    assert lost_while_training == 0 and merged_share > 0.8
    lost_while_training, _ = _run_alone(threaded_syncer, keep_progress=False)
    assert lost_while_training > 0


def test_every_step_of_progress_is_merged_once_however_often_the_learner_pushes(threaded_syncer):
    """One learner, outer lr 1 without momentum, fp32 both ways: the syncer's model is the initial one
    plus every step the learner took, once. The learner steps faster than versions come back, so it
    pushes several times from one version: each push is the increment since the one before, and a
    push counted twice (or a step never pushed) would show in the sum."""
    s = threaded_syncer(
        num_fragments=2,
        period=2,
        quorum=1,
        token=TOKEN,
        merge="mean",
        outer=OuterConfig(lr=1.0, momentum=0.0),
        broadcast_codec="fp32",
        push_codecs=("fp32",),
    )
    params, target = model32(1), model32(10)
    # Without the hold-back (push_skips_max 0) it pushes at every due step.
    config = SyncConfig(url=s.url, name="a", token=TOKEN, codec="fp32", push_skips_max=0)
    sync = DilocoSync.connect(params, config)
    tree = sync.tree
    start = [tree.gather(params, q).copy() for q in range(2)]
    trained = [np.zeros_like(x) for x in start]  # the sum of every step's change, per fragment
    pushes_from: dict[tuple[int, int], int] = {}  # (fragment, version held) -> pushes made from it
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and (
            s.server.state.merges < 8 or sum(n > 1 for n in pushes_from.values()) < 3
        ):
            for q in sync.due_next:
                key = (q, sync.fragments[q].version)
                pushes_from[key] = pushes_from.get(key, 0) + 1
            stepped = jax.tree.map(lambda x, t: x - 0.2 * (x - t), params, target)
            for q in range(2):
                trained[q] += tree.gather(stepped, q) - tree.gather(params, q)
            params = sync.step(stepped, tokens=128)
            time.sleep(0.001)
        assert sum(n > 1 for n in pushes_from.values()) >= 3, pushes_from
        # No more training: every step taken goes out and is merged; three more versions of each
        # fragment after the last step's push mean its round has closed.
        versions = [f.version for f in sync.fragments]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(f.version < v + 3 for f, v in zip(sync.fragments, versions)):
            params = sync.step(params, tokens=1)  # no change, but a weight: the rounds merge
            time.sleep(0.002)
        for q in range(2):
            held = s.server.state.fragments[q].theta
            np.testing.assert_allclose(held[: start[q].size], start[q] + trained[q], rtol=0, atol=1e-4)
        assert all(f.version >= v + 3 for f, v in zip(sync.fragments, versions)), (versions, sync.versions)
    finally:
        sync.close()


class _FullQueue:
    """The hook's transport, whose push queue is full for the first `refusals` pushes of each
    fragment (fault injection: a graceful close pushes every fragment at once into a queue of a few
    pushes); `refused` lists the fragment of each push it refused."""

    def __init__(self, inner, refusals: int = 1):
        self.inner, self.refusals, self.refused = inner, refusals, []

    def _full(self, push) -> bool:
        if self.refused.count(push.fragment) >= self.refusals:
            return False
        self.refused.append(push.fragment)
        return True

    def push(self, push):
        return False if self._full(push) else self.inner.push(push)

    def sender(self):
        send = self.inner.sender()
        return lambda push: False if self._full(push) else send(push)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _leave_and_count(threaded_syncer, with_params: bool, full_queue: bool = False) -> int:
    """Learner a trains past its last pushes, then leaves (`close`, with its parameters or without;
    `full_queue`: into a push queue that refuses each fragment's first push) while learner b steps
    on, so that the fragments' rounds open and close; the tokens booked lost once every push of a
    has been decided (b loses none while it trains: it keeps its progress)."""
    s = threaded_syncer(num_fragments=2, period=8, quorum=1, token=TOKEN)
    a = {"params": model(1), "target": model(10)}
    a["sync"] = DilocoSync.connect(a["params"], SyncConfig(url=s.url, name="a", token=TOKEN))
    b = {"params": model(2), "target": model(20)}
    b["sync"] = DilocoSync.connect(b["params"], SyncConfig(url=s.url, name="b", token=TOKEN))
    try:
        deadline = time.monotonic() + 120
        while min(a["sync"].versions + b["sync"].versions) < 2 and time.monotonic() < deadline:
            train([a, b], 1)
        while a["sync"].due_next:  # on to a step where nothing falls due
            train([a, b], 1)
        train([a], 1)
        # Trained after every push it made, so that only close(params) pushes it: a step can still
        # start a push that carries its tokens (an update that says b's global step is ahead makes a
        # catch up and push what fell due), and that push is in flight after the step.
        while a["sync"].pushes_in_flight:
            assert time.monotonic() < deadline, "a's pushes never went out"
            train([a], 1)
        learner = a["sync"].learner_id
        if full_queue:
            a["sync"].client = _FullQueue(a["sync"].client)
        a["sync"].close(a["params"] if with_params else None)
        assert not full_queue or sorted(a["sync"].client.refused) == [0, 1]
        deadline = time.monotonic() + 120
        while s.read(lambda st: any(k[0] == learner for k in st.ledger.held)) and time.monotonic() < deadline:
            train([b], 1)
        lost, mine = s.read(lambda st: (st.ledger.totals["lost"], st.ledger.of_learner(learner)))
        assert mine["merged"] + mine["merged_late"] > 0
        b["sync"].close()
        s.read(lambda st: st.ledger.check())
        return lost
    finally:
        s.stop()


def test_a_learner_that_leaves_with_its_parameters_has_every_token_it_trained_merged(threaded_syncer):
    """close(params) pushes what was trained since the last pushes, and the syncer merges it: no token
    is booked lost; a plain close() leaves the last step's tokens unpushed, booked lost."""
    assert _leave_and_count(threaded_syncer, with_params=True) == 0
    assert _leave_and_count(threaded_syncer, with_params=False) > 0


def test_a_close_gives_up_a_push_after_a_bounded_number_of_tries(threaded_syncer, monkeypatch):
    """A queue that never has room: each unpushed fragment is tried CLOSE_PUSH_TRIES times (a count,
    not a time: a replay refused where the recorded run was makes the same tries), then given up."""
    from ddiloco.learner import sync as hook

    monkeypatch.setattr(hook, "CLOSE_PUSH_RETRY_S", 0.0)
    s = threaded_syncer(num_fragments=2, period=8, quorum=1, token=TOKEN)
    a = {"params": model(1), "target": model(10)}
    a["sync"] = DilocoSync.connect(a["params"], SyncConfig(url=s.url, name="a", token=TOKEN))
    try:
        deadline = time.monotonic() + 60
        while min(a["sync"].versions) < 1 or a["sync"].due_next or a["sync"].pushes_in_flight:
            assert time.monotonic() < deadline, "the learner never got going"
            train([a], 1)
        train([a], 1)  # trained since every push it made
        full = a["sync"].client = _FullQueue(a["sync"].client, refusals=hook.CLOSE_PUSH_TRIES + 1)  # never room
        a["sync"].close(a["params"])
        assert sorted(full.refused) == [0] * hook.CLOSE_PUSH_TRIES + [1] * hook.CLOSE_PUSH_TRIES
    finally:
        s.stop()


def test_a_learner_that_leaves_into_a_full_push_queue_pushes_again_and_loses_nothing(threaded_syncer):
    """The pushes of a graceful close that the transport refuses for a full queue are made again
    once there is room (at most `CLOSE_PUSH_TRIES` tries), rather than dropped with what they carry."""
    assert _leave_and_count(threaded_syncer, with_params=True, full_queue=True) == 0


def test_a_learner_behind_the_global_step_moves_up_to_it_and_pushes_into_the_open_rounds(threaded_syncer):
    """Protocol 3: every update carries the syncer's global step (the fastest learner's at K = 1). A
    learner whose steps fell behind moves its count up to it and pushes the fragments that fell due
    in between at once, into the rounds that are open, instead of late into the next ones."""
    s = threaded_syncer(num_fragments=2, period=4, quorum=1, token=TOKEN)
    try:
        a, b = two_learners(s.url)
        train([a, b], 4)  # both hold every fragment
        moves = []
        deadline = time.monotonic() + 120
        while not moves and time.monotonic() < deadline:
            train([a], 8)  # a steps eight times for each step of b
            before, held = b["sync"].step_count, b["sync"].pushes_held
            b["params"] = b["sync"].step(inner_step(b["params"], b["target"]), tokens=128)
            if b["sync"].step_count > before + 1:
                moves.append((before, b["sync"].step_count, b["sync"].pushes_in_flight, b["sync"].pushes_held - held))
        assert moves, "b never heard of a global step ahead of its own"
        before, after, flights, newly_held = moves[0]
        assert after <= a["sync"].step_count  # never past the syncer's global step, which is a's
        # what fell due in between is pushed now, held back behind its own push, or (a fragment
        # whose version came in that call) left to its next due step: never more than were due
        assert len(flights) + newly_held <= 2, (flights, newly_held)
        pushes_before = s.server.state.learners[b["sync"].learner_id].pushed
        train([b], 2)
        rec = s.server.state.learners[b["sync"].learner_id]
        assert rec.step >= after  # its reports continue from the step it moved up to
        assert rec.pushed or pushes_before
        a["sync"].close()
        b["sync"].close()
        s.server.state.ledger.check()
    finally:
        s.stop()


def _slow_inner_step(params, target):
    """`inner_step` behind a computation of a few hundred milliseconds on 2 cores: a loop that does
    not wait for its steps calls the hook long before the devices finish."""
    heavy = jnp.full((256, 256), 1 / 256, dtype=jnp.float32)
    heavy = jax.lax.fori_loop(0, 300, lambda i, y: jnp.tanh(y @ y), heavy)
    nudged = jax.tree_util.tree_map(lambda x: x + (0 * heavy[0, 0]).astype(x.dtype), params)
    return inner_step(nudged, target)


def test_reports_name_the_newest_step_computed_not_the_newest_dispatched(threaded_syncer):
    """learner.lead: a loop that runs ahead of its devices reports the step they finished, so that the
    syncer opens a round when its first push can leave; once the loop waits, the report catches up."""
    s = threaded_syncer(num_fragments=2, period=64, quorum=1, token=TOKEN)
    params, target = model(1), model(10)
    sync = DilocoSync.connect(params, SyncConfig(url=s.url, name="a", token=TOKEN, progress_interval_s=0.0))
    slow = jax.jit(_slow_inner_step)
    try:
        deadline = time.monotonic() + 60
        while min(sync.versions) < 0 or s.read(lambda st: st.learners[sync.learner_id].step) < 1:
            assert time.monotonic() < deadline, "the learner never held its fragments"
            params = sync.step(inner_step(params, target), tokens=128)
            time.sleep(0.01)
        jax.block_until_ready(slow(params, target))  # compiled, so a call below returns at once
        computed = sync.step_count
        for _ in range(3):
            params = sync.step(slow(params, target), tokens=128)
        assert sync.steps_ahead >= 1  # the devices are still at it
        me = sync.learner_id
        # what the syncer heard is a step the devices finished, not one of the three dispatched
        assert s.read(lambda st: st.learners[me].step) <= computed + (3 - sync.steps_ahead)
        jax.block_until_ready(params)  # the loop reads its loss, say
        params = sync.step(inner_step(params, target), tokens=128)
        jax.block_until_ready(params)
        params = sync.step(inner_step(params, target), tokens=128)
        want = sync.step_count
        while s.read(lambda st: st.learners[me].step) < want:
            assert time.monotonic() < deadline, "the report never caught up with the steps computed"
            time.sleep(0.01)
        sync.close()
        s.server.state.ledger.check()
    finally:
        s.stop()
