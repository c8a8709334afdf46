"""`ddiloco demo`: a real multi-process Decoupled DiLoCo run on this machine, with a chaos monkey.

It starts `ddiloco syncer` and M `ddiloco learner` processes on loopback, kills learners (SIGKILL,
restarted after a delay) and pauses others (SIGSTOP/SIGCONT) on a seeded schedule, optionally kills
the syncer once and restarts it from its checkpoint (`kill_syncer`), and shows live progress (a rich
table on a terminal, plain lines otherwise). At the end it evaluates the merged model (the syncer's
final checkpoint) on held-out plays, by loss and by multiple-choice continuation accuracy, against a
data-parallel baseline trained in this process on the same token budget.

Uptime: from the first merge to the end of training, the share of wall time not inside a gap between
merges longer than two fragment periods (such a gap counts whole). A syncer outage is such a gap.
"""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jax
import numpy as np
from ddiloco.reference import data
from ddiloco.reference import model as reference
from ddiloco.learner.tree import TreeFragments
from ddiloco.net import snapshot as snapshots
from ddiloco.net.auth import write_token_file

POLL_S = 0.5
EVAL_WINDOWS = 64
SYNCER_START_S_MAX = 60.0  # a syncer that has not said "listening" by then has failed
LOG_EVERY_STEPS = 5  # a learner writes one JSON line per this many of its steps (demo/learner_process.py)
STEPS_CAP_FACTOR = 2  # learners stop at this many times `steps` global steps, budget spent or not


@dataclass(frozen=True)
class DemoConfig:
    learners: int = 4
    steps: int = 400  # the budget in data-parallel steps (see token_budget); the schedule's length too
    batch: int = 8
    fragments: int = 4
    # H: steps between two syncs of one fragment. Measured with `ddiloco demo --no-chaos --baseline
    # none` on a 400-step budget (eval loss, DP 2.220): H = 12 2.309 / 2.371, H = 24 2.359 / 2.478.
    period: int = 12
    # tau: steps a fragment may stay in flight; a request is answered within about a step (85 ms
    # median of a ~100 ms step with 4 learners on 2 cores), and 4 steps leave the grace window room.
    overlap: int = 4
    quorum: int = 1
    chaos: bool = True
    kills: int = 3
    pauses: int = 2
    restart_delay_s: float = 3.0
    pause_s: float = 3.0
    speeds: tuple[float, ...] = ()
    baseline: bool = True
    seed: int = 0
    model: str = "dense"
    kill_syncer: bool = False  # SIGKILL the syncer once and restart it with --resume
    checkpoint_every_s: float = 2.0  # often, so that a syncer restart loses little
    # Plain averaging of the merged fragments (lr 1, no momentum): the paper's 0.7 / 0.9 are for
    # hundreds of inner steps between syncs; at the demo's H = 12-24 they over-step. Measured with
    # `ddiloco demo --no-chaos --baseline none` at H = 24: eval loss 2.630 with 0.7 / 0.9, 2.359 with 1 / 0.
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    merge: str = "rda"  # how the syncer merges outer gradients: rda | mean
    grace_ms_max: float = 1000.0
    grace_gamma: float = 0.5
    choice_items: int = reference.CHOICE_ITEMS  # multiple-choice items per evaluated model
    # Record the whole run here for `ddiloco replay DIR --full`: the syncer's tape (push payloads by
    # hash only: the replay regenerates them) and one tape per learner incarnation (learner.tape).
    record: Path | None = None
    # Consistent snapshots (net.snapshot) into <workdir>/snapshots every this many seconds (0: only
    # on `ddiloco snapshot URL`); `restore` restarts the whole system from one of them.
    snapshot_every_s: float = 0.0
    restore: Path | None = None

    @property
    def token_budget(self) -> int:
        """What the learners train on in all, and the data-parallel baseline too."""
        return self.steps * self.learners * self.batch * _model_config(self).seq

    def __post_init__(self) -> None:
        if self.learners < 1 or self.steps < 10 or self.batch < 1:
            raise ValueError("need at least 1 learner, 10 steps and a batch of 1")
        if self.speeds and len(self.speeds) != self.learners:
            raise ValueError(f"--speeds has {len(self.speeds)} values for {self.learners} learners")
        if any(not 0 < v <= 1 for v in self.speeds):
            raise ValueError(f"every speed must lie in (0, 1], got {self.speeds}")
        if self.kills < 0 or self.pauses < 0 or self.restart_delay_s < 0 or self.pause_s < 0:
            raise ValueError("kills, pauses and their delays must be non-negative")
        if self.model not in ("dense", "moe"):
            raise ValueError(f"model must be dense or moe, got {self.model!r}")
        if self.choice_items < 1:
            raise ValueError(f"choice_items must be positive, got {self.choice_items}")
        if self.checkpoint_every_s <= 0:
            raise ValueError("checkpoint_every_s must be positive (the demo resumes from checkpoints)")
        if self.merge not in ("rda", "mean"):
            raise ValueError(f"merge must be rda or mean, got {self.merge!r}")
        if self.snapshot_every_s < 0:
            raise ValueError("snapshot_every_s must be non-negative")


