"""How far the training loop runs ahead of its devices: the newest step known to be computed.

With JAX's asynchronous dispatch a loop that does not wait for every step (one that reads its loss
every few steps, say) calls the hook at step t while the devices still compute step t - k. The
hook's push of a fragment due at step t can leave only once step t is computed, so a progress
report that says "step t" tells the syncer of a step whose push is k steps away. The syncer opens a
fragment's round when the global step reaches the fragment's due step and sizes the grace window
from the time its quorum then takes (core.grace): reports of dispatched steps make that quorum time
k steps longer, leave the window no slack, and the learners a step behind the first are merged a
version late. Reports of computed steps open the round when its first push can leave.

Whether a step is computed is asked of one output array of the step (`jax.Array.is_ready`, which
never waits); the outputs of one program become ready together. This holds a reference to that one
array per step not known computed, which the devices hold anyway as the input of the next step.
"""

from __future__ import annotations

from collections import deque
from typing import Any

__all__ = ["LEAD_STEPS_MAX", "DispatchLead"]

# Steps the loop may run ahead before the oldest is taken as computed: JAX bounds the programs in
# flight well below this, and the report never lags the loop by more.
LEAD_STEPS_MAX = 64


class DispatchLead:
    """The steps dispatched and not yet known computed, oldest first, each with its probe array."""

    def __init__(self, computed: int = 0) -> None:
        self.computed = computed  # the newest step known computed
        self._pending: deque[tuple[int, Any]] = deque()

    def dispatched(self, step: int, probe: Any) -> int:
        """Step `step` was dispatched and `probe` is one of its output arrays (None: its values are
        on the host, computed already); the newest step known computed now."""
        self.note(step, probe)
        while self._pending:
            step, probe = self._pending[0]
            if probe.is_deleted():
                # Donated to the next step: it says nothing of its own step's end. A later probe
                # will (the newest is never donated yet when the hook holds it).
                self._pending.popleft()
                continue
            if not probe.is_ready():
                break
            self._pending.popleft()
            self.computed = max(self.computed, step)
        return self.computed

    def note(self, step: int, probe: Any) -> None:
        """Step `step` was dispatched and `probe` is one of its output arrays, not asked about now:
        `dispatched`, at the next report, looks at it (a call of the hook that only counts)."""
        if probe is None:
            self._pending.clear()
            self.computed = max(self.computed, step)
            return
        self._pending.append((step, probe))
        if len(self._pending) > LEAD_STEPS_MAX:
            self.computed = max(self.computed, self._pending.popleft()[0])

    @property
    def pending(self) -> int:
        """Steps dispatched and not known computed: how far the loop runs ahead of its devices."""
        return len(self._pending)
