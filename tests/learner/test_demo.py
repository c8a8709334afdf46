"""The demo's quick path: real syncer and learner processes, one learner killed and restarted."""

import math

from ddiloco.learner.demo import DemoConfig, report_json, report_text, run_demo


def test_quick_demo_survives_a_kill_and_reports(tmp_path):
    cfg = DemoConfig(learners=2, steps=60, batch=4, kills=1, pauses=1, restart_delay_s=1.0, pause_s=1.0, seed=1)
    report = run_demo(cfg, tmp_path, out=open(tmp_path / "live.txt", "w"))
    assert report.kills == 1 and report.recoveries == 1  # the killed learner was started again and finished
    assert report.merges > 0 and math.isfinite(report.eval_loss) and math.isfinite(report.baseline_eval_loss)
    ledger = report.ledger
    assert ledger["reported"] == sum(ledger[k] for k in ("merged", "late", "stale", "rejected", "lost", "open"))
    assert 0 < report.uptime <= 1 and 0 < report.goodput <= 1
    data = report_json(report)
    for key in ("eval_loss", "baseline_eval_loss", "uptime", "goodput", "kills", "recoveries", "merges", "ledger"):
        assert key in data
    assert "merged model" in report_text(report)
    assert "chaos: kill" in (tmp_path / "live.txt").read_text()
