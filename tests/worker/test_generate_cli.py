"""`kvserving generate` runs the engine offline and reports what it did."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvserving import cli


def run_cli(monkeypatch: pytest.MonkeyPatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", ["kvserving", *argv])
    return cli.main()


def test_generate_prints_each_prompt_and_a_summary(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code = run_cli(
        monkeypatch,
        "generate",
        "--model",
        str(tiny_model_dir),
        "--kv-dtype",
        "nvfp4",
        "--prompt",
        "def main():",
        "--prompt",
        "import os",
        "--max-tokens",
        "5",
        "--kv-bytes",
        str(8 << 20),
    )
    out = capsys.readouterr().out
    assert code == 0
    assert out.count("--- prompt:") == 2
    # The seeded tiny model greedily emits no EOS in these 5 tokens.
    assert "--- 10 tokens in" in out
    # 8 MiB over 4 layers = 2 MiB a layer; an nvfp4 page of 16 tokens x 2 KV
    # heads x (32 data + 4 scale bytes) x (K, V) is 2304 B: 910 pages.
    assert "kv nvfp4, pool 14560 tokens" in out


def test_generate_refuses_a_missing_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(monkeypatch, "generate", "--model", str(tmp_path), "--prompt", "x") == 1
    assert capsys.readouterr().err == f"kvserving generate: error: no tokenizer.json in {tmp_path}\n"
