"""`ddiloco bench syncer`: how fast the real daemon ingests fragment pushes from real learner processes.

The syncer runs in this process, on its own event loop; M learner processes (started with spawn)
connect over loopback websockets and do no training: each pre-encodes one outer gradient per
fragment and, as fast as the syncer lets it, reports a step, pushes the fragments due at it (one
push from each version received, as a learner holds back its pushes) and takes every update. So the figures are the syncer's (and loopback's) own limits.

Reported: merges/s, payload GB/s in and out, p50/p99 round latency (round open to merge), the share
of wall time spent in the core (merge kernels and outer step), and the syncer's peak RSS against the
fp32 size of the model. The baseline, measured in the same run before the syncer starts: what
loopback websockets carry on this machine when as many processes push frames of the syncer's size
to an aiohttp server that only counts them (`wire_ceiling_gbps`). The syncer's traffic in and out
is reported as a share of it.

With `shards` (`ddiloco bench syncer --shards N`, `run_sharded_bench`) the same load runs twice, each
time against syncers in processes of their own: one whole syncer, then N shards (core.shards), every
learner connected to each shard, sending its progress to all of them and each push and initial
fragment to the fragment's owner. The ingest of both (payload bytes in per second, merges per
second, summed over the shards) is reported side by side: what splitting the syncer buys on this
machine. The baseline and the round latencies are not measured there.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from ddiloco.bench import wire
from ddiloco.core.layout import TensorSpec

TOKEN = "bench-token-0123456789abcdef"
TENSOR_ELEMENTS = 1 << 20  # the model is cut into tensors of about this size


@dataclass(frozen=True)
class SyncerBenchConfig:
    learners: int = 8
    params: int = 50_000_000
    codec: str = "int4"
    fragments: int = 8
    seconds: float = 20.0
    broadcast_codec: str = "int4"  # the codec of the deltas sent back (core.publish)
    merge: str = "rda"
    step_hz: float = 50.0  # how often each learner reports a step (rounds open at this rate)
    quorum: int = 1  # the syncer's minimum quorum K (core.config; 1, its default, merges the soonest)
    ceiling_seconds: float = 4.0  # how long the baseline's processes push

    def __post_init__(self) -> None:
        if (
            self.learners < 1
            or self.params < 1024
            or self.fragments < 1
            or self.seconds <= 0
            or self.step_hz <= 0
            or self.ceiling_seconds <= 0
            or not 1 <= self.quorum <= self.learners
        ):
            raise ValueError(f"bad syncer bench config {self}")


def bench_tensors(params: int, fragments: int) -> tuple[TensorSpec, ...]:
    count = max(fragments, -(-params // TENSOR_ELEMENTS))
    size = params // count
    return tuple(TensorSpec(f"blocks/{i}/w", (size,)) for i in range(count))


def _learner_main(
    urls: list[str],
    name: str,
    params: int,
    fragments: int,
    codec_name: str,
    seconds: float,
    step_hz: float,
    seed: int,
    out,
    stop=None,
) -> None:
    """One learner process: no training, just the protocol as fast as it goes. With several `urls`
    (the shards of one syncer, in shard order) it sends its progress to all of them and each push
    and initial fragment to the shard that owns the fragment."""
    from ddiloco.core import codec
    from ddiloco.core.events import Push
    from ddiloco.core.shards import owner
    from ddiloco.net import session
    from ddiloco.net.client import ClientConfig, SyncerClient

    async def main() -> dict:
        tensors = bench_tensors(params, fragments)
        clients = [SyncerClient(ClientConfig(url=url, name=name, tensors=tensors, token=TOKEN)) for url in urls]
        tasks = [asyncio.create_task(c.run()) for c in clients]
        for client in clients:
            await asyncio.wait_for(client.welcomed.wait(), 120)
            if client.refused:
                raise client.refused
        welcomes = [c.inbox.welcome for c in clients]
        w = welcomes[0]
        rng = np.random.default_rng(seed)
        sizes = [-(-sum(int(np.prod(s)) for _, s, _, _ in f) // 128) * 128 for f in w.layout["fragments"]]
        versions = [-1] * len(sizes)
        for client, welcome in zip(clients, welcomes, strict=True):
            if welcome.needs_init:  # each shard asks one learner for its own fragments
                for p in welcome.owned:
                    client.queue_init(p, codec.encode(rng.standard_normal(sizes[p]).astype(np.float32), "fp32"))
                    versions[p] = 0
        payloads = [
            codec.parse(codec.encode((rng.standard_normal(n) * 0.01).astype(np.float32), codec_name)) for n in sizes
        ]
        step, pushes = 0, 0
        pushed_from = [-2] * len(sizes)  # fragment -> the version its last push was made from
        end = time.monotonic() + seconds
        # `stop` (the sharded bench): run until the measured window ends; `seconds` is then a cap.
        while time.monotonic() < end and not (stop is not None and stop.is_set()):
            for client in clients:
                box = client.inbox
                for p, chain in list(box.updates.items()):
                    versions[p] = chain[-1].version if chain else versions[p]
                box.updates.clear()
            step += 1
            n = len(sizes)
            # As the hook and the sharded client do: a report only to the shards whose fragments
            # this learner holds, 0 for another shard's fragment it lacks (the wire has no -1).
            progress = session.ProgressInfo(step, tuple(max(v, 0) for v in versions), (1,) * n, (1024,) * n)
            for client in clients:
                if all(versions[q] >= 0 for q in client.inbox.welcome.owned):
                    client.queue_progress(progress)
            due = (q for q, t in enumerate(w.offsets) if step % w.period == t and min(versions) >= 0)
            # As a learner does (learner.sync, the hold-back): one push from each version it receives.
            for p in (q for q in due if pushed_from[q] != versions[q]):
                client = clients[owner(p, len(clients))]
                learner = client.inbox.welcome.learner  # each shard numbers its learners itself
                push = Push(learner, p, step, versions[p], 1, 1024, payloads[p])  # its own schedule (protocol 2)
                if client.queue_push(push):
                    pushes += 1
                    pushed_from[p] = versions[p]
            await asyncio.sleep(1.0 / step_hz)
        for client, task in zip(clients, tasks, strict=True):
            await client.close()
            task.cancel()
        return {"name": name, "steps": step, "pushes": pushes, "bytes_out": sum(c.bytes_out for c in clients)}

    out.put(asyncio.run(main()))


def _pusher_main(url: str, frame_bytes: int, seconds: float, out) -> None:
    """One process of the ceiling: push `frame_bytes` binary frames for `seconds`, as fast as it goes."""
    import aiohttp

    async def main() -> int:
        frame, sent = bytes(frame_bytes), 0
        async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=0) as ws:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                await ws.send_bytes(frame)
                sent += frame_bytes
            await ws.close()
        return sent

    out.put(asyncio.run(main()))


def wire_ceiling(processes: int, frame_bytes: int, seconds: float) -> float:
    """GB/s that `processes` spawned clients push over loopback websockets to a server that counts
    them and does nothing else: what this machine's loopback and aiohttp allow the syncer at most."""
    from aiohttp import WSMsgType, web

    async def main() -> float:
        received = [0, None, None]  # bytes, first and last arrival

        async def ws_handler(request: web.Request) -> web.WebSocketResponse:
            ws = web.WebSocketResponse(max_msg_size=0)
            await ws.prepare(request)
            async for msg in ws:
                if msg.type is WSMsgType.BINARY:
                    now = time.perf_counter()
                    received[0] += len(msg.data)
                    received[1] = received[1] or now
                    received[2] = now
            return ws

        runner, port = await wire.serve_websocket(ws_handler)
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [
            ctx.Process(target=_pusher_main, args=(f"ws://127.0.0.1:{port}/ws", frame_bytes, seconds, out), daemon=True)
            for _ in range(processes)
        ]
        for p in procs:
            p.start()
        while any(p.is_alive() for p in procs):
            await asyncio.sleep(0.05)
        await runner.cleanup()
        first, last = received[1], received[2]
        return received[0] / (last - first) / 1e9 if first is not None and last > first else 0.0

    return asyncio.run(main())


