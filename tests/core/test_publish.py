"""The delta broadcast (core.publish, the syncer's published copies, the shell's choice of delta or
whole): a learner that applied every delta holds exactly the bytes of one that received the copy whole."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.core import checkpoint, codec, publish, syncer
from ddiloco.core.config import SyncerConfig
from ddiloco.core.events import Disconnect, InitFragment, Join, Merged, Progress, Push, SendUpdate, TimerFired
from ddiloco.core.layout import TensorSpec
from ddiloco.net.shell import Shell

TENSORS = (TensorSpec("embed", (64, 8), embedding=True), TensorSpec("w", (8, 48)), TensorSpec("head", (8, 16)))


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from(publish.BROADCAST_CODECS),
    st.sampled_from([16, 128]),
    st.integers(0, 2**32 - 1),
    st.lists(st.sampled_from([1e-4, 1e-2, 1.0]), min_size=1, max_size=6),
)
def test_published_stays_within_one_quantisation_step_of_global(name, block, seed, sizes):
    rng = np.random.default_rng(seed)
    n = block * 9
    theta = rng.standard_normal(n).astype(np.float32)
    published, learner = theta.copy(), theta.copy()
    for size in sizes:
        theta = theta - (rng.standard_normal(n) * size).astype(np.float32)
        body, b = publish.publish(published, theta, name, block)
        delta = codec.from_body(name, b, n, memoryview(body).cast("B"))
        publish.apply(learner, delta, parallel=False)
        assert learner.tobytes() == published.tobytes()  # the learner's copy, bit for bit
        gap = np.abs(theta - published)
        if name is codec.Codec.INT4:  # half a step of the block's scale, rounding aside
            step = np.repeat(delta.scales, block)
            assert (gap <= step * (0.5 + 1e-5) + np.abs(theta) * 1e-6).all()
        else:  # a bf16 (or fp32) rounding of the delta, not of the values
            moved = np.abs(delta.decode())
            assert (gap <= moved * 2.0**-8 + np.abs(theta) * 2.0**-22).all()


class Learners:
    """The core, and learners that keep what arrives the way learner.sync does (a delta onto the
    exact version held, a whole copy as it is), the updates taken from the core after each event."""

    def __init__(self, **cfg):
        self.state = syncer.new_state(SyncerConfig(num_fragments=2, period=2, **cfg))
        self.now = 0.0
        self.held: dict[int, list] = {}  # learner -> per fragment (version, published copy)
        self.sent: dict[int, list] = {}  # learner -> per fragment: the version sent last (net.shell's table)

    def send(self, event):
        self.now += 0.01
        self.state, effects = syncer.handle(self.state, event, self.now)
        for e in effects:
            if isinstance(e, SendUpdate):
                for lid in e.learners:
                    self._deliver(lid, e)
        return effects

    def _deliver(self, lid, effect):
        p = effect.fragment
        whole = effect.base_version < 0 or self.sent[lid][p] != effect.base_version
        name, version, base, block, values = syncer.update_values(self.state, p, whole)
        payload = codec.from_body(name, block, values.size if not block else self._size(p), values.tobytes())
        self.sent[lid][p] = version
        held_version, copy = self.held[lid][p]
        if base < 0:
            self.held[lid][p] = (version, payload.decode())
        elif copy is not None and base == held_version:
            copy = copy.copy()
            publish.apply(copy, payload)
            self.held[lid][p] = (version, copy)

    def _size(self, p):
        return self.state.layout.fragments[p].padded_size

    def join(self, name, conn):
        learner = self.state.next_learner
        self.held[learner] = [(-1, None)] * 2
        self.sent[learner] = [-1] * 2
        self.send(Join(conn, name, TENSORS, syncer.PROTOCOL_VERSION))
        return learner

    def merge(self, learner, fragment, seed):
        """Report a step that opens fragment's round, push into it; the round merges (quorum 1)."""
        versions = tuple(f.version for f in self.state.fragments)
        rec = self.state.learners[learner]
        step = max(rec.step, self.state.global_step) + 1
        while step % 2 != self.state.schedule.offsets[fragment]:
            step += 1
        self.send(Progress(learner, step, versions, (1, 1), (64, 64)))
        rnd = self.state.fragments[fragment].open
        assert rnd is not None
        n = self._size(fragment)
        vec = np.random.default_rng(seed).standard_normal(n).astype(np.float32) * 0.05
        effects = self.send(
            Push(learner, fragment, rnd.number, versions[fragment], 1, 64, codec.parse(codec.encode(vec, "int4")))
        )
        assert any(isinstance(e, Merged) for e in effects)


