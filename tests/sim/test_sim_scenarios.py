"""Mixed hardware and opportunistic compute: closed forms where they exist, the paper's direction."""

import numpy as np
import pytest

from ddiloco import sim


def test_mixed_without_noise_waits_for_the_slow_learners_exactly():
    cfg = sim.MixedConfig(fast=3, slow=5, speed_gap=0.25, noise=0.0, rounds=500)
    barrier, alone, grace = sim.simulate_mixed(cfg, np.random.default_rng(0))
    # Every round lasts one slow step (1.25); fast learners are busy 1 / 1.25 of it.
    assert barrier.goodput == pytest.approx((3 * 1.0 + 5 * 1.25) / (8 * 1.25), rel=1e-12)
    assert alone.goodput == grace.goodput == 1.0
    assert alone.merged_share == pytest.approx(1 / 8)


def test_mixed_reproduces_the_paper_direction():
    barrier, alone, grace = sim.simulate_mixed(sim.MixedConfig(), np.random.default_rng(1))
    assert 0.80 <= barrier.goodput <= 0.88  # paper: 84%
    assert alone.merged_share < 0.25 < 0.85 < grace.merged_share <= 1.0
    assert barrier.merged_share == 1.0


def test_mixed_is_deterministic_by_seed():
    cfg = sim.MixedConfig(rounds=1000)
    assert sim.simulate_mixed(cfg, np.random.default_rng(4)) == sim.simulate_mixed(cfg, np.random.default_rng(4))


def test_scavenge_limits():
    none = sim.scavenge(sim.ScavengeConfig(extra=0.0))
    assert none.wall_decoupled == none.wall_dp == 1.0
    # Same-speed chips always present and no batch-size penalty: both simply scale with the chips...
    same = sim.scavenge(sim.ScavengeConfig(extra=1.0, speed=1.0, beta=1e-9))
    assert same.wall_decoupled == pytest.approx(1.0) and same.wall_dp == pytest.approx(1.0)
    # ...and with beta the wall time follows the critical-batch law (1 + beta / 2) / (1 + beta).
    half = sim.scavenge(sim.ScavengeConfig(extra=1.0, speed=1.0, beta=1.0))
    assert half.wall_decoupled == pytest.approx(0.75) == half.wall_dp


def test_scavenge_direction_matches_the_paper():
    walls = [sim.scavenge(sim.ScavengeConfig(extra=e)) for e in (0.25, 1.0, 3.0)]
    for r in walls:
        assert r.wall_decoupled < r.wall_dp
    assert walls[0].wall_dp > 1.0  # lockstep on slower chips: a little extra compute slows DP down
    assert [r.wall_decoupled for r in walls] == sorted((r.wall_decoupled for r in walls), reverse=True)


def test_scavenge_churn_hurts_dp_more():
    calm = sim.scavenge(sim.ScavengeConfig(extra=1.0))
    churn = sim.scavenge(sim.ScavengeConfig(extra=1.0, stay_s=600.0))
    assert churn.wall_dp - calm.wall_dp > churn.wall_decoupled - calm.wall_decoupled > 0
