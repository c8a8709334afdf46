"""The daemon's HTTP endpoints: health, metrics, status, the live page, checkpoint and snapshot requests.

`/healthz` answers JSON: `status` (ok, degraded or failing; net.health says when), the `reasons`,
the core loop's and the checkpoints' facts; 503 when failing, 200 otherwise. `/status` carries the
same `core` and `checkpoint` sections.

Status and metrics read the `SyncerView` the core thread last published (net.telemetry), never the
state the core is changing; the two that change state run on the core thread, between two events.
"""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web

from ddiloco.net import health
from ddiloco.net import snapshot as snapshots
from ddiloco.net.auth import bearer_matches
from ddiloco.net.items import SnapshotStart
from ddiloco.net.telemetry import render_prometheus, status_document

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
        return web.Response(body=orjson.dumps(verdict.document), status=verdict.http_status,
                            content_type="application/json")

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=render_prometheus(server.metrics, server.view), content_type="text/plain", charset="utf-8")

    async def status(request: web.Request) -> web.Response:
        now = server.clock()
        doc = status_document(server.view, server.metrics, now, now - server.started_at)
        doc["core"] = health.core_section(server.core.health())
        doc["checkpoint"] = health.checkpoint_section(*checkpoint_health())
        return web.Response(body=orjson.dumps(doc), content_type="application/json")

    async def page(request: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/html")

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
        web.get("/healthz", healthz),
        web.get("/metrics", metrics),
        web.get("/status", status),
        web.get("/", page),
        web.post("/checkpoint", checkpoint_now),
        web.post("/snapshot", snapshot_now),
    ]


PAGE = """<!doctype html><meta charset="utf-8"><title>ddiloco syncer</title>
<style>body{font:14px monospace;margin:2em}td,th{padding:2px 10px;text-align:left}</style>
<h1>ddiloco syncer</h1><div id="s">loading...</div>
<script>
async function tick(){
  const s = await (await fetch('status')).json();
  let h = `<p>global step ${s.global_step} &middot; merges ${s.merges} &middot; up ${s.uptime_s}s</p>`;
  h += '<table><tr><th>learner</th><th>status</th><th>step</th><th>seen</th></tr>';
  for (const l of s.learners) h += `<tr><td>${l.id} ${l.name}</td><td>${l.status}</td><td>${l.step}</td><td>${l.last_seen_s_ago}s ago</td></tr>`;
  h += '</table><table><tr><th>fragment</th><th>version</th></tr>';
  for (const f of s.fragments) h += `<tr><td>${f.index}</td><td>${f.version}</td></tr>`;
  h += '</table><h3>last decisions</h3>';
  for (const d of s.decisions.slice(-8).reverse()) h += `<div>fragment ${d.fragment} v${d.version}: ${d.reason}</div>`;
  h += `<h3>tokens</h3><pre>${JSON.stringify(s.ledger)}</pre>`;
  document.getElementById('s').innerHTML = h;
}
tick(); setInterval(tick, 1000);
</script>
"""
