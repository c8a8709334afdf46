"""The goodput simulator against what must hold analytically, and against closed forms."""

import math

import numpy as np
import pytest

from ddiloco import sim
from ddiloco.sim import engine
from ddiloco.sim.config import YEAR_S
from ddiloco.sim.failures import draw_failures, slices_per_learner

TIMINGS = sim.Timings(restart_s=60.0, scale_down_s=20.0, scale_up_s=15.0, join_wait_s=120.0)
REPAIR = sim.RepairTime(sim.RepairKind.EXPONENTIAL, 300.0)


def _run(system, chips=2e5, days=2.0, seed=0, timings=TIMINGS, repair=REPAIR, slice_chips=1024, mtbi=1.0):
    cluster = sim.ClusterConfig(chips, mtbi, slice_chips, repair)
    return sim.simulate(cluster, system, timings, sim.RunConfig(days), np.random.default_rng(seed))


def test_same_seed_same_result_other_seed_other_result():
    system = sim.SystemConfig.of("decoupled", 4, 1, 0.1)
    assert _run(system, seed=3) == _run(system, seed=3)
    assert _run(system, seed=3) != _run(system, seed=4)


def test_grid_cells_do_not_depend_on_which_cells_run_with_them():
    one = sim.run_table1(TIMINGS, [0], slice_chips=1024, repair=REPAIR, days=0.5, chips=[3e5])
    two = sim.run_table1(TIMINGS, [0], slice_chips=1024, repair=REPAIR, days=0.5, chips=[1.5e5, 3e5])
    assert [c for c in two if c.chips == 3e5] == one


@pytest.mark.parametrize(
    "system", [sim.SystemConfig.of("dp"), sim.SystemConfig.of("elastic-dp"), sim.SystemConfig.of("decoupled", 8)]
)
def test_no_failures_gives_full_goodput_and_uptime(system):
    result = _run(system, mtbi=math.inf)
    assert result.failures == 0
    assert result.goodput == pytest.approx(1.0, abs=1e-12)
    assert result.uptime == pytest.approx(1.0, abs=1e-12)
    assert result.partial_share == 0.0


def test_one_learner_decoupled_is_elastic_dp():
    for seed in (0, 1):
        assert _run(sim.SystemConfig.of("decoupled", 1), seed=seed) == _run(
            sim.SystemConfig.of("elastic-dp"), seed=seed
        )


def test_goodput_falls_with_cluster_size_and_rises_with_learners():
    cells = sim.run_table1(TIMINGS, [0, 1], slice_chips=1024, repair=REPAIR, days=2.0)
    rows = {}
    for c in cells:
        rows.setdefault(c.system.label, []).append(c.goodput)
    for label, row in rows.items():
        assert all(a > b for a, b in zip(row, row[1:])), (label, row)
    order = ["dp", "elastic-dp", "decoupled M=2", "decoupled M=4", "decoupled M=8", "decoupled M=16"]
    for size in range(5):
        column = [rows[label][size] for label in order]
        assert all(a < b for a, b in zip(column, column[1:])), (size, column)


def test_synchronous_job_matches_the_renewal_closed_form():
    # Poisson failures at rate lam; each stops the job for R and failures during a restart fold into
    # it, so a cycle is an exponential run (mean 1/lam) plus R: goodput = 1 / (1 + lam R).
    chips, restart = 4e5, 60.0
    lam = chips / YEAR_S
    result = _run(sim.SystemConfig.of("dp"), chips=chips, days=20.0, timings=sim.Timings(restart_s=restart))
    assert result.goodput == pytest.approx(1.0 / (1.0 + lam * restart), abs=0.01)
    assert result.uptime == pytest.approx(result.goodput, abs=1e-12)


def test_elastic_without_pauses_keeps_the_slice_availability():
    # No pauses, immediate rejoin: each slice alternates exponential up-time (rate slice/MTBI) and a
    # repair of mean T, so the share of chips running is 1 / (1 + slice * T / MTBI).
    slice_chips, mtbi_years, repair_mean = 4096, 0.01, 600.0
    timings = sim.Timings(restart_s=0.0, scale_down_s=0.0, scale_up_s=0.0, join_wait_s=0.0)
    repair = sim.RepairTime(sim.RepairKind.EXPONENTIAL, repair_mean)
    result = _run(
        sim.SystemConfig.of("elastic-dp"),
        chips=4096 * 64,
        days=10.0,
        timings=timings,
        repair=repair,
        slice_chips=slice_chips,
        mtbi=mtbi_years,
    )
    rho = slice_chips * repair_mean / (mtbi_years * YEAR_S)
    assert rho > 0.5  # the check means something only if many slices are out at once
    assert result.goodput == pytest.approx(1.0 / (1.0 + rho), abs=0.01)