@dataclass
class _Learner:
    index: int
    proc: subprocess.Popen | None = None
    restarts: int = 0
    killed_at: float | None = None
    paused_until: float | None = None
    restarted_at: float | None = None  # started again, not yet live at the syncer (catching up)
    syncer_id: int | None = None  # its id at the syncer, from the last status
    done: bool = False
    stopping: bool = False  # asked to stop (SIGTERM) because the token budget is spent
    finished_at: float | None = None


@dataclass
class _Syncer:
    proc: subprocess.Popen
    log: Path
    killed_at: float | None = None
    restarted_at: float | None = None  # restarted, no merge since
    starts: int = 1


@dataclass
class _LossLog:
    """A learner's JSON lines (demo/learner_process.py) read as they grow: (global step, train loss)."""

    path: Path
    offset: int = 0
    points: list = field(default_factory=list)
    torn: int = 0  # lines cut short by a SIGKILL mid-write (an expected fault, so counted, not raised)

    def read(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            chunk = fh.read()
        end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next read
        self.offset += end
        for line in chunk[:end].splitlines():
            try:
                rec = json.loads(line)
                self.points.append((int(rec["step"]), float(rec["loss"])))
            except (ValueError, KeyError, TypeError):
                self.torn += 1


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
    curves: dict = field(default_factory=dict)  # "learners"/"baseline": [[tokens, train loss], ...]
    config: dict = field(default_factory=dict)
    tokens_trained: int = 0  # by all learners, from the ledger (the budget is the baseline's)
    token_budget: int = 0
    global_steps: int = 0


class _Demo:
    """The processes of one demo run and what happened to them; the loop in `run_demo` drives it."""

    def __init__(self, cfg: DemoConfig, work: Path, view) -> None:
        self.cfg, self.work, self.view = cfg, work, view
        self.token_file = work / "token"
        write_token_file(self.token_file, secrets.token_hex(16))
        self.token = self.token_file.read_text().strip()
        self.restore = _restore_plan(cfg)  # learner name -> its local state file in the snapshot
        self.events: list[dict] = []
        self.catch_up: list[dict] = []
        self.syncer = _start_syncer(cfg, work, self.token_file, port=0, resume=False, starts=1)
        self.port = _wait_listening(self.syncer)
        self.base = f"http://127.0.0.1:{self.port}"
        self.learners = [_Learner(i) for i in range(cfg.learners)]
        self.logs = [_LossLog(work / f"learner{i}.jsonl") for i in range(cfg.learners)]
        self.started = time.monotonic()
        self.step = 0  # the syncer's global step at the last status
        for lr in self.learners:
            self.spawn(lr)

    def now(self) -> float:
        return time.monotonic() - self.started

    def record(self, what: str, now: float, **extra) -> None:
        self.events.append({"t": round(now, 2), "what": what, "step": self.step, **extra})

    def spawn(self, lr: _Learner) -> None:
        cfg, speed = self.cfg, self.cfg.speeds[lr.index] if self.cfg.speeds else 1.0
        log = open(self.work / f"learner{lr.index}.log", "a")
        lr.proc = subprocess.Popen(
            [sys.executable, "-m", "ddiloco.cli", "learner", "--syncer", f"ws://127.0.0.1:{self.port}/ws",
             "--token-file", str(self.token_file), "--shard", f"{lr.index}/{cfg.learners}",
             "--steps", str(cfg.steps * STEPS_CAP_FACTOR), "--schedule-steps", str(cfg.steps),
             "--batch", str(cfg.batch), "--seed", str(cfg.seed * 1000 + lr.index * 10 + lr.restarts),
             "--speed", str(speed), "--model", cfg.model, "--name", f"learner-{lr.index}",
             "--cache-dir", str(self.work / "jax-cache"), "--log-file", str(self.work / f"learner{lr.index}.jsonl"),
             *(["--record", str(cfg.record / "learners" / f"learner-{lr.index}.{lr.restarts}")] if cfg.record else []),
             *(["--restore", str(self.restore[f"learner-{lr.index}"])] if lr.restarts == 0 and f"learner-{lr.index}" in self.restore else [])],
            stdout=subprocess.DEVNULL, stderr=log,
        )
        log.close()  # the child holds its own copy

    # ---- chaos ----

    def act(self, plan: list, now: float) -> list:
        """Carry out the planned actions that are due at the current global step; returns the rest."""
        while plan and plan[0][0] <= self.step:
            _, action, i = plan.pop(0)
            if action == "kill-syncer":
                if not any((self.work / "ckpt").glob("*")):  # nothing to resume from yet: a step later
                    plan = sorted(plan + [(self.step + 1, action, i)])
                    break
                self.syncer.proc.send_signal(signal.SIGKILL)
                self.syncer.killed_at = now
                self.record("kill-syncer", now)
                self.view.note(f"chaos: kill the syncer at {now:.1f} s")
                continue
            lr = self._target(i)
            if lr is None:
                continue
            if self._up() <= 1:
                # At most all but one learner down at a time, as a disruption budget would have it:
                # a fault on the last one running is a full outage, which no syncer can merge through.
                plan = sorted(plan + [(self.step + 1, action, i)])
                break
            if action == "kill":
                lr.proc.send_signal(signal.SIGKILL)
                lr.killed_at = now
                self.record("kill", now, learner=lr.index)
            else:
                lr.proc.send_signal(signal.SIGSTOP)
                lr.paused_until = now + self.cfg.pause_s
                self.record("pause", now, learner=lr.index)
            self.view.note(f"chaos: {action} learner {lr.index} at {now:.1f} s")
        return plan

    def _up(self) -> int:
        return sum(1 for lr in self.learners if self._is_up(lr))

    @staticmethod
    def _is_up(lr: _Learner) -> bool:
        down = lr.killed_at is not None or lr.restarted_at is not None or lr.paused_until is not None
        return not (down or lr.done or lr.stopping or lr.proc.poll() is not None)

    def _target(self, i: int) -> _Learner | None:
        """Learner i, or the next one after it that is running and caught up: a fault aimed at a
        learner that is still restarting would only lengthen the same outage."""
        for k in range(len(self.learners)):
            lr = self.learners[(i + k) % len(self.learners)]
            if self._is_up(lr):
                return lr
        return None

    def revive_syncer(self, now: float) -> None:
        s = self.syncer
        if s.killed_at is None:
            if s.proc.poll() is not None:
                raise RuntimeError(f"the syncer exited ({s.proc.returncode}); its log:\n{s.log.read_text()[-2000:]}")
            return
        if now - s.killed_at < self.cfg.restart_delay_s:
            return
        s.proc.wait()
        self.syncer = _start_syncer(self.cfg, self.work, self.token_file, port=self.port, resume=True, starts=s.starts + 1)
        self.syncer.restarted_at = now
        self.record("restart-syncer", now)
        self.view.note(f"chaos: restart the syncer from its checkpoint at {now:.1f} s")

    def reap(self, lr: _Learner, now: float) -> None:
        if lr.paused_until is not None and now >= lr.paused_until:
            lr.proc.send_signal(signal.SIGCONT)
            lr.paused_until = None
            self.record("resume", now, learner=lr.index)
        if lr.killed_at is not None and now - lr.killed_at >= self.cfg.restart_delay_s:
            lr.proc.wait()
            lr.restarts += 1
            lr.killed_at = None
            lr.restarted_at = now
            self.spawn(lr)
            self.record("restart", now, learner=lr.index)
        elif lr.killed_at is None and lr.proc.poll() is not None and not lr.done:
            # -SIGTERM: we asked it to stop and it was between steps or already closing; that is a finish
            if lr.proc.returncode != 0 and not (lr.stopping and lr.proc.returncode == -signal.SIGTERM):
                raise RuntimeError(f"learner {lr.index} failed (exit {lr.proc.returncode}); see learner{lr.index}.log")
            lr.done = True
            lr.finished_at = now

    def stop_when_budget_spent(self, status: dict) -> None:
        """The token budget is spent: the learners finish their step and leave. The budget is what
        the data-parallel baseline trains on (`steps` x learners x batch x sequence); under chaos the
        learners need more global steps to train it (a killed learner trains nothing until it is
        back), up to STEPS_CAP_FACTOR x `steps`."""
        if not status:
            return
        if trained_tokens(status) < self.cfg.token_budget and status["global_step"] < self.cfg.steps * STEPS_CAP_FACTOR:
            return
        for lr in self.learners:
            if not lr.done and not lr.stopping and lr.proc.poll() is None and lr.killed_at is None:
                if lr.paused_until is not None:
                    lr.proc.send_signal(signal.SIGCONT)
                    lr.paused_until = None
                lr.proc.send_signal(signal.SIGTERM)
                lr.stopping = True

    def note_catch_up(self, status: dict, now: float) -> None:
        """A restarted learner has caught up when the syncer lists it live under a new id."""
        rows = _newest_rows(status)
        for lr in self.learners:
            r = rows.get(f"learner-{lr.index}")
            if r is None:
                continue
            if lr.restarted_at is not None and r["id"] != lr.syncer_id and r["status"] == "live":
                self.catch_up.append({"learner": lr.index, "restarted_at": round(lr.restarted_at, 2),
                                      "live_at": round(now, 2), "catch_up_s": round(now - lr.restarted_at, 2)})
                lr.restarted_at = None
            if lr.restarted_at is None or lr.killed_at is not None:
                lr.syncer_id = r["id"]  # the id the next restart must differ from

    def shutdown(self) -> None:
        for lr in self.learners:
            if lr.proc and lr.proc.poll() is None:
                lr.proc.kill()
        if self.syncer.proc.poll() is None:
            self.syncer.proc.send_signal(signal.SIGTERM)
            self.syncer.proc.wait(60)


def run_demo(cfg: DemoConfig, workdir: Path | None = None, out=sys.stdout) -> DemoReport:
    """Run the syncer and learners until the token budget is spent, then evaluate and report."""
    work = Path(workdir or tempfile.mkdtemp(prefix="ddiloco-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    plan = _chaos_plan(cfg, np.random.default_rng(cfg.seed)) if cfg.chaos else []
    if cfg.restore is not None:  # faults before the cut happened in the run the snapshot was taken of
        start = snapshots.read(cfg.restore)["global_step"]
        plan = [p for p in plan if p[0] >= start]
    if cfg.record is not None:
        _start_recording(cfg)
    view = make_view(out)
    demo = None
    merge_times: list[float] = []
    last_merges, counted_start = 0, 1  # merges seen, and of which syncer start (a restart counts from its checkpoint)
    outage: float | None = None
    status: dict = {}
    try:
        demo = _Demo(cfg, work, view)
        while not (all(lr.done for lr in demo.learners) and status):  # and a syncer that is up
            now = demo.now()
            plan = demo.act(plan, now)
            demo.revive_syncer(now)
            for lr in demo.learners:
                demo.reap(lr, now)
            status = _get(f"{demo.base}/status") if demo.syncer.killed_at is None else {}
            if status:
                demo.step = status["global_step"]
                demo.stop_when_budget_spent(status)
                demo.note_catch_up(status, now)
                if counted_start != demo.syncer.starts:
                    last_merges, counted_start = status["merges"], demo.syncer.starts
                elif status["merges"] > last_merges:
                    merge_times.append(now)
                    last_merges = status["merges"]
                    if demo.syncer.restarted_at is not None:
                        outage = now - next(e["t"] for e in reversed(demo.events) if e["what"] == "kill-syncer")
                        demo.syncer.restarted_at = None
            for log in demo.logs:
                log.read()
            view.update(now, status, demo.learners, demo.logs, cfg, demo.syncer)
            time.sleep(POLL_S)
        _post(f"{demo.base}/checkpoint", demo.token)
        final = _get(f"{demo.base}/status") or status
    finally:
        view.close()
        if demo is not None:
            demo.shutdown()
    return _report(cfg, demo, work, merge_times, final, outage)


def _report(cfg: DemoConfig, demo: _Demo, work: Path, merge_times: list[float], final: dict, outage) -> DemoReport:
    wall = demo.now()
    trained_until = max((lr.finished_at or wall) for lr in demo.learners)
    mcfg = _model_config(cfg)
    choice = reference.make_choice_accuracy(mcfg, count=cfg.choice_items)
    merged_loss, merged_choice = _evaluate(_checkpoint_params(cfg, work / "ckpt"), mcfg, choice)
    base_loss = base_choice = None
    base_curve: list = []
    if cfg.baseline:
        params, base_curve = _train_baseline(cfg)
        base_loss, base_choice = _evaluate(params, mcfg, choice)
    uptime, longest = _uptime(merge_times, trained_until, wall, cfg)
    tokens_per_step = cfg.learners * cfg.batch * mcfg.seq
    events = [{**e, "tokens": e["step"] * tokens_per_step} for e in demo.events]
    return DemoReport(
        eval_loss=merged_loss, eval_bits_per_byte=merged_loss / np.log(2),
        baseline_eval_loss=base_loss, baseline_bits_per_byte=None if base_loss is None else base_loss / np.log(2),
        choice_accuracy=merged_choice, baseline_choice_accuracy=base_choice,
        uptime=uptime, longest_merge_gap_s=longest,
        goodput=_goodput(demo.events, cfg, wall), kills=sum(1 for e in events if e["what"] == "kill"),
        recoveries=sum(1 for e in events if e["what"] == "restart"),
        merges=int(final.get("merges", 0)), ledger=final.get("ledger", {}), wall_s=wall, events=events,
        catch_up=demo.catch_up, syncer_kills=sum(1 for e in events if e["what"] == "kill-syncer"),
        syncer_outage_s=None if outage is None else round(outage, 2),
        curves={"learners": _learner_curve(demo.logs, tokens_per_step), "baseline": base_curve},
        config=asdict(cfg),
        tokens_trained=trained_tokens(final) if final.get("ledger") else 0, token_budget=cfg.token_budget,
        global_steps=int(final.get("global_step", 0)),
    )


def _restore_plan(cfg: DemoConfig) -> dict[str, Path]:
    """learner name -> its local state in the snapshot to restore from (checked against the manifest)."""
    if cfg.restore is None:
        return {}
    try:
        manifest = snapshots.read(cfg.restore)
    except snapshots.SnapshotError as exc:
        raise ValueError(f"--restore {cfg.restore}: {exc}") from exc
    return {e["name"]: Path(cfg.restore) / e["file"] for e in manifest["learners"].values()}


def _start_recording(cfg: DemoConfig) -> None:
    """An empty recording directory, with run.json saying what was run (the tapes follow)."""
    assert cfg.record is not None
    if cfg.record.exists() and any(cfg.record.iterdir()):
        raise ValueError(f"--record {cfg.record}: the directory is not empty (a recording holds one run)")
    (cfg.record / "learners").mkdir(parents=True, exist_ok=True)
    doc = {"format": 1, "what": "ddiloco demo", "config": asdict(cfg)}
    (cfg.record / "run.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")


def _uptime(merge_times: list[float], trained_until: float, wall: float, cfg: DemoConfig) -> tuple[float, float]:
    """(uptime, longest gap in seconds). Counts from the first merge (before it the processes start
    and compile) until the last learner finished; a gap between merges longer than two fragment
    periods is downtime, all of it."""
    span = [merge_times[0]] + merge_times + [trained_until] if merge_times else [0.0, wall]
    gaps = np.diff(span)
    period_s = (span[-1] - span[0]) / max(1, cfg.steps) * cfg.period
    downtime = float(np.sum(gaps[gaps > 2 * period_s])) if merge_times else wall
    return 1.0 - downtime / max(span[-1] - span[0], 1e-9), float(gaps.max())


def _learner_curve(logs: list[_LossLog], tokens_per_step: int, bin_steps: int = 10) -> list[list[float]]:
    """Mean train loss of all learners per bin of global steps, against global tokens."""
    bins: dict[int, list[float]] = {}
    for log in logs:
        for step, loss in log.points:
            if np.isfinite(loss):
                bins.setdefault(step // bin_steps, []).append(loss)
    return [[(b + 0.5) * bin_steps * tokens_per_step, float(np.mean(v))] for b, v in sorted(bins.items())]


def _newest_rows(status: dict) -> dict[str, dict]:
    """name -> the status row with the highest id (a restarted learner is a new id, same name)."""
    rows: dict[str, dict] = {}
    for r in sorted(status.get("learners", []), key=lambda r: r["id"]):
        rows[r["name"]] = r
    return rows


def _start_syncer(cfg: DemoConfig, work: Path, token_file: Path, port: int, resume: bool, starts: int) -> _Syncer:
    log_path = work / ("syncer.log" if starts == 1 else f"syncer.{starts}.log")
    if cfg.restore is not None and not resume:  # the syncer's state at the snapshot's cut, its config included
        where = ["--resume", str(cfg.restore), "--checkpoint-dir", str(work / "ckpt")]
    elif resume:
        where = ["--resume", str(work / "ckpt")]
    else:
        where = [
            "--checkpoint-dir", str(work / "ckpt"), "--fragments", str(cfg.fragments), "--period", str(cfg.period),
            "--overlap", str(cfg.overlap), "--quorum", str(cfg.quorum), "--outer-lr", str(cfg.outer_lr),
            "--outer-momentum", str(cfg.outer_momentum), "--merge", cfg.merge, "--grace-max-ms", str(cfg.grace_ms_max),
            "--grace-gamma", str(cfg.grace_gamma), "--checkpoint-every-s", str(cfg.checkpoint_every_s),
        ]
    where += ["--snapshot-dir", str(work / "snapshots"), "--snapshot-every-s", str(cfg.snapshot_every_s)]
    if cfg.record is not None:
        where += ["--record", str(cfg.record / ("syncer" if starts == 1 else f"syncer.{starts}")), "--record-no-payloads"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ddiloco.cli", "syncer", "--port", str(port), "--auth-token-file", str(token_file), *where],
            stderr=subprocess.STDOUT, stdout=log,
        )
    return _Syncer(proc, log_path, starts=starts)


def _wait_listening(s: _Syncer) -> int:
    deadline = time.monotonic() + SYNCER_START_S_MAX
    while time.monotonic() < deadline:
        text = s.log.read_text()
        if "listening on 127.0.0.1:" in text:
            return int(text.split("listening on 127.0.0.1:")[1].split()[0])
        if s.proc.poll() is not None:
            break
        time.sleep(0.1)
    s.proc.kill()
    raise RuntimeError(f"the syncer did not start; its log:\n{s.log.read_text()[-2000:]}")


def _chaos_plan(cfg: DemoConfig, rng: np.random.Generator) -> list[tuple[int, str, int]]:
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


# ---- live view ----


def _learner_rows(status: dict, learners: list[_Learner], logs: list[_LossLog], cfg: DemoConfig) -> list[dict]:
    rows = _newest_rows(status)
    out = []
    for lr, log in zip(learners, logs):
        r = rows.get(f"learner-{lr.index}")
        state = (
            "done" if lr.done else "stopping" if lr.stopping else "killed" if lr.killed_at is not None
            else "paused" if lr.paused_until else (r["status"] if r else "joining")
        )
        out.append({
            "learner": lr.index, "state": state, "step": r["step"] if r else None,
            "tokens": len(log.points) * LOG_EVERY_STEPS * cfg.batch * _model_config(cfg).seq,
            "loss": log.points[-1][1] if log.points else None, "versions": r["versions"] if r else None,
            "restarts": lr.restarts,
        })
    return out


def _headline(now: float, status: dict, syncer: _Syncer) -> tuple[str, str]:
    if not status:
        return f"[{now:6.1f}s] syncer {'down' if syncer.killed_at is not None else 'starting'}", ""
    versions = ",".join(str(f["version"]) for f in status.get("fragments", []))
    last = status["decisions"][-1]["reason"] if status.get("decisions") else ""
    return f"[{now:6.1f}s] step {status['global_step']:4d} merges {status['merges']:4d} v[{versions}]", last


class PlainView:
    """One line per poll: for logs, pipes and terminals without rich."""

    def __init__(self, out) -> None:
        self.out = out

    def note(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def update(self, now, status, learners, logs, cfg, syncer) -> None:
        head, last = _headline(now, status, syncer)
        cells = " ".join(f"L{r['learner']}:{r['state']}@{'-' if r['step'] is None else r['step']}"
                         for r in _learner_rows(status, learners, logs, cfg))
        print(f"{head} {cells} | {last[:60]}", file=self.out, flush=True)

    def close(self) -> None:
        pass


class RichView:
    """A live table on a terminal: per learner state, step, tokens, loss, fragment versions."""

    def __init__(self, out) -> None:
        from rich.console import Console
        from rich.live import Live

        self.live = Live(console=Console(file=out), refresh_per_second=4)
        self.live.start()

    def note(self, text: str) -> None:
        self.live.console.print(text)

    def update(self, now, status, learners, logs, cfg, syncer) -> None:
        from rich.table import Table

        head, last = _headline(now, status, syncer)
        table = Table(title=head, caption=f"last decision: {last}" if last else None, expand=False)
        for name in ("learner", "state", "step", "tokens", "loss", "versions held", "restarts"):
            table.add_column(name, justify="left" if name in ("state", "versions held") else "right")
        for r in _learner_rows(status, learners, logs, cfg):
            table.add_row(
                str(r["learner"]), r["state"], "-" if r["step"] is None else str(r["step"]), f"{r['tokens']:,}",
                "-" if r["loss"] is None else f"{r['loss']:.3f}",
                "-" if r["versions"] is None else ",".join(map(str, r["versions"])), str(r["restarts"]),
            )
        self.live.update(table)

    def close(self) -> None:
        self.live.stop()


def make_view(out):
    """A rich live table when `out` is a terminal and rich is installed, plain lines otherwise."""
    if not (hasattr(out, "isatty") and out.isatty()):
        return PlainView(out)
    try:
        import rich.live  # noqa: F401  (the learner extra brings it; without it, plain lines)
    except ImportError:
        return PlainView(out)
    return RichView(out)


# ---- syncer HTTP ----


def _get(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return {}  # down or restarting: the view says so and uptime counts it


def _post(url: str, token: str) -> None:
    req = urllib.request.Request(url, method="POST", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


# ---- evaluation and the data-parallel baseline ----


def trained_tokens(status: dict) -> int:
    """Tokens the learners have trained on, from the syncer's ledger: every step's tokens are
    reported once for each fragment (the counters run per fragment)."""
    return status["ledger"]["reported"] // max(1, len(status["fragments"]))


def _model_config(cfg: DemoConfig) -> reference.ModelConfig:
    return reference.ModelConfig(experts=4 if cfg.model == "moe" else 0)


def _evaluate(params, mcfg: reference.ModelConfig, choice=None) -> tuple[float, float | None]:
    """(held-out loss in nats per byte, multiple-choice accuracy or None without a scorer)."""
    x, y = data.eval_windows(mcfg.seq, EVAL_WINDOWS)
    loss = float(reference.make_eval(mcfg)(params, x, y))
    return loss, None if choice is None else choice(params)


def _checkpoint_params(cfg: DemoConfig, ckpt_dir: Path):
    from ddiloco.net.store import newest_valid

    state, _ = newest_valid(ckpt_dir)
    mcfg = _model_config(cfg)
    params = reference.init_params(mcfg, jax.random.PRNGKey(0))
    tree = TreeFragments(params, state.layout)
    for p, frag in enumerate(state.fragments):
        params = tree.scatter(params, p, frag.theta)
    return params


def _evaluate_checkpoint(cfg: DemoConfig, ckpt_dir: Path) -> float:
    return _evaluate(_checkpoint_params(cfg, ckpt_dir), _model_config(cfg))[0]


def _train_baseline(cfg: DemoConfig) -> tuple[dict, list[list[float]]]:
    """Data-parallel on the same token budget: one model, a batch M times larger, as many steps.
    Returns the parameters and the train loss every 10 steps against tokens."""
    mcfg = _model_config(cfg)
    tcfg = reference.TrainConfig(total_steps=max(cfg.steps, 21))
    params = reference.init_params(mcfg, jax.random.PRNGKey(cfg.seed))
    tx = reference.make_optimizer(tcfg)
    opt_state = tx.init(params)
    step = reference.make_train_step(mcfg, tx)
    stream = data.batches(data.train_bytes(), cfg.batch * cfg.learners, mcfg.seq, np.random.default_rng(cfg.seed))
    tokens_per_step, curve, window = cfg.batch * cfg.learners * mcfg.seq, [], []
    for i in range(cfg.steps):
        x, y = next(stream)
        params, opt_state, ce = step(params, opt_state, x, y)
        window.append(ce)
        if len(window) == 10:
            curve.append([(i + 1 - 5) * tokens_per_step, float(np.mean([float(c) for c in window]))])
            window = []
    return params, curve


def _goodput(events: list[dict], cfg: DemoConfig, wall: float) -> float:
    """Share of learner-time not lost to kills (down until restarted) or pauses."""
    ends = {"restart": "kill", "resume": "pause"}  # the event that ends each kind of outage
    lost, open_at = 0.0, {}
    for e in events:
        if e["what"] in ends.values():
            open_at[(e["what"], e["learner"])] = e["t"]
        elif e["what"] in ends and (ends[e["what"]], e["learner"]) in open_at:
            lost += e["t"] - open_at.pop((ends[e["what"]], e["learner"]))
    return 1.0 - lost / (wall * cfg.learners)


# ---- the report ----


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def report_text(r: DemoReport) -> str:
    def f(x):
        return "-" if x is None else f"{x:.4f}"

    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    rel = "" if r.baseline_eval_loss is None else f" ({100 * (r.eval_loss / r.baseline_eval_loss - 1):+.1f}% vs baseline)"
    catch = ", ".join(f"L{c['learner']} {c['catch_up_s']:.1f} s" for c in r.catch_up) or "-"
    ledger = r.ledger or {}
    merged_share = ledger.get("merged", 0) / ledger["reported"] if ledger.get("reported") else None
    lines = [
        f"merged model   eval loss {f(r.eval_loss)} nats/byte, {f(r.eval_bits_per_byte)} bits/byte{rel}",
        f"data-parallel  eval loss {f(r.baseline_eval_loss)} nats/byte, {f(r.baseline_bits_per_byte)} bits/byte",
        (f"choice acc.    merged {pct(r.choice_accuracy)}, data-parallel {pct(r.baseline_choice_accuracy)} "
         f"(true next line among 4, ranked by what the context adds to its likelihood; chance 25%)"),
        f"syncer uptime  {100 * r.uptime:.1f}% (longest gap between merges {r.longest_merge_gap_s:.1f} s)",
        f"goodput        {100 * r.goodput:.1f}% of learner time; {pct(merged_share)} of reported tokens merged",
        (f"chaos          {_count(r.kills, 'learner kill')}, {_count(r.recoveries, 'restart')}, "
         f"{len(r.catch_up)} caught up before the end (catch-up: {catch})"),
        (f"tokens         {r.tokens_trained:,} trained of a budget of {r.token_budget:,} "
         f"(the baseline's), in {r.global_steps} global steps"),
    ]
    if r.syncer_kills:
        outage = "-" if r.syncer_outage_s is None else f"{r.syncer_outage_s:.1f} s"
        lines.append(f"syncer kill    {r.syncer_kills}, restarted from its checkpoint; kill to next merge {outage}")
    return "\n".join(lines + [
        f"merges         {r.merges}",
        f"token ledger   {r.ledger}",
        f"wall time      {r.wall_s:.1f} s",
    ])


def report_json(r: DemoReport) -> dict:
    doc = asdict(r)
    if doc["config"].get("record") is not None:
        doc["config"]["record"] = str(doc["config"]["record"])
    return doc


def write_plot(r: DemoReport, path: Path) -> None:
    """A PNG of train loss against tokens for the learners and the data-parallel baseline, the
    final held-out losses as markers, and the kills as vertical lines."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: install the learner extra (pip install 'ddiloco[learner]')") from exc
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for key, label, color in (("learners", "Decoupled DiLoCo learners (train, mean)", "tab:blue"),
                              ("baseline", "data-parallel (train)", "tab:orange")):
        pts = np.array(r.curves.get(key) or [], dtype=float).reshape(-1, 2)
        if pts.size:
            ax.plot(pts[:, 0], pts[:, 1], label=label, color=color)
    end = max((p[0] for c in r.curves.values() for p in c), default=0.0)
    ax.scatter([end], [r.eval_loss], marker="*", s=120, color="tab:blue", zorder=3, label="merged model (held-out)")
    if r.baseline_eval_loss is not None:
        ax.scatter([end], [r.baseline_eval_loss], marker="*", s=120, color="tab:orange", zorder=3, label="data-parallel (held-out)")
    for e in r.events:
        if e["what"] in ("kill", "kill-syncer"):
            ax.axvline(e["tokens"], color="tab:red" if e["what"] == "kill" else "black", linestyle="--", linewidth=1)
    if r.kills:
        ax.plot([], [], color="tab:red", linestyle="--", label="learner killed")
    if r.syncer_kills:
        ax.plot([], [], color="black", linestyle="--", label="syncer killed")
    ax.set_xlabel("tokens (all learners)")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title("ddiloco demo: loss against tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
