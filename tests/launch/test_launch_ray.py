"""`ddiloco.launch.ray` on a real local Ray cluster (127.0.0.1, 2 CPUs): the syncer and two small
learners as actors, merges through the real daemon, and Ray bringing back a killed learner actor
(which rejoins) and a killed syncer actor (which resumes from its checkpoint)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time

import pytest
import ray

from ddiloco.launch.plan import LaunchConfig
from ddiloco.launch.ray import launch
from ddiloco.net import store

pytestmark = pytest.mark.ray

SMALL_LEARNER = ("--steps", "100000", "--batch", "4", "--speed", "0.5")  # trains until shut down


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_ports(n: int) -> int:
    """A port p with p ... p + n - 1 all free on 127.0.0.1 (a sharded syncer listens on port + i)."""
    for _ in range(100):
        first = _free_port()
        if first + n > 65536:
            continue
        with contextlib.ExitStack() as held:
            try:
                for i in range(1, n):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", first + i))
            except OSError:
                continue
        return first
    raise AssertionError(f"no {n} consecutive free ports on 127.0.0.1")


def until(predicate, timeout_s, what):
    """Poll `predicate` (a status read through Ray) until it holds; a read that fails counts as not yet."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception:  # noqa: BLE001 - an actor being restarted, a syncer not listening yet
            value = None
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@pytest.fixture
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield
    ray.shutdown()


def _live(status, name=None):
    return [entry for entry in status["learners"] if entry["status"] == "live" and name in (None, entry["name"])]


def test_ray_launch_survives_a_killed_learner_and_a_killed_syncer(tmp_path, local_ray, self_signed_cert, jax_cache_dir):
    cert, key = self_signed_cert
    config = LaunchConfig(
        learners=2,
        checkpoint_dir=tmp_path / "ck",
        log_dir=tmp_path / "logs",
        token=secrets.token_hex(16),
        host="127.0.0.1",
        port=_free_port(),
        tls_cert=cert.read_bytes(),
        tls_key=key.read_bytes(),
        tls_ca=cert.read_bytes(),
        # Ray kills an actor's children with it: a killed syncer resumes from its last periodic checkpoint.
        syncer_args=("--fragments", "2", "--period", "2", "--checkpoint-every-merges", "5"),
        learner_args=(*SMALL_LEARNER, "--cache-dir", str(jax_cache_dir)),
        syncer_cpus=0.5,
        learner_cpus=0.5,  # three actors on a 2-CPU cluster
    )
    job = launch(config)
    try:
        assert job.syncer_url.startswith("wss://127.0.0.1:") and job.status_url.startswith("https://")
        status = until(
            lambda: (s := job.status())["merges"] >= 2 and len(_live(s)) == 2 and s, 240, "two live learners merging"
        )
        assert {entry["name"] for entry in _live(status)} == {"learner-0", "learner-1"}

        # A learner actor killed: Ray starts it again, and its learner rejoins the syncer by itself.
        before = ray.get(job.learners[0].pid.remote())
        ids_before = {entry["id"] for entry in status["learners"] if entry["name"] == "learner-0"}
        ray.kill(job.learners[0], no_restart=False)
        after = until(
            lambda: (pid := ray.get(job.learners[0].pid.remote(), timeout=60)) != before and pid, 120, "a new actor"
        )
        assert after != before
        merges = job.status()["merges"]
        rejoined = until(
            lambda: (
                (s := job.status())["merges"] > merges
                and [e for e in _live(s, "learner-0") if e["id"] not in ids_before]
                and s
            ),
            240,
            "learner-0 rejoined under a new id, and merges going on",
        )
        assert len(_live(rejoined)) == 2

        # The syncer actor killed: it comes back on the same address, resumes from its newest
        # checkpoint (at most 5 merges old, and those pushes are lost), and the learners reconnect.
        syncer_pid = ray.get(job.syncer.address.remote())["pid"]
        merged = job.status()["merges"]
        ray.kill(job.syncer, no_restart=False)
        where = until(
            lambda: (a := ray.get(job.syncer.address.remote(), timeout=60))["pid"] != syncer_pid and a,
            180,
            "a new syncer actor",
        )
        assert where["resumed"] and where["url"] == job.syncer_url
        resumed_at = int(
            re.findall(r"resumed from ckpt-\S+: (\d+) merges", (tmp_path / "logs" / "syncer.log").read_text())[-1]
        )
        assert resumed_at >= merged - 10  # the newest checkpoint, or the one before it if the kill cut a write short
        resumed = until(
            lambda: (s := job.status())["merges"] >= merged + 2 and len(_live(s)) == 2 and s,
            240,
            "merges after the syncer's restart",
        )
        assert resumed["merges"] >= merged + 2
    finally:
        job.shutdown()
    syncer_log = (tmp_path / "logs" / "syncer.log").read_text()
    assert "resumed from ckpt-" in syncer_log and syncer_log.count("TLS: https, wss") == 2
    for i in range(2):  # each learner's last run ended on the launcher's SIGTERM: a goodbye and its summary
        last = (tmp_path / "logs" / f"learner-{i}.log").read_text().strip().splitlines()[-1]
        assert json.loads(last)["learner"] >= 1
    assert ("wss" in job.syncer_url) and config.token not in syncer_log


