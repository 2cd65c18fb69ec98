"""Launch decode attention per format at 32x32K (or SHAPE) for Nsight Compute (ncu): WARM launches of each argument first, then
one launch of each, in argument order, so ncu profiles the last len(args) launches (``gpu_run.sh ncu``):

    ncu --clock-control none --kernel-name regex:_decode_kernel --launch-skip 9 --launch-count 3 \
        --section SpeedOfLight ... python3 bench/profile_decode.py nvfp4 triaxial fp8_e4m3

An argument is a format. TUNING='{"num_warps": 2}' (JSON) passes a tuning to the kernel paged_ops picks; WARM
(default 3) sets the warm-up launches per argument; SHAPE=64x4096 (batch x context) another shape than 32x32768.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from decode_gpu import HQ, D, Pool

from kvserving.argtypes import decode_shapes

tuning = json.loads(os.environ.get("TUNING", "{}")) or None
((batch, context),) = decode_shapes(os.environ.get("SHAPE", "32x32768"))
runs = [(fmt, Pool(fmt, batch, context)) for fmt in sys.argv[1:]]
q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
for _, pool in runs:
    for _ in range(int(os.environ.get("WARM", "3"))):
        pool.decode(q, tuning=tuning)
torch.cuda.synchronize()
for arg, pool in runs:  # the profiled launches
    pool.decode(q, tuning=tuning)
    torch.cuda.synchronize()
    k: Any = pool.last_kernel
    print(arg, "regs", k.n_regs, "spills", k.n_spills, "smem", k.metadata.shared, flush=True)
