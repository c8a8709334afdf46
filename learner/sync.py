"""The per-step sync hook a JAX training loop calls: `params = sync.step(params, tokens=n)`.

The learner loop of Decoupled DiLoCo (docs/algorithm.md, "Learner loop"). Each call, between two inner steps and without waiting on the
network or the device: counts the step and its tokens for every fragment; at the steps where
fragment p is due (step mod H == t_p, the welcome's schedule) starts copying fragment p to the host,
and the hook's background thread pushes the compressed outer gradient base_p - theta_p on its own (protocol 2,
docs/protocol.md "Learner-driven pushes"); applies fragment versions that have arrived (a delta onto the syncer's published copy
it holds, or a whole copy; then overwrite, or an alpha mix) and resets their counters; and reports progress. A step with no fragment due and
nothing arrived only counts. The network runs on the client's own thread; a syncer that is down only
means no merges for a while.

    with DilocoSync.connect(params, SyncConfig(url=..., name=...)) as sync:
        params, opt_state = sync.recover(params, opt_state)
        for batch in data:
            params, opt_state = train_step(params, opt_state, batch)
            params = sync.step(params, tokens=n, opt_state=opt_state)

Joining: the constructor touches no network (it compiles the codec kernels); `join()` starts the
client (and the peer server), waits for the syncer's welcome and sends the initial parameters if the
syncer asks for them. `connect` is the constructor and `join` in one call. `step`, `recover` and
`restore` join first when nobody has, so `DilocoSync(...)` followed by `step(...)` works as well;
the first call then waits for the welcome (at most `welcome_timeout_s`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple, Self

from ddiloco.core import codec
from ddiloco.core import publish as publishing
from ddiloco.core.events import Push
from ddiloco.core.layout import Layout, TensorSpec, layout_from_description
from ddiloco.errors import UserError
from ddiloco.learner import arrivals, background, local_state, pushes, recovery
from ddiloco.learner import schedule as scheduling
from ddiloco.learner.fragment import FragmentSync, progress_report, replaced
from ddiloco.learner.lead import DispatchLead
from ddiloco.learner.pushes import PUSH_SKIPS_LIMIT, PUSH_SKIPS_MAX
from ddiloco.learner.schedule import due_fragments
from ddiloco.learner.tape import LearnerTapeWriter
from ddiloco.learner.transport import SnapshotOutbox, Transport
from ddiloco.learner.tree import LeafPlace, TreeFragments, default_is_embedding, tensor_specs
from ddiloco.net import peer, session
from ddiloco.net.client import Calm, ClientConfig, ThreadedClient
from ddiloco.net.peer import PeerConfig, PeerServer, SnapshotBox
from ddiloco.net.sharded import ShardedClient, split_urls

__all__ = [
    "DilocoSync",
    "FragmentSync",
    "NotJoinedError",
    "RecoverFn",
    "SyncConfig",
    "check_alpha",
    "due_fragments",
    "syncer_transport",
]

log = logging.getLogger("ddiloco.learner")

# A graceful close (`close(params)`) makes a last push that the transport refused for a full queue
# (a short one, ClientConfig.pushes_queued_max) again, at most CLOSE_PUSH_TRIES times, waiting
# CLOSE_PUSH_RETRY_S, doubled at each try up to CLOSE_PUSH_RETRY_S_MAX, while the network thread
# sends (about 9 s in all); after that the push is dropped, and what it carried is booked lost, as a
# kill would leave it. Bounded by tries, not time, so that a replay, refused where the recorded run
# was, makes the same tries. (Dropped at once, a close's push was lost in 3 of 4 runs of a test of
# learners stepping every 2 ms.)
CLOSE_PUSH_TRIES = 25
CLOSE_PUSH_RETRY_S = 0.005
CLOSE_PUSH_RETRY_S_MAX = 0.5

# (welcome, params, opt_state, token, timeout_s, snapshot_bytes_max) -> the state copied from a peer
RecoverFn = Callable[[session.WelcomeInfo, Any, Any, "str | None", float, int], recovery.Recovered]


def check_alpha(alpha: float) -> None:
    """The mix of an arrived fragment into the learner's own: 0 overwrites; 1 would never apply it."""
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"alpha must lie in [0, 1), got {alpha}")


class NotJoinedError(UserError, RuntimeError):
    """What the syncer's welcome decides (the learner id, the layout) was asked before `join`."""


@dataclass(frozen=True)
class SyncConfig:
    # The syncer's websocket URL; for a syncer split into shards (core.shards), every shard's URL,
    # in any order: separated by commas, or a tuple. Kept as one comma-separated string; `urls`
    # holds them apart.
    url: str | tuple[str, ...]
    name: str
    token: str | None = None
    ca_file: Path | None = None  # wss://: the CA certificate(s) the syncer's certificate must chain to (net.tls)
    lane: bool = True  # offer the syncer a lane: pushes and updates on a TCP connection of their own (net.lane)
    codec: str = "int4"
    alpha: float = 0.0  # 0: overwrite with the merged fragment (the paper's default)
    # With alpha 0, keep what this learner trained since its last push over an arriving version
    # (ours; docs/algorithm.md "Progress carried over a merge"); False: overwrite, as the paper.
    keep_progress: bool = True
    # The hold-back (PUSH_SKIPS_MAX): due steps skipped while the last push of a fragment awaits its
    # version; 0 pushes at every due step (safe for progress, each push an increment, but stale under
    # outer momentum).
    push_skips_max: int = PUSH_SKIPS_MAX
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
    # Codec kernels on the training thread only, never numba's thread pool (each call passes
    # parallel=False): the cores are the training step's.
    serial_kernels: bool = True
    # The host work of pushes (the copy's wait, the increment, its quantisation) and of arriving
    # versions (the delta onto the published copy, less the kept progress's anchor) on the hook's
    # background thread while the training steps run (learner.background); False: on the training
    # thread. The pushes and parameters are the same bits either way.
    background: bool = True
    # Progress reports name the newest step the devices have computed, not the newest dispatched
    # (learner.lead): the syncer then opens a round when its first push can leave. False: the step
    # dispatched, as a loop on a virtual clock needs (its steps are computed at their calls).
    report_computed: bool = True
    urls: tuple[str, ...] = field(init=False)  # from `url`, one per shard

    def __post_init__(self) -> None:
        urls = split_urls(self.url)
        object.__setattr__(self, "urls", urls)
        object.__setattr__(self, "url", ",".join(urls))
        codec.parse_codec(self.codec)
        if self.recover_timeout_s <= 0 or self.snapshot_bytes_max <= 0:
            raise ValueError("recover_timeout_s and snapshot_bytes_max must be positive")
        if self.welcome_timeout_s <= 0:
            raise ValueError(f"welcome_timeout_s must be positive, got {self.welcome_timeout_s}")
        check_alpha(self.alpha)
        if not 0 <= self.push_skips_max <= PUSH_SKIPS_LIMIT:
            raise ValueError(f"push_skips_max must lie in [0, {PUSH_SKIPS_LIMIT}], got {self.push_skips_max}")
        if self.error_feedback and codec.parse_codec(self.codec) is codec.Codec.FP32:
            raise ValueError("error feedback needs a lossy codec (fp32 loses nothing)")


