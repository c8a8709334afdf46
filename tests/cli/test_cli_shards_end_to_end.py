"""A syncer split into two shards, as a user runs it: two `ddiloco syncer --shard I --shards 2`
processes and two `ddiloco learner` processes dialling both. Shard 1 is killed (SIGKILL) while they
train and restarted with `--resume` on its own checkpoint directory and port; `ddiloco status` over
both URLs is read while it is down and once it is back. Real processes, real files, 127.0.0.1."""

from __future__ import annotations

import json
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from ddiloco.net import store
from ddiloco.net.auth import write_token_file

WAIT_S_MAX = 240  # bound of every wait below: learners compile and join on a loaded 2-core machine
POLL_S = 0.25  # each poll is an HTTP request to a syncer sharing the cores with the learners
CLI_TIMEOUT_S = 120
FRAGMENTS = 4  # shard 0 owns fragments 0 and 2, shard 1 owns 1 and 3
MERGES_WHILE_DOWN = 4  # shard 0's merges awaited while shard 1 is down: both its fragments, twice
RESUMED = re.compile(r"resumed from (ckpt-\S+): (\d+) merges")
ROUND = re.compile(r"fragment (\d+) round (\d+): ")
SENT_INIT = re.compile(r"sent the initial parameters \(version 0\) of fragments \[([\d, ]+)\]")


def wait_for(predicate, what: str, timeout_s: float = WAIT_S_MAX):
    """Poll `predicate` until it returns something true, and return that; a shard that does not
    answer (not listening yet, being restarted) counts as not yet. Fails naming `what`."""
    deadline = time.monotonic() + timeout_s
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            value, last_error = None, exc
        if value:
            return value
        time.sleep(POLL_S)
    raise AssertionError(f"no {what} within {timeout_s} s (last error: {last_error})")


