"""Dense float32 kernels: the weighted accumulate of a plain contribution, a round's fused mean of fp32
contributions (with the outer step), and a finiteness check.

No fastmath: the loops are elementwise and vectorise without it, and the accumulate then rounds
exactly as the numpy expression does (tests compare bit for bit).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import njit, prange

from ddiloco.kernels import _checks
from ddiloco.kernels._nesterov import _nesterov_serial
from ddiloco.kernels._parallelism import CHUNK_ELEMENTS, thread_bounds, tile_elements, typed_list

_ABS_MASK = np.uint32(0x7FFFFFFF)
_NONFINITE_BITS = np.uint32(0x7F800000)


@njit(nogil=True, cache=True)
def _accumulate_serial(acc, weight, x):
    # acc: f32[m] (in place), weight: f32, x: f32[m]
    for i in range(acc.size):
        acc[i] += weight * x[i]


@njit(parallel=True, nogil=True, cache=True)
def _accumulate_parallel(acc, weight, x, bounds):
    for s in prange(bounds.size - 1):
        a = bounds[s]
        b = bounds[s + 1]
        _accumulate_serial(acc[a:b], weight, x[a:b])


@njit(nogil=True, cache=True)
def _count_nonfinite_serial(xbits):
    # xbits: u32[m] (float32 bit patterns); integer compares vectorise and see Inf and NaN exactly
    count = 0
    for i in range(xbits.size):
        count += (xbits[i] & _ABS_MASK) >= _NONFINITE_BITS
    return count


@njit(parallel=True, nogil=True, cache=True)
def _count_nonfinite_parallel(xbits, bounds):
    count = 0
    for s in prange(bounds.size - 1):
        count += _count_nonfinite_serial(xbits[bounds[s] : bounds[s + 1]])
    return count


@njit(nogil=True, cache=True)
def _round_mean_range(theta, buf, weights, xs, lo, hi, step, lr, mu, tile):
    # The fp32 twin of _lowbit._round_mean_range: tile by tile, g = sum_m float32(weights[m]) * xs[m]
    # in learner order, then the outer step on theta/buf (step) or theta[...] = g.
    g = np.empty(tile, np.float32)
    for t0 in range(lo, hi, tile):
        t1 = min(t0 + tile, hi)
        gt = g[: t1 - t0]
        gt[:] = 0.0
        for m in range(weights.size):
            w = np.float32(weights[m])
            x = xs[m][t0:t1]
            for i in range(t1 - t0):
                gt[i] += w * x[i]
        if step:
            _nesterov_serial(theta[t0:t1], buf[t0:t1], gt, lr, mu)  # the outer step, the one loop of it
        else:
            theta[t0:t1] = gt


@njit(parallel=True, nogil=True, cache=True)
def _round_mean_parallel(theta, buf, weights, xs, step, lr, mu, tile, bounds):
    for s in prange(bounds.size - 1):
        _round_mean_range(theta, buf, weights, xs, bounds[s], bounds[s + 1], step, lr, mu, tile)


def accumulate(acc: np.ndarray, weight: float, x: np.ndarray, *, parallel: bool = True) -> None:
    """acc += float32(weight) * x in place; acc and x are float32[n] and must not overlap."""
    _checks.vector("acc", acc, np.float32, writeable=True)
    weight = _checks.finite_scalar("weight", weight)
    x = _checks.vector("x", x, np.float32)
    _checks.length("x", x, acc.size)
    _checks.disjoint(acc=acc, x=x)
    w32 = np.float32(weight)
    bounds = thread_bounds(acc.size, CHUNK_ELEMENTS, parallel)
    if bounds is None:
        _accumulate_serial(acc, w32, x)
    else:
        _accumulate_parallel(acc, w32, x, bounds)


def _round_mean(
    theta: object, buf: object, weights: object, xs: object, lr: object, mu: object, parallel: bool
) -> None:
    step = buf is not None
    theta = _checks.vector("theta" if step else "out", theta, np.float32, writeable=True)
    n = theta.size
    weights = _checks.weights(weights)
    xs = _checks.sequence("xs", xs, weights.size)
    for m in range(weights.size):
        xs[m] = _checks.vector(f"xs[{m}]", xs[m], np.float32)
        _checks.length(f"xs[{m}]", xs[m], n)
    named = {f"xs[{m}]": x for m, x in enumerate(xs)}
    if step:
        buf = _checks.vector("buf", buf, np.float32, writeable=True)
        _checks.length("buf", buf, n)
        _checks.written_apart({"theta": theta, "buf": buf}, named)
        lr32, mu32 = np.float32(_checks.finite_scalar("lr", lr)), np.float32(_checks.finite_scalar("mu", mu))
    else:
        _checks.written_apart({"out": theta}, named)
        buf, lr32, mu32 = theta, np.float32(0.0), np.float32(0.0)
    tile = tile_elements(CHUNK_ELEMENTS)
    bounds = thread_bounds(n, CHUNK_ELEMENTS, parallel)
    if bounds is None:
        _round_mean_range(theta, buf, weights, typed_list(xs), 0, n, step, lr32, mu32, tile)
    else:
        _round_mean_parallel(theta, buf, weights, typed_list(xs), step, lr32, mu32, tile, bounds)


def round_mean(out: np.ndarray, weights: np.ndarray, xs: Sequence[np.ndarray], *, parallel: bool = True) -> None:
    """out = sum_m float32(weights[m]) * xs[m] in one pass, every contribution read once: bit for bit
    `accumulate` into zeros, one contribution after the other in this order."""
    _round_mean(out, None, weights, xs, None, None, parallel)


def round_mean_step(
    theta: np.ndarray,
    buf: np.ndarray,
    weights: np.ndarray,
    xs: Sequence[np.ndarray],
    lr: float,
    mu: float,
    *,
    parallel: bool = True,
) -> None:
    """The merged mean g of `round_mean` (never materialised) and `nesterov_step(theta, buf, g, lr, mu)`
    in place, in one pass over the fragment, with the same bits."""
    _round_mean(theta, buf, weights, xs, lr, mu, parallel)


def count_nonfinite(x: np.ndarray, *, parallel: bool = True) -> int:
    """How many values of float32[n] `x` are NaN or +-Inf (one read-only pass, no temporaries)."""
    x = _checks.vector("x", x, np.float32)
    xbits = x.view(np.uint32)
    bounds = thread_bounds(x.size, CHUNK_ELEMENTS, parallel)
    if bounds is None:
        return int(_count_nonfinite_serial(xbits))
    return int(_count_nonfinite_parallel(xbits, bounds))


def all_finite(x: np.ndarray, *, parallel: bool = True) -> bool:
    """Whether every value of float32[n] `x` is finite: the admissibility check of a contribution."""
    return count_nonfinite(x, parallel=parallel) == 0
