"""The push side of the sync hook, as a value: the hold-back, the host copies in flight, this
learner's last push of each fragment, and the encoding of a push as an increment.

Pure functions that take a `Pushes` and hand back a new one; the hook (learner.sync) does the I/O
around them: starting and finishing the host copies, the transport, the tape.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, NamedTuple

import numpy as np

from ddiloco.core import codec
from ddiloco.learner.fragment import FragmentSync

__all__ = [
    "PUSH_SKIPS_LIMIT",
    "PUSH_SKIPS_MAX",
    "InFlight",
    "LastPush",
    "Pushes",
    "donated",
    "encode_increment",
    "flying",
    "forget",
    "given_up",
    "hold_back",
    "last_from",
    "refused",
    "sent",
    "started",
    "take",
    "waits_on_push",
]

# The default of `SyncConfig.push_skips_max`: the most due steps of a fragment skipped while this
# learner's last push of it, from the version it still holds, awaits its merged version (the
# hold-back). A push made before that version arrives is stale by construction: the syncer merges it
# onto a version that already holds the previous push, and with outer momentum the stale pushes of
# one learner compound (a single learner stepping in 1 ms under the default Nesterov 0.9 diverged).
# Past this many skipped due steps, on a rejoin and after any error from the syncer the learner
# pushes again: the increment since its last push, so nothing is counted twice (docs/protocol.md,
# "One push from a base, and then an increment"). Generous: a learner stepping in 1 ms with 4 fragments due every 4 steps
# meets its due steps faster than a loaded syncer's round trip.
PUSH_SKIPS_MAX = 16
PUSH_SKIPS_LIMIT = 1_000_000  # beyond, a push lost in transit would stall a fragment for good


class LastPush(NamedTuple):
    """This learner's last push of a fragment: its base version, the due steps skipped since
    (PUSH_SKIPS_MAX), and what it pushed: the host copy of the parameters and the counters then. The
    next push from the same base is the increment over it (theta - the parameters then), so no
    progress is pushed twice."""

    base: int
    skips: int
    theta: np.ndarray
    steps: int
    tokens: int


class InFlight(NamedTuple):
    """A push on its way: fragment `fragment`'s host copy started at `step`, with the fragment's
    sync state then (its base, version and counters are what the push carries)."""

    fragment: int
    step: int
    frag: FragmentSync
    leaves: list
    # The push's host work started on the hook's background thread (learner.background.Encoding),
    # or None: done at the send.
    job: Any = None


class Pushes(NamedTuple):
    """The push side's state. Its mappings are replaced, never changed in place."""

    in_flight: tuple[InFlight, ...] = ()  # pushes whose host copies started, booked at a later call
    # fragment -> this learner's last push of it; void once a newer version is held
    last: Mapping[int, LastPush] = {}
    # due steps skipped behind a push not merged back yet or on its way; their tokens go with the next push
    held: int = 0
    skipped: int = 0  # pushes given up: their leaves were deleted (a donating step) meanwhile


def last_from(pushes: Pushes, q: int, version: int) -> LastPush | None:
    """This learner's last push of fragment q if it was made from `version` (the version held), else
    None: a push from an older version is in a version since, and void."""
    last = pushes.last.get(q)
    return last if last is not None and last.base == version else None


def waits_on_push(pushes: Pushes, q: int, version: int, skips_max: int) -> bool:
    """Whether fragment q's due steps are skipped now: this learner's last push of q, from the
    version it holds (`version`), has not come back merged yet (PUSH_SKIPS_MAX)."""
    last = last_from(pushes, q, version)
    return last is not None and last.skips < skips_max


def flying(pushes: Pushes, q: int) -> bool:
    """Whether a push of fragment q is on its way: its host copy started, and not booked yet."""
    return any(f.fragment == q for f in pushes.in_flight)


