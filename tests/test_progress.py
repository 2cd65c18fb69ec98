"""kvserving.progress: a tqdm bar on stderr when it is a terminal, periodic lines when it is not, nothing with --quiet."""

from __future__ import annotations

import argparse
import fcntl
import io
import os
import pty
import struct
import sys
import termios

import pytest

from kvserving.progress import Steps, add_quiet_argument, progress


def _drain(fd: int) -> bytes:
    out = b""
    os.set_blocking(fd, False)
    try:
        while chunk := os.read(fd, 65536):
            out += chunk
    except (BlockingIOError, OSError):
        pass
    return out


@pytest.mark.parametrize("quiet", [False, True])
def test_bar_on_a_terminal_unless_quiet(monkeypatch: pytest.MonkeyPatch, quiet: bool) -> None:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # rows, columns
    with open(slave, "w", closefd=True) as tty:
        monkeypatch.setattr(sys, "stderr", tty)
        assert list(progress(range(3), desc="cells", quiet=quiet)) == [0, 1, 2]
        tty.flush()
        written = _drain(master)
    os.close(master)
    if quiet:
        assert written == b""
    else:
        assert b"cells:" in written and b"0/3" in written


def test_a_short_run_off_a_terminal_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    assert list(progress(iter("abc"), desc="rows", total=3)) == ["a", "b", "c"]
    assert err.getvalue() == ""


def test_a_long_run_off_a_terminal_writes_a_line_per_interval_unless_quiet() -> None:
    log = io.StringIO()
    with Steps(3, desc="calibrate", stream=log, every_s=0.0) as steps:  # every step is past the interval
        steps.step("distortion")
        steps.step()
    assert log.getvalue() == "calibrate: 1/3 distortion\ncalibrate: 2/3\n"
    quiet = io.StringIO()
    with Steps(3, desc="calibrate", stream=quiet, every_s=0.0, quiet=True) as steps:
        steps.step("distortion")
    assert quiet.getvalue() == ""


def test_a_job_counted_in_its_own_unit_reports_where_it_is() -> None:
    log = io.StringIO()  # kvserving simulate: simulated seconds, and a search starts its population again from 0
    with Steps(600, desc="nvfp4", stream=log, every_s=0.0, unit="s simulated") as steps:
        steps.at(120)
        steps.at(0)
    assert log.getvalue() == "nvfp4: 120/600 s simulated\nnvfp4: 0/600 s simulated\n"


def test_quiet_flag() -> None:
    parser = argparse.ArgumentParser()
    add_quiet_argument(parser)
    assert parser.parse_args(["--quiet"]).quiet is True
    assert parser.parse_args([]).quiet is False
