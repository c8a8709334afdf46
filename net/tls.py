"""TLS for the syncer's address: the daemon's server context and the learner's client context.

The daemon serves `https://` and `wss://` when it is given a certificate chain and its private key
(PEM files); a client trusts the system's certificate authorities, or only the one in `ca_file`
(a self-signed certificate, a private CA). Both contexts come from the standard library's
`ssl.create_default_context`, so they keep its defaults: TLS 1.2 or newer, the host name checked
against the certificate, no legacy ciphers. A file that cannot be used is refused when the context
is made, with its name and the reason, before any socket is opened.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from ddiloco.errors import UserError

__all__ = ["TlsConfigError", "client_context", "is_certificate_error", "server_context"]


class TlsConfigError(UserError, ValueError):
    """A certificate, key or CA file that cannot be used; the message names the file and why."""


def server_context(cert_file: str | Path, key_file: str | Path) -> ssl.SSLContext:
    """The daemon's context: `cert_file` holds the certificate (and any intermediates), `key_file` its key."""
    _check_readable("certificate", cert_file)
    _check_readable("key", key_file)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certfile=str(cert_file), keyfile=str(key_file))
    except ssl.SSLError as exc:
        # OpenSSL's reason ("KEY_VALUES_MISMATCH", "PEM lib") is terse; say which pair failed.
        raise TlsConfigError(
            f"the TLS certificate {cert_file} and key {key_file} cannot be used together: {exc.reason or exc}"
        ) from exc
    return context


def client_context(ca_file: str | Path | None) -> ssl.SSLContext:
    """A learner's (or `ddiloco status`'s) context: the system's CAs, or only those in `ca_file`."""
    if ca_file is not None:
        _check_readable("CA file", ca_file)
    try:
        return ssl.create_default_context(cafile=str(ca_file) if ca_file is not None else None)
    except ssl.SSLError as exc:
        raise TlsConfigError(f"the TLS CA file {ca_file} holds no usable certificate: {exc.reason or exc}") from exc


def _check_readable(what: str, path: str | Path) -> None:
    """OpenSSL's own error for a file it cannot open names neither the file nor the reason."""
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise TlsConfigError(f"cannot read the TLS {what} {path}: {exc.strerror or exc}") from exc


def is_certificate_error(exc: BaseException) -> bool:
    """True for a failure that trying again cannot mend: the peer's certificate is not trusted or
    does not name the host dialled (as opposed to a network fault, which is retried)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ssl.SSLCertVerificationError):
            return True
        exc = (
            exc.__cause__
            or exc.__context__
            or getattr(exc, "os_error", None)
            or getattr(exc, "certificate_error", None)
        )
    return False
