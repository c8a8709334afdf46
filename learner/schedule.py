"""The push schedule a syncer's welcome gives: which fragments are due at which step, and which
of them this learner serves yet (it holds a version of every fragment of their syncer or shard).

A value (`Schedule`) and pure functions of it; the hold-back behind an outstanding push is the push
side's (learner.pushes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from ddiloco.core import shards
from ddiloco.learner.fragment import FragmentSync
from ddiloco.net import session

__all__ = [
    "Schedule",
    "caught_up",
    "due_fragments",
    "holds_shard_of",
    "newest_global_step",
    "next_phase_step",
    "rescheduled",
    "scheduled_at",
    "schedule_of",
    "serves_any",
]


def due_fragments(period: int, offsets: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
    """phase -> the fragments pushed at the steps of that phase (step mod period), in index order."""
    due: dict[int, tuple[int, ...]] = {}
    for q, t in enumerate(offsets):
        due[t] = due.get(t, ()) + (q,)
    return due


class Schedule(NamedTuple):
    period: int = 1
    due: Mapping[int, tuple[int, ...]] = {}  # the welcome's schedule, by phase (`due_fragments`)
    shard_of: tuple[tuple[int, ...], ...] = ()  # fragment -> the fragments of its shard (core.shards)


def schedule_of(welcome: session.WelcomeInfo, num: int) -> Schedule:
    """The schedule of a first welcome, for `num` fragments."""
    shard_of = tuple(shards.owned(shards.owner(q, welcome.shards), welcome.shards, num) for q in range(num))
    return rescheduled(Schedule(shard_of=shard_of), welcome, num)


def rescheduled(schedule: Schedule, welcome: session.WelcomeInfo, num: int) -> Schedule:
    """The schedule after a welcome (a first one or a rejoin's): its period and offsets."""
    offsets = welcome.offsets or (0,) * num
    return schedule._replace(period=welcome.period, due=due_fragments(welcome.period, offsets))


def holds_shard_of(schedule: Schedule, fragments: tuple[FragmentSync, ...], q: int) -> bool:
    """Whether this learner holds a version of every fragment of fragment q's shard (with one
    syncer: of every fragment). Until then it has weight 0 there: it neither pushes nor reports
    to it. The other shards are not held up by one whose fragments are on their way."""
    return all(fragments[p].version >= 0 for p in schedule.shard_of[q])


def scheduled_at(schedule: Schedule, fragments: tuple[FragmentSync, ...], step: int) -> tuple[int, ...]:
    """The fragments the schedule makes due at `step`, of those whose syncer (or shard) is served:
    none while one of its fragments' versions is missing (`holds_shard_of`)."""
    due = schedule.due.get(step % schedule.period) if fragments else None
    if not due:  # most steps
        return ()
    return tuple(q for q in due if holds_shard_of(schedule, fragments, q))


def next_phase_step(schedule: Schedule, step: int) -> int:
    """The first step after `step` at one of the schedule's phases: where a fragment may fall due
    and, the welcome's offsets being the rounds' too, where one's round opens. With no phase, a
    period on (a bound, not a step that matters)."""
    for s in range(step + 1, step + schedule.period + 1):
        if s % schedule.period in schedule.due:
            return s
    return step + schedule.period


def serves_any(schedule: Schedule, versions: tuple[int, ...]) -> bool:
    """Whether this learner, holding `versions` (-1: none yet), holds every fragment of some syncer
    or shard (`holds_shard_of`): then it reports its progress."""
    if not versions:
        return False
    if min(versions) >= 0:  # every fragment held: the case at every step but the first
        return True
    return any(all(versions[p] >= 0 for p in shard) for shard in schedule.shard_of)


def newest_global_step(updates: Mapping[int, list[session.UpdateInfo]]) -> int:
    """The newest global step the syncer (or any of its shards) sent with these updates; -1: none."""
    return max((u.global_step for chain in updates.values() for u in chain), default=-1)


def caught_up(
    schedule: Schedule, fragments: tuple[FragmentSync, ...], step: int, global_step: int
) -> tuple[int, tuple[int, ...]]:
    """(the step to count from, the fragments due at the steps skipped): a learner at `step` that
    hears of the syncer's `global_step` further on moves up to it. Learners push at their own step of
    the schedule while the syncer opens a fragment's round at the global step (the fastest learners'),
    so a learner whose steps fall behind would push after the round closed, late, and be merged a
    version later and discounted (docs/algorithm.md, "Late pushes"). Moved up, it pushes the
    fragments due in between now, into the rounds that are open, with the steps it has trained."""
    if global_step <= step:
        return step, ()
    due: list[int] = []
    for s in range(step + 1, step + 1 + min(global_step - step, schedule.period)):
        due.extend(q for q in scheduled_at(schedule, fragments, s) if q not in due)
    return global_step, tuple(due)
