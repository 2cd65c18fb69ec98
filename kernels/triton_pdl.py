"""Programmatic dependent launch (PDL) for the decode step's small Triton kernels.

Under CUDA graphs a decode step is ~450 kernels, most of them a few microseconds
long, each starting only once the one before has drained. A kernel launched
with PDL (``launch_pdl``) may start while its predecessor still runs: it
signals its own successor (``gdc_launch_dependents``), reads what no
kernel of the step writes (weights), and waits (``gdc_wait``:
``griddepcontrol.wait``, the predecessor finished and its writes visible)
before it reads or writes anything else. A kernel launched without PDL (cuBLAS,
torch's) waits for the whole of its predecessor as usual, so the chain stays
ordered whichever kernels take part. ``KernelOptions.overlaps`` says when
(sm_90 and later, asked for, never in the interpreter, which has no
``griddepcontrol``)::

    GEMM ──────────────┐ (cuBLAS)
          norm: launch, load w ─ wait ─ load x, reduce, store
                                     add_rms_norm ... (the next PDL kernel may launch here)

When it signals is the launch's ``mode`` (the constexpr ``PDL``): ``EARLY``, before its own wait (the programs
of several kernels may then wait on the SMs ahead of the one running), or ``LATE``, right after its wait (at
most one kernel waits ahead). Launches of one row (a one-token step) signal late, the rest early: the decode
step measured 2.7-4.1 % faster at 1 x 4K and 1.6-3.5 % at 1 x 32K with one-row launches late, and with every
Triton kernel late 2.5 % slower at 8 x 4K with FP8 weights, the same within 0.7 % at 16 and 64 x 4K and 16 x 32K
(docs/performance-log/engine-gpu.md)::

    EARLY: launch ─ load w ─ wait ─ ...       LATE: load w ─ wait ─ launch ─ ...
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from .options import KernelOptions

OFF, EARLY, LATE = 0, 1, 2  # the constexpr PDL: no PDL; let the next kernel launch before / after our wait
LATE_ROWS = 1  # launches of at most this many rows (tokens, or sequences for attention) signal LATE


def mode(pdl: bool, rows: int) -> int:
    """The constexpr ``PDL`` of a launch of ``rows`` rows: OFF without PDL, else LATE up to ``LATE_ROWS`` rows and
    EARLY above."""
    if not pdl:
        return OFF
    return LATE if rows <= LATE_ROWS else EARLY


@triton.jit
def start(PDL: tl.constexpr):
    """EARLY: let the next kernel launch now (it waits for this one's end before it reads our outputs)."""
    if PDL == 1:  # EARLY (a jit function reads literals, not module globals)
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait until the kernel before has finished and its writes are visible; call before touching any tensor a
    kernel of the step writes. LATE: then let the next kernel launch."""
    if PDL != 0:  # not OFF
        tl.extra.cuda.gdc_wait()
    if PDL == 2:  # LATE
        tl.extra.cuda.gdc_launch_dependents()


def launch_args(pdl: bool) -> dict[str, Any]:
    """The launch's keyword arguments: ``launch_pdl`` when on (none otherwise: the interpreter has no such option)."""
    return {"launch_pdl": True} if pdl else {}


def launch(pdl: bool, rows: int) -> dict[str, Any]:
    """A ``start`` / ``wait`` kernel's launch keywords: its constexpr ``PDL`` (``mode``) and ``launch_args``."""
    return {"PDL": mode(pdl, rows), **launch_args(pdl)}


@functools.cache
def _env_overlaps(device: torch.device) -> bool:
    return KernelOptions.from_env().overlaps(device)


def resolve(pdl: bool | None, device: torch.device) -> bool:
    """``pdl``, or when None the environment's choice for ``device`` (``KernelOptions.overlaps``; the environment
    read once per device): for the kernels the model calls directly (norms, the FP8 GEMV), which no
    ``KernelOptions`` reaches."""
    return _env_overlaps(device) if pdl is None else pdl
