"""A learner that is killed rejoins from a live peer (real syncer, real learner processes, 127.0.0.1)."""

import multiprocessing
import os
import signal
import threading
import time

import jax
import numpy as np
import optax
import pytest

from ddiloco.core.syncer import LearnerStatus
from ddiloco.demo.learner_process import LearnerConfig, run_learner
from ddiloco.learner import recovery
from ddiloco.learner.sync import DilocoSync, SyncConfig
from ddiloco.net import peer
from ddiloco.net.peer import PeerConfig
from ddiloco.reference import data
from ddiloco.reference import model as reference

TOKEN = "recovery-test-token-0123456789"
MODEL = reference.ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, seq=16)
TRAIN = reference.TrainConfig(lr=1e-3, warmup_steps=2, total_steps=100_000)
DEADLINE_S = 120


def live(name):
    return lambda s: [r.id for r in s.learners.values() if r.name == name and r.status is LearnerStatus.LIVE]


def learner_config(url, name, index):
    return LearnerConfig(
        syncer=url,
        name=name,
        shard=data.Shard(index, 2),
        token=TOKEN,
        model=MODEL,
        train=TRAIN,
        batch=2,
        seed=index,
        codec="int4",
        steps_total=10**9,
        speed=0.2,
    )


def fresh_state(seed=7):
    params = reference.init_params(MODEL, jax.random.PRNGKey(seed))
    return params, reference.make_optimizer(TRAIN).init(params)


def adam_count(opt_state):
    counts = [
        int(np.asarray(s.count))
        for s in jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)
    ]
    assert counts, "the reference optimizer holds an Adam state"
    return counts[0]


class PeerLearner:
    """Learner a: the reference model and AdamW in a thread of this process, serving its state."""

    def __init__(self, url):
        self.stop, self.steps, self.error = threading.Event(), 0, None
        params, opt_state = fresh_state(0)
        self.sync = DilocoSync.connect(params, SyncConfig(url=url, name="a", token=TOKEN, peer=PeerConfig()))
        self.thread = threading.Thread(target=self._run, args=(params, opt_state), daemon=True)
        self.thread.start()

    def _run(self, params, opt_state):
        try:
            train_step = reference.make_train_step(MODEL, reference.make_optimizer(TRAIN))
            stream = data.batches(data.Shard(0, 2).slice(data.train_bytes()), 2, MODEL.seq, np.random.default_rng(0))
            while not self.stop.is_set():
                x, y = next(stream)
                params, opt_state, _ = train_step(params, opt_state, x, y)
                params = self.sync.step(params, tokens=2 * MODEL.seq, opt_state=opt_state)
                self.steps += 1
                self.stop.wait(0.01)  # leave the CPU to the other learners
        except BaseException as exc:  # reported by the test, not lost with the thread
            self.error = exc

    def close(self):
        self.stop.set()
        self.thread.join(30)
        self.sync.close()
        assert self.error is None, self.error


def test_a_killed_learner_rejoins_from_a_live_peer(threaded_syncer):
    hub = threaded_syncer(num_fragments=2, period=2, block=64, token=TOKEN)
    killed = multiprocessing.get_context("spawn").Process(
        target=run_learner, args=(learner_config(hub.url, "b", 1),), daemon=True
    )
    a = sync = None
    try:
        a = PeerLearner(hub.url)
        killed.start()
        hub.wait_for("live learner b", live("b"))
        os.kill(killed.pid, signal.SIGKILL)  # no bye, no clean close: the syncer sees the socket drop
        killed.join(30)
        hub.wait_for("b gone", lambda s: not live("b")(s))
        (peer_id,) = hub.wait_for("live learner a", live("a"))

        params, opt_state = fresh_state(1)
        sync = DilocoSync.connect(params, SyncConfig(url=hub.url, name="b", token=TOKEN, recover_timeout_s=60))
        params, opt_state = sync.recover(params, opt_state)
        assert sync.recovered_from == f"peer {peer_id}"
        assert sync.step_count > 0 and adam_count(opt_state) > 0  # the peer's step and AdamW state, not fresh ones
        assert min(sync.versions) >= 0
        # The adopted leaves are the peer's (not this learner's seed) and sit on the local sharding.
        mine = jax.tree_util.tree_leaves(fresh_state(1)[0])[0]
        leaf = jax.tree_util.tree_leaves(params)[0]
        assert not np.array_equal(np.asarray(leaf), np.asarray(mine)) and leaf.sharding == mine.sharding

        step0 = sync.step_count
        for _ in range(3):
            params = sync.step(params, tokens=32, opt_state=opt_state)
        # it counts on from the peer's step, and moves up to the syncer's global step (protocol 3)
        # where an update says it is behind: never back, and never further than that step and the
        # calls since (the syncer's global step counts steps computed, learner.lead, which may
        # trail the steps this learner dispatched)
        assert sync.step_count >= step0 + 3
        assert sync.step_count <= max(step0, hub.read(lambda s: s.global_step)) + 3
        me = sync.learner_id
        hub.wait_for("the rejoined learner live", lambda s: s.learners[me].status is LearnerStatus.LIVE)
        versions, held = hub.read(lambda s: ([f.version for f in s.fragments], list(s.learners[me].versions)))
        assert all(0 <= h <= v for h, v in zip(held, versions))
        hub.read(lambda s: s.ledger.check())
    finally:
        if sync is not None:
            sync.close()
        if killed.is_alive():
            killed.kill()
        killed.join(30)
        if a is not None:
            a.close()
        hub.stop()


