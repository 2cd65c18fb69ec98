"""Real Triton compiles through CompileWatch without a GPU: ``python compile_watch_child.py [CASE]``.

Launches kernels through Triton's JIT under a driver that reports an sm_90 target and
launches nothing (Triton compiles each new specialization for sm_90, as it would on the
device), with the watch installed; prints one JSON list of the events (kernel, phase,
cache_hit, seconds, signature). CASE ``watch`` (the default): a Triton kernel and a Gluon
kernel that takes a layout constexpr; ``int2_first``: the triaxial extend's page listing
at the prefix page counts a served turn can have. Run without TRITON_INTERPRET (kernels
must be JIT functions) and with TRITON_CACHE_DIR set.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch
import triton
import triton.compiler
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.runtime import driver

from kvserving.worker.compiles import CompileEvent, CompileWatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_driver import NotLaunched, OfflineDriver  # noqa: E402


_compile = triton.compiler.compile


def _compile_only(src: Any, target: Any = None, options: Any = None, **kw: Any) -> NotLaunched:
    _compile(src, target=target, options=options, **kw)  # the real compile: it calls the listener
    return NotLaunched()


@triton.jit
def _scale_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(x_ptr + offs, x * 2.0, mask=offs < n)


@gluon.jit
def _fill_kernel(out_ptr, n, layout: gl.constexpr):
    offs = gl.arange(0, 128, layout=layout)
    gl.store(out_ptr + offs, offs.to(gl.float32), mask=offs < n)


def watch_case(events: list[CompileEvent], watch: CompileWatch) -> None:
    x = torch.zeros(128)
    _scale_kernel[(1,)](x, 100, BLOCK=128)  # n specialized as neither 1 nor a multiple of 16
    _scale_kernel[(1,)](x, 101, BLOCK=128)  # the same specialization: no compile
    _scale_kernel[(1,)](x, 96, BLOCK=128)  # n divisible by 16: a second one
    watch.serving()
    layout = gl.BlockedLayout([1], [32], [4], [0])
    _fill_kernel[(1,)](x, 100, layout, num_warps=4)
    _fill_kernel[(1,)](x, 100, layout, num_warps=4)
    watch.uninstall()
    _scale_kernel[(1,)](x, 1, BLOCK=128)  # compiled, not reported: the watch is gone


def int2_first_case(events: list[CompileEvent], watch: CompileWatch) -> None:
    from kvserving.kernels import gluon_extend_tri

    for pages in (4, 128, 1, 137, 16, 1000, 1280, 4096):  # the warm-up's kinds of prefix, then served ones
        if pages == 137:
            watch.serving()
        gluon_extend_tri.int2_first(torch.arange(pages, dtype=torch.int32))
    watch.uninstall()


def main() -> None:
    driver.set_active(OfflineDriver(90))  # type: ignore[arg-type]
    triton.compiler.compile = _compile_only
    events: list[CompileEvent] = []
    watch = CompileWatch(events.append)
    assert watch.install()
    {"watch": watch_case, "int2_first": int2_first_case}[sys.argv[1] if len(sys.argv) > 1 else "watch"](events, watch)
    json.dump([dataclasses.asdict(e) for e in events], sys.stdout)


if __name__ == "__main__":
    main()
