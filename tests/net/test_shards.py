"""A shard of a sharded syncer as a daemon (docs/protocol.md, "A sharded syncer"): a real server on
127.0.0.1 and a real client; what its /status and /metrics say, and what a misrouted init gets."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from ddiloco.net import messages as msg

from .test_daemon import Learner, Syncer, until


async def test_a_shard_daemon_serves_its_own_fragments_and_says_which_shard_it_is(tmp_path):
    s = Syncer(tmp_path, num_fragments=4, period=4, shard=1, shards=2)
    await s.start()
    learner = Learner(s.ws_url, "a")
    try:
        welcome = await learner.welcome()
        assert (welcome.shard, welcome.shards, welcome.owned) == (1, 2, (1, 3))
        # The learner (not yet shard-aware) sends every fragment's initial values: the owned ones
        # are taken, the others refused by name, the connection kept.
        await until(lambda: s.server.view.holds_parameters, what="the shard initialised")
        await until(lambda: len(learner.client.inbox.errors) == 2, what="the two refusals")
        errors = sorted((e.code, e.text, e.fatal) for e in learner.client.inbox.errors)
        assert errors == [
            (msg.ErrorCode.BAD_SHAPE.name.lower(), f"fragment {p} belongs to shard 0 of 2; this is shard 1", False)
            for p in (0, 2)
        ]
        state = s.server.state
        assert [f.theta is not None for f in state.fragments] == [False, True, False, True]

        async with aiohttp.ClientSession() as http:
            status = await (await http.get(f"{s.http}/status")).json()
            text = await (await http.get(f"{s.http}/metrics")).text()
        assert (status["shard"], status["shards"], status["owned"]) == (1, 2, [1, 3])
        assert [f["index"] for f in status["fragments"]] == [1, 3]
        assert (status["config"]["shard"], status["config"]["shards"]) == (1, 2)
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        (info,) = fams["ddiloco_shard_info"].samples
        assert info.labels == {"shard": "1", "shards": "2"} and info.value == 1
        for name in ("ddiloco_fragment_version", "ddiloco_fragment_elements", "ddiloco_learner_held_version"):
            assert sorted({sm.labels["fragment"] for sm in fams[name].samples}) == ["1", "3"], name
    finally:
        await learner.stop()
        await s.server.stop()
