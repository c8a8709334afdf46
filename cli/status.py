"""`ddiloco status URL`: a running syncer at a glance; `--json` for its raw /status document.

The summary: uptime, step and merges; the checkpoint's health; what needs looking at (warnings); a
table of the learners (status, step, versions behind, last seen, merged and late shares of their
pushed tokens); the fragments' versions and last rounds; the last decisions with their reasons; the
token ledger with each fate's share. Learner names are the learners' own text: a character that is
not printable (an escape sequence that would drive the operator's terminal) is shown escaped.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

from ddiloco.errors import FaultError, UserError
from ddiloco.net import tls

__all__ = ["add_arguments", "render", "run"]

DECISIONS_PRINTED = 8
NAME_CHARS_PRINTED = 40  # a longer name is cut (with "...") so the table stays a table
PUSHED_FATES = ("merged", "merged_late", "late", "stale", "rejected")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="the syncer's HTTP address, e.g. http://127.0.0.1:8470")
    p.add_argument("--json", action="store_true", help="print the raw /status JSON instead of the summary")
    p.add_argument("--timeout-s", type=float, default=5.0)
    p.add_argument(
        "--tls-ca",
        type=Path,
        metavar="FILE",
        help="with an https:// URL: trust only the CA certificate(s) in this PEM file (default: the system's)",
    )


def run(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise UserError(f"URL must start with http:// or https://, got {args.url!r}")
    if args.tls_ca is not None and not url.startswith("https://"):
        raise UserError(f"--tls-ca only applies to an https:// URL, got {args.url!r}")
    context = tls.client_context(args.tls_ca) if url.startswith("https://") else None
    try:
        with urllib.request.urlopen(f"{url}/status", timeout=args.timeout_s, context=context) as resp:
            doc = json.loads(resp.read())
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
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render(doc, url))
    return 0


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
