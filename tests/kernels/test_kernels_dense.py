"""Dense accumulate, the finiteness check and the outer Nesterov step."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco import kernels
from ddiloco.kernels import reference

SETTINGS = settings(max_examples=40, deadline=None)
# sizes on the serial path and one that uses all 64 slices of the parallel one
PARALLEL_N = 64 * (1 << 14) + 1001


def vectors(seed, n, count):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4)).astype(np.float32) for _ in range(count)]


@SETTINGS
@given(st.integers(0, 2**32 - 1), st.integers(0, 5000), st.floats(-1e6, 1e6, allow_nan=False))
def test_accumulate_is_exactly_the_reference(seed, n, weight):
    acc, x = vectors(seed, n, 2)
    want = acc.copy()
    kernels.accumulate(acc, weight, x)
    reference.accumulate(want, weight, x)
    np.testing.assert_array_equal(acc, want)


def test_accumulate_parallel_path():
    acc, x = vectors(1, PARALLEL_N, 2)
    want = acc.copy()
    kernels.accumulate(acc, 0.125, x)
    reference.accumulate(want, 0.125, x)
    np.testing.assert_array_equal(acc, want)


@SETTINGS
@given(st.integers(0, 2**32 - 1), st.integers(0, 3000), st.integers(0, 5))
def test_count_nonfinite(seed, n, bad):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    if n:
        x[rng.integers(0, n, bad)] = rng.choice(np.array([np.nan, np.inf, -np.inf], dtype=np.float32), bad)
    x[: min(n, 3)] = np.finfo(np.float32).max  # the largest finite value is finite
    assert kernels.count_nonfinite(x) == reference.count_nonfinite(x)
    assert kernels.all_finite(x) == reference.all_finite(x)


def test_count_nonfinite_parallel_path():
    x = np.zeros(PARALLEL_N, dtype=np.float32)
    x[[0, 12345, PARALLEL_N - 1]] = [np.nan, -np.inf, np.inf]
    assert kernels.count_nonfinite(x) == 3
    assert not kernels.all_finite(x)
    assert kernels.all_finite(np.zeros(PARALLEL_N, dtype=np.float32))


def nesterov_loop(theta, buf, g, lr, mu):
    """Element by element in float32 scalars, the update rule of docs/algorithm.md as written."""
    lr, mu = np.float32(lr), np.float32(mu)
    for i in range(theta.size):
        buf[i] = mu * buf[i] + g[i]
        theta[i] = theta[i] - lr * (g[i] + mu * buf[i])


@SETTINGS
@given(
    st.integers(0, 2**32 - 1),
    st.integers(0, 300),
    st.floats(0.0, 2.0, allow_nan=False),
    st.floats(0.0, 0.99, allow_nan=False),
    st.integers(1, 3),
)
def test_nesterov_matches_a_plain_loop(seed, n, lr, mu, steps):
    theta, buf, *grads = vectors(seed, n, 2 + steps)
    theta_loop, buf_loop = theta.copy(), buf.copy()
    for g in grads:
        kernels.nesterov_step(theta, buf, g, lr, mu)
        nesterov_loop(theta_loop, buf_loop, g, lr, mu)
    np.testing.assert_array_equal(theta, theta_loop)
    np.testing.assert_array_equal(buf, buf_loop)


def test_nesterov_parallel_path_matches_reference():
    theta, buf, g = vectors(4, PARALLEL_N, 3)
    theta_ref, buf_ref = theta.copy(), buf.copy()
    for _ in range(2):
        kernels.nesterov_step(theta, buf, g, 0.7, 0.9)
        reference.nesterov_step(theta_ref, buf_ref, g, 0.7, 0.9)
    np.testing.assert_array_equal(theta, theta_ref)
    np.testing.assert_array_equal(buf, buf_ref)


def test_nesterov_defaults_by_hand():
    # lr 0.5, mu 0.5, buf 2, g 1: buf = 0.5*2 + 1 = 2; theta = 10 - 0.5 * (1 + 0.5*2) = 9
    theta, buf, g = (np.array([v], dtype=np.float32) for v in (10.0, 2.0, 1.0))
    kernels.nesterov_step(theta, buf, g, 0.5, 0.5)
    assert buf[0] == 2.0 and theta[0] == 9.0
