"""When each fragment is synchronised (docs/algorithm.md, "Fragments and the schedule").

Fragment p has an offset t_p in [0, H) and is due at every global step t with t mod H == t_p. The
default offsets t_p = floor(p*H/P) spread the P fragments evenly, so with P = H one fragment starts
per step; with tau > 1 several are in flight at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ddiloco.errors import UserError

H_MAX = 1_000_000


class ScheduleError(UserError, ValueError):
    """An impossible schedule; the message says which value is wrong."""


@dataclass(frozen=True)
class Schedule:
    period: int  # H: steps between two synchronisations of the same fragment
    num_fragments: int  # P
    overlap: int = 2  # tau: steps a fragment may stay in flight before its merge is due
    offsets: tuple[int, ...] = field(default=())  # t_p; empty means the default floor(p*H/P)

    def __post_init__(self) -> None:
        if not isinstance(self.period, int) or not 1 <= self.period <= H_MAX:
            raise ScheduleError(f"period H must be an integer in [1, {H_MAX}], got {self.period!r}")
        if not isinstance(self.num_fragments, int) or self.num_fragments < 1:
            raise ScheduleError(f"number of fragments P must be a positive integer, got {self.num_fragments!r}")
        if not isinstance(self.overlap, int) or not 0 <= self.overlap <= self.period:
            raise ScheduleError(f"overlap tau must be an integer in [0, H={self.period}], got {self.overlap!r}")
        offsets = tuple(self.offsets) or default_offsets(self.period, self.num_fragments)
        if len(offsets) != self.num_fragments:
            raise ScheduleError(f"{len(offsets)} offsets given for {self.num_fragments} fragments")
        if any(not isinstance(t, int) or not 0 <= t < self.period for t in offsets):
            raise ScheduleError(f"every offset must be an integer in [0, H={self.period}), got {offsets!r}")
        object.__setattr__(self, "offsets", offsets)

    def due(self, step: int) -> tuple[int, ...]:
        """Fragments whose round opens at global step `step`, in index order."""
        phase = step % self.period
        return tuple(p for p, t in enumerate(self.offsets) if t == phase)

    def opened_between(self, start: int, stop: int) -> tuple[tuple[int, int], ...]:
        """(step, fragment) of every round that opens at a step in [start, stop), in step order.

        The global step can jump by several steps at once (it follows the learners), and no round may
        be skipped because of that."""
        if stop - start > self.period:
            start = stop - self.period  # each fragment opens once per period; older openings are superseded
        return tuple((t, p) for t in range(max(start, 0), stop) for p in self.due(t))


def default_offsets(period: int, num_fragments: int) -> tuple[int, ...]:
    """t_p = floor(p*H/P)."""
    return tuple(p * period // num_fragments for p in range(num_fragments))
