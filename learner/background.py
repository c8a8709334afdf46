"""The hook's one background thread: the host work of pushes and arrivals, done while the training
step runs.

At the step where fragment p is due, the hook starts the device-to-host copy of p's leaves and hands
this thread the rest of the push: waiting for the copy, the increment over the last push and its
quantisation (`pushes.encode_increment`). The training thread then spends the step's device time
(or, on a CPU learner, the other core) instead of its own. Where the transport takes pushes from
another thread (`sender`: the websocket clients), this thread sends the push as soon as its bytes
exist (`Send`), and the first call after that only books it (no call waits for this thread's
work: a fragment due again before its push went out skips that due step); otherwise the next call
sends it. (Sent at the
next call, the push of a loop that waits for each step left a whole step after its bytes existed.)

The result is the same bytes the training thread would have computed at the next call: the job's
inputs (the copied leaves, the last push of p from the version held, p's error-feedback residual)
cannot change between the two calls, since only booking a push of p or applying a version of p
changes them, and the hook books p's push before either. The hook checks that at the booking
(`Encoding.still_valid`) and computes the push itself where it does not hold (a job that sent its
push must hold: an assertion), so a replay or a simulation on a virtual clock, whose transports
have no `sender`, gets the same pushes at the same calls with or without this thread; the learner's
tape records a push at the call that booked it, wherever it was sent from.

Arrivals: the client tells this thread of each fragment update as it lands (`offer`, on the
client's thread), and the thread applies it onto the published copy the fragment will hold by then
(the copy the hook last held, or the one the thread made from the update before) and subtracts the
anchor of the progress kept over it (arrivals.kept_progress). When the hook takes the update, it uses
that result if it was computed from the very arrays the hook holds (`published`, `difference`),
and computes it itself otherwise: the parameters are the same bits either way, and a transport that
tells nothing (a replay, a simulation) takes the second way every time.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from ddiloco.core import codec
from ddiloco.core.events import Push
from ddiloco.learner import arrivals, pushes
from ddiloco.net import session

__all__ = ["DECODED_MAX", "Background", "Encoded", "Encoding", "Prepared", "PushWork", "Send", "encode_push"]

# Updates of one fragment decoded ahead and not taken yet, at most: past it the oldest is dropped
# (the hook then decodes it itself). Each holds two fragment-sized host arrays and, where the hook
# told where the fragment's leaves live, the difference placed there (one fragment on its devices);
# a loop that takes its updates every step finds one at a time.
DECODED_MAX = 1

# (the difference, float32[padded]) -> it cut into the fragment's leaves and put on their devices
# (learner.tree.TreeFragments.place, bound to a fragment and its placement)
Place = Callable[[np.ndarray], list]


class _Decoded(NamedTuple):
    update: session.UpdateInfo
    onto: np.ndarray | None  # the published copy the delta went onto; None: a whole copy
    published: np.ndarray
    anchor: np.ndarray | None  # what was subtracted (None: nothing)
    difference: np.ndarray | None  # published - anchor
    placed: list | None  # the difference on the leaves' devices (None: not placed)


class Prepared(NamedTuple):
    """What the hook adds to a fragment for an arrived version: published - anchor, and the same
    already put where the fragment's leaves were when the hook last told (None: not placed; the
    hook checks the place before using it, learner.tree.TreeFragments.fits)."""

    difference: np.ndarray
    placed: list | None


class Encoded(NamedTuple):
    """A push's host work, done: the host copy of the fragment and the push's payload (parsed: views
    into its bytes), with the error-feedback residual it leaves; and where this thread sent the push
    itself (`Send`), the push as sent and whether the transport took it."""

    theta: np.ndarray
    payload: codec.Encoded
    feedback: codec.FeedbackState | None
    push: Push | None = None  # None: not sent here; the hook sends it at the next call
    sent: bool = False


# The push's payload -> (the push, whether the transport took it): sends it from this thread, as soon
# as its bytes exist, rather than at the hook's next call (a step later). Made by the hook from the
# transport's `sender`, with the push's fields fixed at the call that started it.
Send = Callable[[codec.Encoded], tuple[Push, bool]]


class PushWork(NamedTuple):
    """What a push's host work reads: how to finish the fragment's host copy
    (`finish_gather(fragment, leaves)`), the push state and the push, the fragment's error-feedback
    residual, and the codec's settings."""

    finish_gather: Any
    state: pushes.Pushes
    flight: pushes.InFlight
    feedback: codec.FeedbackState | None
    codec_name: str
    error_feedback: bool
    block: int


