"""`ddiloco bench learner`: what the sync hook costs a training loop.

Two loops, each in this process against a real `ddiloco syncer` started as its own process on
loopback. The reference loop (demo/learner_process.py: the byte transformer, inner AdamW, one data
shard; `d_model` and `layers` size it). The synthetic loop (`synthetic_step_ms`): no model, an
N-parameter pytree on JAX's default device, one of whose tensors a cheap jitted op perturbs each step
(each in turn), then the step waits out the rest of `synthetic_step_ms` (sleeping, as a host does while its accelerator computes,
or spinning, as a CPU-bound step does): it shows the hook's cost at a model size and step time this
machine could not train at. The same loop is timed with `params = sync.step(params, tokens=n)` after
every step and without it, in alternating blocks so that a change in the machine's load falls on both
alike. Every step is timed until its parameters are ready (`jax.block_until_ready`), so the
asynchronous dispatch of JAX hides nothing on either side.

Reported: mean and median step time each way, and the overhead of the hook: the median over the
rounds of (mean hooked step of the round / mean plain step of the round - 1). Means within a round,
because the hook's cost comes in bursts (a step that answers a request copies, quantises and queues
a fragment; a block of 12 steps holds two rounds of the default schedule); the median across
rounds, because this machine's speed drifts by up to 3x over minutes and a round that straddles
such a change says nothing about the hook. The quartiles of the per-round figures show the spread.
Beside it, CPU time per step each way, of this process (all its threads: XLA's, the client's) and of
the syncer's: on 2 shared cores the hook's cost is CPU that the training step then lacks. This
process's is also split by thread (`hooked_cpu_by_thread_ms`, `plain_cpu_by_thread_ms`): the
training thread, the hook's background thread, its network thread, and the others (XLA's, numba's),
read from /proc in clock ticks.

The hook's own time, `sync.step` timed around the call (the step's parameters already ready, so it
holds no wait for the device): its median on the hooked steps where no push started or was booked
and no version was applied (`idle_step_hook_us`: the cost every step pays) and on the others
(`busy_step_hook_us`); and the same calls' CPU time on the training thread (`idle_step_hook_cpu_us`,
`busy_step_hook_cpu_us`), which leaves out the waits for a core held by XLA's threads or the
syncer. And the share of the tokens reported that the syncer merged, from its ledger
(`/status`) at the end of the run, of those whose fate is decided (each fragment's last window is
still open then); the plain blocks report nothing, so they add no tokens to it.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ddiloco.net.auth import write_token_file

__all__ = ["LearnerBenchConfig", "format_report", "run_learner_bench", "synthetic_learner"]

SYNCER_START_S_MAX = 600.0  # to listen and load its kernels (compiled on a fresh checkout: minutes)
STATUS_S_MAX = 10.0  # the syncer's /status answers within this
SYNTHETIC_STEP_MS_MAX = 60_000.0
SYNTHETIC_PARAMS_MAX = 1 << 32  # 16 GiB of float32: more than a bench host should be asked to hold
SYNTHETIC_PARAMS_DEFAULT = 10 * (1 << 20)  # the CLI's 10M
WARMUP_STEPS_MAX = 10_000  # the warm-up goes on until the learner holds every fragment, up to this
REFERENCE_HEADS = 4  # reference.ModelConfig's n_heads, which d_model must be a multiple of
THREAD_ROLES = ("training", "background", "network", "other")  # how CPU per step is split by thread
BACKGROUND_THREAD_PREFIX = "ddiloco-sync"  # learner.background's worker
NETWORK_THREAD_NAME = "ddiloco-client"  # net.client.ThreadedClient's
LANE_THREAD_PREFIX = "ddiloco-lane"  # net.lane's sender and receiver: network too
SYNTHETIC_TOKENS_PER_STEP = 512  # what a synthetic step reports (the reference loop's 8 x 64)


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
    # the reference loop's size (reference.ModelConfig: d_ff is 4 x d_model)
    d_model: int = 128
    layers: int = 2
    # the synthetic loop: None runs the reference loop
    synthetic_step_ms: float | None = None
    params: int = SYNTHETIC_PARAMS_DEFAULT  # parameters of the synthetic loop's pytree
    synthetic_wait: str = "sleep"  # sleep (a host waiting on its accelerator) or spin (a CPU-bound step)

    def __post_init__(self) -> None:
        if self.steps < self.rounds or self.rounds < 1 or self.warmup_steps < 1 or self.batch < 1:
            raise ValueError(f"need rounds >= 1, steps >= rounds, warmup_steps >= 1 and batch >= 1, got {self}")
        if self.model not in ("dense", "moe"):
            raise ValueError(f"model must be dense or moe, got {self.model!r}")
        if self.synthetic_step_ms is not None and not 0 < self.synthetic_step_ms <= SYNTHETIC_STEP_MS_MAX:
            raise ValueError(
                f"synthetic_step_ms must lie in (0, {SYNTHETIC_STEP_MS_MAX:g}], got {self.synthetic_step_ms}"
            )
        if not 2 * self.fragments <= self.params <= SYNTHETIC_PARAMS_MAX:
            raise ValueError(f"params must lie in [2 x fragments, {SYNTHETIC_PARAMS_MAX}], got {self.params}")
        if self.synthetic_wait not in ("sleep", "spin"):
            raise ValueError(f"synthetic_wait must be sleep or spin, got {self.synthetic_wait!r}")
        if self.d_model % REFERENCE_HEADS or self.layers < 1:
            raise ValueError(
                f"d_model {self.d_model} must be a multiple of n_heads {REFERENCE_HEADS}, and layers positive"
            )
        if self.fragments < 1 or self.period < 1 or self.overlap < 0:
            raise ValueError(f"need fragments >= 1, period >= 1 and overlap >= 0, got {self}")

    @property
    def synthetic(self) -> bool:
        return self.synthetic_step_ms is not None


@dataclass
class _Loop:
    """One training loop as the bench drives it: `advance` takes one step without the hook and
    returns the new parameters, ready on the device."""

    params: Any
    advance: Callable[[Any], Any]
    tokens: int  # per step, what the hook is told
    param_count: int


def _reference_loop(cfg: LearnerBenchConfig) -> _Loop:
    import jax
    import numpy as np

    from ddiloco.reference import data
    from ddiloco.reference import model as reference

    mcfg = reference.ModelConfig(
        d_model=cfg.d_model,
        n_layers=cfg.layers,
        n_heads=REFERENCE_HEADS,
        d_ff=4 * cfg.d_model,
        experts=4 if cfg.model == "moe" else 0,
    )
    total = cfg.warmup_steps + 2 * cfg.steps
    tx = reference.make_optimizer(reference.TrainConfig(total_steps=max(total, 21)))
    params = reference.init_params(mcfg, jax.random.PRNGKey(cfg.seed))
    opt_state = tx.init(params)
    train_step = reference.make_train_step(mcfg, tx)
    stream = data.batches(
        data.Shard(0, 1).slice(data.train_bytes()), cfg.batch, mcfg.seq, np.random.default_rng(cfg.seed)
    )

    def advance(params: Any) -> Any:
        nonlocal opt_state
        x, y = next(stream)
        params, opt_state, _ = train_step(params, opt_state, x, y)
        return jax.block_until_ready(params)

    count = sum(int(leaf.size) for leaf in jax.tree.leaves(params))
    return _Loop(params, advance, cfg.batch * mcfg.seq, count)


def _synthetic_loop(cfg: LearnerBenchConfig) -> _Loop:
    """`cfg.params` float32 parameters in 2 x fragments tensors (a layout needs a tensor per fragment
    at least) on the default device; a step scales and shifts each one, then waits out the step time."""
    import jax
    import jax.numpy as jnp

    assert cfg.synthetic_step_ms is not None
    tensors = 2 * cfg.fragments
    sizes = [cfg.params // tensors + (1 if i < cfg.params % tensors else 0) for i in range(tensors)]
    keys = jax.random.split(jax.random.PRNGKey(cfg.seed), tensors)
    params = {
        f"block{i:03d}": {"w": 0.02 * jax.random.normal(k, (n,), jnp.float32)}
        for i, (k, n) in enumerate(zip(keys, sizes))
    }
    # One tensor per step, in turn: every parameter moves within 2 x fragments steps (well inside a
    # period), so each push carries a real outer gradient, while the step's own compute stays small
    # beside its time, as on an accelerator, where the host waits while the device computes. Moving
    # all of a 10M pytree every step would be a memory-bound CPU step of its own (80 MB of traffic),
    # and the bench would time that instead of the hook.
    names = sorted(params)
    perturb = jax.jit(lambda x: x * (1 - 1e-4) + 1e-4)
    step_s = cfg.synthetic_step_ms / 1000
    turn = 0

    def advance(params: Any) -> Any:
        nonlocal turn
        t0 = time.perf_counter()
        name, turn = names[turn % len(names)], turn + 1
        params = {**params, name: {"w": jax.block_until_ready(perturb(params[name]["w"]))}}
        end = t0 + step_s
        if cfg.synthetic_wait == "sleep":
            left = end - time.perf_counter()
            if left > 0:
                time.sleep(left)
        else:
            while time.perf_counter() < end:
                pass
        return params

    return _Loop(jax.block_until_ready(params), advance, SYNTHETIC_TOKENS_PER_STEP, cfg.params)


def synthetic_learner(
    url: str, name: str, token: str, seconds: float, cfg: LearnerBenchConfig, out: Any = None
) -> dict:
    """One learner of the synthetic loop (`cfg.synthetic_step_ms`, `cfg.params`) joined to the syncer
    at `url` under `name`: it trains `seconds`, then leaves with its parameters (`close(params)`:
    what it trained since its last pushes goes out). For load and chaos tests that need learners at
    accelerator speed without an accelerator; run it in a spawned process to kill it. Returns its
    counts (and puts them on the queue `out`, if given)."""
    from ddiloco.learner.sync import DilocoSync, SyncConfig

    loop = _synthetic_loop(cfg)
    params = loop.advance(loop.params)  # compiled before the clock starts
    sync = DilocoSync.connect(params, SyncConfig(url=url, name=name, token=token, codec=cfg.codec))
    steps, end = 0, time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            params = sync.step(loop.advance(params), tokens=loop.tokens)
            steps += 1
        counts = {"name": name, "learner": sync.learner_id, "steps": steps, "applied": sync.merged_versions_applied}
        sync.close(params)
    finally:
        sync.close()
    if out is not None:
        out.put(counts)
    return counts


class _CountingTransport:
    """The hook's transport with its pushes counted, those its background thread sends included."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.pushes = 0
        self._lock = threading.Lock()

    def push(self, item: Any) -> bool:
        with self._lock:
            self.pushes += 1
        return self.inner.push(item)

    def sender(self) -> Any:
        send = self.inner.sender()

        def counted(item: Any) -> bool:
            with self._lock:
                self.pushes += 1
            return send(item)

        return counted

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


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
    # Listening, and its kernels loaded: the daemon warms them up after it listens (net.warmup), and
    # a merge before that loads its own. Compiled into a fresh checkout's numba cache, that took the
    # first run's merges long enough that 58% of its tokens were merged late (0% in the run after).
    deadline = time.monotonic() + SYNCER_START_S_MAX
    while time.monotonic() < deadline and proc.poll() is None:
        text = log_path.read_text()
        if "listening on 127.0.0.1:" in text and ("kernels warmed up" in text or "kernel warm-up failed" in text):
            return proc, int(text.split("listening on 127.0.0.1:")[1].split()[0]), token
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the syncer did not start and warm up; its log:\n{log_path.read_text()[-2000:]}")