def run_syncer_bench(config: SyncerBenchConfig) -> dict:
    from ddiloco import kernels
    from ddiloco.core import syncer
    from ddiloco.core.config import SyncerConfig
    from ddiloco.net.server import ServerConfig, SyncerServer, use_uvloop

    use_uvloop()  # the daemon's loop (the ceiling's server runs on it too)
    kernels.warmup()
    from ddiloco.net.wire import FRAME_BYTES_MAX_DEFAULT

    ceiling = wire_ceiling(config.learners, FRAME_BYTES_MAX_DEFAULT, config.ceiling_seconds)
    rss_before = _rss_now()
    core_cfg = SyncerConfig(
        num_fragments=config.fragments,
        period=config.fragments,
        merge=config.merge,
        broadcast_codec=config.broadcast_codec,
        learners_max=max(8, config.learners),
        quorum=config.quorum,
    )

    async def main() -> dict:
        server = SyncerServer(syncer.new_state(core_cfg), ServerConfig(port=0, auth_token=TOKEN))
        port = await server.start()
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        url = f"ws://127.0.0.1:{port}/ws"
        procs = [
            ctx.Process(
                target=_learner_main,
                args=(
                    [url],
                    f"bench{i}",
                    config.params,
                    config.fragments,
                    config.codec,
                    config.seconds,
                    config.step_hz,
                    i,
                    out,
                ),
                daemon=True,
            )
            for i in range(config.learners)
        ]
        for p in procs:
            p.start()
        # Measure from the first merge on: start-up (spawn, imports, init) is not ingest.
        while server.state.merges == 0:
            await asyncio.sleep(0.05)
            if not any(p.is_alive() for p in procs):
                raise RuntimeError("every learner process exited before the first merge")
        t0, m0, b0, c0 = (
            time.perf_counter(),
            server.state.merges,
            server.metrics.bytes_in,
            server.metrics.merge_kernel_s,
        )
        p0 = server.metrics.pushes_merged
        o0 = server.metrics.bytes_out
        samples_before = len(server.metrics.round_samples_s)
        while any(p.is_alive() for p in procs):
            await asyncio.sleep(0.1)
        wall = time.perf_counter() - t0
        merges = server.state.merges - m0
        bytes_in = server.metrics.bytes_in - b0
        bytes_out = server.metrics.bytes_out - o0
        kernel_s = server.metrics.merge_kernel_s - c0
        pushes_merged = server.metrics.pushes_merged - p0
        rounds = list(server.metrics.round_samples_s)[samples_before:]
        results = [out.get(timeout=10) for _ in procs]
        await server.stop(checkpoint=False)
        return {
            "merges": merges,
            "pushes_merged": pushes_merged,
            "wall_s": wall,
            "bytes_in": bytes_in,
            "bytes_out": bytes_out,
            "kernel_s": kernel_s,
            "rounds": rounds,
            "learners": results,
            "rejected": dict(server.state.rejections),
        }

    raw = asyncio.run(main())
    rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rss_model = rss_bytes - rss_before  # what the syncer's state and traffic added to the process
    rounds = sorted(raw["rounds"]) or [float("nan")]
    model_bytes = 4 * config.params
    return {
        "config": asdict(config),
        "merges_per_s": raw["merges"] / raw["wall_s"],
        "payload_gbps_in": raw["bytes_in"] / raw["wall_s"] / 1e9,
        "gbps_out": raw["bytes_out"] / raw["wall_s"] / 1e9,
        "bytes_out_per_byte_in": raw["bytes_out"] / max(raw["bytes_in"], 1),
        "wire_ceiling_gbps": ceiling,
        "traffic_over_ceiling": (raw["bytes_in"] + raw["bytes_out"]) / raw["wall_s"] / 1e9 / ceiling
        if ceiling
        else float("nan"),
        "round_p50_ms": 1000 * statistics.median(rounds),
        "round_p99_ms": 1000 * rounds[min(len(rounds) - 1, int(0.99 * len(rounds)))],
        "kernel_share": raw["kernel_s"] / raw["wall_s"],
        "syncer_peak_rss_bytes": rss_bytes,
        "rss_over_fp32_model": rss_bytes / model_bytes,
        "rss_before_bytes": rss_before,
        "added_rss_over_fp32_model": rss_model / model_bytes,
        "merges": raw["merges"],
        # with the learners (each merge goes out to every one), what sets the bytes out per byte in
        "pushes_per_merge": raw["pushes_merged"] / max(raw["merges"], 1),
        "wall_s": raw["wall_s"],
        "rejected": raw["rejected"],
        "pushes": sum(r["pushes"] for r in raw["learners"]),
        # per learner process: a learner whose connection died pushes nothing, and the rest then
        # measure a lighter syncer than the one asked for
        "pushes_per_learner": sorted(r["pushes"] for r in raw["learners"]),
    }


