"""Progress of long jobs (calibrate, benches) on stderr: a tqdm bar on a terminal, periodic lines elsewhere.

On a terminal a bar counts the steps. Off a terminal (a log, a pipe, CI) a line
``desc: done/total note`` every ``every_s`` seconds of work, so a long run is
never silent and a short one adds nothing. ``quiet=True`` writes nothing. The
tables a bench prints on stdout stay byte for byte the same either way.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable, Iterator, Sized
from types import TracebackType
from typing import TextIO, TypeVar

from tqdm import tqdm

T = TypeVar("T")
EVERY_S = 30.0  # off a terminal: a line per this many seconds of work


def add_quiet_argument(parser: argparse.ArgumentParser) -> None:
    """``--quiet``: no progress on stderr, on a terminal or off it."""
    parser.add_argument("--quiet", action="store_true", help="no progress bar or progress lines on stderr")


class Steps:
    """A count of a job's steps on ``stream`` (stderr): a bar on a terminal, else a line per ``every_s``."""

    def __init__(
        self,
        total: float | None,
        *,
        desc: str,
        quiet: bool = False,
        stream: TextIO | None = None,
        every_s: float = EVERY_S,
        leave: bool = False,
        unit: str = "it",
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.total, self.desc, self.unit = total, desc, unit
        self.done: float = 0
        self.lines = not quiet and not self.stream.isatty()
        self.every_s, self.last = every_s, time.monotonic()
        on_tty = not quiet and not self.lines
        self.bar = tqdm(total=total, desc=desc, file=self.stream, leave=leave, dynamic_ncols=True, unit=unit) if on_tty else None

    def step(self, note: str = "") -> None:
        """One more step done."""
        self.at(self.done + 1, note)

    def at(self, done: float, note: str = "") -> None:
        """``done`` of ``total`` done (a job counted in something other than steps, e.g. simulated seconds)."""
        if self.bar is not None:
            if note:
                self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(done - self.done)
        elif self.lines and time.monotonic() - self.last >= self.every_s:
            self.last = time.monotonic()
            of = f"/{self.total:g}" if self.total is not None else ""
            unit = f" {self.unit}" if self.unit != "it" else ""
            self.stream.write(f"{self.desc}: {done:g}{of}{unit} {note}".rstrip() + "\n")
            self.stream.flush()
        self.done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> Steps:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def progress(items: Iterable[T], *, desc: str, total: int | None = None, quiet: bool = False) -> Iterator[T]:
    """Yield ``items`` while ``Steps`` labelled ``desc`` counts them on stderr."""
    if total is None and isinstance(items, Sized):
        total = len(items)
    with Steps(total, desc=desc, quiet=quiet) as steps:
        for item in items:
            yield item
            steps.step()
