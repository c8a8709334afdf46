"""The delta broadcast over the real daemon: learners that follow the deltas from the start hold the
same bytes as the syncer's published copy and as a learner that joins late and gets it whole."""

import numpy as np

from ddiloco.core import codec, publish

from .test_daemon import Learner, Syncer, train, until


class Following(Learner):
    """A learner that keeps the published copy of each fragment as learner.sync does: a delta onto
    exactly the version it holds, a whole copy as it is."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.copies: dict[int, np.ndarray] = {}
        self.deltas = self.wholes = 0

    async def welcome(self):
        # the initial values this learner would send are version 0 as published (fp32, exact)
        state = self.rng.bit_generator.state
        w = await super().welcome()
        if w.needs_init:
            again = np.random.default_rng()
            again.bit_generator.state = state
            self.copies = {p: again.standard_normal(n).astype(np.float32) for p, n in enumerate(self.sizes)}
        return w

    def absorb(self):
        box = self.client.inbox
        for p, chain in list(box.updates.items()):
            for u in chain:
                if u.whole:
                    self.copies[p] = u.encoded.decode()
                    self.wholes += 1
                elif u.base_version == self.versions[p] and p in self.copies:
                    copy = self.copies[p].copy()
                    publish.apply(copy, u.encoded)
                    self.copies[p] = copy
                    self.deltas += 1
                else:
                    continue  # not onto what it holds: wait for a whole copy
                self.versions[p] = u.version
        box.updates.clear()


async def test_deltas_applied_from_the_start_give_the_bytes_of_a_late_whole_copy(tmp_path):
    s = Syncer(tmp_path)  # the default broadcast: int4 deltas
    await s.start()
    a = Following(s.ws_url, "a", seed=1)
    assert (await a.welcome()).needs_init
    b = Following(s.ws_url, "b", seed=2)
    await b.welcome()
    await until(lambda: s.server.state.holds_parameters, what="initial parameters")
    await train(s.server, [a, b], 16)
    await until(lambda: s.server.state.merges >= 4, what="merges")
    state = s.server.state

    def settled():  # no push waits in a round any more, and a holds every version merged
        a.absorb()
        no_push = all(f.open is None or not f.open.pushes for f in state.fragments)
        return no_push and a.versions == [f.version for f in state.fragments]

    await until(settled, what="the last merges, and a holding them")
    await a.stop()
    await b.stop()
    late = Following(s.ws_url, "late", seed=3)
    await late.welcome()
    await until(lambda: len(late.client.inbox.updates) == 2, what="the late learner's whole copies")
    late.absorb()
    # a followed a chain of deltas (a stale push of its may also have brought it a whole copy)
    assert a.deltas >= 2 and late.wholes == 2 and late.deltas == 0
    for p, frag in enumerate(state.fragments):
        assert a.versions[p] == late.versions[p] == frag.version
        assert a.copies[p].tobytes() == late.copies[p].tobytes() == frag.published.tobytes()
    # the deltas were int4: about an eighth of the fp32 fragment
    assert all(f.delta is None or f.delta.codec is codec.Codec.INT4 for f in state.fragments)
    await late.stop()
    await s.server.stop()