SHARD_START_S_MAX = 300.0  # a shard process that has not listened or merged by then is stuck


def _core_config(config: SyncerBenchConfig, shard: int = 0, shards: int = 1) -> dict:
    """The syncer configuration of the bench (for `core.config.from_mapping`), as shard `shard` of `shards`."""
    return {
        "num_fragments": config.fragments,
        "period": config.fragments,
        "merge": config.merge,
        "broadcast_codec": config.broadcast_codec,
        "learners_max": max(8, config.learners),
        "quorum": config.quorum,
        "shard": shard,
        "shards": shards,
    }


def _shard_main(core: dict, events, start, stop, out) -> None:
    """One syncer shard in a process of its own: says its port, then when it first merged; counts
    its merges and payload bytes between `start` and `stop` (multiprocessing events), and says them."""
    from ddiloco import kernels
    from ddiloco.core import syncer
    from ddiloco.core.config import from_mapping
    from ddiloco.net.server import ServerConfig, SyncerServer, use_uvloop

    use_uvloop()
    kernels.warmup()
    config = from_mapping(core)

    async def main() -> dict:
        server = SyncerServer(syncer.new_state(config), ServerConfig(port=0, auth_token=TOKEN))
        events.put(("port", config.shard, await server.start()))
        while server.state.merges == 0 and not stop.is_set():
            await asyncio.sleep(0.02)
        events.put(("merged", config.shard, None))
        while not start.is_set() and not stop.is_set():
            await asyncio.sleep(0.01)
        t0, m0, b0 = time.perf_counter(), server.state.merges, server.metrics.bytes_in
        while not stop.is_set():
            await asyncio.sleep(0.02)
        wall = time.perf_counter() - t0
        result = {
            "shard": config.shard,
            "merges": server.state.merges - m0,
            "bytes_in": server.metrics.bytes_in - b0,
            "wall_s": wall,
            "versions": [f.version for f in server.state.fragments],
            "owned": list(server.state.owned),
            "rejected": dict(server.state.rejections),
        }
        await server.stop(checkpoint=False)
        return result

    out.put(asyncio.run(main()))


