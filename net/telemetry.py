"""What the syncer tells the outside: Prometheus metrics, the /status JSON and its warnings.

Counters are updated by the daemon from the effects the core returns and from the bytes it moves
(`Metrics`). Everything else is read off a `SyncerView`: a frozen value the core thread publishes
after each event, so the HTTP handlers never read, and never lock, the state the core is changing.

/metrics is prometheus_client's exposition of a registry per daemon (`new_registry`; several daemons
run in one test process, so never the global default registry): `SyncerCollector` turns one
`Reading` (the view, the counters, the checkpoint health, the time) into metric families named by
Prometheus' conventions, `ddiloco_` prefix, `_total` counters in base units, HELP and TYPE on
every family. Beside it the process's own metrics (`process_*`, `python_info`). docs/operations.md
lists them.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ddiloco.core.config import SyncerConfig
from ddiloco.core.events import Merged
from ddiloco.core.ledger import FATES
from ddiloco.core.syncer import Decision, LearnerStatus, SyncerState
from ddiloco.core.weights import token_weight
from ddiloco.net.store import Health

__all__ = [
    "DECISIONS_SHOWN",
    "GONE_SHOWN",
    "FragmentView",
    "LastRound",
    "LearnerView",
    "Metrics",
    "Reading",
    "SyncerCollector",
    "SyncerView",
    "checkpoint_status",
    "new_registry",
    "status_document",
    "view_of",
    "warnings_of",
]

DECISIONS_SHOWN = 16  # the last decisions /status lists
GONE_SHOWN = 16  # the learners gone most recently that the view keeps (the others only grow the state)
NAME_LABEL_CHARS_MAX = 64  # a learner's name as a label value: its own text, cut to this
GONE_WARNED_S = 600.0  # a learner gone within this long is a warning on /status
BEHIND_WARNED_VERSIONS = 3  # a live learner this many versions behind on a fragment is a warning
WARNINGS_MAX = 16

# Round latency buckets in seconds (a Prometheus histogram).
ROUND_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ROUND_SAMPLES_KEPT = 100_000  # raw latencies kept for percentiles (bench, status)
PUSHED_FATES = tuple(f for f in FATES if f != "lost")  # the fates a push gives (per learner)


@dataclass(frozen=True)
class LastRound:
    """A fragment's last merged round, as the Merged effect told it."""

    at: float  # the daemon's clock when it merged
    learners: int  # contributions merged
    grace_s: float
    round_s: float  # open to close


@dataclass
class Metrics:
    """The daemon's counters. Written on the core thread and the event loop, read by /metrics: plain
    numbers, and values replaced whole (`last_rounds`), so a reader never sees a half-made one."""

    merges: int = 0
    pushes_merged: int = 0  # contributions of the rounds merged (pushes per merge: this / merges)
    bytes_in: int = 0  # frames' bytes, on the websockets and the lanes
    bytes_out: int = 0
    lane_bytes_in: int = 0  # of them, the frames' data that went on a lane (net.lane)
    lane_bytes_out: int = 0
    frames_in: int = 0
    frames_out: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # by reason (error code)
    wire_errors: dict[str, int] = field(default_factory=dict)  # malformed input dropped at the boundary
    grace_s_last: float = 0.0
    round_counts: list[int] = field(default_factory=lambda: [0] * (len(ROUND_BUCKETS_S) + 1))
    round_sum_s: float = 0.0
    round_samples_s: deque = field(default_factory=lambda: deque(maxlen=ROUND_SAMPLES_KEPT))
    merge_kernel_s: float = 0.0  # time spent in the core's merge path (kernels), summed
    merge_kernel_last_s: float = 0.0  # the same, of the last event that merged
    checkpoints: int = 0
    checkpoint_failures: int = 0
    dropped_slow: int = 0
    last_rounds: Mapping[int, LastRound] = field(default_factory=lambda: MappingProxyType({}))  # by fragment

    def observe_round(self, seconds: float) -> None:
        for i, bound in enumerate(ROUND_BUCKETS_S):
            if seconds <= bound:
                self.round_counts[i] += 1
                break
        else:
            self.round_counts[-1] += 1
        self.round_sum_s += seconds
        self.round_samples_s.append(seconds)

    def observe_merged(self, effect: Merged, at: float) -> None:
        """A round merged (the core's Merged effect) at the daemon's time `at`."""
        self.merges += 1
        self.pushes_merged += len(effect.learners)
        self.grace_s_last = effect.grace_s
        self.observe_round(effect.round_s)
        last = LastRound(at, len(effect.learners), effect.grace_s, effect.round_s)
        self.last_rounds = MappingProxyType({**self.last_rounds, effect.fragment: last})

    def count(self, table: dict[str, int], reason: str) -> None:
        table[reason] = table.get(reason, 0) + 1


