"""The page an operator runs a job by, served at `/`: one HTML document, no dependencies.

It polls /status every second and draws what a person watching a run needs: merges/s and tokens/s
(from the change between two polls), each learner's merged and late shares and how stale it is
(versions behind, last seen), each fragment's last round, the checkpoint's age, the last decisions
with their reasons, and the warnings /status lists, highlighted. When a poll fails the page keeps the
last values, greyed, under a red "syncer not answering since HH:MM:SS": a dead syncer never leaves a
page that looks alive.

Everything shown comes from the syncer's learners (names) or is shaped by them (reasons), so the page
builds DOM nodes and sets their text (`textContent`, `append` of strings); it never parses data as
HTML. A learner named `<img src=x onerror=...>` is shown as exactly that text.
"""

from __future__ import annotations

__all__ = ["PAGE_HTML", "POLL_MS", "POLL_TIMEOUT_MS"]

POLL_MS = 1000  # how often the page asks /status
POLL_TIMEOUT_MS = 3000  # a poll not answered within this counts as the syncer not answering

PAGE_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>ddiloco syncer</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:13px/1.4 ui-monospace,monospace;margin:1.2em 2em;color:#222;background:#fff}
h1{font-size:18px;margin:0 0 .3em}h2{font-size:14px;margin:1.2em 0 .3em}
table{border-collapse:collapse}td,th{padding:2px 10px;text-align:left;border-bottom:1px solid #eee}
th{color:#666;font-weight:normal}td.n{text-align:right}
#answer{font-weight:bold}#answer.up{color:#187218}#answer.down{color:#cc0000}
.stale{opacity:.45}
.cards{display:flex;flex-wrap:wrap;gap:8px}.card{border:1px solid #ddd;border-radius:4px;padding:4px 10px}
.card b{display:block;font-size:16px}
#warnings li{color:#b00000;background:#fff0f0;margin:2px 0;padding:2px 6px;list-style:none}
#warnings{padding:0;margin:.5em 0}
tr.warn td{background:#fff4e0}tr.skipped td{color:#b00000}
</style></head>
<body>
<h1>ddiloco syncer</h1>
<div id="answer">connecting...</div>
<div id="view">
<div class="cards" id="cards"></div>
<ul id="warnings"></ul>
<h2>learners</h2>
<table id="learners"><thead><tr><th>id</th><th>name</th><th>status</th><th>step</th><th>versions behind</th>
<th>last seen</th><th>merged</th><th>late</th></tr></thead><tbody></tbody></table>
<h2>fragments</h2>
<table id="fragments"><thead><tr><th>fragment</th><th>version</th><th>last merge</th><th>learners merged</th>
<th>grace</th><th>round open</th></tr></thead><tbody></tbody></table>
<h2>recent decisions</h2>
<table id="decisions"><thead><tr><th>when</th><th>fragment</th><th>round</th><th>version</th><th>reason</th></tr>
</thead>
<tbody></tbody></table>
<h2>tokens by fate</h2>
<table id="ledger"><thead><tr><th>fate</th><th>tokens</th><th>share of reported</th></tr></thead><tbody></tbody></table>
</div>
<script>
"use strict";
const POLL_MS = @POLL_MS@, POLL_TIMEOUT_MS = @POLL_TIMEOUT_MS@;
let previous = null, downSince = null;

// A node with text children only: strings become text nodes, never markup.
function el(tag, cls, ...children) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  for (const c of children) node.append(c instanceof Node ? c : String(c));
  return node;
}
function cell(value, numeric) { return el("td", numeric ? "n" : "", value); }
function row(cls, ...values) { return el("tr", cls, ...values.map(v => v instanceof Node ? v : cell(v))); }
function fill(id, rows) { document.querySelector("#" + id + " tbody").replaceChildren(...rows); }
function ago(s) {
  if (s === null || s === undefined) return "never";
  if (s < 120) return s.toFixed(1) + " s ago";
  if (s < 7200) return (s / 60).toFixed(1) + " min ago";
  return (s / 3600).toFixed(1) + " h ago";
}
function pct(n, total) { return total > 0 ? (100 * n / total).toFixed(1) + "%" : "-"; }
function clock(d) { return d.toTimeString().slice(0, 8); }
function pushed(t) { return (t.merged || 0) + (t.late || 0) + (t.stale || 0) + (t.rejected || 0); }

function rates(s) {
  const now = {t: s.uptime_s, merges: s.merges, reported: s.ledger.reported || 0, merged: s.ledger.merged || 0};
  let out = {merges: "-", tokens: "-", merged: "-"};
  if (previous && now.t > previous.t) {
    const dt = now.t - previous.t;
    out = {merges: ((now.merges - previous.merges) / dt).toFixed(2),
           tokens: ((now.reported - previous.reported) / dt).toFixed(0),
           merged: ((now.merged - previous.merged) / dt).toFixed(0)};
  }
  previous = now;
  return out;
}

function draw(s) {
  const r = rates(s), ck = s.checkpoint;
  const cards = [["global step", s.global_step], ["merges", s.merges], ["merges/s", r.merges],
    ["tokens/s reported", r.tokens], ["tokens/s merged", r.merged], ["learners", s.learners.length],
    ["checkpoint", ck ? (ck.written ? ago(ck.age_s) : "none yet") : "off"],
    ["up", ago(s.uptime_s).replace(" ago", "")]];
  document.getElementById("cards").replaceChildren(...cards.map(([k, v]) => el("div", "card", k, el("b", "", v))));
  document.getElementById("warnings").replaceChildren(...s.warnings.map(w => el("li", "", w)));
  fill("learners", s.learners.map(l => {
    const t = l.pushed_tokens, total = pushed(t);
    return row(t.late > 0 || l.versions_behind >= 3 ? "warn" : "", l.id, l.name, l.status, l.step, l.versions_behind,
               ago(l.last_seen_s_ago), pct(t.merged, total), pct(t.late, total));
  }));
  fill("fragments", s.fragments.map(f => row("", f.index, f.version, ago(f.last_merge_s_ago),
    f.last_round_learners === null ? "-" : f.last_round_learners,
    f.last_round_grace_s === null ? "-" : (1000 * f.last_round_grace_s).toFixed(0) + " ms",
    f.round_open === null ? "-" : "round " + f.round_open)));
  fill("decisions", s.decisions.slice().reverse().map(d => row(d.outcome === "merged" ? "" : "skipped",
    ago(d.s_ago), d.fragment, d.round, d.version, d.reason)));
  const reported = s.ledger.reported || 0;
  fill("ledger", Object.entries(s.ledger).filter(([k]) => k !== "reported")
    .map(([k, v]) => row(k === "late" && v > 0 ? "warn" : "", k, v, pct(v, reported))));
}

function answered() {
  downSince = null;
  const a = document.getElementById("answer");
  a.className = "up";
  a.textContent = "syncer answering, updated " + clock(new Date());
  document.getElementById("view").className = "";
}
function notAnswering(why) {
  if (downSince === null) downSince = new Date();
  const a = document.getElementById("answer");
  a.className = "down";
  a.textContent = "syncer not answering since " + clock(downSince) + " (" + why + ")";
  document.getElementById("view").className = "stale";
}

async function poll() {
  const abort = new AbortController(), timer = setTimeout(() => abort.abort(), POLL_TIMEOUT_MS);
  try {
    const response = await fetch("status", {signal: abort.signal, cache: "no-store"});
    if (!response.ok) throw new Error("HTTP " + response.status);
    return await response.json();
  } finally {
    clearTimeout(timer);
  }
}

async function tick() {
  try {
    let s;
    try {
      s = await poll();
    } catch (e) {
      notAnswering(e.name === "AbortError" ? "no answer in " + POLL_TIMEOUT_MS / 1000 + " s" : String(e.message || e));
      return;
    }
    answered();
    draw(s);  // a bug here shows in the console; it is not the syncer's silence
  } finally {
    setTimeout(tick, POLL_MS);
  }
}
tick();
</script>
</body></html>
""".replace("@POLL_MS@", str(POLL_MS)).replace("@POLL_TIMEOUT_MS@", str(POLL_TIMEOUT_MS))