def _sharded_ingest(config: SyncerBenchConfig, shards: int) -> dict:
    """The bench's load against `shards` syncer processes (1: one whole syncer); measured from the
    moment every shard has merged once until the learners stop."""
    ctx = mp.get_context("spawn")
    events, out, learner_out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    start, stop = ctx.Event(), ctx.Event()
    syncers = [
        ctx.Process(target=_shard_main, args=(_core_config(config, i, shards), events, start, stop, out), daemon=True)
        for i in range(shards)
    ]
    for p in syncers:
        p.start()
    learners: list = []
    try:
        ports = dict(_await_events(events, "port", shards))
        urls = [f"ws://127.0.0.1:{ports[i]}/ws" for i in range(shards)]
        # The learners push until the measured window (`config.seconds` from every shard's first
        # merge) ends, however long the shards took to start and merge on a loaded machine.
        learners_stop = ctx.Event()
        args = (config.params, config.fragments, config.codec, SHARD_START_S_MAX + config.seconds, config.step_hz)
        learners = [
            ctx.Process(
                target=_learner_main, args=(urls, f"bench{i}", *args, i, learner_out, learners_stop), daemon=True
            )
            for i in range(config.learners)
        ]
        for p in learners:
            p.start()
        _await_events(events, "merged", shards, alive=learners)
        start.set()
        t0 = time.perf_counter()
        while any(p.is_alive() for p in learners) and time.perf_counter() - t0 < config.seconds:
            time.sleep(0.1)
        learners_stop.set()
        while any(p.is_alive() for p in learners):
            time.sleep(0.1)
        wall = time.perf_counter() - t0
        stop.set()
        per_shard = sorted((out.get(timeout=60) for _ in syncers), key=lambda r: r["shard"])
        pushed = [learner_out.get(timeout=10) for _ in learners]
    finally:
        stop.set()
        for p in (*learners, *syncers):
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for r in per_shard:
        r["merges_per_s"] = r["merges"] / r["wall_s"]
        r["payload_gbps_in"] = r["bytes_in"] / r["wall_s"] / 1e9
    return {
        "shards": shards,
        "wall_s": wall,
        "merges": sum(r["merges"] for r in per_shard),
        "merges_per_s": sum(r["merges"] for r in per_shard) / wall,
        "payload_gbps_in": sum(r["bytes_in"] for r in per_shard) / wall / 1e9,
        "pushes": sum(r["pushes"] for r in pushed),
        "per_shard": per_shard,
    }