def status(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as r:
        return json.loads(r.read())


def versions(doc: dict) -> dict[int, int]:
    """fragment -> version, of the fragments this shard's /status document holds (its own)."""
    return {f["index"]: f["version"] for f in doc["fragments"]}


def ddiloco(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddiloco.cli", *args], capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False
    )


def drain(proc: subprocess.Popen, sink: list) -> threading.Thread:
    """Read a child's stderr on a thread so that it never blocks on a full pipe; the thread ends
    once the child has exited and its last line is in `sink`."""
    thread = threading.Thread(target=lambda: sink.extend(proc.stderr), daemon=True)
    thread.start()
    return thread


def shard(i: int, token: Path, port: int, *where: str) -> tuple[subprocess.Popen, int, list[str]]:
    """`ddiloco syncer` shard i of 2 in a real process, on `port` (0: a free one), checkpointing or
    resuming as `where` says; returns (process, port it listens on, its log lines so far)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddiloco.cli",
            "syncer",
            "--port",
            str(port),
            "--auth-token-file",
            str(token),
            "--shard",
            str(i),
            "--shards",
            "2",
            "--fragments",
            str(FRAGMENTS),
            "--period",
            "4",
            # shard 1 has checkpoints before it is killed, and resumes from the newest
            "--checkpoint-every-merges",
            "2",
            *where,
        ],  # fmt: skip
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    deadline = time.monotonic() + WAIT_S_MAX
    while time.monotonic() < deadline:  # bounded between lines; a process that ends ends the loop
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if m := re.search(r"listening on 127\.0\.0\.1:(\d+)", line):
            return proc, int(m[1]), lines
    proc.kill()
    raise AssertionError(f"syncer shard {i} did not start:\n" + "".join(lines))


def learner(i: int, urls: str, token: Path, cache_dir: Path) -> subprocess.Popen:
    # A budget far beyond what the test needs: each learner trains until the SIGTERM at the end (its
    # clean stop: the step finished, a goodbye, exit 0), which the test sends once it has seen what
    # it waits for, however slowly a loaded machine gets there.
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddiloco.cli",
            "learner",
            "--syncer",
            urls,
            "--token-file",
            str(token),
            "--shard",
            f"{i}/2",
            "--seed",
            str(i),
            "--steps",
            "1000000",
            "--batch",
            "4",
            "--speed",
            "0.25",
            "--cache-dir",
            str(cache_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def first_rounds(log: list[str]) -> dict[int, int] | None:
    """fragment -> the first round decided in restarted shard 1's `log`, once both its fragments have one."""
    first: dict[int, int] = {}
    for line in list(log):
        if m := ROUND.search(line):
            first.setdefault(int(m[1]), int(m[2]))
    return first if set(first) == {1, 3} else None


def live(doc: dict) -> list[str]:
    """The names of the learners live on the shard whose /status document `doc` is."""
    return sorted(lr["name"] for lr in doc["learners"] if lr["status"] == "live")


def test_two_shards_two_learners_a_shard_killed_and_resumed_and_status_over_both(tmp_path, jax_cache_dir):
    token = write_token_file(tmp_path / "token", secrets.token_hex(16))
    checkpoints = [tmp_path / "ck-0", tmp_path / "ck-1"]  # each shard's own
    syncers: list[subprocess.Popen] = []
    learners: list[subprocess.Popen] = []
    logs: list[list[str]] = [[], [], []]  # shard 0, shard 1, shard 1 restarted
    learner_logs: list[list[str]] = [[], []]
    readers: list[threading.Thread] = []  # of the learners' logs
    try:
        ports = []
        for i, directory in enumerate(checkpoints):
            proc, port, lines = shard(i, token, 0, "--checkpoint-dir", str(directory))
            logs[i].extend(lines)
            drain(proc, logs[i])
            syncers.append(proc)
            ports.append(port)
        https = [f"http://127.0.0.1:{p}" for p in ports]
        urls = ",".join(f"ws://127.0.0.1:{p}/ws" for p in reversed(ports))  # in any order
        for i in range(2):
            learners.append(learner(i, urls, token, jax_cache_dir))
            readers.append(drain(learners[i], learner_logs[i]))

        def merged_with_a_checkpoint(port, i):
            doc = status(port)
            assert (doc["shard"], doc["shards"], doc["owned"]) == (i, 2, [q for q in range(FRAGMENTS) if q % 2 == i])
            checkpoint = doc["checkpoint"] or {}
            return doc["merges"] >= 4 and len(live(doc)) == 2 and checkpoint.get("merges", 0) >= 2 and doc

        for i, port in enumerate(ports):
            wait_for(lambda port=port, i=i: merged_with_a_checkpoint(port, i), f"merges and a checkpoint on shard {i}")

        # Shard 1 killed outright: no last checkpoint, its connections cut.
        syncers[1].send_signal(signal.SIGKILL)
        assert syncers[1].wait(60) == -signal.SIGKILL
        at_kill = status(ports[0])
        # The other shard goes on merging its own fragments with both learners meanwhile.
        while_down = wait_for(
            lambda: (
                (d := status(ports[0]))["merges"] >= at_kill["merges"] + MERGES_WHILE_DOWN
                and all(v > versions(at_kill)[q] for q, v in versions(d).items())
                and len(live(d)) == 2
                and d
            ),
            f"{MERGES_WHILE_DOWN} merges of shard 0 (of both its fragments) while shard 1 is down",
        )
        assert syncers[1].poll() is not None  # still down: those merges were shard 0's alone

        down = ddiloco("status", https[0], https[1])
        assert down.returncode == 1, down.stdout + down.stderr
        assert f"1 of 2 shards down: {https[1]}" in down.stderr, down.stderr
        lines = down.stdout.splitlines()
        assert lines[0].startswith("sharded syncer: 2 shards, 1 DOWN; merges "), down.stdout
        assert any(line.split()[:3] == ["0", https[0], "up"] for line in lines), down.stdout
        assert any(line.split()[:3] == ["1", https[1], "DOWN"] and "cannot reach" in line for line in lines), (
            down.stdout
        )
        down_json = ddiloco("status", https[1], https[0], "--json")
        assert down_json.returncode == 1, down_json.stderr
        doc = json.loads(down_json.stdout)
        assert (doc["shards"], doc["shards_down"]) == (2, 1)
        assert [(s["shard"], s["up"]) for s in doc["per_shard"]] == [(0, True), (1, False)]
        assert doc["merges"] >= while_down["merges"]  # shard 0's alone
        for f in doc["fragments"]:
            assert f["shard"] == f["index"] % 2 and f["up"] == (f["index"] % 2 == 0), f
            if f["up"]:
                assert f["version"] >= versions(while_down)[f["index"]], (f, while_down)

        # What shard 1 resumes from: the newest checkpoint intact in its directory (the kill may have
        # cut the last write short), written before the kill, so versions above 0.
        checkpoint, path = store.newest_valid(checkpoints[1])
        held = {q: checkpoint.fragments[q].version for q in (1, 3)}
        assert checkpoint.merges >= 2 and all(v >= 1 for v in held.values()), (path, held)

        restarted, port, lines = shard(1, token, ports[1], "--resume", str(checkpoints[1]))
        syncers[1] = restarted
        logs[2].extend(lines)
        drain(restarted, logs[2])
        assert port == ports[1]
        (resumed,) = [m.groups() for m in map(RESUMED.search, lines) if m]
        assert resumed == (path.name, str(checkpoint.merges)), lines

        # Merging again from where the checkpoint left: every version of shard 1's fragments past the
        # checkpoint's, the merge count past its, both learners live on it again.
        back = wait_for(
            lambda: (
                (d := status(ports[1]))["merges"] >= checkpoint.merges + 4
                and all(versions(d)[q] > v for q, v in held.items())
                and len(live(d)) == 2
                and d
            ),
            "merges of both of shard 1's fragments after its restart, with both learners live",
        )
        assert (back["shard"], back["shards"], back["owned"]) == (1, 2, [1, 3])
        # Not a fresh start that merged its way past those numbers: the restarted shard's first round
        # of each fragment is numbered past the checkpoint's version (a fresh one opens round 1).
        # (Its log is read on a thread: the lines of those merges may still be on their way.)
        first_round = wait_for(lambda: first_rounds(logs[2]), "the restarted shard's rounds of fragments 1 and 3")
        assert all(first_round[q] > v for q, v in held.items()), (first_round, held)

        # `ddiloco status` over both once both are up: every fragment from its owner, read between
        # two readings of each shard's own /status.
        for port in ports:
            wait_for(lambda port=port: live(status(port)) == ["learner-0", "learner-1"], "both learners live on both")
        before = [status(p) for p in ports]
        both = ddiloco("status", https[1], https[0], "--json")  # in any order
        after = [status(p) for p in ports]
        assert both.returncode == 0, both.stderr
        doc = json.loads(both.stdout)
        assert (doc["shards"], doc["shards_down"]) == (2, 0)
        assert [(s["shard"], s["url"], s["up"]) for s in doc["per_shard"]] == [(0, https[0], True), (1, https[1], True)]
        assert sum(d["merges"] for d in before) <= doc["merges"] <= sum(d["merges"] for d in after)
        assert [f["index"] for f in doc["fragments"]] == list(range(FRAGMENTS))
        for f in doc["fragments"]:
            q, owner = f["index"], f["index"] % 2
            assert f["shard"] == owner and f["up"], f
            assert versions(before[owner])[q] <= f["version"] <= versions(after[owner])[q], (f, before, after)
        assert all(f["version"] > held[f["index"]] for f in doc["fragments"] if f["index"] in held)

        before = [status(p) for p in ports]
        text = ddiloco("status", https[0], https[1])
        after = [status(p) for p in ports]
        assert text.returncode == 0 and text.stderr == "", text.stderr
        lines = text.stdout.splitlines()
        assert lines[0].startswith("sharded syncer: 2 shards, all up; merges "), text.stdout
        for i in range(2):
            assert any(line.split()[:3] == [str(i), https[i], "up"] for line in lines), text.stdout
        table = lines[next(i for i, line in enumerate(lines) if line.startswith("fragments: 4")) + 2 :]
        rows = {int(line.split()[0]): line.split() for line in table}
        assert sorted(rows) == list(range(FRAGMENTS)), text.stdout
        for q, row in rows.items():
            owner = q % 2
            assert row[1] == str(owner), text.stdout
            assert versions(before[owner])[q] <= int(row[2]) <= versions(after[owner])[q], (row, before, after)

        # The learners rode out the outage: each rejoined shard 1 and stops cleanly.
        for proc in learners:
            proc.send_signal(signal.SIGTERM)
        for i, proc in enumerate(learners):
            code = proc.wait(CLI_TIMEOUT_S)
            readers[i].join(CLI_TIMEOUT_S)
            assert code == 0, "".join(learner_logs[i])[-3000:]
            summary = json.loads(proc.stdout.read().strip().splitlines()[-1])  # its only output
            assert summary["applied"] > 0 and summary["steps"] > 0, summary
            assert any("rejoined syncer shard 1 of 2" in line for line in learner_logs[i]), learner_logs[i][-20:]
        # Nor did the restarted shard ask for initial parameters: each fragment's were sent once, at
        # the start, to its owner, by whichever learner that shard asked.
        sent = [
            int(q) for log in learner_logs for line in log if (m := SENT_INIT.search(line)) for q in m[1].split(",")
        ]
        assert sorted(sent) == list(range(FRAGMENTS)), sent
        for proc in syncers:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
    finally:
        for proc in [*learners, *syncers]:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    # Each shard wrote its own checkpoints, under its own run, naming its shard.
    for i, directory in enumerate(checkpoints):
        state, _ = store.newest_valid(directory)
        assert (state.config.shard, state.config.shards) == (i, 2)
    assert store.run_of(store.newest_valid(checkpoints[1])[1]) == store.run_of(path)  # the resumed run went on
    assert not any("Traceback" in line for log in [*logs, *learner_logs] for line in log), logs
