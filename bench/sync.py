"""`ddiloco bench sync`: one full DiLoCo outer sync of N parameters among M learners, against the same
sync done with a torch.distributed gloo all-reduce.

One sync, ddiloco's way: the syncer daemon runs in this process on loopback, by default with one
fragment holding all N parameters (`--fragments 1`, period H = 1, quorum K = M: every round merges
once all M learners have pushed). M learner processes (spawn) each hold each fragment as a host
float32 vector. With `--fragments F` the model is cut into F fragments of whole tensors; a learner
pushes them one after the other and the syncer merges each once its M pushes are in, so that the
merge and broadcast of one fragment overlap the encode of the next (a sync is then F rounds). Each
learner reports the step and, every fragment being due at every step, at once (protocol 2: nobody
asks) encodes base - theta (`core.codec.encode_delta`, the push codec, on the calling thread as the
hook's default `serial_kernels` does) and pushes it; the syncer merges the M pushes, takes the outer
Nesterov step and broadcasts the new version (the delta onto the published copy, in its broadcast
codec: docs/protocol.md "Delta broadcast"); each learner applies it onto the published copy it holds
and copies that over its parameters. Timed per sync: from the first learner starting its push to the last
learner holding the new version (`time.monotonic`, which on Linux is one clock for all processes of
the machine). Between syncs every learner meets this process at a barrier, which is not timed: the
syncer's counters are read there, and each learner moves its parameters away from the version it
holds (the stand-in for training), so every outer gradient is fresh.

Why the client and the codec rather than `DilocoSync`: the hook is driven by training steps, and
each `step` call is one more global step. Waiting for a merged version by calling `step` therefore
opens the next round (with H = 1) before the one being timed has closed; "one sync now, then wait
for its result" cannot be said through it. So each learner does what the hook does inside `step`
for a push and an update, through the same public pieces: `net.client.ThreadedClient` (the
hook's default transport), `core.codec.encode_delta`, `core.publish.apply` (`Encoded.decode` for a
whole copy) and `core.events.Push`.
What the hook adds around them is left out: gathering the fragment from a JAX pytree to the host
and scattering it back onto the devices (here the parameters already are one host vector).

The breakdown of each sync cuts its time at points on the critical path, so the parts add up to it:
encode (first push started to last push handed to the client), wire in (to the start of the last
merge: serialising, loopback, the syncer parsing the pushes), merge (the syncer's own time in the
core step of that merge: the merge kernels and the outer step, `merge_kernel_last_s` of its
metrics), wire out (end of that merge to the last learner having the last update: encoding the
broadcast, loopback, reassembly) and apply (to the last learner holding every new version: the
delta applied and copied). With one fragment, the merge is the sync's only one.

CPU per sync: each learner's process time from its first push started to its last version held
(every thread: the client's network thread too), and this process's (the syncer, its kernels'
threads) from the go to the done meeting, summed over the processes; the gloo ranks' likewise over
their timed part. Divided by the cores this process may run on, it is the least wall time the
machine allows for that work: where the measured sync is close to it, the sync is bound by CPU, and
only less work makes it faster.

Bytes are the websocket payload bytes the syncer received and sent during the sync (pushes and progress reports
in; the broadcast out, M copies), and their ratio, bytes out per byte in.

The comparison, in the same run where torch is importable: M processes in a gloo process group on
127.0.0.1, one thread each (`torch.set_num_threads(1)`), each holding the parameters and an
N-float32 gradient; one sync is `all_reduce` (sum) of the gradient, its division by M and one step
of `torch.optim.SGD(momentum=0.9, nesterov=True)`, timed from the first rank leaving a gloo barrier
to the last rank done. It is given less to do than ddiloco's sync: its gradient is made before the
clock starts (ddiloco's encode computes base - theta inside the timed part) and no parameter copy
follows the step. Both sides' processes live through the whole run and their syncs take turns (the
side not syncing waits at a barrier, using no CPU), so that the drift of a shared machine's speed
falls on both alike. `speedup_vs_gloo = gloo_median_s / ddiloco_median_s`.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import os
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ddiloco.bench import wire
from ddiloco.core.layout import TensorSpec
from ddiloco.errors import FaultError

__all__ = [
    "PHASES",
    "SyncBenchConfig",
    "SyncBenchError",
    "format_report",
    "run_sync_bench",
    "sync_tensors",
    "torch_importable",
]

TOKEN = "bench-sync-token-0123456789abcdef"
TENSOR_ELEMENTS = 1 << 20  # the model is cut into tensors of this size (the last one holds the rest)
PARAMS_MAX = 1 << 31  # one fragment: its int32-indexed kernels stay below this
LEARNERS_MAX = 64
FRAGMENTS_MAX = 64  # the syncer's rounds per sync; each fragment holds whole tensors
REPEAT_MAX = 1000
WARMUP_MAX = 100
PHASE_S_MAX = 600.0  # the longest a learner waits for an update or the barrier
START_S_MAX = 300.0  # spawn, imports, kernel warm-up, join and the initial parameters
POLL_S = 0.0005  # how often a waiting learner looks at its client's inbox (costs microseconds)
PUSH_STEPS = 1  # the counters a push and a progress report carry: one inner step of ...
PUSH_TOKENS = 1024  # ... this many tokens (any positive weight; every learner the same)
DRIFT = 0.01  # the scale of the stand-in for training between syncs
GLOO_LR = 0.7  # the outer step's learning rate on both sides (core.outer.OuterConfig's default)
GLOO_MOMENTUM = 0.9
PHASES = ("encode", "wire_in", "merge", "wire_out", "apply")
CODECS = ("int4", "bf16", "fp32", "int2", "int1")
WIRE_MESSAGE_BYTES = 4 << 20  # the wire measurement's messages: the size of a fragment's int4 push
WIRE_BYTES_MIN = 64 << 20  # and its bytes, at least (a small sync's bytes time nothing)


class SyncBenchError(FaultError, RuntimeError):
    """A part of the benchmark did not finish (a process died, a barrier or a phase timed out)."""

    what_to_do = "read the learner's or rank's error above; on a loaded machine, run it again"


@dataclass(frozen=True)
class SyncBenchConfig:
    params: int = 50_000_000
    learners: int = 4
    codec: str = "int4"  # what the learners push
    broadcast_codec: str = "int4"  # the codec of the deltas the syncer sends back (core.publish)
    merge: str = "mean"  # mean: what an all-reduce computes; rda: the syncer's default
    # The model cut into this many fragments, pushed one after the other and merged each once its M
    # pushes are in: the syncer's merge and broadcast of one overlap the learners' encode of the next.
    fragments: int = 1
    repeat: int = 7  # timed syncs each way (the median is reported)
    warmup: int = 2  # syncs before the timed ones, each way
    torch: bool = True  # also time the gloo all-reduce, where torch is importable
    lane: bool = True  # pushes' and updates' bytes on the lane (net.lane); False: all on the websockets
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1024 <= self.params <= PARAMS_MAX:
            raise ValueError(f"params must lie in [1024, {PARAMS_MAX}], got {self.params}")
        if not 1 <= self.learners <= LEARNERS_MAX:
            raise ValueError(f"learners must lie in [1, {LEARNERS_MAX}], got {self.learners}")
        if not 1 <= self.repeat <= REPEAT_MAX or not 0 <= self.warmup <= WARMUP_MAX:
            raise ValueError(f"repeat must lie in [1, {REPEAT_MAX}] and warmup in [0, {WARMUP_MAX}], got {self}")
        tensors = len(sync_tensors(self.params))
        if not 1 <= self.fragments <= min(FRAGMENTS_MAX, tensors):
            raise ValueError(
                f"fragments must lie in [1, {min(FRAGMENTS_MAX, tensors)}] "
                f"({tensors} tensors of {TENSOR_ELEMENTS} values), got {self.fragments}"
            )
        if self.codec not in CODECS:
            raise ValueError(f"codec must be one of {CODECS}, got {self.codec!r}")
        if self.merge not in ("mean", "rda"):
            raise ValueError(f"merge must be mean or rda, got {self.merge!r}")


def sync_tensors(params: int) -> tuple[TensorSpec, ...]:
    """`params` parameters as tensors of TENSOR_ELEMENTS values, the last one holding the rest."""
    full, rest = divmod(params, TENSOR_ELEMENTS)
    sizes = [TENSOR_ELEMENTS] * full + ([rest] if rest else [])
    return tuple(TensorSpec(f"blocks/{i}/w", (n,)) for i, n in enumerate(sizes))


def torch_importable() -> bool:
    """Whether `import torch` works here (the `bench` extra), without importing it."""
    import importlib.util

    return importlib.util.find_spec("torch") is not None


# ---- ddiloco: the learner processes -------------------------------------------------------------------


@dataclass(frozen=True)
class _LearnerArgs:
    url: str
    name: str
    params: int
    codec: str
    syncs: int
    seed: int
    fragments: int
    lane: bool


class _Held:
    """The published copy a bench learner holds of one fragment, kept as learner.sync keeps it: a
    delta onto exactly the version held, a whole copy as it is."""

    def __init__(self) -> None:
        self.version, self.base, self.arrived = -1, None, 0.0

    def follow(self, updates) -> None:
        """Take the fragment's updates of one `take`, in order."""
        from ddiloco.core import publish

        for u in updates:
            if not u.whole and (self.base is None or u.base_version != self.version):
                continue  # not onto the copy held: a whole copy follows
            self.arrived = time.monotonic()  # the update is here; what follows is the apply part
            if u.whole:
                self.base = u.encoded.decode(parallel=False)
            else:
                # In place: nothing else holds this copy (the parameters are arrays of their own).
                publish.apply(self.base, u.encoded, parallel=False)
            self.version = u.version


