"""One learner over several JAX processes (learner/multihost.py), with a real syncer on 127.0.0.1.

In this pytest process (one JAX process, one CPU device): the step header, the held transport, the
watchdog, a failed collective, and `MultiProcessSync` over one process against a real syncer (the
leader's host view, the fragments it sets, a quiet step that returns the parameters untouched).

Across processes: a learner of two JAX processes with two CPU devices each (parameters sharded over
all four) and an ordinary learner, as child Pythons started on this file (`python test_multihost.py
process I ...` or `plain ...`; a child cannot import a test module, but it can run this file as a
script). Both learners' pushes merge; then one process of the two-process learner is killed
(process 1; the leader keeps the connection): the other exits with LearnerProcessLost's message within the collective timeout, the syncer sees that
learner leave, and it goes on merging the ordinary learner's pushes.

The ordinary learner starts training only once the two-process learner has merged: with quorum 1 the
fastest learner opens the rounds, and a loaded machine once let it run thousands of rounds ahead
while every push of the slower two-process learner arrived after its round had closed (late).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddiloco.core import syncer
from ddiloco.core.config import SyncerConfig
from ddiloco.core.layout import build_layout
from ddiloco.errors import UserError
from ddiloco.learner import multihost
from ddiloco.learner.multihost import (
    EXIT_LEARNER_LOST,
    HEADER_FLAG_UPDATES,
    HeldTransport,
    LearnerProcessLost,
    MultiProcessSync,
    StepHeader,
    check_process_args,
)
from ddiloco.learner.sync import SyncConfig
from ddiloco.learner.tree import TreeFragments, tensor_specs

TOKEN = "learner-test-token-0123456789"  # tests/learner/conftest.py's
PROCESS_DEVICES = 2
# The surviving process must be gone within this: the named bound plus start-up slack of its exit.
EXIT_BOUND_S = multihost.COLLECTIVE_TIMEOUT_S + 30
CHILD_DEADLINE_S = 240  # a child that is never stopped ends by itself (a failed test leaves nothing behind)


def model(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "embed": jnp.asarray(rng.standard_normal((16, 4)), dtype=jnp.float32),
        "blocks": [{"w": jnp.asarray(rng.standard_normal((4, 4)), dtype=jnp.float32)} for _ in range(2)],
        "head": jnp.asarray(rng.standard_normal((4, 8)), dtype=jnp.bfloat16),
    }


# ---- the pieces, in this process ------------------------------------------------------------------


def test_the_step_header_is_a_small_int_vector_and_round_trips():
    header = StepHeader(7, HEADER_FLAG_UPDATES, (True, False, True))
    vector = header.encode()
    assert vector.dtype == np.int32 and vector.shape == (6,)
    back = StepHeader.decode(vector, 3)
    assert (back.step, back.flags, back.gather) == (7, HEADER_FLAG_UPDATES, (True, False, True))
    assert StepHeader.empty(3).shape == vector.shape
    with pytest.raises(AssertionError, match="disagree on the layout"):
        StepHeader.decode(vector, 4)


@pytest.mark.parametrize(
    ("coordinator", "n", "i", "what"),
    [
        ("node0", 2, 0, "HOST:PORT"),
        ("node0:http", 2, 0, "HOST:PORT"),
        ("node0:70000", 2, 0, "HOST:PORT"),
        ("node0:1234", 0, 0, "number of processes"),
        ("node0:1234", 2, 2, "process id"),
        ("node0:1234", 2, -1, "process id"),
    ],
)
def test_bad_process_arguments_are_user_errors(coordinator, n, i, what):
    with pytest.raises(UserError, match=what):
        check_process_args(coordinator, n, i)
    check_process_args("node0:1234", 2, 1)


class FakeTransport:
    """Hands out one prepared `take`; records what the hook sends."""

    def __init__(self, taken: Any, markers: list[int]):
        self.taken, self.markers, self.sent = taken, markers, []

    def take(self):
        return self.taken

    def take_markers(self):
        return self.markers

    def progress(self, item):
        self.sent.append(("progress", item))

    def close(self):
        self.sent.append(("close", None))


def test_the_held_transport_hands_the_hook_exactly_what_the_leader_peeked_at():
    inner = FakeTransport(({}, [], (1, None)), [5])
    held = HeldTransport(inner)
    with pytest.raises(AssertionError, match="before the leader peeked"):
        held.take()
    taken, markers = held.peek()
    assert held.take() is taken and markers == [5]
    assert held.take_markers() == [5] and held.take_markers() == []
    held.progress("p")
    held.close()
    assert inner.sent == [("progress", "p"), ("close", None)]


def test_the_watchdog_calls_its_expiry_once_armed_and_not_when_disarmed():
    fired: list[str] = []
    done = threading.Event()
    dog = multihost._Watchdog(lambda what: (fired.append(what), done.set()))
    try:
        dog.arm(3600, "never")
        dog.disarm()
        dog.arm(0.01, "the step header")
        assert done.wait(30), "the watchdog did not fire"
        assert fired == ["the step header"]
    finally:
        dog.stop()


def test_a_failed_collective_is_the_learner_lost(threaded_syncer, monkeypatch):
    syncer = threaded_syncer(num_fragments=2, period=2, quorum=1)
    sync = MultiProcessSync(model(0), SyncConfig(url=syncer.url, name="mp", token=TOKEN))
    try:

        def gone(_value):  # what a collective raises when a peer's connection closed
            raise jax.errors.JaxRuntimeError("Gloo all-reduce failed: Connection closed by peer")

        monkeypatch.setattr(multihost.multihost_utils, "broadcast_one_to_all", gone)
        with pytest.raises(LearnerProcessLost, match="the step header failed: another process of this learner"):
            sync.step(model(0), tokens=8)
    finally:
        sync.close()


def test_one_process_learner_sets_exactly_the_fragments_the_hook_received(threaded_syncer):
    """process_count() == 1: every collective is a local no-op, the rest is the real path."""
    syncer = threaded_syncer(num_fragments=2, period=2, quorum=1)
    params = model(1)
    config = SyncConfig(url=syncer.url, name="mp", token=TOKEN, progress_interval_s=0, keep_progress=False)
    sync = MultiProcessSync(params, config)
    tree = TreeFragments(params, build_layout(tensor_specs(params), 2))
    update = jax.jit(lambda ps: jax.tree.map(lambda x: (x * 0.99).astype(x.dtype), ps))
    quiet, checked = 0, 0
    try:
        assert sync.is_leader and sync.sync is not None and sync.layout.digest == sync.sync.layout.digest
        deadline = time.monotonic() + 120
        while (sync.fragments_applied < 4 or checked < 2) and time.monotonic() < deadline:
            time.sleep(0.01)  # a step's time: a round's request must reach the learner before the next round opens
            stepped = update(params)
            before = list(sync.sync.versions)
            params = sync.step(stepped, tokens=8)
            arrived = [q for q, (a, b) in enumerate(zip(before, sync.sync.versions)) if a != b]
            if not arrived:
                quiet += params is stepped
                continue
            for q in arrived:  # the values set are the hook's new base as the leaves' dtypes hold it, bit for bit
                want = tree.gather(tree.scatter(params, q, sync.sync.fragments[q].base), q)
                np.testing.assert_array_equal(tree.gather(params, q), want)
                checked += 1
        assert sync.fragments_applied >= 4 and checked >= 2, f"too few fragments arrived: {sync.fragments_applied}"
        assert quiet > 0, "no step returned the parameters untouched"
        assert syncer.read(lambda state: state.merges) > 0
        assert params["head"].dtype == jnp.bfloat16
    finally:
        sync.close()


def test_the_leader_reaches_every_shard_of_a_sharded_syncer(threaded_syncer):
    """With several syncer URLs the leader's link is one client per shard: both shards merge, and
    the fragments each sends are set on the learner's parameters."""
    made = []
    for shard in (0, 1):
        config = SyncerConfig(num_fragments=2, period=2, quorum=1, shard=shard, shards=2)
        start = model(0)
        layout = build_layout(tensor_specs(start), 2, config.strategy, config.block)
        tree = TreeFragments(start, layout)
        made.append(threaded_syncer(syncer.new_state(config, layout, [tree.gather(start, q).copy() for q in range(2)])))
    params = model(1)
    config = SyncConfig(url=tuple(s.url for s in made), name="mp", token=TOKEN, progress_interval_s=0)
    sync = MultiProcessSync(params, config)
    update = jax.jit(lambda ps: jax.tree.map(lambda x: (x * 0.99).astype(x.dtype), ps))
    try:
        assert sync.sync.welcome.shards == 2
        deadline = time.monotonic() + 120
        # Shard i owns fragment i: each merges its own.
        while min(s.read(lambda state, i=i: state.fragments[i].version) for i, s in enumerate(made)) < 1:
            assert time.monotonic() < deadline, f"no merge on both shards: {sync.sync.versions}"
            time.sleep(0.01)
            params = sync.step(update(params), tokens=8)
        assert sync.fragments_applied >= 2
    finally:
        sync.close()


