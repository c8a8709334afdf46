"""The learner library: pytree <-> fragments, the per-step sync hook, peer recovery, learner tapes.

    from ddiloco.learner import DilocoSync, SyncConfig

    with DilocoSync.connect(params, SyncConfig(url=..., name=...)) as sync:
        params = sync.step(params, tokens=n)

docs/learner.md is the guide. The reference models, the demo and the experiments that use this
library live beside it (`ddiloco.reference`, `ddiloco.demo`, `ddiloco.experiments`).
"""

from ddiloco.learner.recovery import Recovered, RecoveryError
from ddiloco.learner.sync import (
    DilocoSync,
    FragmentSync,
    NotJoinedError,
    RecoverFn,
    SyncConfig,
)
from ddiloco.learner.tape import LearnerTape, LearnerTapeError, LearnerTapeWriter
from ddiloco.learner.transport import SnapshotOutbox, Taken, Transport
from ddiloco.learner.tree import TreeFragments, default_is_embedding, tensor_specs

__all__ = [
    "DilocoSync",
    "FragmentSync",
    "LearnerTape",
    "LearnerTapeError",
    "LearnerTapeWriter",
    "NotJoinedError",
    "RecoverFn",
    "Recovered",
    "RecoveryError",
    "SnapshotOutbox",
    "SyncConfig",
    "Taken",
    "Transport",
    "TreeFragments",
    "default_is_embedding",
    "tensor_specs",
]
