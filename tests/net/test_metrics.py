"""/metrics of the real daemon with real clients, parsed by prometheus_client's own parser; the
Grafana dashboard's expressions checked against what it exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from ddiloco.core.syncer import LearnerStatus

from .test_daemon import TOKEN, Learner, Syncer, train, two_learners, until

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "ddiloco.json"
OPERATIONS = ROOT / "docs" / "operations.md"
ODD_NAME = 'odd "name" \\ with {braces}=,'  # characters a label value must escape (the wire refuses a newline)


def quiet(server) -> bool:
    """Nothing will change the state until a learner sends again: nothing queued for the core, and
    no round waits on its grace timer (a round without quorum waits for pushes, which nobody sends)."""
    state = server.state
    return server.core.empty() and all(f.open is None or f.open.quorum_at is None for f in state.fragments)


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, name: str, **labels) -> float:
    family = fams[name]
    found = [
        s.value
        for s in family.samples
        if all(s.labels.get(k) == v for k, v in labels.items()) and s.name in (name, f"{name}_total")
    ]
    assert len(found) == 1, (name, labels, family.samples)
    return found[0]


async def test_metrics_are_typed_named_and_agree_with_the_daemon(tmp_path):
    s = Syncer(tmp_path)
    await s.start()
    a, b = await two_learners(s)
    odd = Learner(s.ws_url, ODD_NAME, seed=3)
    await odd.welcome()
    await until(lambda: len(odd.client.inbox.updates) == 2, what="the third learner's recovery updates")
    await train(s.server, [a, b, odd], 12)
    await until(lambda: s.server.state.merges >= 4, what="merges")
    await until(lambda: quiet(s.server), what="a quiet syncer")
    async with aiohttp.ClientSession() as http:
        answer = await http.post(f"{s.http}/checkpoint", headers={"Authorization": f"Bearer {TOKEN}"})
        assert answer.status == 200, await answer.text()
        response = await http.get(f"{s.http}/metrics")
        text = await response.text()
        assert response.headers["Content-Type"].startswith("text/plain; version=")
    view = s.server.view
    fams = families(text)

    # Conventions: HELP and TYPE on every family, counters end in _total, base units in the names.
    ours = {n: f for n, f in fams.items() if n.startswith("ddiloco_")}
    assert len(ours) >= 30
    for name, f in ours.items():
        assert f.type in ("counter", "gauge", "histogram"), (name, f.type)
        assert f.documentation, name
        if f.type == "counter":
            assert all(sm.name == f"{name}_total" for sm in f.samples), (name, f.samples)
        assert not re.search(r"_(ms|millis|bytes_in|bytes_out)(_|$)", name), name
    assert {"process_cpu_seconds", "process_resident_memory_bytes", "python_info"} <= set(fams)

    # The daemon's own numbers.
    merges = value(fams, "ddiloco_merges")
    assert merges == view.merges == s.server.metrics.merges >= 4
    assert sum(sm.value for sm in fams["ddiloco_fragment_version"].samples) == merges  # one version per merge
    count = next(sm.value for sm in fams["ddiloco_round_seconds"].samples if sm.name == "ddiloco_round_seconds_count")
    assert count == merges
    assert value(fams, "ddiloco_received_bytes") > 0 and value(fams, "ddiloco_sent_bytes") > 0
    assert value(fams, "ddiloco_learners", status="live") == 3
    assert value(fams, "ddiloco_learners_max") == s.config.learners_max

    # The ledger: every reported token has one fate or is still open; per learner it adds up too.
    fates = {sm.labels["fate"]: sm.value for sm in fams["ddiloco_tokens"].samples}
    assert set(fates) == {"merged", "merged_late", "late", "stale", "rejected", "lost"} and fates["merged"] > 0
    assert sum(fates.values()) + value(fams, "ddiloco_tokens_open") == value(fams, "ddiloco_tokens_reported")
    assert fams["ddiloco_tokens_open"].type == "gauge"
    for fate in ("merged", "late"):
        per_learner = [sm.value for sm in fams["ddiloco_learner_tokens"].samples if sm.labels["fate"] == fate]
        assert len(per_learner) == 3 and sum(per_learner) == fates[fate], fate

    # Per learner: one series each (the odd name exactly as given), step and versions as the core has them.
    info = {sm.labels["learner"]: sm.labels for sm in fams["ddiloco_learner_info"].samples}
    assert {labels["name"] for labels in info.values()} == {"a", "b", ODD_NAME}
    for lv in view.learners:
        assert lv.status is LearnerStatus.LIVE
        assert value(fams, "ddiloco_learner_step", learner=str(lv.id)) == lv.step
        assert value(fams, "ddiloco_learner_versions_behind", learner=str(lv.id)) == lv.versions_behind
        for p, held in enumerate(lv.versions):
            assert value(fams, "ddiloco_learner_held_version", learner=str(lv.id), fragment=str(p)) == held
        assert 0 <= value(fams, "ddiloco_learner_last_seen_age_seconds", learner=str(lv.id)) < 60

    # Per fragment: the last merged round's size and grace.
    for p, f in enumerate(view.fragments):
        assert value(fams, "ddiloco_fragment_version", fragment=str(p)) == f.version
        if f.version:
            assert 1 <= value(fams, "ddiloco_fragment_last_round_learners", fragment=str(p)) <= 3
            assert value(fams, "ddiloco_fragment_last_round_grace_seconds", fragment=str(p)) >= 0
            assert 0 <= value(fams, "ddiloco_fragment_last_merge_age_seconds", fragment=str(p)) < 60

    # Checkpoints: the one asked for above, none failed.
    assert value(fams, "ddiloco_checkpoints_written") >= 1
    assert value(fams, "ddiloco_checkpoint_failures") == 0
    assert value(fams, "ddiloco_checkpoint_failures_since_written") == 0
    assert 0 <= value(fams, "ddiloco_checkpoint_age_seconds") < 60

    # A second daemon in the same process has a registry of its own.
    second = Syncer(tmp_path / "second")
    await second.start()
    async with aiohttp.ClientSession() as http:
        fams2 = families(await (await http.get(f"{second.http}/metrics")).text())
    assert value(fams2, "ddiloco_merges") == 0 and not fams2["ddiloco_learner_info"].samples
    await second.server.stop()

    # The dashboard asks only for what /metrics has.
    # (a labelled family without samples yet, refusals say, is still there with its HELP and TYPE)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",), "info": ("_info",)}
    exposed = {f.name + end for f in fams.values() for end in suffixes.get(f.type, ("",))}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert len(exprs) >= 10
    for expr in exprs:
        names = set(re.findall(r"\b((?:ddiloco|process)_[a-z_]+)\b", expr))
        assert names, expr
        assert names <= exposed, (expr, names - exposed)

    # docs/operations.md lists every family.
    documented = set(re.findall(r"`(ddiloco_[a-z_]+)`", OPERATIONS.read_text()))
    for name, f in ours.items():
        assert (f"{name}_total" if f.type == "counter" else name) in documented, name

    for lr in (a, b, odd):
        await lr.stop()
    await s.server.stop()
