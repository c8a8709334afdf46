"""Recording a real daemon run (127.0.0.1, a free port, real clients) and replaying its tape."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import orjson

from ddiloco.cli import main as cli_main
from ddiloco.core import codec, syncer
from ddiloco.core import tape as tapes
from ddiloco.core.config import SyncerConfig
from ddiloco.core.events import Push
from ddiloco.core.layout import TensorSpec
from ddiloco.net import recording, session, wire
from ddiloco.net.client import ClientConfig, SyncerClient
from ddiloco.net.server import ServerConfig, SyncerServer

from ..waiting import steps_until, until

TENSORS = (TensorSpec("embed", (32, 8), embedding=True), TensorSpec("w", (8, 32)))  # 512 parameters
SMALL = wire.WireLimits(frame_bytes_max=1024)


class Learner:
    """The real client, answering every request with a small seeded outer gradient."""

    def __init__(self, url, name, seed):
        self.client = SyncerClient(ClientConfig(url=url, name=name, tensors=TENSORS, wire=SMALL))
        self.rng = np.random.default_rng(seed)
        self.task = asyncio.create_task(self.client.run())
        self.step = 0

    async def welcome(self):
        await until(lambda: self.client.inbox.welcome is not None, what="welcome")
        w = self.client.inbox.welcome
        self.sizes = [-(-sum(int(np.prod(s)) for _, s, _, _ in f) // 128) * 128 for f in w.layout["fragments"]]
        self.versions = [-1] * len(self.sizes)
        self.step = w.global_step
        if w.needs_init:
            for p, n in enumerate(self.sizes):
                self.client.queue_init(p, codec.encode(self.rng.standard_normal(n).astype(np.float32), "fp32"))
            self.versions = [0] * len(self.sizes)
        return w

    def tick(self):
        box = self.client.inbox
        for p, chain in list(box.updates.items()):
            self.versions[p] = chain[-1].version
        box.updates.clear()
        self.step += 1
        n = len(self.sizes)
        if min(self.versions) >= 0:  # as a learner does: it reports once it holds every fragment
            self.client.queue_progress(session.ProgressInfo(self.step, tuple(self.versions), (1,) * n, (64,) * n))
        w = box.welcome  # the fragments due at this step (protocol 2: nobody asks)
        for p in (q for q, t in enumerate(w.offsets) if self.step % w.period == t and min(self.versions) >= 0):
            vec = (self.rng.standard_normal(self.sizes[p]) * 0.01).astype(np.float32)
            push = Push(w.learner, p, self.step, self.versions[p], 1, 64, codec.parse(codec.encode(vec, "int4")))
            self.client.queue_push(push)

    async def kill(self):
        """Gone without a bye: the task dies, the socket closes under the syncer."""
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def train_until(server, learners, merges):
    async def step():
        for lr in learners:
            lr.tick()
        await until(lambda: server.core.empty(), what="the core to drain")
        await asyncio.sleep(0.01)  # let this step's pushes arrive

    await steps_until(step, lambda: server.state.merges >= merges, f"{merges} merges")


async def test_a_recorded_run_with_a_kill_replays_bit_identically(tmp_path, capsys):
    state = syncer.new_state(SyncerConfig(num_fragments=2, period=2))
    tape = recording.TapeWriter.create(tmp_path / "tape", state, "test")
    server = SyncerServer(state, ServerConfig(port=0, wire=SMALL), tape=tape)
    await server.start()
    url = f"ws://127.0.0.1:{server.port}/ws"
    a, b = Learner(url, "a", 1), Learner(url, "b", 2)
    await a.welcome()
    await until(lambda: server.state.holds_parameters, what="initial parameters")
    await b.welcome()
    await train_until(server, [a, b], 3)
    await b.kill()
    await until(
        lambda: any(r.status is syncer.LearnerStatus.GONE for r in server.state.learners.values()), what="b gone"
    )
    await train_until(server, [a], 5)
    b = Learner(url, "b", 3)  # a new process under the same name
    await b.welcome()
    await train_until(server, [a, b], 8)
    # Every message carries clocks: the syncer's reached the learners, the learners' the syncer.
    assert a.client.clock.get("syncer") > 0 and a.client.clock.get("a") > 0
    assert server.vclock.get("a") > 0 and server.vclock.get("b") > 0
    await a.kill()
    await b.kill()
    await server.stop(checkpoint=False)
    final = syncer.state_hash(server.state)

    recorded = recording.read(tmp_path / "tape")
    kinds = {r["kind"] for r in recorded.events}
    assert {"Join", "InitFragment", "Progress", "Push", "Disconnect", "MergeCost"} <= kinds
    assert recorded.close["state_hash"] == final
    assert [r["clock"]["syncer"] for r in recorded.events] == list(range(1, len(recorded.events) + 1))

    rc = cli_main(["replay", str(tmp_path / "tape"), "--json", str(tmp_path / "result.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "OK: bit-identical" in out
    doc = orjson.loads((tmp_path / "result.json").read_bytes())
    assert doc["ok"] and doc["final_checked"] and doc["merges_checked"] == server.state.merges >= 8
    assert doc["state_hash"] == final

    # The same tape with one pushed payload damaged: exit 1, the push named.
    push = next(r for r in recorded.events if r["kind"] == "Push")
    stored = tmp_path / "tape" / tapes.PAYLOAD_DIR / push["fields"]["payload"]["$payload"]["sha256"]
    stored.write_bytes(stored.read_bytes()[::-1])
    assert cli_main(["replay", str(tmp_path / "tape")]) == 1
    assert f"DIVERGED at event {push['i']} (#{push['i']} Push" in capsys.readouterr().out


def test_replay_of_a_bad_tape_exits_non_zero_with_the_reason(tmp_path, capsys):
    (tmp_path / tapes.TAPE_FILE).write_bytes(b"not a tape at all, no")
    assert cli_main(["replay", str(tmp_path)]) == 2
    assert "not a ddiloco tape" in capsys.readouterr().err


async def syncer_merges(http: aiohttp.ClientSession, port: int) -> int:
    """The daemon's own count of merges, from its read-only /status."""
    async with http.get(f"http://127.0.0.1:{port}/status") as response:
        assert response.status == 200, f"/status answered {response.status}"
        return (await response.json())["merges"]