def test_a_multi_process_learner_needs_no_peer_server():
    from ddiloco.net.peer import PeerConfig

    with pytest.raises(UserError, match="peer snapshots"):
        MultiProcessSync(model(0), SyncConfig(url="ws://127.0.0.1:9/ws", name="mp", peer=PeerConfig()))


@pytest.mark.parametrize(
    ("flags", "what"),
    [
        (["--num-processes", "2"], "need --coordinator"),
        (["--process-id", "1"], "need --coordinator"),
        (["--coordinator", "node0"], "HOST:PORT"),
        (["--coordinator", "node0:8476", "--num-processes", "2", "--process-id", "2"], "process id"),
        (["--coordinator", "node0:8476", "--num-processes", "2", "--record", "tape"], "--record and --restore"),
        (["--coordinator", "node0:8476", "--num-processes", "2", "--speed", "0.5"], "--speed"),
    ],
)
def test_the_learner_command_refuses_a_distributed_setup_that_cannot_work(flags, what, capsys):
    """Refused before jax.distributed starts (a process that waited for its peers would hang first)."""
    from ddiloco.cli import main

    assert main(["learner", "--syncer", "ws://127.0.0.1:9/ws", *flags]) == 2
    assert what in capsys.readouterr().err


# ---- across processes -------------------------------------------------------------------------------


