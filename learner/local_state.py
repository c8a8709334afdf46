"""A learner's local state for a consistent snapshot (net.snapshot): written at the cut, and the
sync state read back from it when the learner restarts from that snapshot.

What is recorded beside the parameters and the optimizer state (recovery.snapshot_bytes): each
fragment's base and error-feedback residual as arrays, and the counters as metadata.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ddiloco.core import codec
from ddiloco.learner import recovery
from ddiloco.learner.fragment import FragmentSync
from ddiloco.net import peer

__all__ = ["fragments_of", "local_state_bytes", "sync_meta_of"]


def local_state_bytes(
    params: Any,
    opt_state: Any,
    step: int,
    fragments: tuple[FragmentSync, ...],
    name: str,
    learner: int,
    digest: str,
) -> bytes:
    """Everything this learner's future depends on: parameters, optimizer state, step, and the
    sync state (fragment versions held, their bases, counters since, error-feedback residuals)."""
    arrays = {f"base/{q}": f.base for q, f in enumerate(fragments) if f.base is not None}
    arrays |= {f"feedback/{q}": f.feedback.residual for q, f in enumerate(fragments) if f.feedback is not None}
    meta = {
        "steps": [f.steps for f in fragments],
        "tokens": [f.tokens for f in fragments],
        "name": name,
        "learner": learner,
    }
    versions = [f.version for f in fragments]
    return recovery.snapshot_bytes(params, opt_state, step, versions, digest, meta, arrays)


def sync_meta_of(snap: peer.Snapshot) -> dict:
    """The sync state's metadata of a local state (RecoveryError if it is not one)."""
    sync_meta = snap.meta.get("sync")
    if not isinstance(sync_meta, dict):
        raise recovery.RecoveryError("not a learner's local state of a snapshot (no sync state in it)")
    return sync_meta


def fragments_of(
    snap: peer.Snapshot, sync_meta: dict, versions: tuple[int, ...] | list[int], num: int
) -> tuple[FragmentSync, ...]:
    """The fragments' sync state recorded in a local state, at the versions adopted with it."""
    missing = [q for q in range(num) if f"sync/base/{q}" not in snap.arrays]
    if missing:
        raise recovery.RecoveryError(f"the local state has no base of fragments {missing}")
    return tuple(
        FragmentSync(
            versions[q],
            np.array(snap.arrays[f"sync/base/{q}"]),
            int(sync_meta["steps"][q]),
            int(sync_meta["tokens"][q]),
            codec.FeedbackState(np.array(snap.arrays[f"sync/feedback/{q}"]))
            if f"sync/feedback/{q}" in snap.arrays
            else None,
        )
        for q in range(num)
    )
