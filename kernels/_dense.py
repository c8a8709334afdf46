"""Dense float32 kernels: the weighted accumulate of a plain contribution and a finiteness check.

No fastmath: the loops are elementwise and vectorise without it, and the accumulate then rounds
exactly as the numpy expression does (tests compare bit for bit).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ddiloco.kernels import _checks
from ddiloco.kernels._parallelism import CHUNK_ELEMENTS, slice_bounds, use_parallel

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


def accumulate(acc: np.ndarray, weight: float, x: np.ndarray) -> None:
    """acc += float32(weight) * x in place; acc and x are float32[n] and must not overlap."""
    _checks.vector("acc", acc, np.float32, writeable=True)
    weight = _checks.finite_scalar("weight", weight)
    x = _checks.vector("x", x, np.float32)
    _checks.length("x", x, acc.size)
    _checks.disjoint(acc=acc, x=x)
    w32 = np.float32(weight)
    if use_parallel(acc.size):
        _accumulate_parallel(acc, w32, x, slice_bounds(acc.size, CHUNK_ELEMENTS))
    else:
        _accumulate_serial(acc, w32, x)


def count_nonfinite(x: np.ndarray) -> int:
    """How many values of float32[n] `x` are NaN or +-Inf (one read-only pass, no temporaries)."""
    x = _checks.vector("x", x, np.float32)
    xbits = x.view(np.uint32)
    if use_parallel(x.size):
        return int(_count_nonfinite_parallel(xbits, slice_bounds(x.size, CHUNK_ELEMENTS)))
    return int(_count_nonfinite_serial(xbits))


def all_finite(x: np.ndarray) -> bool:
    """Whether every value of float32[n] `x` is finite: the admissibility check of a contribution."""
    return count_nonfinite(x) == 0
