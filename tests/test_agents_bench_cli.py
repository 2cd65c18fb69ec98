"""bench/agents.py's command line: a point list that would not be used is refused before any stack starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_concurrency_without_the_lease_mode_is_refused_in_one_line() -> None:
    r = subprocess.run(
        [sys.executable, "bench/agents.py", "--modes", "off", "--concurrency", "12,16"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    assert r.returncode == 2 and r.stdout == ""
    assert (
        r.stderr.strip()
        .splitlines()[-1]
        .endswith("error: --concurrency sets mode lease's points and --modes off runs no lease; the other modes take --mode-concurrency")
    )
