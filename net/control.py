"""The syncer's state-changing HTTP endpoints, from a plain client: `POST /checkpoint`.

For scripts and training loops that are done and want the syncer's current parameters on disk
(then `ddiloco export`), without aiohttp or the learner's connection.
"""

from __future__ import annotations

import urllib.error
import urllib.request

from ddiloco.errors import FaultError

CHECKPOINT_WAIT_S_DEFAULT = 120.0


class ControlError(FaultError, RuntimeError):
    """The syncer could not be reached or refused the request; the message says which and why."""


def http_base(url: str) -> str:
    """`http://host:port` from the syncer's websocket URL (`ws://host:port/ws`) or its HTTP address."""
    for ws, http in (("ws://", "http://"), ("wss://", "https://")):
        if url.startswith(ws):
            url = http + url[len(ws) :]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"syncer URL must start with ws://, wss://, http:// or https://, got {url!r}")
    url = url.rstrip("/")
    return url.removesuffix("/ws")


def request_checkpoint(url: str, token: str | None, timeout_s: float = CHECKPOINT_WAIT_S_DEFAULT) -> str:
    """Ask the syncer to write a checkpoint now; returns once it is on disk (the syncer's answer)."""
    base = http_base(url)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(f"{base}/checkpoint", method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.read().decode(errors="replace").strip()
    except urllib.error.HTTPError as exc:
        raise ControlError(
            f"the syncer at {base} refused the checkpoint: {exc.code} {exc.read().decode(errors='replace').strip()}"
        ) from exc
    except (urllib.error.URLError, OSError) as exc:
        raise ControlError(f"cannot reach the syncer at {base}: {getattr(exc, 'reason', exc)}") from exc