def _follow_all(held: list[_Held], taken) -> None:
    """Each fragment's updates of one `take`; returns None (so it chains with `or` in `_wait_for`)."""
    for q, updates in taken[0].items():
        held[q].follow(updates)


def _wait_for(what: str, ready, client) -> Any:
    """Poll the client's inbox until `ready(taken)` returns something; the syncer's errors end it."""
    deadline = time.monotonic() + PHASE_S_MAX
    while time.monotonic() < deadline:
        taken = client.take()
        for err in taken[1]:
            raise SyncBenchError(
                f"the syncer sent an error while this learner waited for {what}: {err.code}: {err.text}"
            )
        got = ready(taken)
        if got is not None:
            return got
        time.sleep(POLL_S)
    raise SyncBenchError(f"no {what} within {PHASE_S_MAX:.0f} s")


def _copy_newer(
    held: list[_Held], params: list[np.ndarray], before: tuple[int, ...], done: set[int], taken
) -> bool | None:
    """Follow one `take`, and copy each fragment's version newer than `before` over its parameters,
    once (`done`); True once every fragment's is, else None (for `_wait_for`)."""
    _follow_all(held, taken)
    for q, h in enumerate(held):
        if q not in done and h.version > before[q]:
            np.copyto(params[q], h.base)
            done.add(q)
    return len(done) == len(held) or None


