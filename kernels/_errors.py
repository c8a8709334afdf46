"""The one exception the kernel wrappers raise for bad input."""

from __future__ import annotations

from ddiloco.errors import UserError


class KernelInputError(UserError, ValueError):
    """An argument handed to a kernel has the wrong type, dtype, layout, length or value.

    Raised by the wrappers before any loop runs, so nothing the caller passed in has been modified.
    The message names the argument and what is wrong with it.
    """