def run_learner_bench(cfg: LearnerBenchConfig, work: Path | None = None) -> dict:
    import jax

    from ddiloco.learner.sync import DilocoSync, SyncConfig

    work = Path(work or tempfile.mkdtemp(prefix="ddiloco-bench-learner-"))
    work.mkdir(parents=True, exist_ok=True)
    loop = _synthetic_loop(cfg) if cfg.synthetic else _reference_loop(cfg)
    params = loop.params
    proc, port, token = _start_syncer(cfg, work)
    sync = None
    try:
        sync = DilocoSync.connect(
            params, SyncConfig(url=f"ws://127.0.0.1:{port}/ws", name="bench", token=token, codec=cfg.codec)
        )
        counted = _CountingTransport(sync.client)
        sync.client = counted
        hook_us: dict[bool, list[float]] = {True: [], False: []}  # busy -> the hook's microseconds
        # the same calls' CPU time on the training thread: the hook's own work, without the time
        # the thread waited for a core that XLA's threads or the syncer held
        hook_cpu_us: dict[bool, list[float]] = {True: [], False: []}

        def one(hooked: bool, timed: bool = True) -> float:
            nonlocal params
            t0 = time.perf_counter()
            params = loop.advance(params)
            if hooked:
                # A busy call applied a version, or started or sent a push (or took one the
                # background thread sent: the pushes under way changed).
                applied, flying = sync.merged_versions_applied, sync.pushes_in_flight
                h0, c0 = time.perf_counter(), time.thread_time()
                params = sync.step(params, tokens=loop.tokens)
                took, cpu_took = time.perf_counter() - h0, time.thread_time() - c0
                if timed:
                    busy = sync.merged_versions_applied != applied or sync.pushes_in_flight != flying
                    hook_us[busy].append(1e6 * took)
                    hook_cpu_us[busy].append(1e6 * cpu_took)
            jax.block_until_ready(params)
            return time.perf_counter() - t0

        warm = 0
        while warm < WARMUP_STEPS_MAX and (warm < cfg.warmup_steps or min(sync.versions) < 0):
            one(True, timed=False)
            warm += 1
        times: dict[bool, list[float]] = {True: [], False: []}
        cpu = {True: [0.0, 0.0], False: [0.0, 0.0]}  # (this process, the syncer's) CPU seconds each way
        by_thread = {hooked: dict.fromkeys(THREAD_ROLES, 0.0) for hooked in (True, False)}  # this process's, by role
        ratios = []
        per_block = cfg.steps // cfg.rounds
        for r in range(cfg.rounds):
            block = {}
            for hooked in (False, True) if r % 2 == 0 else (True, False):
                before, threads_before = (_cpu_s(), _cpu_s(proc.pid)), _threads_cpu_s()
                block[hooked] = [one(hooked) for _ in range(per_block)]
                cpu[hooked][0] += _cpu_s() - before[0]
                cpu[hooked][1] += _cpu_s(proc.pid) - before[1]
                for role, seconds in _threads_cpu_s().items():
                    by_thread[hooked][role] += max(0.0, seconds - threads_before.get(role, 0.0))
                times[hooked] += block[hooked]
            ratios.append(statistics.fmean(block[True]) / statistics.fmean(block[False]))
        applied, pushed = sync.merged_versions_applied, counted.pushes
        ledger = _ledger(port)  # while the learner is still there: its open windows are not lost yet
    finally:
        if sync is not None:
            sync.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    plain, hooked = times[False], times[True]
    overhead = statistics.median(ratios) - 1
    return {
        "config": asdict(cfg),
        "loop": "synthetic" if cfg.synthetic else "reference",
        "params": loop.param_count,
        "synthetic_step_ms": cfg.synthetic_step_ms,
        "fragments": cfg.fragments,
        "period": cfg.period,
        "warmup_steps_run": warm,
        "steps_each": len(plain),
        "plain_mean_ms": 1000 * statistics.fmean(plain),
        "plain_p50_ms": 1000 * statistics.median(plain),
        "hooked_mean_ms": 1000 * statistics.fmean(hooked),
        "hooked_p50_ms": 1000 * statistics.median(hooked),
        "overhead": overhead,
        "overhead_pct": 100 * overhead,
        "overhead_quartiles_pct": [100 * (q - 1) for q in _quartiles(ratios)],
        "overhead_of_means_pct": 100 * (statistics.fmean(hooked) / statistics.fmean(plain) - 1),
        "merged_versions_applied": applied,
        "pushes": pushed,
        # the hook's own time per call, on steps with nothing to push or apply and on the others
        "idle_step_hook_us": _median_or_none(hook_us[False]),
        "busy_step_hook_us": _median_or_none(hook_us[True]),
        "idle_step_hook_cpu_us": _median_or_none(hook_cpu_us[False]),
        "busy_step_hook_cpu_us": _median_or_none(hook_cpu_us[True]),
        "idle_steps": len(hook_us[False]),
        "busy_steps": len(hook_us[True]),
        # the hook's own time per hooked step, on average: what of the overhead is the call itself
        # (the rest is the step waiting for the devices' share of the hook, and the cores it shares)
        "hook_mean_per_step_us": _mean_or_none(hook_us[False] + hook_us[True]),
        "merged_share": _merged_share(ledger),
        "ledger": ledger,
        # CPU time per step, all threads (XLA's, the client's): steadier than wall time when the
        # machine's speed drifts, and it says where the hook's cost lands
        "plain_cpu_ms": 1000 * cpu[False][0] / len(plain),
        "hooked_cpu_ms": 1000 * cpu[True][0] / len(hooked),
        "syncer_cpu_ms": 1000 * cpu[True][1] / len(hooked),
        # the same by thread (_threads_cpu_s), in clock ticks (10 ms on Linux): at 1200 steps a
        # figure below about 0.1 ms per step is within their resolution
        "hooked_cpu_by_thread_ms": {role: 1000 * v / len(hooked) for role, v in by_thread[True].items()},
        "plain_cpu_by_thread_ms": {role: 1000 * v / len(plain) for role, v in by_thread[False].items()},
    }


