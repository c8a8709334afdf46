"""The in-process experiment runner: deterministic by seed, the same merges as the real daemon, faults
and late joiners handled by the real core, and `ddiloco experiment` end to end at a tiny size."""

import json
import math
import re
import time
from dataclasses import replace

import numpy as np
import pytest

from ddiloco.cli import main
from ddiloco.core import syncer
from ddiloco.core.config import SyncerConfig
from ddiloco.core.events import Push
from ddiloco.core.grace import GraceConfig
from ddiloco.experiments import catalog as experiments
from ddiloco.experiments import runner as ex
from ddiloco.experiments.catalog import outage_schedule
from ddiloco.learner.sync import DilocoSync, SyncConfig
from ddiloco.reference import model as reference

TINY = reference.ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, seq=32)  # seq >= 28: the choice eval
TOKEN = "experiment-test-token-0123456789"


@pytest.fixture(autouse=True, scope="module")
def _cache():
    reference.enable_compilation_cache()


def config(seed=0, learners=2, steps=16, **kw):
    kw.setdefault("syncer", SyncerConfig(num_fragments=2, period=4))
    kw.setdefault("inner_steps", 21)  # one compiled step for every test run
    specs = kw.pop("specs", (ex.LearnerSpec(),) * learners)
    return ex.RunConfig(
        learners=tuple(specs), model=TINY, batch=2, budget_tokens=learners * 2 * TINY.seq * steps, seed=seed, **kw
    )


def test_a_run_is_deterministic_by_seed():
    cfg = config(seed=3, learners=3, step_noise=0.2)
    a, b = ex.run(cfg), ex.run(cfg)
    assert a.merges > 0
    assert a.state_hash == b.state_hash and a.merge_log == b.merge_log and a.eval_loss == b.eval_loss
    other = ex.run(config(seed=4, learners=3, step_noise=0.2))
    assert other.state_hash != a.state_hash
    assert a.ledger["reported"] == sum(
        a.ledger[k] for k in ("merged", "merged_late", "late", "stale", "rejected", "lost", "open")
    )


class _Recorded:
    """Wraps a real client: remembers the (learner, fragment, step) of every push it hands over.

    It offers no `sender`: each push goes out at the hook's call, as the runner's transport sends it.
    Sent from the hook's background thread whenever its bytes exist, a push would reach the daemon
    before or after the learners' next reports by timing, and this test needs one event order."""

    sender = None

    def __init__(self, client):
        self.client, self.pushed = client, set()

    def push(self, item):
        self.pushed.add((item.learner, item.fragment, item.step))
        return self.client.push(item)

    def __getattr__(self, name):
        return getattr(self.client, name)


def _settled(state, syncs, step, seen) -> bool:
    """Everything up to `step` has happened in the daemon: progress seen, the rounds due opened,
    every push handed to the core (`seen`: its pushes, as the core took them) and every merged
    version delivered. Read across threads, so each check is one the core makes true last (a torn
    read means 'not yet')."""
    try:
        decided = {(d.fragment, d.round) for d in list(state.decisions)}
        if state.global_step != step:
            return False
        for p, frag in enumerate(state.fragments):
            due = sum(1 for t in range(1, step + 1) if state.schedule.due(t).count(p))
            rnd = frag.open
            if frag.rounds_opened != due or (due and (p, due) not in decided and (rnd is None or rnd.number != due)):
                return False
        for s in syncs:
            rec = state.learners.get(s.learner_id)
            if rec is None or rec.step != s.step_count:
                return False
            box = s.client.client.client.inbox
            updates = dict(box.updates)
            if not set(s.client.pushed) <= set(seen):
                return False
            for p, frag in enumerate(state.fragments):
                if max(s.versions[p], updates[p][-1].version if updates.get(p) else -1) != frag.version:
                    return False
        return True
    except (RuntimeError, KeyError, AttributeError):
        return False