@dataclass(frozen=True)
class LearnerView:
    id: int
    name: str
    status: LearnerStatus
    step: int
    last_seen: float
    versions: tuple[int, ...]
    steps: tuple[int, ...]
    tokens: tuple[int, ...]
    pushed: Mapping[str, int] = field(default_factory=dict)  # its pushes' tokens by fate (core.ledger)
    versions_behind: int = 0  # on its furthest-behind fragment (holding none counts as one behind version 0)


@dataclass(frozen=True)
class FragmentView:
    index: int
    version: int
    elements: int
    round_open: int | None


@dataclass(frozen=True)
class SyncerView:
    """What /status and /metrics show of the core state, copied at one instant (between two events)."""

    global_step: int
    merges: int
    init_source: str
    config: Mapping
    layout_digest: str | None
    learners: tuple[LearnerView, ...]  # by id: the connected ones and the GONE_SHOWN gone most recently
    fragments: tuple[FragmentView, ...]  # the fragments this syncer owns (every one unless it is a shard)
    decisions: tuple[Decision, ...]  # the last DECISIONS_SHOWN
    ledger: Mapping
    rejections: Mapping
    holds_parameters: bool
    late_pushes: Mapping  # core.syncer: carried (merged, discounted) / rejected (too stale)
    # A sharded syncer (core.shards): shard `shard` of `shards`, owning the fragments `owned`.
    shard: int = 0
    shards: int = 1
    owned: tuple[int, ...] = ()

    @property
    def connected(self) -> tuple[LearnerView, ...]:
        return tuple(r for r in self.learners if r.status is not LearnerStatus.GONE)


@functools.lru_cache(maxsize=4)
def _config_view(config: SyncerConfig) -> Mapping[str, Any]:
    """The config as the view shows it: made once per config (`to_dict` took about 24 us of each
    view, and a view is taken as often as every event, net.server._refresh_view)."""
    return MappingProxyType(config.to_dict())


def view_of(state: SyncerState) -> SyncerView:
    """A frozen copy of what the outside may read; small (no parameters), but O(learners x fragments):
    the server takes it when its core is idle, and under load every VIEW_REFRESH_S (net.server)."""
    owned = state.owned
    versions = [state.fragments[p].version for p in owned]
    gone = sorted((r for r in state.learners.values() if r.status is LearnerStatus.GONE), key=lambda r: r.last_seen)
    shown = [r for r in state.learners.values() if r.status is not LearnerStatus.GONE] + gone[-GONE_SHOWN:]
    learners = tuple(
        LearnerView(
            r.id,
            r.name,
            r.status,
            r.step,
            r.last_seen,
            tuple(r.versions),
            tuple(r.steps),
            tuple(r.tokens),
            MappingProxyType(state.ledger.of_learner(r.id)),
            _behind(versions, [r.versions[p] for p in owned]),
        )
        for r in sorted(shown, key=lambda r: r.id)
    )
    fragments = tuple(
        FragmentView(
            p,
            f.version,
            state.layout.fragments[p].padded_size if state.layout else 0,
            f.open.number if f.open else None,
        )
        for p, f in ((p, state.fragments[p]) for p in owned)
    )
    decisions = tuple(state.decisions)[-DECISIONS_SHOWN:]
    return SyncerView(
        global_step=state.global_step,
        merges=state.merges,
        init_source=state.init_source,
        config=_config_view(state.config),
        layout_digest=state.layout.digest if state.layout else None,
        learners=learners,
        fragments=fragments,
        decisions=decisions,
        ledger=MappingProxyType(state.ledger.summary()),
        rejections=MappingProxyType(dict(state.rejections)),
        holds_parameters=state.holds_parameters,
        late_pushes=MappingProxyType(dict(state.late_pushes)),
        shard=state.config.shard,
        shards=state.config.shards,
        owned=owned,
    )


def _behind(current: list[int], held: list[int]) -> int:
    # A learner holding none of a fragment (-1) is one version behind version 0.
    return max((c - h for c, h in zip(current, held, strict=True)), default=0)


# ---- /metrics ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reading:
    """What one scrape reads, taken at once: the view, the counters and the checkpoint health."""

    view: SyncerView
    metrics: Metrics
    now: float  # the daemon's clock (the view's times are on it)
    checkpoint: Health | None = None  # None: no checkpoint directory
    checkpoint_now: float = 0.0  # the checkpoint store's clock (the health's times are on it)

    @property
    def checkpoint_age_s(self) -> float | None:
        if self.checkpoint is None or self.checkpoint.written_at is None:
            return None
        return max(0.0, self.checkpoint_now - self.checkpoint.written_at)


