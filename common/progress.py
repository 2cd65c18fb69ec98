"""Progress bars for long loops (benches): tqdm on stderr, shown only on a terminal.

Off when stderr is not a terminal (a log, a pipe, CI) or when the caller passes
``quiet=True``, so the tables a bench prints on stdout stay byte for byte the
same whether or not a bar ran beside them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


def add_quiet_argument(parser: argparse.ArgumentParser) -> None:
    """``--quiet``: no progress bar even on a terminal."""
    parser.add_argument("--quiet", action="store_true", help="no progress bar on stderr")


def progress(items: Iterable[T], *, desc: str, total: int | None = None, quiet: bool = False) -> Iterator[T]:
    """Yield ``items`` while a bar labelled ``desc`` counts them on stderr."""
    on = not quiet and sys.stderr.isatty()
    yield from tqdm(items, desc=desc, total=total, file=sys.stderr, disable=not on, leave=False, dynamic_ncols=True)
