"""One message from an authenticated peer never takes the daemon down.

The real daemon on 127.0.0.1 (a free port) and a real learner over the real client; a second peer
on a raw websocket sends one hostile message (built byte by byte, as a peer that does not go through
`net.messages` can) and must get an error frame back, while the daemon keeps merging the learner's
pushes. The first three are the messages that used to kill the core.
"""

from __future__ import annotations

import asyncio
import json
from typing import Self

import aiohttp
import numpy as np
import pytest

from ddiloco.core import codec, syncer
from ddiloco.core.config import SyncerConfig
from ddiloco.core.events import Push
from ddiloco.core.layout import TensorSpec
from ddiloco.net import messages as msg
from ddiloco.net import session, wire
from ddiloco.net.client import ClientConfig, SyncerClient
from ddiloco.net.fuzz import raw_frames
from ddiloco.net.server import ServerConfig, SyncerServer

from ..waiting import steps_until, until

TOKEN = "test-token-0123456789abcdef"
TENSORS = (
    TensorSpec("embed", (64, 8), embedding=True),
    TensorSpec("blocks/0/w", (8, 32)),
    TensorSpec("head", (8, 16)),
)
LIMITS = wire.WireLimits(frame_bytes_max=1024)
WAIT_S = 20.0  # a bound on each wait, never a timing that is asserted


class Daemon:
    """The daemon, one honest learner that trains, and a raw socket for the hostile peer."""

    async def __aenter__(self) -> Self:
        state = syncer.new_state(SyncerConfig(num_fragments=2, period=2, quorum=1))
        self.server = SyncerServer(state, ServerConfig(port=0, auth_token=TOKEN, wire=LIMITS))
        await self.server.start()
        self.url = f"ws://127.0.0.1:{self.server.port}/ws"
        self.client = SyncerClient(
            ClientConfig(
                url=self.url,
                name="honest",
                tensors=TENSORS,
                token=TOKEN,
                wire=LIMITS,
                progress_interval_s=0,
                close_drain_s=0,
            )
        )
        self.task = asyncio.create_task(self.client.run())
        await asyncio.wait_for(self.client.welcomed.wait(), 20)
        self.rng = np.random.default_rng(0)
        await until(lambda: self.server.state.layout is not None, WAIT_S, "the layout")
        self.sizes = [f.padded_size for f in self.server.state.layout.fragments]
        for p, n in enumerate(self.sizes):
            self.client.queue_init(p, codec.encode(self.rng.standard_normal(n).astype(np.float32), "fp32"))
        self.versions = [0] * len(self.sizes)
        self.step = 0
        await until(lambda: self.server.state.holds_parameters, WAIT_S, "the initial parameters")
        self.http = aiohttp.ClientSession()
        self.ws = await self.http.ws_connect(
            self.url, headers={"Authorization": f"Bearer {TOKEN}"}, max_msg_size=LIMITS.max_msg_size
        )
        self.reassembler = wire.Reassembler(LIMITS, accepted=msg.SYNCER_KINDS)
        self.ids = 100
        return self

    async def __aexit__(self, *exc) -> None:
        await self.ws.close()
        await self.http.close()
        await self.client.close()
        await asyncio.wait_for(self.task, 20)
        await self.server.stop(checkpoint=False)

    async def merges_go_on(self) -> None:
        """The honest learner trains until a round merges its push: the core lives and serves it."""
        state = self.server.state
        before = state.merges
        await steps_until(self._train_step, lambda: state.merges > before, "merge after the hostile message", 30)
        async with self.http.get(f"http://127.0.0.1:{self.server.port}/healthz") as answer:
            assert answer.status == 200

    async def _train_step(self) -> None:
        """One step of the honest learner: take what arrived, report, push the fragments due."""
        box = self.client.inbox
        for p, chain in list(box.updates.items()):
            self.versions[p] = chain[-1].version
        box.updates.clear()
        self.step += 1
        n = len(self.sizes)
        if min(self.versions) >= 0:  # as a learner does: it reports once it holds every fragment
            self.client.queue_progress(session.ProgressInfo(self.step, tuple(self.versions), (1,) * n, (64,) * n))
        welcome = box.welcome  # the fragments due at this step (protocol 2: nobody asks)
        for p in (q for q, t in enumerate(welcome.offsets) if self.step % welcome.period == t):
            vec = self.rng.standard_normal(self.sizes[p]).astype(np.float32) * 0.01
            push = Push(0, p, self.step, self.versions[p], 1, 64, codec.parse(codec.encode(vec, "int4")))
            self.client.queue_push(push)
        await asyncio.sleep(0.02)

    async def send(self, kind: msg.Kind, meta: dict, payload: bytes = b"", *, frames_max: int | None = None) -> None:
        self.ids += 1
        body = json.dumps(meta, separators=(",", ":")).encode()
        for frame in raw_frames(kind, body, payload, message_id=self.ids, limits=LIMITS)[:frames_max]:
            await self.ws.send_bytes(bytes(frame))

    async def hello(self, tensors: list | None = None) -> msg.Welcome:
        rows = tensors if tensors is not None else json.loads(session.tensors_json(TENSORS))
        await self.send(msg.Kind.HELLO, _hello(rows))
        return await self.next(msg.Welcome)

    async def next(self, kind: type) -> msg.Message:
        while True:
            frame = await asyncio.wait_for(self.ws.receive(), 20)
            assert frame.type is aiohttp.WSMsgType.BINARY, frame
            m = self.reassembler.feed(frame.data)
            if isinstance(m, kind):
                return m
            assert not isinstance(m, msg.Error), m


