"""Kernel compiles in the worker's process: counted and timed by phase, so one in a served turn shows.

Triton compiles a kernel the first time a launch meets a new specialization: its
``constexpr`` values, and for every integer argument whether it is 1 or divisible by
16 (and every pointer's 16-byte alignment). A compile takes from a fraction of a
second to tens of seconds (the warp-specialized extend kernels), and it runs on the
engine thread inside a step: every sequence of that step waits for it. The worker
therefore runs its shapes once before it says ready (``warm_up.py``) and counts what
still compiles afterwards: ``CompileWatch`` is Triton's compilation listener
(``triton.knobs.compilation.listener``, called by ``triton.compiler.compile`` at the end
of every compile with the compile's times; chained to a listener found there) and
reports each compile with the phase it fell in, ``start`` until ``serving()``,
``serving`` after.

Not the JIT's ``jit_cache_hook`` / ``jit_post_compile_hook``: with either set, the JIT
serializes each launch's constexprs to JSON before it compiles, and a Gluon kernel's
layout constexpr is not serializable, so every Gluon compile would fail.

A compile served from Triton's on-disk cache reaches the listener too (the JIT still
loads it inside the step); it counts, with its (short) seconds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

PHASES = ("start", "serving")


@dataclass(frozen=True, slots=True)
class CompileEvent:
    """One kernel specialization compiled (or loaded from Triton's disk cache)."""

    kernel: str  # the jitted function's name
    signature: str  # launch options and each argument's type, 16-divisibility or constexpr value
    seconds: float
    phase: str  # "start" or "serving"
    cache_hit: bool = False  # loaded from Triton's on-disk cache, not compiled


def describe(src: Any, metadata: dict[str, Any]) -> str:
    """One line for a compile: ``name[num_warps=4, num_stages=3](x: *bf16 %16, n: i32, BLOCK=128)``: each
    argument's type, ``%16`` where Triton specialized it as 16-byte aligned / divisible by 16, a constexpr's value."""
    name = str(getattr(src, "name", "unknown"))
    signature = getattr(src, "signature", None) or {}
    constants = getattr(src, "constants", None) or {}
    attrs = getattr(src, "attrs", None) or {}
    aligned = {path[0] for path, marks in attrs.items() if len(path) == 1 and any(m[0] == "tt.divisibility" for m in marks)}
    args = []
    for i, (arg, kind) in enumerate(signature.items()):
        if kind == "constexpr":
            args.append(f"{arg}={constants.get((i,))}")
        else:
            args.append(f"{arg}: {kind}" + (" %16" if i in aligned else ""))
    options = f"num_warps={metadata.get('num_warps')}, num_stages={metadata.get('num_stages')}"
    return f"{name}[{options}]({', '.join(args)})"


class CompileWatch:
    """Reports every Triton compile of this process to ``on_compile`` while installed.

    ``install`` makes the watch Triton's compilation listener, keeping the listener found
    there and calling it first; ``uninstall`` puts that one back. One watch per process
    (the worker's main installs it); a second ``install`` is a ValueError.
    """

    def __init__(self, on_compile: Callable[[CompileEvent], None]) -> None:
        self._on_compile = on_compile
        self._phase = "start"
        self._installed = False
        self._prior: Any = None
        self._knobs: Any = None

    def serving(self) -> None:
        """Every compile from now on counts as one in a served request."""
        self._phase = "serving"

    def install(self) -> bool:
        """Listen to Triton's compiles; False (and nothing installed) when Triton or its listener is missing."""
        if self._installed:
            raise ValueError("this CompileWatch is already installed")
        try:
            from triton import knobs
        except ImportError:
            return False
        if not hasattr(knobs, "compilation") or not hasattr(knobs.compilation, "listener"):
            return False
        self._knobs = knobs.compilation
        self._prior = self._knobs.listener
        self._knobs.listener = self._compiled
        self._installed = True
        return True

    def uninstall(self) -> None:
        """Put back the listener ``install`` found (no-op when not installed)."""
        if not self._installed:
            return
        self._knobs.listener = self._prior
        self._installed = False

    def _compiled(self, *, src: Any, metadata: dict[str, Any], metadata_group: dict[str, str], times: Any, cache_hit: bool) -> None:
        if self._prior is not None:
            self._prior(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)
        signature = describe(src, metadata)
        event = CompileEvent(
            kernel=str(getattr(src, "name", "unknown")),
            signature=signature,
            seconds=float(getattr(times, "total", 0)) / 1e6,  # Triton's compile times are in microseconds
            phase=self._phase,
            cache_hit=bool(cache_hit),
        )
        if event.phase == "serving":
            how = "loaded from the disk cache" if cache_hit else "compiled"
            log.warning("kernel %s %s while serving (%.2f s): %s", event.kernel, how, event.seconds, signature)
        self._on_compile(event)
