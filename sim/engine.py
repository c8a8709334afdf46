"""The event loop: one pass over a failure stream, exact chip-time accounting between events.

State per learner is a handful of counts (slices active, in repair, repaired and waiting to join), a
pause end and a join deadline; pending repairs, pause ends and join deadlines sit in one heap. Since
the slices of a learner are interchangeable, a failure picks the state of the slice it hits by the
counts (`pick`), not by slice identity, so memory does not grow with chips.

Rules (docs/simulator.md gives the reasoning):
- synchronous job (not elastic): a failure stops the job for `restart_s` (a spare slice takes the
  failed one's place); a failure during a restart is folded into it;
- elastic job: a failure on an active slice sends it to repair and starts a scale-down pause
  (`scale_down_s`); repaired slices wait to join at the next reconfiguration, or after `join_wait_s`
  pay a scale-up pause (`scale_up_s`) of their own; a learner with no active slice scales up as soon
  as one comes back; any change landing during a pause is folded into that pause;
- a learner progresses when it has active slices, is not paused, and at least `quorum` learners
  progress (with fewer the syncer cannot merge and learners block once their overlap runs out);
- with quorum K > 1 a learner faster than the K-th fastest progressing one waits for it, so its chips
  are busy only `cap / speed` of the time.

The kernel is compiled on first use (numba, cached on disk); `warm_up()` does that on purpose.
"""

from __future__ import annotations

import heapq

import numpy as np
from numba import njit

# Indices of the kernel's statistics vector.
STAT_USEFUL_CHIP_S = 0  # chip-seconds of productive training (chips x busy fraction x time)
STAT_UP_S = 1  # wall time with global progress
STAT_PARTIAL_S = 2  # wall time with global progress but fewer than M learners progressing
STAT_RECONFIGURATIONS = 3  # restarts and scale pauses actually paid (folded ones not counted)
STAT_INTERRUPTIONS = 4  # failures that hit a running chip
STAT_COUNT = 5

_REPAIR_DONE = 0
_PAUSE_END = 1
_JOIN_DEADLINE = 2


@njit(nogil=True, cache=True)
def _pause(pause_end, m, t, length_s, stats):
    """Start a pause of learner m unless one is running (a change during a pause folds into it).

    Returns the new pause end, or -1.0 when none started; the caller queues the end event.
    """
    if t < pause_end[m]:
        return -1.0
    pause_end[m] = t + length_s
    stats[STAT_RECONFIGURATIONS] += 1.0
    return pause_end[m]


@njit(nogil=True, cache=True)
def _rate(active, pause_end, speed, t, quorum, chips_per_slice, spread, buf):
    """(useful chip-seconds per second, learners progressing) of the state at time t."""
    m_count = active.shape[0]
    n_prog = 0
    for m in range(m_count):
        if active[m] > 0 and t >= pause_end[m]:
            buf[n_prog] = speed[m]
            n_prog += 1
    if n_prog < quorum:
        return 0.0, n_prog
    cap = np.inf
    if spread and quorum > 1:
        cap = np.sort(buf[:n_prog])[n_prog - quorum]  # the K-th fastest progressing learner
    rate = 0.0
    for m in range(m_count):
        if active[m] > 0 and t >= pause_end[m]:
            busy = 1.0 if speed[m] <= cap else cap / speed[m]
            rate += active[m] * chips_per_slice * busy
    return rate, n_prog


