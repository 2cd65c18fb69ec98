"""CompileWatch on Triton's JIT hooks: each compile reported once, timed, in its phase; the hooks it found kept.

Without a GPU nothing compiles, so these tests call the two hooks the way Triton's JIT does
(``JITFunction._do_compile``: the cache hook before a compile, the post-compile hook after it, keyword
arguments only); tests/worker/test_warm_up.py's gpu test runs real compiles through the watch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from triton import knobs
from triton.runtime.jit import JitFunctionInfo

from kvserving.worker.compiles import CompileEvent, CompileWatch
from kvserving.worker.metrics import WorkerMetrics


@pytest.fixture(autouse=True)
def bare_hooks() -> Iterator[None]:
    saved = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None
    yield
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = saved


def triton_compiles(name: str, *, seconds: float = 0.0) -> Any:
    """What the JIT does around one compile of kernel ``name``; returns the cache hook's answer."""
    kw: dict[str, Any] = dict(
        key=(name, ("i32",)),
        repr=f"{name}[num_warps=4, num_ctas=1, num_stages=3](n: i32)",
        fn=JitFunctionInfo(module=None, name=name, jit_function=None),  # type: ignore[arg-type]
        compile={"device": 0},
        is_manual_warmup=False,
        already_compiled=False,
    )
    hook = knobs.runtime.jit_cache_hook
    skip = hook(**kw) if hook is not None else None
    if skip:
        return skip
    time.sleep(seconds)
    post = knobs.runtime.jit_post_compile_hook
    if post is not None:
        post(**kw)
    return skip


def test_a_compile_is_reported_with_its_kernel_seconds_and_phase(caplog: pytest.LogCaptureFixture) -> None:
    events: list[CompileEvent] = []
    watch = CompileWatch(events.append)
    assert watch.install()
    triton_compiles("_write_kv_kernel", seconds=0.05)
    assert [(e.kernel, e.phase) for e in events] == [("_write_kv_kernel", "start")]
    assert 0.05 <= events[0].seconds < 5.0
    assert events[0].signature.startswith("_write_kv_kernel[num_warps=4")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    watch.serving()
    with caplog.at_level(logging.WARNING, logger="kvserving.worker.compiles"):
        triton_compiles("_gl_extend_kernel")
    assert [(e.kernel, e.phase) for e in events] == [("_write_kv_kernel", "start"), ("_gl_extend_kernel", "serving")]
    assert any("_gl_extend_kernel compiled while serving" in r.getMessage() for r in caplog.records)
    watch.uninstall()
    triton_compiles("_silu_mul_kernel")
    assert len(events) == 2  # uninstalled: no longer reported


def test_the_hooks_found_are_called_first_and_put_back() -> None:
    calls: list[str] = []

    def cache_hook(**kw: Any) -> None:
        calls.append("cache " + kw["fn"].name)

    def post_hook(**kw: Any) -> None:
        calls.append("post " + kw["fn"].name)

    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = cache_hook, post_hook
    events: list[CompileEvent] = []
    watch = CompileWatch(events.append)
    watch.install()
    triton_compiles("k")
    assert calls == ["cache k", "post k"] and [e.kernel for e in events] == ["k"]
    with pytest.raises(ValueError, match="already installed"):
        watch.install()
    watch.uninstall()
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == (cache_hook, post_hook)


def test_a_compile_a_prior_hook_skips_is_not_reported() -> None:
    knobs.runtime.jit_cache_hook = lambda **kw: True  # e.g. a tool that only lists specializations
    events: list[CompileEvent] = []
    watch = CompileWatch(events.append)
    watch.install()
    assert triton_compiles("k") is True
    assert events == []
    watch.uninstall()


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