def _hello(rows: list, clock: dict | None = None) -> dict:
    return {
        "name": "hostile",
        "layout_digest": "0" * 64,
        "shard": 0,
        "resume_learner_id": None,
        "held_versions": [],
        "clock": clock or {"hostile": 1},
        "tensors_json": json.dumps(rows),
    }


def _push(fragment: int, elements: int, **fields) -> tuple[dict, bytes]:
    encoded = codec.encode(np.zeros(elements, dtype=np.float32), "fp32")
    meta = {
        "fragment": fragment,
        "step": 1,
        "base_version": 0,
        "steps": 1,
        "tokens": 64,
        "codec": "fp32",
        "block": 1,
        "element_count": elements,
        "clock": {"hostile": 2},
    } | fields
    return meta, encoded[codec.HEADER_BYTES :]


async def test_a_tensor_path_with_a_digit_int_cannot_read_is_refused_as_bad_layout():
    # '²' passes str.isdigit() and int() refuses it: the layout code used to raise a bare ValueError
    # on the core thread, and the core stopped
    async with Daemon() as d:
        rows = [["blocks/\u00b2/w", [8, 32], "float32", False], ["embed", [64, 8], "float32", True]]
        await d.send(msg.Kind.HELLO, _hello(rows))
        err = await d.next(msg.Error)
        assert err.code == msg.ErrorCode.BAD_LAYOUT and err.fatal
        assert "printable ASCII" in err.text and "blocks/" in err.text
        await d.merges_go_on()


@pytest.mark.parametrize("counter", [2**63 - 1, 2**53, 2**52 + 1])
async def test_a_clock_near_the_limit_is_refused_and_the_syncers_clock_keeps_its_room(counter):
    # a clock entry near 2**63 made the syncer's own tick overflow outside any handler
    async with Daemon() as d:
        await d.hello()
        meta = {
            "step": 1,
            "held_versions": [0, 0],
            "fragment_steps": [1, 1],
            "fragment_tokens": [64, 64],
            "clock": {"syncer": counter},
        }
        await d.send(msg.Kind.PROGRESS, meta)
        err = await d.next(msg.Error)
        assert err.code == msg.ErrorCode.BAD_MESSAGE and not err.fatal and "clock" in err.text
        assert d.server.vclock.get("syncer") < 2**52
        await d.merges_go_on()


