"""The demo's quick path: real syncer and learner processes, a learner killed and restarted, the
syncer killed and restarted from its checkpoint, the report, its JSON and its plot."""

import json
import math

import pytest

from ddiloco.cli import main as cli_main
from ddiloco.demo.chaos_monkey import chaos_plan
from ddiloco.demo.config import DemoConfig
from ddiloco.demo.plot import write_plot
from ddiloco.demo.report import report_json, report_text
from ddiloco.demo.supervisor import run_demo
from ddiloco.net import snapshot as snapshots


def test_quick_demo_survives_kills_of_a_learner_and_the_syncer_and_replays_in_full(tmp_path, jax_cache_dir):
    # Slowed down: at full speed these tiny learners would train their whole step cap while the
    # syncer restarts, and end before the learner's kill comes due (at 0.4 of full speed it
    # happened in 2 of 7 runs once no call of the hook waited for its background thread).
    cfg = DemoConfig(
        learners=2,
        steps=60,
        batch=4,
        kills=1,
        pauses=0,
        restart_delay_s=1.0,
        seed=1,
        speeds=(0.25, 0.25),
        kill_syncer=True,
        checkpoint_every_s=0.5,
        choice_items=32,
        record=tmp_path / "rec",
        cache_dir=jax_cache_dir,
    )
    report = run_demo(cfg, tmp_path, out=open(tmp_path / "live.txt", "w"))
    assert report.kills == 1 and report.recoveries == 1  # the killed learner was started again
    assert report.syncer_kills == 1
    whats = [e["what"] for e in report.events]
    assert whats.index("kill-syncer") < whats.index("restart-syncer")  # restarted with --resume
    assert "resumed from" in (tmp_path / "syncer.2.log").read_text()
    r = report.syncer_restart  # the takeover step by step, from the standby's log
    keys = ("killed_at", "took_over_at", "up_at", "listening_at", "first_join_at", "first_merge_at")
    steps = [r[k] for k in keys]
    assert None not in steps and steps == sorted(steps) and r["restarted_at"] == r["killed_at"]
    assert r["listening_at"] <= r["warmed_up_at"]
    assert r["outage_s"] == round(r["first_merge_at"] - r["killed_at"], 3)
    assert report.syncer_outage_s == round(r["outage_s"], 2)  # to the log's millisecond, not to the poll
    assert report.merges > 0 and math.isfinite(report.eval_loss) and math.isfinite(report.baseline_eval_loss)
    assert 0 <= report.choice_accuracy <= 1 and 0 <= report.baseline_choice_accuracy <= 1
    ledger = report.ledger
    assert ledger["reported"] == sum(
        ledger[k] for k in ("merged", "merged_late", "late", "stale", "rejected", "lost", "open")
    )
    assert 0 < report.uptime <= 1 and 0 < report.goodput <= 1
    data = json.loads(json.dumps(report_json(report)))
    for key in (
        "eval_loss",
        "baseline_eval_loss",
        "choice_accuracy",
        "baseline_choice_accuracy",
        "uptime",
        "goodput",
        "kills",
        "recoveries",
        "merges",
        "ledger",
    ):
        assert key in data
    assert data["curves"]["baseline"] and all(e["tokens"] >= 0 for e in data["events"])
    text = report_text(report)
    assert "merged model" in text and "a standby took over" in text and "standby takes over" in text
    assert "kernel warm-up" in text
    assert f"1 learner kill, 1 restart, {len(report.catch_up)} caught up before the end" in text
    live = (tmp_path / "live.txt").read_text()
    assert "chaos: kill learner" in live and "chaos: kill the syncer" in live
    assert "chaos: the standby syncer takes over" in live
    write_plot(report, tmp_path / "plot" / "loss.png")
    assert (tmp_path / "plot" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The recording: both syncer starts and every learner that trained, re-executed in one process.
    assert (tmp_path / "rec" / "syncer").is_dir() and (tmp_path / "rec" / "syncer.2").is_dir()
    assert cli_main(["replay", str(tmp_path / "rec"), "--full", "--json", str(tmp_path / "replay.json")]) == 0
    replayed = json.loads((tmp_path / "replay.json").read_text())
    assert replayed["ok"] and replayed["full"] and replayed["syncers"]["syncer.2"]["final_checked"]
    assert len(replayed["learners"]) >= 2 and replayed["updates_checked"] > 0


def test_a_demo_restarts_from_a_snapshot_of_another_run(tmp_path, jax_cache_dir):
    # Long enough for several snapshots while both learners train (they do ~25 steps/s here).
    first = DemoConfig(
        learners=2,
        steps=160,
        batch=4,
        chaos=False,
        baseline=False,
        snapshot_every_s=0.5,
        checkpoint_every_s=0.5,
        choice_items=16,
        cache_dir=jax_cache_dir,
    )
    run_demo(first, tmp_path / "first", out=open(tmp_path / "first.txt", "w"))
    taken = sorted(
        p
        for p in (tmp_path / "first" / "snapshots").glob("snap-*")
        if len(snapshots.read(p)["learners"]) == 2 and snapshots.read(p)["global_step"] > 0
    )
    assert taken, "a snapshot with both learners in it"
    manifest = snapshots.read(taken[0])

    again = DemoConfig(
        learners=2,
        steps=manifest["global_step"] + 40,
        batch=4,
        chaos=False,
        baseline=False,
        restore=taken[0],
        choice_items=16,
        cache_dir=jax_cache_dir,
    )
    report = run_demo(again, tmp_path / "again", out=open(tmp_path / "again.txt", "w"))

    syncer_log = (tmp_path / "again" / "syncer.log").read_text()
    assert f"resumed from {manifest['syncer']}" in syncer_log and f"global step {manifest['global_step']}" in syncer_log
    for i in range(2):  # each learner went on from its own local state at the cut
        assert "from a snapshot's local state" in (tmp_path / "again" / f"learner{i}.log").read_text()
    assert report.merges > manifest["merges"] and math.isfinite(report.eval_loss)


def test_chaos_plan_is_seeded_by_step_and_the_syncer_kill_leaves_the_rest_alone():
    import numpy as np

    cfg = DemoConfig(steps=400, kills=3, pauses=2)
    plan = chaos_plan(cfg, np.random.default_rng(7))
    assert plan == chaos_plan(cfg, np.random.default_rng(7))
    assert [a for _, a, _ in plan].count("kill") == 3 and all(0 < s < 400 for s, _, _ in plan)
    with_syncer = chaos_plan(DemoConfig(steps=400, kills=3, pauses=2, kill_syncer=True), np.random.default_rng(7))
    assert [p for p in with_syncer if p[1] != "kill-syncer"] == plan


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"speeds": (1.0,)}, "speeds"),
        ({"speeds": (1.0, 1.5)}, "speed"),
        ({"kills": -1}, "non-negative"),
        ({"model": "big"}, "dense or moe"),
        ({"checkpoint_every_s": 0}, "checkpoint"),
    ],
)
def test_bad_demo_configs(bad, match):
    with pytest.raises(ValueError, match=match):
        DemoConfig(learners=2, **bad)


