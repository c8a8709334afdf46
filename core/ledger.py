"""The token ledger: every token a learner reports ends in exactly one fate.

Tokens are counted per (learner, fragment) *window*: the stretch of training between two receipts
of fragment p by learner m (docs/algorithm.md, "Learner loop": the counters run since the learner last
received fragment p). A window's tokens end as:

- merged: they were in a push that took part in a merge,
- late: in a push that arrived after its round had closed,
- stale: in a push computed against an old version of the fragment,
- rejected: in a push refused for bad content (wrong size, NaN, duplicate...),
- lost: never pushed (trained after the push and then overwritten by the merged fragment, or the
  learner died before it could push). A push delivered before its learner died is decided with
  its round like any other.

A window is open while the learner trains; it closes when the learner reports that it holds a newer
version of the fragment (its counters reset) or when the learner is gone. The invariant is
`reported == merged + late + stale + rejected + lost + open`, checked by `check`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FATES = ("merged", "late", "stale", "rejected", "lost")


@dataclass
class _Window:
    tokens: int = 0  # the learner's counter as last reported
    fated: int = 0  # tokens of this window already given a fate by a push


@dataclass
class Ledger:
    totals: dict[str, int] = field(default_factory=lambda: {f: 0 for f in FATES})
    closed: int = 0  # tokens of closed windows (all fated)
    windows: dict[tuple[int, int], _Window] = field(default_factory=dict)
    # Fated tokens per learner (merged/late/stale/rejected; not lost), for the operator's per-learner
    # shares. Not in a checkpoint: a resumed syncer counts them from zero (a counter reset).
    by_learner: dict[int, dict[str, int]] = field(default_factory=dict)

    def report(self, learner: int, fragment: int, tokens: int, *, reset: bool) -> None:
        """The learner's window counter for `fragment` is now `tokens`; `reset` when the learner says
        it received a newer version since its last report (the previous window closed first)."""
        key = (learner, fragment)
        window = self.windows.setdefault(key, _Window())
        if reset:
            self._close(window)
            window = self.windows[key] = _Window()
        # A counter never shrinks inside a window; a smaller value would be a learner bug, and
        # counting it would unbalance the books, so the larger of the two is kept.
        window.tokens = max(window.tokens, tokens, window.fated)

    def fate(self, learner: int, fragment: int, tokens: int, fate: str) -> None:
        """A push carrying `tokens` of this window was decided as `fate`."""
        assert fate in FATES and fate != "lost", fate
        window = self.windows.setdefault((learner, fragment), _Window())
        # Only tokens not fated already in this window count (a second push of the same window,
        # e.g. after a stale rejection, carries the same counter again).
        fresh = max(0, tokens - window.fated)
        window.fated += fresh
        window.tokens = max(window.tokens, window.fated)
        self.totals[fate] += fresh
        if fresh:
            mine = self.by_learner.setdefault(learner, {})
            mine[fate] = mine.get(fate, 0) + fresh

    def learner_gone(self, learner: int, awaiting: frozenset[int] = frozenset()) -> None:
        """Close the learner's windows, except those of the fragments in `awaiting`: a push of
        theirs waits in an open round and takes part in its decision; `settle` closes them then."""
        for key in [k for k in self.windows if k[0] == learner and k[1] not in awaiting]:
            self._close(self.windows.pop(key))

    def settle(self, learner: int, fragment: int, tokens: int, fate: str) -> None:
        """The push a departed learner left waiting was decided as `fate`: book it, close its window.
        Nothing happens for a window that was not kept open (`learner_gone` booked it as lost)."""
        if (learner, fragment) not in self.windows:
            return
        self.fate(learner, fragment, tokens, fate)
        self._close(self.windows.pop((learner, fragment)))

    def _close(self, window: _Window) -> None:
        self.totals["lost"] += window.tokens - window.fated
        self.closed += window.tokens

    @property
    def open(self) -> int:
        return sum(w.tokens - w.fated for w in self.windows.values())

    @property
    def reported(self) -> int:
        return self.closed + sum(w.tokens for w in self.windows.values())

    def check(self) -> None:
        assert self.reported == sum(self.totals.values()) + self.open, (self.reported, self.totals, self.open)

    def of_learner(self, learner: int) -> dict[str, int]:
        """The tokens of `learner` given each fate by a push (lost tokens are not counted per learner)."""
        mine = self.by_learner.get(learner, {})
        return {f: mine.get(f, 0) for f in FATES if f != "lost"}

    def summary(self) -> dict[str, int]:
        return {"reported": self.reported, **self.totals, "open": self.open}