def _learner_main(args: _LearnerArgs, barrier, out) -> None:
    """One learner: join, hold version 0, then `args.syncs` outer syncs, meeting the others and the
    parent at `barrier` before each (go) and after it (done); puts its timestamps and final state on
    `out`."""
    try:
        out.put(_learner_syncs(args, barrier))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it; the process ends anyway
        barrier.abort()  # the others (and the parent) stop waiting for this one
        out.put({"name": args.name, "error": f"{type(exc).__name__}: {exc}"})


def _learner_syncs(args: _LearnerArgs, barrier) -> dict:
    from ddiloco.core import codec, publish
    from ddiloco.core.events import Push
    from ddiloco.core.layout import layout_from_description
    from ddiloco.net import session
    from ddiloco.net.client import ClientConfig, ThreadedClient

    codec.warm_up([args.codec])  # before joining: a kernel compiled later would hold the GIL for seconds
    publish.warm_up()
    client = ThreadedClient(
        ClientConfig(
            url=args.url,
            name=args.name,
            tensors=sync_tensors(args.params),
            token=TOKEN,
            progress_interval_s=0,
            pushes_queued_max=args.fragments,  # a sync pushes every fragment at once
            lane=args.lane,
        )
    )
    try:
        welcome = client.wait_welcome(START_S_MAX)
        layout = layout_from_description(welcome.layout)
        fragments = range(layout.num_fragments)
        rng = np.random.default_rng(args.seed)
        drifts = [(DRIFT * rng.standard_normal(f.padded_size)).astype(np.float32) for f in layout.fragments]
        held = [_Held() for _ in fragments]
        if welcome.needs_init:
            for q, h in enumerate(held):
                h.base = rng.standard_normal(layout.fragments[q].padded_size).astype(np.float32)
                client.init(q, codec.encode(h.base, "fp32", parallel=False))
                h.version = 0
        else:
            everything = lambda t: _follow_all(held, t) or all(h.version >= 0 for h in held) or None
            _wait_for("the initial parameters", everything, client)
        bases, versions = [h.base for h in held], [h.version for h in held]
        params = [b.copy() for b in bases]
        ones = (PUSH_STEPS,) * len(held)
        # live: the syncer counts it in
        client.progress(session.ProgressInfo(0, tuple(versions), (0,) * len(held), (0,) * len(held)))
        samples = []
        for step in range(1, args.syncs + 1):
            barrier.wait(PHASE_S_MAX)  # go: every learner is live, and the gloo ranks are idle
            for q in fragments:  # the stand-in for training since the versions held
                np.subtract(bases[q], drifts[q], out=params[q])
            client.progress(session.ProgressInfo(step, tuple(versions), ones, (PUSH_TOKENS,) * len(held)))
            # Every step is due (H = 1): the learner pushes each fragment on its own (protocol 2), in
            # order, and the syncer merges each once all M pushes of it are in.
            t_start, cpu_start = time.monotonic(), time.process_time()
            push_bytes = 0
            for q in fragments:
                payload, _ = codec.encode_delta(bases[q], params[q], None, args.codec, layout.block, parallel=False)
                push = Push(welcome.learner, q, step, versions[q], PUSH_STEPS, PUSH_TOKENS, codec.parse(payload))
                if not client.push(push):
                    raise SyncBenchError(f"the client refused the push of fragment {q} (its queue is full)")
                push_bytes += len(payload)
            t_pushed, cpu_encode_s = time.monotonic(), time.process_time() - cpu_start
            # Each fragment's new version is copied over its parameters as it arrives, while the
            # others are still on their way.
            applied: set[int] = set()
            newer = lambda t, done=applied, before=tuple(versions): _copy_newer(held, params, before, done, t)
            _wait_for("the merged versions", newer, client)
            t_update = max(h.arrived for h in held)
            bases, versions = [h.base for h in held], [h.version for h in held]
            t_applied, cpu_s = time.monotonic(), time.process_time() - cpu_start
            barrier.wait(PHASE_S_MAX)  # done: the parent reads the syncer's counters
            samples.append(
                {
                    "start": t_start,
                    "pushed": t_pushed,
                    "update": t_update,
                    "applied": t_applied,
                    "push_bytes": push_bytes,
                    "cpu_s": cpu_s,  # this process's, every thread's (the client's network thread too)
                    "cpu_encode_s": cpu_encode_s,  # of it, to the last push handed over
                }
            )
        digest = hashlib.sha256()
        for p in params:
            digest.update(memoryview(p))
        return {
            "name": args.name,
            "learner": welcome.learner,
            "versions": versions,
            "params_sha256": digest.hexdigest(),
            "samples": samples,
            "lane": client.client.lanes_attached > 0,
        }
    finally:
        client.close()


