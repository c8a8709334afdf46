"""`ddiloco status URL`: print a syncer's /status JSON."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

from ddiloco.net import tls

from ddiloco.errors import FaultError, UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="the syncer's HTTP address, e.g. http://127.0.0.1:8470")
    p.add_argument("--timeout-s", type=float, default=5.0)
    p.add_argument("--tls-ca", type=Path, metavar="FILE",
                   help="with an https:// URL: trust only the CA certificate(s) in this PEM file (default: the system's)")


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
            raise FaultError(f"the certificate of {url} is not trusted by {trust}: {reason}",
                             what_to_do="give the CA that signed the syncer's certificate with --tls-ca FILE") from exc
        raise FaultError(f"cannot reach {url}: {reason}",
                         what_to_do="check that the syncer runs and listens at that address") from exc
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0
