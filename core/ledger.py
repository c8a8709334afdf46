"""The token ledger: every token a learner reports ends in exactly one fate.

Tokens are counted per (learner, fragment) *window*: the stretch of training between two receipts
of fragment p by learner m (docs/algorithm.md, "Learner loop": the counters run since the learner last
received fragment p). A window's tokens end as:

- merged: they were in a push that took part in a merge on time (computed against the version the
  merge applied to),
- merged_late: in a push merged with a staleness of 1 to STALENESS_MAX versions (core.syncer),
  its weight discounted (docs/algorithm.md, "Late pushes"),
- late: in a push of zero weight that a merge left out,
- stale: protocol 1 only (a push against an old version was refused); stays 0 since protocol 2,
  kept so that older checkpoints and dashboards still read,
- rejected: in a push refused for bad content (wrong size, NaN...),
- lost: never pushed (trained after the push and then overwritten by the merged fragment, unless
  the learner carried that progress over the merge and says so (`report(carried=)`): those tokens
  move into its next window; or the learner died before it could push), or in a push too stale to
  merge (more than STALENESS_MAX versions behind). A push delivered before its learner died is
  decided with its round like any other.

A window is open while the learner trains; it closes when the learner reports that it holds a newer
version of the fragment (its counters reset) or when the learner is gone. An admitted push's tokens
are *held* (`hold`) until its round decides them (`decide`): a push waits for the next round of its
fragment while its learner may already have received a newer version and closed its window. Held
tokens count as open. The invariant is
`reported == merged + merged_late + late + stale + rejected + lost + open`, checked by `check`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FATES = ("merged", "merged_late", "late", "stale", "rejected", "lost")


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
    # Tokens of admitted pushes not decided yet, per (learner, fragment): one waiting push each
    # (a newer push of the same learner and fragment replaces or joins the older one, core.syncer).
    held: dict[tuple[int, int], int] = field(default_factory=dict)

    def report(self, learner: int, fragment: int, tokens: int, *, reset: bool, carried: int = 0) -> None:
        """The learner's window counter for `fragment` is now `tokens`; `reset` when the learner says
        it received a newer version since its last report (the previous window closed first). Of
        `tokens`, `carried` were trained under the previous version and kept over the merge: at a
        reset, that many of the closing window's unfated tokens move into the new window instead of
        being lost (at most as many as it has: reported once, fated once)."""
        key = (learner, fragment)
        window = self.windows.setdefault(key, _Window())
        if reset:
            moved = min(carried, window.tokens - window.fated)
            self._close(window, moved)
            window = self.windows[key] = _Window()
        # A counter never shrinks inside a window; a smaller value would be a learner bug, and
        # counting it would unbalance the books, so the larger of the two is kept.
        window.tokens = max(window.tokens, tokens, window.fated)

    def fate(self, learner: int, fragment: int, tokens: int, fate: str) -> None:
        """A push carrying `tokens` of this window was decided as `fate` on arrival (a rejection)."""
        assert fate in FATES, fate
        self._book(learner, fate, self._fresh(learner, fragment, tokens))

    def hold(self, learner: int, fragment: int, tokens: int) -> None:
        """A push carrying `tokens` of this window was admitted: they wait for its round's decision.
        Added to what an earlier push of the same window left held (the newer push covers it)."""
        key = (learner, fragment)
        self.held[key] = self.held.get(key, 0) + self._fresh(learner, fragment, tokens)

    def decide(self, learner: int, fragment: int, fate: str) -> None:
        """The waiting push of (learner, fragment) was decided as `fate`: its held tokens get it."""
        assert fate in FATES, fate
        self._book(learner, fate, self.held.pop((learner, fragment), 0))

    def _fresh(self, learner: int, fragment: int, tokens: int) -> int:
        """The tokens of a push not given to an earlier push of the same window (a second push of
        the window carries the same counter again, grown): marked as fated in the window."""
        window = self.windows.setdefault((learner, fragment), _Window())
        fresh = max(0, tokens - window.fated)
        window.fated += fresh
        window.tokens = max(window.tokens, window.fated)
        return fresh

    def _book(self, learner: int, fate: str, tokens: int) -> None:
        self.totals[fate] += tokens
        if tokens and fate != "lost":
            mine = self.by_learner.setdefault(learner, {})
            mine[fate] = mine.get(fate, 0) + tokens

    def learner_gone(self, learner: int) -> None:
        """Close the learner's windows. Its waiting pushes stay held: their rounds decide them."""
        for key in [k for k in self.windows if k[0] == learner]:
            self._close(self.windows.pop(key))

    def _close(self, window: _Window, moved: int = 0) -> None:
        """Close `window`; `moved` of its unfated tokens go on in the next window (reported there)."""
        self.totals["lost"] += window.tokens - window.fated - moved
        self.closed += window.tokens - moved

    @property
    def open(self) -> int:
        return sum(w.tokens - w.fated for w in self.windows.values()) + sum(self.held.values())

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
