"""Kernel compiles in the worker's process: counted and timed by phase, so one in a served turn shows.

Triton compiles a kernel the first time a launch meets a new specialization: its
``constexpr`` values, and for every integer argument whether it is 1 or divisible by
16 (and every pointer's 16-byte alignment). A compile takes from a fraction of a
second to tens of seconds (the warp-specialized extend kernels), and it runs on the
engine thread inside a step: every sequence of that step waits for it. The worker
therefore runs its shapes once before it says ready (``warm_up.py``) and counts what
still compiles afterwards: ``CompileWatch`` sits on Triton's two JIT hooks (called
before and after each compile, chained to whatever hook was there) and reports each
compile with the phase it fell in, ``start`` until ``serving()``, ``serving`` after.

A compile served from Triton's on-disk cache passes the same hooks; it counts too,
with its (short) seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

PHASES = ("start", "serving")


@dataclass(frozen=True, slots=True)
class CompileEvent:
    """One kernel specialization compiled (or loaded from Triton's disk cache)."""

    kernel: str  # the jitted function's name
    signature: str  # Triton's one-line description: launch options and each argument's specialization
    seconds: float
    phase: str  # "start" or "serving"


class CompileWatch:
    """Reports every Triton compile of this process to ``on_compile`` while installed.

    ``install`` puts the watch on ``triton.knobs.runtime``'s ``jit_cache_hook`` (before a
    compile) and ``jit_post_compile_hook`` (after it), keeping the hooks found there and
    calling them first; ``uninstall`` puts those back. One watch per process (the worker's
    main installs it); a second ``install`` is a ValueError.
    """

    def __init__(self, on_compile: Callable[[CompileEvent], None]) -> None:
        self._on_compile = on_compile
        self._phase = "start"
        self._started: dict[tuple[int, str], float] = {}  # (thread, signature) -> when its compile began
        self._lock = threading.Lock()
        self._prior: tuple[Any, Any] | None = None
        self._runtime: Any = None

    def serving(self) -> None:
        """Every compile from now on counts as one in a served request."""
        self._phase = "serving"

    def install(self) -> bool:
        """Hook into Triton; False (and nothing hooked) when Triton or its JIT hooks are missing."""
        if self._prior is not None:
            raise ValueError("this CompileWatch is already installed")
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = knobs.runtime
        if not hasattr(runtime, "jit_cache_hook") or not hasattr(runtime, "jit_post_compile_hook"):
            return False
        self._runtime = runtime
        self._prior = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook = self._before
        runtime.jit_post_compile_hook = self._after
        return True

    def uninstall(self) -> None:
        """Put back the hooks ``install`` found (no-op when not installed)."""
        if self._prior is None:
            return
        self._runtime.jit_cache_hook, self._runtime.jit_post_compile_hook = self._prior
        self._prior = None

    def _before(self, **kwargs: Any) -> Any:
        # Triton skips the compile when this hook returns a true value: only a prior hook may say so.
        prior = self._prior[0] if self._prior is not None else None
        skip = prior(**kwargs) if prior is not None else None
        if not skip:
            with self._lock:
                self._started[(threading.get_ident(), str(kwargs.get("repr", "")))] = time.perf_counter()
        return skip

    def _after(self, **kwargs: Any) -> Any:
        prior = self._prior[1] if self._prior is not None else None
        result = prior(**kwargs) if prior is not None else None
        signature = str(kwargs.get("repr", ""))
        with self._lock:
            began = self._started.pop((threading.get_ident(), signature), None)
        seconds = time.perf_counter() - began if began is not None else 0.0
        fn = kwargs.get("fn")
        name = str(getattr(fn, "name", None) or signature.split("[", 1)[0] or "unknown")
        event = CompileEvent(kernel=name, signature=signature, seconds=seconds, phase=self._phase)
        if event.phase == "serving":
            log.warning("kernel %s compiled while serving (%.2f s): %s", name, seconds, signature)
        self._on_compile(event)
        return result