# ---- the syncer in this process, and both sides' syncs in turn -------------------------------------------


def _run_both(config: SyncBenchConfig, with_gloo: bool) -> dict:
    """Both sides' processes alive at once; their syncs take turns (ddiloco first on even syncs, gloo
    first on odd ones), so that a change in this machine's load falls on both alike. The side that
    is not syncing waits at its barrier, which takes no CPU."""
    from ddiloco import kernels
    from ddiloco.core import syncer
    from ddiloco.core.config import SyncerConfig
    from ddiloco.core.grace import GraceConfig
    from ddiloco.net.server import ServerConfig, SyncerServer, use_uvloop

    use_uvloop()
    kernels.warmup()
    core_config = SyncerConfig(
        num_fragments=config.fragments,
        period=1,
        quorum=config.learners,
        merge=config.merge,
        broadcast_codec=config.broadcast_codec,
        grace=GraceConfig(overlap=1),
        learners_max=max(8, config.learners),
        checkpoint_every_s=0,
    )
    syncs = config.warmup + config.repeat
    ctx = mp.get_context("spawn")
    learner_barrier, learner_out = ctx.Barrier(config.learners + 1), ctx.Queue()
    gloo_barrier, gloo_out = ctx.Barrier(config.learners + 1), ctx.Queue()

    async def main(rendezvous: str) -> dict:
        server_config = ServerConfig(port=0, auth_token=TOKEN, lane_port=0 if config.lane else None)
        server = SyncerServer(syncer.new_state(core_config), server_config)
        port = await server.start()
        url = f"ws://127.0.0.1:{port}/ws"
        procs = [
            ctx.Process(
                target=_learner_main,
                args=(
                    _LearnerArgs(
                        url,
                        f"sync{i}",
                        config.params,
                        config.codec,
                        syncs,
                        config.seed + i,
                        config.fragments,
                        config.lane,
                    ),
                    learner_barrier,
                    learner_out,
                ),
                daemon=True,
            )
            for i in range(config.learners)
        ]
        if with_gloo:
            procs += [
                ctx.Process(
                    target=_gloo_worker,
                    args=(rank, config.learners, rendezvous, config.params, syncs, config.seed, gloo_barrier, gloo_out),
                    daemon=True,
                )
                for rank in range(config.learners)
            ]
        for p in procs:
            p.start()
        loop = asyncio.get_running_loop()
        meet = lambda barrier: loop.run_in_executor(None, _meet, barrier)
        syncer_samples = []

        async def ddiloco_sync() -> None:
            before = _syncer_counters(server, config.fragments)
            cpu_start = time.process_time()  # this process: the syncer, its merge threads, the barrier's
            await meet(learner_barrier)  # go
            await meet(learner_barrier)  # done: every learner holds the new versions
            # The syncer sent each update only after the core step that merged had completed
            # (net.sessions posts what a step sends), so those steps' counters are all written by now.
            now = _syncer_counters(server, config.fragments)
            if now["merges"] != before["merges"] + config.fragments or now["outcomes"] != {"merged"}:
                raise SyncBenchError(
                    f"expected one merge of each of the {config.fragments} fragments per sync, "
                    f"the syncer's counters went {before} -> {now}"
                )
            syncer_samples.append(
                {key: now[key] - before[key] for key in ("merge_s", "bytes_in", "bytes_out")}
                | {
                    "merge_started_at": now["decided_at"],
                    "last_merge_s": now["last_merge_s"],
                    "cpu_s": time.process_time() - cpu_start,
                }
            )

        async def gloo_sync() -> None:
            await meet(gloo_barrier)  # go
            await meet(gloo_barrier)  # done

        try:
            deadline = time.monotonic() + START_S_MAX
            while len(server.state.live()) < config.learners:
                if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
                    raise SyncBenchError(
                        f"{len(server.state.live())} of {config.learners} learners live after start-up"
                        + _errors(learner_out, gloo_out)
                    )
                await asyncio.sleep(0.01)
            for k in range(syncs):
                sides = [ddiloco_sync, gloo_sync] if with_gloo else [ddiloco_sync]
                for side in sides if k % 2 == 0 else sides[::-1]:
                    await side()
            learners = [learner_out.get(timeout=PHASE_S_MAX) for _ in range(config.learners)]
            ranks = [gloo_out.get(timeout=PHASE_S_MAX) for _ in range(config.learners)] if with_gloo else []
        except threading.BrokenBarrierError:
            raise SyncBenchError(
                "a process stopped before the syncs were done" + _errors(learner_out, gloo_out)
            ) from None
        finally:
            learner_barrier.abort()
            gloo_barrier.abort()
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
            await server.stop(checkpoint=False)
        failed = [f"{r['name']}: {r['error']}" for r in learners + ranks if "error" in r]
        if failed:
            raise SyncBenchError("failed: " + "; ".join(failed))
        return {
            "learners": learners,
            "syncer": syncer_samples,
            "rejected": dict(server.state.rejections),
            "gloo": _gloo_summary(ranks, config.warmup) if with_gloo else None,
        }

    with tempfile.TemporaryDirectory(prefix="ddiloco-bench-sync-") as work:
        return asyncio.run(main(str(Path(work) / "gloo-rendezvous")))


