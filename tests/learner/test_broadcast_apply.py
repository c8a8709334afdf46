"""The hook's side of the delta broadcast, in process (the daemon's shell and wire frames on a
virtual clock): what a learner holds after applying every delta is the syncer's published copy,
bit for bit, and so is what a learner that joined late got whole."""

import jax.numpy as jnp
import numpy as np

from ddiloco.core import syncer
from ddiloco.core.config import SyncerConfig
from ddiloco.experiments.inprocess import Hub, InProcessTransport, NetworkModel, VirtualLoop
from ddiloco.learner import recovery
from ddiloco.learner.sync import DilocoSync, SyncConfig
from ddiloco.learner.tree import tensor_specs


def model(seed):
    rng = np.random.default_rng(seed)
    return {
        "embed": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32),
        "w": jnp.asarray(rng.standard_normal((8, 24)), jnp.float32),
    }


def hook(hub, loop, name, seed):
    params = model(seed)
    transport = InProcessTransport(hub, name, tensor_specs(params))
    transport.connect()
    loop.run(lambda: transport.inbox.welcome is not None)
    sync = DilocoSync(params, SyncConfig(url="ws://in-process/ws", name=name), transport=transport)
    sync.join()
    transport.flush()
    return {"sync": sync, "transport": transport, "params": params, "target": model(seed + 100)}


def step(lr, loop):
    lr["params"] = {k: v - 0.2 * (v - lr["target"][k]) for k, v in lr["params"].items()}
    lr["transport"].step += 1
    lr["params"] = lr["sync"].step(lr["params"], tokens=64)
    lr["transport"].flush()
    loop.run(lambda at=loop.now + 0.2: loop.now >= at)


def trained(steps):
    """A hub on a virtual clock, and learner "a" after `steps` steps against it: (loop, hub, a)."""
    loop = VirtualLoop()
    hub = Hub(syncer.new_state(SyncerConfig(num_fragments=2, period=2, quorum=1)), loop, NetworkModel())
    a = hook(hub, loop, "a", 1)
    for _ in range(steps):
        step(a, loop)
    return loop, hub, a


def test_the_hook_holds_the_published_copy_after_deltas_and_a_late_joiner_gets_the_same_bytes():
    loop, hub, a = trained(24)
    state = hub.state
    assert state.merges >= 6 and all(f.delta is not None and f.delta.codec.value == "int4" for f in state.fragments)
    assert a["sync"].merged_versions_applied >= 6  # every version reached by a delta onto the one before
    late = hook(hub, loop, "late", 2)
    while any(f.version < 0 for f in late["sync"].fragments):
        step(late, loop)
    # a, then the late learner, take what arrived; then both hold the syncer's current versions
    for lr in (a, late):
        lr["params"] = lr["sync"].step(lr["params"], tokens=0)
    for q, frag in enumerate(state.fragments):
        held_a, held_late = a["sync"].fragments[q], late["sync"].fragments[q]
        if held_a.version == held_late.version == frag.version:
            assert held_a.published.tobytes() == held_late.published.tobytes() == frag.published.tobytes()
            assert held_a.base is held_a.published  # outer gradients start from the published copy
    assert any(
        a["sync"].fragments[q].version == late["sync"].fragments[q].version == f.version
        for q, f in enumerate(state.fragments)
    ), "no fragment held at the same version by both: nothing was compared"


def test_a_learner_that_adopts_a_newer_version_from_a_peer_follows_the_broadcast_at_once():
    # The syncer sends the joining learner its versions whole, then the deltas of the merges that
    # follow; the peer it recovers from holds those newer versions by then. The learner follows the
    # older whole copies along the deltas up to what it adopted, and applies the next delta at once,
    # long before the syncer would resend a version whole (WHOLE_RESEND_STUCK_S, 25 steps here).
    loop, hub, a = trained(8)
    late = hook(hub, loop, "late", 2)  # sent the current versions whole at its join
    joined_at = [f.version for f in hub.state.fragments]
    for _ in range(8):
        step(a, loop)
    adopted = tuple(f.version for f in a["sync"].fragments)
    assert all(v > w for v, w in zip(adopted, joined_at))  # the peer is ahead of the whole copies

    def from_peer(welcome, params, opt_state, *_):
        return recovery.Recovered(a["params"], opt_state, a["sync"].step_count, adopted, "peer 1", 0.0)

    late["sync"].recover_fn = from_peer
    late["params"], _ = late["sync"].recover(late["params"], None)
    assert late["sync"].recovered_from == "peer 1" and tuple(late["sync"].versions) == adopted
    # 0.4 s of the virtual clock per turn: six turns end long before a whole resend (5 s)
    published = {}  # (fragment, version) -> the syncer's published copy of it, as it was

    def keep():
        for q, f in enumerate(hub.state.fragments):
            published[q, f.version] = f.published.tobytes()

    keep()
    for _ in range(6):
        step(a, loop)
        keep()
        step(late, loop)
        keep()
        if all(f.version > v for f, v in zip(late["sync"].fragments, adopted)):
            break
    for q, frag in enumerate(late["sync"].fragments):
        assert frag.published is not None, f"fragment {q} still has no published copy"
        # a version past the adopted one came as a delta onto it, with the syncer's bits
        assert frag.version > adopted[q], f"fragment {q} still at the adopted version {adopted[q]}"
        assert frag.published.tobytes() == published[q, frag.version]
    assert hub.state.learners[late["sync"].learner_id].resent == {}  # nothing was sent whole again