async def syncer_merges_at_least(http: aiohttp.ClientSession, port: int, merges: int) -> bool:
    return await syncer_merges(http, port) >= merges


async def test_ddiloco_syncer_record_flag_writes_a_tape_that_replays(tmp_path, capsys):
    import re
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddiloco.cli",
            "syncer",
            "--port",
            "0",
            "--fragments",
            "2",
            "--period",
            "2",
            "--record",
            str(tmp_path / "tape"),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        loop = asyncio.get_running_loop()
        port = None
        while port is None:
            line = await asyncio.wait_for(loop.run_in_executor(None, proc.stderr.readline), 60)
            assert line, "the syncer exited before listening"
            m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else None
        a = Learner(f"ws://127.0.0.1:{port}/ws", "a", 1)
        await a.welcome()

        # Train until the daemon says it merged (a loaded machine may need many ticks for the first
        # merge), so that the tape has a merge for the replay to check.
        async def tick():
            a.tick()
            await asyncio.sleep(0.02)  # a step's time: this tick's pushes arrive

        async with aiohttp.ClientSession() as http:
            await steps_until(tick, lambda: syncer_merges_at_least(http, port, 1), "merge the daemon reports")
        await a.kill()
    finally:
        proc.send_signal(signal.SIGTERM)
        await loop.run_in_executor(None, proc.wait, 30)
    assert proc.returncode == 0
    recorded = recording.read(tmp_path / "tape")
    assert recorded.header["start"] == {"kind": "empty", "source": "no parameters"} and recorded.close is not None
    assert cli_main(["replay", str(tmp_path / "tape"), "--json", str(tmp_path / "r.json")]) == 0
    assert "OK: bit-identical" in capsys.readouterr().out
    doc = orjson.loads((tmp_path / "r.json").read_bytes())
    assert doc["final_checked"] and doc["merges_checked"] >= 1
