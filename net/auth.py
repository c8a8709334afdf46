"""The shared-token check: `Authorization: Bearer <token>`, compared in constant time.

Learners must present it before the websocket upgrade (401 otherwise); HTTP endpoints that change
state need it too. The token comes from a file so it never appears in a process listing.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from ddiloco.errors import UserError

TOKEN_BYTES_MIN = 16
TOKEN_BYTES_MAX = 4096


class AuthConfigError(UserError, ValueError):
    pass


def read_token_file(path: str | Path) -> str:
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise AuthConfigError(f"cannot read the auth token file {path}: {exc.strerror or exc}") from exc
    check_token(token)
    return token


def check_token(token: str) -> None:
    if not TOKEN_BYTES_MIN <= len(token.encode()) <= TOKEN_BYTES_MAX:
        raise AuthConfigError(f"auth token must be {TOKEN_BYTES_MIN} to {TOKEN_BYTES_MAX} bytes long")
    if any(c.isspace() for c in token):
        raise AuthConfigError("auth token must not contain whitespace")


def bearer_matches(header: str | None, token: str | None) -> bool:
    """True when no token is configured, or the header carries exactly that token."""
    if token is None:
        return True
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer ") :].encode(), token.encode())
