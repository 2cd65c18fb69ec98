"""A cost model for simulator tests on tiny pools (imported by the simulator's test files)."""

from __future__ import annotations

from kvserving.sim.costs import CostModel


def tiny_costs(pages: int) -> CostModel:
    """fp8 at 1 layer x 1 head x head_dim 32: 64 bytes per token, 1 KiB per page of 16; ``pages`` pages per worker."""
    return CostModel(
        name="t",
        layers=1,
        kv_heads=1,
        head_dim=32,
        kv_bytes_per_worker=pages * 1024,
        prefill_token_s=1e-4,
        prefill_attn_s=0.0,
        decode_step_s=1e-3,
        decode_ctx_s={"fp8_e4m3": 0.0},
    )
