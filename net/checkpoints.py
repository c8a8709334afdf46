"""The daemon's checkpoints: written on the core thread, between two events, counted and logged."""

from __future__ import annotations

import logging
from pathlib import Path

from ddiloco.core.syncer import SyncerState
from ddiloco.net import store
from ddiloco.net.telemetry import Metrics

__all__ = ["Checkpoints"]

log = logging.getLogger("ddiloco.syncer")


class Checkpoints:
    def __init__(self, directory: Path | None, kept: int, metrics: Metrics):
        self.directory, self.kept, self.metrics = directory, kept, metrics

    def write(self, state: SyncerState, reason: str) -> None:
        """A checkpoint that cannot be written is counted and logged; the syncer goes on."""
        if self.directory is None:
            return
        try:
            written = store.write(self.directory, state, self.kept)
        except store.StoreError as exc:
            self.metrics.checkpoint_failures += 1
            log.error("%s", exc)
            return
        self.metrics.checkpoints += 1
        log.info("checkpoint %s (%d bytes, %s)", written.path.name, written.bytes, reason)
