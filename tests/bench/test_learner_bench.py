"""`ddiloco bench learner` on the synthetic loop at a tiny size: a real syncer process, the real hook."""

import json
import math

import pytest

from ddiloco.bench.learner import LearnerBenchConfig, format_report
from ddiloco.cli import main


def test_a_short_synthetic_run_writes_every_figure_in_its_range(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "learner", "--synthetic-step-ms", "2", "--params", "100000", "--steps", "480", "--rounds", "8"]
    assert main([*argv, "--json", str(out)]) == 0
    (r,) = json.loads(out.read_text())
    # the settings
    assert (r["loop"], r["params"], r["synthetic_step_ms"], r["fragments"], r["period"]) == (
        "synthetic",
        100000,
        2.0,
        4,
        24,
    )
    assert r["config"]["synthetic_wait"] == "sleep" and r["steps_each"] == 480
    # every hooked step is timed, as idle or busy, and the steps that pushed or applied are the busy ones
    assert r["idle_steps"] + r["busy_steps"] == 480
    assert r["pushes"] > 0 and r["busy_steps"] > 0 and r["merged_versions_applied"] > 0
    assert 0 < r["idle_step_hook_us"] and 0 < r["busy_step_hook_us"]
    # the same calls' CPU time on the training thread: never more than their wall time (the two
    # clocks are read one after the other, so allow them a few microseconds apart)
    for kind in ("idle", "busy"):
        assert 0 < r[f"{kind}_step_hook_cpu_us"] <= r[f"{kind}_step_hook_us"] + 20
    assert 0 <= r["merged_share"] <= 1
    assert r["ledger"]["merged"] > 0 and r["ledger"]["reported"] >= r["ledger"]["merged"]
    assert math.isfinite(r["overhead"]) and r["overhead"] > -1
    assert r["overhead_pct"] == pytest.approx(100 * r["overhead"])
    # this process's CPU by thread: every role, never negative, adding up to the process's own
    # figure within the clock ticks both are counted in (10 ms each, per block of 60 steps)
    for kind in ("hooked", "plain"):
        split = r[f"{kind}_cpu_by_thread_ms"]
        assert set(split) == {"training", "background", "network", "other"} and min(split.values()) >= 0
        assert sum(split.values()) == pytest.approx(r[f"{kind}_cpu_ms"], abs=8 * 5 * 10 / 60)
    # a synthetic step waits out its 2 ms whatever else it does
    assert r["plain_p50_ms"] >= 2.0 and r["hooked_p50_ms"] >= 2.0
    text = capsys.readouterr().out
    assert "synthetic: 100,000 parameters, 2 ms per step (sleep)" in text and "hook per call" in text
    assert "CPU by thread  with hook training" in text
    assert format_report(r) in text


@pytest.mark.parametrize("name, role", [("ddiloco-sync_0", "background"), ("ddiloco-lane-recv_0", "network")])
def test_thread_cpu_is_split_by_the_threads_role(name, role):
    # a thread named as the hook's background thread (or a lane's) burns CPU: its seconds land under its role
    import threading
    import time

    from ddiloco.bench import learner

    before, burnt, read = learner._threads_cpu_s(), threading.Event(), threading.Event()

    def burn():
        end = time.thread_time() + 0.2
        while time.thread_time() < end:
            pass
        burnt.set()
        read.wait(60)  # alive while its seconds are read: a thread that ended takes them with it

    worker = threading.Thread(target=burn, name=name)
    worker.start()
    assert burnt.wait(60)
    after = learner._threads_cpu_s()
    read.set()
    worker.join()
    assert after[role] - before[role] >= 0.15
    assert after["training"] - before["training"] < 0.1  # this thread waited


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"synthetic_step_ms": 0.0}, "synthetic_step_ms must lie in"),
        ({"params": 7}, "params must lie in"),
        ({"synthetic_wait": "nap"}, "sleep or spin"),
        ({"steps": 10, "rounds": 20}, "steps >= rounds"),
    ],
)
def test_bench_config_refuses_nonsense(fields, match):
    with pytest.raises(ValueError, match=match):
        LearnerBenchConfig(**fields)
