"""`ddiloco status URL` in a real process against the real daemon with real clients."""

from __future__ import annotations

import asyncio
import json
import re
import sys

import aiohttp

from ddiloco.cli.status import render

from ..net.test_daemon import Learner, Syncer, train, two_learners, until

ESCAPING = "evil name <b>"  # the wire refuses control characters in a name (net.messages); this one prints as it is


async def ddiloco(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ddiloco.cli", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    return proc.returncode, out.decode(), err.decode()


async def test_status_prints_a_readable_summary_and_the_raw_json(tmp_path):
    s = Syncer(tmp_path)
    await s.start()
    a, b = await two_learners(s)
    odd = Learner(s.ws_url, ESCAPING, seed=3)
    await odd.welcome()
    await until(lambda: len(odd.client.inbox.updates) == 2, what="the third learner's recovery updates")
    await train(s.server, [a, b, odd], 8)
    await until(lambda: s.server.state.merges >= 4, what="merges")
    await b.stop()
    await until(lambda: any(r.status.value == "gone" for r in s.server.view.learners), what="b gone")

    code, out, err = await ddiloco("status", s.http)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"syncer {s.http}: up ") and ", merges " in lines[0]
    written = r"checkpoint: ok, last written \d+\.\d s ago \(ckpt-\S+\.safetensors, \d+ merges\)"
    assert re.fullmatch(written, lines[1]), lines[1]
    assert any(line.startswith("  ! learner 2 (b) gone, last seen") for line in lines)
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["id", "name", "status"])
    rows = {line.split()[0]: line for line in lines[header + 1 : header + 3]}
    assert set(rows) == {"1", "3"} and " a " in rows["1"] and "live" in rows["1"]
    assert "evil name <b>" in rows["3"] and "\x1b" not in out and "\r" not in out
    assert any(line.startswith("fragments: 2") for line in lines)
    assert sum(1 for line in lines if "fragment " in line and ": merged " in line) >= 1
    fates = [line.split()[0] for line in lines if re.fullmatch(r"  \w+ +\d+ +(\d+\.\d%|-)", line)]
    assert fates == ["merged", "merged_late", "late", "stale", "rejected", "lost", "open"], out

    code, out, err = await ddiloco("status", s.http, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert {lr["name"] for lr in doc["learners"]} == {"a", ESCAPING} and doc["merges"] >= 4

    for lr in (a, odd):
        await lr.stop()
    await s.server.stop()
    code, out, err = await ddiloco("status", s.http)
    assert code == 1 and "fault: cannot reach" in err and out == ""
    code, out, err = await ddiloco("status", "127.0.0.1:1")
    assert code == 2 and "URL must start with http://" in err


async def test_a_shards_summary_names_the_shard_and_its_fragments(tmp_path):
    s = Syncer(tmp_path, num_fragments=5, period=5, shard=1, shards=2)
    await s.start()
    try:
        async with aiohttp.ClientSession() as http:
            doc = await (await http.get(f"{s.http}/status")).json()
    finally:
        await s.server.stop()
    first = render(doc, s.http).splitlines()[0]
    assert first.endswith(", merges 0, shard 1 of 2 (fragments 1, 3)"), first
    assert "shard" not in render({**doc, "shard": 0, "shards": 1, "owned": [0, 1, 2, 3, 4]}, s.http).splitlines()[0]
