"""The fuzz harness against the real daemon: a bounded run finds no core death, and a core that
dies is caught, counted and reported (by `ddiloco fuzz`'s exit status too)."""

from __future__ import annotations

import json

from ddiloco.cli import main
from ddiloco.core import syncer
from ddiloco.core.events import Join
from ddiloco.net import fuzz

FAMILIES = {
    "valid",
    "field",
    "clock",
    "tensors",
    "structure",
    "payload",
    "bitflip",
    "header",
    "truncate",
    "truncate+crc",
    "sequence",
    "oversized",
    "counters",
} | set(fuzz.LANE_MUTATIONS)  # a laned hostile session's frame data on its lane, as announced and out of step


def test_a_bounded_fuzz_run_leaves_the_daemon_alive_and_merging():
    report = fuzz.run(fuzz.FuzzConfig(seconds=25, seed=0, batch_frames=100))
    assert report.ok, "\n".join(report.lines())
    assert report.core_deaths == 0 and report.checks_passed == report.batches >= 3
    assert report.frames_sent > 1000 and report.errors_answered > 100 and report.merges > report.batches
    assert set(report.mutations) == FAMILIES
    assert {"bad_message", "unexpected_kind", "bad_frame", "checksum", "oversized"} <= set(report.error_codes)


def test_a_core_that_dies_is_counted_and_fails_the_run(monkeypatch, capsys, tmp_path):
    handle = syncer.handle

    def dies_on_a_hostile_hello(state, event, now):
        if isinstance(event, Join) and event.name.startswith("hostile"):
            raise AssertionError("an injected core bug")
        return handle(state, event, now)

    monkeypatch.setattr(syncer, "handle", dies_on_a_hostile_hello)
    written = tmp_path / "fuzz.json"
    # Bounded by frames, not seconds: a loaded machine may spend seconds before the first hostile hello.
    # One frame: the run ends after its first batch, the one whose hostile hello kills the core (each
    # further batch would start a fresh daemon only to kill it again: 150 s at 300 frames under load).
    argv = ["fuzz", "--seconds", "300", "--frames", "1", "--seed", "1", "--batch", "20", "--json", str(written)]
    assert main(argv) == 1
    out = capsys.readouterr().out
    doc = json.loads(written.read_text())
    assert doc["ok"] is False and doc["core_deaths"] >= 1 and doc["seed"] == 1
    # a core that failed stops the daemon (net.server): it answers 503, or no longer listens
    assert "core deaths: 0" not in out
    assert (
        "FAILED: batch 1: core died: /healthz answers 503" in out
        or "FAILED: batch 1: the daemon refuses new sessions (503)" in out
        or "FAILED: batch 1: the daemon stopped listening" in out
    )
    assert "an injected core bug" in out  # the daemon's own record of why its core died, in the report
    assert out.rstrip().endswith("FAILED")