def _meet(barrier) -> None:
    barrier.wait(PHASE_S_MAX)


def _syncer_counters(server, fragments: int) -> dict:
    """The syncer's cumulative counters; the outcomes of its last `fragments` decisions; and of the
    last one, its time (the `now` the core was given for the push that completed the round, which is
    when its merge started) and how long that merge took."""
    decisions = list(server.state.decisions)[-fragments:]
    last = decisions[-1] if decisions else None
    return {
        "merges": server.metrics.merges,
        "merge_s": server.metrics.merge_kernel_s,
        "last_merge_s": server.metrics.merge_kernel_last_s,
        "bytes_in": server.metrics.bytes_in,
        "bytes_out": server.metrics.bytes_out,
        "decided_at": last.at if last is not None else float("nan"),
        "outcomes": {d.outcome for d in decisions},
    }


def _errors(*queues) -> str:
    """The errors the processes reported before one of them broke a barrier."""
    errors = []
    for out in queues:
        while not out.empty():
            r = out.get_nowait()
            if "error" in r:
                errors.append(f"{r['name']}: {r['error']}")
    return "; " + "; ".join(errors) if errors else ""


def _sync_breakdowns(raw: dict, warmup: int) -> list[dict]:
    """Per timed sync: its total and its parts on the critical path (module docstring)."""
    learners, syncer_samples = raw["learners"], raw["syncer"]
    rows = []
    for k in range(warmup, len(syncer_samples)):
        s = [r["samples"][k] for r in learners]
        start, pushed = min(x["start"] for x in s), max(x["pushed"] for x in s)
        got, held = max(x["update"] for x in s), max(x["applied"] for x in s)
        # The critical path ends with the last fragment merged: its merge, and the wire out after it.
        merge_started, merge_s = syncer_samples[k]["merge_started_at"], syncer_samples[k]["last_merge_s"]
        rows.append(
            {
                "total": held - start,
                "encode": pushed - start,
                "wire_in": merge_started - pushed,
                "merge": merge_s,
                "merges_s": syncer_samples[k]["merge_s"],
                "cpu_learners": sum(x["cpu_s"] for x in s),
                "cpu_encode": sum(x["cpu_encode_s"] for x in s),
                "cpu_syncer": syncer_samples[k]["cpu_s"],
                "wire_out": got - (merge_started + merge_s),
                "apply": held - got,
                "bytes_in": syncer_samples[k]["bytes_in"],
                "bytes_out": syncer_samples[k]["bytes_out"],
                "push_bytes": s[0]["push_bytes"],
            }
        )
    return rows


