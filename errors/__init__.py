"""The root of every exception ddiloco raises on purpose, and its two branches.

    DdilocoError
      UserError   bad input, a bad configuration, a refusal by a peer: the fix is the user's,
                  so it is shown as one line (the message says what is wrong)
      FaultError  an expected runtime fault (network, disk, a peer that died): shown as one line
                  that also says what to do about it

Anything that is not a DdilocoError is a bug and keeps its traceback: the command line turns a
UserError into exit status 2, a FaultError into 1, and lets everything else through. A class
whose callers already catch a builtin keeps that builtin as a second base
(`class CodecError(UserError, ValueError)`), so those callers behave as before.

This package is the bottom layer: it imports nothing of ddiloco.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

__all__ = ["DdilocoError", "FaultError", "UserError", "one_line", "reported_as_exit"]


class DdilocoError(Exception):
    """Something ddiloco refuses or cannot do, said in one line; never a bug."""


class UserError(DdilocoError):
    """Bad input, a configuration that cannot work, or a peer's refusal; the message names what is wrong."""


class FaultError(DdilocoError):
    """An expected runtime fault (network, disk, a peer that died); the message says what happened.

    `what_to_do` is the advice printed after it; a subclass that knows better says so.
    """

    what_to_do: str = "check the network, the disk and the other processes named above, then run it again"

    def __init__(self, *args: object, what_to_do: str | None = None) -> None:
        super().__init__(*args)
        if what_to_do is not None:
            self.what_to_do = what_to_do


def one_line(prog: str, exc: DdilocoError) -> tuple[int, str]:
    """(exit status, the line shown) for an error of ours: 2 for a UserError, 1 for a FaultError."""
    if isinstance(exc, FaultError):
        return 1, f"{prog}: fault: {exc}; {exc.what_to_do}"
    return 2, f"{prog}: error: {exc}"


@contextlib.contextmanager
def reported_as_exit(prog: str) -> Iterator[None]:
    """For a program's `main`: an error of ours ends it with its one line on stderr and its exit status
    (`one_line`); anything else is a bug and keeps its traceback."""
    try:
        yield
    except DdilocoError as exc:
        status, line = one_line(prog, exc)
        print(line, file=sys.stderr)
        raise SystemExit(status) from None
