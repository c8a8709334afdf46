"""What the daemon records of each core step: the syncer's vector clock and the event tape.

The vector clock lives here in the shell, not in the core state: no decision of the core depends on
it, so the core, `state_hash` and the checkpoint format stay as they are, and the tape records it
beside each event. Recording only reads: the core gets the same event and `now` with or without a
tape. Runs on the core thread only.
"""

from __future__ import annotations

import logging

from ddiloco.core import tape as tapes
from ddiloco.core.events import Effect, Event
from ddiloco.core.syncer import SyncerState
from ddiloco.core.vclock import VClock, VClockError
from ddiloco.net import recording

__all__ = ["SYNCER_CLOCK_NAME", "Recorder"]

log = logging.getLogger("ddiloco.syncer")
SYNCER_CLOCK_NAME = "syncer"  # the syncer's entry in every vector clock


class Recorder:
    def __init__(self, tape: recording.TapeWriter | None):
        self.tape = tape
        self.vclock = VClock()  # replaced, never changed: an immutable value
        self.carried: dict[str, int] | None = None  # the clock the next event's learner message carried
        self._index: int | None = None

    def before(self, event: Event, now: float) -> None:
        """Advance the syncer's clock (merging the learner's) and tape the event."""
        try:
            clock = self.vclock.merge(self.carried or {})
        except VClockError as exc:
            log.warning("not merging a learner's clock into the syncer's: %s", exc)
            clock = self.vclock
        self.carried = None
        self.vclock = clock.tick(SYNCER_CLOCK_NAME)
        self._index = self._write(lambda t: t.event(event, now, self.vclock))

    def after(self, event: Event, effects: list[Effect], state: SyncerState, now: float) -> None:
        """Tape the checks of what the core did (state hash, merges)."""
        index, self._index = self._index, None
        if index is not None:
            self._write(lambda t: t.checks(index, state, effects))

    def close(self, state: SyncerState) -> None:
        self._write(lambda t: t.close(state))

    def _write(self, write):
        """Run one tape write; a tape that cannot be written stops recording, loudly, never the syncer."""
        if self.tape is None:
            return None
        try:
            return write(self.tape)
        except (tapes.TapeError, OSError) as exc:
            log.error("event tape stopped, the run goes on unrecorded from here: %s", exc)
            tape, self.tape = self.tape, None
            try:
                tape.abandon()
            except OSError:
                pass  # the disk already failed the write above; that error is the one logged
            return None