@njit(nogil=True, cache=True)
def run_events(
    fail_t,  # (n,) float64 sorted
    fail_learner,  # (n,) int64
    fail_pick,  # (n,) float64 in [0, 1)
    fail_repair_s,  # (n,) float64
    slices,  # (M,) int64 slices per learner
    speed,  # (M,) float64 relative speed per learner
    chips_per_slice,
    elastic,
    quorum,
    restart_s,
    scale_down_s,
    scale_up_s,
    join_wait_s,
    horizon_s,
):
    """Simulate [0, horizon_s) and return the statistics vector (STAT_* indices), float64."""
    m_count = slices.shape[0]
    n = fail_t.shape[0]
    active = slices.copy()
    repairing = np.zeros(m_count, dtype=np.int64)
    waiting = np.zeros(m_count, dtype=np.int64)
    pause_end = np.zeros(m_count)
    deadline = np.full(m_count, np.inf)
    buf = np.empty(m_count)
    spread = False
    for m in range(m_count):
        spread = spread or speed[m] != speed[0]
    stats = np.zeros(STAT_COUNT)
    heap = [(np.inf, -1, -1)]  # sentinel: numba infers the element type from it
    i = 0
    t_prev = 0.0
    rate, n_prog = _rate(active, pause_end, speed, 0.0, quorum, chips_per_slice, spread, buf)
    while True:
        t_fail = fail_t[i] if i < n else np.inf
        t_heap = heap[0][0]
        t = min(t_fail, t_heap, horizon_s)
        dt = t - t_prev
        if rate > 0.0:
            stats[STAT_USEFUL_CHIP_S] += rate * dt
            stats[STAT_UP_S] += dt
            if n_prog < m_count:
                stats[STAT_PARTIAL_S] += dt
        t_prev = t
        if t >= horizon_s:
            break
        if t_fail <= t_heap:
            m = fail_learner[i]
            if not elastic:
                stats[STAT_INTERRUPTIONS] += 1.0
                end = _pause(pause_end, m, t, restart_s, stats)
                if end >= 0.0:
                    heapq.heappush(heap, (end, _PAUSE_END, m))
            else:
                x = fail_pick[i] * slices[m]
                if x < repairing[m]:
                    pass  # the slice is already out: its chips are not running
                elif x < repairing[m] + waiting[m]:
                    waiting[m] -= 1
                    repairing[m] += 1
                    heapq.heappush(heap, (t + fail_repair_s[i], _REPAIR_DONE, m))
                else:
                    stats[STAT_INTERRUPTIONS] += 1.0
                    active[m] -= 1
                    repairing[m] += 1
                    heapq.heappush(heap, (t + fail_repair_s[i], _REPAIR_DONE, m))
                    # The reconfiguration that drops the slice also takes in every repaired one.
                    active[m] += waiting[m]
                    waiting[m] = 0
                    deadline[m] = np.inf
                    end = _pause(pause_end, m, t, scale_down_s, stats)
                    if end >= 0.0:
                        heapq.heappush(heap, (end, _PAUSE_END, m))
            i += 1
        else:
            _, kind, m = heapq.heappop(heap)
            if kind == _REPAIR_DONE:
                repairing[m] -= 1
                waiting[m] += 1
                if active[m] == 0 or join_wait_s == 0.0:
                    active[m] += waiting[m]
                    waiting[m] = 0
                    deadline[m] = np.inf
                    end = _pause(pause_end, m, t, scale_up_s, stats)
                    if end >= 0.0:
                        heapq.heappush(heap, (end, _PAUSE_END, m))
                elif deadline[m] == np.inf and join_wait_s < np.inf:
                    deadline[m] = t + join_wait_s
                    heapq.heappush(heap, (deadline[m], _JOIN_DEADLINE, m))
            elif kind == _JOIN_DEADLINE and deadline[m] == t:
                deadline[m] = np.inf
                if waiting[m] > 0:
                    active[m] += waiting[m]
                    waiting[m] = 0
                    end = _pause(pause_end, m, t, scale_up_s, stats)
                    if end >= 0.0:
                        heapq.heappush(heap, (end, _PAUSE_END, m))
            # _PAUSE_END (or a superseded deadline) changes no count: the rate below picks it up.
        rate, n_prog = _rate(active, pause_end, speed, t, quorum, chips_per_slice, spread, buf)
    return stats