def test_quorum_of_all_learners_stalls_everyone_on_any_failure():
    free = _run(sim.SystemConfig.of("decoupled", 8, 1))
    barrier = _run(sim.SystemConfig.of("decoupled", 8, 8))
    assert barrier.goodput < free.goodput
    assert barrier.uptime < free.uptime == pytest.approx(1.0)


def test_quorum_with_speed_spread_costs_the_fast_learners_their_lead():
    free = _run(sim.SystemConfig.of("decoupled", 8, 1, 0.2), mtbi=math.inf, seed=5)
    barrier = _run(sim.SystemConfig.of("decoupled", 8, 8, 0.2), mtbi=math.inf, seed=5)
    speeds = np.maximum(0.05, 1 + 0.2 * np.random.default_rng(5).standard_normal(8))
    assert free.goodput == pytest.approx(1.0)
    # Everyone waits for the slowest: busy share is min(speed) / speed, weighted by each one's slices.
    weights = slices_per_learner(sim.ClusterConfig(2e5, 1.0, 1024).slices, 8)
    assert barrier.goodput == pytest.approx(float(np.average(speeds.min() / speeds, weights=weights)), rel=1e-9)


def test_compiled_loop_matches_its_python_source():
    cluster = sim.ClusterConfig(65536, 0.02, 1024, REPAIR)
    slices = slices_per_learner(cluster.slices, 4)
    stream = draw_failures(cluster, slices, 86400.0, np.random.default_rng(2))
    speed = np.array([1.0, 0.9, 1.1, 0.8])
    args = (
        stream.times_s,
        stream.learner,
        stream.pick,
        stream.repair_s,
        slices,
        speed,
        cluster.chips / cluster.slices,
        True,
        2,
        60.0,
        20.0,
        15.0,
        120.0,
        86400.0,
    )
    assert len(stream) > 500
    np.testing.assert_allclose(engine.run_events(*args), engine.run_events.py_func(*args), rtol=1e-12)


def test_failure_stream_is_a_poisson_process_of_the_cluster_rate():
    cluster = sim.ClusterConfig(1.2e6, 1.0, 1024, REPAIR)
    slices = slices_per_learner(cluster.slices, 8)
    stream = draw_failures(cluster, slices, 7 * 86400.0, np.random.default_rng(0))
    mean = cluster.failure_rate_per_s * 7 * 86400.0
    assert abs(len(stream) - mean) < 5 * math.sqrt(mean)
    gaps = np.diff(stream.times_s)
    assert gaps.min() >= 0
    assert gaps.mean() == pytest.approx(1 / cluster.failure_rate_per_s, rel=0.03)
    counts = np.bincount(stream.learner, minlength=8)
    assert counts.min() > 0.9 * len(stream) / 8


@pytest.mark.parametrize("kind", list(sim.RepairKind))
def test_repair_distributions_have_the_requested_mean(kind):
    from ddiloco.sim.failures import sample_repair

    draws = sample_repair(sim.RepairTime(kind, 300.0, 0.5), 200_000, np.random.default_rng(1))
    assert draws.min() > 0
    assert draws.mean() == pytest.approx(300.0, rel=0.01)


def test_calibration_search_returns_the_minimax_candidate():
    space = sim.SearchSpace(
        restart_s=(40.0, 76.0),
        slice_chips=(1024,),
        repair_mean_s=(300.0,),
        scale_down_s=(5.0, 20.0),
        scale_up_s=(15.0,),
        join_wait_s=(120.0,),
    )
    best, candidates = sim.search(space, seeds=[0], days=0.5)
    assert len(candidates) == 2
    assert candidates[0].error_max <= candidates[1].error_max
    # 5 s scale-downs are far too cheap for the paper's elastic rows; 20 s is close.
    assert best.calibration.timings.scale_down_s == 20.0
    assert best.calibration.timings.restart_s == 76.0  # 40 s restarts overshoot the DP row
    assert best.error_max >= candidates[0].error_max
