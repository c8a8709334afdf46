"""One seed of the chaos simulation: a safety phase with faults, then a liveness phase without.

    result = run_seed(17)

Safety phase, `[0, safety_s)`: the plan's faults hit learners, links and the syncer while the
checker (invariants.py) watches every core step and every consistent snapshot (one every
`snapshot_every_s`, net.snapshot's protocol); the first violation ends the run.

Liveness phase: at `safety_s` everything heals (links, partitions; dead learners start again; a
stopped syncer resumes). Then:

1. every learner must be live in the syncer within `rejoin_s_max` (reconnect backoff included);
2. from then on the global step must advance by `liveness_periods` fragment periods (H steps each),
   in no more than 1.5 times the time the slowest learner needs to step there, plus 2 s;
3. the learners then stop reporting progress, so no new round opens, and the network drains;
4. every fragment must have merged at least once since step 1, and every learner must hold exactly
   the syncer's version of every fragment.

The result names the seed, the first broken invariant (or "liveness", "core_error", "runaway"),
what went wrong, the hash of the whole trace (the same seed gives the same hash) and its tail.
"""

from __future__ import annotations

import hashlib
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ddiloco.chaos.faults import ChaosConfig, Fault, Plan, draw_plan
from ddiloco.chaos.invariants import Checker
from ddiloco.chaos.learner import SimLearner
from ddiloco.chaos.network import UP, Network, Scheduler
from ddiloco.chaos.shell import SimSyncer
from ddiloco.core import syncer
from ddiloco.core.syncer import LearnerStatus

TRACE_TAIL = 40  # lines of trace kept in a result
PROBE_S = 0.05  # how often the liveness phase looks at the world
DRAIN_S = 2.0  # quiet time after the learners stop reporting, before versions are compared


@dataclass(frozen=True)
class Result:
    seed: int
    passed: bool
    failure: str | None  # the violated invariant, "liveness", "core_error" or "runaway"; None if passed
    detail: str
    at: float | None  # virtual time of the failure
    events: int  # core events handled
    actions: int  # simulator actions (deliveries, steps, timers, faults)
    merges: int
    faults: int
    snapshots: int  # consistent snapshots completed and checked
    snapshot_channels: int  # learner states in them held to the cut (on channels that kept their order)
    trace_hash: str
    state_hash: str
    trace_tail: tuple[str, ...]
    plan: tuple[str, ...]

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


class _Stop(Exception):
    """Ends a run early: a failure was recorded."""