class SyncerCollector(Collector):
    """The daemon's metric families, made afresh from one `Reading` per scrape."""

    def __init__(self, read: Callable[[], Reading]):
        self._read = read

    def collect(self) -> Iterator[Metric]:
        r = self._read()
        yield from _syncer_families(r)
        yield from _learner_families(r)
        yield from _fragment_families(r)
        yield from _checkpoint_families(r)


def new_registry(read: Callable[[], Reading]) -> CollectorRegistry:
    """A registry of its own for one daemon: its collector and the process's metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SyncerCollector(read))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


def _counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"ddiloco_{name}", help_text, value=value)


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"ddiloco_{name}", help_text, value=value)


def _by(table: Mapping[str, int], family: CounterMetricFamily) -> CounterMetricFamily:
    for key, n in sorted(table.items()):
        family.add_metric([key], n)
    return family


def _syncer_families(r: Reading) -> Iterator[Metric]:
    v, m = r.view, r.metrics
    yield _counter("merges_total", "Fragment merges applied (each one new version of one fragment).", v.merges)
    yield _by(
        v.rejections,
        CounterMetricFamily(
            "ddiloco_rejected_messages_total", "Messages the syncer core refused, by reason.", labels=["reason"]
        ),
    )
    yield _by(
        m.wire_errors,
        CounterMetricFamily(
            "ddiloco_wire_errors_total", "Frames refused at the wire boundary, by code.", labels=["code"]
        ),
    )
    yield _counter("pushes_merged_total", "Pushes merged (contributions of the rounds merged).", m.pushes_merged)
    yield _counter("received_bytes_total", "Frame bytes received from learners (websockets and lanes).", m.bytes_in)
    yield _counter("sent_bytes_total", "Frame bytes sent to learners (websockets and lanes).", m.bytes_out)
    yield _counter("received_lane_bytes_total", "Of the bytes received, those that came on a lane.", m.lane_bytes_in)
    yield _counter("sent_lane_bytes_total", "Of the bytes sent, those that went on a lane.", m.lane_bytes_out)
    yield _counter("received_frames_total", "Websocket frames received from learners.", m.frames_in)
    yield _counter("sent_frames_total", "Websocket frames sent to learners.", m.frames_out)
    yield _counter(
        "learners_dropped_slow_total", "Learners dropped for not reading what the syncer sends.", m.dropped_slow
    )
    yield _counter(
        "merge_kernel_seconds_total", "Time spent in the merge path of the core (kernels).", m.merge_kernel_s
    )
    yield _counter(
        "tokens_reported_total", "Tokens learners reported training (core.ledger).", v.ledger.get("reported", 0)
    )
    tokens = CounterMetricFamily(
        "ddiloco_tokens_total",
        "Reported tokens by fate (merged, merged_late, late, stale, rejected, lost).",
        labels=["fate"],
    )
    for fate in FATES:
        tokens.add_metric([fate], v.ledger.get(fate, 0))
    yield tokens
    yield _by(
        v.late_pushes,
        CounterMetricFamily(
            "ddiloco_late_pushes_total",
            "Pushes merged against an older version than their base (carried, weight / (1 + staleness)) or "
            "refused as too stale (rejected).",
            labels=["outcome"],
        ),
    )
    yield _gauge(
        "tokens_open", "Reported tokens whose fate is not decided yet (open windows).", v.ledger.get("open", 0)
    )
    statuses = GaugeMetricFamily("ddiloco_learners", "Learners connected, by status.", labels=["status"])
    for status in LearnerStatus:
        if status is not LearnerStatus.GONE:
            statuses.add_metric([status.value], sum(1 for x in v.learners if x.status is status))
    yield statuses
    yield _gauge(
        "learners_max",
        "Learners the syncer serves at most (the per-learner series are bounded by it).",
        v.config.get("learners_max", 0),
    )
    yield _gauge("global_step", "Step of the K-th most advanced live learner.", v.global_step)
    shard = GaugeMetricFamily(
        "ddiloco_shard_info",
        "1, labelled with this syncer's shard index and shard count (0 of 1: not sharded); its fragment series "
        "cover the fragments it owns, p with p mod shards == shard.",
        labels=["shard", "shards"],
    )
    shard.add_metric([str(v.shard), str(v.shards)], 1)
    yield shard
    yield _gauge("grace_window_seconds", "Grace window of the last merged round.", m.grace_s_last)
    counts = list(m.round_counts)  # one copy: the core thread counts on meanwhile
    buckets, cumulative = [], 0
    for bound, n in zip((*(f"{b:g}" for b in ROUND_BUCKETS_S), "+Inf"), counts, strict=True):
        cumulative += n
        buckets.append((bound, cumulative))
    yield HistogramMetricFamily(
        "ddiloco_round_seconds", "Round latency, open to merge.", buckets=buckets, sum_value=m.round_sum_s
    )


def _learner_families(r: Reading) -> Iterator[Metric]:
    # Connected learners only: at most learners_max of them, so the label sets stay bounded.
    labels = ["learner", "name"]
    info = GaugeMetricFamily(
        "ddiloco_learner_info", "A connected learner: 1, with its status.", labels=[*labels, "status"]
    )
    step = GaugeMetricFamily("ddiloco_learner_step", "The learner's step, as it last reported.", labels=labels)
    seen = GaugeMetricFamily(
        "ddiloco_learner_last_seen_age_seconds", "Seconds since the learner last sent anything.", labels=labels
    )
    behind = GaugeMetricFamily(
        "ddiloco_learner_versions_behind",
        "Versions the learner is behind on its furthest-behind fragment.",
        labels=labels,
    )
    held = GaugeMetricFamily(
        "ddiloco_learner_held_version",
        "Version of each fragment the learner holds (-1: none).",
        labels=[*labels, "fragment"],
    )
    tokens = CounterMetricFamily(
        "ddiloco_learner_tokens_total", "The learner's pushed tokens by fate.", labels=[*labels, "fate"]
    )
    for x in r.view.connected:
        who = [str(x.id), x.name[:NAME_LABEL_CHARS_MAX]]
        info.add_metric([*who, x.status.value], 1)
        step.add_metric(who, x.step)
        seen.add_metric(who, max(0.0, r.now - x.last_seen))
        behind.add_metric(who, x.versions_behind)
        for p in r.view.owned:  # a shard's learners hold the other fragments from the other shards
            held.add_metric([*who, str(p)], x.versions[p])
        for fate in PUSHED_FATES:
            tokens.add_metric([*who, fate], x.pushed.get(fate, 0))
    yield from (info, step, seen, behind, held, tokens)


def _fragment_families(r: Reading) -> Iterator[Metric]:
    labels = ["fragment"]
    version = GaugeMetricFamily("ddiloco_fragment_version", "The fragment's current version.", labels=labels)
    elements = GaugeMetricFamily("ddiloco_fragment_elements", "Elements in the fragment (padded).", labels=labels)
    opened = GaugeMetricFamily("ddiloco_fragment_round_open", "1 while a round of the fragment is open.", labels=labels)
    age = GaugeMetricFamily(
        "ddiloco_fragment_last_merge_age_seconds", "Seconds since the fragment last merged.", labels=labels
    )
    size = GaugeMetricFamily(
        "ddiloco_fragment_last_round_learners", "Contributions merged in the fragment's last round.", labels=labels
    )
    grace = GaugeMetricFamily(
        "ddiloco_fragment_last_round_grace_seconds", "Grace window of the fragment's last round.", labels=labels
    )
    took = GaugeMetricFamily(
        "ddiloco_fragment_last_round_seconds", "The fragment's last round, open to merge.", labels=labels
    )
    last_rounds = r.metrics.last_rounds
    for f in r.view.fragments:
        p = f.index
        which = [str(p)]
        version.add_metric(which, f.version)
        elements.add_metric(which, f.elements)
        opened.add_metric(which, 0 if f.round_open is None else 1)
        last = last_rounds.get(p)
        if last is not None:  # no sample before the first merge: "never" is not a number of seconds
            age.add_metric(which, max(0.0, r.now - last.at))
            size.add_metric(which, last.learners)
            grace.add_metric(which, last.grace_s)
            took.add_metric(which, last.round_s)
    yield from (version, elements, opened, age, size, grace, took)


def _checkpoint_families(r: Reading) -> Iterator[Metric]:
    yield _counter("checkpoints_written_total", "Checkpoints written.", r.metrics.checkpoints)
    yield _counter("checkpoint_failures_total", "Checkpoint writes that failed.", r.metrics.checkpoint_failures)
    health = r.checkpoint
    failing = GaugeMetricFamily(
        "ddiloco_checkpoint_failures_since_written", "Failed checkpoint writes since the last one written (0: healthy)."
    )
    age = GaugeMetricFamily("ddiloco_checkpoint_age_seconds", "Seconds since the last checkpoint was written.")
    if health is not None:  # without a checkpoint directory there is nothing to tell
        failing.add_metric([], health.failures_since_written)
        if r.checkpoint_age_s is not None:
            age.add_metric([], r.checkpoint_age_s)
    yield from (failing, age)


# ---- /status ---------------------------------------------------------------------------------------


def checkpoint_status(r: Reading) -> dict | None:
    """The checkpoint health for /status with its age; None without a checkpoint directory."""
    if r.checkpoint is None:
        return None
    age = r.checkpoint_age_s
    return {**r.checkpoint.as_dict(), "age_s": None if age is None else round(age, 3)}


def warnings_of(r: Reading) -> list[str]:
    """What an operator should look at, most serious first: a failing checkpoint, learners gone, late
    pushes, learners falling behind. At most WARNINGS_MAX."""
    out: list[str] = []
    health = r.checkpoint
    if health is not None and not health.ok:
        out.append(
            f"checkpoint failing: {health.failures_since_written} attempt(s) since the last one written: {health.error}"
        )
    for x in sorted((x for x in r.view.learners if x.status is LearnerStatus.GONE), key=lambda x: -x.last_seen):
        ago = r.now - x.last_seen
        if ago <= GONE_WARNED_S:
            out.append(f"learner {x.id} ({x.name}) gone, last seen {ago:.0f} s ago")
    late = r.view.ledger.get("merged_late", 0)
    if late:
        out.append(
            f"{late} tokens merged late (against an older version, discounted): "
            f"{_share(late, r.view.ledger)} of those pushed"
        )
    for x in r.view.connected:
        if x.pushed.get("merged_late", 0):
            n = x.pushed["merged_late"]
            out.append(f"learner {x.id} ({x.name}): {n} tokens merged late, {_share(n, x.pushed)}")
        if x.status is LearnerStatus.LIVE and x.versions_behind >= BEHIND_WARNED_VERSIONS:
            out.append(f"learner {x.id} ({x.name}) is {x.versions_behind} versions behind")
    return out[:WARNINGS_MAX]


def _share(n: int, books: Mapping[str, int]) -> str:
    pushed = sum(books.get(f, 0) for f in PUSHED_FATES)
    return f"{100 * n / pushed:.1f}%" if pushed else "n/a"


def status_document(r: Reading, started_at: float) -> dict:
    """The /status JSON: learners, fragments, last decisions with reasons, the token ledger, the
    checkpoint health and what needs looking at (`warnings`)."""
    v = r.view
    learners = [
        {
            "id": x.id,
            "name": x.name,
            "status": x.status.value,
            "step": x.step,
            "last_seen_s_ago": round(r.now - x.last_seen, 3),
            "tokens": list(x.tokens),
            "weights": [token_weight(t, s) for t, s in zip(x.tokens, x.steps, strict=True)],
            "versions": list(x.versions),
            "versions_behind": x.versions_behind,
            "pushed_tokens": dict(x.pushed),
        }
        for x in v.connected
    ]
    gone = [
        {"id": x.id, "name": x.name, "last_seen_s_ago": round(r.now - x.last_seen, 3)}
        for x in v.learners
        if x.status is LearnerStatus.GONE
    ]
    last_rounds = r.metrics.last_rounds
    fragments = []
    for f in v.fragments:
        p = f.index
        last = last_rounds.get(p)
        fragments.append(
            {
                "index": p,
                "version": f.version,
                "elements": f.elements,
                "round_open": f.round_open,
                "last_merge_s_ago": None if last is None else round(r.now - last.at, 3),
                "last_round_learners": None if last is None else last.learners,
                "last_round_grace_s": None if last is None else round(last.grace_s, 4),
            }
        )
    decisions = [
        {
            "at_s": round(d.at, 3),
            "s_ago": round(r.now - d.at, 3),
            "fragment": d.fragment,
            "round": d.round,
            "outcome": d.outcome,
            "version": d.version,
            "reason": d.reason,
        }
        for d in v.decisions
    ]
    return {
        "global_step": v.global_step,
        "merges": v.merges,
        "shard": v.shard,
        "shards": v.shards,
        "owned": list(v.owned),
        "uptime_s": round(r.now - started_at, 3),
        "init_source": v.init_source,
        "config": dict(v.config),
        "layout_digest": v.layout_digest,
        "learners": learners,
        "gone": gone,
        "fragments": fragments,
        "decisions": decisions,
        "ledger": dict(v.ledger),
        "checkpoint": checkpoint_status(r),
        "warnings": warnings_of(r),
        "bytes_in": r.metrics.bytes_in,
        "bytes_out": r.metrics.bytes_out,
        "lane_bytes_in": r.metrics.lane_bytes_in,
        "lane_bytes_out": r.metrics.lane_bytes_out,
    }
