"""The arrival side of the sync hook: the chain of updates of each fragment (deltas onto the
syncer's published copy, whole copies), the wait behind a push of the fragment, and the progress
carried over an arriving version.

Pure functions over values; the hook (learner.sync) puts what they decide into the parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import NamedTuple

import numpy as np

from ddiloco.core import publish as publishing
from ddiloco.learner.fragment import FragmentSync
from ddiloco.learner.pushes import LastPush
from ddiloco.net import session

__all__ = [
    "DEFER_CALLS_MAX",
    "Deferred",
    "Kept",
    "Prefetched",
    "Reached",
    "apply_update",
    "apply_update_kept",
    "defer",
    "forget",
    "kept_progress",
    "reach",
    "received",
]

# The most calls an arrived version waits behind a push of its fragment, or for the background
# thread's decode of it (`defer`), before the call waits for them. A host slower than the step (2 ms
# steps, a 10M-parameter model on 2 cores: a fragment's host work takes 3 to 5 ms) needs a few calls;
# 2 made most applies wait (bench learner --synthetic-step-ms 2: +84% against +63% with 8).
DEFER_CALLS_MAX = 8

# fragment -> (the updates that arrived for it, in order; the calls they waited). Arrived versions of
# fragments whose push is in flight or went out in this call: applied once the push went out at an
# earlier call, so that the report of the new version leaves after the push of the old one (the
# syncer books the push's tokens in the window of the version it was computed from). Replaced, never
# changed in place.
Deferred = Mapping[int, tuple[list[session.UpdateInfo], int]]


def defer(
    deferred: Deferred, updates: Mapping[int, list[session.UpdateInfo]], busy: Collection[int]
) -> tuple[list[tuple[int, list[session.UpdateInfo]]], Deferred]:
    """(the chains to apply now, in fragment order; those that wait): the updates of each fragment
    that arrived, after those that waited, except where a push of the fragment is in flight or went
    out in this call (`busy`): those wait, at most DEFER_CALLS_MAX calls (with one fragment due every
    step, a push of it is always in flight)."""
    arrived = dict(deferred)
    for q, chain in updates.items():
        earlier, waited = arrived.get(q, ([], 0))
        arrived[q] = (earlier + list(chain), waited)
    ready, waiting = [], {}
    for q, (chain, waited) in sorted(arrived.items()):
        if q in busy and waited < DEFER_CALLS_MAX:
            waiting[q] = (chain, waited + 1)
        else:
            ready.append((q, chain))
    return ready, waiting


def forget(deferred: Deferred, fragments: Collection[int]) -> Deferred:
    """`fragments` start a new session: their waiting versions belong to the old one."""
    return {q: d for q, d in deferred.items() if q not in fragments}


class Reached(NamedTuple):
    """Where a fragment's chain of updates led: the fragment's state (its published copy replaced
    when a whole copy of the version held arrived), the newest version reached and its published copy."""

    frag: FragmentSync
    version: int
    published: np.ndarray | None


# (an update, the published copy it applies onto or None for a whole copy) -> the published copy it
# makes, where it was computed beforehand (learner.background), else None
Prefetched = Callable[[session.UpdateInfo, "np.ndarray | None"], "np.ndarray | None"]


def _none_prefetched(update: session.UpdateInfo, onto: np.ndarray | None) -> None:
    return None


def reach(
    frag: FragmentSync,
    chain: list[session.UpdateInfo],
    parallel: bool,
    prefetched: Prefetched = _none_prefetched,
) -> Reached:
    """The updates of a fragment that arrived, in order: each delta onto the published copy of
    exactly its base version (else ignored: a whole copy follows, docs/protocol.md "Delta
    broadcast"), a whole copy as it is. `prefetched` hands over what was computed beforehand.

    A version held without the syncer's published copy (adopted from a peer or a snapshot) gets it
    from a whole copy of that version, or from a whole copy of an older one followed along the
    deltas up to it (`FragmentSync.trail`): the syncer sends a joining learner its versions whole
    and the deltas after them, while the peer it recovers from may already hold a newer version.
    Without that, the deltas onto the version held were ignored until the syncer sent it whole
    again (core.syncer.WHOLE_RESEND_STUCK_S), and the pushes made meanwhile were refused as stale."""
    version, published = frag.version, frag.published
    for update in chain:
        if published is None and update.version <= version:
            frag = _follow_trail(frag, update, parallel)
            published = frag.published
            continue
        if update.whole:
            if update.version <= version:
                continue
            ready = prefetched(update, None)
            published = ready if ready is not None else apply_update(None, update, parallel)
        else:
            if published is None or update.base_version != version:
                continue
            ready = prefetched(update, published)
            published = ready if ready is not None else apply_update(published, update, parallel)
        version = update.version
    return Reached(frag, version, published)


def _follow_trail(frag: FragmentSync, update: session.UpdateInfo, parallel: bool) -> FragmentSync:
    """`frag` (no published copy of its version) after `update` of a version not newer than the one
    it holds: a whole copy starts the trail, a delta onto the trail's version moves it on, and the
    trail that reaches the version held is its published copy (its base stays: this learner's outer
    gradient holds its own progress only). Anything else is not on the way: ignored."""
    if update.whole:
        trail = (update.version, apply_update(None, update, parallel))
    elif frag.trail is not None and update.base_version == frag.trail[0]:
        trail = (update.version, apply_update(frag.trail[1], update, parallel))
    else:
        return frag
    if trail[0] == frag.version:
        return frag._replace(published=trail[1], trail=None)
    return frag._replace(trail=trail)


class Kept(NamedTuple):
    """The progress a fragment keeps over an arriving version: what it trained since `anchor`
    (the parameters then), in `steps` steps and `tokens` tokens."""

    anchor: np.ndarray
    steps: int
    tokens: int


def kept_progress(frag: FragmentSync, last: LastPush | None, keep_progress: bool, alpha: float) -> Kept | None:
    """The progress the fragment keeps over an arriving version: since this learner's last push
    from the version held (`last`, `pushes.last_from`: what that push carried is in the syncer's
    hands), else since that version. None: overwrite (an alpha mix, or no version held yet).
    docs/algorithm.md, "Progress carried over a merge"."""
    if not keep_progress or alpha or frag.base is None or frag.version < 0:
        return None
    if last is not None:
        return Kept(last.theta, frag.steps - last.steps, frag.tokens - last.tokens)
    return Kept(frag.base, frag.steps, frag.tokens)


def received(frag: FragmentSync, version: int, published: np.ndarray, kept: Kept | None) -> FragmentSync:
    """The fragment's state once `version` (its published copy `published`) is in the parameters,
    with the progress `kept` over it, if any, counted as carried."""
    new = frag.received(version, published, published)
    return new if kept is None else new._replace(steps=kept.steps, tokens=kept.tokens, carried=kept.tokens)


def apply_update_kept(
    onto: np.ndarray | None, update: session.UpdateInfo, anchor: np.ndarray | None, parallel: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """`apply_update`, and the difference published - anchor that puts the progress kept since
    `anchor` over it (None without an anchor); a delta's in one pass (core.publish.apply_apart)."""
    if anchor is None or update.whole:
        published = apply_update(onto, update, parallel)
        return published, None if anchor is None else published - anchor
    assert onto is not None, "a delta applies onto a published copy"
    return publishing.apply_apart(onto, update.encoded, anchor, parallel=parallel)


def apply_update(onto: np.ndarray | None, update: session.UpdateInfo, parallel: bool) -> np.ndarray:
    """The published copy `update` makes, as a new array: a whole copy decoded, or onto + the
    decoded delta (the bits the syncer's published copy has); `onto` is None for a whole copy."""
    if update.whole:
        return update.encoded.decode(parallel=parallel)
    assert onto is not None, "a delta applies onto a published copy"
    out = onto.copy()
    publishing.apply(out, update.encoded, parallel=parallel)
    return out
