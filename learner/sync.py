"""The per-step sync hook a JAX training loop calls: `params = sync.step(params, tokens=n)`.

ALGORITHM.md, "Learner loop". Each call, between two inner steps and without waiting on the
network: counts the step and its tokens for every fragment; applies fragment versions that have
arrived (overwrite, or an alpha mix) and resets their counters; answers the syncer's requests with
the compressed outer gradient base_p - theta_p; and reports progress. The network runs on the
client's own thread; a syncer that is down only means no merges for a while.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jax
import numpy as np
from ddiloco import kernels
from ddiloco.core import codec
from ddiloco.core.layout import layout_from_description
from ddiloco.learner import recovery
from ddiloco.learner.tree import TreeFragments, default_is_embedding, tensor_specs
from ddiloco.net import peer, session
from ddiloco.net.client import ClientConfig, ThreadedClient
from ddiloco.net.peer import PeerConfig, PeerServer, SnapshotBox

log = logging.getLogger("ddiloco.learner")


def check_alpha(alpha: float) -> None:
    """The mix of an arrived fragment into the learner's own: 0 overwrites; 1 would never apply it."""
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"alpha must lie in [0, 1), got {alpha}")


@dataclass(frozen=True)
class SyncConfig:
    url: str
    name: str
    token: str | None = None
    ca_file: Path | None = None  # wss://: the CA certificate(s) the syncer's certificate must chain to (net.tls)
    codec: str = "int4"
    alpha: float = 0.0  # 0: overwrite with the merged fragment (the paper's default)
    # Error feedback (ours, core.codec): what compression lost from an outer gradient is added to the
    # next one of the same fragment; reset when the learner rejoins.
    error_feedback: bool = False
    welcome_timeout_s: float = 60.0
    # Serve this learner's state to (re)joining peers (net.peer); None: do not serve.
    peer: PeerConfig | None = None
    recover_timeout_s: float = 60.0  # fetching a peer's snapshot, per peer tried
    snapshot_bytes_max: int = 16 << 30  # the largest peer snapshot accepted
    # Between the steps where a round opens, progress reports at most this often (net.client.ClientConfig).
    progress_interval_s: float = 0.5
    # Codec kernels on the training thread only, never numba's thread pool (kernels.serial_only):
    # the cores are the training step's. For the whole process, which a learner normally is.
    serial_kernels: bool = True

    def __post_init__(self) -> None:
        codec.parse_codec(self.codec)
        if self.recover_timeout_s <= 0 or self.snapshot_bytes_max <= 0:
            raise ValueError("recover_timeout_s and snapshot_bytes_max must be positive")
        check_alpha(self.alpha)
        if self.error_feedback and codec.parse_codec(self.codec) is codec.Codec.FP32:
            raise ValueError("error feedback needs a lossy codec (fp32 loses nothing)")


