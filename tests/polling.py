"""Bounded waits for tests: every poll has a deadline, so a test fails with a message instead of spinning
when the thing it waits for never happens (or already happened on a fast CPU)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

DEFAULT_TIMEOUT = 30.0


def wait_until(cond: Callable[[], bool], timeout: float = DEFAULT_TIMEOUT, interval: float = 0.01,
               what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout} s")
        time.sleep(interval)


async def async_wait_until(cond: Callable[[], bool], timeout: float = DEFAULT_TIMEOUT, interval: float = 0.005,
                           what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout} s")
        await asyncio.sleep(interval)
