"""The outer optimizer's update, SGD with Nesterov momentum, in place.

docs/algorithm.md, "Syncer: one round of fragment p", item 6:

    buf   <- mu * buf + g
    theta <- theta - lr * (g + mu * buf)

This is optax's `sgd(lr, momentum=mu, nesterov=True)` written as one fused pass over three vectors
(20 bytes of traffic per value). All arithmetic is float32 in exactly this order and without
fastmath, so the result is bit-for-bit that of the same expression in numpy.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ddiloco.kernels import _checks
from ddiloco.kernels._parallelism import CHUNK_ELEMENTS, thread_bounds


@njit(nogil=True, cache=True)
def _nesterov_serial(theta, buf, g, lr, mu):
    # theta, buf: f32[m] (in place), g: f32[m], lr, mu: f32
    for i in range(theta.size):
        gi = g[i]
        b = mu * buf[i] + gi
        buf[i] = b
        theta[i] -= lr * (gi + mu * b)


@njit(parallel=True, nogil=True, cache=True)
def _nesterov_parallel(theta, buf, g, lr, mu, bounds):
    for s in prange(bounds.size - 1):
        a = bounds[s]
        b = bounds[s + 1]
        _nesterov_serial(theta[a:b], buf[a:b], g[a:b], lr, mu)


def nesterov_step(
    theta: np.ndarray, buf: np.ndarray, g: np.ndarray, lr: float, mu: float, *, parallel: bool = True
) -> None:
    """One outer step in place on float32[n] `theta` and momentum `buf`, with outer gradient `g`."""
    _checks.vector("theta", theta, np.float32, writeable=True)
    _checks.vector("buf", buf, np.float32, writeable=True)
    g = _checks.vector("g", g, np.float32)
    _checks.length("buf", buf, theta.size)
    _checks.length("g", g, theta.size)
    lr = _checks.finite_scalar("lr", lr)
    mu = _checks.finite_scalar("mu", mu)
    _checks.disjoint(theta=theta, buf=buf, g=g)
    lr32, mu32 = np.float32(lr), np.float32(mu)
    bounds = thread_bounds(theta.size, CHUNK_ELEMENTS, parallel)
    if bounds is None:
        _nesterov_serial(theta, buf, g, lr32, mu32)
    else:
        _nesterov_parallel(theta, buf, g, lr32, mu32, bounds)
