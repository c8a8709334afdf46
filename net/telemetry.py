"""What the syncer tells the outside: Prometheus metrics and the /status JSON.

Counters are updated by the daemon from the effects the core returns and from the bytes it moves.
The status document and the gauges are read off a `SyncerView`: a frozen value the core thread
publishes after each event, so the HTTP handlers never read the state the core is changing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ddiloco.core.syncer import Decision, LearnerStatus, SyncerState
from ddiloco.core.weights import token_weight

DECISIONS_SHOWN = 16  # the last decisions /status lists

# Round latency buckets in seconds (a Prometheus histogram).
ROUND_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ROUND_SAMPLES_KEPT = 100_000  # raw latencies kept for percentiles (bench, status)


@dataclass
class Metrics:
    merges: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    frames_in: int = 0
    frames_out: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # by reason (error code)
    wire_errors: dict[str, int] = field(default_factory=dict)  # malformed input dropped at the boundary
    grace_s_last: float = 0.0
    round_counts: list[int] = field(default_factory=lambda: [0] * (len(ROUND_BUCKETS_S) + 1))
    round_sum_s: float = 0.0
    round_samples_s: deque = field(default_factory=lambda: deque(maxlen=ROUND_SAMPLES_KEPT))
    merge_kernel_s: float = 0.0  # time spent in the core's merge path (kernels), summed
    checkpoints: int = 0
    checkpoint_failures: int = 0
    dropped_slow: int = 0

    def observe_round(self, seconds: float) -> None:
        for i, bound in enumerate(ROUND_BUCKETS_S):
            if seconds <= bound:
                self.round_counts[i] += 1
                break
        else:
            self.round_counts[-1] += 1
        self.round_sum_s += seconds
        self.round_samples_s.append(seconds)

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


@dataclass(frozen=True)
class FragmentView:
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
    learners: tuple[LearnerView, ...]  # by id, gone ones included (the gauges count them apart)
    fragments: tuple[FragmentView, ...]
    decisions: tuple[Decision, ...]  # the last DECISIONS_SHOWN
    ledger: Mapping
    rejections: Mapping
    holds_parameters: bool


def view_of(state: SyncerState) -> SyncerView:
    """A frozen copy of what the outside may read; small (no parameters), taken after every event."""
    learners = tuple(
        LearnerView(lid, r.name, r.status, r.step, r.last_seen, tuple(r.versions), tuple(r.steps), tuple(r.tokens))
        for lid, r in sorted(state.learners.items())
    )
    fragments = tuple(
        FragmentView(f.version, state.layout.fragments[p].padded_size if state.layout else 0, f.open.number if f.open else None)
        for p, f in enumerate(state.fragments)
    )
    decisions = tuple(state.decisions)[-DECISIONS_SHOWN:]
    return SyncerView(
        global_step=state.global_step, merges=state.merges, init_source=state.init_source,
        config=MappingProxyType(state.config.to_dict()), layout_digest=state.layout.digest if state.layout else None,
        learners=learners, fragments=fragments, decisions=decisions,
        ledger=MappingProxyType(state.ledger.summary()), rejections=MappingProxyType(dict(state.rejections)),
        holds_parameters=state.holds_parameters,
    )


def render_prometheus(metrics: Metrics, state: SyncerView) -> str:
    """The Prometheus text exposition format (version 0.0.4)."""
    live = sum(1 for r in state.learners if r.status is LearnerStatus.LIVE)
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP ddiloco_{name} {help_text}")
        lines.append(f"# TYPE ddiloco_{name} {kind}")
        for labels, value in samples:
            lines.append(f"ddiloco_{name}{labels} {value:g}" if isinstance(value, float) else f"ddiloco_{name}{labels} {value}")

    metric("merges_total", "counter", "Fragment merges applied.", [("", state.merges)])
    reasons = sorted(set(state.rejections) | set(metrics.rejected))
    metric(
        "rejected_pushes_total", "counter", "Messages refused by the syncer core, by reason.",
        [(f'{{reason="{r}"}}', state.rejections.get(r, 0)) for r in reasons],
    )
    metric(
        "wire_errors_total", "counter", "Frames refused at the wire boundary, by code.",
        [(f'{{code="{c}"}}', n) for c, n in sorted(metrics.wire_errors.items())],
    )
    metric("bytes_in_total", "counter", "Payload bytes received.", [("", metrics.bytes_in)])
    metric("bytes_out_total", "counter", "Payload bytes sent.", [("", metrics.bytes_out)])
    metric("grace_window_seconds", "gauge", "Grace window chosen for the last round.", [("", float(metrics.grace_s_last))])
    metric("learners_live", "gauge", "Learners live (contributing).", [("", live)])
    metric("learners_connected", "gauge", "Learners connected, any state.",
           [("", sum(1 for r in state.learners if r.status is not LearnerStatus.GONE))])
    metric("global_step", "gauge", "Step of the K-th most advanced live learner.", [("", state.global_step)])
    metric("checkpoints_total", "counter", "Checkpoints written.", [("", metrics.checkpoints)])
    metric("checkpoint_failures_total", "counter", "Checkpoints that could not be written.", [("", metrics.checkpoint_failures)])
    metric("learners_dropped_slow_total", "counter", "Learners dropped for not reading.", [("", metrics.dropped_slow)])
    for name, value in state.ledger.items():
        lines.append(f'ddiloco_tokens{{fate="{name}"}} {value}')
    lines.append("# HELP ddiloco_round_seconds Round latency, open to merge.")
    lines.append("# TYPE ddiloco_round_seconds histogram")
    cumulative = 0
    for bound, n in zip(ROUND_BUCKETS_S, metrics.round_counts):
        cumulative += n
        lines.append(f'ddiloco_round_seconds_bucket{{le="{bound:g}"}} {cumulative}')
    cumulative += metrics.round_counts[-1]
    lines.append(f'ddiloco_round_seconds_bucket{{le="+Inf"}} {cumulative}')
    lines.append(f"ddiloco_round_seconds_sum {metrics.round_sum_s:g}")
    lines.append(f"ddiloco_round_seconds_count {cumulative}")
    return "\n".join(lines) + "\n"


def status_document(state: SyncerView, metrics: Metrics, now: float, uptime_s: float) -> dict:
    """The /status JSON: learners, fragments, last decisions with reasons, the token ledger."""
    learners = [
        {
            "id": r.id, "name": r.name, "status": r.status.value, "step": r.step,
            "last_seen_s_ago": round(now - r.last_seen, 3), "tokens": list(r.tokens),
            "weights": [token_weight(t, s) for t, s in zip(r.tokens, r.steps)], "versions": list(r.versions),
        }
        for r in state.learners
        if r.status is not LearnerStatus.GONE
    ]
    fragments = [{"index": p, "version": f.version, "elements": f.elements, "round_open": f.round_open}
                 for p, f in enumerate(state.fragments)]
    decisions = [
        {"at_s": round(d.at, 3), "fragment": d.fragment, "round": d.round, "outcome": d.outcome,
         "version": d.version, "reason": d.reason}
        for d in state.decisions
    ]
    return {
        "global_step": state.global_step,
        "merges": state.merges,
        "uptime_s": round(uptime_s, 3),
        "init_source": state.init_source,
        "config": dict(state.config),
        "layout_digest": state.layout_digest,
        "learners": learners,
        "fragments": fragments,
        "decisions": decisions,
        "ledger": dict(state.ledger),
        "bytes_in": metrics.bytes_in,
        "bytes_out": metrics.bytes_out,
    }
