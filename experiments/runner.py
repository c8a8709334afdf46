"""In-process experiments: M learners and the real syncer core in one process, on a virtual clock.

A run is a discrete-event loop. Each learner's steps end at virtual times drawn from its speed model;
what a learner sends reaches the syncer after a modelled latency; the syncer core
(`core.syncer.handle`) runs at those virtual times, its timers (`ArmTimer`) fire at theirs, and what
it sends back reaches the learners after the latency again. The JAX compute is real and runs
sequentially, so a run of 8 learners costs what one process can do, and one seed reproduces it.

Nothing of the algorithm is written twice. Learners are the real `DilocoSync` hook with an
in-process transport in place of the websocket client; the transport and the hub encode every
message into the same wire frames the daemon exchanges and map them with `net.session` (frames ->
core events on the way in, effects -> frames -> what the learner sees on the way out), and the hub
carries out each effect as `net.server` does (welcome binds the connection, updates take the newest
values when sent, timers, drops). Virtual time is in units of `step_s` (one inner step at speed 1).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from ddiloco.core import codec as codecs
from ddiloco.core import syncer as core
from ddiloco.core.config import SyncerConfig
from ddiloco.experiments.inprocess import Hub, InProcessTransport, NetworkModel, VirtualLoop
from ddiloco.learner.sync import DilocoSync, SyncConfig, check_alpha
from ddiloco.learner.tree import TreeFragments, tensor_specs
from ddiloco.reference import data
from ddiloco.reference import model as reference

LEARNERS_MAX = 64
EVAL_WINDOWS = 64  # held-out windows per evaluation, as in the demo


# ---- configuration --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LearnerSpec:
    """One learner: its speed (1 = one step per step_s), when it joins and leaves (None: at the end)
    and its outages (start_s, end_s): down, disconnected, computing nothing."""

    speed: float = 1.0
    join_s: float = 0.0
    leave_s: float | None = None
    outages: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.speed) and self.speed > 0):
            raise ValueError(f"speed must be positive, got {self.speed!r}")
        if not (math.isfinite(self.join_s) and self.join_s >= 0):
            raise ValueError(f"join_s must be non-negative, got {self.join_s!r}")
        if self.leave_s is not None and not self.leave_s > self.join_s:
            raise ValueError(f"leave_s {self.leave_s} must come after join_s {self.join_s}")
        if any(not 0 <= a < b for a, b in self.outages) or list(self.outages) != sorted(self.outages):
            raise ValueError(f"outages must be sorted (start, end) pairs with 0 <= start < end, got {self.outages}")


@dataclass(frozen=True)
class RunConfig:
    learners: tuple[LearnerSpec, ...]
    syncer: SyncerConfig
    model: reference.ModelConfig
    batch: int
    budget_tokens: int  # the run ends when the learners together have trained this many tokens
    seed: int = 0
    codec: str = "int4"
    error_feedback: bool = False  # int4 with a residual kept per fragment on the learner (ours)
    alpha: float = 0.0  # how an arrived fragment is mixed into the learner's (SyncConfig.alpha)
    keep_progress: bool = True  # keep what a learner trained since its push over an arriving version (SyncConfig)
    step_s: float = 1.0
    step_noise: float = 0.0  # relative spread of each step's duration (lognormal sigma)
    network: NetworkModel = field(default_factory=NetworkModel)
    inner_steps: int = 0  # length of the inner LR schedule; 0: budget / (learners * batch * seq)
    inner_lr: float = reference.TrainConfig.lr  # the inner AdamW's peak learning rate
    eval_every_s: float = 0.0  # > 0: evaluate the syncer's model on this period (time to target)
    target_loss: float | None = None  # stop as soon as a periodic evaluation reaches it

    def __post_init__(self) -> None:
        if not 1 <= len(self.learners) <= LEARNERS_MAX:
            raise ValueError(f"a run needs 1 to {LEARNERS_MAX} learners, got {len(self.learners)}")
        if self.batch < 1 or self.budget_tokens < self.batch * self.model.seq:
            raise ValueError(
                f"need batch >= 1 and a budget of at least one batch, got {self.batch}, {self.budget_tokens}"
            )
        codecs.parse_codec(self.codec)
        check_alpha(self.alpha)  # here, not first when a learner's hook is built mid-run
        if self.error_feedback and self.codec == "fp32":
            raise ValueError("error feedback needs a lossy codec")
        if not (self.step_s > 0 and self.step_noise >= 0 and self.eval_every_s >= 0):
            raise ValueError("need step_s > 0, step_noise >= 0 and eval_every_s >= 0")
        if not (math.isfinite(self.inner_lr) and self.inner_lr > 0):
            raise ValueError(f"inner_lr must be a positive number, got {self.inner_lr!r}")
        if self.target_loss is not None and not self.eval_every_s:
            raise ValueError("a target loss needs eval_every_s > 0")

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.model.seq

    def schedule_steps(self) -> int:
        initial = sum(1 for s in self.learners if s.join_s == 0) or 1
        return self.inner_steps or max(21, self.budget_tokens // (initial * self.tokens_per_step))


# ---- shared compiled programs, learner inputs ------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def programs(
    model: reference.ModelConfig, schedule_steps: int, lr: float = reference.TrainConfig.lr
) -> tuple[Any, Callable, Callable]:
    """(optimizer, jitted train step, jitted eval): compiled once per configuration and shared by
    every learner of every run (the inner optimizer is a pure transformation, its state per learner)."""
    train = reference.TrainConfig(lr=lr, total_steps=schedule_steps, warmup_steps=min(20, schedule_steps // 5))
    tx = reference.make_optimizer(train)
    return tx, reference.make_train_step(model, tx), reference.make_eval(model)


def initial_params(model: reference.ModelConfig, seed: int) -> Any:
    """Every learner and the data-parallel baseline start from the same weights."""
    return reference.init_params(model, jax.random.PRNGKey(seed))


def learner_stream(model: reference.ModelConfig, batch: int, seed: int, index: int, shards: int):
    """Learner `index` of `shards` draws windows from its own disjoint slice of the training text."""
    shard = data.Shard(index, shards).slice(data.train_bytes())
    return data.batches(shard, batch, model.seq, np.random.default_rng([seed, index]))


def evaluate(model: reference.ModelConfig, params: Any, schedule_steps: int) -> float:
    """Held-out next-byte cross entropy (nats per byte) on fixed windows of unseen plays."""
    x, y = data.eval_windows(model.seq, EVAL_WINDOWS)
    return float(programs(model, schedule_steps)[2](params, x, y))


def choice_accuracy(model: reference.ModelConfig, params: Any) -> float | None:
    """Multiple-choice accuracy (the true next line of a held-out play among 4), or None where the
    model module has no multiple-choice eval."""
    make = getattr(reference, "make_choice_accuracy", None)
    return None if make is None else _choice_scorer(model, make)(params)


@functools.lru_cache(maxsize=8)
def _choice_scorer(model: reference.ModelConfig, make: Callable) -> Callable[[Any], float]:
    return make(model)


# ---- one run -----------------------------------------------------------------------------------------


@dataclass
class RunResult:
    eval_loss: float
    bits_per_byte: float
    choice_accuracy: float | None
    goodput: float  # merged share of trained tokens x busy share of allocated learner time
    wall_s: float  # virtual seconds until the budget was spent (or the target reached)
    reached_target_s: float | None
    tokens: int
    merges: int
    ledger: dict
    bytes_up: int
    bytes_up_per_step_peak: int  # all learners' push bytes in one global step slot
    bytes_up_per_step_mean: float
    bytes_down: int
    state_hash: str
    merge_log: list  # (fragment, version, learners) of every merge, in order
    evals: list  # (virtual s, eval loss) of the periodic evaluations


class _Learner:
    def __init__(self, run: _Run, index: int, spec: LearnerSpec):
        self.run, self.index, self.spec = run, index, spec
        cfg = run.cfg
        self.rng = np.random.default_rng([cfg.seed, index, 7])
        self.params = initial_params(cfg.model, cfg.seed)
        self.opt_state = run.tx.init(self.params)
        self.stream = learner_stream(cfg.model, cfg.batch, cfg.seed, index, len(cfg.learners))
        self.transport = InProcessTransport(run.hub, f"learner-{index}", run.tensors)
        self.sync: DilocoSync | None = None
        self.down = False
        self.gone = False
        self.busy_s = 0.0
        self.steps = 0

    def duration(self) -> float:
        base = self.run.cfg.step_s / self.spec.speed
        noise = self.run.cfg.step_noise
        return base * float(np.exp(self.rng.normal(0.0, noise) - noise * noise / 2)) if noise else base

    def build_hook(self) -> None:
        sync_cfg = SyncConfig(
            url="ws://in-process/ws",
            name=f"learner-{self.index}",
            codec=self.run.cfg.codec,
            error_feedback=self.run.cfg.error_feedback,
            alpha=self.run.cfg.alpha,
            keep_progress=self.run.cfg.keep_progress,
            # On the virtual clock every step is computed at its call; asking the devices would let
            # the real time of this process into the simulated one.
            report_computed=False,
        )
        self.sync = DilocoSync.connect(self.params, sync_cfg, transport=self.transport)
        self.transport.flush()  # the initial parameters, when this learner was asked for them

    def step(self) -> None:
        """One inner step ends now: train, call the hook, schedule the next."""
        if self.down or self.gone:
            return
        loop = self.run.loop
        if self.sync is None:
            if self.transport.inbox.welcome is None:  # still joining: try again a step later
                loop.at(loop.now + self.duration(), self.step)
                return
            self.build_hook()
        d = self.duration()
        x, y = next(self.stream)
        self.params, self.opt_state, _ = self.run.train_step(self.params, self.opt_state, x, y)
        self.transport.step = self.sync.step_count + 1
        self.params = self.sync.step(self.params, tokens=self.run.cfg.tokens_per_step)
        self.transport.flush()
        self.steps += 1
        self.busy_s += d
        self.run.tokens += self.run.cfg.tokens_per_step
        loop.at(loop.now + d, self.step)

    def go_down(self) -> None:
        if not self.gone:
            self.down = True
            self.transport.hang_up()

    def come_up(self) -> None:
        if not self.gone:
            self.down = False
            self.transport.connect()  # a new welcome: the hook rejoins (weight 0 until caught up)
            self.run.loop.at(self.run.loop.now + self.duration(), self.step)

    def leave(self) -> None:
        self.gone = True
        self.transport.hang_up()


class _Run:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.loop = VirtualLoop()
        self.hub = Hub(core.new_state(cfg.syncer), self.loop, cfg.network)
        self.schedule_steps = cfg.schedule_steps()
        self.tx, self.train_step, _ = programs(cfg.model, self.schedule_steps, cfg.inner_lr)
        template = initial_params(cfg.model, cfg.seed)
        self.tensors = tensor_specs(template)
        self.template = template
        self.tokens = 0
        self.evals: list[tuple[float, float]] = []
        self.reached_at: float | None = None
        self.learners = [_Learner(self, i, spec) for i, spec in enumerate(cfg.learners)]

    def start(self) -> None:
        """Learners present from the start join before the first step, in index order (the first is
        asked for the initial parameters); later ones join at their time."""
        first = [lr for lr in self.learners if lr.spec.join_s == 0]
        for lr in first:
            lr.transport.connect()
        self.loop.drain()
        for lr in first:
            if lr.transport.inbox.welcome is not None:
                lr.build_hook()
        self.loop.drain()
        for lr in self.learners:
            self._plan(lr)
        if self.cfg.eval_every_s:
            self.loop.at(self.cfg.eval_every_s, self._periodic_eval)

    def _plan(self, lr: _Learner) -> None:
        spec, loop = lr.spec, self.loop
        if spec.join_s > 0:
            loop.at(spec.join_s, lr.transport.connect)
        loop.at(spec.join_s + lr.duration(), lr.step)
        for start, end in spec.outages:
            loop.at(max(start, spec.join_s), lr.go_down)
            loop.at(max(end, spec.join_s), lr.come_up)
        if spec.leave_s is not None:
            loop.at(spec.leave_s, lr.leave)

    def _periodic_eval(self) -> None:
        if self.done():
            return
        if not self.hub.state.holds_parameters:
            self.loop.at(self.loop.now + self.cfg.eval_every_s, self._periodic_eval)
            return
        loss = evaluate(self.cfg.model, self.global_params(), self.schedule_steps)
        self.evals.append((self.loop.now, loss))
        if self.cfg.target_loss is not None and loss <= self.cfg.target_loss and self.reached_at is None:
            self.reached_at = self.loop.now
        self.loop.at(self.loop.now + self.cfg.eval_every_s, self._periodic_eval)

    def done(self) -> bool:
        return self.tokens >= self.cfg.budget_tokens or self.reached_at is not None

    def global_params(self) -> Any:
        state = self.hub.state
        tree = TreeFragments(self.template, state.layout)
        params = self.template
        for p, frag in enumerate(state.fragments):
            params = tree.scatter(params, p, frag.theta)
        return params

    def result(self) -> RunResult:
        state, wall = self.hub.state, self.loop.now
        params = self.global_params()
        loss = evaluate(self.cfg.model, params, self.schedule_steps)
        ledger = state.ledger.summary()
        settled = max(1, ledger["reported"] - ledger["open"])
        allocated = sum(
            max(0.0, (lr.spec.leave_s or wall) - lr.spec.join_s) for lr in self.learners if lr.spec.join_s < wall
        )
        busy = sum(lr.busy_s for lr in self.learners)
        per_step: dict[int, int] = {}
        for lr in self.learners:
            for step, size in lr.transport.push_log:
                per_step[step] = per_step.get(step, 0) + size
        steps_seen = max(1, max((lr.sync.step_count for lr in self.learners if lr.sync), default=1))
        bytes_up = sum(lr.transport.bytes_up for lr in self.learners)
        return RunResult(
            eval_loss=loss,
            bits_per_byte=loss / math.log(2),
            choice_accuracy=choice_accuracy(self.cfg.model, params),
            # merged_late tokens are merged too (protocol 2: discounted by their staleness, not lost)
            goodput=((ledger["merged"] + ledger["merged_late"]) / settled) * (busy / max(allocated, 1e-9)),
            wall_s=wall,
            reached_target_s=self.reached_at,
            tokens=self.tokens,
            merges=state.merges,
            ledger=ledger,
            bytes_up=bytes_up,
            bytes_up_per_step_peak=max(per_step.values(), default=0),
            bytes_up_per_step_mean=bytes_up / steps_seen,
            bytes_down=self.hub.bytes_down,
            state_hash=core.state_hash(state),
            merge_log=[(m.fragment, m.version, m.learners) for m in self.hub.merges],
            evals=self.evals,
        )


def run(cfg: RunConfig, *, settle: bool = False) -> RunResult:
    """Train until the token budget is spent (or the target loss is reached); the syncer's fragments
    are the model evaluated. `settle`: then let every message in flight arrive, with no more steps
    (for comparing the final syncer state with another path)."""
    r = _Run(cfg)
    r.start()
    r.loop.run(r.done)
    if settle:
        for lr in r.learners:
            lr.gone = True
        r.loop.run(lambda: False)
    return r.result()


def run_data_parallel(
    model: reference.ModelConfig,
    batch: int,
    steps: int,
    seed: int,
    schedule_steps: int | None = None,
    lr: float = reference.TrainConfig.lr,
) -> dict:
    """The data-parallel baseline: one model, the learners' batches together in one batch, as many
    steps as a learner's schedule (the same token budget), from the same initial weights."""
    sched = schedule_steps or max(21, steps)
    tx, train_step, _ = programs(model, sched, lr)
    params = initial_params(model, seed)
    opt_state = tx.init(params)
    stream = data.batches(data.train_bytes(), batch, model.seq, np.random.default_rng([seed, 1 << 20]))
    for _ in range(steps):
        x, y = next(stream)
        params, opt_state, _ = train_step(params, opt_state, x, y)
    loss = evaluate(model, params, sched)
    return {
        "eval_loss": loss,
        "bits_per_byte": loss / math.log(2),
        "choice_accuracy": choice_accuracy(model, params),
        "tokens": steps * batch * model.seq,
    }
