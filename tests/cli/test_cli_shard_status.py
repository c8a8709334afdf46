"""`ddiloco status URL URL` in a real process against a syncer split into two shards (real daemons on
127.0.0.1) and a real learner: one summary of both, and a shard that is down shown as down."""

from __future__ import annotations

import json
import subprocess
import sys

from ..learner.conftest import ThreadedSyncer
from ..learner.test_shard_sync import Learner, holding, shard_config, versions

CLI_TIMEOUT_S = 120


def ddiloco(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddiloco.cli", *args], capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False
    )


def merges(syncers) -> int:
    return sum(s.read(lambda state: state.merges) for s in syncers)


def test_status_of_every_shard_in_one_summary_and_a_shard_down_beside_the_others():
    shard0, shard1 = ThreadedSyncer(holding(shard_config(0))), ThreadedSyncer(holding(shard_config(1)))
    a = None
    try:
        a = Learner((shard0.url, shard1.url))
        a.train_until("merges of every fragment", lambda: all(v >= 1 for v in a.sync.versions))
        before, held = merges([shard0, shard1]), [versions(shard0), versions(shard1)]
        done = ddiloco("status", shard1.http, shard0.http, "--json")  # in any order
        after, now = merges([shard0, shard1]), [versions(shard0), versions(shard1)]
        assert done.returncode == 0, done.stderr
        doc = json.loads(done.stdout)
        assert (doc["shards"], doc["shards_down"]) == (2, 0)
        assert before <= doc["merges"] <= after and doc["merges"] >= 4
        assert [s["shard"] for s in doc["per_shard"]] == [0, 1]
        assert [lr["name"] for lr in doc["learners"]] == ["a"]
        assert doc["learners"][0]["status"] == {"0": "live", "1": "live"}
        for f in doc["fragments"]:  # each from its owner, shard q mod 2
            q = f["index"]
            assert f["shard"] == q % 2 and held[q % 2][q] <= f["version"] <= now[q % 2][q], (f, held, now)

        a.sync.close()
        shard1.stop()
        done = ddiloco("status", shard0.http, shard1.http)
        assert done.returncode == 1 and "1 of 2 shards down: " + shard1.http in done.stderr
        lines = done.stdout.splitlines()
        assert lines[0].startswith("sharded syncer: 2 shards, 1 DOWN; merges ")
        assert any(line.split()[:3] == ["1", shard1.http, "DOWN"] and "cannot reach" in line for line in lines)
        assert any(line.split()[:3] == ["0", shard0.http, "up"] for line in lines)
        table = lines[next(i for i, line in enumerate(lines) if line.startswith("fragments: 4")) + 2 :]
        frags = {line.split()[0]: line.split() for line in table}
        assert frags["1"][1:3] == ["1", "down"] and frags["3"][1:3] == ["1", "down"]
        assert frags["0"][1] == "0" and frags["0"][2] == str(versions(shard0)[0])

        shard0.stop()
        done = ddiloco("status", shard0.http, shard1.http)
        assert done.returncode == 1 and "cannot reach any of the 2 shards" in done.stderr and done.stdout == ""
    finally:
        if a is not None:
            a.sync.close()
        shard0.stop()
        shard1.stop()
