"""`ddiloco status URL [URL ...]`: a running syncer at a glance; `--json` for its raw /status document.

The summary: uptime, step and merges; the checkpoint's health; what needs looking at (warnings); a
table of the learners (status, step, versions behind, last seen, merged and late shares of their
pushed tokens); the fragments' versions and last rounds; the last decisions with their reasons; the
token ledger with each fate's share. Learner names are the learners' own text: a character that is
not printable (an escape sequence that would drive the operator's terminal) is shown escaped.

With several URLs, those of a syncer split into shards (core.shards): one summary of them all
(net.shard_status: total merges, learners by name, each fragment's version from its owner, a row per
shard). A shard that cannot be read is shown as down beside the others, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ddiloco.core.shards import SHARDS_MAX
from ddiloco.errors import FaultError, UserError
from ddiloco.net import tls
from ddiloco.net.shard_status import merge_status

__all__ = ["add_arguments", "render", "render_shards", "run"]

DECISIONS_PRINTED = 8
NAME_CHARS_PRINTED = 40  # a longer name is cut (with "...") so the table stays a table
PUSHED_FATES = ("merged", "merged_late", "late", "stale", "rejected")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "url",
        nargs="+",
        help="the syncer's HTTP address, e.g. http://127.0.0.1:8470; for a sharded syncer, every shard's",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the raw /status JSON instead of the summary (several URLs: the shards' merged into one)",
    )
    p.add_argument("--timeout-s", type=float, default=5.0)
    p.add_argument(
        "--tls-ca",
        type=Path,
        metavar="FILE",
        help="with an https:// URL: trust only the CA certificate(s) in this PEM file (default: the system's)",
    )


def run(args: argparse.Namespace) -> int:
    urls = [_checked_url(u, args.tls_ca) for u in args.url]
    if len(urls) > SHARDS_MAX:
        raise UserError(f"{len(urls)} URLs, more than the {SHARDS_MAX} shards a syncer may have")
    if len(set(urls)) != len(urls):
        raise UserError("a URL is given twice")
    if len(urls) > 1:
        return _run_shards(urls, args)
    doc = _fetch(urls[0], args)
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render(doc, urls[0]))
    return 0


def _run_shards(urls: list[str], args: argparse.Namespace) -> int:
    """Every shard read at once; one that cannot be read is a row of its own, down."""

    def read(url: str) -> tuple[str, dict | None, str | None]:
        try:
            return url, _fetch(url, args), None
        except FaultError as exc:
            return url, None, str(exc)

    with ThreadPoolExecutor(max_workers=len(urls)) as pool:
        readings = list(pool.map(read, urls))
    if all(doc is None for _, doc, _ in readings):
        raise FaultError(
            f"cannot reach any of the {len(urls)} shards: " + "; ".join(str(e) for _, _, e in readings),
            what_to_do="check that the syncer's shards run and listen at those addresses",
        )
    merged = merge_status(readings)
    if args.json:
        json.dump(merged, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_shards(merged))
    down = [row["url"] for row in merged["per_shard"] if not row["up"]]
    if down:
        print(f"ddiloco status: {len(down)} of {len(urls)} shards down: {', '.join(down)}", file=sys.stderr)
        return 1
    return 0


def _checked_url(given: str, tls_ca: Path | None) -> str:
    url = given.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise UserError(f"URL must start with http:// or https://, got {given!r}")
    if tls_ca is not None and not url.startswith("https://"):
        raise UserError(f"--tls-ca only applies to an https:// URL, got {given!r}")
    return url


def _fetch(url: str, args: argparse.Namespace) -> dict:
    """The /status document at `url`; FaultError when it cannot be read."""
    context = tls.client_context(args.tls_ca) if url.startswith("https://") else None
    try:
        with urllib.request.urlopen(f"{url}/status", timeout=args.timeout_s, context=context) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if tls.is_certificate_error(reason if isinstance(reason, BaseException) else exc):
            trust = f"the CA in {args.tls_ca}" if args.tls_ca else "the system's CAs (give --tls-ca FILE)"
            raise FaultError(
                f"the certificate of {url} is not trusted by {trust}: {reason}",
                what_to_do="give the CA that signed the syncer's certificate with --tls-ca FILE",
            ) from exc
        raise FaultError(
            f"cannot reach {url}: {reason}", what_to_do="check that the syncer runs and listens at that address"
        ) from exc
    except ValueError as exc:  # (json's error is a ValueError) something answered, not a syncer
        raise FaultError(
            f"{url}/status did not answer JSON: {exc}",
            what_to_do="check that the address is a ddiloco syncer's HTTP port",
        ) from exc


def render(doc: dict, url: str) -> str:
    """The readable summary of a /status document."""
    out = [
        f"syncer {url}: up {_duration(doc['uptime_s'])}, global step {doc['global_step']}, merges {doc['merges']}"
        + (f", initialised from {doc['init_source']}" if doc.get("init_source") else "")
        + _shard(doc),
        f"checkpoint: {_checkpoint(doc.get('checkpoint'))}",
    ]
    warnings = doc.get("warnings", [])
    out.append(f"warnings: {len(warnings) or 'none'}")
    out.extend(f"  ! {_text(w)}" for w in warnings)

    learners = doc["learners"]
    out.append(f"\nlearners: {len(learners)} connected, {len(doc.get('gone', []))} gone recently")
    rows = [["id", "name", "status", "step", "behind", "last seen", "merged", "late"]]
    for lr in learners:
        pushed = lr.get("pushed_tokens", {})
        total = sum(pushed.get(f, 0) for f in PUSHED_FATES)
        rows.append(
            [
                str(lr["id"]),
                _name(lr["name"]),
                lr["status"],
                str(lr["step"]),
                str(lr.get("versions_behind", "?")),
                f"{lr['last_seen_s_ago']:.1f} s ago",
                _share(pushed.get("merged", 0) + pushed.get("merged_late", 0), total),
                _share(pushed.get("merged_late", 0), total),
            ]
        )
    out.extend(_table(rows))

    out.append(f"\nfragments: {len(doc['fragments'])}")
    rows = [["fragment", "version", "last merge", "merged", "grace", "round open"]]
    for f in doc["fragments"]:
        ago = f.get("last_merge_s_ago")
        grace = f.get("last_round_grace_s")
        rows.append(
            [
                str(f["index"]),
                str(f["version"]),
                "never" if ago is None else f"{ago:.1f} s ago",
                "-" if f.get("last_round_learners") is None else str(f["last_round_learners"]),
                "-" if grace is None else f"{grace * 1000:.0f} ms",
                "-" if f["round_open"] is None else str(f["round_open"]),
            ]
        )
    out.extend(_table(rows))

    decisions = doc["decisions"][-DECISIONS_PRINTED:][::-1]
    out.append(f"\nlast decisions: {len(decisions)} shown, newest first")
    for d in decisions:
        when = f"{d['s_ago']:.1f} s ago" if "s_ago" in d else f"at {d['at_s']:.1f} s"
        out.append(f"  {when}  fragment {d['fragment']} round {d['round']} -> v{d['version']}: {_text(d['reason'])}")

    ledger = doc["ledger"]
    reported = ledger.get("reported", 0)
    out.append(f"\ntokens: {reported} reported")
    rows = [["fate", "tokens", "share"]]
    rows.extend([fate, str(n), _share(n, reported)] for fate, n in ledger.items() if fate != "reported")
    out.extend(_table(rows))
    return "\n".join(out) + "\n"


def _shard(doc: dict) -> str:
    """Which shard of a sharded syncer this is and its fragments; nothing for a whole syncer."""
    if doc.get("shards", 1) <= 1:
        return ""
    return f", shard {doc['shard']} of {doc['shards']} (fragments {', '.join(map(str, doc['owned']))})"


def render_shards(merged: dict) -> str:
    """The readable summary of a sharded syncer (net.shard_status.merge_status)."""
    down = merged["shards_down"]
    step = merged["global_step"]
    out = [
        f"sharded syncer: {merged['shards']} shards"
        + (f", {down} DOWN" if down else ", all up")
        + f"; merges {merged['merges']}, global step {'?' if step is None else step}"
    ]
    rows = [["shard", "url", "state", "up for", "step", "merges", "learners", "checkpoint"]]
    for s in merged["per_shard"]:
        shard = "?" if s["shard"] is None else str(s["shard"])
        if not s["up"]:
            rows.append([shard, s["url"], "DOWN", "-", "-", "-", "-", _text(s["error"] or "")])
            continue
        rows.append(
            [
                shard,
                s["url"],
                "up",
                _duration(s["uptime_s"] or 0.0),
                str(s["global_step"]),
                str(s["merges"]),
                str(s["learners"]),
                _checkpoint(s["checkpoint"]),
            ]
        )
    out.extend(_table(rows))
    warnings = merged["warnings"]
    out.append(f"warnings: {len(warnings) or 'none'}")
    out.extend(f"  ! {_text(w)}" for w in warnings)

    out.append(f"\nlearners: {len(merged['learners'])}")
    rows = [["name", "step", "status by shard"]]
    for lr in merged["learners"]:
        statuses = ", ".join(
            f"{shard}: {status}" for shard, status in sorted(lr["status"].items(), key=lambda kv: int(kv[0]))
        )
        rows.append([_name(lr["name"]), str(lr["step"]), statuses])
    out.extend(_table(rows))

    out.append(f"\nfragments: {len(merged['fragments'])}")
    rows = [["fragment", "shard", "version", "last merge", "round open"]]
    for f in merged["fragments"]:
        if not f["up"]:
            rows.append([str(f["index"]), str(f["shard"]), "down", "-", "-"])
            continue
        ago = f.get("last_merge_s_ago")
        rows.append(
            [
                str(f["index"]),
                str(f["shard"]),
                str(f["version"]),
                "never" if ago is None else f"{ago:.1f} s ago",
                "-" if f.get("round_open") is None else str(f["round_open"]),
            ]
        )
    out.extend(_table(rows))
    return "\n".join(out) + "\n"


def _checkpoint(ck: dict | None) -> str:
    if ck is None:
        return "off (no checkpoint directory)"
    written = (
        "none written yet"
        if ck.get("written") is None
        else (f"last written {_duration(ck['age_s'])} ago ({_text(ck['written'])}, {ck['merges']} merges)")
    )
    if ck.get("ok", True):
        return f"ok, {written}"
    failed = ck["failures_since_written"]
    return f"FAILING, {failed} attempt(s) since the last one written: {_text(ck['error'])}; {written}"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _share(n: int, total: int) -> str:
    return f"{100 * n / total:.1f}%" if total else "-"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _text(s: str) -> str:
    # A peer's text must not drive the terminal: escape what is not printable (ESC, CR, ...).
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(s))


def _name(name: str) -> str:
    shown = _text(name)
    return shown if len(shown) <= NAME_CHARS_PRINTED else shown[: NAME_CHARS_PRINTED - 3] + "..."