def encode_push(work: PushWork, parallel: bool) -> Encoded:
    """A push's host work, on whichever thread calls it: the host copy, then the increment over the
    last push (`pushes.encode_increment`), parsed as the push carries it."""
    w = work
    theta = w.finish_gather(w.flight.fragment, w.flight.leaves)
    payload, left = pushes.encode_increment(
        w.state, w.flight, theta, w.feedback, w.codec_name, w.error_feedback, w.block, parallel
    )
    return Encoded(theta, codec.parse(payload), left)


class Encoding(NamedTuple):
    """A push's host work under way, with the inputs it was started from (compared by identity at
    the send: the state values are replaced, never changed in place)."""

    future: Future
    last: pushes.LastPush | None
    feedback: codec.FeedbackState | None
    sends: bool = False  # the job sends the push itself

    def still_valid(self, last: pushes.LastPush | None, feedback: codec.FeedbackState | None) -> bool:
        """Whether the push's inputs are still these: the increment's base (the last push's host
        copy; its skip count may have changed) and the residual."""
        same_last = last is self.last or (last is not None and self.last is not None and last.theta is self.last.theta)
        return same_last and feedback is self.feedback

    def result(self) -> Encoded:
        """Waits for the job; re-raises what it raised."""
        return self.future.result()

    def done(self) -> bool:
        """Whether the job has ended (`result` then returns at once)."""
        return self.future.done()