# ---- the comparison: torch.distributed gloo -----------------------------------------------------------


def _gloo_worker(rank: int, world: int, rendezvous: str, params: int, syncs: int, seed: int, barrier, out) -> None:
    """One rank: `syncs` times all_reduce + SGD(nesterov) step, each timed from leaving a gloo barrier,
    between a go and a done meeting with the parent at `barrier`."""
    name = f"gloo rank {rank}"
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the loopback interface: 127.0.0.1
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
        try:
            generator = torch.Generator().manual_seed(seed + rank)
            theta = torch.nn.Parameter(torch.zeros(params))
            gradient = DRIFT * torch.randn(params, generator=generator)
            step = torch.optim.SGD([theta], lr=GLOO_LR, momentum=GLOO_MOMENTUM, nesterov=True)
            times = []
            for _ in range(syncs):
                theta.grad = gradient.clone()  # this rank's outer gradient, made before the clock starts
                barrier.wait(PHASE_S_MAX)  # go
                dist.barrier()
                started, cpu_start = time.monotonic(), time.process_time()
                dist.all_reduce(theta.grad)
                theta.grad.div_(world)
                step.step()
                times.append((started, time.monotonic(), time.process_time() - cpu_start))
                barrier.wait(PHASE_S_MAX)  # done
            digest = hashlib.sha256(theta.detach().numpy().tobytes()).hexdigest()
        finally:
            dist.destroy_process_group()
        out.put({"name": name, "times": times, "params_sha256": digest})
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        barrier.abort()
        out.put({"name": name, "error": f"{type(exc).__name__}: {exc}"})


