"""The daemon's checkpoints: written on the core thread, between two events, counted and logged.

The files, their run and their health are `net.store.CheckpointStore`'s; this module is what the
daemon does around a write: count it, log it, and hand a failure back to whoever asked for it (an
HTTP request answers it, a periodic write only logs it; both leave it in the store's health).
"""

from __future__ import annotations

import logging

from ddiloco.core.syncer import SyncerState
from ddiloco.net import store
from ddiloco.net.telemetry import Metrics

__all__ = ["Checkpoints"]

log = logging.getLogger("ddiloco.syncer")


class Checkpoints:
    def __init__(self, checkpoint_store: store.CheckpointStore | None, metrics: Metrics):
        self.store, self.metrics = checkpoint_store, metrics

    @property
    def healthy(self) -> bool:
        """No checkpoint directory, or the last write succeeded."""
        return self.store is None or self.store.health.ok

    def write(self, state: SyncerState, reason: str) -> str | None:
        """Write one; returns what went wrong, if anything (also in `store.health`). The syncer goes on."""
        if self.store is None:
            return None
        try:
            written = self.store.write(state)
        except store.StoreError as exc:
            self.metrics.checkpoint_failures += 1
            log.error("%s (%s)", exc, reason)
            return str(exc)
        self.metrics.checkpoints += 1
        log.info("checkpoint %s (%d bytes, %s)", written.path.name, written.bytes, reason)
        return None