def _ledger(port: int) -> dict:
    """The syncer's token ledger (`/status`), {} if it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=STATUS_S_MAX) as r:
            return dict(json.loads(r.read()).get("ledger", {}))
    except (OSError, ValueError):
        return {}


def _merged_share(ledger: dict) -> float | None:
    """Merged tokens (on time and late, discounted) over the tokens whose fate is decided: reported,
    less the windows still open when the run ended (the last of each fragment, which the next round
    would have decided)."""
    decided = ledger.get("reported", 0) - ledger.get("open", 0)
    merged = ledger.get("merged", 0) + ledger.get("merged_late", 0)
    return merged / decided if decided > 0 else None


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _mean_or_none(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _threads_cpu_s() -> dict[str, float]:
    """CPU seconds so far of this process's threads, summed by role (THREAD_ROLES): the calling
    thread (the training loop), the hook's background thread, its network thread, and the rest
    (XLA's and numba's pools, among others); {} where /proc is missing. A thread that ended since an
    earlier call takes its seconds with it, so differences are taken per role and never below 0."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except (OSError, ValueError):
        return {}
    names = {t.native_id: t.name for t in threading.enumerate()}
    me = threading.get_native_id()
    out = dict.fromkeys(THREAD_ROLES, 0.0)
    for tid in tids:
        seconds = _stat_cpu_s(f"/proc/self/task/{tid}/stat")
        if seconds is not None:  # else it ended meanwhile
            out[_thread_role(tid, me, names.get(tid, ""))] += seconds
    return out