def _gloo_summary(ranks: list[dict], warmup: int) -> dict:
    """Per timed sync: first rank leaving the barrier to last rank done."""
    syncs = len(ranks[0]["times"])
    totals = [max(r["times"][k][1] for r in ranks) - min(r["times"][k][0] for r in ranks) for k in range(warmup, syncs)]
    cpu = [sum(r["times"][k][2] for r in ranks) for k in range(warmup, syncs)]
    return {
        "syncs_s": totals,
        "cpu_s": statistics.median(cpu),
        "same_params": len({r["params_sha256"] for r in ranks}) == 1,
    }


# ---- both, and the report -----------------------------------------------------------------------------


def run_sync_bench(config: SyncBenchConfig, progress=None) -> dict:
    """Time `config.repeat` syncs (after `config.warmup`) each way; the result is JSON-able."""
    say = progress or (lambda text: None)
    gloo_skipped = None
    if not config.torch:
        gloo_skipped = "--no-torch"
    elif not torch_importable():
        gloo_skipped = 'torch is not installed (pip install -e ".[bench]")'
    syncs = config.warmup + config.repeat
    say(
        f"{config.learners} learner processes around the syncer"
        + (f" and {config.learners} gloo ranks, taking turns" if gloo_skipped is None else "")
        + f": {syncs} syncs each"
    )
    raw = _run_both(config, with_gloo=gloo_skipped is None)
    rows = _sync_breakdowns(raw, config.warmup)
    if len(rows) != config.repeat:
        raise SyncBenchError(f"{len(rows)} timed syncs measured on the syncer, {config.repeat} expected")
    wire_bytes = statistics.median(r["bytes_in"] + r["bytes_out"] for r in rows)
    say(
        f"the wire's CPU: {max(wire_bytes, WIRE_BYTES_MIN) / 2**20:.0f} MiB over a loopback websocket, then a bare socket"
    )
    wire_cost = wire.wire_cost(max(int(wire_bytes), WIRE_BYTES_MIN), WIRE_MESSAGE_BYTES)
    totals = [r["total"] for r in rows]
    ddiloco_median = statistics.median(totals)
    gloo = raw["gloo"]
    gloo_median = statistics.median(gloo["syncs_s"]) if gloo else None
    learners = raw["learners"]
    return {
        "settings": asdict(config) | {"tensors": len(sync_tensors(config.params))},
        "ddiloco_median_s": ddiloco_median,
        "ddiloco_syncs_s": totals,
        "gloo_median_s": gloo_median,
        "gloo_syncs_s": gloo["syncs_s"] if gloo else None,
        "gloo_same_params": gloo["same_params"] if gloo else None,
        "gloo_skipped": gloo_skipped,
        "speedup_vs_gloo": gloo_median / ddiloco_median if gloo_median is not None else None,
        "breakdown_median_s": {phase: statistics.median(r[phase] for r in rows) for phase in PHASES},
        "merges_median_s": statistics.median(r["merges_s"] for r in rows),
        # CPU seconds per sync, every process's threads summed (medians): what the cores must carry
        "cpu_s": {
            "ddiloco_learners": statistics.median(r["cpu_learners"] for r in rows),
            "ddiloco_learners_encode": statistics.median(r["cpu_encode"] for r in rows),
            "ddiloco_syncer": statistics.median(r["cpu_syncer"] for r in rows),
            "ddiloco": statistics.median(r["cpu_learners"] + r["cpu_syncer"] for r in rows),
            "gloo": gloo["cpu_s"] if gloo else None,
        },
        "cores": len(os.sched_getaffinity(0)),
        # the same bytes as a sync's in + out, over each transport alone (bench.wire): CPU seconds
        "wire": wire_cost,
        "wire_cpu_s_per_sync": {t: c["cpu_ns_per_byte"] * wire_bytes / 1e9 for t, c in wire_cost.items()},
        "bytes_in_per_sync": statistics.median(r["bytes_in"] for r in rows),
        "bytes_out_per_sync": statistics.median(r["bytes_out"] for r in rows),
        "bytes_out_per_byte_in": statistics.median(r["bytes_out"] / max(r["bytes_in"], 1) for r in rows),
        "push_bytes": rows[0]["push_bytes"],
        "fp32_model_bytes": 4 * config.params,
        "learner_versions": [r["versions"] for r in learners],
        "learners_on_a_lane": sum(r["lane"] for r in learners),
        "same_params": len({r["params_sha256"] for r in learners}) == 1,
        "rejected": raw["rejected"],
    }


