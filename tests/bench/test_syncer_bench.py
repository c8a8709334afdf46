"""`ddiloco bench syncer` at a tiny size: real learner processes, the real daemon, the baseline."""

import pytest

from ddiloco.bench.syncer import SyncerBenchConfig, format_report, run_syncer_bench


def test_tiny_syncer_bench_reports_traffic_against_the_ceiling_of_the_same_run():
    r = run_syncer_bench(SyncerBenchConfig(learners=2, params=1 << 20, fragments=2, seconds=3.0, ceiling_seconds=1.5))
    assert r["merges"] > 0 and r["pushes"] > 0
    assert r["payload_gbps_in"] > 0 and r["gbps_out"] > 0  # broadcasts are counted as sent
    assert r["wire_ceiling_gbps"] > 0
    # int4 deltas out (2 learners, pushes in int4): a couple of bytes out per byte in, not the ~8 x M
    # of whole fp32 copies (progress reports in and control messages out make it inexact)
    assert 0 < r["bytes_out_per_byte_in"] < 4
    share = (r["payload_gbps_in"] + r["gbps_out"]) / r["wire_ceiling_gbps"]
    assert r["traffic_over_ceiling"] == pytest.approx(share)
    text = format_report(r)
    assert "wire ceiling" in text and "bytes out per byte in" in text


def test_bench_config_refuses_nonsense():
    with pytest.raises(ValueError, match="bad syncer bench config"):
        SyncerBenchConfig(ceiling_seconds=0)
