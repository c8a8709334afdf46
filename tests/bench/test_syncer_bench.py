"""`ddiloco bench syncer` at a tiny size: real learner processes, the real daemon, the baseline."""

import pytest

from ddiloco.bench.syncer import (
    SyncerBenchConfig,
    check_bench_shards,
    format_report,
    format_shards_report,
    run_sharded_bench,
    run_syncer_bench,
)


def test_tiny_syncer_bench_reports_traffic_against_the_ceiling_of_the_same_run():
    r = run_syncer_bench(SyncerBenchConfig(learners=2, params=1 << 20, fragments=2, seconds=3.0, ceiling_seconds=1.5))
    assert r["merges"] > 0 and r["pushes"] > 0
    # every learner process took part (one whose connection died would leave the others a lighter
    # syncer: measured so for a while, with 7 of 8 learners gone at their first report)
    assert len(r["pushes_per_learner"]) == 2 and min(r["pushes_per_learner"]) > 0
    assert r["payload_gbps_in"] > 0 and r["gbps_out"] > 0  # broadcasts are counted as sent
    assert r["wire_ceiling_gbps"] > 0
    # int4 deltas out (2 learners, pushes in int4): a couple of bytes out per byte in, not the ~8 x M
    # of whole fp32 copies (progress reports in and control messages out make it inexact)
    assert 0 < r["bytes_out_per_byte_in"] < 4
    share = (r["payload_gbps_in"] + r["gbps_out"]) / r["wire_ceiling_gbps"]
    assert r["traffic_over_ceiling"] == pytest.approx(share)
    assert r["pushes_per_merge"] >= 1
    text = format_report(r)
    assert "wire ceiling" in text and "bytes out per byte in" in text and "2 of 2 learners" in text
    assert "pushes per merge" in text and "quorum 1" in text


def test_a_quorum_of_every_learner_merges_a_push_of_each_and_sends_a_byte_out_per_byte_in():
    """Each merge goes out to every learner: the pushes a round merges set the bytes out per byte in
    (about learners / pushes per merge, for int4 both ways)."""
    r = run_syncer_bench(
        SyncerBenchConfig(learners=2, params=1 << 20, fragments=2, seconds=3.0, ceiling_seconds=0.5, quorum=2)
    )
    assert r["merges"] > 0 and r["pushes_per_merge"] > 1.5  # (a round the last goodbyes cut short merges fewer)
    assert r["bytes_out_per_byte_in"] < 1.5


def test_bench_config_refuses_nonsense():
    with pytest.raises(ValueError, match="bad syncer bench config"):
        SyncerBenchConfig(ceiling_seconds=0)
    with pytest.raises(ValueError, match="bad syncer bench config"):
        SyncerBenchConfig(learners=2, quorum=3)


def test_tiny_sharded_bench_runs_one_syncer_then_two_shards_each_fed_only_its_own_fragments():
    r = run_sharded_bench(SyncerBenchConfig(learners=2, params=1 << 20, fragments=2, seconds=3.0), 2)
    one, two = r["runs"]
    assert (one["shards"], two["shards"]) == (1, 2) and len(two["per_shard"]) == 2
    for run in (one, two):
        assert run["merges"] > 0 and run["pushes"] > 0 and run["payload_gbps_in"] > 0
    for shard in two["per_shard"]:
        # every push and initial fragment reached its owner: none refused, and each shard merged
        # its own fragment and held the other at version 0
        assert shard["rejected"] == {}
        assert shard["owned"] == [shard["shard"]]
        assert [v > 0 for v in shard["versions"]] == [p == shard["shard"] for p in range(2)]
    assert two["merges"] == sum(s["merges"] for s in two["per_shard"])
    text = format_shards_report(r)
    assert "1 syncer" in text and "2 shards" in text and "shard 1 (fragments 1)" in text


@pytest.mark.parametrize(("shards", "message"), [(3, "3 shards need at least 3 fragments"), (1, "2 or more")])
def test_a_sharded_bench_needs_two_shards_or_more_and_a_fragment_for_each(shards, message):
    with pytest.raises(ValueError, match=message):
        check_bench_shards(SyncerBenchConfig(fragments=2), shards)
