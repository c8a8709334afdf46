"""Bad input to the simulator gets a clear error naming what is wrong."""

import math

import pytest

from ddiloco import sim


@pytest.mark.parametrize(
    "build, words",
    [
        (lambda: sim.ClusterConfig(chips=0), "chips"),
        (lambda: sim.ClusterConfig(chips=-1e6), "chips"),
        (lambda: sim.ClusterConfig(chips=math.nan), "chips"),
        (lambda: sim.ClusterConfig(mtbi_chip_years=0), "mtbi_chip_years"),
        (lambda: sim.ClusterConfig(mtbi_chip_years=-1), "mtbi_chip_years"),
        (lambda: sim.ClusterConfig(slice_chips=0), "slice_chips"),
        (lambda: sim.ClusterConfig(chips=100, slice_chips=256), "exceeds chips"),
        (lambda: sim.RepairTime("weibull"), "repair distribution"),
        (lambda: sim.RepairTime(mean_s=0), "mean_s"),
        (lambda: sim.RepairTime(sim.RepairKind.LOGNORMAL, 60.0, cv=-1), "cv"),
        (lambda: sim.Timings(scale_down_s=-1), "scale_down_s"),
        (lambda: sim.Timings(restart_s=math.inf), "restart_s"),
        (lambda: sim.SystemConfig.of("decoupled", 4, 5), "quorum K=5 exceeds"),
        (lambda: sim.SystemConfig.of("decoupled", 0), "learners"),
        (lambda: sim.SystemConfig.of("ring-allreduce"), "system"),
        (lambda: sim.SystemConfig("dp", 4), "one job"),
        (lambda: sim.SystemConfig.of("decoupled", 4, 1, speed_sigma=1.5), "speed_sigma"),
        (lambda: sim.RunConfig(days=0), "days"),
        (lambda: sim.RunConfig(days=1000), "days"),
        (lambda: sim.MixedConfig(rounds=0), "rounds"),
        (lambda: sim.MixedConfig(fast=0, slow=0), "at least one learner"),
        (lambda: sim.ScavengeConfig(extra=-0.5), "extra"),
        (lambda: sim.ScavengeConfig(speed=0), "speed"),
    ],
)
def test_bad_settings_are_refused_by_name(build, words):
    with pytest.raises(sim.SimConfigError, match=words):
        build()


def test_more_learners_than_slices_is_refused_before_running():
    import numpy as np

    cluster = sim.ClusterConfig(chips=4096, slice_chips=1024)
    with pytest.raises(sim.SimConfigError, match="need at least 8 slices"):
        sim.simulate(
            cluster, sim.SystemConfig.of("decoupled", 8), sim.Timings(), sim.RunConfig(1), np.random.default_rng(0)
        )


def test_a_run_with_too_many_failures_is_refused_before_drawing():
    import numpy as np

    cluster = sim.ClusterConfig(chips=1e9, mtbi_chip_years=0.01, slice_chips=1024)
    with pytest.raises(sim.SimConfigError, match="expected failures"):
        sim.simulate(cluster, sim.SystemConfig.of("dp"), sim.Timings(), sim.RunConfig(300), np.random.default_rng(0))


def test_errors_are_value_errors_for_the_cli():
    assert issubclass(sim.SimConfigError, ValueError)
