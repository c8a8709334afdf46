"""`ddiloco snapshot URL --token-file F`: take a consistent snapshot of a running system (net.snapshot).

Asks the syncer (`POST /snapshot`, the syncer needs `--snapshot-dir`) and waits until the learners'
local states are in; prints where the snapshot is, how many learners and messages in flight it holds,
and which learners were left out and why. `ddiloco demo --restore DIR` restarts a demo from it.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

from ddiloco.errors import FaultError, UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="the syncer's HTTP address, e.g. http://127.0.0.1:8470")
    p.add_argument("--token-file", type=Path, required=True, help="file holding the shared bearer token")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument(
        "--tls-ca",
        type=Path,
        metavar="FILE",
        help="with an https:// URL: trust only the CA certificate(s) in this PEM file (default: the system's)",
    )


def run(args: argparse.Namespace) -> int:
    from ddiloco.net import tls
    from ddiloco.net.auth import read_token_file

    url = args.url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise UserError(f"URL must start with http:// or https://, got {args.url!r}")
    if args.tls_ca is not None and not url.startswith("https://"):
        raise UserError(f"--tls-ca only applies to an https:// URL, got {args.url!r}")
    context = tls.client_context(args.tls_ca) if url.startswith("https://") else None
    req = urllib.request.Request(
        f"{url}/snapshot",
        method="POST",
        headers={"Authorization": f"Bearer {read_token_file(args.token_file, allow_shared=True)}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=args.timeout_s, context=context) as resp:
            doc = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        print(
            f"ddiloco snapshot: the syncer said {exc.code}: {exc.read().decode(errors='replace').strip()}",
            file=sys.stderr,
        )
        return 1
    except (urllib.error.URLError, OSError) as exc:
        raise FaultError(
            f"cannot reach {url}: {getattr(exc, 'reason', exc)}",
            what_to_do="check that the syncer runs and listens at that address",
        ) from exc
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0