@pytest.mark.parametrize("name", ["int4", "bf16", "fp32"])
def test_a_learner_that_applied_every_delta_holds_the_bytes_of_one_that_joined_late(name):
    h = Learners(broadcast_codec=name)
    a = h.join("a", 1)
    rng = np.random.default_rng(0)
    for f in h.state.layout.fragments:
        vec = rng.standard_normal(f.padded_size).astype(np.float32)
        h.send(InitFragment(a, f.index, codec.parse(codec.encode(vec, "fp32"))))
        h.held[a][f.index] = (0, vec)  # what it sent is version 0, published as it is
        h.sent[a][f.index] = 0
    for i in range(6):
        h.merge(a, i % 2, seed=i)
    late = h.join("late", 2)
    for p, frag in enumerate(h.state.fragments):
        assert frag.version == 3
        (va, copy_a), (vl, copy_late) = h.held[a][p], h.held[late][p]
        assert va == vl == 3
        assert copy_a.tobytes() == copy_late.tobytes() == frag.published.tobytes()
        if name != "fp32":
            assert copy_a.tobytes() != frag.theta.tobytes()  # lossy: the copy is not the global values
    # the delta of a merge is int4 (or bf16 / fp32) of the fragment's size; the whole copy fp32
    h.merge(a, 0, seed=99)
    delta = h.state.fragments[0].delta
    assert delta.codec.value == name and delta.base_version == 3
    assert delta.body.nbytes == codec.Codec(name).body_bytes(h._size(0), delta.block)
    assert h.held[late][0][1].tobytes() == h.held[a][0][1].tobytes() == h.state.fragments[0].published.tobytes()


def test_resume_from_a_checkpoint_reproduces_the_published_copy_and_its_next_delta():
    h = Learners()
    a = h.join("a", 1)
    rng = np.random.default_rng(1)
    for f in h.state.layout.fragments:
        h.send(
            InitFragment(
                a, f.index, codec.parse(codec.encode(rng.standard_normal(f.padded_size).astype(np.float32), "fp32"))
            )
        )
    for i in range(4):
        h.merge(a, i % 2, seed=10 + i)
    data = b"".join(bytes(c) for c in checkpoint.to_chunks(h.state))
    back = checkpoint.restore(data)
    assert syncer.state_hash(back) == syncer.state_hash(h.state)
    for frag, want in zip(back.fragments, h.state.fragments):
        assert frag.published.tobytes() == want.published.tobytes()
    # the next merge publishes the same delta in both
    twin = Learners()
    twin.state, twin.now = back, h.now
    b_id = twin.state.next_learner
    assert b_id == h.state.next_learner
    h.send(Disconnect(a, "gone"))  # the restored syncer has no learners: a new one merges in both
    for run in (h, twin):
        lid = run.join("b", 7)
        run.merge(lid, 0, seed=77)
    assert h.state.fragments[0].delta.body.tobytes() == twin.state.fragments[0].delta.body.tobytes()
    assert syncer.state_hash(h.state) == syncer.state_hash(twin.state)


class _Recorder:
    """A Link that keeps what the shell sends (the network itself is not under test here)."""

    def __init__(self):
        self.updates = []

    def send(self, conn, effect):
        pass

    def send_update(self, conns, fragment, codec_name, version, values, base_version=-1, block=0, global_step=0):
        self.updates.append((conns, fragment, codec_name, version, base_version, block, bytes(values)))

    def close(self, conn, reason):
        pass

    def wake(self, at, token):
        pass

    def write_checkpoint(self, state, reason):
        pass

    def merged(self, effect):
        pass

    def log(self, effect):
        pass


