"""The shared token: how strong it must be, who may read its file, and the bearer check.

Learners present it as `Authorization: Bearer <token>` before the websocket upgrade (401 otherwise);
HTTP endpoints that change state need it too, compared in constant time. The token comes from a file
so it never appears in a process listing; that file must be the owner's alone, or anyone on the
machine can join the run and push outer gradients.

Strength is estimated, not measured (a token's true entropy is a property of how it was made, which
the daemon cannot see): effective length x log2(alphabet), where the alphabet is the smallest of the
usual ones that holds every character (hex: 16; otherwise digits 10 + lower case 26 + upper case 26 +
ASCII punctuation 32, for each class used, and one per distinct other character), and the effective
length is that of the repeated unit when the token repeats one at least twice ("abcabcab" counts 3;
a random token's last characters matching its first few do not count). Tokens of fewer than
`DISTINCT_CHARS_MIN` distinct characters are refused whatever their length (`"0101..."` is binary, not
hex). The README's `secrets.token_hex(16)` is 32 hex characters: 128 bits, exactly the minimum.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import math
import os
import stat
import string
from pathlib import Path

from ddiloco.errors import UserError

log = logging.getLogger("ddiloco.auth")

TOKEN_BYTES_MIN = 16
TOKEN_BYTES_MAX = 4096
TOKEN_BITS_MIN = 128
DISTINCT_CHARS_MIN = 8  # 32 random hex characters have fewer with probability below 1e-6
TOKEN_FILE_MODE = 0o600

_HEX = (frozenset(string.digits + "abcdef"), frozenset(string.digits + "ABCDEF"))
_CLASSES = (
    frozenset(string.digits),
    frozenset(string.ascii_lowercase),
    frozenset(string.ascii_uppercase),
    frozenset(string.punctuation),
)


class AuthConfigError(UserError, ValueError):
    """A token or token file the daemon will not use; the message says why and what to do."""


def read_token_file(path: str | Path, *, allow_shared: bool = False) -> str:
    """The token in `path`, checked. A file that group or others may read is refused, or with
    `allow_shared` accepted with a warning."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise AuthConfigError(f"cannot read the auth token file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise AuthConfigError(f"the auth token file {path} is not UTF-8 text") from exc
    shared = readable_by_others(mode)
    if shared:
        what = f"the auth token file {path} is readable by {shared} (mode {stat.S_IMODE(mode):04o})"
        if not allow_shared:
            raise AuthConfigError(
                f"{what}: run `chmod 600 {path}` (`ddiloco syncer --allow-shared-token` accepts it anyway)"
            )
        log.warning("%s; accepted, but whoever can read it can join the run", what)
    try:
        check_token(token)
    except AuthConfigError as exc:
        raise AuthConfigError(f"the auth token in {path}: {exc}") from None
    return token


def write_token_file(path: str | Path, token: str) -> Path:
    """Write `token` to a new file only its owner may read (mode 0600 from the start, never wider)."""
    check_token(token)
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, TOKEN_FILE_MODE)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(token + "\n")
    return path


def readable_by_others(mode: int) -> str:
    """'group', 'others' or 'group and others' when the mode lets them read; '' when it does not."""
    who = [name for bit, name in ((stat.S_IRGRP, "group"), (stat.S_IROTH, "others")) if mode & bit]
    return " and ".join(who)


def check_token(token: str) -> None:
    if not TOKEN_BYTES_MIN <= len(token.encode()) <= TOKEN_BYTES_MAX:
        raise AuthConfigError(f"auth token must be {TOKEN_BYTES_MIN} to {TOKEN_BYTES_MAX} bytes long")
    if any(c.isspace() for c in token):
        raise AuthConfigError("auth token must not contain whitespace")
    distinct = len(set(token))
    if distinct < DISTINCT_CHARS_MIN:
        raise AuthConfigError(
            f"auth token has only {distinct} distinct characters (at least {DISTINCT_CHARS_MIN}): "
            "generate one with `python -c 'import secrets; print(secrets.token_hex(16))'`"
        )
    bits = estimated_bits(token)
    if bits < TOKEN_BITS_MIN:
        raise AuthConfigError(
            f"auth token has an estimated {bits:.0f} bits of entropy, fewer than {TOKEN_BITS_MIN} "
            f"(estimated as length x log2(alphabet); {len(token)} characters): "
            "generate one with `python -c 'import secrets; print(secrets.token_hex(16))'`"
        )


def estimated_bits(token: str) -> float:
    """Effective length x log2(alphabet size): see the module docstring for both."""
    return effective_length(token) * math.log2(alphabet_size(token))


def effective_length(token: str) -> int:
    period = shortest_period(token)
    return period if 2 * period <= len(token) else len(token)


def alphabet_size(token: str) -> int:
    chars = set(token)
    if any(chars <= hexdigits for hexdigits in _HEX):
        return 16
    size = sum(len(cls) for cls in _CLASSES if chars & cls)
    return size + len(chars.difference(*_CLASSES))


def shortest_period(token: str) -> int:
    """The smallest p with token[i] == token[i - p] for every i >= p (the prefix function)."""
    border = [0] * len(token)
    for i in range(1, len(token)):
        k = border[i - 1]
        while k and token[i] != token[k]:
            k = border[k - 1]
        border[i] = k + (token[i] == token[k])
    return len(token) - (border[-1] if token else 0)


def is_loopback(host: str) -> bool:
    """Only this machine can reach `host`: a loopback address or `localhost`. Any other name might
    resolve to anything, so it counts as reachable from outside."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, token: str | None, insecure_no_auth: bool) -> None:
    """Refuse to serve without a token on an address other machines can reach, unless told to."""
    if token is None and not is_loopback(host) and not insecure_no_auth:
        raise AuthConfigError(
            f"no auth token on {host!r}, an address other machines can reach: any of them could join and push "
            "gradients. Give --auth-token-file, listen on 127.0.0.1, or pass --insecure-no-auth"
        )


def bearer_matches(header: str | None, token: str | None) -> bool:
    """True when no token is configured, or the header carries exactly that token."""
    if token is None:
        return True
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer ") :].encode(), token.encode())
