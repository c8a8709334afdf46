"""Waiting in tests without timing anything: poll a condition, or take steps until one holds.

Every wait has a bound, and running past it fails the test with what was awaited: the bound only
stops a test that would otherwise hang, and nothing asserts how long anything took. A loaded
machine needs more steps, not another test.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable

__all__ = ["POLL_S", "STEPS_S_MAX", "WAIT_S_DEFAULT", "steps_until", "until"]

POLL_S = 0.005
WAIT_S_DEFAULT = 10.0
STEPS_S_MAX = 120.0  # a first merge of a fresh daemon under CI load took over 30 steps; this is a hang


async def until(predicate: Callable[[], object], timeout_s: float = WAIT_S_DEFAULT, what: str = "condition") -> None:
    """Return once `predicate()` is true; fail after `timeout_s` (never a bare sleep to let things happen)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(POLL_S)


async def steps_until(
    step: Callable[[], Awaitable[object] | object],
    done: Callable[[], Awaitable[bool] | bool],
    what: str,
    timeout_s: float = STEPS_S_MAX,
) -> int:
    """Take `step()` until `done()` holds (either may be a coroutine function); returns the steps taken.
    The way to train until N merges: a fixed number of steps merges too few on a loaded machine."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    steps = 0
    while not await _value(done()):
        assert loop.time() < deadline, f"no {what} within {timeout_s:g} s ({steps} steps)"
        await _value(step())
        steps += 1
    return steps


async def _value(result):
    return await result if inspect.isawaitable(result) else result
