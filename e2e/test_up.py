"""`kvserving up` as a user runs it: real gateway and worker processes on
loopback, the ready line, SIGTERM stops everything with exit 0, and a child
that dies is reported and takes the rest down (exit 1); no process is left."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvserving.local.stack import free_ports, port_is_free

READY_S = 180.0


def _children_of(run_dir: Path) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(run_dir) in cmd and "kvserving.cli up" not in cmd:
                pids.append(int(entry.name))
    return pids


def _start(tmp_path: Path, name: str) -> tuple[subprocess.Popen[str], Path, int]:
    run_dir = tmp_path / name
    # `up` takes the next port too and refuses in one line if it is busy: the OS picks a free
    # port from the ephemeral range, where the next one may be a live connection's local port
    port = next(p for p in (free_ports(1)[0] for _ in range(50)) if port_is_free("127.0.0.1", p + 1))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserving.cli", "up", "--single", "--port", str(port), "--run-dir", str(run_dir), "--kv-mib", "8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONSAFEPATH="1"),
        start_new_session=True,
    )
    deadline = time.monotonic() + READY_S
    assert proc.stdout is not None
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("ready:"):
            return proc, run_dir, port
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"no ready line: {lines} {proc.stderr.read() if proc.stderr else ''}")


def _stop_all(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_up_serves_then_stops_on_sigterm_and_when_a_child_dies(tmp_path: Path) -> None:
    proc, run_dir, port = _start(tmp_path, "first")
    try:
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["kvserving-tiny"]
        assert len(_children_of(run_dir)) >= 2  # gateway and worker
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert _children_of(run_dir) == []
    finally:
        _stop_all(proc)

    proc, run_dir, port = _start(tmp_path, "second")
    try:
        worker = [
            p
            for p in _children_of(run_dir)
            if "worker --role both" in Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        ]
        assert worker
        os.kill(worker[0], signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
        assert proc.stderr is not None
        assert re.search(
            r"^kvserving up: error: worker exited with code -9 \(log: \S+worker\.log\)\nits last lines:", proc.stderr.read(), re.M
        )
        assert _children_of(run_dir) == []
    finally:
        _stop_all(proc)
