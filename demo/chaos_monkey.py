"""The demo's chaos monkey: a seeded plan of faults by global step, and carrying them out (SIGKILL a
learner, SIGSTOP one for a while, SIGKILL the syncer once)."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

import numpy as np

from ddiloco.demo.config import DemoConfig

if TYPE_CHECKING:
    from ddiloco.demo.supervisor import Demo, LearnerProcess

__all__ = ["act", "chaos_plan"]


def chaos_plan(cfg: DemoConfig, rng: np.random.Generator) -> list[tuple[int, str, int]]:
    """(global step, action, learner) sorted by step, drawn from the seed. By step, not by time, so
    that a slow or busy machine (start-up and compilation take seconds) sees the same faults at the
    same point of training. The syncer's kill is drawn last: the learners' plan is the same with or
    without it."""

    def at(lo: float, hi: float, n: int) -> list[int]:
        return [int(s) for s in rng.uniform(lo, hi, n) * cfg.steps]

    kills = [(s, "kill", int(rng.integers(cfg.learners))) for s in at(0.25, 0.7, cfg.kills)]
    pauses = [(s, "pause", int(rng.integers(cfg.learners))) for s in at(0.2, 0.8, cfg.pauses)]
    syncer = [(at(0.3, 0.5, 1)[0], "kill-syncer", -1)] if cfg.kill_syncer else []
    return sorted(kills + pauses + syncer)


def act(demo: Demo, plan: list, now: float) -> list:
    """Carry out the planned actions that are due at the current global step; returns the rest."""
    while plan and plan[0][0] <= demo.step:
        _, action, i = plan.pop(0)
        if action == "kill-syncer":
            if not any((demo.work / "ckpt").glob("*")):  # nothing to resume from yet: a step later
                plan = sorted(plan + [(demo.step + 1, action, i)])
                break
            demo.syncer.proc.send_signal(signal.SIGKILL)
            demo.syncer.killed_at = now
            demo.record("kill-syncer", now)
            demo.view.note(f"chaos: kill the syncer at {now:.1f} s")
            continue
        lr = _target(demo, i)
        if lr is None:
            continue
        if _up(demo) <= 1:
            # At most all but one learner down at a time, as a disruption budget would have it:
            # a fault on the last one running is a full outage, which no syncer can merge through.
            plan = sorted(plan + [(demo.step + 1, action, i)])
            break
        if action == "kill":
            lr.proc.send_signal(signal.SIGKILL)
            lr.killed_at = now
            demo.record("kill", now, learner=lr.index)
        else:
            lr.proc.send_signal(signal.SIGSTOP)
            lr.paused_until = now + demo.cfg.pause_s
            demo.record("pause", now, learner=lr.index)
        demo.view.note(f"chaos: {action} learner {lr.index} at {now:.1f} s")
    return plan


def _up(demo: Demo) -> int:
    return sum(1 for lr in demo.learners if _is_up(lr))


def _is_up(lr: LearnerProcess) -> bool:
    down = lr.killed_at is not None or lr.restarted_at is not None or lr.paused_until is not None
    return not (down or lr.done or lr.stopping or lr.proc.poll() is not None)


def _target(demo: Demo, i: int) -> LearnerProcess | None:
    """Learner i, or the next one after it that is running and caught up: a fault aimed at a
    learner that is still restarting would only lengthen the same outage."""
    for k in range(len(demo.learners)):
        lr = demo.learners[(i + k) % len(demo.learners)]
        if _is_up(lr):
            return lr
    return None
