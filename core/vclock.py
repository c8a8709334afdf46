"""Vector clocks: which events of the syncer and the learners happened before which.

docs/algorithm.md, "Recovery, snapshots, replay". A clock maps a process name ("syncer", or a learner's
name) to a counter. The rules (docs/replay.md):

- the syncer ticks its own entry once for every event its core handles, after merging the clock
  carried by the learner message that became the event; whatever it sends for that event carries
  the resulting clock;
- a learner's client ticks its own entry before every message it sends and merges the clock of
  every message it receives.

A `VClock` is an immutable value: `tick` and `merge` return new clocks, so one thread may hand its
clock to another without a lock. Entries are bounded by `ENTRIES_MAX`; a clock above it is refused
rather than truncated, since dropping an entry would silently change what the clock orders.

Counters are bounded by `COUNTER_MAX` (2**53 - 1, what the wire carries). A clock merged from
another process may hold no counter above `MERGED_COUNTER_MAX` (2**52): a process that takes over a
counter of its own from a peer (a restarted syncer catching up on its entry) then still has 2**52
ticks of its own before `COUNTER_MAX`, which no run comes near, so a tick never overflows whatever a
peer sends. A peer's clock above it is corrupt and is refused (`check_mergeable`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

import orjson

from ddiloco.errors import UserError

ENTRIES_MAX = 4096  # distinct process names in one clock
NAME_CHARS_MAX = 256
COUNTER_MAX = 2**53 - 1  # what the wire can carry (exact in every JSON reader)
MERGED_COUNTER_MAX = 2**52  # the largest counter taken from another process's clock


class VClockError(UserError, ValueError):
    """A clock that cannot be built or merged (bad entry, too many entries); the message says which."""


class Order(str, enum.Enum):
    BEFORE = "before"  # every entry <= the other's, one strictly less
    AFTER = "after"
    EQUAL = "equal"
    CONCURRENT = "concurrent"


@dataclass(frozen=True)
class VClock:
    """Process name -> counter; absent names count 0. Build with `from_mapping` to validate."""

    entries: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", _checked(self.entries))

    def get(self, name: str) -> int:
        return self.entries.get(name, 0)

    def tick(self, name: str) -> VClock:
        """This clock with `name`'s own counter one higher (a local event or a send)."""
        counter = self.get(name) + 1
        if counter > COUNTER_MAX:
            raise VClockError(f"counter of {name!r} overflows {COUNTER_MAX}")
        return VClock({**self.entries, name: counter})

    def merge(self, other: VClock | Mapping[str, int]) -> VClock:
        """The entrywise maximum (on receipt of a message carrying `other`); refuses a clock that
        `check_mergeable` refuses."""
        theirs = other.entries if isinstance(other, VClock) else _checked(other)
        check_mergeable(theirs)
        if not theirs:
            return self
        merged = dict(self.entries)
        for name, counter in theirs.items():
            if counter > merged.get(name, 0):
                merged[name] = counter
        return VClock(merged)

    def compare(self, other: VClock) -> Order:
        names = set(self.entries) | set(other.entries)
        less = any(self.get(n) < other.get(n) for n in names)
        more = any(self.get(n) > other.get(n) for n in names)
        if less and more:
            return Order.CONCURRENT
        if less:
            return Order.BEFORE
        return Order.AFTER if more else Order.EQUAL

    def happens_before(self, other: VClock) -> bool:
        return self.compare(other) is Order.BEFORE

    def as_dict(self) -> dict[str, int]:
        """Sorted by name: the form the wire and the tape carry."""
        return dict(sorted(self.entries.items()))

    def to_json(self) -> bytes:
        return orjson.dumps(self.as_dict())


def check_mergeable(values: Mapping[str, int]) -> None:
    """Raise `VClockError` unless a clock with these (already checked) entries may be merged into
    another process's: no counter above `MERGED_COUNTER_MAX`."""
    for name, counter in values.items():
        if counter > MERGED_COUNTER_MAX:
            raise VClockError(
                f"clock entry {name[:40]!r} = {counter} is above {MERGED_COUNTER_MAX} (2**52): a corrupt counter,"
                " not merged"
            )


def from_mapping(values: Mapping[str, int]) -> VClock:
    return VClock(values)


def from_json(text: bytes | str) -> VClock:
    try:
        values = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise VClockError(f"clock is not JSON: {exc}") from exc
    if not isinstance(values, dict):
        raise VClockError(f"clock must be a JSON object, got {type(values).__name__}")
    return VClock(values)


def _checked(values: Mapping[str, int]) -> dict[str, int]:
    if not isinstance(values, Mapping):
        raise VClockError(f"clock must be a mapping of name to counter, got {type(values).__name__}")
    if len(values) > ENTRIES_MAX:
        raise VClockError(f"clock has {len(values)} entries, above the limit of {ENTRIES_MAX}")
    out = {}
    for name, counter in values.items():
        if not isinstance(name, str) or not 0 < len(name) <= NAME_CHARS_MAX:
            raise VClockError(f"clock entry name must be 1 to {NAME_CHARS_MAX} characters, got {str(name)[:40]!r}")
        if type(counter) is not int or not 0 <= counter <= COUNTER_MAX:
            raise VClockError(f"clock entry {name[:40]!r} must be an integer in [0, 2**53), got {str(counter)[:40]}")
        if counter:  # an absent name counts 0: leaving zeros out keeps one form per clock
            out[name] = counter
    return out
