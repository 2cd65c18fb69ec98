"""Launch decode attention a few times per format at 32x32K, for Nsight Compute (ncu) to profile.

    ncu --clock-control none --kernel-name regex:_decode_kernel --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight ... python3 bench/profile_decode.py nvfp4 triaxial

TUNING='{"num_warps": 2}' (JSON) passes a tuning to the kernel paged_ops picks; PART=2 or 4 runs only the
INT2 or INT4 splits of the triaxial Gluon kernel (gluon_decode.launch_decode's benchmark-only ``part``).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from decode_gpu import HQ, D, Pool

for fmt in sys.argv[1:]:
    pool = Pool(fmt, 32, 32768)
    q = torch.randn(32, HQ, D, device="cuda", dtype=torch.bfloat16)
    tuning = json.loads(os.environ.get("TUNING", "{}")) or None
    part = int(os.environ["PART"]) if os.environ.get("PART") else None
    for _ in range(4):
        pool.decode(q, tuning=tuning, part=part)
    torch.cuda.synchronize()
    k: Any = pool.last_kernel
    print(fmt, "regs", k.n_regs, "spills", k.n_spills, "smem", k.metadata.shared, flush=True)
    del pool
    torch.cuda.empty_cache()
