"""The daemon's HTTP endpoints: health, metrics, status, the operator's page, checkpoint and snapshot
requests, and where the lane listens.

`/healthz` answers JSON: `status` (ok, degraded or failing; net.health says when), the `reasons`,
the core loop's and the checkpoints' facts; 503 when failing, 200 otherwise. `/status` carries the
same `core` and `checkpoint` sections.

Status and metrics read the `SyncerView` the core thread last published (net.telemetry), never the
state the core is changing; the two that change state run on the core thread, between two events.
/metrics is prometheus_client's exposition of the daemon's own registry (net.telemetry.new_registry);
`/` is the operator's page (net.page), which polls /status.
"""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web
from prometheus_client.exposition import choose_encoder

from ddiloco.net import health
from ddiloco.net import snapshot as snapshots
from ddiloco.net.auth import bearer_matches
from ddiloco.net.items import SnapshotStart
from ddiloco.net.page import PAGE_HTML
from ddiloco.net.telemetry import Reading, new_registry, status_document

__all__ = ["SNAPSHOT_ANSWER_S_EXTRA", "routes"]

SNAPSHOT_ANSWER_S_EXTRA = 30.0  # beyond the snapshot's wait limit, for writing its files


def routes(server) -> list[web.RouteDef]:
    """The endpoints of `server` (a net.server.SyncerServer)."""

    def authorized(request: web.Request) -> bool:
        token = server.config.auth_token
        return token is not None and bearer_matches(request.headers.get("Authorization"), token)

    def checkpoint_health():
        """(the store's health, now on the store's clock); (None, 0) without a checkpoint directory."""
        checkpoint_store = server.checkpoints.store
        return (None, 0.0) if checkpoint_store is None else (checkpoint_store.health, checkpoint_store.clock())

    async def healthz(request: web.Request) -> web.Response:
        verdict = health.judge(server.core.health(), *checkpoint_health(), server.config.core_stall_s_max)
        return web.Response(
            body=orjson.dumps(verdict.document), status=verdict.http_status, content_type="application/json"
        )

    registry = new_registry(lambda: reading(server))

    async def metrics(request: web.Request) -> web.Response:
        # The format the scraper asks for (Prometheus' text, or OpenMetrics when its Accept says so).
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        response = web.Response(body=encode(registry))
        response.headers["Content-Type"] = content_type  # (aiohttp's content_type= would drop the version)
        return response

    async def status(request: web.Request) -> web.Response:
        doc = status_document(reading(server), server.started_at)
        doc["core"] = health.core_section(server.core.health())
        return web.Response(body=orjson.dumps(doc), content_type="application/json")

    async def lane(request: web.Request) -> web.Response:
        """Where the lane listens (net.lane); 404 when this daemon has none. The port is no secret:
        a lane is only attached with the token its websocket offered."""
        lanes = server.sessions.lanes
        if lanes is None:
            raise web.HTTPNotFound(text="this syncer has no lane\n")
        return web.Response(body=orjson.dumps({"port": lanes.port}), content_type="application/json")

    async def page(request: web.Request) -> web.Response:
        return web.Response(text=PAGE_HTML, content_type="text/html", charset="utf-8")

    async def checkpoint_now(request: web.Request) -> web.Response:
        if not authorized(request):
            raise web.HTTPUnauthorized(text="this endpoint changes state: bearer token required\n")
        if not server.config.checkpoint_dir:
            raise web.HTTPConflict(text="no checkpoint directory configured\n")
        if not server.view.holds_parameters:
            raise web.HTTPConflict(text="the syncer holds no parameters yet: nothing to checkpoint\n")
        failed = await server.core.call(lambda: server.checkpoints.write(server.shell.state, "requested over HTTP"))
        if failed:
            raise web.HTTPInsufficientStorage(text=f"{failed}\n")
        return web.Response(text=f"checkpoint written: {server.checkpoints.store.health.written}\n")

    async def snapshot_now(request: web.Request) -> web.Response:
        """Take a consistent snapshot; answers when it is complete, with its manifest's summary."""
        if not authorized(request):
            raise web.HTTPUnauthorized(text="this endpoint writes state: bearer token required\n")
        done = asyncio.get_running_loop().create_future()
        await server.core.submit(SnapshotStart("requested over HTTP", done))
        try:
            result = await asyncio.wait_for(done, server.config.snapshot_wait_s_max + SNAPSHOT_ANSWER_S_EXTRA)
        except snapshots.SnapshotError as exc:
            raise web.HTTPConflict(text=f"{exc}\n") from None
        return web.Response(body=orjson.dumps(result), content_type="application/json")

    return [
        web.get("/ws", server.sessions.serve),
        web.get("/lane", lane),
        web.get("/healthz", healthz),
        web.get("/metrics", metrics),
        web.get("/status", status),
        web.get("/", page),
        web.post("/checkpoint", checkpoint_now),
        web.post("/snapshot", snapshot_now),
    ]


def reading(server) -> Reading:
    """What /metrics and /status read of `server`, at once: its view, counters, checkpoint health."""
    store = server.checkpoints.store
    return Reading(
        server.view,
        server.metrics,
        server.clock(),
        None if store is None else store.health,
        0.0 if store is None else store.clock(),
    )