async def test_a_push_with_tokens_near_2_63_is_refused():
    # the wire allowed it, admission did not check the range token_weight asserts, and the core stopped
    async with Daemon() as d:
        await d.hello()
        meta, payload = _push(0, d.sizes[0], tokens=2**63 - 2)
        await d.send(msg.Kind.PUSH, meta, bytes(payload))
        err = await d.next(msg.Error)
        assert err.code == msg.ErrorCode.BAD_MESSAGE and "Push.tokens" in err.text
        await d.merges_go_on()


async def test_a_progress_that_jumps_a_million_steps_is_refused_and_the_global_step_stays():
    async with Daemon() as d:
        await d.hello()
        await d.merges_go_on()
        step = d.server.state.global_step
        meta = {
            "step": step + 10**6,
            "held_versions": [0, 0],
            "fragment_steps": [1, 1],
            "fragment_tokens": [64, 64],
            "clock": {"hostile": 3},
        }
        await d.send(msg.Kind.PROGRESS, meta)
        err = await d.next(msg.Error)
        assert err.code == msg.ErrorCode.BAD_MESSAGE and "jumps more than" in err.text
        assert d.server.state.global_step < step + 10**6
        await d.merges_go_on()


@pytest.mark.parametrize("kind", [msg.Kind.UPDATE, msg.Kind.WELCOME, msg.Kind.MARKER])
async def test_the_syncers_kinds_from_a_learner_are_refused_by_the_wire(kind):
    async with Daemon() as d:
        await d.hello()
        # a multi-frame update declaring 1 MiB: refused on its first frame, before anything is reserved
        meta = {"fragment": 0, "version": 1, "codec": "fp32", "element_count": 2**18, "clock": {}}
        payload = bytes(4 * 2**18) if kind is msg.Kind.UPDATE else b""
        await d.send(kind, meta if kind is msg.Kind.UPDATE else {"snapshot": 1, "clock": {}}, payload, frames_max=1)
        err = await d.next(msg.Error)
        assert err.code == msg.ErrorCode.UNEXPECTED_KIND and f"{kind.name.lower()} is not accepted" in err.text
        await d.merges_go_on()


@pytest.mark.parametrize("name", ["int4", "int2", "int1"])
async def test_a_push_with_a_negative_block_scale_is_refused_as_bad_shape(name):
    # found by `ddiloco fuzz --seed 109`: the scale passed admission (it is finite), and the merge
    # kernel refused it when the round closed, on the core thread
    async with Daemon() as d:
        await d.hello()
        versions = [f.version for f in d.server.state.fragments]
        await d.send(
            msg.Kind.PROGRESS,
            {
                "step": d.server.state.global_step,
                "held_versions": versions,
                "fragment_steps": [1, 1],
                "fragment_tokens": [64, 64],
                "clock": {"hostile": 2},
            },
        )
        await until(
            lambda: d.server.state.learners[2].status is syncer.LearnerStatus.LIVE, WAIT_S, "the hostile peer live"
        )
        await d.merges_go_on()
        fragment = 0
        raw = bytearray(codec.encode(np.full(d.sizes[fragment], 0.01, dtype=np.float32), name))
        raw[codec.HEADER_BYTES : codec.HEADER_BYTES + 4] = np.float32(-1.0).tobytes()
        parsed = codec.parse(codec.encode(np.zeros(d.sizes[fragment], dtype=np.float32), name))
        meta = {
            "fragment": fragment,
            "step": d.server.state.global_step,
            "base_version": d.server.state.fragments[fragment].version,
            "steps": 1,
            "tokens": 64,
            "codec": name,
            "block": parsed.block,
            "element_count": parsed.elements,
            "clock": {"hostile": 5},
        }
        await d.send(msg.Kind.PUSH, meta, bytes(raw[codec.HEADER_BYTES :]))
        err = await d.next(msg.Error)
        assert err.code == msg.ErrorCode.BAD_SHAPE and "negative block scale" in err.text
        await d.merges_go_on()
