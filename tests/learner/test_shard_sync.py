"""The sync hook against a syncer split into two shards, each a real syncer daemon on 127.0.0.1: a
shard that restarts resets only its own fragments, and only the shards that ask get initial
parameters."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddiloco.core import syncer
from ddiloco.core.config import SyncerConfig
from ddiloco.core.layout import build_layout
from ddiloco.errors import UserError
from ddiloco.learner.sync import DilocoSync, SyncConfig
from ddiloco.learner.tree import TreeFragments, tensor_specs
from ddiloco.net.client import ClientConfigError

TOKEN = "learner-test-token-0123456789"
FRAGMENTS = 4
DEADLINE_S = 120


def model(seed):
    rng = np.random.default_rng(seed)
    return {
        "embed": jnp.asarray(rng.standard_normal((16, 4)), dtype=jnp.float32),
        "blocks": [{"w": jnp.asarray(rng.standard_normal((4, 4)), dtype=jnp.float32)} for _ in range(2)],
        "head": jnp.asarray(rng.standard_normal((4, 8)), dtype=jnp.float32),
    }


def shard_config(shard):
    return SyncerConfig(num_fragments=FRAGMENTS, period=2, quorum=1, shard=shard, shards=2)


def holding(config, seed=0):
    """A shard that holds parameters already (as one resumed from a checkpoint does)."""
    params = model(seed)
    layout = build_layout(tensor_specs(params), FRAGMENTS, config.strategy, config.block)
    tree = TreeFragments(params, layout)
    return syncer.new_state(config, layout, [tree.gather(params, q).copy() for q in range(FRAGMENTS)])


def versions(s):
    return s.read(lambda state: [f.version for f in state.fragments])


class Learner:
    def __init__(self, urls, seed=1):
        self.params = model(seed)
        self.target = jax.tree.map(lambda x: x + 1.0, self.params)
        self.sync = DilocoSync.connect(self.params, SyncConfig(url=urls, name="a", token=TOKEN))

    def step(self):
        self.params = jax.tree.map(lambda p, t: p - 0.2 * (p - t), self.params, self.target)
        self.params = self.sync.step(self.params, tokens=64)
        time.sleep(0.005)  # a training step's time, for the rounds' round trips

    def train_until(self, what, fn):
        deadline = time.monotonic() + DEADLINE_S
        while not fn():
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {DEADLINE_S} s (versions {self.sync.versions})")
            self.step()


def test_a_restarted_shard_resets_only_its_own_fragments_and_the_other_merges_on(threaded_syncer):
    shard0 = threaded_syncer(holding(shard_config(0)))
    shard1 = threaded_syncer(holding(shard_config(1)))
    a = Learner(f"{shard0.url},{shard1.url}")
    try:
        assert a.sync.welcome.shards == 2 and a.sync.recovered_from == "syncer"
        learner = a.sync.learner_id
        a.train_until("merges of every fragment", lambda: all(v >= 1 for v in a.sync.versions))
        assert versions(shard0)[0] >= 1 and versions(shard1)[1] >= 1

        port = shard1.server.port
        shard1.stop()
        merges = shard0.read(lambda s: s.merges)
        a.train_until("shard 0 merging without shard 1", lambda: shard0.read(lambda s: s.merges) > merges + 2)

        # Shard 1 comes back from its initial state (as from an old checkpoint): version 0 again.
        held = a.sync.versions
        again = threaded_syncer(holding(shard_config(1)), server={"port": port})
        welcomes = a.sync.welcomes_seen
        a.train_until("shard 1's new welcome", lambda: a.sync.welcomes_seen > welcomes)
        after = a.sync.versions
        assert after[1] in (-1, 0) and after[3] in (-1, 0), after  # shard 1's: started again
        assert after[0] >= held[0] and after[2] >= held[2], (held, after)  # shard 0's: kept
        assert a.sync.learner_id == learner  # shard 0's session goes on

        a.train_until("shard 0's fragments merging on", lambda: a.sync.versions[0] > after[0])
        a.train_until("the new shard 1 merging", lambda: versions(again)[1] >= 1 and a.sync.versions[1] >= 1)
        assert shard0.read(lambda s: s.rejections) == {}
    finally:
        a.sync.close()


def test_only_the_shards_that_ask_are_sent_the_initial_parameters(threaded_syncer):
    shard0 = threaded_syncer(holding(shard_config(0)))  # holds its fragments
    shard1 = threaded_syncer(shard_config(1))  # holds nothing: asks the first learner
    a = Learner((shard1.url, shard0.url))
    try:
        assert a.sync.welcome.init_shards == (1,) and a.sync.recovered_from == "init"
        sent = shard1.wait_for("fragment 3's init", lambda s: s.fragments[3].theta is not None and s)
        tree = a.sync.tree
        initial = model(1)
        for q in (1, 3):
            np.testing.assert_array_equal(sent.fragments[q].theta, tree.gather(initial, q))
        assert shard1.read(lambda s: [f.theta is None for f in s.fragments]) == [True, False, True, False]
        a.train_until("shard 0's fragments", lambda: all(v >= 0 for v in a.sync.versions))
        shard0.wait_for("the learner live on shard 0", lambda s: s.live())
        assert shard0.read(lambda s: (s.rejections, s.init_source)) == ({}, "file")  # it was sent no init
    finally:
        a.sync.close()


def test_one_shards_url_alone_is_refused(threaded_syncer):
    shard0 = threaded_syncer(holding(shard_config(0)))
    with pytest.raises(UserError, match=r"is shard 0 of 2: give the learner every shard's URL"):
        DilocoSync.connect(model(1), SyncConfig(url=shard0.url, name="a", token=TOKEN))


@pytest.mark.parametrize(
    "url, urls",
    [
        ("ws://a/ws", ("ws://a/ws",)),
        ("ws://a/ws, ws://b/ws", ("ws://a/ws", "ws://b/ws")),
        (("ws://b/ws", "ws://a/ws"), ("ws://b/ws", "ws://a/ws")),
    ],
)
def test_the_url_is_one_syncer_or_every_shard(url, urls):
    config = SyncConfig(url=url, name="a")
    assert config.urls == urls and config.url == ",".join(urls)


def test_a_url_list_with_a_hole_is_refused():
    with pytest.raises(ClientConfigError, match="an empty syncer URL"):
        SyncConfig(url="ws://a/ws,,ws://b/ws", name="a")