def hold_back(
    pushes: Pushes, due: tuple[int, ...], fragments: tuple[FragmentSync, ...], skips_max: int
) -> tuple[Pushes, tuple[int, ...]]:
    """Of the fragments the schedule makes due, those skipped: behind a push not merged back yet
    (counted against PUSH_SKIPS_MAX), or behind one still on its way (its host work not done: one
    push of a fragment at a time, so a host that falls behind skips due steps rather than queue
    pushes; the skipped progress goes with the next push)."""
    if not due:  # most calls: nothing due, nothing to rebuild
        return pushes, ()
    waiting = tuple(q for q in due if waits_on_push(pushes, q, fragments[q].version, skips_max))
    held = tuple(q for q in due if q in waiting or flying(pushes, q))
    last = dict(pushes.last)
    for q in waiting:
        last[q] = last[q]._replace(skips=last[q].skips + 1)
    return pushes._replace(last=last, held=pushes.held + len(held)), held


def started(pushes: Pushes, flight: InFlight) -> Pushes:
    """A push whose host copy started: a later call books it (learner.sync)."""
    return pushes._replace(in_flight=(*pushes.in_flight, flight))


def take(
    pushes: Pushes, fragment: int | None = None, ready: Callable[[InFlight], bool] | None = None
) -> tuple[Pushes, tuple[InFlight, ...]]:
    """The pushes in flight (of `fragment` only, if given; of those, the `ready` ones only, if
    given), in the order started, taken out."""
    # Each flight judged once: `ready` may turn true meanwhile (a send on another thread), and a
    # flight judged twice could be both taken and left in flight, and booked twice.
    chosen = [(fragment is None or f.fragment == fragment) and (ready is None or ready(f)) for f in pushes.in_flight]
    rest = tuple(f for f, c in zip(pushes.in_flight, chosen) if not c)
    return pushes._replace(in_flight=rest), tuple(f for f, c in zip(pushes.in_flight, chosen) if c)


def donated(flight: InFlight) -> bool:
    """Whether a training step that donates its parameters freed the push's leaves before the copy
    was read (the push is then given up)."""
    return any(getattr(leaf, "is_deleted", lambda: False)() for leaf in flight.leaves)


def encode_increment(
    pushes: Pushes,
    flight: InFlight,
    theta: np.ndarray,
    feedback: codec.FeedbackState | None,
    codec_name: str,
    error_feedback: bool,
    block: int,
    parallel: bool,
) -> tuple[bytes, codec.FeedbackState | None]:
    """The push of `flight`, whose host copy is `theta`, as bytes; with error feedback, also the
    residual it leaves for the next push of the fragment.

    The progress since this learner's last push of the fragment from the same version (that one is
    in the syncer's hands), else since the version: each step's progress is pushed once."""
    last = last_from(pushes, flight.fragment, flight.frag.version)
    since = flight.frag.base if last is None else last.theta
    # One pass over the fragment for int4 (the difference, its check for NaN and Inf and its
    # quantisation fused: codec.encode_delta), not three; the same bytes as encoding since - theta.
    if not error_feedback:
        return codec.encode_delta(since, theta, None, codec_name, block, parallel=parallel)[0], feedback
    return codec.encode_delta(
        since, theta, feedback or codec.feedback_init(theta.size), codec_name, block, parallel=parallel
    )


def sent(pushes: Pushes, flight: InFlight, theta: np.ndarray) -> Pushes:
    """The push of `flight` went out: the next one from the same version is the increment over it."""
    frag = flight.frag
    last = {**pushes.last, flight.fragment: LastPush(frag.version, 0, theta, frag.steps, frag.tokens)}
    return pushes._replace(last=last)


def given_up(pushes: Pushes) -> Pushes:
    """A push given up (`donated`): the counters run on and the next push of the fragment carries them."""
    return pushes._replace(skipped=pushes.skipped + 1)


def refused(pushes: Pushes, skips_max: int) -> Pushes:
    """The syncer answered with an error: a refused push comes back as no version, so the next due
    step of every fragment pushes (its increment) rather than wait."""
    return pushes._replace(last={q: last._replace(skips=skips_max) for q, last in pushes.last.items()})


def forget(pushes: Pushes, fragments: Collection[int]) -> Pushes:
    """`fragments` start a new session: what was under way for them belongs to the old one."""
    return pushes._replace(
        in_flight=tuple(f for f in pushes.in_flight if f.fragment not in fragments),
        last={q: o for q, o in pushes.last.items() if q not in fragments},
    )
