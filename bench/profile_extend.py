"""Launch the Gluon extend kernels once per argument, for Nsight Compute (ncu) to count what a launch does.

    ncu --clock-control none --kernel-name regex:_gl_extend --metrics ... python3 bench/profile_extend.py \
        nvfp4 tri fi

Each argument is ``nvfp4`` (gluon_extend), ``tri`` (gluon_extend_tri) or ``fi`` (FlashInfer's paged prefill on
bf16 pages, the peer: extend_gpu.flashinfer_prefill); the shape is the bench's 512 new tokens on 32K cached
(NEW / PREFIX override it). Every launch is listed with its argument, in order, so ncu's launches can be matched
to the arguments.
"""

from __future__ import annotations

import os
import sys

import torch
from decode_gpu import HQ, D, H, Pool
from extend_gpu import flashinfer_prefill

from kvserving.kernels import gluon_extend, gluon_extend_tri

NEW = int(os.environ.get("NEW", "512"))
PREFIX = int(os.environ.get("PREFIX", "32768"))
SM = D**-0.5

ours = {"triaxial" if a == "tri" else "nvfp4" for a in sys.argv[1:] if a != "fi"}
pools = {fmt: Pool(fmt, 1, PREFIX) for fmt in ours}
q = torch.randn(NEW, HQ, D, device="cuda", dtype=torch.bfloat16)
k = torch.randn(NEW, H, D, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
for i, arg in enumerate(sys.argv[1:]):
    if arg == "fi":
        flashinfer_prefill("bf16", NEW, PREFIX, q, k, v)[0]()
        torch.cuda.synchronize()
        print(f"launch {i}: {arg}", flush=True)
        continue
    if arg not in ("nvfp4", "tri"):
        raise SystemExit(f"unknown argument {arg!r}: nvfp4, tri or fi")
    pool = pools["triaxial" if arg == "tri" else "nvfp4"]
    row = pool.page_table[0].contiguous()
    if arg == "tri":
        gluon_extend_tri.extend_attention(q, k, v, pool.kv, row, PREFIX, sm_scale=SM)
    else:
        gluon_extend.extend_attention(q, k, v, pool.kv, row, PREFIX, sm_scale=SM)
    torch.cuda.synchronize()
    print(f"launch {i}: {arg}", flush=True)
