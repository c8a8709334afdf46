"""One fragment's sync state on the learner, as a value, and the progress report built from them.

The hook (learner.sync) keeps a tuple of `FragmentSync`, one per fragment; the push side
(learner.pushes) and the arrival side (learner.arrivals) take one and hand back a new one.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ddiloco.core import codec
from ddiloco.net import session

__all__ = ["FragmentSync", "progress_report", "replaced"]


class FragmentSync(NamedTuple):
    """One fragment's sync state, as a value: the hook keeps a tuple of these, one per fragment."""

    version: int = -1  # the version held; -1: none yet (the learner has weight 0 until it holds all)
    base: np.ndarray | None = None  # that version's values as received: what outer gradients start from
    steps: int = 0  # inner steps since the version held arrived
    tokens: int = 0  # tokens trained on since then
    feedback: codec.FeedbackState | None = None  # error feedback's residual, when enabled
    # The syncer's published copy of `version` (core.publish), bit for bit: what the next delta
    # applies onto. None when the version held came from elsewhere (a peer, a snapshot) and no whole
    # copy of it has arrived: deltas are then ignored until one does. Never changed in place.
    published: np.ndarray | None = None
    # Of `tokens`, those trained under the version before and carried over its merge (learner.arrivals).
    carried: int = 0
    # While `published` is None: the syncer's published copy of an older version than `version`, and
    # that version (a whole copy sent when this learner joined, before its peer's newer version was
    # adopted), followed along the deltas until it reaches `version` and becomes `published`
    # (learner.arrivals.reach). Never changed in place.
    trail: tuple[int, np.ndarray] | None = None

    def counted(self, tokens: int, steps: int = 1) -> FragmentSync:
        """`steps` more inner steps (one by default), of `tokens` tokens in all."""
        # Built field by field, not by _replace: _replace's keyword handling cost more than the rest.
        v, base, done, toks, feedback, published, carried, trail = self
        return FragmentSync(v, base, done + steps, toks + tokens, feedback, published, carried, trail)

    def received(self, version: int, values: np.ndarray, published: np.ndarray | None = None) -> FragmentSync:
        """A version arrived and was applied: it is the new base, and the counters start again."""
        return self._replace(
            version=version, base=values, steps=0, tokens=0, published=published, carried=0, trail=None
        )


def replaced(fragments: tuple[FragmentSync, ...], q: int, frag: FragmentSync) -> tuple[FragmentSync, ...]:
    """`fragments` with fragment q's state replaced by `frag`."""
    return fragments[:q] + (frag,) + fragments[q + 1 :]


def progress_report(step: int, fragments: tuple[FragmentSync, ...]) -> session.ProgressInfo:
    """The progress report at global step `step`: per fragment, the version held and the steps and
    tokens trained on since (of those, the tokens carried over its merge)."""
    if not fragments:
        return session.ProgressInfo(step, (), (), (), ())
    # One pass over the fragments (this runs at every call of the hook), transposed by zip.
    versions, steps, tokens, carried = zip(*[(f.version, f.steps, f.tokens, f.carried) for f in fragments])
    return session.ProgressInfo(step, versions, steps, tokens, carried)