def _wait_settled(state, syncs, step, seen, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not _settled(state, syncs, step, seen):
        assert time.monotonic() < deadline, "the daemon did not settle"
        time.sleep(0.002)


def test_runner_and_daemon_give_the_same_merges(threaded_syncer):
    """Lockstep learners and K = M (a round closes when all delivered) force one event order; the
    runner and the real daemon with real clients must then reach the same syncer state bit for bit."""
    steps, m = 16, 2
    cfg = config(
        learners=m, steps=steps, syncer=SyncerConfig(num_fragments=2, period=4, quorum=m, grace=GraceConfig(overlap=2))
    )
    ours = ex.run(cfg, settle=True)
    assert ours.merges >= 4

    daemon = threaded_syncer(cfg.syncer, token=TOKEN)
    syncs, seen = [], set()
    observed = daemon.server.shell.observe

    def observe(event, effects, state, now):  # on the core's thread: the pushes as the core took them
        if isinstance(event, Push):
            seen.add((event.learner, event.fragment, event.step))
        if observed is not None:
            observed(event, effects, state, now)

    daemon.server.shell.observe = observe
    try:
        tx, train_step, _ = ex.programs(TINY, cfg.schedule_steps())
        learners = []
        for i in range(m):
            params = ex.initial_params(TINY, cfg.seed)
            # every step's report, as the runner's learners send them (lockstep needs each one), of
            # the step dispatched, as on the runner's virtual clock
            sync = DilocoSync.connect(
                params,
                SyncConfig(
                    url=daemon.url,
                    name=f"learner-{i}",
                    token=TOKEN,
                    codec=cfg.codec,
                    progress_interval_s=0.0,
                    report_computed=False,
                ),
            )
            sync.client = _Recorded(sync.client)
            syncs.append(sync)
            learners.append([params, tx.init(params), ex.learner_stream(TINY, cfg.batch, cfg.seed, i, m), sync])
        _wait_settled(daemon.server.state, syncs, 0, seen)
        for step in range(1, steps + 1):
            for lr in learners:
                x, y = next(lr[2])
                lr[0], lr[1], _ = train_step(lr[0], lr[1], x, y)
                lr[0] = lr[3].step(lr[0], tokens=cfg.tokens_per_step)
            _wait_settled(daemon.server.state, syncs, step, seen)
        state = daemon.server.state
        merged = [(d.fragment, d.version) for d in state.decisions if d.outcome == "merged"]
        assert merged == [(f, v) for f, v, _ in ours.merge_log]
        assert syncer.state_hash(state) == ours.state_hash
    finally:
        for s in syncs:
            s.close()
        daemon.stop()


def test_outages_and_a_late_joiner_are_handled_by_the_core():
    m, steps = 3, 24
    specs = [
        ex.LearnerSpec(),
        ex.LearnerSpec(outages=((6.0, 12.0),)),
        ex.LearnerSpec(join_s=8.0),
    ]
    r = ex.run(config(learners=m, steps=steps, specs=specs))
    contributors = {x for _, _, learners in r.merge_log for x in learners}
    # learner 2 rejoined after its outage under a new id (4), the late joiner is learner 3
    assert {1, 3, 4} <= contributors
    assert r.goodput < 1.0  # the outage and the late join cost allocated time
    assert r.ledger["lost"] > 0 or r.ledger["late"] > 0 or r.ledger["stale"] > 0


def test_outage_schedule_has_the_asked_share():
    spans = outage_schedule(seed=1, learner=0, share=0.25, outage_s=4.0, horizon_s=160.0)
    assert all(b - a == 4.0 for a, b in spans)
    assert len(spans) * 4.0 / (len(spans) * 16.0) == 0.25
    assert spans == outage_schedule(seed=1, learner=0, share=0.25, outage_s=4.0, horizon_s=160.0)
    with pytest.raises(ValueError, match="down share"):
        outage_schedule(seed=1, learner=0, share=1.5, outage_s=4.0, horizon_s=10.0)


def test_bad_configuration_is_a_clear_error():
    with pytest.raises(ValueError, match="learners"):
        config(learners=0, specs=())
    with pytest.raises(ValueError, match="speed"):
        ex.LearnerSpec(speed=0)
    with pytest.raises(ValueError, match="outages"):
        ex.LearnerSpec(outages=((5.0, 3.0),))
    with pytest.raises(ValueError, match="codec"):
        config(codec="int3")
    with pytest.raises(ValueError, match="target loss"):
        config(target_loss=1.0)
    with pytest.raises(ValueError, match="alpha"):
        config(alpha=1.0)


def test_alpha_reaches_the_learners():
    """A mix of the learner's own fragment into the merged one changes what the learners push."""
    plain, mixed = ex.run(config()), ex.run(config(alpha=0.5))
    assert plain.merges == mixed.merges > 0
    assert plain.state_hash != mixed.state_hash


def test_inner_lr_reaches_the_learners_and_is_checked():
    base, faster = ex.run(config()), ex.run(config(inner_lr=2 * reference.TrainConfig.lr))
    assert base.merges == faster.merges > 0 and base.state_hash != faster.state_hash
    with pytest.raises(ValueError, match="inner_lr must be a positive number"):
        config(inner_lr=float("nan"))


def test_demo_settings_default_size_is_the_demos_training():
    """The experiment claims to be the demo's run: its model, batch, learners, steps, H and tau."""
    import argparse

    from ddiloco.cli import demo as demo_cli
    from ddiloco.demo.config import model_config

    parser = argparse.ArgumentParser()
    demo_cli.add_arguments(parser)
    cfg = demo_cli.config_from_args(parser.parse_args([]))
    from ddiloco.demo.config import DemoConfig

    assert cfg == DemoConfig()  # `ddiloco demo` and the Python API's default are one demo
    size = experiments.DEFAULT
    setting = size.demo_setting()
    assert (setting.model, setting.steps, setting.period, setting.overlap) == (
        model_config(cfg),
        cfg.steps,
        cfg.period,
        cfg.overlap,
    )
    assert (size.batch, size.m, size.fragments) == (cfg.batch, cfg.learners, cfg.fragments)
    assert (cfg.outer_lr, cfg.outer_momentum, cfg.quorum) == (1.0, 0.0, 1)
    assert experiments.EXPERIMENTS["demo-settings"].model_and_steps(size) == (
        model_config(cfg),
        cfg.steps,
    )  # what the page names
    # a budget given overrides the steps, as for the other experiments
    assert replace(size, budget_tokens=4 * 8 * 64 * 10).demo_setting().steps == 10


def test_experiment_command_end_to_end(tmp_path, capsys):
    out = tmp_path / "r.json"
    page = tmp_path / "docs" / "results.md"
    argv = ["experiment", "fragments", "--quick", "--budget-tokens", "3072", "--json", str(out), "--results", str(page)]
    assert main(argv) == 0
    first = json.loads(out.read_text())
    [result] = first
    assert result["seeds"] == [0, 1, 2] and set(result["arms"]) == {"layer", "tensor", "balanced"}
    for stats in result["arms"].values():
        assert len(stats["eval_loss"]["values"]) == 3 and stats["bytes_peak"]["mean"] > 0
        accuracy = stats["choice_accuracy"]["mean"]
        assert accuracy is None or 0 <= accuracy <= 1
    text = page.read_text()
    assert "| balanced |" in text and "quick size" in text and "results/fragments.png" in text
    assert (tmp_path / "docs" / "results" / "fragments.png").stat().st_size > 1000
    # the page again from the saved results, running nothing
    again = tmp_path / "again" / "results.md"
    assert main(["experiment", "fragments", "--from-json", str(out), "--results", str(again)]) == 0
    assert again.read_text() == text


def test_experiment_command_refuses_bad_input(capsys):
    assert main(["experiment", "merge", "--quick", "--seeds", "2"]) == 2
    assert "--seeds must lie in [3, 100], got 2" in capsys.readouterr().err
    assert main(["experiment", "all", "--quick", "--plot", "x.png"]) == 2
    assert "--plot draws one experiment" in capsys.readouterr().err
    assert main(["experiment", "all", "--from-json", "no-such-results.json"]) == 2
    assert "cannot read results from no-such-results.json" in capsys.readouterr().err


def _per_seed(arms: dict, label: str, metric: str) -> list:
    return arms[label][metric]["values"]


def _dp_vs_decoupled_order(arms: dict, steps: int) -> None:
    # data-parallel has nothing to wait for and nothing to lose here: every step is useful
    assert _per_seed(arms, "dense DP, M = 2", "goodput") == [1.0] * 3
    assert _per_seed(arms, "dense DP, M = 2", "wall_s") == [float(steps)] * 3


def _failures_order(arms: dict, steps: int) -> None:
    dp, free, down = "DP, M = 4 slices, same failures", "Decoupled, M = 4, fault-free", "Decoupled, M = 4, down 25%"
    # the synchronous job advances one step per second of wall time in which no slice is down
    for goodput, wall in zip(_per_seed(arms, dp, "goodput"), _per_seed(arms, dp, "wall_s"), strict=True):
        assert goodput == pytest.approx(steps / wall)
    # K = 1 without faults: nobody waits, nothing is lost (what a learner trains while its push is on its
    # way is carried over the merge, docs/algorithm.md "Progress carried over a merge")
    assert _per_seed(arms, free, "goodput") == [1.0] * 3
    # a synchronous job stalls while any slice is down; a decoupled one loses only the down learner's time
    pairs = zip(_per_seed(arms, dp, "goodput"), _per_seed(arms, down, "goodput"), strict=True)
    assert all(dp_goodput <= decoupled_goodput for dp_goodput, decoupled_goodput in pairs)


def _merge_order(arms: dict, steps: int) -> None:
    # the merge rule changes what a round merges, not when rounds happen
    for m in (4, 8):
        assert _per_seed(arms, f"mean, M = {m}", "merges") == _per_seed(arms, f"rda, M = {m}", "merges")


def _broadcast_order(arms: dict, steps: int) -> None:
    # an arm for each codec the syncer accepts, int4 deltas among them, and the codec reaches the
    # learners: a lossy delta rounds the copy they train from, so the run differs from the fp32 one.
    # (Only from a fragment's second merge on: version 0 is published exactly. The test runs this one
    # 16 steps so that fragments merge again; still not necessarily in every seed.)
    assert list(arms) == [f"broadcast {c}" for c in experiments.broadcast_codecs()]
    assert set(arms) == {"broadcast fp32", "broadcast bf16", "broadcast int4"}
    fp32 = _per_seed(arms, "broadcast fp32", "eval_loss")
    for lossy in ("bf16", "int4"):
        other = _per_seed(arms, f"broadcast {lossy}", "eval_loss")
        assert any(a != b for a, b in zip(fp32, other, strict=True)), (lossy, fp32, other)


def _hetero_order(arms: dict, steps: int) -> None:
    # K = M: a merge needs every learner, so exactly half of each merge comes from the slow half
    assert _per_seed(arms, "K = M = 4", "slow_share") == [0.5] * 3
    # Without a grace window a push that arrives just after its round closed is carried into the next
    # round of its fragment, discounted (protocol 2), no longer wasted: the window costs no goodput
    with_grace, without = arms["K = 1, grace"]["goodput"]["mean"], arms["K = 1, no grace"]["goodput"]["mean"]
    assert with_grace >= without > 0.9


def _scavenge_order(arms: dict, steps: int) -> None:
    base = _per_seed(arms, "base", "time_to_target_s")
    assert _per_seed(arms, "base", "speedup") == [1.0] * 3
    assert all(0 < t <= w for t, w in zip(base, _per_seed(arms, "base", "wall_s"), strict=True))
    for label in arms:
        if label != "base":  # the time to the base run's loss, relative to the base run's (inf: never reached)
            times, speedups = _per_seed(arms, label, "time_to_target_s"), _per_seed(arms, label, "speedup")
            assert speedups == [t / b for t, b in zip(times, base, strict=True)]


def _demo_settings_order(arms: dict, steps: int) -> None:
    # half the period H: every fragment is synchronised twice as often
    shorter = _per_seed(arms, "plain averaging, H = 4", "merges")
    demo = _per_seed(arms, "plain averaging, H = 8 (the demo)", "merges")
    assert all(a > b for a, b in zip(shorter, demo, strict=True))
    assert _per_seed(arms, "DP, 2x tokens", "wall_s") == [2 * w for w in _per_seed(arms, "DP", "wall_s")]


def _demo_gap_order(arms: dict, steps: int) -> None:
    assert list(arms) == [
        "DP",
        "the demo (K = 1)",
        "K = 4: every push on time",
        "K = 4, overwrite (no progress carried)",
    ]
    # an overwrite books what a learner trained since its push as lost; carrying it over loses nothing
    kept = _per_seed(arms, "K = 4: every push on time", "goodput")
    overwritten = _per_seed(arms, "K = 4, overwrite (no progress carried)", "goodput")
    assert all(o <= k for o, k in zip(overwritten, kept, strict=True))


ORDERS = {
    "dp-vs-decoupled": _dp_vs_decoupled_order,
    "failures": _failures_order,
    "merge": _merge_order,
    "compression": lambda arms, steps: None,  # at 8 steps the codecs' losses are not yet apart
    "broadcast": _broadcast_order,
    "hetero": _hetero_order,
    "scavenge": _scavenge_order,
    "demo-settings": _demo_settings_order,
    "demo-gap": _demo_gap_order,
}


def _check_summary_and_ranges(result: dict) -> None:
    for label, stats in result["arms"].items():
        for metric, s in stats.items():
            values = s["values"]
            assert len(values) == 3, (label, metric)
            if any(v is None for v in values):
                assert s["mean"] is None and s["std"] is None, (label, metric)
                continue
            arr = np.asarray(values, dtype=float)
            if np.isfinite(arr).all():
                assert s["mean"] == pytest.approx(arr.mean()), (label, metric)
                assert s["std"] == pytest.approx(arr.std(ddof=1)), (label, metric)
            else:
                assert s["mean"] == math.inf, (label, metric)
        loss = stats["eval_loss"]["values"]
        assert all(0 < v < 6 for v in loss), (label, loss)  # nats per byte; uniform over 256 bytes is 5.55
        assert stats["bits_per_byte"]["values"] == pytest.approx([v / math.log(2) for v in loss])
        assert all(0 < g <= 1 for g in stats["goodput"]["values"]), label
        assert all(w > 0 for w in stats["wall_s"]["values"]), label
        accuracy = stats["choice_accuracy"]["values"]
        assert all(a is None or 0 <= a <= 1 for a in accuracy), label
        merges = stats["merges"]["values"]
        if re.search(r"\bDP\b", label):
            assert merges == [None] * 3, label  # data-parallel has no syncer
        else:
            assert all(m >= 1 and m == int(m) for m in merges), (label, merges)


@pytest.mark.parametrize("name", list(ORDERS))
def test_every_quick_experiment_runs_over_three_seeds(name):
    """At a tiny budget (8 steps per learner, 16 for broadcast): every arm over three seeds, its summary the mean and
    spread of its values, every value in range, the orderings the algorithm implies, and the whole
    result again for the same seeds."""
    # dp-vs-decoupled at dense M = 2 only: each M and each model is one more program to compile
    # (the MoE model itself is covered by test_model)
    # broadcast: 16 steps, so that fragments merge more than once (version 0 is published exactly)
    steps = 16 if name == "broadcast" else 8
    size = replace(experiments.QUICK, budget_tokens=4 * 4 * 32 * steps, ms=(2,), moe_ms=())
    result = experiments.run_experiment(experiments.EXPERIMENTS[name], size)
    assert result["seeds"] == [0, 1, 2] and result["size"] == "quick"
    assert set(result["arms"]) == {arm.label for arm in experiments.EXPERIMENTS[name].arms(size)}
    _check_summary_and_ranges(result)
    ORDERS[name](result["arms"], result["steps_per_learner"])
    assert result["verdict"]
    assert experiments.run_experiment(experiments.EXPERIMENTS[name], size) == result  # deterministic by seed
