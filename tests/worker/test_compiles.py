"""CompileWatch as Triton's compilation listener: each compile reported once, timed, in its phase; a listener found kept.

The first test compiles real kernels (a Triton one and a Gluon one with a layout constexpr) through Triton's JIT
for sm_90 without a GPU (tests/kernels/compile_watch_child.py, in a child process: this session runs under
TRITON_INTERPRET=1); the others call the listener the way ``triton.compiler.compile`` does (keyword
arguments only). tests/worker/test_warm_up.py's gpu test runs the worker's own kernels through the watch.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from triton import knobs

from kvserving.worker.compiles import CompileEvent, CompileWatch
from kvserving.worker.metrics import WorkerMetrics

HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def bare_listener() -> Iterator[None]:
    saved = knobs.compilation.listener
    knobs.compilation.listener = None
    yield
    knobs.compilation.listener = saved


def _child(cache_dir: Path, case: str = "watch") -> list[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(cache_dir)}
    cmd = [sys.executable, str(HERE.parent / "kernels" / "compile_watch_child.py"), case]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events: list[dict[str, Any]] = json.loads(proc.stdout)
    return events


def test_real_compiles_are_reported_by_phase_once_per_specialization_gluon_layouts_too(tmp_path: Path) -> None:
    # the child launches _scale_kernel at n = 100, 101 (one specialization), 96 (divisible by 16: another), then,
    # serving, the Gluon _fill_kernel twice with a BlockedLayout constexpr (one compile), then uninstalls and launches
    # once more (not reported). The JIT's own hooks would fail the Gluon compile (its layout is not JSON).
    want = [("_scale_kernel", "start"), ("_scale_kernel", "start"), ("_fill_kernel", "serving")]
    first = _child(tmp_path)
    assert [(e["kernel"], e["phase"]) for e in first] == want
    assert [e["cache_hit"] for e in first] == [False] * 3
    assert all(e["seconds"] > 0 for e in first)
    assert "n: i32," in first[0]["signature"] and "n: i32 %16" in first[1]["signature"]
    assert first[0]["signature"].startswith("_scale_kernel[num_warps=4") and "BLOCK=128" in first[0]["signature"]
    assert "layout=BlockedLayout(" in first[2]["signature"]
    # a new process over the same Triton cache: the same compiles, each loaded from the disk cache
    again = _child(tmp_path)
    assert [(e["kernel"], e["phase"], e["signature"]) for e in again] == [(e["kernel"], e["phase"], e["signature"]) for e in first]
    assert [e["cache_hit"] for e in again] == [True] * 3


def test_the_triaxial_page_listing_compiles_once_for_every_prefix_length(tmp_path: Path) -> None:
    # the warm-up's prefixes (4 pages, and chunk-aligned ones: 128) and then served ones of any page count (1, 137,
    # 16, 1000, up to a 128K context's 4,096): the device saw a compile per power of two of the page count in served
    # turns when the listing's block followed the count
    events = _child(tmp_path, "int2_first")
    assert [(e["kernel"], e["phase"]) for e in events] == [("_int2_first_kernel", "start")], events


def triton_compiled(name: str, *, micros: int = 0, cache_hit: bool = False) -> None:
    """What ``triton.compiler.compile`` tells the listener at the end of one compile of kernel ``name``."""
    listener = knobs.compilation.listener
    if listener is None:
        return
    src = SimpleNamespace(name=name, signature={"n": "i32", "BLOCK": "constexpr"}, constants={(1,): 64}, attrs={})
    times = knobs.CompileTimes(ir_initialization=micros // 2, lowering_stages=[("ttir", micros - micros // 2)], store_results=0)
    listener(src=src, metadata={"num_warps": 4, "num_stages": 3}, metadata_group={}, times=times, cache_hit=cache_hit)


def test_a_compile_is_reported_with_its_kernel_seconds_and_phase(caplog: pytest.LogCaptureFixture) -> None:
    events: list[CompileEvent] = []
    watch = CompileWatch(events.append)
    assert watch.install()
    with caplog.at_level(logging.WARNING, logger="kvserving.worker.compiles"):
        triton_compiled("_write_kv_kernel", micros=50_000)
    assert [(e.kernel, e.phase, e.seconds) for e in events] == [("_write_kv_kernel", "start", 0.05)]
    assert events[0].signature == "_write_kv_kernel[num_warps=4, num_stages=3](n: i32, BLOCK=64)"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    watch.serving()
    with caplog.at_level(logging.WARNING, logger="kvserving.worker.compiles"):
        triton_compiled("_gl_extend_kernel", micros=2_500_000)
        triton_compiled("_merge_kernel", micros=300, cache_hit=True)
    assert [(e.kernel, e.phase, e.cache_hit) for e in events[1:]] == [
        ("_gl_extend_kernel", "serving", False),
        ("_merge_kernel", "serving", True),
    ]
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("kernel _gl_extend_kernel compiled while serving (2.50 s)") for m in messages)
    assert any(m.startswith("kernel _merge_kernel loaded from the disk cache while serving") for m in messages)
    watch.uninstall()
    triton_compiled("_silu_mul_kernel")
    assert len(events) == 3  # uninstalled: no longer reported


def test_the_listener_found_is_called_first_and_put_back() -> None:
    calls: list[str] = []

    def listener(**kw: Any) -> None:
        calls.append(kw["src"].name)

    knobs.compilation.listener = listener
    events: list[CompileEvent] = []
    watch = CompileWatch(events.append)
    watch.install()
    triton_compiled("k")
    assert calls == ["k"] and [e.kernel for e in events] == ["k"]
    with pytest.raises(ValueError, match="already installed"):
        watch.install()
    watch.uninstall()
    assert knobs.compilation.listener is listener


def test_metrics_count_compiles_and_their_seconds_by_phase() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, role="decode")
    assert registry.get_sample_value("kvserving_worker_kernel_compiles_total", {"phase": "serving"}) == 0
    metrics.kernel_compiled(CompileEvent("a", "a[...]", 2.5, "start"))
    metrics.kernel_compiled(CompileEvent("b", "b[...]", 1.5, "start"))
    metrics.kernel_compiled(CompileEvent("c", "c[...]", 0.25, "serving"))
    assert registry.get_sample_value("kvserving_worker_kernel_compiles_total", {"phase": "start"}) == 2
    assert registry.get_sample_value("kvserving_worker_kernel_compile_seconds_total", {"phase": "start"}) == 4.0
    assert registry.get_sample_value("kvserving_worker_kernel_compiles_total", {"phase": "serving"}) == 1
    assert registry.get_sample_value("kvserving_worker_kernel_compile_seconds_total", {"phase": "serving"}) == 0.25
