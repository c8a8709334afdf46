"""The typed items of the daemon's core queue (net.core_loop): everything the core thread handles."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ddiloco.net import messages as msg

__all__ = ["Closed", "CoreItem", "Incoming", "Opened", "SnapshotStart", "SnapshotTimeout", "Wake"]


@dataclass(frozen=True)
class Opened:
    conn: int


@dataclass(frozen=True)
class Incoming:
    """A complete message from a learner's connection, as the wire decoded it."""

    conn: int
    message: msg.Message
    nbytes: int = 0  # its frames' bytes, taken from the readers' budget (net.budget) until handled


@dataclass(frozen=True)
class Closed:
    conn: int
    reason: str


@dataclass(frozen=True)
class Wake:
    """A timer the shell asked for (net.shell.Link.wake) is due."""

    token: int


@dataclass(frozen=True)
class SnapshotStart:
    """Queued like an event: the cut falls exactly between the events before it and after it."""

    reason: str
    done: asyncio.Future


@dataclass(frozen=True)
class SnapshotTimeout:
    snapshot: int


CoreItem = Opened | Incoming | Closed | Wake | SnapshotStart | SnapshotTimeout
