"""`ddiloco bench sync` at a small size: real learner processes around the real daemon, and the gloo
comparison where torch is importable (its keys null where it is not, or with --no-torch)."""

import json

import pytest

from ddiloco.bench.sync import PHASES, SyncBenchConfig, format_report, sync_tensors, torch_importable
from ddiloco.cli import main

KEYS = {
    "settings",
    "ddiloco_median_s",
    "ddiloco_syncs_s",
    "gloo_median_s",
    "gloo_syncs_s",
    "gloo_same_params",
    "gloo_skipped",
    "speedup_vs_gloo",
    "breakdown_median_s",
    "bytes_in_per_sync",
    "bytes_out_per_sync",
    "push_bytes",
    "fp32_model_bytes",
    "learner_versions",
    "same_params",
    "rejected",
    "bytes_out_per_byte_in",
    "merges_median_s",
    "cpu_s",
    "cores",
    "wire",
    "wire_cpu_s_per_sync",
    "learners_on_a_lane",
}


def _check_ddiloco_side(r: dict, learners: int, syncs: int, params: int = 100_000, fragments: int = 1) -> None:
    assert set(r) == KEYS
    assert r["settings"]["params"] == params and r["settings"]["learners"] == learners
    assert r["settings"]["fragments"] == fragments
    assert len(r["ddiloco_syncs_s"]) == r["settings"]["repeat"]
    assert r["ddiloco_median_s"] > 0
    assert set(r["breakdown_median_s"]) == set(PHASES)
    assert r["breakdown_median_s"]["merge"] > 0 and r["breakdown_median_s"]["encode"] > 0
    # every learner pushed its int4 outer gradient (about an eighth of the fp32 model, plus scales) ...
    assert r["push_bytes"] < r["fp32_model_bytes"] / 4
    assert r["bytes_in_per_sync"] >= learners * r["push_bytes"]
    # ... and received the new version as an int4 delta (the default broadcast codec): about as many
    # bytes out as in, never a whole fp32 copy per learner
    assert learners * r["push_bytes"] <= r["bytes_out_per_sync"] < learners * r["fp32_model_bytes"] / 4
    assert r["bytes_out_per_byte_in"] == pytest.approx(r["bytes_out_per_sync"] / r["bytes_in_per_sync"], rel=0.5)
    # the initial version 0, then one version of each fragment per sync, the same values at every learner
    assert r["learner_versions"] == [[syncs] * fragments] * learners
    assert r["same_params"] is True
    assert r["rejected"] == {}
    # the critical path's merge is the last fragment's; the syncer's time in merges covers them all
    assert r["merges_median_s"] >= r["breakdown_median_s"]["merge"] > 0
    cpu = r["cpu_s"]  # every process's threads, per sync: the learners encoded and applied, the syncer merged
    assert cpu["ddiloco_learners"] > 0 and cpu["ddiloco_syncer"] > 0 and cpu["ddiloco"] > 0
    assert r["cores"] >= 1
    # every learner had its lane (net.lane) unless the run said --no-lane
    assert r["learners_on_a_lane"] == (learners if r["settings"]["lane"] else 0)
    # the sync's bytes, moved again over each transport alone
    for transport in ("websocket", "tcp"):
        assert r["wire"][transport]["cpu_ns_per_byte"] > 0 and r["wire"][transport]["gbps"] > 0
        assert r["wire_cpu_s_per_sync"][transport] > 0
    report = format_report(r)
    assert "ddiloco" in report and "CPU per sync" in report


def test_small_sync_writes_every_key_and_the_gloo_side_where_torch_is(tmp_path):
    path = tmp_path / "sync.json"
    assert main(["bench", "sync", "--params", "100000", "--learners", "2", "--repeat", "2", "--json", str(path)]) == 0
    r = json.loads(path.read_text())
    _check_ddiloco_side(r, learners=2, syncs=2 + 2)  # default warm-up 2
    if torch_importable():
        assert r["gloo_skipped"] is None
        assert len(r["gloo_syncs_s"]) == 2 and r["gloo_median_s"] > 0
        assert r["gloo_same_params"] is True  # every rank took the same step
        assert r["speedup_vs_gloo"] == pytest.approx(r["gloo_median_s"] / r["ddiloco_median_s"])
        assert r["cpu_s"]["gloo"] > 0
    else:
        assert r["gloo_skipped"].startswith("torch is not installed")
        assert r["gloo_median_s"] is None and r["gloo_syncs_s"] is None and r["speedup_vs_gloo"] is None


def test_no_torch_leaves_the_gloo_keys_null(tmp_path, capsys):
    path = tmp_path / "sync.json"
    argv = ["bench", "sync", "--params", "100000", "--learners", "3", "--repeat", "1", "--warmup", "0", "--no-torch"]
    argv += ["--no-lane"]  # every byte on the websockets: that path stays measured too
    assert main(argv + ["--codec", "bf16", "--merge", "rda", "--json", str(path)]) == 0
    r = json.loads(path.read_text())
    assert r["gloo_skipped"] == "--no-torch"
    assert r["gloo_median_s"] is None and r["gloo_syncs_s"] is None and r["speedup_vs_gloo"] is None
    assert r["settings"]["codec"] == "bf16" and r["settings"]["merge"] == "rda"
    assert r["learner_versions"] == [[1]] * 3 and r["same_params"] is True
    assert r["cpu_s"]["gloo"] is None
    assert "not run: --no-torch" in capsys.readouterr().out


def test_fragments_are_pushed_in_turn_and_each_merged_once_per_sync(tmp_path):
    # three tensors, three fragments: a sync is three rounds, each merged once both learners pushed
    path, params = tmp_path / "sync.json", 2 * (1 << 20) + 1000
    argv = ["bench", "sync", "--params", str(params), "--learners", "2", "--fragments", "3", "--repeat", "2"]
    assert main(argv + ["--warmup", "1", "--no-torch", "--json", str(path)]) == 0
    r = json.loads(path.read_text())
    _check_ddiloco_side(r, learners=2, syncs=1 + 2, params=params, fragments=3)
    assert "3 fragments" in format_report(r)


def test_the_model_is_cut_into_tensors_that_hold_every_parameter():
    tensors = sync_tensors(3 * (1 << 20) + 5)
    assert [t.shape for t in tensors] == [(1 << 20,)] * 3 + [(5,)]
    assert [t.shape for t in sync_tensors(1 << 20)] == [(1 << 20,)]


@pytest.mark.parametrize(
    "bad",
    [
        {"params": 10},
        {"learners": 0},
        {"repeat": 0},
        {"warmup": -1},
        {"codec": "int3"},
        {"merge": "median"},
        {"fragments": 0},
        {"params": 100_000, "fragments": 2},  # one tensor: one fragment at most
    ],
)
def test_config_refuses_nonsense(bad):
    with pytest.raises(ValueError):
        SyncBenchConfig(**bad)