class DilocoSync:
    """One learner's side of Decoupled DiLoCo. Construct with the initial parameters (they become
    global state only if the syncer holds none and asks for them), then call `step` every step.

    `transport` is how it reaches the syncer (learner.transport.Transport): by default a
    `ThreadedClient` to `config.url`, started by `join`; `experiments.runner` passes an in-process one
    that feeds the syncer core on a virtual clock, full replay one that hands back a recording.

    The class is the step's orchestration and its I/O (the transport, the tape, the devices); what it
    decides lives in values beside it: the fragments' sync state (learner.fragment), the schedule
    (learner.schedule), the push side (learner.pushes), the arrival side (learner.arrivals) and the
    local state of a snapshot (learner.local_state)."""

    def __init__(
        self,
        params: Any,
        config: SyncConfig,
        is_embedding: Callable[[str], bool] = default_is_embedding,
        transport: Transport | None = None,
        tape: LearnerTapeWriter | None = None,
        recover_fn: RecoverFn = recovery.recover,
        snapshots: SnapshotOutbox | None = None,
    ):
        self.config = config
        self.is_embedding = is_embedding
        # Codec kernels on the training thread only, unless asked otherwise (SyncConfig.serial_kernels).
        self.parallel_kernels = not config.serial_kernels
        codec.warm_up([config.codec])  # before joining: see codec.warm_up
        publishing.warm_up()  # the broadcast's deltas, applied as they arrive
        # `tape` records what the hook takes from the network; `recover_fn` and `snapshots` are how a
        # replay (demo.replay) stands in for the peers.
        self.tape = tape
        self.recover_fn = recover_fn
        self.snapshots: SnapshotOutbox = snapshots if snapshots is not None else SnapshotBox()
        if config.peer is not None and transport is None and not isinstance(self.snapshots, SnapshotBox):
            raise ValueError("a peer server (config.peer) serves a net.peer.SnapshotBox: leave snapshots unset with it")
        self.client: Transport | None = transport
        self.peer_server: PeerServer | None = None
        self._closed = False
        self._initial = params  # sent as version 0 if the syncer asks this learner for them
        self._welcome: session.WelcomeInfo | None = None
        self._learner_id: int | None = None
        self._layout: Layout | None = None
        self.tree: TreeFragments | None = None
        self._fragments: tuple[FragmentSync, ...] = ()
        # Steps and tokens counted by calls that only count (`_counts_only`), not yet in `fragments`.
        self._uncounted_steps = 0
        self._uncounted_tokens = 0
        self._holds_report: Callable[[int], bool] | None = None  # the transport's holds_report, if any
        self._calm: Callable[[], Calm | None] | None = None  # and its calm, with it
        self._quiet: _Quiet | None = None  # where the calls to come only count, and until when (`_quiet_call`)
        self.calls = 0  # calls of `step`: the tape's clock
        self.step_count = 0  # the global step; a (re)joining learner continues the syncer's count
        self._lead = DispatchLead()  # the steps dispatched and not known computed (report_computed)
        self._schedule = scheduling.Schedule()
        self._pushes = pushes.Pushes(last={})
        self._deferred: arrivals.Deferred = {}  # arrived versions waiting behind a push (arrivals.defer)
        self._background = background.Background()  # host work off the training thread (SyncConfig.background)
        self._placements: dict[int, tuple[LeafPlace, ...]] = {}  # fragment -> where its leaves live, last seen
        self._warmed: set[tuple[LeafPlace, ...]] = set()  # placements whose device add is compiled (`_warm_add`)
        self.merged_versions_applied = 0
        self.welcomes_seen = 0
        self.recovered_from, self.recovery_s = "init", 0.0

    @classmethod
    def connect(cls, params: Any, config: SyncConfig, **kwargs: Any) -> DilocoSync:
        """The hook, joined: constructed, then `join` (closed again if joining fails)."""
        sync = cls(params, config, **kwargs)
        try:
            sync.join()
        except BaseException:
            sync.close()
            raise
        return sync

    # ---- joining -----------------------------------------------------------------------------------

    @property
    def joined(self) -> bool:
        return self._welcome is not None

    def join(self) -> session.WelcomeInfo:
        """Start the client (and the peer server, if configured), wait for the syncer's welcome (at
        most `welcome_timeout_s`: TimeoutError), send the initial parameters if it asks for them.
        A syncer that refuses this learner (its token, a model it cannot lay out: more fragments
        than tensors) raises `net.client.SyncerRefused`, a UserError whose message says what to
        change. Called again, returns the first welcome. On an error the hook is closed."""
        if self._welcome is not None:
            return self._welcome
        if self._closed:
            raise RuntimeError("this hook was closed: a learner that leaves joins again with a new DilocoSync")
        try:
            client = self.client if self.client is not None else self._start_client()
            watch = getattr(client, "watch_updates", None)  # a network client; replays tell nothing
            if watch is not None and self.config.background:
                watch(self._background.offer)
            welcome = client.wait_welcome(self.config.welcome_timeout_s)
            if welcome.shards > 1 and welcome.init_shards is None:
                # One shard's welcome, not every shard's: the other fragments would never arrive.
                raise UserError(
                    f"the syncer at {self.config.url} is shard {welcome.shard} of {welcome.shards}: "
                    "give the learner every shard's URL, separated by commas"
                )
        except BaseException:
            self.close()
            raise
        self._welcome, self._learner_id, self.welcomes_seen = welcome, welcome.learner, 1
        if self.tape is not None:
            self.tape.welcome(1, welcome)
        self._layout = layout_from_description(welcome.layout)
        # Calls that hand over no report (`_counts_only`, `_report_held`, quiet calls) only where the
        # learner keeps its progress over a version: one that overwrites it loses the tokens trained
        # since its push, and the syncer books them lost only from a report of the last step before
        # the version (the client forwards the last report of the old versions before the new one).
        # Nor where a tape is recorded: a replay makes every call's report.
        if self.config.keep_progress and self.tape is None:
            self._holds_report = getattr(self.client, "holds_report", None)
            self._calm = getattr(self.client, "calm", None)
        self.tree = TreeFragments(self._initial, self._layout, self.is_embedding)
        self.fragments = (FragmentSync(),) * self._layout.num_fragments
        self._schedule = scheduling.schedule_of(welcome, self._layout.num_fragments)
        self.step_count = welcome.global_step
        self._lead = DispatchLead(self.step_count)
        self.recovered_from = "init" if welcome.needs_init else "syncer"
        if welcome.needs_init:
            self._send_init(self._initial, welcome.init_fragments)
        self._initial = None  # not kept alive for the run: the syncer holds the state from now on
        return welcome

    def _start_client(self) -> Transport:
        config = self.config
        if config.peer is not None:
            assert isinstance(self.snapshots, SnapshotBox)  # checked in the constructor
            self.peer_server = PeerServer(self.snapshots, replace(config.peer, token=config.peer.token or config.token))
        tensors = tensor_specs(self._initial, self.is_embedding)
        peer_url = self.peer_server.url if self.peer_server else ""
        self.client = syncer_transport(config, tensors, peer_url)
        return self.client

    def _joined(self) -> tuple[Transport, TreeFragments, Layout]:
        if self.client is None or self.tree is None or self._layout is None:
            raise NotJoinedError(
                "the learner has not joined the syncer yet: call join() (or step, recover, restore) first"
            )
        return self.client, self.tree, self._layout

    @property
    def welcome(self) -> session.WelcomeInfo:
        """The first welcome of this hook's syncer session."""
        if self._welcome is None:
            raise NotJoinedError("no welcome yet: call join() first")
        return self._welcome

    @property
    def layout(self) -> Layout:
        return self._joined()[2]

    @property
    def learner_id(self) -> int:
        """This learner's id in its current session (a rejoin gets a new one; with a sharded
        syncer, the id shard 0 gave it)."""
        if self._learner_id is None:
            raise NotJoinedError("no learner id yet: call join() first")
        return self._learner_id

    @property
    def versions(self) -> list[int]:
        """The version of each fragment held (-1: none yet)."""
        return [f.version for f in self.fragments]

    @property
    def steps(self) -> list[int]:
        return [f.steps for f in self.fragments]

    @property
    def tokens(self) -> list[int]:
        return [f.tokens for f in self.fragments]

    def _send_init(self, params: Any, asked: tuple[int, ...]) -> None:
        """The syncer (or the shards owning `asked`) holds no parameters and asked this learner for
        them (only then do a learner's own weights become global state)."""
        client, tree, _ = self._joined()
        fragments = list(self.fragments)
        for q in asked:
            values = tree.gather(params, q)
            payload = codec.encode(values, "fp32", parallel=self.parallel_kernels)
            if self.tape is not None:
                self.tape.init(self.calls, q, payload)
            client.init(q, payload)
            fragments[q] = FragmentSync().received(0, values, values)  # the syncer publishes version 0 as sent
        self.fragments = tuple(fragments)
        for q in asked:
            self._tell_background(q, params)
        log.info("learner %d sent the initial parameters (version 0) of fragments %s", self.learner_id, list(asked))

    def _rejoin(self, params: Any, welcome: session.WelcomeInfo) -> None:
        """A new welcome: the client reconnected (a new learner id; the syncer resends every
        fragment and the learner has weight 0 until it holds them), or the learner asked for the
        initial parameters died and this one is asked instead.

        With a sharded syncer the welcome is one shard's (it restarted, or its connection was made
        again): only the fragments it owns start again; the others' versions, pushes and the
        learner id (shard 0's) stay as they are, and go on merging meanwhile."""
        if welcome.shards == 1 or welcome.shard == 0:
            self._learner_id = welcome.learner
        reset = set(welcome.owned)
        self.fragments = tuple(FragmentSync() if q in reset else f for q, f in enumerate(self.fragments))
        # What was under way for those fragments belongs to the old session.
        self._pushes = pushes.forget(self._pushes, reset)
        self._background.forget(reset)
        self._placements = {q: at for q, at in self._placements.items() if q not in reset}
        self._deferred = arrivals.forget(self._deferred, reset)
        self._schedule = scheduling.rescheduled(self._schedule, welcome, len(self.fragments))
        if welcome.needs_init:
            self._send_init(params, welcome.init_fragments)
        elif welcome.shards > 1:
            log.info("rejoined syncer shard %d of %d (fragments %s)", welcome.shard, welcome.shards, sorted(reset))
        else:
            log.info("rejoined the syncer as learner %d", self._learner_id)

    # ---- starting state ------------------------------------------------------------------------------

    def recover(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """Call once after joining, before the first step: (params, opt_state) copied from a healthy
        peer that holds the syncer's current versions, or the arguments unchanged (the syncer's
        fragments then arrive and overwrite every parameter). `recovered_from` says which."""
        welcome = self.join()
        _, tree, layout = self._joined()
        if welcome.needs_init or any(f.version >= 0 for f in self.fragments):
            self.recovered_from = "init"
            return params, opt_state
        got = self.recover_fn(
            welcome, params, opt_state, self.config.token, self.config.recover_timeout_s, self.config.snapshot_bytes_max
        )
        self.recovered_from, self.recovery_s = got.source, got.seconds
        if self.tape is not None:  # the adopted state, as bytes a replay adopts the same way
            copied = (
                recovery.snapshot_bytes(got.params, got.opt_state, got.step, list(got.versions), layout.digest)
                if got.versions
                else None
            )
            self.tape.recovered(got.source, got.step, got.versions, copied)
        if got.versions:
            self.step_count = got.step
            self._lead = DispatchLead(self.step_count)
            # The base is the copied parameters, not the peer's base: the outer gradient this
            # learner pushes then holds its own progress only, not a second copy of the peer's.
            self.fragments = tuple(
                FragmentSync().received(v, tree.gather(got.params, q)) for q, v in enumerate(got.versions)
            )
        return got.params, got.opt_state

    def restore(self, params: Any, opt_state: Any, data: bytes) -> tuple[Any, Any]:
        """Call once after joining instead of `recover`: continue from a local state recorded for a
        consistent snapshot (`local_state_bytes`), against a syncer restored from the same snapshot.
        Fragment versions newer than those held (in flight at the cut) arrive by themselves."""
        welcome = self.join()
        _, _, layout = self._joined()
        snap = peer.decode_snapshot(data)
        sync_meta = local_state.sync_meta_of(snap)
        params, opt_state, step, versions = recovery.adopt(
            snap, params, opt_state, layout.digest, tuple(welcome.versions)
        )
        if any(v > w for v, w in zip(versions, welcome.versions)):
            raise recovery.RecoveryError(
                f"the local state holds versions {list(versions)}, newer than the syncer's "
                f"{list(welcome.versions)}: they are not from the same snapshot"
            )
        fragments = local_state.fragments_of(snap, sync_meta, versions, layout.num_fragments)
        self.step_count = step
        self._lead = DispatchLead(self.step_count)
        self.fragments = fragments
        for q in range(layout.num_fragments):
            self._tell_background(q)
        self.recovered_from = "snapshot"
        log.info("restored step %d and versions %s from a snapshot's local state", step, list(versions))
        return params, opt_state

    # ---- the step ------------------------------------------------------------------------------------

    @property
    def fragments(self) -> tuple[FragmentSync, ...]:
        """Each fragment's sync state (learner.fragment), every call of `step` counted."""
        if self._uncounted_steps:
            steps, tokens = self._uncounted_steps, self._uncounted_tokens
            self._uncounted_steps = self._uncounted_tokens = 0
            self._fragments = tuple([f.counted(tokens, steps) for f in self._fragments])
        return self._fragments

    @fragments.setter
    def fragments(self, value: tuple[FragmentSync, ...]) -> None:
        # A new state whole: each step's update reads the old one first (counting what is uncounted);
        # a state recovered or restored replaces it, counts and all.
        self._uncounted_steps = self._uncounted_tokens = 0
        self._fragments = value
        self._quiet = None  # what a quiet call relies on was of the old state

    @property
    def due_next(self) -> tuple[int, ...]:
        """The fragments the next call of `step` pushes (starts copying), as the schedule stands now:
        step_count + 1 is the next call's step. Empty while the learner does not hold every fragment."""
        skips_max = self.config.push_skips_max
        waits = lambda q: pushes.waits_on_push(self._pushes, q, self.fragments[q].version, skips_max)
        return tuple(q for q in self._scheduled_next() if not waits(q))

    def due_taking(self, updates: dict[int, list[session.UpdateInfo]]) -> tuple[int, ...]:
        """The fragments the next call of `step` may push when it takes `updates` (so whose leaves it
        reads): those due next, those that fell due at the steps it skips moving up to the global
        step the updates carry (`learner.schedule.caught_up`), and those whose version arrives (a
        push held back behind it goes out in the same call). A superset: some may stay held back."""
        _, behind = self._caught_up(self.step_count + 1, updates)
        return tuple(dict.fromkeys(self.due_next + behind + tuple(sorted(updates))))

    def _caught_up(self, step: int, updates: dict[int, list[session.UpdateInfo]]) -> tuple[int, tuple[int, ...]]:
        """A call at `step` that takes `updates`: the step it counts from and the fragments that fell due
        at the steps it skips (`learner.schedule.caught_up`)."""
        global_step = scheduling.newest_global_step(updates)
        return scheduling.caught_up(self._schedule, self.fragments, step, global_step)

    def _scheduled_next(self) -> tuple[int, ...]:
        # the versions held are all it reads: counting the calls into the fragments can wait
        return scheduling.scheduled_at(self._schedule, self._fragments, self.step_count + 1)

    @property
    def pushes_in_flight(self) -> tuple[int, ...]:
        """Fragments whose host copy a call started and whose push a later call books (the next,
        unless the background thread sends it and has not yet)."""
        return tuple(f.fragment for f in self._pushes.in_flight)

    @property
    def updates_waiting(self) -> tuple[int, ...]:
        """Fragments whose arrived version the next call applies although nothing new arrives: held
        back one call behind the fragment's push (see `arrivals.defer`)."""
        return tuple(sorted(self._deferred))

    @property
    def pushes_held(self) -> int:
        """Due steps skipped behind a push not merged back yet or still on its way; their tokens go with
        the next push."""
        return self._pushes.held

    @property
    def pushes_skipped(self) -> int:
        """Pushes given up: their leaves were deleted (a donating step) meanwhile."""
        return self._pushes.skipped

    def step(self, params: Any, tokens: int, opt_state: Any = None) -> Any:
        """Account one inner step of `tokens` tokens; return `params` with arrived fragments applied.
        Give `opt_state` to let (re)joining peers copy the optimizer state too.

        Never waits for the device: with JAX's asynchronous dispatch the loop runs ahead of it. At a
        step where fragment p is due its copy to the host starts (`TreeFragments.start_gather`), and
        the background thread encodes and sends the push; a later call books it, once sent (a
        transport without `sender`: the next call sends it)."""
        if self._quiet is not None and self._quiet_call(params, tokens):
            return params
        self._quiet = None
        # Read before anything this call looks at: a job that ends later ends the next quiet window.
        finished = self._background.finished
        if tokens < 0:
            raise ValueError(f"tokens must be non-negative, got {tokens}")
        self.join()
        client, tree, layout = self._joined()
        scheduled = self._scheduled_next()
        self.step_count += 1
        self.calls += 1
        self._uncounted_steps += 1
        self._uncounted_tokens += tokens
        updates, errors, (welcomes, welcome) = client.take()
        if self.tape is not None:
            self.tape.take(self.calls, updates, errors, welcomes, welcome, welcomes != self.welcomes_seen)
        elif not (scheduled or updates or errors or welcomes != self.welcomes_seen) and self._counts_only(tree, params):
            self._quiet = self._quiet_from_here(finished)
            return params
        applied_before, rejoined = self.merged_versions_applied, welcomes != self.welcomes_seen
        if rejoined:
            assert welcome is not None, "a transport counted a welcome it did not hand over"
            self.welcomes_seen = welcomes
            self._rejoin(params, welcome)
            scheduled = ()  # the schedule was of the old session
        if updates:  # behind the syncer's global step: move up to it (learner.schedule.caught_up)
            self.step_count, behind = self._caught_up(self.step_count, updates)
            # Not a fragment whose new version came in this call: the round it was due for is over, and
            # a push from the version held would reach the next one late; its next due step pushes
            # from the new version, on time.
            scheduled += tuple(q for q in behind if q not in scheduled and q not in updates)
        for err in errors:
            log.warning("syncer: %s: %s", err.code, err.text)
        if errors:  # a refused push comes back as no version: the next due step pushes (its increment)
            self._pushes = pushes.refused(self._pushes, self.config.push_skips_max)
        # Pushes started at an earlier call first: against the versions held then (a push of base v
        # that arrives after version v+1 was merged still counts, discounted: it is not overwritten).
        # Those the background thread sends itself are booked once it has: the call never waits for
        # its host work (a due fragment whose push is still on its way skips that due step).
        sent = self._send_in_flight(landed_only=True) if self._pushes.in_flight else ()
        # Due fragments are copied before arrived versions overwrite them: the push keeps the
        # progress made since the version held.
        self._pushes, held = pushes.hold_back(self._pushes, scheduled, self.fragments, self.config.push_skips_max)
        for q in (q for q in scheduled if q not in held):
            self._pushes = pushes.started(self._pushes, self._start_push(params, q))
        released: tuple[int, ...] = ()
        if updates or self._deferred:
            params = self._apply_arrived(params, updates, sent)
            released = self._released(held)
        if self._report_held(applied_before, rejoined):
            self._note_step(tree, params)
        else:
            report = progress_report(self._reported_step(tree, params), self.fragments)
            if scheduling.serves_any(self._schedule, report.versions):
                # Held versions on the wire are >= 0 (docs/protocol.md): a learner that does not hold
                # every fragment yet has weight 0 and reports once it does (which makes it live). To a
                # sharded syncer, the report goes to each shard whose fragments it holds (net.sharded).
                client.progress(report)
        # Due, but held back behind a push whose version came back in this very call: pushed now,
        # from that version (the progress since the push), into the round that is open, rather than
        # a period later. Started after the report of that version: the background thread may send
        # the push before this call ends, and the syncer books a push's tokens in the window its
        # learner last reported (a push of the new version ahead of that report went into the old
        # window, and the new window's tokens were booked lost at its close).
        for q in released:
            self._pushes = pushes.started(self._pushes, self._start_push(params, q))
        for snapshot in client.take_markers():
            # A consistent snapshot (net.snapshot): the state at this step boundary, sent after the
            # pushes made so far, which is what makes the cut consistent.
            self._send_in_flight()
            client.local_state(snapshot, self.local_state_bytes(params, opt_state))
            log.info("recorded the local state for snapshot %d at step %d", snapshot, self.step_count)
        if self.snapshots.wanted:  # a peer asked; the end of a step is a consistent point to copy
            snapshot = recovery.snapshot_bytes(params, opt_state, self.step_count, self.versions, layout.digest)
            if self.tape is not None:
                self.tape.published(self.calls, self.step_count, snapshot)
            self.snapshots.publish(snapshot)
        elif self._holds_report is not None and self._holds_report(self.step_count):
            # The calls after this one have nothing to do either, as after a call that only counted.
            self._quiet = self._quiet_from_here(finished)
        return params

    def _counts_only(self, tree: TreeFragments, params: Any) -> bool:
        """Whether this call, with nothing due and nothing taken, has nothing to do but count (the
        counting is done): no arrived version is to be applied (those waiting behind a push or a
        decode wait one call more), no push the background thread sent is to be booked, no peer
        wants a snapshot, and the transport would hold back this call's progress report
        (`holds_report`: superseded by a later one; no snapshot marker waits), so none is built. Most
        calls of a loop stepping faster than its fragments fall due: each skips the work of a report
        (docs/learner.md). Never where a tape is recorded: a replay makes every call's report."""
        holds = self._holds_report
        if holds is None or self.snapshots.wanted:
            return False
        if self._pushes.in_flight and any(_landed(f) for f in self._pushes.in_flight):
            return False
        if not holds(self.step_count):
            return False
        if self._deferred:  # versions waiting for a push or a decode: they wait one call more, or this call applies
            ready, waiting = self._defer({}, ())
            if ready:
                return False
            self._deferred = waiting
        self._note_step(tree, params)
        return True

    def _note_step(self, tree: TreeFragments, params: Any) -> None:
        """A call that hands over no report notes its step's probe: the next report looks at it
        (learner.lead). `_quiet_call` does the same inline."""
        if self.config.report_computed:
            self._lead.note(self.step_count, tree.probe(params))

    def _report_held(self, applied_before: int, rejoined: bool) -> bool:
        """Whether a call that did some work (booked a push the background thread sent, started one
        that opens no round) builds no report either, as a call that only counts: no version was
        applied and no welcome taken (the report's versions are those of the last one), and the
        transport would hold it back (`holds_report`; None where a tape is recorded)."""
        holds = self._holds_report
        return (
            holds is not None
            and not rejoined
            and self.merged_versions_applied == applied_before
            and holds(self.step_count)
        )

    def _quiet_from_here(self, finished: int) -> _Quiet | None:
        """After a call that only counted, or one that did its work and whose report the transport
        would hold back now: the window over which the calls to come only count,
        without asking the transport or the background thread anything (`_quiet_call`). It lasts
        while no step of the schedule's phases comes (no fragment due, no round opening: a report
        would go out), nothing arrives, no job of the background thread ends after `finished` was
        read (at the call's start: a push it sent is to be booked), no peer asks for a snapshot, and
        the report interval runs. None where versions wait to be applied, or the transport cannot
        say (`calm`: a sharded or replayed one)."""
        if self._deferred:  # each call counts toward their wait's bound (arrivals.DEFER_CALLS_MAX)
            return None
        calm = self._calm() if self._calm is not None else None
        if calm is None:
            return None
        return _Quiet(calm, scheduling.next_phase_step(self._schedule, self.step_count), finished)

    def _quiet_call(self, params: Any, tokens: int) -> bool:
        """A call inside the quiet window (`_quiet_from_here`): counted, and True; else False, and the
        call goes the whole way. The loop's most frequent call, so it reads a few values and calls
        nothing but the clock: after a step of a few milliseconds its code and data are out of the
        caches, and each function it called cost it more than its work (docs/learner.md). A client
        refused or stopped meanwhile is told at the window's end, within the report interval."""
        q = self._quiet
        if not (
            self.step_count + 1 < q.until_step
            and q.calm.inbox.deliveries == q.calm.deliveries
            and self._background.finished == q.finished
            and tokens >= 0
            and not self.snapshots.wanted
            and q.calm.clock() < q.calm.report_by
        ):
            return False
        self.step_count += 1
        self.calls += 1
        self._uncounted_steps += 1
        self._uncounted_tokens += tokens
        if self.config.report_computed:  # `_note_step`, inline
            self._lead.note(self.step_count, self.tree.probe(params))
        return True

    def _reported_step(self, tree: TreeFragments, params: Any) -> int:
        """The step a progress report names (SyncConfig.report_computed): the newest computed."""
        if not self.config.report_computed:
            return self.step_count
        return self._lead.dispatched(self.step_count, tree.probe(params))

    @property
    def steps_ahead(self) -> int:
        """Steps dispatched and not known computed at the last call: how far the loop runs ahead
        of its devices (0 where reports name the step dispatched)."""
        return self._lead.pending

    def _apply_arrived(self, params: Any, updates: dict[int, list[session.UpdateInfo]], sent: tuple[int, ...]) -> Any:
        """Apply the updates of each fragment that arrived, in order, except those that wait behind a
        push of the fragment (`arrivals.defer`)."""
        ready, self._deferred = self._defer(updates, sent)
        for q, chain in ready:
            if q in self.pushes_in_flight:
                # Waited long enough (a fragment due every step or two): its push, copied before this
                # version, goes out first (waiting for the copy), so that what the version keeps of
                # this learner's progress starts where that push ends and nothing is pushed twice.
                self._send_in_flight(q)
            params = self._apply(params, q, chain)
        return params

    def _released(self, held: tuple[int, ...]) -> tuple[int, ...]:
        """Of the due fragments `held` back at this call, those to push now after all: their push's
        version came back in this call (and no push of theirs is on its way)."""
        skips_max = self.config.push_skips_max
        return tuple(
            q
            for q in held
            if not pushes.flying(self._pushes, q)
            and not pushes.waits_on_push(self._pushes, q, self.fragments[q].version, skips_max)
        )

    def _defer(
        self, updates: dict[int, list[session.UpdateInfo]], sent: tuple[int, ...]
    ) -> tuple[list[tuple[int, list[session.UpdateInfo]]], arrivals.Deferred]:
        """`arrivals.defer` of what waits and what arrived at this call: (the chains to apply now, those
        that wait one call more), busy being the fragments pushed at this call (`sent`), those whose
        push is in flight, and those the background thread is still decoding."""
        busy = set(sent) | set(self.pushes_in_flight) | self._decoding(updates)
        return arrivals.defer(self._deferred, updates, busy)

    def _decoding(self, updates: dict[int, list[session.UpdateInfo]]) -> set[int]:
        """Fragments with an arrived update (now or waiting) that the background thread is still
        decoding: applied at a later call rather than waited for (`arrivals.defer` bounds the wait;
        only where timing may decide, `_timing_decides`)."""
        if not self.config.background or not self._timing_decides():
            return set()
        chains = {q: [*self._deferred.get(q, ([], 0))[0], *updates.get(q, ())] for q in {*updates, *self._deferred}}
        return {q for q, chain in chains.items() if self._background.decoding(chain)}

    def _apply(self, params: Any, q: int, chain: list[session.UpdateInfo]) -> Any:
        """The updates of fragment q that arrived, in order (`arrivals.reach`); the newest version
        reached goes into the parameters once."""
        frag, version, published = arrivals.reach(
            self.fragments[q], chain, self.parallel_kernels, self._background.published
        )
        if version == frag.version:
            self._background.taken(chain)
            had_published = self.fragments[q].published is not None
            self.fragments = replaced(self.fragments, q, frag)
            if frag.published is not None and not had_published:
                self._tell_background(q)  # the version held has the syncer's published copy now
            return params
        assert published is not None  # a newer version is reached only with its published copy
        tree = self._joined()[1]
        last = pushes.last_from(self._pushes, q, frag.version)
        kept = arrivals.kept_progress(frag, last, self.config.keep_progress, self.config.alpha)
        if kept is None:
            params = tree.scatter(params, q, published, self.config.alpha)
        else:
            # The new version plus what this learner trained since its last push (or since the version
            # it held, when none is outstanding): published + (theta - anchor), added on the devices.
            prepared = self._background.difference(published, kept.anchor)
            if prepared is not None and prepared.placed is not None and tree.fits(params, q, prepared.placed):
                params = tree.add_placed(params, q, prepared.placed)
            else:
                params = tree.add(params, q, published - kept.anchor if prepared is None else prepared.difference)
        self._background.taken(chain)  # after `difference`, which looks among what it holds
        self.fragments = replaced(self.fragments, q, arrivals.received(frag, version, published, kept))
        self.merged_versions_applied += 1
        self._tell_background(q, params)
        return params

    def _tell_background(self, q: int, params: Any = None) -> None:
        """What the next version of fragment q applies onto, for the background thread: the
        published copy held and the anchor of the progress kept over it; and where the difference
        goes: where fragment q's leaves of `params` live (else where they lived when last told)."""
        if not self.config.background:
            return
        if params is not None:
            self._placements[q] = self._joined()[1].placement(params, q)
            self._warm_add(self._placements[q])
        frag = self.fragments[q]
        if frag.published is None:
            return
        last = pushes.last_from(self._pushes, q, frag.version)
        kept = arrivals.kept_progress(frag, last, self.config.keep_progress, self.config.alpha)
        placement = self._placements.get(q)
        place = None if placement is None else functools.partial(self._joined()[1].place, q, placement)
        self._background.holds(q, frag.version, frag.published, None if kept is None else kept.anchor, place)

    def _warm_add(self, placement: tuple) -> None:
        """Compile the device add for leaves placed so, on a thread of its own, once per placement."""
        if placement in self._warmed:
            return
        self._warmed.add(placement)
        tree = self._joined()[1]
        threading.Thread(target=tree.warm_add, args=(placement,), name="ddiloco-sync-warm", daemon=True).start()

    def _start_push(self, params: Any, q: int) -> pushes.InFlight:
        """Fragment q's push, started: its copy to the host, and its host work on the background
        thread (SyncConfig.background)."""
        tree = self._joined()[1]
        flight = pushes.InFlight(q, self.step_count, self.fragments[q], tree.start_gather(params, q))
        if not self.config.background:
            return flight
        self._placements[q] = tree.placement(params, q)  # where the next version's difference goes (_tell_background)
        return flight._replace(job=self._background.encode(self._push_work(flight), self._sending(flight)))

    def _sending(self, flight: pushes.InFlight) -> background.Send | None:
        """How the background thread sends `flight` as soon as its bytes exist, where the transport
        takes pushes from another thread (`sender`); None: the next call sends it. The push is the
        one the next call would make: every field is fixed now, the payload aside."""
        if not self._timing_decides():
            return None
        send, learner = self._joined()[0].sender(), self.learner_id

        def send_payload(payload: codec.Encoded) -> tuple[Push, bool]:
            push = _push_of(learner, flight, payload)
            return push, send(push) is not False

        return send_payload

    def _timing_decides(self) -> bool:
        """Whether the background thread's timing may decide at which call a push is booked or an
        arrived version applied: only where the transport sends from another thread (`sender`: the
        websocket clients) and no tape is recorded. A replay or a simulation (no `sender`) books
        and applies at the same calls every time, and so does a recorded learner: it sends at the
        call that books the push, so its tape holds every push that went out (killed between a send
        from the thread and the booking, it would leave a push on the syncer's tape that no replay
        of the learners makes again)."""
        return getattr(self._joined()[0], "sender", None) is not None and self.tape is None

    def _push_work(self, flight: pushes.InFlight) -> background.PushWork:
        """What `flight`'s host work reads, as the hook holds it now."""
        _, tree, layout = self._joined()
        feedback = self.fragments[flight.fragment].feedback
        config = self.config
        return background.PushWork(
            tree.finish_gather, self._pushes, flight, feedback, config.codec, config.error_feedback, layout.block
        )

    def _send_in_flight(self, fragment: int | None = None, landed_only: bool = False) -> tuple[int, ...]:
        """Encode and send the pushes whose host copies were started (of `fragment` only, if given),
        in the order started; the fragments pushed. `landed_only`: of the pushes the background
        thread sends itself, only those it has sent (the others stay in flight, and nothing waits)."""
        self._pushes, flights = pushes.take(self._pushes, fragment, _landed if landed_only else None)
        for flight in flights:
            self._push(flight)
        return tuple(f.fragment for f in flights)

    def _push(self, flight: pushes.InFlight) -> None:
        client = self._joined()[0]
        q = flight.fragment
        done = self._sent_ahead(flight)
        if done is None and pushes.donated(flight):
            # A training step that donates its parameters freed them before the copy was read: this
            # push is given up; the counters run on and the next push of the fragment carries them.
            self._pushes = pushes.given_up(self._pushes)
            log.warning("push of fragment %d at step %d skipped: its parameters were donated", q, flight.step)
            return
        done = done or self._encoded(flight)
        theta, feedback = done.theta, done.feedback
        if done.push is not None:  # the background thread sent it already, as soon as it was encoded
            push, sent = done.push, done.sent
        else:
            push = _push_of(self.learner_id, flight, done.payload)
            sent = client.push(push) is not False  # a transport that returns nothing sent it
        if self.tape is not None:
            self.tape.push(self.calls, push)
        if sent:
            self.fragments = replaced(self.fragments, q, self.fragments[q]._replace(feedback=feedback))
            self._pushes = pushes.sent(self._pushes, flight, theta)
            self._tell_background(q)  # the progress kept over the next version now starts at theta
        elif self.tape is not None:  # not sent: the next push starts from where this one did
            self.tape.dropped(self.calls, q)

    def _sent_ahead(self, flight: pushes.InFlight) -> background.Encoded | None:
        """What the background thread sent of `flight` (`_sending`), waiting for it; None where it
        sends nothing, or where its copy failed because a donating step freed the leaves first."""
        job = flight.job
        if job is None or not job.sends:
            return None
        last = pushes.last_from(self._pushes, flight.fragment, flight.frag.version)
        # Its inputs cannot change before this call (learner.background): only this push changes them.
        assert job.still_valid(last, self.fragments[flight.fragment].feedback), "a push went out from stale inputs"
        try:
            return job.result()
        except Exception:
            if pushes.donated(flight):
                return None
            raise

    def _encoded(self, flight: pushes.InFlight) -> background.Encoded:
        """The push's host copy and bytes: the background thread's, where its inputs still hold (they
        do unless the hook has a bug; see learner.background), else computed here."""
        q = flight.fragment
        feedback = self.fragments[q].feedback
        last = pushes.last_from(self._pushes, q, flight.frag.version)
        if flight.job is not None and flight.job.still_valid(last, feedback):
            return flight.job.result()
        return background.encode_push(self._push_work(flight), self.parallel_kernels)

    # ---- state out -----------------------------------------------------------------------------------

    def local_state_bytes(self, params: Any, opt_state: Any) -> bytes:
        """Everything this learner's future depends on: parameters, optimizer state, step, and the
        sync state (learner.local_state)."""
        _, _, layout = self._joined()
        return local_state.local_state_bytes(
            params, opt_state, self.step_count, self.fragments, self.config.name, self.learner_id, layout.digest
        )

    def params_sha256(self, params: Any) -> str:
        """sha256 of every fragment of `params`, gathered to the host: what a full replay compares."""
        _, tree, layout = self._joined()
        h = hashlib.sha256()
        for q in range(layout.num_fragments):
            h.update(memoryview(tree.gather(params, q)))
        return h.hexdigest()

    # ---- the end -------------------------------------------------------------------------------------

    def close(self, params: Any = None) -> None:
        """Close the client (what is queued goes out, then a goodbye) and the peer server. Idempotent.

        Given `params` (the parameters after the last step), a graceful stop loses no training: every
        fragment's progress not pushed yet goes out first, as the increment since its last push (or
        since the version held). The syncer merges it in the fragment's next round, as it does any push
        of a learner that has left; a round opens while other learners train on."""
        if self._closed:
            return
        self._closed, self._quiet = True, None
        try:
            if self.client is not None:
                if params is not None and self.joined:
                    self._push_the_rest(params)
                if self._pushes.in_flight:
                    self._send_in_flight()  # the last step's pushes, sent (and recorded) before the goodbye
                if params is not None and self.joined:
                    self._report_the_end(params)
        except Exception as exc:  # noqa: BLE001 - closing goes on: a client already stopped cannot send
            log.warning("the last pushes were not sent: %s", exc)
        try:
            if self.client is not None:
                self.client.close()
        finally:
            self._background.close()
            if self.peer_server is not None:
                self.peer_server.close()

    def _report_the_end(self, params: Any) -> None:
        """The last step's progress, once its parameters are computed (the loop has ended: waiting
        costs nothing now): the syncer's global step then counts every step this learner trained, as
        a learner that joins after it continues from there."""
        tree = self._joined()[1]
        probe = tree.probe(params)
        if probe is not None:
            probe.block_until_ready()
        report = progress_report(self._lead.dispatched(self.step_count, None), self.fragments)
        if scheduling.serves_any(self._schedule, report.versions):
            self._joined()[0].progress(report)

    def _push_the_rest(self, params: Any) -> None:
        """Push every fragment that holds a version and trained since its last push (the pushes the
        last step started go out first, in order), for `close`. A push the transport refuses for a
        full queue is made again once there is room (at most CLOSE_PUSH_TRIES tries)."""
        self._send_in_flight()
        for q in range(len(self.fragments)):
            for attempt in range(CLOSE_PUSH_TRIES):
                if not self._unpushed(q):
                    break
                if attempt:  # the queue was full: its network thread sends meanwhile
                    time.sleep(min(CLOSE_PUSH_RETRY_S * 2 ** (attempt - 1), CLOSE_PUSH_RETRY_S_MAX))
                self._pushes = pushes.started(self._pushes, self._start_push(params, q))
                self._send_in_flight()

    def _unpushed(self, q: int) -> bool:
        """Whether fragment q holds a version and has trained since its last push."""
        frag = self.fragments[q]
        last = pushes.last_from(self._pushes, q, frag.version)
        return frag.version >= 0 and frag.base is not None and frag.tokens > (last.tokens if last is not None else 0)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Quiet(NamedTuple):
    """What the calls of a quiet window check (`DilocoSync._quiet_call`)."""

    calm: Calm  # nothing arrived, and the report interval runs (net.client.ThreadedClient.calm)
    until_step: int  # the first step of the schedule's phases after the window opened
    finished: int  # the background thread's jobs ended when it opened


def _landed(flight: pushes.InFlight) -> bool:
    """Whether booking `flight` now waits for nothing: a push the background thread sends, sent. Any
    other push is booked at the call after its start, waiting for its host work if need be, so that
    a replay or a simulation books it at the same call every time (learner.background)."""
    job = flight.job
    return job is None or not job.sends or job.done()


def _push_of(learner: int, flight: pushes.InFlight, payload: codec.Encoded) -> Push:
    """The push's one shape (core.events.Push), made once; `learner` is this session's id as the hook
    knows it (the syncer takes the sender from the connection, not from the push)."""
    frag = flight.frag
    return Push(learner, flight.fragment, flight.step, frag.version, frag.steps, frag.tokens, payload)


def syncer_transport(config: SyncConfig, tensors: tuple[TensorSpec, ...], peer_url: str = "") -> Transport:
    """A client to the syncer of `config.urls`: one websocket, or one per shard (net.sharded)."""
    configs = [
        ClientConfig(
            url=url,
            name=config.name,
            tensors=tensors,
            token=config.token,
            ca_file=config.ca_file,
            lane=config.lane,
            peer_url=peer_url,
            progress_interval_s=config.progress_interval_s,
        )
        for url in config.urls
    ]
    return ThreadedClient(configs[0]) if len(configs) == 1 else ShardedClient(configs)
