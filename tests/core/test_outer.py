import numpy as np
import pytest

from ddiloco.core import outer
from ddiloco.core.outer import OuterConfig, OuterConfigError


def test_matches_optax_sgd_nesterov_step_for_step():
    import jax.numpy as jnp
    import optax  # the dev extra installs it

    rng = np.random.default_rng(0)
    theta = rng.standard_normal(300).astype(np.float32)
    cfg = OuterConfig(lr=0.7, momentum=0.9)
    tx = optax.sgd(cfg.lr, momentum=cfg.momentum, nesterov=True)
    params = jnp.asarray(theta)
    opt_state = tx.init(params)
    state = outer.init(theta)
    for _ in range(10):
        delta = rng.standard_normal(300).astype(np.float32) * 0.1
        updates, opt_state = tx.update(jnp.asarray(delta), opt_state, params)
        params = optax.apply_updates(params, updates)
        theta, state = outer.update(state, theta, delta, cfg)
        np.testing.assert_allclose(theta, np.asarray(params), rtol=1e-5, atol=1e-6)


def test_update_is_pure_unless_donated():
    theta = np.ones(8, dtype=np.float32)
    state = outer.init(theta)
    delta = np.full(8, 0.5, dtype=np.float32)
    new_theta, new_state = outer.update(state, theta, delta, OuterConfig())
    assert (theta == 1).all() and (state.buf == 0).all()
    assert not np.array_equal(new_theta, theta)
    donated, donated_state = outer.update(state, theta, delta, OuterConfig(), donate=True)
    assert donated is theta and donated_state.buf is state.buf
    np.testing.assert_array_equal(donated, new_theta)


def test_bad_config_and_shapes():
    with pytest.raises(OuterConfigError, match="learning rate"):
        OuterConfig(lr=0)
    with pytest.raises(OuterConfigError, match="momentum"):
        OuterConfig(momentum=1.0)
    theta = np.ones(8, dtype=np.float32)
    with pytest.raises(ValueError, match="shapes differ"):
        outer.update(outer.init(theta), theta, np.ones(4, dtype=np.float32), OuterConfig())
