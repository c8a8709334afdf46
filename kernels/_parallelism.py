"""Where a kernel runs: how a vector is cut into slices and whether the thread pool may be used.

Every kernel cuts its vector into at most SLICES_MAX contiguous slices, each a multiple of an
alignment unit (a codec block, or a cache-friendly chunk), and runs a serial loop per slice under
`prange`. Measured on 2 cores that beats `prange` over blocks 2-4x: each slice is one tight,
vectorised loop and the pool is woken once. The cut depends only on the length, never on the
number of threads, so every result, reductions included, is the same bits whatever the thread
count or driver (serial or parallel). Sums vectorised with reassociation (segment_sumsq) may still
differ in their last bits between CPU instruction sets, since the vector width sets the order.
"""

from __future__ import annotations

import functools
import os

import numpy as np

SLICES_MAX = 64
# Below this many elements one thread finishes before the pool would have woken up.
PARALLEL_ELEMENTS_MIN = 1 << 16
# Slice boundaries of unblocked kernels fall on multiples of this (64 KiB of float32): whole cache
# lines and whole vector registers at every boundary.
CHUNK_ELEMENTS = 1 << 14

_forked_child = False


def warmup_sizes(block: int) -> tuple[int, int]:
    """Two element counts that compile a kernel's serial driver and its parallel one: a few blocks,
    and one block more than the parallel threshold (the segment kernels go parallel on where the
    last segment ends, which warm-up puts half a block before the end)."""
    return 4 * block, (-(-PARALLEL_ELEMENTS_MIN // block) + 1) * block


def _mark_forked_child() -> None:
    # numba's OpenMP pool does not survive fork(): a forked child that enters a parallel region is
    # terminated. We start children with spawn, but if anything forks anyway the child keeps working
    # on the serial loops instead of dying.
    global _forked_child
    _forked_child = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_mark_forked_child)


_serial_only = False


def serial_only(on: bool = True) -> None:
    """Run every kernel of this process on its calling thread (`on`), or let large vectors use
    the thread pool again. For a process whose cores belong to something else, a learner's
    training step: its XLA threads hold the cores, and a pool woken beside them waits for its
    share. Measured in `ddiloco bench learner`'s loop, quantising a 109k-element fragment took
    1.5 ms with the pool and 0.3 ms on one thread (0.1 ms on idle cores). Results are the same
    bits either way (the cut does not depend on the driver)."""
    global _serial_only
    _serial_only = bool(on)


def use_parallel(elements: int) -> bool:
    """Whether a kernel over `elements` values should run its parallel driver."""
    return elements >= PARALLEL_ELEMENTS_MIN and not _forked_child and not _serial_only


@functools.lru_cache(maxsize=512)
def _bounds_cached(elements: int, unit: int, slices_max: int) -> np.ndarray:
    units = -(-elements // unit)
    slices = max(1, min(slices_max, units))
    # slice s starts at unit floor(s * units / slices): sizes differ by at most one unit
    bounds = np.arange(slices + 1, dtype=np.int64) * units // slices * unit
    bounds[-1] = elements  # the last unit may be partial
    bounds.flags.writeable = False
    return bounds


def slice_bounds(elements: int, unit: int, slices_max: int = SLICES_MAX) -> np.ndarray:
    """int64[s+1] element boundaries: 0, then multiples of `unit`, then `elements`.

    s = min(slices_max, ceil(elements / unit)) non-empty slices whose unit counts differ by at most
    one; `elements` need not be a multiple of `unit` (the last unit is short). A zero-length vector
    gets the single slice [0, 0]. The array is cached and read-only.
    """
    if elements < 0 or unit <= 0 or slices_max <= 0:
        raise ValueError(f"bad slicing request: elements={elements}, unit={unit}, slices_max={slices_max}")
    return _bounds_cached(int(elements), int(unit), int(slices_max))
