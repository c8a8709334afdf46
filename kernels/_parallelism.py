"""Where a kernel runs: on the calling thread, or cut into slices over numba's thread pool.

Every wrapper takes `parallel: bool = True`. The caller decides, per call, whether the pool may be
used: a learner's codec work runs beside its training step, whose XLA threads hold the cores, and
a pool woken beside them waits for its share (measured in `ddiloco bench learner`'s loop: quantising
a 109k-element fragment took 1.5 ms with the pool, 0.3 ms on one thread). There is no process-wide
switch: two callers in one process (a test, an in-process experiment) never see each other's choice.

How a vector is cut, and why it holds from 2 to many cores:

- Elementwise kernels (every kernel but the sums of squares) cut the vector into one slice per
  thread numba has (`numba.get_num_threads()`, read at each call), each slice a multiple of an
  alignment unit (a codec block, or CHUNK_ELEMENTS) and at least SLICE_ELEMENTS_MIN long. numba's
  `prange` hands each thread one contiguous run of iterations, so one slice per thread is one tight,
  vectorised loop per thread and a single wake-up of the pool; more slices than threads only add
  loop overhead, fewer leave cores idle (a fixed cut of 64 slices, as before, would leave most of a
  96-core host idle). A kernel's result does not depend on the cut: each element is computed alone.
- The parallel threshold is PARALLEL_ELEMENTS_MIN whatever the thread count: it is where one
  thread's loop (tens of microseconds) outgrows the pool's wake-up, a fixed cost per call.
- Reductions (segment_sumsq*) keep a cut that depends on the length only (REDUCTION_SLICES_MAX
  slices), so their float sums, and the merges built on them, are the same bits on every host and
  thread count; a replay reproduces a merge exactly. They use at most that many threads.
- A round's fused merge works through each thread's slice in tiles of TILE_ELEMENTS: a tile's partial
  sums stay in cache while every contribution is added to them, so each contribution's bytes are read
  once and the accumulator never goes to memory. The contributions reach the loop as numba typed lists,
  fetched once per tile (a list item is reference-counted: fetched per block, 16 threads would contend
  for one counter).

Sums vectorised with reassociation (segment_sumsq) may still differ in their last bits between CPU
instruction sets, since the vector width sets the order.
"""

from __future__ import annotations

import functools
import os

# numba's OpenMP pool (its default threading layer where libgomp is present) spins its threads after
# each parallel region, waiting for the next. On a host whose cores are shared (a syncer beside its
# learners, a learner beside XLA's threads) that spinning is CPU taken from the others: `ddiloco
# bench learner --synthetic-step-ms 2 --params 10M` measured the syncer at 4.8 ms of CPU per step
# spinning, 1.9 ms passive. Passive threads sleep and are woken per region (tens of microseconds,
# small beside a kernel worth the pool). Set before numba loads the pool; a user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numba  # noqa: E402 - after the wait policy, which the pool reads when it loads
import numpy as np

# Slices of the reductions' fixed cut: threads beyond this many sit out a sum of squares.
REDUCTION_SLICES_MAX = 64
# Below this many elements one thread finishes before the pool would have woken up.
PARALLEL_ELEMENTS_MIN = 1 << 16
# Unblocked kernels cut at multiples of this (64 KiB of float32): whole cache lines and whole
# vector registers at every boundary.
CHUNK_ELEMENTS = 1 << 14
# The shortest slice worth a thread of its own: tens of microseconds of work, well above the cost of
# handing it out.
SLICE_ELEMENTS_MIN = 1 << 14
# A fused round's working set per thread: 64 KiB of float32 partial sums, which stay in the core's
# cache while every contribution's bytes stream past.
TILE_ELEMENTS = 1 << 14

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


def use_parallel(elements: int, parallel: bool = True) -> bool:
    """Whether a kernel over `elements` values runs its parallel driver: the caller allows it, the
    vector is long enough, there is more than one thread, and the pool can run in this process."""
    return bool(parallel) and elements >= PARALLEL_ELEMENTS_MIN and not _forked_child and numba.get_num_threads() > 1


def thread_bounds(elements: int, unit: int, parallel: bool = True) -> np.ndarray | None:
    """The cut of an elementwise kernel: int64 bounds of one slice per thread (at most, each a
    multiple of `unit` and about SLICE_ELEMENTS_MIN or more), or None to run on the calling thread."""
    if not use_parallel(elements, parallel):
        return None
    slices = min(numba.get_num_threads(), max(1, elements // max(unit, SLICE_ELEMENTS_MIN)))
    return slice_bounds(elements, unit, slices)


def tile_elements(block: int) -> int:
    """TILE_ELEMENTS rounded down to whole blocks (one block at least)."""
    return max(block, TILE_ELEMENTS // block * block)


def typed_list(arrays: list[np.ndarray]) -> numba.typed.List:
    """The arrays as a numba typed list, the container a fused round's kernel takes (all of one type;
    the wrappers pass read-only views, so every list has the type that warmup() compiles)."""
    return numba.typed.List(arrays)  # one bulk call: 20 us for four arrays, against 60 us appending each


@functools.lru_cache(maxsize=512)
def _bounds_cached(elements: int, unit: int, slices_max: int) -> np.ndarray:
    units = -(-elements // unit)
    slices = max(1, min(slices_max, units))
    # slice s starts at unit floor(s * units / slices): sizes differ by at most one unit
    bounds = np.arange(slices + 1, dtype=np.int64) * units // slices * unit
    bounds[-1] = elements  # the last unit may be partial
    bounds.flags.writeable = False
    return bounds


def slice_bounds(elements: int, unit: int, slices_max: int = REDUCTION_SLICES_MAX) -> np.ndarray:
    """int64[s+1] element boundaries: 0, then multiples of `unit`, then `elements`.

    s = min(slices_max, ceil(elements / unit)) non-empty slices whose unit counts differ by at most
    one; `elements` need not be a multiple of `unit` (the last unit is short). A zero-length vector
    gets the single slice [0, 0]. The array is cached and read-only.
    """
    if elements < 0 or unit <= 0 or slices_max <= 0:
        raise ValueError(f"bad slicing request: elements={elements}, unit={unit}, slices_max={slices_max}")
    return _bounds_cached(int(elements), int(unit), int(slices_max))
