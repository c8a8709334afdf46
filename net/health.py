"""Whether the daemon is healthy: the judgement behind `/healthz`, and the same facts for `/status`.

Failing (503, with the reasons): the core loop is not running (it failed, or the daemon is
stopping), or it has completed no item for `core_stall_s_max` while items wait or one is being
handled (a core stuck in a kernel or a lock serves nobody, though every socket is open).

Degraded (200): the latest checkpoint failed (a full or read-only disk). Not 503, on purpose: what
acts on /healthz (a load balancer, an orchestrator's liveness probe) would take the syncer out or
restart it, which cannot free the disk and loses every merge since the last good checkpoint; the
syncer goes on merging and the next checkpoint tries again. The reason names the failure, for the
alert a human reads; `ddiloco_checkpoint_failures_total` counts them.

Pure: the facts and the clocks' readings come in, a value goes out.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddiloco.net.core_loop import CoreHealth
from ddiloco.net.store import Health

__all__ = ["Verdict", "checkpoint_section", "core_section", "judge"]

OK, DEGRADED, FAILING = "ok", "degraded", "failing"


@dataclass(frozen=True)
class Verdict:
    status: str  # ok | degraded | failing
    http_status: int
    reasons: tuple[str, ...]
    document: dict  # the JSON /healthz answers


def core_section(core: CoreHealth) -> dict:
    return {
        "running": core.running,
        "failure": core.failure,
        "queued": core.queued,
        "busy_s": None if core.busy_s is None else round(core.busy_s, 3),
        "since_completed_s": round(core.since_completed_s, 3),
    }


def checkpoint_section(health: Health | None, wall_now: float) -> dict | None:
    """The checkpoint store's health with the age of the last checkpoint written (None: no
    checkpoint directory). `wall_now` on the store's clock."""
    if health is None:
        return None
    age = None if health.written_at is None else round(wall_now - health.written_at, 3)
    return {**health.as_dict(), "age_s": age}


def judge(core: CoreHealth, checkpoint: Health | None, wall_now: float, core_stall_s_max: float) -> Verdict:
    failing, degraded = [], []
    if not core.running:
        failing.append(f"the core is not running: {core.failure}" if core.failure else "the core is not running")
    elif core.stalled_s() > core_stall_s_max:
        failing.append(
            f"the core has completed nothing for {core.stalled_s():.1f} s with {core.queued} items "
            f"waiting (core_stall_s_max {core_stall_s_max:g} s)"
        )
    if checkpoint is not None and not checkpoint.ok:
        degraded.append(
            f"{checkpoint.failures_since_written} checkpoint(s) failed since the last one written: {checkpoint.error}"
        )
    status = FAILING if failing else DEGRADED if degraded else OK
    reasons = tuple(failing + degraded)
    document = {
        "status": status,
        "reasons": list(reasons),
        "core": core_section(core),
        "checkpoint": checkpoint_section(checkpoint, wall_now),
    }
    return Verdict(status, 503 if failing else 200, reasons, document)