class DilocoSync:
    """One learner's side of Decoupled DiLoCo. Construct with the initial parameters (they become
    global state only if the syncer holds none and asks for them), then call `step` every step.

    `transport` is how it reaches the syncer: by default a `ThreadedClient` to `config.url`. Any
    object with the same non-blocking methods works (`wait_welcome`, `progress`, `push`, `init`,
    `take`, `close`, the `refused` attribute); `learner.experiment` passes an in-process one that
    feeds the syncer core on a virtual clock."""

    def __init__(
        self, params: Any, config: SyncConfig, is_embedding: Callable[[str], bool] = default_is_embedding,
        transport: Any = None, tape: Any = None, recover_fn: Callable[..., recovery.Recovered] = recovery.recover,
        snapshots: Any = None,
    ):
        self.config = config
        if config.serial_kernels:
            kernels.serial_only()
        codec.warm_up([config.codec])  # before joining: see codec.warm_up
        # `tape` (a learner.tape.LearnerTapeWriter) records what the hook takes from the network;
        # `recover_fn` and `snapshots` are how a replay (learner.replay) stands in for the peers.
        self.tape = tape
        self.recover_fn = recover_fn
        self.calls = 0  # calls of `step`: the tape's clock
        self.snapshots = snapshots if snapshots is not None else SnapshotBox()
        self.peer_server = None
        if config.peer is not None and transport is None:
            self.peer_server = PeerServer(self.snapshots, replace(config.peer, token=config.peer.token or config.token))
        peer_url = self.peer_server.url if self.peer_server else ""
        try:
            self.client = transport if transport is not None else ThreadedClient(
                ClientConfig(url=config.url, name=config.name, tensors=tensor_specs(params, is_embedding), token=config.token,
                             ca_file=config.ca_file, peer_url=peer_url, progress_interval_s=config.progress_interval_s)
            )
            welcome = self.client.wait_welcome(config.welcome_timeout_s)
        except BaseException:
            self.close()
            raise
        self.welcome = welcome
        if tape is not None:
            tape.welcome(1, welcome)
        self.learner_id = welcome.learner
        self.layout = layout_from_description(welcome.layout)
        self.tree = TreeFragments(params, self.layout, is_embedding)
        p = self.layout.num_fragments
        self.step_count = welcome.global_step  # a (re)joining learner continues the syncer's count
        self.versions = [-1] * p
        self.base: list[np.ndarray | None] = [None] * p  # the version of each fragment last received
        self.steps = [0] * p
        self.tokens = [0] * p
        self.feedback: list[codec.FeedbackState | None] = [None] * p
        self.merged_versions_applied = 0
        self.welcomes_seen = 1
        self.recovered_from, self.recovery_s = "init" if welcome.needs_init else "syncer", 0.0
        if welcome.needs_init:
            self._send_init(params)

    def _send_init(self, params: Any) -> None:
        """The syncer holds no parameters and asked this learner for them (only then do a learner's
        own weights become global state)."""
        for q in range(self.layout.num_fragments):
            values = self.tree.gather(params, q)
            payload = codec.encode(values, "fp32")
            if self.tape is not None:
                self.tape.init(self.calls, q, payload)
            self.client.init(q, payload)
            self.base[q], self.versions[q] = values, 0
        log.info("learner %d sent the initial parameters (version 0)", self.learner_id)

    def _rejoin(self, params: Any, welcome: session.WelcomeInfo) -> None:
        """A new welcome: the client reconnected (a new learner id; the syncer resends every
        fragment and the learner has weight 0 until it holds them), or the learner asked for the
        initial parameters died and this one is asked instead."""
        self.learner_id = welcome.learner
        self.versions = [-1] * self.layout.num_fragments
        self.base = [None] * self.layout.num_fragments
        self.steps = [0] * self.layout.num_fragments
        self.tokens = [0] * self.layout.num_fragments
        self.feedback = [None] * self.layout.num_fragments
        if welcome.needs_init:
            self._send_init(params)
        else:
            log.info("rejoined the syncer as learner %d", self.learner_id)

    def recover(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """Call once after construction, before the first step: (params, opt_state) copied from a
        healthy peer that holds the syncer's current versions, or the arguments unchanged (the
        syncer's fragments then arrive and overwrite every parameter). `recovered_from` says which."""
        if self.welcome.needs_init or any(v >= 0 for v in self.versions):
            self.recovered_from = "init"
            return params, opt_state
        got = self.recover_fn(
            self.welcome, params, opt_state, self.config.token, self.config.recover_timeout_s, self.config.snapshot_bytes_max
        )
        self.recovered_from, self.recovery_s = got.source, got.seconds
        if self.tape is not None:  # the adopted state, as bytes a replay adopts the same way
            copied = recovery.snapshot_bytes(got.params, got.opt_state, got.step, list(got.versions), self.layout.digest) if got.versions else None
            self.tape.recovered(got.source, got.step, got.versions, copied)
        if got.versions:
            self.step_count = got.step
            self.versions = list(got.versions)
            # The base is the copied parameters, not the peer's base: the outer gradient this
            # learner pushes then holds its own progress only, not a second copy of the peer's.
            self.base = [self.tree.gather(got.params, q) for q in range(self.layout.num_fragments)]
        return got.params, got.opt_state

    def step(self, params: Any, tokens: int, opt_state: Any = None) -> Any:
        """Account one inner step of `tokens` tokens; return `params` with arrived fragments applied.
        Give `opt_state` to let (re)joining peers copy the optimizer state too."""
        if tokens < 0:
            raise ValueError(f"tokens must be non-negative, got {tokens}")
        # The step boundary is where this step's parameters exist. With JAX's asynchronous dispatch
        # a loop runs steps ahead of the device, and a request then waits both for the loop to come
        # round and for the queue to drain: measured in the demo, a push left 350 ms (3.5 steps)
        # after its request arrived, half the pushes missed their grace window and 47% of tokens
        # were merged; waiting here, 85 ms and 93%.
        jax.block_until_ready(params)
        self.step_count += 1
        self.calls += 1
        for q in range(len(self.steps)):
            self.steps[q] += 1
            self.tokens[q] += tokens
        requests, updates, errors, (welcomes, welcome) = self.client.take()
        if self.tape is not None:
            self.tape.take(self.calls, requests, updates, errors, welcomes, welcome, welcomes != self.welcomes_seen)
        if welcomes != self.welcomes_seen:
            self.welcomes_seen = welcomes
            self._rejoin(params, welcome)
            requests = []  # asked of the old session
        for err in errors:
            log.warning("syncer: %s: %s", err.code, err.text)
        # Requests first: a request for base v that arrives together with version v+1 is still
        # answered (the syncer books it as late rather than the tokens being silently overwritten).
        for req in requests:
            self._answer(params, req)
        for q, update in sorted(updates.items()):
            params = self._apply(params, q, update)
        if min(self.versions) >= 0:
            # Held versions on the wire are >= 0 (docs/protocol.md): a learner that does not hold
            # every fragment yet has weight 0 and reports once it does (which makes it live).
            self.client.progress(
                session.ProgressInfo(self.step_count, tuple(self.versions), tuple(self.steps), tuple(self.tokens))
            )
        take_markers = getattr(self.client, "take_markers", None)
        for snapshot in take_markers() if take_markers is not None else ():
            # A consistent snapshot (net.snapshot): the state at this step boundary, sent after the
            # pushes made so far, which is what makes the cut consistent.
            self.client.local_state(snapshot, self.local_state_bytes(params, opt_state))
            log.info("recorded the local state for snapshot %d at step %d", snapshot, self.step_count)
        if self.snapshots.wanted:  # a peer asked; the end of a step is a consistent point to copy
            snapshot = recovery.snapshot_bytes(params, opt_state, self.step_count, self.versions, self.layout.digest)
            if self.tape is not None:
                self.tape.published(self.calls, self.step_count, snapshot)
            self.snapshots.publish(snapshot)
        return params

    def _apply(self, params: Any, q: int, update: session.UpdateInfo) -> Any:
        if update.version <= self.versions[q]:
            return params
        values = update.encoded.decode()
        params = self.tree.scatter(params, q, values, self.config.alpha)
        self.base[q], self.versions[q] = values, update.version
        self.steps[q], self.tokens[q] = 0, 0
        self.merged_versions_applied += 1
        return params

    def _answer(self, params: Any, req: session.RequestInfo) -> None:
        # A request computed against a version we no longer hold is answered by the next round.
        if self.base[req.fragment] is None or req.base_version != self.versions[req.fragment]:
            return
        delta = self.base[req.fragment] - self.tree.gather(params, req.fragment)
        if self.config.error_feedback:
            state = self.feedback[req.fragment] or codec.feedback_init(delta.size)
            payload, self.feedback[req.fragment] = codec.encode_with_feedback(delta, state, self.config.codec, self.layout.block)
        else:
            payload = codec.encode(delta, self.config.codec, self.layout.block)
        push = session.PushInfo(req.fragment, req.round, req.base_version, self.steps[req.fragment], self.tokens[req.fragment], payload)
        if self.tape is not None:
            self.tape.push(self.calls, push)
        self.client.push(push)

    def local_state_bytes(self, params: Any, opt_state: Any) -> bytes:
        """Everything this learner's future depends on: parameters, optimizer state, step, and the
        sync state (fragment versions held, their bases, counters since, error-feedback residuals)."""
        p = self.layout.num_fragments
        arrays = {f"base/{q}": self.base[q] for q in range(p) if self.base[q] is not None}
        arrays |= {f"feedback/{q}": self.feedback[q].residual for q in range(p) if self.feedback[q] is not None}
        meta = {"steps": list(self.steps), "tokens": list(self.tokens), "name": self.config.name, "learner": self.learner_id}
        return recovery.snapshot_bytes(params, opt_state, self.step_count, self.versions, self.layout.digest, meta, arrays)

    def restore(self, params: Any, opt_state: Any, data: bytes) -> tuple[Any, Any]:
        """Call once after construction instead of `recover`: continue from a local state recorded
        for a consistent snapshot (`local_state_bytes`), against a syncer restored from the same
        snapshot. Fragment versions newer than those held (in flight at the cut) arrive by themselves."""
        snap = peer.decode_snapshot(data)
        sync_meta = snap.meta.get("sync")
        if not isinstance(sync_meta, dict):
            raise recovery.RecoveryError("not a learner's local state of a snapshot (no sync state in it)")
        params, opt_state, step, versions = recovery.adopt(snap, params, opt_state, self.layout.digest, tuple(self.welcome.versions))
        p = self.layout.num_fragments
        if any(v > w for v, w in zip(versions, self.welcome.versions)):
            raise recovery.RecoveryError(f"the local state holds versions {list(versions)}, newer than the syncer's "
                                         f"{list(self.welcome.versions)}: they are not from the same snapshot")
        missing = [q for q in range(p) if f"sync/base/{q}" not in snap.arrays]
        if missing:
            raise recovery.RecoveryError(f"the local state has no base of fragments {missing}")
        self.step_count, self.versions = step, list(versions)
        self.base = [np.array(snap.arrays[f"sync/base/{q}"]) for q in range(p)]
        self.steps, self.tokens = [int(x) for x in sync_meta["steps"]], [int(x) for x in sync_meta["tokens"]]
        self.feedback = [codec.FeedbackState(np.array(snap.arrays[f"sync/feedback/{q}"]))
                         if f"sync/feedback/{q}" in snap.arrays else None for q in range(p)]
        self.recovered_from = "snapshot"
        log.info("restored step %d and versions %s from a snapshot's local state", step, list(versions))
        return params, opt_state

    def params_sha256(self, params: Any) -> str:
        """sha256 of every fragment of `params`, gathered to the host: what a full replay compares."""
        h = hashlib.sha256()
        for q in range(self.layout.num_fragments):
            h.update(memoryview(self.tree.gather(params, q)))
        return h.hexdigest()

    def close(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.close()
        if self.peer_server is not None:
            self.peer_server.close()
