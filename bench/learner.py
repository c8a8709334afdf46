"""`ddiloco bench learner`: what the sync hook costs a training loop.

The reference training loop (demo/learner_process.py: the byte transformer, inner AdamW, one data shard) runs
in this process against a real `ddiloco syncer` started as its own process on loopback. The same
loop, same model and same batches, is timed with `params = sync.step(params, tokens=n)` after every
inner step and without it, in alternating blocks so that a change in the machine's load falls on
both alike. Every step is timed until its parameters are ready (`jax.block_until_ready`), so the
asynchronous dispatch of JAX hides nothing on either side.

Reported: mean and median step time each way, and the overhead of the hook: the median over the
rounds of (mean hooked step of the round / mean plain step of the round - 1). Means within a round,
because the hook's cost comes in bursts (a step that answers a request copies, quantises and queues
a fragment; a block of 12 steps holds two rounds of the default schedule); the median across
rounds, because this machine's speed drifts by up to 3x over minutes and a round that straddles
such a change says nothing about the hook. The quartiles of the per-round figures show the spread.
Beside it, CPU time per step each way, of this process (all its threads: XLA's, the client's) and of
the syncer's: on 2 shared cores the hook's cost is CPU that the training step then lacks.
"""

from __future__ import annotations

import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ddiloco.net.auth import write_token_file

SYNCER_START_S_MAX = 60.0


@dataclass(frozen=True)
class LearnerBenchConfig:
    steps: int = 240  # timed steps each way
    warmup_steps: int = 30  # compile, join, receive every fragment once
    rounds: int = 20  # blocks each way, alternating
    batch: int = 8
    fragments: int = 4
    period: int = 24
    overlap: int = 8
    model: str = "dense"
    codec: str = "int4"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < self.rounds or self.rounds < 1 or self.warmup_steps < 1 or self.batch < 1:
            raise ValueError(f"need rounds >= 1, steps >= rounds, warmup_steps >= 1 and batch >= 1, got {self}")
        if self.model not in ("dense", "moe"):
            raise ValueError(f"model must be dense or moe, got {self.model!r}")


def _start_syncer(cfg: LearnerBenchConfig, work: Path) -> tuple[subprocess.Popen, int, str]:
    token = secrets.token_hex(16)
    write_token_file(work / "token", token)
    log_path = work / "syncer.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ddiloco.cli",
                "syncer",
                "--port",
                "0",
                "--auth-token-file",
                str(work / "token"),
                "--fragments",
                str(cfg.fragments),
                "--period",
                str(cfg.period),
                "--overlap",
                str(cfg.overlap),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + SYNCER_START_S_MAX
    while time.monotonic() < deadline and proc.poll() is None:
        text = log_path.read_text()
        if "listening on 127.0.0.1:" in text:
            return proc, int(text.split("listening on 127.0.0.1:")[1].split()[0]), token
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the syncer did not start; its log:\n{log_path.read_text()[-2000:]}")


