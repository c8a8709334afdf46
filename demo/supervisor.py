"""`ddiloco demo`: a real multi-process Decoupled DiLoCo run on this machine, with a chaos monkey.

It starts `ddiloco syncer` and M `ddiloco learner` processes on loopback, kills learners (SIGKILL,
restarted after a delay) and pauses others (SIGSTOP/SIGCONT) on a seeded schedule, optionally kills
the syncer once and restarts it from its checkpoint (`kill_syncer`), and shows live progress (a rich
table on a terminal, plain lines otherwise). At the end it evaluates the merged model (the syncer's
final checkpoint) on held-out plays, by loss and by multiple-choice continuation accuracy, against a
data-parallel baseline trained in this process on the same token budget.

This module is the supervisor: it starts, watches, restarts and stops the processes, and puts the
report together. The other jobs have a module each: config, chaos_monkey, live_view, evaluation,
baseline, report, plot.

Uptime: from the first merge to the end of training, the share of wall time not inside a gap between
merges longer than two fragment periods (such a gap counts whole). A syncer outage is such a gap.
"""

from __future__ import annotations

import json
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

from ddiloco.demo import chaos_monkey
from ddiloco.demo.baseline import train_baseline
from ddiloco.demo.chaos_monkey import chaos_plan
from ddiloco.demo.config import STEPS_CAP_FACTOR, DemoConfig, model_config
from ddiloco.demo.evaluation import checkpoint_params, evaluate
from ddiloco.demo.live_view import make_view, newest_rows
from ddiloco.demo.report import DemoReport, goodput, learner_curve, trained_tokens, uptime_and_longest_gap
from ddiloco.learner.devices import LearnerDevices, learner_device_plan, visible_gpu_count
from ddiloco.net import snapshot as snapshots
from ddiloco.net.auth import write_token_file
from ddiloco.reference import model as reference

__all__ = ["Demo", "LearnerProcess", "LossLog", "SyncerProcess", "device_plan_words", "learner_argv", "run_demo"]

POLL_S = 0.5
SYNCER_START_S_MAX = 60.0  # a syncer that has not said "listening" by then has failed


@dataclass
class LearnerProcess:
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
class SyncerProcess:
    proc: subprocess.Popen
    log: Path
    killed_at: float | None = None
    restarted_at: float | None = None  # restarted, no merge since
    starts: int = 1


@dataclass
class LossLog:
    """A learner's JSON lines (demo/learner_process.py) read as they grow: (global step, train loss),
    and what its newest process said it is doing (`phase`)."""

    path: Path
    offset: int = 0
    points: list = field(default_factory=list)
    torn: int = 0  # lines cut short by a SIGKILL mid-write (an expected fault, so counted, not raised)
    # "compiling", "compiled" (then joining), "training" once a step is logged; a restarted process
    # appends to the same file, so the newest line is its own.
    phase: str | None = None

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
                if "phase" in rec:
                    self.phase = str(rec["phase"])
                    continue
                self.points.append((int(rec["step"]), float(rec["loss"])))
                self.phase = "training"
            except (ValueError, KeyError, TypeError):
                self.torn += 1