def format_report(r: dict) -> str:
    c = r["settings"]
    b = r["breakdown_median_s"]
    ms = lambda s: f"{1000 * s:.1f} ms"
    rows = [
        (
            "sync",
            (
                f"{c['params'] / 1e6:.1f}M parameters ({c['tensors']} tensors, {_fragments(c['fragments'])}), "
                f"{c['learners']} learners, "
                f"push {c['codec']}, broadcast {c['broadcast_codec']}, merge {c['merge']}, "
                f"{r['learners_on_a_lane']} on a lane; "
                f"median of {c['repeat']} after {c['warmup']} warm-up"
            ),
        ),
        ("ddiloco", f"{ms(r['ddiloco_median_s'])} (first push started to last learner holding the new versions)"),
        (
            "breakdown",
            ", ".join(f"{phase.replace('_', ' ')} {ms(b[phase])}" for phase in PHASES)
            + " (medians"
            + ("" if c["fragments"] == 1 else "; merge and wire out of the last fragment merged")
            + ")",
        ),
        ("syncer", f"{ms(r['merges_median_s'])} in merges per sync ({_fragments(c['fragments'])})"),
        ("CPU per sync", _cpu_row(r, ms)),
        ("wire", _wire_row(r, ms)),
        (
            "bytes",
            (
                f"in {r['bytes_in_per_sync'] / 2**20:.1f} MiB, out {r['bytes_out_per_sync'] / 2**20:.1f} MiB per sync, "
                f"{r['bytes_out_per_byte_in']:.2f} bytes out per byte in "
                f"(the fp32 model is {r['fp32_model_bytes'] / 2**20:.1f} MiB)"
            ),
        ),
        (
            "learners",
            f"versions {_distinct(r['learner_versions'])}, {'the same' if r['same_params'] else 'DIFFERENT'} parameters",
        ),
    ]
    if r["gloo_median_s"] is None:
        rows.append(("gloo", f"not run: {r['gloo_skipped']}"))
    else:
        rows.append(("gloo", f"{ms(r['gloo_median_s'])} (all_reduce + SGD nesterov step, 1 thread per rank)"))
        rows.append(("speedup_vs_gloo", f"{r['speedup_vs_gloo']:.2f}x (gloo median / ddiloco median)"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def _fragments(n: int) -> str:
    return "1 fragment" if n == 1 else f"{n} fragments"


def _distinct(versions: list[list[int]]) -> str:
    """The learners' version vectors, each distinct one once (all learners alike: one)."""
    return " / ".join(str(v) for v in dict.fromkeys(tuple(v) for v in versions))


def _cpu_row(r: dict, ms) -> str:
    """CPU time per sync, all processes' threads: with this machine's cores, the least wall time it
    allows."""
    cpu, cores = r["cpu_s"], r["cores"]
    text = (
        f"ddiloco {ms(cpu['ddiloco'])} (learners {ms(cpu['ddiloco_learners'])}, of it encode "
        f"{ms(cpu['ddiloco_learners_encode'])}; syncer {ms(cpu['ddiloco_syncer'])}), "
        f"at least {ms(cpu['ddiloco'] / cores)} on {cores} cores"
    )
    if cpu["gloo"] is not None:
        text += f"; gloo {ms(cpu['gloo'])}"
    return text


def _wire_row(r: dict, ms) -> str:
    """The CPU the sync's bytes cost on each transport alone (bench.wire)."""
    w, per_sync = r["wire"], r["wire_cpu_s_per_sync"]
    return ", ".join(
        f"{name} {w[t]['cpu_ns_per_byte']:.2f} ns of CPU per byte at {w[t]['gbps']:.2f} GB/s "
        f"({ms(per_sync[t])} for a sync's in + out)"
        for t, name in (("websocket", "loopback websocket"), ("tcp", "bare socket"))
    )
