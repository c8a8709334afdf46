"""`ddiloco demo`: a real multi-process Decoupled DiLoCo run on this machine, with a chaos monkey.

It starts `ddiloco syncer` and M `ddiloco learner` processes on loopback, kills learners (SIGKILL,
restarted after a delay) and pauses others (SIGSTOP/SIGCONT) on a seeded schedule, and shows live
progress. At the end it evaluates the merged model (the syncer's final checkpoint) on held-out plays
against a data-parallel baseline trained in this process on the same token budget.
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

from ddiloco.learner import data
from ddiloco.learner import model as reference
from ddiloco.learner.tree import TreeFragments

POLL_S = 0.5
EVAL_WINDOWS = 64


@dataclass(frozen=True)
class DemoConfig:
    learners: int = 4
    steps: int = 300  # global steps; every learner trains until the syncer's step count reaches it
    batch: int = 8
    fragments: int = 4
    period: int = 24  # H: steps between two syncs of one fragment (overlap costs tau/H of the progress)
    overlap: int = 8  # tau: on 2 shared CPU cores a step (~40 ms) is short next to a round trip (~170 ms)
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

    def __post_init__(self) -> None:
        if self.learners < 1 or self.steps < 10 or self.batch < 1:
            raise ValueError("need at least 1 learner, 10 steps and a batch of 1")
        if self.speeds and len(self.speeds) != self.learners:
            raise ValueError(f"--speeds has {len(self.speeds)} values for {self.learners} learners")


@dataclass
class _Learner:
    index: int
    proc: subprocess.Popen | None = None
    restarts: int = 0
    killed_at: float | None = None
    paused_until: float | None = None
    done: bool = False
    stopping: bool = False  # asked to stop (SIGTERM) because the step budget is spent
    finished_at: float | None = None


@dataclass
class DemoReport:
    eval_loss: float
    eval_bits_per_byte: float
    baseline_eval_loss: float | None
    baseline_bits_per_byte: float | None
    choice_accuracy: float | None
    baseline_choice_accuracy: float | None
    uptime: float
    longest_merge_gap_s: float
    goodput: float
    kills: int
    recoveries: int
    merges: int
    ledger: dict
    wall_s: float
    events: list = field(default_factory=list)


def run_demo(cfg: DemoConfig, workdir: Path | None = None, out=sys.stdout) -> DemoReport:
    work = Path(workdir or tempfile.mkdtemp(prefix="ddiloco-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    token_file = work / "token"
    token_file.write_text(secrets.token_hex(16) + "\n")
    token = token_file.read_text().strip()
    rng = np.random.default_rng(cfg.seed)
    syncer, port = _start_syncer(cfg, work, token_file)
    base = f"http://127.0.0.1:{port}"
    learners = [_Learner(i) for i in range(cfg.learners)]
    events: list[dict] = []
    started = time.monotonic()
    for lr in learners:
        _spawn_learner(lr, cfg, port, work, token_file)
    plan = _chaos_plan(cfg, rng) if cfg.chaos else []
    merge_times: list[float] = []
    last_merges, status = 0, {}
    try:
        while not all(lr.done for lr in learners):
            now = time.monotonic() - started
            plan = _act(plan, now, learners, cfg, port, work, token_file, events, out)
            for lr in learners:
                _reap(lr, now, cfg, port, work, token_file, events)
            status = _get(f"{base}/status")
            if status and status["global_step"] >= cfg.steps:
                # The budget is spent: the syncer opens no more rounds, so learners still behind
                # would train for nothing. They finish their step and leave.
                for lr in learners:
                    if not lr.done and not lr.stopping and lr.proc.poll() is None and lr.killed_at is None:
                        if lr.paused_until is not None:
                            lr.proc.send_signal(signal.SIGCONT)
                            lr.paused_until = None
                        lr.proc.send_signal(signal.SIGTERM)
                        lr.stopping = True
            if status and status["merges"] > last_merges:
                merge_times.append(now)
                last_merges = status["merges"]
            _print_live(status, learners, now, out)
            time.sleep(POLL_S)
        _post(f"{base}/checkpoint", token)
        final = _get(f"{base}/status") or status
    finally:
        for lr in learners:
            if lr.proc and lr.proc.poll() is None:
                lr.proc.kill()
        syncer.send_signal(signal.SIGTERM)
        syncer.wait(60)
    wall = time.monotonic() - started
    trained_until = max((lr.finished_at or wall) for lr in learners)
    merged_loss = _evaluate_checkpoint(cfg, work / "ckpt")
    base_loss = _train_baseline(cfg) if cfg.baseline else None
    # Uptime counts from the first merge (before it, the processes start and compile) until the last
    # learner finished; a gap between merges longer than two fragment periods is downtime.
    span = [merge_times[0]] + merge_times + [trained_until] if merge_times else [0.0, wall]
    gaps = np.diff(span)
    period_s = (span[-1] - span[0]) / max(1, cfg.steps) * cfg.period
    downtime = float(np.sum(np.clip(gaps - 2 * period_s, 0, None)))
    kills = sum(1 for e in events if e["what"] == "kill")
    report = DemoReport(
        eval_loss=merged_loss, eval_bits_per_byte=merged_loss / np.log(2),
        baseline_eval_loss=base_loss, baseline_bits_per_byte=None if base_loss is None else base_loss / np.log(2),
        choice_accuracy=None, baseline_choice_accuracy=None,
        uptime=1.0 - downtime / max(span[-1] - span[0], 1e-9), longest_merge_gap_s=float(gaps.max()),
        goodput=_goodput(events, cfg, wall), kills=kills,
        recoveries=sum(1 for e in events if e["what"] == "restart"),
        merges=int(final.get("merges", 0)), ledger=final.get("ledger", {}), wall_s=wall, events=events,
    )
    return report


def _start_syncer(cfg: DemoConfig, work: Path, token_file: Path) -> tuple[subprocess.Popen, int]:
    log = open(work / "syncer.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddiloco.cli", "syncer", "--port", "0", "--auth-token-file", str(token_file),
         "--checkpoint-dir", str(work / "ckpt"), "--fragments", str(cfg.fragments), "--period", str(cfg.period),
         "--overlap", str(cfg.overlap), "--quorum", str(cfg.quorum),
         "--checkpoint-every-merges", "50"],
        stderr=subprocess.STDOUT, stdout=log,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = (work / "syncer.log").read_text()
        if "listening on 127.0.0.1:" in text:
            return proc, int(text.split("listening on 127.0.0.1:")[1].split()[0])
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the syncer did not start; its log:\n{(work / 'syncer.log').read_text()[-2000:]}")


def _spawn_learner(lr: _Learner, cfg: DemoConfig, port: int, work: Path, token_file: Path) -> None:
    speed = cfg.speeds[lr.index] if cfg.speeds else 1.0
    log = open(work / f"learner{lr.index}.log", "a")
    lr.proc = subprocess.Popen(
        [sys.executable, "-m", "ddiloco.cli", "learner", "--syncer", f"ws://127.0.0.1:{port}/ws",
         "--token-file", str(token_file), "--shard", f"{lr.index}/{cfg.learners}", "--steps", str(cfg.steps),
         "--batch", str(cfg.batch), "--seed", str(cfg.seed * 1000 + lr.index * 10 + lr.restarts),
         "--speed", str(speed), "--model", cfg.model, "--name", f"learner-{lr.index}",
         "--cache-dir", str(work / "jax-cache"), "--log-file", str(work / f"learner{lr.index}.jsonl")],
        stdout=subprocess.DEVNULL, stderr=log,
    )


def _chaos_plan(cfg: DemoConfig, rng: np.random.Generator) -> list[tuple[float, str, int]]:
    """(time, action, learner) sorted by time, drawn from the seed; spread over the expected run."""
    horizon = max(20.0, cfg.steps * 0.12)
    kills = [(float(t), "kill", int(rng.integers(cfg.learners))) for t in rng.uniform(0.25, 0.7, cfg.kills) * horizon]
    pauses = [(float(t), "pause", int(rng.integers(cfg.learners))) for t in rng.uniform(0.2, 0.8, cfg.pauses) * horizon]
    return sorted(kills + pauses)


def _act(plan, now, learners, cfg, port, work, token_file, events, out):
    while plan and plan[0][0] <= now:
        _, action, i = plan.pop(0)
        lr = learners[i]
        if lr.done or lr.proc is None or lr.proc.poll() is not None or lr.killed_at is not None:
            continue
        if action == "kill":
            lr.proc.send_signal(signal.SIGKILL)
            lr.killed_at = now
            events.append({"t": round(now, 2), "what": "kill", "learner": i})
        elif lr.paused_until is None:
            lr.proc.send_signal(signal.SIGSTOP)
            lr.paused_until = now + cfg.pause_s
            events.append({"t": round(now, 2), "what": "pause", "learner": i})
        print(f"chaos: {action} learner {i} at {now:.1f} s", file=out)
    return plan


def _reap(lr, now, cfg, port, work, token_file, events) -> None:
    if lr.paused_until is not None and now >= lr.paused_until:
        lr.proc.send_signal(signal.SIGCONT)
        lr.paused_until = None
        events.append({"t": round(now, 2), "what": "resume", "learner": lr.index})
    if lr.killed_at is not None and now - lr.killed_at >= cfg.restart_delay_s:
        lr.proc.wait()
        lr.restarts += 1
        lr.killed_at = None
        _spawn_learner(lr, cfg, port, work, token_file)
        events.append({"t": round(now, 2), "what": "restart", "learner": lr.index})
    elif lr.killed_at is None and lr.proc.poll() is not None and not lr.done:
        # -SIGTERM: we asked it to stop and it was between steps or already closing; that is a finish
        if lr.proc.returncode != 0 and not (lr.stopping and lr.proc.returncode == -signal.SIGTERM):
            raise RuntimeError(f"learner {lr.index} failed (exit {lr.proc.returncode}); see learner{lr.index}.log")
        lr.done = True
        lr.finished_at = now


def _print_live(status: dict, learners, now: float, out) -> None:
    if not status:
        return
    rows = {r["name"]: r for r in status.get("learners", [])}
    cells = []
    for lr in learners:
        r = rows.get(f"learner-{lr.index}")
        state = (
            "done" if lr.done else "stopping" if lr.stopping else "killed" if lr.killed_at is not None
            else "paused" if lr.paused_until else (r["status"] if r else "joining")
        )
        cells.append(f"L{lr.index}:{state}@{r['step'] if r else '-'}")
    versions = ",".join(str(f["version"]) for f in status.get("fragments", []))
    last = status["decisions"][-1]["reason"][:60] if status.get("decisions") else ""
    print(f"[{now:6.1f}s] step {status['global_step']:4d} merges {status['merges']:4d} v[{versions}] {' '.join(cells)} | {last}", file=out, flush=True)


def _get(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return {}


def _post(url: str, token: str) -> None:
    req = urllib.request.Request(url, method="POST", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


def _model_config(cfg: DemoConfig) -> reference.ModelConfig:
    return reference.ModelConfig(experts=4 if cfg.model == "moe" else 0)


def _evaluate(params, mcfg: reference.ModelConfig) -> float:
    x, y = data.eval_windows(mcfg.seq, EVAL_WINDOWS)
    return float(reference.make_eval(mcfg)(params, x, y))


def _evaluate_checkpoint(cfg: DemoConfig, ckpt_dir: Path) -> float:
    from ddiloco.net.store import newest_valid

    state, _ = newest_valid(ckpt_dir)
    mcfg = _model_config(cfg)
    params = reference.init_params(mcfg, jax.random.PRNGKey(0))
    tree = TreeFragments(params, state.layout)
    for p, frag in enumerate(state.fragments):
        params = tree.scatter(params, p, frag.theta)
    return _evaluate(params, mcfg)


def _train_baseline(cfg: DemoConfig) -> float:
    """Data-parallel on the same token budget: one model, a batch M times larger, as many steps."""
    mcfg = _model_config(cfg)
    tcfg = reference.TrainConfig(total_steps=max(cfg.steps, 21))
    params = reference.init_params(mcfg, jax.random.PRNGKey(cfg.seed))
    tx = reference.make_optimizer(tcfg)
    opt_state = tx.init(params)
    step = reference.make_train_step(mcfg, tx)
    stream = data.batches(data.train_bytes(), cfg.batch * cfg.learners, mcfg.seq, np.random.default_rng(cfg.seed))
    for _ in range(cfg.steps):
        x, y = next(stream)
        params, opt_state, _ = step(params, opt_state, x, y)
    return _evaluate(params, mcfg)


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


def report_text(r: DemoReport) -> str:
    def f(x):
        return "-" if x is None else f"{x:.4f}"

    rel = "" if r.baseline_eval_loss is None else f" ({100 * (r.eval_loss / r.baseline_eval_loss - 1):+.1f}% vs baseline)"
    return "\n".join([
        f"merged model   eval loss {f(r.eval_loss)} nats/byte, {f(r.eval_bits_per_byte)} bits/byte{rel}",
        f"data-parallel  eval loss {f(r.baseline_eval_loss)} nats/byte, {f(r.baseline_bits_per_byte)} bits/byte",
        f"syncer uptime  {100 * r.uptime:.1f}% (longest gap between merges {r.longest_merge_gap_s:.1f} s)",
        f"goodput        {100 * r.goodput:.1f}% of learner time",
        f"chaos          {r.kills} kills, {r.recoveries} recoveries",
        f"merges         {r.merges}",
        f"token ledger   {r.ledger}",
        f"wall time      {r.wall_s:.1f} s",
    ])


def report_json(r: DemoReport) -> dict:
    return asdict(r)