class Background:
    """One worker thread, started at the first job; jobs run in the order submitted."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # the pool's start and stop, and the two maps below
        self._closed = False
        # fragment -> (version, its published copy, the anchor of the progress kept over the next,
        # where to place the difference or None): what the next delta of the fragment applies onto
        self._onto: dict[int, tuple[int, np.ndarray, np.ndarray | None, Place | None]] = {}
        self._decoded: OrderedDict[int, _Decoded] = OrderedDict()  # id(update) -> its result
        self._pending: dict[int, tuple[session.UpdateInfo, Future]] = {}  # id(update) -> its job, not done
        # Jobs ended so far, counted once each has its result (a done callback, on this thread): a
        # hook that sees it unchanged knows no push went out and no decode ended since it last looked.
        self.finished = 0

    def _submit(self, job: Any, update: session.UpdateInfo | None = None) -> Future | None:
        """Queue `job` (None once closed); a decode of `update` is registered as pending in the same
        hold of the lock, so that the job's own removal of it cannot come first."""
        with self._lock:
            if self._closed:
                return None
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddiloco-sync")
            future = self._pool.submit(job)
            future.add_done_callback(self._count_finished)
            if update is not None:
                self._pending[id(update)] = (update, future)
            return future

    def _count_finished(self, _: Future) -> None:
        # On the worker thread (or the submitting one, where the job ended first). It only grows: a
        # hook that compares it with a value it read sees any job that ended since.
        self.finished += 1

    def encode(self, work: PushWork, send: Send | None = None) -> Encoding:
        """Start a push's host work (`encode_push`) on this thread (serial kernels: the worker is one
        thread beside the training step), and with `send`, send the push from here when done."""

        def job() -> Encoded:
            done = encode_push(work, False)
            if send is None:
                return done
            push, sent = send(done.payload)
            if sent:
                self._pushed(work.flight.fragment, work.flight.frag.version, done.theta)
            return done._replace(push=push, sent=sent)

        last = pushes.last_from(work.state, work.flight.fragment, work.flight.frag.version)
        future = self._submit(job)
        if future is None:  # closed: done at the send, as without this thread
            future = Future()
            future.set_result(encode_push(work, False))
        return Encoding(future, last, work.feedback, send is not None)

    # ---- arrivals ----------------------------------------------------------------------------------

    def holds(
        self, q: int, version: int, published: np.ndarray, anchor: np.ndarray | None, place: Place | None = None
    ) -> None:
        """The hook holds `version` of fragment q with this published copy, and keeps the progress
        since `anchor` over the next version (None: overwrites); `place` puts a difference where the
        fragment's leaves live (None: the hook places it). Where this thread has decoded a later
        version onto this very copy already, it goes on from there, with the new anchor."""
        with self._lock:
            known = self._onto.get(q)
            if known is not None and known[0] > version and self._descends(q, published):
                self._onto[q] = (known[0], known[1], anchor, place)
            else:
                self._onto[q] = (version, published, anchor, place)

    def _pushed(self, q: int, version: int, theta: np.ndarray) -> None:
        """This thread sent a push of fragment q from `version`: the progress kept over the next
        version now starts at its host copy `theta`, as the hook will say when it books the push
        (`holds`). Said here first, an update that arrives before that call is decoded with the
        right anchor, and the hook finds the difference ready rather than computing it on the
        training thread. Nothing changes where no progress is kept (no anchor) or the hook holds
        another version; a wrong guess costs only that: `difference` matches anchors by identity."""
        with self._lock:
            known = self._onto.get(q)
            if known is not None and known[0] == version and known[2] is not None:
                self._onto[q] = (version, known[1], theta, known[3])

    def _descends(self, q: int, published: np.ndarray) -> bool:
        """Whether a decoded update of q waiting to be taken went onto `published` (this thread is
        ahead of the hook on the same arrays). Called with the lock held."""
        return any(d.update.fragment == q and d.onto is published for d in self._decoded.values())

    def offer(self, update: session.UpdateInfo) -> None:
        """An update of a fragment arrived (called on the client's thread): decode it here."""
        self._submit(lambda: self._decode(update), update)

    def _decode(self, update: session.UpdateInfo) -> None:
        q = update.fragment
        try:
            self._decode_onto(update, q)
        finally:
            with self._lock:
                self._pending.pop(id(update), None)

    def _decode_onto(self, update: session.UpdateInfo, q: int) -> None:
        with self._lock:
            known = self._onto.get(q)
        if update.whole:
            onto = None
        elif known is not None and known[0] == update.base_version:
            onto = known[1]
        else:
            return  # not onto what the hook will hold: it decodes the update itself
        anchor, place = (known[2], known[3]) if known is not None else (None, None)
        published, difference = arrivals.apply_update_kept(onto, update, anchor, False)
        placed = None if difference is None or place is None else place(difference)
        with self._lock:
            self._onto[q] = (update.version, published, anchor, place)
            self._decoded[id(update)] = _Decoded(update, onto, published, anchor, difference, placed)
            mine = [k for k, d in self._decoded.items() if d.update.fragment == q]
            for key in mine[: max(0, len(mine) - DECODED_MAX)]:
                del self._decoded[key]

    def published(self, update: session.UpdateInfo, onto: np.ndarray | None) -> np.ndarray | None:
        """The published copy `update` makes onto `onto` (None: a whole copy), if this thread made
        it from that very array, else None (arrivals.Prefetched). Waits for it where this thread is
        at it: the same bits, and the work is not done twice."""
        with self._lock:
            pending = self._pending.get(id(update))
        if pending is not None and pending[0] is update:
            pending[1].result()
        with self._lock:
            d = self._decoded.get(id(update))
        if d is None or d.update is not update or d.onto is not onto:
            return None
        return d.published

    def decoding(self, updates: Collection[session.UpdateInfo]) -> bool:
        """Whether this thread is still at the decode of any of `updates` (`published` would wait)."""
        with self._lock:
            return any(id(u) in self._pending and self._pending[id(u)][0] is u for u in updates)

    def difference(self, published: np.ndarray, anchor: np.ndarray) -> Prepared | None:
        """published - anchor (and where placed, the same on the devices), if this thread computed
        it for these very arrays, else None."""
        with self._lock:
            for d in self._decoded.values():
                if d.published is published and d.anchor is anchor and d.difference is not None:
                    return Prepared(d.difference, d.placed)
        return None

    def taken(self, updates: Collection[session.UpdateInfo]) -> None:
        """The hook took these updates: what was decoded of them is no longer wanted."""
        with self._lock:
            for update in updates:
                self._decoded.pop(id(update), None)

    def forget(self, fragments: Collection[int]) -> None:
        """`fragments` start a new session: what this thread knows of them belongs to the old one."""
        with self._lock:
            for q in fragments:
                self._onto.pop(q, None)
            for key in [k for k, d in self._decoded.items() if d.update.fragment in fragments]:
                del self._decoded[key]
            for key in [k for k, (u, _) in self._pending.items() if u.fragment in fragments]:
                del self._pending[key]

    def close(self) -> None:
        """Waits for the jobs under way (their results are no longer wanted) and stops the thread."""
        with self._lock:
            self._closed, pool, self._pool = True, self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