def child(args: list[str], log: Path) -> subprocess.Popen:
    """A child Python on this file; its output goes to `log` (a pipe nobody reads could fill and block it)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={PROCESS_DEVICES}"
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), *args],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def merged_tokens(state: Any, name: str) -> int:
    ids = [i for i, r in state.learners.items() if r.name == name]
    return sum(state.ledger.by_learner.get(i, {}).get("merged", 0) for i in ids)


# Killing the leader (process 0) instead also passed once here, but took 94 s, against 44 s: the
# survivor's exit then seems to come from the watchdog at COLLECTIVE_TIMEOUT_S (not checked yet),
# which is over this suite's time budget for one test.
@pytest.mark.parametrize("killed", [1], ids=["other-process-killed"])
def test_a_two_process_learner_merges_and_dies_whole_when_one_process_is_killed(threaded_syncer, tmp_path, killed):
    syncer = threaded_syncer(num_fragments=2, period=2, quorum=1)
    coordinator = f"127.0.0.1:{free_port()}"
    logs = [tmp_path / f"process-{i}.log" for i in range(2)]
    procs = [child(["process", str(i), syncer.url, coordinator], logs[i]) for i in range(2)]
    gate = tmp_path / "plain-may-train"
    plain = child(["plain", syncer.url, str(gate)], tmp_path / "plain.log")  # starts up meanwhile, then waits
    try:
        syncer.wait_for("merge of the two-process learner", lambda s: merged_tokens(s, "multi") > 0)
        gate.touch()
        syncer.wait_for("merge of the ordinary learner", lambda s: merged_tokens(s, "plain") > 0)
        survivor = 1 - killed
        procs[killed].send_signal(signal.SIGKILL)
        try:
            procs[survivor].wait(timeout=EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"process {survivor} still runs {EXIT_BOUND_S} s after process {killed} was killed")
        err = logs[survivor].read_text()
        code = procs[survivor].returncode
        assert code == EXIT_LEARNER_LOST, f"process {survivor} exited {code}:\n{err[-3000:]}"
        assert "another process of this learner is gone" in err, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        syncer.wait_for(
            "the two-process learner gone",
            lambda s: all(r.status.name == "GONE" for r in s.learners.values() if r.name == "multi"),
        )
        after = syncer.read(lambda s: s.merges)
        syncer.wait_for("merges after the kill", lambda s: s.merges >= after + 3)
        assert plain.poll() is None, "the ordinary learner stopped"
    finally:
        for p in [*procs, plain]:
            if p.poll() is None:
                p.kill()
            p.wait()


# ---- the children ---------------------------------------------------------------------------------


def _train(step_fn: Any, params: Any, report: Any) -> None:
    update = jax.jit(lambda ps: jax.tree.map(lambda x: (x * 0.99 + 0.001).astype(x.dtype), ps))
    params = update(update(params))  # compiled on its own outputs too, before any sync
    deadline, steps = time.monotonic() + CHILD_DEADLINE_S, 0
    while time.monotonic() < deadline:
        params = step_fn(update(params))
        steps += 1
        if steps % 20 == 0:
            print(json.dumps(report(steps)), flush=True)
        time.sleep(0.01)


def run_process(index: int, url: str, coordinator: str) -> None:
    """One of the two processes of the learner "multi": parameters sharded over all four devices."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    multihost.initialize_processes(coordinator, 2, index)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    specs = {"embed": PartitionSpec("x"), "blocks": [{"w": PartitionSpec(None, "x")}] * 2, "head": PartitionSpec()}
    host = jax.tree.map(np.asarray, model(0))
    params = jax.tree.map(
        lambda v, spec: jax.make_array_from_callback(v.shape, NamedSharding(mesh, spec), lambda i: v[i]),
        host,
        specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
    try:
        sync = MultiProcessSync(params, SyncConfig(url=url, name="multi", token=TOKEN))
        _train(lambda p: sync.step(p, tokens=16), params, lambda n: {"process": index, "steps": n})
    except LearnerProcessLost as exc:
        multihost.exit_lost(exc)
    sync.close()


def run_plain(url: str, gate: str) -> None:
    """The learner "plain"; it connects once the file `gate` exists (the parent's go)."""
    from ddiloco.learner.sync import DilocoSync

    deadline = time.monotonic() + CHILD_DEADLINE_S
    while not Path(gate).exists():
        if time.monotonic() > deadline:
            sys.exit(f"plain: no go ({gate}) within {CHILD_DEADLINE_S} s")
        time.sleep(0.05)
    with DilocoSync.connect(model(0), SyncConfig(url=url, name="plain", token=TOKEN)) as sync:
        _train(lambda p: sync.step(p, tokens=16), model(0), lambda n: {"plain": n, "versions": sync.versions})


if __name__ == "__main__":
    if sys.argv[1] == "process":
        run_process(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        run_plain(sys.argv[2], sys.argv[3])
