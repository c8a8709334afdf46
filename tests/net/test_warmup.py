"""A restarted syncer's way back: it listens before numba is imported, nothing waits for the kernels'
warm-up (a merge that comes first reports no loading as its cost), and the warm-up loads the kernels
the syncer's merges run."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import numpy as np
import pytest

from ddiloco.core import codec, syncer
from ddiloco.core.config import SyncerConfig
from ddiloco.core.events import Push
from ddiloco.core.grace import Timing
from ddiloco.core.layout import TensorSpec, build_layout
from ddiloco.net import session
from ddiloco.net.client import ClientConfig, SyncerClient
from ddiloco.net.server import ServerConfig, SyncerServer
from ddiloco.net.warmup import FIRST_CODECS, syncer_warmup

from ..waiting import until as wait_until

TOKEN = "test-token-0123456789abcdef"
TENSORS = (
    TensorSpec("embed", (64, 8), embedding=True),
    TensorSpec("blocks/0/w", (8, 32)),
    TensorSpec("blocks/1/w", (8, 32)),
    TensorSpec("head", (8, 16)),
)
CONFIG = SyncerConfig(num_fragments=2, period=2)
WAIT_S_MAX = 60.0  # a bound on each wait below, never a timing that is asserted
SYNC_S_RESUMED = 1e-9  # a merge cost estimate below any real merge's
HOLD_S_MAX = 900.0  # the fake warm-up's bound: released by the test long before (a busy machine is slow)


async def until(predicate, what: str) -> None:
    await wait_until(predicate, WAIT_S_MAX, what)


def resumed_state() -> syncer.SyncerState:
    """A syncer that holds parameters, as one resumed from a checkpoint does."""
    layout = build_layout(TENSORS, CONFIG.num_fragments, CONFIG.strategy, CONFIG.block)
    params = [np.linspace(-1, 1, f.padded_size, dtype=np.float32) for f in layout.fragments]
    return syncer.new_state(CONFIG, layout, params)


async def test_hellos_progress_and_merges_go_ahead_of_the_warmup_and_its_loading_widens_no_grace(tmp_path):
    release = threading.Event()
    state = resumed_state()
    state.timing = Timing(step_s=0.1, quorum_s=0.01, sync_s=SYNC_S_RESUMED)  # as a checkpoint holds it
    server = SyncerServer(state, ServerConfig(auth_token=TOKEN, checkpoint_dir=tmp_path / "ckpt"))
    await server.start()
    warmup = server.start_warmup([lambda: release.wait(HOLD_S_MAX)])  # a warm-up that takes its time
    client = SyncerClient(ClientConfig(url=f"ws://127.0.0.1:{server.port}/ws", name="a", tensors=TENSORS, token=TOKEN))
    running = asyncio.create_task(client.run())
    try:
        await asyncio.wait_for(client.welcomed.wait(), WAIT_S_MAX)
        await until(lambda: len(client.inbox.updates) == CONFIG.num_fragments, "the resumed fragments")
        assert not server.warmed_up.is_set()  # welcomed and sent every fragment with the warm-up still running
        learner = client.inbox.welcome.learner
        step = client.inbox.welcome.global_step

        async def merge_one() -> None:
            nonlocal step
            merges = server.state.merges
            while True:  # progress makes it live and opens rounds
                step += 1
                versions = tuple(chain[-1].version for _, chain in sorted(client.inbox.updates.items()))
                client.queue_progress(session.ProgressInfo(step, versions, (1, 1), (64, 64)))
                await until(lambda at=step: server.state.global_step == at, "the global step")
                opened = [p for p, f in enumerate(server.state.fragments) if f.open is not None]
                if opened:
                    break
            fragment = opened[0]
            size = server.state.layout.fragments[fragment].padded_size
            payload = codec.parse(codec.encode(np.full(size, 0.01, np.float32), "int4"))
            steps = server.shell.steps  # the core's events so far: the push is the next, its MergeCost the one after
            client.queue_push(Push(learner, fragment, step, versions[fragment], 1, 64, payload))
            await until(lambda: server.state.merges == merges + 1, "a merge")
            await until(lambda: server.shell.steps >= steps + 2, "the merge's cost")

        await merge_one()
        assert not server.warmed_up.is_set()  # merged with the warm-up still running ...
        # ... and its cost, which may be the kernels' loading, counts no more than the estimate
        assert server.state.timing.sync_s == pytest.approx(SYNC_S_RESUMED, rel=1e-6)
        release.set()
        warmup.join(WAIT_S_MAX)
        await merge_one()
        assert server.state.timing.sync_s > 2 * SYNC_S_RESUMED  # a merge's real cost, once warmed up
    finally:
        release.set()
        await client.close()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await server.stop()


def test_a_failing_warmup_lets_the_merges_go_on(tmp_path):
    async def run() -> None:
        server = SyncerServer(resumed_state(), ServerConfig(checkpoint_dir=tmp_path / "ckpt"))
        await server.start()

        def broken() -> None:
            raise RuntimeError("a bug in the warm-up")

        server.start_warmup([broken]).join(WAIT_S_MAX)
        assert server.warmed_up.is_set()
        await server.stop()

    asyncio.run(run())


def test_the_warmup_stages_follow_the_push_codecs():
    layout = build_layout(TENSORS, CONFIG.num_fragments, CONFIG.strategy, CONFIG.block)
    assert len(syncer_warmup(CONFIG, layout)) == 2  # the default codec first, the other accepted ones after
    only = SyncerConfig(num_fragments=2, period=2, push_codecs=FIRST_CODECS)
    assert len(syncer_warmup(only, layout)) == 1
    assert len(syncer_warmup(CONFIG, None)) == 1  # no layout yet: every kernel, in one stage


# In a child process: what the syncer daemon imports up to listening, and the kernels its first
# warm-up stage loads (a child, because this test process has imported numba and jax long ago).
_LISTENING = """
import asyncio, sys
from ddiloco.cli import SUBCOMMANDS, build_parser
build_parser("syncer")
from ddiloco.cli import syncer as cli_syncer
from ddiloco import kernels
from ddiloco.core import checkpoint, syncer
from ddiloco.core.config import SyncerConfig
from ddiloco.net import server, store, auth, warmup