def run_learner_bench(cfg: LearnerBenchConfig, work: Path | None = None) -> dict:
    import jax
    import numpy as np

    from ddiloco.learner.sync import DilocoSync, SyncConfig
    from ddiloco.reference import data
    from ddiloco.reference import model as reference

    work = Path(work or tempfile.mkdtemp(prefix="ddiloco-bench-learner-"))
    work.mkdir(parents=True, exist_ok=True)
    mcfg = reference.ModelConfig(experts=4 if cfg.model == "moe" else 0)
    total = cfg.warmup_steps + 2 * cfg.steps
    tx = reference.make_optimizer(reference.TrainConfig(total_steps=max(total, 21)))
    params = reference.init_params(mcfg, jax.random.PRNGKey(cfg.seed))
    opt_state = tx.init(params)
    train_step = reference.make_train_step(mcfg, tx)
    stream = data.batches(
        data.Shard(0, 1).slice(data.train_bytes()), cfg.batch, mcfg.seq, np.random.default_rng(cfg.seed)
    )
    tokens = cfg.batch * mcfg.seq
    proc, port, token = _start_syncer(cfg, work)
    sync = None
    try:
        sync = DilocoSync.connect(
            params, SyncConfig(url=f"ws://127.0.0.1:{port}/ws", name="bench", token=token, codec=cfg.codec)
        )

        def one(hooked: bool) -> float:
            nonlocal params, opt_state
            t0 = time.perf_counter()
            x, y = next(stream)
            params, opt_state, _ = train_step(params, opt_state, x, y)
            if hooked:
                params = sync.step(params, tokens=tokens)
            jax.block_until_ready(params)
            return time.perf_counter() - t0

        for _ in range(cfg.warmup_steps):
            one(True)
        times: dict[bool, list[float]] = {True: [], False: []}
        cpu = {True: [0.0, 0.0], False: [0.0, 0.0]}  # (this process, the syncer's) CPU seconds each way
        ratios = []
        per_block = cfg.steps // cfg.rounds
        for r in range(cfg.rounds):
            block = {}
            for hooked in (False, True) if r % 2 == 0 else (True, False):
                before = (_cpu_s(), _cpu_s(proc.pid))
                block[hooked] = [one(hooked) for _ in range(per_block)]
                cpu[hooked][0] += _cpu_s() - before[0]
                cpu[hooked][1] += _cpu_s(proc.pid) - before[1]
                times[hooked] += block[hooked]
            ratios.append(statistics.fmean(block[True]) / statistics.fmean(block[False]))
        applied = sync.merged_versions_applied
    finally:
        if sync is not None:
            sync.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    plain, hooked = times[False], times[True]
    return {
        "config": asdict(cfg),
        "steps_each": len(plain),
        "plain_mean_ms": 1000 * statistics.fmean(plain),
        "plain_p50_ms": 1000 * statistics.median(plain),
        "hooked_mean_ms": 1000 * statistics.fmean(hooked),
        "hooked_p50_ms": 1000 * statistics.median(hooked),
        "overhead_pct": 100 * (statistics.median(ratios) - 1),
        "overhead_quartiles_pct": [100 * (q - 1) for q in _quartiles(ratios)],
        "overhead_of_means_pct": 100 * (statistics.fmean(hooked) / statistics.fmean(plain) - 1),
        "merged_versions_applied": applied,
        # CPU time per step, all threads (XLA's, the client's): steadier than wall time when the
        # machine's speed drifts, and it says where the hook's cost lands
        "plain_cpu_ms": 1000 * cpu[False][0] / len(plain),
        "hooked_cpu_ms": 1000 * cpu[True][0] / len(hooked),
        "syncer_cpu_ms": 1000 * cpu[True][1] / len(hooked),
    }


def _cpu_s(pid: int | None = None) -> float:
    """CPU seconds used so far by this process (pid None) or another one; 0 where /proc is missing."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def format_report(r: dict) -> str:
    c = r["config"]
    rows = [
        (
            "loop",
            (
                f"{c['model']} byte transformer, batch {c['batch']}, {c['fragments']} fragments, H = {c['period']}, "
                f"tau = {c['overlap']}, push {c['codec']}; {r['steps_each']} steps each way in {c['rounds']} blocks"
            ),
        ),
        ("without hook", f"mean {r['plain_mean_ms']:.2f} ms, p50 {r['plain_p50_ms']:.2f} ms per step"),
        (
            "with hook",
            (
                f"mean {r['hooked_mean_ms']:.2f} ms, p50 {r['hooked_p50_ms']:.2f} ms per step "
                f"({r['merged_versions_applied']} merged fragment versions applied)"
            ),
        ),
        (
            "CPU per step",
            (
                f"without hook {r['plain_cpu_ms']:.1f} ms, with hook {r['hooked_cpu_ms']:.1f} ms in this process "
                f"and {r['syncer_cpu_ms']:.1f} ms in the syncer's (all threads; "
                f"{100 * ((r['hooked_cpu_ms'] + r['syncer_cpu_ms']) / r['plain_cpu_ms'] - 1):+.1f}% in all)"
            ),
        ),
        (
            "overhead",
            (
                f"{r['overhead_pct']:+.1f}% of the step time, median of {c['rounds']} rounds (quartiles "
                f"{r['overhead_quartiles_pct'][0]:+.1f}% / {r['overhead_quartiles_pct'][1]:+.1f}%; of all steps' means "
                f"{r['overhead_of_means_pct']:+.1f}%); target <= 5%"
            ),
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