def test_the_launch_ray_command_runs_a_job_to_its_end_and_stops_it_cleanly(tmp_path, jax_cache_dir):
    """`ddiloco launch ray` as a user runs it: its own local Ray cluster, one learner with a small
    step budget; it waits for the learner, then stops the syncer, which writes a last checkpoint."""
    from ddiloco.net.auth import write_token_file

    write_token_file(tmp_path / "token", secrets.token_hex(16))
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "DDILOCO_"))}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddiloco.cli",
            "launch",
            "ray",
            "--learners",
            "1",
            "--token-file",
            str(tmp_path / "token"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--checkpoint-dir",
            "ck",
            "--log-dir",
            "logs",
            "--syncer-cpus",
            "0.5",
            "--learner-cpus",
            "0.5",
            "--syncer-args=--fragments 2 --period 2",
            f"--learner-args=--steps 12 --batch 4 --cache-dir {jax_cache_dir}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    first, last = json.loads(lines[0]), json.loads(lines[-1])  # where the job runs; how it ended
    assert first["syncer"] == f"ws://127.0.0.1:{port}/ws" and first["logs"] == str(tmp_path / "logs")
    assert last["merges"] > 0 and last["global_step"] >= 12
    assert "signal received: writing a last checkpoint" in (tmp_path / "logs" / "syncer.log").read_text()
    assert store.newest_valid(tmp_path / "ck")[0].merges > 0
    learner = json.loads((tmp_path / "logs" / "learner-0.log").read_text().strip().splitlines()[-1])
    assert learner["last_step"] >= 12  # its summary: it spent its step budget and exited 0


def test_a_ray_launch_of_a_syncer_in_two_shards_runs_to_its_end(tmp_path, local_ray, jax_cache_dir):
    """`launch(LaunchConfig(shards=2))`: two shard actors on port and port + 1, each with its own
    checkpoint directory and log; two learners with a small step budget dial both, and each shard
    merges their pushes of its own fragments until the learners have spent their budget."""
    steps = 20  # about 10 pushes of each fragment per learner at period 2: merges on both shards
    port = _free_ports(2)
    config = LaunchConfig(
        learners=2,
        checkpoint_dir=tmp_path / "ck",
        log_dir=tmp_path / "logs",
        token=secrets.token_hex(16),
        host="127.0.0.1",
        port=port,
        shards=2,
        syncer_args=("--fragments", "4", "--period", "2"),
        learner_args=("--steps", str(steps), "--batch", "4", "--cache-dir", str(jax_cache_dir)),
        syncer_cpus=0.5,
        learner_cpus=0.5,  # four actors on a 2-CPU cluster
    )
    job = launch(config)
    try:
        assert job.syncer_urls == [f"ws://127.0.0.1:{port}/ws", f"ws://127.0.0.1:{port + 1}/ws"]
        assert [ray.get(s.address.remote())["shard"] for s in job.syncers] == [0, 1]
        assert job.wait(timeout_s=300) == [0, 0]  # both learners spent their budget and exited 0
        status = job.status()  # the shards' merged /status, read through their actors
    finally:
        job.shutdown()
    assert (status["shards"], status["shards_down"]) == (2, 0), status["per_shard"]
    assert all(row["up"] and row["merges"] > 0 for row in status["per_shard"]), status["per_shard"]
    assert [(f["index"], f["shard"]) for f in status["fragments"]] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    assert all(f["up"] and f["version"] >= 1 for f in status["fragments"]), status["fragments"]
    for i in range(2):
        log = (tmp_path / "logs" / f"syncer-{i}.log").read_text()
        # each learner joined each shard (under that shard's own learner id), and the shard stopped cleanly
        for name in ("learner-0", "learner-1"):
            assert re.search(rf"learner \d+ \({name}\) joined", log), log[-3000:]
        assert "signal received: writing a last checkpoint" in log
        state, _ = store.newest_valid(tmp_path / "ck" / f"shard-{i}")  # its own directory, its own fragments
        assert (state.config.shard, state.config.shards) == (i, 2) and state.merges > 0
        assert state.owned == (i, i + 2)
        # Its summary: the budget spent. Whether a learner applied a merged version within its few
        # steps depends on the machine's load (the merges above show both shards merging and sending
        # versions out; tests/cli/test_cli_shards_end_to_end.py checks that learners apply them).
        learner = json.loads((tmp_path / "logs" / f"learner-{i}.log").read_text().strip().splitlines()[-1])
        assert learner["steps"] == steps, learner
    assert config.token not in (tmp_path / "logs" / "syncer-0.log").read_text()
