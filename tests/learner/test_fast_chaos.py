"""Learners at accelerator speed under chaos: real learner processes (spawned, the synthetic loop of
`ddiloco bench learner` stepping every 2 ms) against the real syncer daemon, one of them killed
without a word and started again under its name. The others train on through it, the rejoined one
gets going, and every token is accounted for: the books balance, and the only tokens lost are those
the killed learner had not pushed."""

import multiprocessing
import os
import signal

from ddiloco.bench.learner import LearnerBenchConfig, synthetic_learner
from ddiloco.core.syncer import LearnerStatus

TOKEN = "fast-chaos-token-0123456789"
# 2 ms steps; 64k parameters in 8 tensors, small enough that 2 cores keep three learners going
LOOP = LearnerBenchConfig(synthetic_step_ms=2.0, params=1 << 16, fragments=4)
RUN_S = 14.0  # how long the learners that are not killed train
REJOINED_S = 5.0


def _live(state, name: str) -> list[int]:
    return [i for i, r in state.learners.items() if r.name == name and r.status is LearnerStatus.LIVE]


def test_learners_stepping_every_2_ms_train_on_through_a_kill_and_a_rejoin(threaded_syncer):
    s = threaded_syncer(num_fragments=LOOP.fragments, period=LOOP.period, quorum=1, block=64, token=TOKEN)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()

    def learner(name: str, seconds: float):
        return ctx.Process(target=synthetic_learner, args=(s.url, name, TOKEN, seconds, LOOP, out), daemon=True)

    others, doomed, rejoined = [learner("a", RUN_S), learner("b", RUN_S)], learner("c", RUN_S), learner("c", REJOINED_S)
    try:
        for p in (*others, doomed):
            p.start()
        (doomed_id,) = s.wait_for("learner c live", lambda st: _live(st, "c"))
        # c's pushes are merging and every fragment has merged twice: it dies in the middle of training
        s.wait_for("c merged", lambda st: st.ledger.of_learner(doomed_id)["merged"] > 0 and st.merges >= 8)
        lost_before = s.read(lambda st: st.ledger.totals["lost"])
        os.kill(doomed.pid, signal.SIGKILL)  # no goodbye: the syncer sees the socket drop
        doomed.join(30)
        s.wait_for("c gone", lambda st: not _live(st, "c"))
        merges_at_kill, lost_at_kill = s.read(lambda st: (st.merges, st.ledger.totals["lost"]))
        rejoined.start()
        for p in (*others, rejoined):
            p.join(120)
            assert p.exitcode == 0, f"a learner process failed (exit code {p.exitcode})"
        ended = {r["name"]: r for r in (out.get(timeout=10) for _ in range(3))}
        assert sorted(ended) == ["a", "b", "c"]
        s.wait_for(
            "every learner gone", lambda st: not any(r.status is LearnerStatus.LIVE for r in st.learners.values())
        )

        assert s.read(lambda st: st.merges) >= merges_at_kill + 8  # on without c: two rounds of each fragment
        assert ended["c"]["learner"] != doomed_id and ended["c"]["applied"] > 0  # rejoined, under a new id
        s.read(lambda st: st.ledger.check())  # every token reported has one fate, or is open
        lost, fates = s.read(
            lambda st: (st.ledger.totals["lost"], {n: st.ledger.of_learner(r["learner"]) for n, r in ended.items()})
        )
        for name, mine in fates.items():
            assert ended[name]["steps"] > 0 and mine["merged"] + mine["merged_late"] > 0, (name, mine)
        # Nothing lost but what c trained after its last push (booked when it was found gone): the
        # learners that left with their parameters pushed it all, merged on time or late.
        assert lost_before == 0 and lost == lost_at_kill, (lost_before, lost_at_kill, lost, fates)
    finally:
        for p in (*others, doomed, rejoined):
            if p.is_alive():
                p.kill()
            if p.pid is not None:
                p.join(30)
