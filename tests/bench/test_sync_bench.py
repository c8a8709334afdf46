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
}


def _check_ddiloco_side(r: dict, learners: int, syncs: int) -> None:
    assert set(r) == KEYS
    assert r["settings"]["params"] == 100_000 and r["settings"]["learners"] == learners
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
    # the initial version 0, then one version per sync, the same values at every learner
    assert r["learner_versions"] == [syncs] * learners
    assert r["same_params"] is True
    assert r["rejected"] == {}
    assert "ddiloco" in format_report(r)


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
    else:
        assert r["gloo_skipped"].startswith("torch is not installed")
        assert r["gloo_median_s"] is None and r["gloo_syncs_s"] is None and r["speedup_vs_gloo"] is None


def test_no_torch_leaves_the_gloo_keys_null(tmp_path, capsys):
    path = tmp_path / "sync.json"
    argv = ["bench", "sync", "--params", "100000", "--learners", "3", "--repeat", "1", "--warmup", "0", "--no-torch"]
    assert main(argv + ["--codec", "bf16", "--merge", "rda", "--json", str(path)]) == 0
    r = json.loads(path.read_text())
    assert r["gloo_skipped"] == "--no-torch"
    assert r["gloo_median_s"] is None and r["gloo_syncs_s"] is None and r["speedup_vs_gloo"] is None
    assert r["settings"]["codec"] == "bf16" and r["settings"]["merge"] == "rda"
    assert r["learner_versions"] == [1, 1, 1] and r["same_params"] is True
    assert "not run: --no-torch" in capsys.readouterr().out


def test_the_model_is_cut_into_tensors_that_hold_every_parameter():
    tensors = sync_tensors(3 * (1 << 20) + 5)
    assert [t.shape for t in tensors] == [(1 << 20,)] * 3 + [(5,)]
    assert [t.shape for t in sync_tensors(1 << 20)] == [(1 << 20,)]


@pytest.mark.parametrize(
    "bad",
    [{"params": 10}, {"learners": 0}, {"repeat": 0}, {"warmup": -1}, {"codec": "int3"}, {"merge": "median"}],
)
def test_config_refuses_nonsense(bad):
    with pytest.raises(ValueError):
        SyncBenchConfig(**bad)
