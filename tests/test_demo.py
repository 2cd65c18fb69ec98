"""`kvserving demo` (what `make demo` runs) completes and reports every format."""

from __future__ import annotations

import re
import sys

import pytest

from kvserving import cli


def test_demo_serves_every_format_on_the_tiny_model(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["kvserving", "demo", "--max-tokens", "4"])
    assert cli.main() == 0
    out = capsys.readouterr().out
    assert "nvfp4                   4.500      41472.0  2,071,261  0.28125  0.5625" in out
    pools = dict(re.findall(r"^(bf16|fp8_e4m3|nvfp4|triaxial)\s+([\d,]+)\s+\d+\s+\d+\s+\d+%$", out, flags=re.M))
    assert set(pools) == {"bf16", "fp8_e4m3", "nvfp4", "triaxial"}
    tokens = {k: int(v.replace(",", "")) for k, v in pools.items()}
    # 16 MiB pool: whole pages of each format (fp32 stands in for bf16 on CPU)
    assert tokens["fp8_e4m3"] == 4 * tokens["bf16"]
    assert abs(tokens["nvfp4"] / tokens["fp8_e4m3"] - 16 / 9) < 0.01
