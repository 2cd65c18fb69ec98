"""bench/agents.py at a tiny scale, end to end: two KV formats, two concurrency
points, real gateway and worker processes on loopback, the openai client.

Asserts real values from its JSON: hit rates are fractions that add up from
their sources, later turns hit the cache while the pool holds the agents, an
overflowed pool hits less than one agent alone and evicts, nvfp4 holds 16/9
the tokens of fp8 at the same memory, and the PNG is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "agents.py"


def test_agents_bench_small_sweep(tmp_path: Path) -> None:
    out, png = tmp_path / "agents.json", tmp_path / "agents.png"
    # 768 KiB per worker: fp8 holds 768 tokens (one agent's <= 700-token history fits, three do not)
    cmd = [
        sys.executable,
        str(BENCH),
        "--formats",
        "fp8,nvfp4",
        "--concurrency",
        "1,3",
        "--modes",
        "lease",
        "--kv-kib",
        "768",
        "--turns",
        "3",
        "--think-s",
        "0.02",
        "--records",
        "--json",
        str(out),
        "--png",
        str(png),
        "--run-dir",
        str(tmp_path / "run"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    points: dict[tuple[str, int], dict[str, Any]] = {(p["format"], p["concurrency"]): p for p in result["points"]}
    assert set(points) == {("fp8", 1), ("fp8", 3), ("nvfp4", 1), ("nvfp4", 3)}
    for (fmt, n), p in points.items():
        assert p["errors"] == [], p["errors"]
        turns: dict[int, list[int]] = {}
        for r in p["records"]:
            turns.setdefault(r["agent"], []).append(r["turn"])
        assert len(turns) == n and all(sorted(t) == list(range(len(t))) and len(t) >= 2 for t in turns.values())
        assert 0.0 <= p["hit_rate"] <= 1.0 and 0.0 <= p["hit_rate_later_turns"] <= 1.0
        assert p["local_share"] + p["pulled_share"] == pytest.approx(p["hit_rate"], abs=1e-9)
        for r in p["records"]:
            assert r["cached_tokens"] == r["local_tokens"] + r["pulled_tokens"]
            assert r["computed_tokens"] == r["prompt_tokens"] - r["cached_tokens"]
            assert r["output_tokens"] == 8 and r["ttft_s"] > 0
            if r["turn"] == 0:
                assert r["cached_tokens"] == 0  # every agent's prefix is its own
            elif n == 1:
                assert r["cached_tokens"] > 0  # one agent fits: every later turn reuses its history
        assert p["req_per_s"] > 0 and p["ttft_p99_ms"] >= p["ttft_p50_ms"] > 0
        assert p["tpot_p99_ms"] >= p["tpot_p50_ms"] > 0
        # every turn's prefill KV goes to the decode worker under a transfer lease that its READ hold consumes
        assert p["prefill_transfer_leases"]["consumed"] > 0 and min(p["prefill_transfer_lease_s"].values()) >= 0
        assert sum(p["decode_transfer_leases"].values()) == 0  # a decode worker makes none
        for role in ("prefill", "decode"):
            # a pull skipped for no free pages first found no room; per such pull, the pool's held pages by holder
            assert p[f"{role}_no_room"] >= p[f"{role}_skips"].get("no_free_pages", 0)
            # each worker's mean time to a request's first token by phase: its step always, a pull's plan where it pulled
            first = p[f"{role}_first_token_ms"]
            assert first["first_step"] > 0 and all(ms >= 0 for ms in first.values())
            assert p[f"{role}_pulls"] == 0 or first["pull_plan"] > 0, first
            held = p[f"{role}_no_room_held_pages"]
            assert set(held) == {"requests", "pins_transfer", "pins_pulling", "pins_retained", "pins_pulled"}
            assert 0 <= sum(held.values()) <= 768 // 16 * 16 / 9 + 1  # at most the larger (nvfp4) pool's pages
            # page-major KV (the default): a READ moves one region per run of pages for all layers, at most one a page
            if p[f"{role}_pulls"]:
                assert 1 <= p[f"{role}_regions_per_pull"] <= p[f"{role}_pulled_tokens"] / 16 / p[f"{role}_pulls"]
                # a READ's mean time, of which its descriptor lists: both measured, the part below the whole
                assert 0 < p[f"{role}_descriptor_ms_per_pull"] < p[f"{role}_read_ms_per_pull"]
                assert 0 < p[f"{role}_post_ms_per_pull"] < p[f"{role}_read_ms_per_pull"]
    # three agents overflow 768 fp8 tokens: fewer hits than one agent, pages evicted
    one, three = points[("fp8", 1)], points[("fp8", 3)]
    assert three["hit_rate"] < one["hit_rate"]
    assert three["prefill_evicted_pages"] + three["decode_evicted_pages"] > 0
    assert one["prefill_evicted_pages"] == one["decode_evicted_pages"] == 0
    caps = {s["format"]: s["capacity_tokens"]["decode"] for s in result["stacks"]}
    assert caps["fp8"] == 768
    assert abs(caps["nvfp4"] / caps["fp8"] - 16 / 9) < 0.02  # 36 vs 64 bytes per head and token (pages round down)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # a sweep landed in parts combines into one result: a later part's point replaces the same point
    first = tmp_path / "part1.json"
    part = json.loads(out.read_text())
    part["points"] = [p for p in part["points"] if p["format"] == "fp8"]
    first.write_text(json.dumps(part))
    combined = tmp_path / "combined.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--combine", str(first), str(out), "--json", str(combined)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = json.loads(combined.read_text())
    assert [(p["format"], p["concurrency"], p["part"]) for p in merged["points"]] == [
        ("fp8", 1, "agents.json"),
        ("fp8", 3, "agents.json"),
        ("nvfp4", 1, "agents.json"),
        ("nvfp4", 3, "agents.json"),
    ]
    assert {k: p["hit_rate"] for k, p in points.items()} == {(p["format"], p["concurrency"]): p["hit_rate"] for p in merged["points"]}
    assert merged["parts"] == ["part1.json", "agents.json"]
    assert combined.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert merged["device"] == "CPU"
    # parts measured on different machines are not one sweep
    other = tmp_path / "other_machine.json"
    other.write_text(json.dumps({**part, "device": "NVIDIA H100 80GB HBM3"}))
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--combine", str(first), str(other), "--json", str(tmp_path / "mixed.json")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2 and "the files differ in 'device'" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "mixed.json").exists()
