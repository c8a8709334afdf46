"""One status of a syncer split into shards, from each shard's /status document (or why it is missing).

Pure: the documents in, one document out (`ddiloco status URL URL ...` prints it; `--json` prints it
as it is). Each fragment's version comes from its owner (core.shards), merges are summed over the
shards, learners are listed once by name with the shards that see them, and every shard has a row
of its own: up with its step, merges and checkpoint, or down with the reason it could not be read.
A shard that is down never hides the others; its fragments show as down.

A shard says which it is in its document (`shard`, `shards`, `owned`; a syncer that predates them
says it in its `config`). A shard whose document cannot be read cannot say: when exactly one index
is unclaimed by the shards that answered, the shard down is that one.
"""

from __future__ import annotations

from collections.abc import Sequence

from ddiloco.core import shards as ownership

__all__ = ["ShardReading", "merge_status", "shard_of"]

# (the URL read, its /status document, or None and why it could not be read)
ShardReading = tuple[str, "dict | None", str | None]


def shard_of(doc: dict) -> tuple[int, int]:
    """(shard index, shard count) a /status document says it is; (0, 1) for a whole syncer."""
    config = doc.get("config", {})
    return int(doc.get("shard", config.get("shard", 0))), int(doc.get("shards", config.get("shards", 1)))


def merge_status(readings: Sequence[ShardReading]) -> dict:
    """The shards' documents as one: totals, learners by name, fragments from their owners, one row per shard."""
    up = [(url, doc) for url, doc, _ in readings if doc is not None]
    counts = sorted({shard_of(doc)[1] for _, doc in up})
    n = counts[-1] if counts else len(readings)
    warnings: list[str] = []
    if len(counts) > 1:
        warnings.append(f"the shards disagree on their count: {', '.join(map(str, counts))}")
    if n != len(readings):
        warnings.append(f"{len(readings)} URLs given for a syncer of {n} shard(s)")
    claimed: dict[int, str] = {}
    rows = []
    for url, doc, error in readings:
        if doc is None:
            rows.append({"url": url, "shard": None, "up": False, "error": error})
            continue
        shard, _ = shard_of(doc)
        if shard in claimed:
            warnings.append(f"{url} says it is shard {shard}, as {claimed[shard]} does")
        claimed.setdefault(shard, url)
        rows.append(
            {
                "url": url,
                "shard": shard,
                "up": True,
                "error": None,
                "global_step": doc.get("global_step"),
                "merges": doc.get("merges", 0),
                "uptime_s": doc.get("uptime_s"),
                "learners": len(doc.get("learners", [])),
                "checkpoint": doc.get("checkpoint"),
            }
        )
        warnings.extend(f"shard {shard}: {w}" for w in doc.get("warnings", []))
    unclaimed = [i for i in range(n) if i not in claimed]
    down = [row for row in rows if not row["up"]]
    if len(down) == 1 and len(unclaimed) == 1:
        down[0]["shard"] = unclaimed[0]
    rows.sort(key=lambda row: (row["shard"] is None, row["shard"] if row["shard"] is not None else 0, row["url"]))
    return {
        "shards": n,
        "shards_down": len(down),
        "merges": sum(row["merges"] for row in rows if row["up"]),
        "global_step": max((row["global_step"] for row in rows if row["up"]), default=None),
        "per_shard": rows,
        "learners": _learners(up),
        "fragments": _fragments(up, n),
        "warnings": warnings,
    }


def _learners(up: list[tuple[str, dict]]) -> list[dict]:
    """Each learner once, by name (its id differs from shard to shard): its status on each shard."""
    by_name: dict[str, dict] = {}
    for _, doc in up:
        shard, _ = shard_of(doc)
        for lr in doc.get("learners", []):
            entry = by_name.setdefault(lr["name"], {"name": lr["name"], "step": lr["step"], "status": {}})
            entry["step"] = max(entry["step"], lr["step"])
            entry["status"][str(shard)] = lr["status"]
    return [by_name[name] for name in sorted(by_name)]


def _fragments(up: list[tuple[str, dict]], n: int) -> list[dict]:
    """Every fragment's row from its owner; a fragment whose owner is down: its index and owner only."""
    count = max(
        (int(doc.get("config", {}).get("num_fragments", len(doc.get("fragments", [])))) for _, doc in up), default=0
    )
    rows: list[dict] = [{"index": q, "shard": ownership.owner(q, n), "up": False} for q in range(count)]
    for _, doc in up:
        shard, shards = shard_of(doc)
        if shards != n:
            continue  # not one of these shards: its versions would be another syncer's
        owned = set(doc.get("owned", ownership.owned(shard, n, count)))
        for f in doc.get("fragments", []):
            q = f["index"]
            if q in owned and q < count:
                rows[q] = {**f, "shard": shard, "up": True}
    return rows