def _await_events(events, kind: str, count: int, alive: list | None = None) -> list[tuple[int, object]]:
    """(shard, value) of `count` events of `kind` from the shard processes, or RuntimeError when
    they do not come (the learner processes in `alive` all exited, or SHARD_START_S_MAX passed)."""
    import queue

    got: list[tuple[int, object]] = []
    deadline = time.monotonic() + SHARD_START_S_MAX
    while len(got) < count:
        if time.monotonic() > deadline or (alive is not None and not any(p.is_alive() for p in alive)):
            raise RuntimeError(f"{count - len(got)} syncer shard(s) never reported {kind!r}")
        try:
            what, shard, value = events.get(timeout=0.1)
        except queue.Empty:
            continue
        assert what == kind, (what, kind)
        got.append((shard, value))
    return got


def check_bench_shards(config: SyncerBenchConfig, shards: int) -> None:
    """ValueError unless the bench can split its syncer into `shards` shards (2 or more, at most one per fragment)."""
    from ddiloco.core.shards import check_shard

    wrong = check_shard(0, shards, config.fragments)
    if wrong is not None or shards < 2:
        raise ValueError(wrong or f"a sharded bench compares 1 syncer with 2 or more shards, got {shards}")


def run_sharded_bench(config: SyncerBenchConfig, shards: int) -> dict:
    """The same load against one whole syncer and then against `shards` shards (each its own process)."""
    check_bench_shards(config, shards)
    runs = [_sharded_ingest(config, 1), _sharded_ingest(config, shards)]
    return {"config": asdict(config), "shards": shards, "runs": runs}