async def main():
    daemon = server.SyncerServer(syncer.new_state(SyncerConfig()), server.ServerConfig())
    await daemon.start()
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})
    others = sorted(m for m, _ in SUBCOMMANDS.values() if m in sys.modules and m != "ddiloco.cli.syncer")
    await daemon.stop()
    print(heavy, others)

asyncio.run(main())
"""

_FIRST_STAGE = """
import json
import numba
from ddiloco.core.config import SyncerConfig
from ddiloco.core.layout import TensorSpec, build_layout
from ddiloco.kernels import _lowbit, _segments
from ddiloco.net.warmup import syncer_warmup
tensors = [TensorSpec("w%d" % i, (256, 512)) for i in range(4)]
config = SyncerConfig(num_fragments=2)
syncer_warmup(config, build_layout(tensors, 2, config.strategy, config.block))[0]()
def loaded(module):
    return sorted(n for n, f in vars(module).items() if isinstance(f, numba.core.dispatcher.Dispatcher) and f.signatures)
print(json.dumps([loaded(_segments), loaded(_lowbit)]))
"""


def _child(script: str) -> str:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_daemon_listens_before_numba_or_any_heavy_import():
    heavy = {"numba", "llvmlite", "scipy", "jax", "optax", "matplotlib", "rich", "pandas", "ray"}
    assert _child(_LISTENING.replace("{heavy!r}", repr(heavy))) == "[] []"


def test_the_first_stage_loads_the_int4_merge_and_not_the_learners_encoders():
    segments, lowbit = json.loads(_child(_FIRST_STAGE))
    assert any("int4" in name for name in segments), segments  # RDA over int4 pushes
    assert not any(name.startswith("_quantize") for name in lowbit), lowbit  # the learners' encoders
