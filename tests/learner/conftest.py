"""The real syncer daemon on its own event loop in a thread, as it runs beside a training process."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from ddiloco.core import syncer
from ddiloco.core.config import SyncerConfig
from ddiloco.net.server import ServerConfig, SyncerServer

TOKEN = "learner-test-token-0123456789"
DEADLINE_S = 120


class ThreadedSyncer:
    def __init__(self, config: SyncerConfig | syncer.SyncerState, token: str = TOKEN, **server_fields):
        self.loop = asyncio.new_event_loop()
        state = config if isinstance(config, syncer.SyncerState) else syncer.new_state(config)
        self.server = SyncerServer(state, ServerConfig(**{"port": 0, "auth_token": token, **server_fields}))
        self._stopped = False
        ready = threading.Event()

        def main():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.server.start())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        assert ready.wait(30)
        self.url = f"ws://127.0.0.1:{self.server.port}/ws"
        self.http = f"http://127.0.0.1:{self.server.port}"

    def read(self, fn):
        """fn(state), run on the syncer's loop so it sees a consistent state."""

        async def call():
            return fn(self.server.state)

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(30)

    def wait_for(self, what, fn):
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            got = self.read(fn)
            if got:
                return got
            time.sleep(0.05)
        raise AssertionError(f"syncer: no {what} within {DEADLINE_S} s")

    def stop(self):
        if self._stopped:
            return
        self._stopped = True
        asyncio.run_coroutine_threadsafe(self.server.stop(checkpoint=False), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@pytest.fixture
def threaded_syncer():
    """A factory: `threaded_syncer(config_or_state_or_None, token=..., server=dict(...), **config_fields)`;
    stopped at the end."""
    made: list[ThreadedSyncer] = []

    def make(config=None, token: str = TOKEN, server: dict | None = None, **fields) -> ThreadedSyncer:
        s = ThreadedSyncer(config if config is not None else SyncerConfig(**fields), token, **(server or {}))
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()
