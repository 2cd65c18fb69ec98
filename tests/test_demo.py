"""`kvserving demo` (what `make demo` runs): the whole stack on the tiny model,
an agent conversation with bidirectional reuse on and off, a table per run, a
PNG plot, and no process left behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

# Tokens a reply: five whole pages, above the default reuse.recompute_threshold_tokens (64), so every later
# turn pulls the reply's pages; the demo's claims hold at any such length and each token is a decode step.
REPLY = 80
ROW = re.compile(r"^\s+(\d+)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+([\d.]+)$", re.M)


def _rows(table: str) -> list[dict[str, int]]:
    names = ("turn", "prompt", "local", "pulled", "computed", "kv_bytes", "cached")
    return [{k: int(v.replace(",", "")) for k, v in zip(names, m.groups()[:7])} for m in ROW.finditer(table)]


def _leftovers() -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "kvserving-demo-" in cmd and str(os.getpid()) != entry.name:
                found.append(cmd)
    return found


def test_demo_shows_reuse_on_and_off_with_a_plot(tmp_path: Path) -> None:
    plot = tmp_path / "ttft.png"
    result = subprocess.run(
        [sys.executable, "-m", "kvserving.cli", "demo", "--max-tokens", str(REPLY), "--plot", str(plot)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONSAFEPATH="1"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "nvfp4                   4.500      41472.0  2,071,261  0.28125  0.5625" in out  # the capacity table
    on_text, off_text = out.split("bidirectional reuse on", 1)[1].split("bidirectional reuse off", 1)
    on, off = _rows(on_text), _rows(off_text)
    assert [r["turn"] for r in on] == [r["turn"] for r in off] == [1, 2, 3, 4, 5]
    for rows in (on, off):
        for r in rows:
            assert r["local"] + r["pulled"] + r["computed"] == r["prompt"]
            assert r["cached"] == r["prompt"] - r["computed"]
    assert on[0]["computed"] == off[0]["computed"] == on[0]["prompt"]  # nothing to reuse on turn 1
    # later turns pull the decode worker's reply pages instead of recomputing them
    assert all(r["pulled"] == REPLY for r in on[1:])
    assert all(r["pulled"] == 0 for r in off)
    assert sum(r["computed"] for r in on[1:]) + 4 * REPLY == sum(r["computed"] for r in off[1:])
    assert f"TTFT plot: {plot}" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _leftovers() == []