class World:
    """The syncer, the learners and the network of one plan, on one virtual clock."""

    def __init__(self, plan: Plan, config: ChaosConfig, echo: Callable[[str], None] | None = None):
        self.plan, self.config, self.echo = plan, config, echo
        net_seed, syncer_seed = np.random.SeedSequence([plan.seed, 0xC4A05]).spawn(2)
        self.scheduler = Scheduler()
        self.network = Network(self.scheduler, np.random.default_rng(net_seed), tuple(p.link for p in plan.learners))
        self.learners = [
            SimLearner(
                i,
                p,
                plan.tensors,
                plan.seed,
                self.scheduler,
                self.network,
                config.client_as_is,
                local_state_as_is=config.local_state_as_is,
            )
            for i, p in enumerate(plan.learners)
        ]
        self.checker = Checker(plan.syncer.quorum, self._tokens_trained, self._holds_all, self._counted)
        self.syncer = SimSyncer(
            plan.syncer, self.scheduler, self.network, np.random.default_rng(syncer_seed), self.checker, self.trace
        )
        self.network.on_deliver = self._deliver
        self.network.on_reset = self._reset
        self._hash = hashlib.sha256()
        self.tail: deque = deque(maxlen=TRACE_TAIL)
        self.failure: tuple[str, str, float] | None = None
        self.done = False  # the liveness check ran to the end

    # ---- plumbing -------------------------------------------------------------------------------

    def trace(self, line: str) -> None:
        self._hash.update(line.encode())
        self._hash.update(b"\n")
        self.tail.append(line)
        if self.echo is not None:
            self.echo(line)

    def _deliver(self, conn, direction, message) -> None:
        if direction == UP:
            self.syncer.receive(conn, message)
        else:
            self.learners[conn.learner].receive(conn, message)

    def _reset(self, conn, side, why) -> None:
        if side == "syncer":
            self.syncer.lost(conn, why)
        else:
            self.learners[conn.learner].lost(conn)

    def _tokens_trained(self) -> int:
        return sum(learner.tokens_trained for learner in self.learners)

    def _counted(self, learner_id: int, p: int, version: int) -> int | None:
        conn = self.syncer.connection_of(learner_id)
        if conn is None:
            return None
        return self.learners[conn.learner].counted.get((learner_id, p, version), 0)

    def _holds_all(self, learner_id: int) -> bool:
        conn = self.syncer.connection_of(learner_id)
        if conn is None:
            return True  # not connected any more: nothing the learner could prove either way
        learner = self.learners[conn.learner]
        return learner.inbox.session == learner_id and learner.holds_all()

    def fail(self, failure: str, detail: str) -> None:
        if self.failure is None:
            self.failure = (failure, detail, self.scheduler.now)
        raise _Stop

    # ---- running --------------------------------------------------------------------------------

    def run(self) -> None:
        for fault in self.plan.faults:
            self.scheduler.at(fault.at, f"fault {fault.kind}", lambda f=fault: self._apply(f))
        self.scheduler.at(self.config.safety_s, "heal", self._heal)
        every = self.config.snapshot_every_s
        for k in range(1, int(self.config.safety_s / every) + 1 if every else 0):
            if k * every < self.config.safety_s:
                self.scheduler.at(k * every, "snapshot", self.syncer.take_snapshot)
        for learner in self.learners:
            learner.start()
        try:
            while self.scheduler.next_time() is not None and self.failure is None:
                label = self.scheduler.run_next()
                self.trace(f"{self.scheduler.now:.6f} {label}")
                if not self.checker.ok:
                    v = self.checker.violation
                    self.failure = (v.invariant, v.detail, v.at)
                elif self.scheduler.actions_run > self.config.events_max:
                    self.fail("runaway", f"more than {self.config.events_max} actions")
        except _Stop:
            pass

    def _apply(self, fault: Fault) -> None:
        self.trace(f"{self.scheduler.now:.6f} FAULT {fault.describe()}")
        end = min(fault.at + fault.duration_s, self.config.safety_s)
        if fault.kind in ("syncer_restart", "syncer_crash"):
            self.syncer.stop(crash=fault.kind == "syncer_crash")
            self.scheduler.at(end, "syncer resumes", self.syncer.resume)
            return
        learner, link = self.learners[fault.learner], self.network.faults[fault.learner]
        if fault.kind == "crash":
            learner.crash()
            self.scheduler.at(end, f"learner {fault.learner} restarts", lambda: learner.alive or learner.start())
        elif fault.kind == "pause":
            learner.pause(end)
        elif fault.kind == "partition":
            link.partitioned = True
            self.network.reset_learner(fault.learner, "partition")
            self.scheduler.at(end, "partition heals", lambda: self._end(link, "partitioned", True, False))
        else:
            name, value, off = {
                "delay": ("extra_latency_s", fault.amount, 0.0),
                "drop": ("drop_p", fault.amount, 0.0),
                "duplicate": ("duplicate_p", fault.amount, 0.0),
                "reorder": ("reorder_s", fault.amount, 0.0),
            }[fault.kind]
            setattr(link, name, value)
            self.scheduler.at(end, f"{fault.kind} ends", lambda: self._end(link, name, value, off))

    @staticmethod
    def _end(link, name: str, value, off) -> None:
        """A fault window ends, unless a later fault of the same kind set the link since."""
        if getattr(link, name) == value:
            setattr(link, name, off)

    # ---- the liveness phase ---------------------------------------------------------------------

    def _heal(self) -> None:
        self.network.heal()
        self.syncer.resume()
        for learner in self.learners:
            if not learner.alive:
                learner.start()
        self.healed_at = self.scheduler.now
        self.scheduler.after(PROBE_S, "probe rejoin", self._probe_rejoin)

    def _all_live(self) -> bool:
        state = self.syncer.state
        for learner in self.learners:
            rec = state.learners.get(learner.inbox.session) if learner.inbox.session is not None else None
            if rec is None or rec.status is not LearnerStatus.LIVE or learner.conn is None or not learner.holds_all():
                return False
        return True

    def _probe_rejoin(self) -> None:
        now = self.scheduler.now
        if self._all_live():
            state = self.syncer.state
            self.live_at, self.live_versions = now, [f.version for f in state.fragments]
            self.target_step = state.global_step + self.config.liveness_periods * state.config.period
            # The global step follows the K-th most advanced learner, and a learner that rejoined
            # keeps its own step count: the deadline lets every learner walk to the target.
            walk = max(
                (self.target_step - lr.step_count) * lr.profile.step_s * (1 + lr.profile.step_jitter)
                for lr in self.learners
            )
            self.step_deadline = now + 1.5 * max(walk, 0.0) + 2.0
            self.trace(f"{now:.6f} all learners live; global step {state.global_step} must reach {self.target_step}")
            self.scheduler.after(PROBE_S, "probe steps", self._probe_steps)
        elif now - self.healed_at > self.config.rejoin_s_max:
            lagging = [lr.index for lr in self.learners if not self._live_one(lr)]
            self.fail("liveness", f"learners {lagging} not live {self.config.rejoin_s_max:g} s after healing")
        else:
            self.scheduler.after(PROBE_S, "probe rejoin", self._probe_rejoin)

    def _live_one(self, learner: SimLearner) -> bool:
        rec = self.syncer.state.learners.get(learner.inbox.session) if learner.inbox.session is not None else None
        return rec is not None and rec.status is LearnerStatus.LIVE

    def _probe_steps(self) -> None:
        now, state = self.scheduler.now, self.syncer.state
        if state.global_step >= self.target_step:
            for learner in self.learners:
                learner.quiet = True
            self.scheduler.after(DRAIN_S + state.config.grace.grace_ms_max / 1000.0, "compare versions", self._compare)
        elif now > self.step_deadline:
            self.fail(
                "liveness",
                f"global step stuck at {state.global_step}, needed {self.target_step} by t={self.step_deadline:.2f}",
            )
        else:
            self.scheduler.after(PROBE_S, "probe steps", self._probe_steps)

    def _compare(self) -> None:
        state = self.syncer.state
        versions = [f.version for f in state.fragments]
        stuck = [p for p, (a, b) in enumerate(zip(self.live_versions, versions)) if b <= a]
        if stuck:
            self.fail(
                "liveness",
                f"fragments {stuck} never merged in {self.config.liveness_periods} periods after every learner was live (versions {versions})",
            )
        behind = {lr.index: list(lr.versions) for lr in self.learners if list(lr.versions) != versions}
        if behind:
            self.fail("liveness", f"learners disagree with the syncer's versions {versions}: {behind}")
        self.trace(f"{self.scheduler.now:.6f} liveness ok: every learner holds versions {versions}")
        self.done = True
        self.scheduler.stop_all()


