"""Worker test fixtures: a worker app served on a real socket (``live``) for
the module's ``config``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from live_worker import Live, start_live, stop_live

from kvserving.config import ServingConfig


@pytest.fixture(scope="module")
def live(config: ServingConfig) -> Iterator[Live]:
    """The worker app of the requesting module's ``config`` fixture, on uvicorn, for the module."""
    w = start_live(config)
    try:
        yield w
    finally:
        stop_live(w)