def test_live_views_show_learner_state_step_tokens_loss_and_versions(tmp_path):
    import io

    from ddiloco.demo.live_view import PlainView, RichView, make_view
    from ddiloco.demo.supervisor import LearnerProcess, LossLog, SyncerProcess

    log = tmp_path / "learner0.jsonl"
    log.write_text(
        '{"step": 5, "loss": 3.25}\n{"step": 10, "loss": 2.5}\n{"step": 1'
    )  # the last line still being written
    logs = [LossLog(log), LossLog(tmp_path / "missing.jsonl")]
    for entry in logs:
        entry.read()
    assert logs[0].points == [(5, 3.25), (10, 2.5)] and logs[1].points == []
    status = {
        "global_step": 10,
        "merges": 3,
        "fragments": [{"version": 2}, {"version": 1}],
        "learners": [{"id": 1, "name": "learner-0", "status": "live", "step": 10, "versions": [2, 1]}],
        "decisions": [{"reason": "merged 1/2 (quorum 1) after 0 ms of grace"}],
    }
    learners, cfg = [LearnerProcess(0), LearnerProcess(1, killed_at=1.0)], DemoConfig(learners=2)
    syncer = SyncerProcess(proc=None, log=tmp_path / "syncer.log")
    assert isinstance(make_view(io.StringIO()), PlainView)  # not a terminal: plain lines
    plain = io.StringIO()
    PlainView(plain).update(12.0, status, learners, logs, cfg, syncer)
    assert "merges    3 v[2,1] L0:live@10 L1:killed@-" in plain.getvalue()
    screen = io.StringIO()
    view = RichView(screen)
    view.update(12.0, status, learners, logs, cfg, syncer)
    view.close()
    text = screen.getvalue()
    for cell in ("learner", "live", "killed", "2.500", "5,120", "2,1", "merged 1/2"):
        assert cell in text, cell


def test_restart_timeline_reads_each_step_from_the_restarted_syncers_log():
    from datetime import datetime

    from ddiloco.demo.supervisor import restart_timeline

    wall_started = datetime(2030, 1, 2, 3, 4, 0).timestamp()  # the demo's second 0, on the wall clock

    def line(second: float, text: str) -> str:
        stamp = datetime.fromtimestamp(wall_started + second).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
        return f"{stamp} INFO ddiloco.syncer: {text}"

    log = "\n".join(
        [
            line(10.5, 'config {"port": 1}'),
            line(10.6, "resumed from ckpt-x: 8 merges, global step 22"),
            line(11.0, "syncer listening on 127.0.0.1:1"),
            line(11.2, "learner 5 (learner-2) joined as recovering"),
            line(11.9, "kernels warmed up in 0.90 s"),
            line(12.0, "learner 6 (learner-3) joined as recovering"),
            "a line without a stamp: merged nothing",
            line(12.25, "fragment 3 round 4: merged 1/1 (quorum 1) after 0 ms of grace"),
            line(13.0, "fragment 0 round 4: merged 2/2 (quorum 1) after 0 ms of grace"),
        ]
    )
    t = restart_timeline(log, wall_started, killed_at=10.0, restarted_at=10.1)
    assert (t["up_at"], t["listening_at"], t["warmed_up_at"], t["first_join_at"], t["first_merge_at"]) == (
        10.5,
        11.0,
        11.9,
        11.2,
        12.25,
    )
    assert t["restart_delay_s"] == 0.1 and t["start_and_imports_s"] == 0.4 and t["resume_and_listen_s"] == 0.5
    assert t["warmup_s"] == 0.9 and t["rejoin_s"] == 0.2 and t["first_round_s"] == 1.05 and t["outage_s"] == 2.25
    assert restart_timeline("", wall_started, 10.0, 10.1)["outage_s"] is None  # a syncer that never came back