def _thread_role(tid: int, training: int, name: str) -> str:
    if tid == training:
        return "training"
    if name.startswith(BACKGROUND_THREAD_PREFIX):
        return "background"
    if name == NETWORK_THREAD_NAME or name.startswith(LANE_THREAD_PREFIX):
        return "network"
    return "other"


def _cpu_s(pid: int | None = None) -> float:
    """CPU seconds used so far by this process (pid None) or another one; 0 where /proc is missing."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    seconds = _stat_cpu_s(f"/proc/{pid}/stat")
    return 0.0 if seconds is None else seconds


def _stat_cpu_s(path: str) -> float | None:
    """User plus system CPU seconds from a /proc stat file (a process's or a thread's); None where it
    cannot be read (no /proc, or the thread or process has ended)."""
    try:
        with open(path) as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def _loop_words(r: dict) -> str:
    c = r["config"]
    if c["synthetic_step_ms"] is not None:
        what = f"synthetic: {r['params']:,} parameters, {c['synthetic_step_ms']:g} ms per step ({c['synthetic_wait']})"
    else:
        what = (
            f"{c['model']} byte transformer ({r['params']:,} parameters, d_model {c['d_model']}, "
            f"{c['layers']} layers), batch {c['batch']}"
        )
    return (
        f"{what}, {c['fragments']} fragments, H = {c['period']}, tau = {c['overlap']}, push {c['codec']}; "
        f"{r['steps_each']} steps each way in {c['rounds']} blocks"
    )


def _fates(ledger: dict) -> str:
    reported = ledger.get("reported", 0)
    return (
        ", ".join(f"{fate} {100 * n / reported:.1f}%" for fate, n in ledger.items() if fate != "reported" and n)
        if reported
        else "empty"
    )


def _by_thread(r: dict) -> str:
    hooked, plain = r["hooked_cpu_by_thread_ms"], r["plain_cpu_by_thread_ms"]
    if not any(hooked.values()):
        return "- (no /proc here)"
    split = lambda ms: ", ".join(f"{role} {ms[role]:.2f}" for role in THREAD_ROLES)  # noqa: E731
    return f"with hook {split(hooked)} ms per step; without {split(plain)}"


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} us"


def format_report(r: dict) -> str:
    c = r["config"]
    share = r["merged_share"]
    rows = [
        ("loop", _loop_words(r)),
        ("without hook", f"mean {r['plain_mean_ms']:.2f} ms, p50 {r['plain_p50_ms']:.2f} ms per step"),
        (
            "with hook",
            (
                f"mean {r['hooked_mean_ms']:.2f} ms, p50 {r['hooked_p50_ms']:.2f} ms per step "
                f"({r['merged_versions_applied']} merged fragment versions applied, {r['pushes']} pushed)"
            ),
        ),
        (
            "hook per call",
            (
                f"median {_us(r['idle_step_hook_us'])} on {r['idle_steps']} steps with nothing to push or apply, "
                f"{_us(r['busy_step_hook_us'])} on {r['busy_steps']} steps that pushed or applied a fragment; "
                f"mean {_us(r['hook_mean_per_step_us'])} per step"
            ),
        ),
        (
            "hook CPU",
            (
                f"median {_us(r['idle_step_hook_cpu_us'])} per call with nothing to push or apply, "
                f"{_us(r['busy_step_hook_cpu_us'])} with (the training thread's CPU time in the call)"
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
        ("CPU by thread", _by_thread(r)),
        (
            "merged",
            "no tokens reported"
            if share is None
            else f"{100 * share:.1f}% of the reported tokens decided (the syncer's ledger: {_fates(r['ledger'])})",
        ),
        (
            "overhead",
            (
                f"{r['overhead_pct']:+.1f}% of the step time, median of {c['rounds']} rounds (quartiles "
                f"{r['overhead_quartiles_pct'][0]:+.1f}% / {r['overhead_quartiles_pct'][1]:+.1f}%; of all steps' means "
                f"{r['overhead_of_means_pct']:+.1f}%)"
            ),
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
