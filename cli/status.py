"""`ddiloco status URL`: print a syncer's /status JSON."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

from ddiloco.errors import FaultError, UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="the syncer's HTTP address, e.g. http://127.0.0.1:8470")
    p.add_argument("--timeout-s", type=float, default=5.0)


def run(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise UserError(f"URL must start with http:// or https://, got {args.url!r}")
    try:
        with urllib.request.urlopen(f"{url}/status", timeout=args.timeout_s) as resp:
            doc = json.loads(resp.read())
    except (urllib.error.URLError, OSError) as exc:
        raise FaultError(f"cannot reach {url}: {getattr(exc, 'reason', exc)}",
                         what_to_do="check that the syncer runs and listens at that address") from exc
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0
