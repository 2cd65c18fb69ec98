"""Kernel options: the environment overrides of the paged-KV ops, read once into one frozen value.

Every knob a user can turn without code lives here, and this is the only
module of ``kvserving.kernels`` that reads the environment
(tests/kernels/test_kernel_layers.py checks it). ``KernelOptions.from_env()``
is called by whoever owns the KV (the worker's ``KVStorage``, once) or by
``paged_ops`` when a caller passes no options; everything below takes the
value as an argument.

==========================  ==============  ===================================================
variable                    field           meaning
==========================  ==============  ===================================================
KVSERVING_PAGED_BACKEND     backend         ``reference`` or ``triton`` for every op (unset:
                                            Triton for CUDA buffers, the reference otherwise)
KVSERVING_CHECK_VALUES=1    check_values    value checks (page ids in range ...) on CUDA too,
                                            at one device sync per call
KVSERVING_DECODE_KERNEL     decode_kernel   ``auto`` (Gluon where it is supported, else ``tl``),
                                            ``gluon`` (refuse a call Gluon cannot run) or ``tl``
KVSERVING_TRITON_FAST=0/1   triton_fast     force the ``tl`` decode's inline-assembly (1) or
                                            portable (0) decoders (unset: assembly on a GPU)
KVSERVING_PDL=0             pdl             the decode step's kernels launch without
                                            programmatic dependent launch (unset: with it,
                                            where ``capability``'s PDL column has it)
KVSERVING_BF16_GEMV=0       bf16_gemv       a bf16 model's projections at 1-64 tokens run cuBLAS
                                            instead of the Triton GEMV (1-2) and block GEMM
                                            (3-64; ``worker.model.product``; unset: Triton)
KVSERVING_FUSED_MERGE=0     fused_merge     the Gluon decode's splits merged by a launch of
                                            their own (unset: in the kernel, ``gluon_decode``'s
                                            FUSE, where the plan has at most 8 splits)
TRITON_INTERPRET=1          interpret       kernels run in Triton's interpreter (no assembly)
==========================  ==============  ===================================================
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .capability import device_choice

BACKENDS = ("reference", "triton")
DECODE_KERNELS = ("auto", "gluon", "tl")


@dataclass(frozen=True, slots=True)
class KernelOptions:
    """How the paged-KV ops pick and run their kernels (defaults: chosen by the tensors' device)."""

    backend: str | None = None  # None: "triton" for CUDA buffers, "reference" otherwise
    check_values: bool = False  # value checks on CUDA tensors too (CPU tensors are always checked)
    decode_kernel: str = "auto"
    triton_fast: bool | None = None  # None: inline-assembly decoders on a real GPU
    pdl: bool = True  # programmatic dependent launch where the device has it (``overlaps``)
    bf16_gemv: bool = True  # bf16 products at 1-64 tokens through the Triton kernels (``worker.model.product``)
    fused_merge: bool = True  # the Gluon decode's splits merged by their last program (``gluon_decode``'s FUSE)
    interpret: bool = False

    def __post_init__(self) -> None:
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}; expected one of {BACKENDS} or None")
        if self.decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel={self.decode_kernel!r}; expected one of {DECODE_KERNELS}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> KernelOptions:
        """The options the environment asks for (``env`` defaults to ``os.environ``); a bad value is a
        ValueError naming the variable."""
        env = os.environ if env is None else env
        backend = env.get("KVSERVING_PAGED_BACKEND") or None
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"KVSERVING_PAGED_BACKEND={backend!r}; expected one of {BACKENDS} (or unset)")
        kernel = env.get("KVSERVING_DECODE_KERNEL") or "auto"
        if kernel not in DECODE_KERNELS:
            raise ValueError(f"KVSERVING_DECODE_KERNEL={kernel!r}; expected one of {DECODE_KERNELS} (or unset)")
        fast = env.get("KVSERVING_TRITON_FAST") or None
        if fast not in (None, "0", "1"):
            raise ValueError(f"KVSERVING_TRITON_FAST={fast!r}; expected 0 or 1 (or unset)")
        pdl = env.get("KVSERVING_PDL") or "1"
        if pdl not in ("0", "1"):
            raise ValueError(f"KVSERVING_PDL={pdl!r}; expected 0 or 1 (or unset)")
        gemv = env.get("KVSERVING_BF16_GEMV") or "1"
        if gemv not in ("0", "1"):
            raise ValueError(f"KVSERVING_BF16_GEMV={gemv!r}; expected 0 or 1 (or unset)")
        fused = env.get("KVSERVING_FUSED_MERGE") or "1"
        if fused not in ("0", "1"):
            raise ValueError(f"KVSERVING_FUSED_MERGE={fused!r}; expected 0 or 1 (or unset)")
        return cls(
            backend=backend,
            check_values=env.get("KVSERVING_CHECK_VALUES") == "1",
            decode_kernel=kernel,
            triton_fast=None if fast is None else fast == "1",
            pdl=pdl == "1",
            bf16_gemv=gemv == "1",
            fused_merge=fused == "1",
            interpret=env.get("TRITON_INTERPRET") == "1",
        )

    def fast_decoders(self, device: torch.device) -> bool:
        """Inline-assembly decoders in the ``tl`` decode: on a real GPU unless forced; never in the interpreter."""
        if self.triton_fast is not None:
            return self.triton_fast
        return device.type == "cuda" and not self.interpret

    def overlaps(self, device: torch.device) -> bool:
        """Whether the kernels that support it launch on ``device`` with programmatic dependent launch: asked for
        (``pdl``), a GPU whose capability row has it, and not the interpreter (it has no ``griddepcontrol``)."""
        return self.pdl and not self.interpret and device_choice(device).pdl