class Demo:
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
        # The standby waits for the syncer's first checkpoint, loads its kernels, then for its exit.
        self.standby = (
            _start_syncer(cfg, work, self.token_file, port=self.port, resume=True, starts=2, standby=True)
            if cfg.kill_syncer and cfg.syncer_standby
            else None
        )
        self.learners = [LearnerProcess(i) for i in range(cfg.learners)]
        gpus = visible_gpu_count() if cfg.gpus is None else cfg.gpus
        self.devices = learner_device_plan(gpus, cfg.learners)
        if gpus:
            view.note(f"demo: {gpus} GPU(s); {device_plan_words(self.devices)}")
        self.logs = [LossLog(work / f"learner{i}.jsonl") for i in range(cfg.learners)]
        self.started = time.monotonic()
        self.wall_started = time.time()  # the syncer's log lines are stamped in wall time
        self.step = 0  # the syncer's global step at the last status
        for lr in self.learners:
            self.spawn(lr)

    def now(self) -> float:
        return time.monotonic() - self.started

    def record(self, what: str, now: float, **extra) -> None:
        self.events.append({"t": round(now, 2), "what": what, "step": self.step, **extra})

    def spawn(self, lr: LearnerProcess) -> None:
        log = open(self.work / f"learner{lr.index}.log", "a")
        lr.proc = subprocess.Popen(
            learner_argv(self.cfg, lr, self.port, self.token_file, self.work, self.restore, self.devices[lr.index]),
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        log.close()  # the child holds its own copy
        self.logs[lr.index].phase = "starting"  # until the new process says it compiles (its JSON lines)

    def revive_syncer(self, now: float) -> None:
        s = self.syncer
        if s.killed_at is None:
            if s.proc.poll() is not None:
                raise RuntimeError(f"the syncer exited ({s.proc.returncode}); its log:\n{s.log.read_text()[-2000:]}")
            return
        if self.standby is not None:  # it takes over by itself the moment the syncer is gone
            s.proc.wait()
            self.syncer, self.standby = self.standby, None
            self.syncer.restarted_at = s.killed_at  # already running: nothing to start
            self.record("restart-syncer", now, standby=True)
            self.view.note(f"chaos: the standby syncer takes over at {now:.1f} s")
            return
        if now - s.killed_at < self.cfg.syncer_restart_delay_s:
            return
        s.proc.wait()
        self.syncer = _start_syncer(
            self.cfg, self.work, self.token_file, port=self.port, resume=True, starts=s.starts + 1
        )
        self.syncer.restarted_at = now
        self.record("restart-syncer", now)
        self.view.note(f"chaos: restart the syncer from its checkpoint at {now:.1f} s")

    def reap(self, lr: LearnerProcess, now: float) -> None:
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
        rows = newest_rows(status)
        for lr in self.learners:
            r = rows.get(f"learner-{lr.index}")
            if r is None:
                continue
            if lr.restarted_at is not None and r["id"] != lr.syncer_id and r["status"] == "live":
                self.catch_up.append(
                    {
                        "learner": lr.index,
                        "restarted_at": round(lr.restarted_at, 2),
                        "live_at": round(now, 2),
                        "catch_up_s": round(now - lr.restarted_at, 2),
                    }
                )
                lr.restarted_at = None
            if lr.restarted_at is None or lr.killed_at is not None:
                lr.syncer_id = r["id"]  # the id the next restart must differ from

    def shutdown(self) -> None:
        for lr in self.learners:
            if lr.proc and lr.proc.poll() is None:
                lr.proc.kill()
        if self.standby is not None and self.standby.proc.poll() is None:
            self.standby.proc.kill()  # never took over: it holds nothing
            self.standby.proc.wait(60)
        if self.syncer.proc.poll() is None:
            self.syncer.proc.send_signal(signal.SIGTERM)
            self.syncer.proc.wait(60)


def run_demo(cfg: DemoConfig, workdir: Path | None = None, out=sys.stdout) -> DemoReport:
    """Run the syncer and learners until the token budget is spent, then evaluate and report."""
    work = Path(workdir or tempfile.mkdtemp(prefix="ddiloco-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    plan = chaos_plan(cfg, np.random.default_rng(cfg.seed)) if cfg.chaos else []
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
        demo = Demo(cfg, work, view)
        while not (all(lr.done for lr in demo.learners) and status):  # and a syncer that is up
            now = demo.now()
            plan = chaos_monkey.act(demo, plan, now)
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


# What the restarted syncer logs at each step of its way back (net.server, cli/syncer.py, the core).
_RESTART_STEPS = (
    ("took_over_at", "standby: took over"),  # a standby's only
    ("up_at", "INFO ddiloco.syncer: config "),
    ("listening_at", "syncer listening on"),
    ("warmed_up_at", "kernels warmed up"),
    ("first_join_at", ") joined as"),
    ("first_merge_at", ": merged "),
)
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def restart_timeline(log_text: str, wall_started: float, killed_at: float, restarted_at: float) -> dict:
    """The restart of a killed syncer, step by step, in the demo's seconds: the kill and the restart
    (the supervisor's), then from the restarted syncer's log: its first line (interpreter, imports
    and the checkpoint read), listening (server up), kernels warmed up (the first stage, on a thread
    of its own while the learners reconnect: nothing waits for it, but a merge needs its kernels),
    the first learner joined, its first merge; and the phases between them. The outage is the kill
    to that merge, to the log's millisecond."""
    at: dict[str, float | None] = {"killed_at": killed_at, "restarted_at": restarted_at}
    for key, _ in _RESTART_STEPS:
        at[key] = None
    for line in log_text.splitlines():
        stamp = _STAMP.match(line)
        if stamp is None:
            continue
        for key, marker in _RESTART_STEPS:
            if at[key] is None and marker in line:
                t = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - wall_started
                at[key] = round(t, 3)

    def span(a: str, b: str) -> float | None:
        return None if at[a] is None or at[b] is None else round(at[b] - at[a], 3)

    phases = {
        "restart_delay_s": span("killed_at", "restarted_at"),
        "takeover_s": span("killed_at", "took_over_at"),
        "start_and_imports_s": span("restarted_at", "up_at"),
        "resume_and_listen_s": span("up_at", "listening_at"),
        "warmup_s": span("listening_at", "warmed_up_at"),
        "rejoin_s": span("listening_at", "first_join_at"),
        "first_round_s": span("first_join_at", "first_merge_at"),
        "outage_s": span("killed_at", "first_merge_at"),
    }
    return {**at, **phases}


def _report(cfg: DemoConfig, demo: Demo, work: Path, merge_times: list[float], final: dict, outage) -> DemoReport:
    wall = demo.now()
    trained_until = max((lr.finished_at or wall) for lr in demo.learners)
    mcfg = model_config(cfg)
    choice = reference.make_choice_accuracy(mcfg, count=cfg.choice_items)
    merged_loss, merged_choice = evaluate(checkpoint_params(cfg, work / "ckpt"), mcfg, choice)
    base_loss = base_choice = None
    base_curve: list = []
    if cfg.baseline:
        params, base_curve = train_baseline(cfg)
        base_loss, base_choice = evaluate(params, mcfg, choice)
    uptime, longest = uptime_and_longest_gap(merge_times, trained_until, wall, cfg)
    tokens_per_step = cfg.learners * cfg.batch * mcfg.seq
    events = [{**e, "tokens": e["step"] * tokens_per_step} for e in demo.events]
    restart = None
    kill = next((e["t"] for e in demo.events if e["what"] == "kill-syncer"), None)
    again = next((e["t"] for e in demo.events if e["what"] == "restart-syncer"), None)
    if kill is not None and again is not None:
        restart = restart_timeline(demo.syncer.log.read_text(), demo.wall_started, kill, again)
        if restart["outage_s"] is not None:
            outage = restart["outage_s"]  # to the millisecond, not to the poll
    return DemoReport(
        eval_loss=merged_loss,
        eval_bits_per_byte=merged_loss / np.log(2),
        baseline_eval_loss=base_loss,
        baseline_bits_per_byte=None if base_loss is None else base_loss / np.log(2),
        choice_accuracy=merged_choice,
        baseline_choice_accuracy=base_choice,
        uptime=uptime,
        longest_merge_gap_s=longest,
        goodput=goodput(demo.events, cfg, wall),
        kills=sum(1 for e in events if e["what"] == "kill"),
        recoveries=sum(1 for e in events if e["what"] == "restart"),
        merges=int(final.get("merges", 0)),
        ledger=final.get("ledger", {}),
        wall_s=wall,
        events=events,
        catch_up=demo.catch_up,
        syncer_kills=sum(1 for e in events if e["what"] == "kill-syncer"),
        syncer_outage_s=None if outage is None else round(outage, 2),
        syncer_restart=restart,
        curves={"learners": learner_curve(demo.logs, tokens_per_step), "baseline": base_curve},
        config=asdict(cfg),
        tokens_trained=trained_tokens(final) if final.get("ledger") else 0,
        token_budget=cfg.token_budget,
        global_steps=int(final.get("global_step", 0)),
    )


def learner_argv(
    cfg: DemoConfig,
    lr: LearnerProcess,
    port: int,
    token_file: Path,
    work: Path,
    restore: dict[str, Path],
    devices: LearnerDevices,
) -> list[str]:
    """The command line of learner `lr`'s next process (a restarted one keeps its index, so its GPU)."""
    speed = cfg.speeds[lr.index] if cfg.speeds else 1.0
    name = f"learner-{lr.index}"
    return [
        sys.executable,
        "-m",
        "ddiloco.cli",
        "learner",
        "--syncer",
        f"ws://127.0.0.1:{port}/ws",
        "--token-file",
        str(token_file),
        "--shard",
        f"{lr.index}/{cfg.learners}",
        "--steps",
        str(cfg.steps * STEPS_CAP_FACTOR),
        "--schedule-steps",
        str(cfg.steps),
        "--batch",
        str(cfg.batch),
        "--seed",
        str(cfg.seed * 1000 + lr.index * 10 + lr.restarts),
        "--speed",
        str(speed),
        "--model",
        cfg.model,
        "--name",
        name,
        "--cache-dir",
        str(cfg.cache_dir or work / "jax-cache"),
        "--log-file",
        str(work / f"learner{lr.index}.jsonl"),
        *devices.argv(),
        *(["--record", str(cfg.record / "learners" / f"{name}.{lr.restarts}")] if cfg.record else []),
        *(["--restore", str(restore[name])] if lr.restarts == 0 and name in restore else []),
    ]


def device_plan_words(plan: list[LearnerDevices]) -> str:
    """The plan in one line: `learner 0 on GPU 0, learner 1 on GPU 0 (memory fraction 0.425)`."""
    return ", ".join(
        f"learner {i} on "
        + ("the devices JAX finds" if d.devices is None else f"GPU {d.devices}")
        + ("" if d.memory_fraction is None else f" (memory fraction {d.memory_fraction:.3f})")
        for i, d in enumerate(plan)
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


def _start_syncer(
    cfg: DemoConfig, work: Path, token_file: Path, port: int, resume: bool, starts: int, standby: bool = False
) -> SyncerProcess:
    log_path = work / ("syncer.log" if starts == 1 else f"syncer.{starts}.log")
    if cfg.restore is not None and not resume:  # the syncer's state at the snapshot's cut, its config included
        where = ["--resume", str(cfg.restore), "--checkpoint-dir", str(work / "ckpt")]
    elif resume:
        where = ["--resume", str(work / "ckpt")]
    else:
        where = [
            "--checkpoint-dir",
            str(work / "ckpt"),
            "--fragments",
            str(cfg.fragments),
            "--period",
            str(cfg.period),
            "--overlap",
            str(cfg.overlap),
            "--quorum",
            str(cfg.quorum),
            "--outer-lr",
            str(cfg.outer_lr),
            "--outer-momentum",
            str(cfg.outer_momentum),
            "--merge",
            cfg.merge,
            "--grace-max-ms",
            str(cfg.grace_ms_max),
            "--grace-gamma",
            str(cfg.grace_gamma),
            "--checkpoint-every-s",
            str(cfg.checkpoint_every_s),
        ]
    where += ["--snapshot-dir", str(work / "snapshots"), "--snapshot-every-s", str(cfg.snapshot_every_s)]
    if standby:
        where.append("--standby")
    if cfg.record is not None:
        where += [
            "--record",
            str(cfg.record / ("syncer" if starts == 1 else f"syncer.{starts}")),
            "--record-no-payloads",
        ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ddiloco.cli",
                "syncer",
                "--port",
                str(port),
                "--auth-token-file",
                str(token_file),
                *where,
            ],
            stderr=subprocess.STDOUT,
            stdout=log,
        )
    return SyncerProcess(proc, log_path, starts=starts)


def _wait_listening(s: SyncerProcess) -> int:
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
