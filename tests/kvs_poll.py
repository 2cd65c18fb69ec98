"""Polling for a condition, for tests that wait on another thread or process:
a generous deadline (a loaded 2-core machine is slow, never wrong), a short
sleep between looks, and a failure that says what was awaited."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], timeout_s: float = 30.0, *, what: str = "condition", every_s: float = 0.02) -> None:
    """Return once ``predicate()`` is true; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout_s:g} s"
        time.sleep(every_s)
