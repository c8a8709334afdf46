"""A (re)joining learner copies a healthy peer's state instead of starting from a fresh optimizer.

docs/algorithm.md, "Recovery, snapshots, replay": the learner gets the syncer's versions in the welcome,
copies parameters, inner-optimizer state and step from a live peer that holds those versions, and
falls back to the syncer's fragments plus its fresh optimizer state on any error (a log line says
why). Nothing the learner had before becomes global state: the syncer still gives it weight 0 until
it reports a received version of every fragment, and its own weights are never pushed as a base.

This module maps pytrees to a `net.peer` snapshot and back. Host copies are gathered per leaf (a
leaf sharded over several devices is gathered by `jax.device_get`), and adopted leaves are put back
with the sharding and dtype of the local leaf they replace, so the same code runs on any device.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.tree_util import tree_flatten_with_path, tree_structure, tree_unflatten

from ddiloco.errors import UserError
from ddiloco.learner.tree import leaf_path, put_all_like
from ddiloco.net import peer, session

__all__ = ["FORMAT", "Recovered", "RecoveryError", "adopt", "recover", "snapshot_bytes"]

log = logging.getLogger("ddiloco.learner")

FORMAT = 1


class RecoveryError(UserError, ValueError):
    """A peer's snapshot does not fit this learner (layout, structure, shapes, versions)."""


@dataclass(frozen=True)
class Recovered:
    params: Any
    opt_state: Any
    step: int
    versions: tuple[int, ...]
    source: str  # "peer <id>" or "syncer"
    seconds: float


def _leaves(tree: Any) -> list[tuple[str, Any]]:
    return [(leaf_path(keys), leaf) for keys, leaf in tree_flatten_with_path(tree)[0]]


def _host(leaf: Any) -> np.ndarray:
    return np.asarray(jax.device_get(leaf))


def snapshot_bytes(
    params: Any,
    opt_state: Any,
    step: int,
    versions: list[int],
    digest: str,
    extra_meta: dict | None = None,
    extra_arrays: dict[str, np.ndarray] | None = None,
) -> bytes:
    """The state a peer copies, as `net.peer` snapshot bytes (host copies taken now). A learner's
    local state for a consistent snapshot adds its sync counters (`extra_*`, learner.sync)."""
    arrays = {f"params/{path}": _host(leaf) for path, leaf in _leaves(params)}
    opt = None
    if opt_state is not None:
        opt = {"treedef": str(tree_structure(opt_state)), "leaves": [path for path, _ in _leaves(opt_state)]}
        arrays |= {f"opt/{i}": _host(leaf) for i, (_, leaf) in enumerate(_leaves(opt_state))}
    arrays |= {f"sync/{k}": v for k, v in (extra_arrays or {}).items()}
    meta = {
        "format": FORMAT,
        "step": int(step),
        "versions": [int(v) for v in versions],
        "layout_digest": digest,
        "opt": opt,
    }
    if extra_meta:
        meta["sync"] = extra_meta
    return peer.encode_snapshot(meta, arrays)


def adopt(
    snap: peer.Snapshot, params: Any, opt_state: Any, digest: str, current: tuple[int, ...]
) -> tuple[Any, Any, int, tuple[int, ...]]:
    """(params, opt_state, step, versions) from `snap`, each leaf on the local leaf's sharding;
    RecoveryError naming the first thing that does not match. The peer must hold a received
    version of every fragment; one older than the syncer's is fine, since the syncer's update of
    it is already on its way to a recovering learner and overwrites it at the next step."""
    meta = snap.meta
    if meta.get("format") != FORMAT or meta.get("layout_digest") != digest:
        raise RecoveryError(
            f"snapshot format {meta.get('format')} / layout {str(meta.get('layout_digest'))[:12]} is not ours"
        )
    versions = tuple(int(v) for v in meta.get("versions", ()))
    if len(versions) != len(current) or min(versions, default=-1) < 0:
        raise RecoveryError(f"snapshot versions {list(versions)} do not cover the syncer's {list(current)}")
    new_params = _put_back(snap, "params/", [p for p, _ in _leaves(params)], params)
    opt = meta.get("opt")
    if not isinstance(opt, dict) or opt.get("treedef") != str(tree_structure(opt_state)):
        raise RecoveryError("the peer's optimizer state has another pytree structure than ours")
    new_opt = _put_back(snap, "opt/", [str(i) for i in range(len(_leaves(opt_state)))], opt_state)
    return new_params, new_opt, int(meta["step"]), versions


def _put_back(snap: peer.Snapshot, prefix: str, names: list[str], like: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(like)
    expected = {prefix + n for n in names}
    present = {k for k in snap.arrays if k.startswith(prefix)}  # (sync/ arrays are read by learner.sync)
    if present != expected:
        raise RecoveryError(
            f"snapshot {prefix[:-1]} leaves differ: missing {sorted(expected - present)[:3]}, extra {sorted(present - expected)[:3]}"
        )
    out = []
    for name, old in zip(names, leaves):
        arr = snap.arrays[prefix + name]
        old_dtype = np.asarray(old).dtype if not hasattr(old, "dtype") else old.dtype
        if tuple(arr.shape) != tuple(np.shape(old)) or arr.dtype != old_dtype:
            raise RecoveryError(
                f"{prefix}{name}: the peer has {arr.dtype}{list(arr.shape)}, we have {old_dtype}{list(np.shape(old))}"
            )
        out.append(np.array(arr))
    return tree_unflatten(treedef, put_all_like(out, list(leaves)))


def recover(
    welcome: session.WelcomeInfo,
    params: Any,
    opt_state: Any,
    token: str | None,
    timeout_s: float,
    snapshot_bytes_max: int,
) -> Recovered:
    """Copy the first healthy peer that works; otherwise keep `params` and `opt_state` (the syncer's
    fragments arrive by themselves and overwrite every parameter)."""
    started = time.monotonic()
    current = tuple(welcome.versions)
    # Merges go on while a learner joins, so a live peer is often a version behind on a fragment:
    # those that hold the syncer's versions exactly come first, then the most up to date.
    healthy = sorted(
        (p for p in welcome.peers if len(p.versions) == len(current) and min(p.versions, default=-1) >= 0),
        key=lambda p: (tuple(p.versions) != current, -sum(p.versions), p.learner),
    )
    if not healthy:
        reason = "no peer listed" if not welcome.peers else "no listed peer holds every fragment"
        log.info("recovering from the syncer's fragments and a fresh optimizer state: %s", reason)
    for candidate in healthy:
        try:
            snap = peer.fetch_snapshot(candidate.url, token, timeout_s, snapshot_bytes_max)
            new_params, new_opt, step, versions = adopt(snap, params, opt_state, welcome.digest, current)
        except (peer.PeerError, RecoveryError) as exc:
            log.warning("not recovering from peer %d: %s", candidate.learner, exc)
            continue
        seconds = time.monotonic() - started
        log.info(
            "recovered step %d and versions %s from peer %d in %.2f s", step, list(versions), candidate.learner, seconds
        )
        return Recovered(new_params, new_opt, step, versions, f"peer {candidate.learner}", seconds)
    if healthy:
        log.info("recovering from the syncer's fragments and a fresh optimizer state: no peer could be used")
    return Recovered(params, opt_state, welcome.global_step, (), "syncer", time.monotonic() - started)
