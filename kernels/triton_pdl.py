"""Programmatic dependent launch (PDL) for the decode step's small Triton kernels.

Under CUDA graphs a decode step is ~450 kernels, most of them a few microseconds
long, each starting only once the one before has drained. A kernel launched
with PDL (``launch_pdl``) may start while its predecessor still runs: it
signals its own successor at once (``gdc_launch_dependents``), reads what no
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
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from .options import KernelOptions


@triton.jit
def start(PDL: tl.constexpr):
    """Let the next kernel launch now (it waits for this one's end before it reads our outputs)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait until the kernel before has finished and its writes are visible; call before touching any tensor a
    kernel of the step writes."""
    if PDL:
        tl.extra.cuda.gdc_wait()


def launch_args(pdl: bool) -> dict[str, Any]:
    """The launch's keyword arguments: ``launch_pdl`` when on (none otherwise: the interpreter has no such option)."""
    return {"launch_pdl": True} if pdl else {}


@functools.cache
def _env_overlaps(device: torch.device) -> bool:
    return KernelOptions.from_env().overlaps(device)


def resolve(pdl: bool | None, device: torch.device) -> bool:
    """``pdl``, or when None the environment's choice for ``device`` (``KernelOptions.overlaps``; the environment
    read once per device): for the kernels the model calls directly (norms, the FP8 GEMV), which no
    ``KernelOptions`` reaches."""
    return _env_overlaps(device) if pdl is None else pdl
