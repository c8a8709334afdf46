"""The demo's report: what a run measured (`DemoReport`), as text and as JSON, and the measures
computed from the supervisor's record (uptime, goodput, the learners' loss curve)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ddiloco.demo.config import DemoConfig

if TYPE_CHECKING:
    from ddiloco.demo.supervisor import LossLog

__all__ = [
    "DemoReport",
    "goodput",
    "ledger_lines",
    "learner_curve",
    "report_json",
    "report_text",
    "trained_tokens",
    "uptime_and_longest_gap",
]

# core.ledger's fates, and still open; "merged" counts merged_late too, its share said beside it
LEDGER_FATES = ("merged", "late", "stale", "rejected", "lost", "open")


@dataclass
class DemoReport:
    eval_loss: float
    eval_bits_per_byte: float
    baseline_eval_loss: float | None
    baseline_bits_per_byte: float | None
    choice_accuracy: float | None  # true next line among 4 (model.make_choice_accuracy, "pmi"); chance 0.25
    baseline_choice_accuracy: float | None
    uptime: float
    longest_merge_gap_s: float
    goodput: float
    kills: int  # learner kills
    recoveries: int  # learner restarts
    merges: int
    ledger: dict
    wall_s: float
    events: list = field(default_factory=list)
    catch_up: list = field(default_factory=list)  # per recovery: restart -> live at the syncer, seconds
    syncer_kills: int = 0
    syncer_outage_s: float | None = None  # syncer killed -> first merge after its restart
    syncer_restart: dict | None = None  # the restart step by step (demo.supervisor.restart_timeline)
    curves: dict = field(default_factory=dict)  # "learners"/"baseline": [[tokens, train loss], ...]
    config: dict = field(default_factory=dict)
    tokens_trained: int = 0  # by all learners, from the ledger (the budget is the baseline's)
    token_budget: int = 0
    global_steps: int = 0


def trained_tokens(status: dict) -> int:
    """Tokens the learners have trained on, from the syncer's ledger: every step's tokens are
    reported once for each fragment (the counters run per fragment)."""
    return status["ledger"]["reported"] // max(1, len(status["fragments"]))


def ledger_lines(ledger: dict, fragments: int) -> list[str]:
    """The syncer's token ledger in words. Its counts are per fragment: each token trained is
    reported once for every fragment (the learner's counters run per fragment, and each fragment's
    share of them ends merged, late, stale, rejected or lost on its own). Printed raw, "reported"
    reads as P times the tokens trained; so: the tokens trained, then the fates as shares."""
    reported = ledger.get("reported", 0)
    if not reported:
        return ["token ledger   nothing reported"]
    late = ledger.get("merged_late", 0)  # merged against an older version, weight discounted (protocol 2)
    counts = {fate: ledger.get(fate, 0) + (late if fate == "merged" else 0) for fate in LEDGER_FATES}
    shares = ", ".join(
        f"{fate} {100 * n / reported:.1f}%"
        + (f" ({100 * late / reported:.1f}% late, discounted)" if fate == "merged" and late else "")
        for fate, n in counts.items()
    )
    return [
        (
            f"token ledger   counted per fragment: each of the {reported // max(1, fragments):,} tokens trained is "
            f"counted once for each of the {fragments} fragments ({reported:,} in all)"
        ),
        f"               what became of them: {shares}",
    ]


def uptime_and_longest_gap(
    merge_times: list[float], trained_until: float, wall: float, cfg: DemoConfig
) -> tuple[float, float]:
    """(uptime, longest gap in seconds). Counts from the first merge (before it the processes start
    and compile) until the last learner finished; a gap between merges longer than two fragment
    periods is downtime, all of it."""
    span = [merge_times[0]] + merge_times + [trained_until] if merge_times else [0.0, wall]
    gaps = np.diff(span)
    period_s = (span[-1] - span[0]) / max(1, cfg.steps) * cfg.period
    downtime = float(np.sum(gaps[gaps > 2 * period_s])) if merge_times else wall
    return 1.0 - downtime / max(span[-1] - span[0], 1e-9), float(gaps.max())


def learner_curve(logs: list[LossLog], tokens_per_step: int, bin_steps: int = 10) -> list[list[float]]:
    """Mean train loss of all learners per bin of global steps, against global tokens."""
    bins: dict[int, list[float]] = {}
    for log in logs:
        for step, loss in log.points:
            if np.isfinite(loss):
                bins.setdefault(step // bin_steps, []).append(loss)
    return [[(b + 0.5) * bin_steps * tokens_per_step, float(np.mean(v))] for b, v in sorted(bins.items())]


def goodput(events: list[dict], cfg: DemoConfig, wall: float) -> float:
    """Share of learner-time not lost to kills (down until restarted) or pauses."""
    ends = {"restart": "kill", "resume": "pause"}  # the event that ends each kind of outage
    lost, open_at = 0.0, {}
    for e in events:
        if e["what"] in ends.values():
            open_at[(e["what"], e["learner"])] = e["t"]
        elif e["what"] in ends and (ends[e["what"]], e["learner"]) in open_at:
            lost += e["t"] - open_at.pop((ends[e["what"]], e["learner"]))
    return 1.0 - lost / (wall * cfg.learners)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def report_text(r: DemoReport) -> str:
    def f(x):
        return "-" if x is None else f"{x:.4f}"

    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    rel = (
        "" if r.baseline_eval_loss is None else f" ({100 * (r.eval_loss / r.baseline_eval_loss - 1):+.1f}% vs baseline)"
    )
    catch = ", ".join(f"L{c['learner']} {c['catch_up_s']:.1f} s" for c in r.catch_up) or "-"
    ledger = r.ledger or {}
    merged_share = ledger.get("merged", 0) / ledger["reported"] if ledger.get("reported") else None
    lines = [
        f"merged model   eval loss {f(r.eval_loss)} nats/byte, {f(r.eval_bits_per_byte)} bits/byte{rel}",
        f"data-parallel  eval loss {f(r.baseline_eval_loss)} nats/byte, {f(r.baseline_bits_per_byte)} bits/byte",
        (
            f"choice acc.    merged {pct(r.choice_accuracy)}, data-parallel {pct(r.baseline_choice_accuracy)} "
            f"(true next line among 4, ranked by what the context adds to its likelihood; chance 25%)"
        ),
        f"syncer uptime  {100 * r.uptime:.1f}% (longest gap between merges {r.longest_merge_gap_s:.1f} s)",
        f"goodput        {100 * r.goodput:.1f}% of learner time; {pct(merged_share)} of reported tokens merged",
        (
            f"chaos          {_count(r.kills, 'learner kill')}, {_count(r.recoveries, 'restart')}, "
            f"{len(r.catch_up)} caught up before the end (catch-up: {catch})"
        ),
        (
            f"tokens         {r.tokens_trained:,} trained of a budget of {r.token_budget:,} "
            f"(the baseline's), in {r.global_steps} global steps"
        ),
    ]
    if r.syncer_kills:
        outage = "-" if r.syncer_outage_s is None else f"{r.syncer_outage_s:.1f} s"
        how = "a standby took over" if (r.syncer_restart or {}).get("took_over_at") is not None else "restarted"
        lines.append(f"syncer kill    {r.syncer_kills}, {how} from its checkpoint; kill to next merge {outage}")
        if r.syncer_restart:
            names = {
                "restart_delay_s": "restart delay",
                "takeover_s": "standby takes over",
                "start_and_imports_s": "start and imports",
                "resume_and_listen_s": "resume and listen",
                "warmup_s": "kernel warm-up",
                "rejoin_s": "learners back",
                "first_round_s": "first round",
            }
            parts = ", ".join(
                f"{text} {r.syncer_restart[k]:.2f} s"
                for k, text in names.items()
                if r.syncer_restart.get(k) is not None
            )
            lines.append(f"               ({parts})")
    return "\n".join(
        lines
        + [
            f"merges         {r.merges}",
            *ledger_lines(r.ledger or {}, int(r.config.get("fragments", 1))),
            f"wall time      {r.wall_s:.1f} s",
        ]
    )


def report_json(r: DemoReport) -> dict:
    doc = asdict(r)
    for key in ("record", "restore", "cache_dir"):  # the config's paths
        if doc["config"].get(key) is not None:
            doc["config"][key] = str(doc["config"][key])
    return doc
