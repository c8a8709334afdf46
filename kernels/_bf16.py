"""float32 <-> bfloat16 (the upper 16 bits of a float32), the uncompressed-ish wire codec.

to_bf16 rounds to nearest, ties to even, on the bit pattern; finite values too large for bfloat16
round to Inf as IEEE rounding says. NaN stays NaN: its upper bits are kept and the quiet bit is set,
because plain truncation of a NaN whose payload sits in the low bits would give Inf.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ddiloco.kernels import _checks
from ddiloco.kernels._parallelism import CHUNK_ELEMENTS, thread_bounds

_ABS_MASK = np.uint32(0x7FFFFFFF)
_INF_BITS = np.uint32(0x7F800000)
_QUIET_BIT = np.uint32(0x0040)  # the top mantissa bit of a bfloat16


@njit(nogil=True, cache=True)
def _to_bf16_serial(xbits, out):
    # xbits: u32[m] (float32 bit patterns), out: u16[m]
    for i in range(xbits.size):
        b = xbits[i]
        lsb = (b >> np.uint32(16)) & np.uint32(1)
        rounded = (b + np.uint32(0x7FFF) + lsb) >> np.uint32(16)  # cannot wrap: b is not a NaN here
        nan = (b >> np.uint32(16)) | _QUIET_BIT
        out[i] = np.uint16(nan if (b & _ABS_MASK) > _INF_BITS else rounded)


@njit(parallel=True, nogil=True, cache=True)
def _to_bf16_parallel(xbits, out, bounds):
    for s in prange(bounds.size - 1):
        a = bounds[s]
        b = bounds[s + 1]
        _to_bf16_serial(xbits[a:b], out[a:b])


@njit(nogil=True, cache=True)
def _from_bf16_serial(u, outbits):
    # u: u16[m], outbits: u32[m] (the float32 result's bit patterns)
    for i in range(u.size):
        outbits[i] = np.uint32(u[i]) << np.uint32(16)


@njit(parallel=True, nogil=True, cache=True)
def _from_bf16_parallel(u, outbits, bounds):
    for s in prange(bounds.size - 1):
        a = bounds[s]
        b = bounds[s + 1]
        _from_bf16_serial(u[a:b], outbits[a:b])


def to_bf16(x: np.ndarray, *, out: np.ndarray | None = None, parallel: bool = True) -> np.ndarray:
    """uint16[n] bfloat16 bit patterns of float32[n] `x` (round to nearest even; NaN stays NaN)."""
    x = _checks.vector("x", x, np.float32)
    out = _checks.out_vector(out, np.uint16, x.size)
    _checks.disjoint(out=out, x=x)
    xbits = x.view(np.uint32)
    bounds = thread_bounds(x.size, CHUNK_ELEMENTS, parallel)
    if bounds is None:
        _to_bf16_serial(xbits, out)
    else:
        _to_bf16_parallel(xbits, out, bounds)
    return out


def from_bf16(u: np.ndarray, *, out: np.ndarray | None = None, parallel: bool = True) -> np.ndarray:
    """float32[n] from uint16[n] bfloat16 bit patterns (exact: every bfloat16 is a float32)."""
    u = _checks.vector("u", u, np.uint16)
    out = _checks.out_vector(out, np.float32, u.size)
    _checks.disjoint(out=out, u=u)
    outbits = out.view(np.uint32)
    bounds = thread_bounds(u.size, CHUNK_ELEMENTS, parallel)
    if bounds is None:
        _from_bf16_serial(u, outbits)
    else:
        _from_bf16_parallel(u, outbits, bounds)
    return out