def run_seed(seed: int, config: ChaosConfig | None = None, echo: Callable[[str], None] | None = None) -> Result:
    """Run one seed (default ChaosConfig); `echo` receives every trace line (the CLI's --verbose)."""
    config = config if config is not None else ChaosConfig()
    plan = draw_plan(seed, np.random.default_rng(seed), config)
    world = World(plan, config, echo)
    for line in plan.describe():
        world.trace(line)
    try:
        world.run()
    except Exception as exc:  # noqa: BLE001  a bug in the core (an assertion) or the simulator fails the seed, not the run
        world.failure = ("core_error", f"{type(exc).__name__}: {exc} at {_where(exc)}", world.scheduler.now)
    if world.failure is None and not world.done:
        world.failure = ("liveness", "the simulation ran out of actions before the liveness check", world.scheduler.now)
    failure, detail, at = world.failure if world.failure is not None else (None, "", None)
    state = world.syncer.state
    return Result(
        seed=seed,
        passed=failure is None,
        failure=failure,
        detail=detail,
        at=at,
        events=world.syncer.events,
        actions=world.scheduler.actions_run,
        merges=state.merges,
        faults=len(plan.faults),
        snapshots=world.checker.snapshots_checked,
        snapshot_channels=world.checker.channels_checked,
        trace_hash=world._hash.hexdigest(),
        state_hash=syncer.state_hash(state) if state.layout is not None else "",
        trace_tail=tuple(world.tail),
        plan=tuple(plan.describe()),
    )


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    return f"{last.filename.rsplit('/', 1)[-1]}:{last.lineno} ({last.name})" if last else "?"
