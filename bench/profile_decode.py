"""Launch decode attention a few times per format at 32x32K, for Nsight Compute (ncu) to profile.

    ncu --clock-control none --kernel-name regex:_decode_kernel --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight ... python3 bench/profile_decode.py nvfp4 triaxial

TUNING='{"PART": 2}' (JSON) passes a Gluon tuning, e.g. to profile the triaxial INT2 splits alone.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from decode_gpu import HQ, D, Pool

from kvserving.kernels import triton_decode

for fmt in sys.argv[1:]:
    pool = Pool(fmt, 32, 32768)
    q = torch.randn(32, HQ, D, device="cuda", dtype=torch.bfloat16)
    tuning = json.loads(os.environ.get("TUNING", "{}"))
    for _ in range(4):
        pool.decode(q, **({"tuning": tuning} if tuning else {}))
    torch.cuda.synchronize()
    k: Any = triton_decode.LAST_KERNEL[0]
    print(fmt, "regs", k.n_regs, "spills", k.n_spills, "smem", k.metadata.shared, flush=True)
    del pool
    torch.cuda.empty_cache()