def test_the_shell_sends_the_delta_to_connections_that_hold_its_base_and_whole_to_the_others():
    link = _Recorder()
    layout_state = Learners()  # for its init values and merge helper's schedule
    shell = Shell(layout_state.state, link)
    for conn in (1, 2):
        shell.opened(conn)
    shell.handle(Join(1, "a", TENSORS, syncer.PROTOCOL_VERSION), 0.0)
    rng = np.random.default_rng(2)
    for f in shell.state.layout.fragments:
        vec = rng.standard_normal(f.padded_size).astype(np.float32)
        shell.handle(InitFragment(1, f.index, codec.parse(codec.encode(vec, "fp32"))), 0.0)
    shell.sent[1] = {0: 0, 1: 0}  # learner 1 sent version 0 itself: it holds it
    shell.handle(Join(2, "b", TENSORS, syncer.PROTOCOL_VERSION), 0.1)  # recovering: whole copies
    assert [(u[0], u[2], u[4]) for u in link.updates] == [((2,), "fp32", -1)] * 2
    link.updates.clear()
    shell.handle(Progress(1, 2, (0, 0), (2, 2), (128, 128)), 0.2)
    shell.handle(Progress(2, 2, (0, 0), (2, 2), (128, 128)), 0.2)
    p = next(q for q, f in enumerate(shell.state.fragments) if f.open is not None)
    rnd = shell.state.fragments[p].open.number
    n = shell.state.layout.fragments[p].padded_size
    vec = np.full(n, 0.01, dtype=np.float32)
    for lid in (1, 2):
        shell.handle(Push(lid, p, rnd, 0, 2, 128, codec.parse(codec.encode(vec, "int4"))), 0.3)
    shell.handle(_timer(shell, p), 10.0)
    (update,) = [u for u in link.updates if u[1] == p]
    conns, _, name, version, base, block, _ = update
    assert sorted(conns) == [1, 2] and name == "int4" and (version, base, block) == (1, 0, 128)
    # a connection that missed a version (its table says another) gets the next one whole
    shell.sent[2][p] = 0
    link.updates.clear()
    shell.handle(Progress(1, 4, tuple(f.version for f in shell.state.fragments), (1, 1), (64, 64)), 11.0)
    shell.handle(Progress(2, 4, tuple(f.version for f in shell.state.fragments), (1, 1), (64, 64)), 11.0)
    rnd = shell.state.fragments[p].open.number
    for lid in (1, 2):
        shell.handle(Push(lid, p, rnd, 1, 1, 64, codec.parse(codec.encode(vec, "int4"))), 11.1)
    shell.handle(_timer(shell, p), 20.0)
    sent = sorted((u[0], u[2], u[4]) for u in link.updates if u[1] == p)
    assert sent == [((1,), "int4", 1), ((2,), "fp32", -1)]
    whole = next(u for u in link.updates if u[1] == p and u[4] == -1)
    assert whole[6] == shell.state.fragments[p].published.tobytes()


def _timer(shell, p):
    """The grace timer of fragment p's open round (a no-op event once the round closed)."""
    rnd = shell.state.fragments[p].open
    return TimerFired(p, rnd.number if rnd is not None else -1)


@pytest.mark.parametrize("name", ["int4", "bf16", "fp32"])
def test_apply_apart_holds_the_bits_of_apply_and_the_progress_kept_since_the_anchor(name):
    rng = np.random.default_rng(7)
    n = 4 * 128
    onto = rng.standard_normal(n).astype(np.float32)
    theta = onto + (rng.standard_normal(n) * 1e-2).astype(np.float32)
    anchor = onto - (rng.standard_normal(n) * 1e-3).astype(np.float32)
    published = onto.copy()
    body, block = publish.publish(published, theta, codec.Codec(name), 128)
    delta = codec.from_body(codec.Codec(name), block, n, memoryview(body).cast("B"))
    before = onto.copy()
    got, difference = publish.apply_apart(onto, delta, anchor, parallel=False)
    assert got.tobytes() == published.tobytes()  # what the syncer published, bit for bit
    assert difference.tobytes() == (published - anchor).tobytes()
    assert onto.tobytes() == before.tobytes()