def format_shards_report(r: dict) -> str:
    """One whole syncer and N shards side by side: ingest summed over the shards, then each shard's."""
    c = r["config"]
    one, many = r["runs"]
    head = (
        f"{c['learners']} learners, {c['params'] / 1e6:.1f}M params in {c['fragments']} fragments, "
        f"push {c['codec']}, broadcast {c['broadcast_codec']}, {c['merge']}; each syncer or shard a process"
    )
    rows = [
        ("", "1 syncer", f"{many['shards']} shards", "ratio"),
        ("measured", f"{one['wall_s']:.1f} s", f"{many['wall_s']:.1f} s", ""),
        ("pushes", str(one["pushes"]), str(many["pushes"]), _ratio(many["pushes"], one["pushes"])),
        ("merges", str(one["merges"]), str(many["merges"]), _ratio(many["merges"], one["merges"])),
        (
            "merges/s",
            f"{one['merges_per_s']:.2f}",
            f"{many['merges_per_s']:.2f}",
            _ratio(many["merges_per_s"], one["merges_per_s"]),
        ),
        (
            "payload in",
            f"{one['payload_gbps_in']:.3f} GB/s",
            f"{many['payload_gbps_in']:.3f} GB/s",
            _ratio(many["payload_gbps_in"], one["payload_gbps_in"]),
        ),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [head, *("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)]
    for s in many["per_shard"]:
        lines.append(
            f"  shard {s['shard']} (fragments {', '.join(map(str, s['owned']))}): {s['merges_per_s']:.2f} merges/s, "
            f"{s['payload_gbps_in']:.3f} GB/s in, rejected {s['rejected'] or 'none'}"
        )
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def _rss_now() -> int:
    """Resident set size of this process now, in bytes (Linux; 0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * resource.getpagesize()
    except OSError:
        return 0


def _pushing(per_learner: list[int]) -> str:
    """How many learner processes pushed, and the fewest and most pushes of one."""
    live = sum(1 for n in per_learner if n > 0)
    warn = "" if live == len(per_learner) else " (a learner that pushed nothing: its connection failed; see its log)"
    return f"{live} of {len(per_learner)} learners, {min(per_learner)} to {max(per_learner)} pushes each{warn}"


def format_report(r: dict) -> str:
    c = r["config"]
    rows = [
        ("learners", f"{c['learners']}"),
        (
            "params",
            f"{c['params'] / 1e6:.1f}M ({c['fragments']} fragments, push {c['codec']}, broadcast {c['broadcast_codec']}, {c['merge']})",
        ),
        ("measured", f"{r['wall_s']:.1f} s, {r['merges']} merges, {r['pushes']} pushes"),
        ("pushing", _pushing(r["pushes_per_learner"])),
        ("merges/s", f"{r['merges_per_s']:.2f}"),
        (
            "pushes per merge",
            f"{r['pushes_per_merge']:.2f} (quorum {c['quorum']}; each merge goes out to {c['learners']} learners)",
        ),
        ("payload in", f"{r['payload_gbps_in']:.3f} GB/s"),
        (
            "sent out",
            f"{r['gbps_out']:.3f} GB/s ({r['bytes_out_per_byte_in']:.2f} bytes out per byte in)",
        ),
        (
            "wire ceiling",
            (
                f"{r['wire_ceiling_gbps']:.3f} GB/s ({c['learners']} processes pushing to a server that only counts; "
                f"the syncer's in + out is {100 * r['traffic_over_ceiling']:.0f}% of it)"
            ),
        ),
        ("round latency", f"p50 {r['round_p50_ms']:.1f} ms, p99 {r['round_p99_ms']:.1f} ms"),
        ("core share", f"{100 * r['kernel_share']:.1f}% of wall time in merges (kernels + outer step)"),
        (
            "syncer peak RSS",
            f"{r['syncer_peak_rss_bytes'] / 2**20:.0f} MiB = {r['rss_over_fp32_model']:.2f}x the fp32 model "
            f"({r['added_rss_over_fp32_model']:.2f}x above the {r['rss_before_bytes'] / 2**20:.0f} MiB "
            "the process held before the model)",
        ),
        ("rejected", f"{r['rejected'] or 'none'}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


if __name__ == "__main__":  # pragma: no cover - a convenience for profiling
    print(format_report(run_syncer_bench(SyncerBenchConfig(seconds=float(sys.argv[1]) if len(sys.argv) > 1 else 10))))