def test_no_reachable_peer_falls_back_to_the_syncer(threaded_syncer):
    hub = threaded_syncer(num_fragments=2, period=2, block=64, token=TOKEN)
    first = second = None
    try:
        params, opt_state = fresh_state(1)
        first = DilocoSync.connect(params, SyncConfig(url=hub.url, name="a", token=TOKEN, peer=PeerConfig()))
        first.recover(params, opt_state)
        assert first.recovered_from == "init"
        hub.wait_for("fragments held", lambda s: s.holds_parameters)
        me = first.learner_id
        deadline = time.monotonic() + DEADLINE_S
        while hub.read(lambda s: s.learners[me].status) is not LearnerStatus.LIVE:
            assert time.monotonic() < deadline, "learner a never became live"
            params = first.step(params, tokens=32, opt_state=opt_state)
        first.peer_server.close()  # a live learner whose endpoint is gone

        params2, opt2 = fresh_state(2)
        second = DilocoSync.connect(params2, SyncConfig(url=hub.url, name="b", token=TOKEN, recover_timeout_s=5))
        assert [p.learner for p in second.welcome.peers] == [me]
        got_params, got_opt = second.recover(params2, opt2)
        assert second.recovered_from == "syncer"
        assert got_opt is opt2 and adam_count(got_opt) == 0  # its fresh state, nothing copied
        deadline = time.monotonic() + DEADLINE_S
        while min(second.versions) < 0:  # the syncer's fragments overwrite every parameter
            assert time.monotonic() < deadline, "the syncer's fragments never arrived"
            got_params = second.step(got_params, tokens=32, opt_state=got_opt)
            time.sleep(0.01)
        theta = hub.read(lambda s: [np.array(f.theta) for f in s.fragments])
        for q in range(2):
            np.testing.assert_array_equal(second.tree.gather(got_params, q), theta[q])
    finally:
        for s in (first, second):
            if s is not None:
                s.close()
        hub.stop()


def test_a_snapshot_of_another_structure_is_refused():
    params, opt_state = fresh_state()
    data_ = recovery.snapshot_bytes(params, opt_state, 5, [1, 1], "ab" * 32)
    snap = peer.decode_snapshot(data_)
    other = optax.sgd(0.1).init(params)
    with pytest.raises(recovery.RecoveryError, match="pytree structure"):
        recovery.adopt(snap, params, other, "ab" * 32, (1, 1))
    unheld = peer.decode_snapshot(recovery.snapshot_bytes(params, opt_state, 5, [-1, 1], "ab" * 32))
    with pytest.raises(recovery.RecoveryError, match="do not cover"):
        recovery.adopt(unheld, params, opt_state, "ab" * 32, (2, 1))
    with pytest.raises(recovery.RecoveryError, match="layout"):
        recovery.adopt(snap, params, opt_state, "cd" * 32, (1, 1))
    new_params, new_opt, step, versions = recovery.adopt(snap, params, opt_state, "ab" * 32, (1, 1))
    assert step == 5 and versions == (1, 1)
    assert jax.tree_util.tree_structure(new_opt) == jax.tree_util.tree_structure(opt_state)
