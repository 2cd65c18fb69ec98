"""Per-layer global KV scales: static 1.0, or calibrated from the model's own
K/V on a calibration batch before any page is written (DESIGN.md, nvfp4:
``g = amax / (6 * 448)``; fp8: ``scale = amax / 448``).

A scale is fixed for the life of the pool: pages written under one scale and
read under another would be wrong, so calibration runs once at engine start.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from kvserving.worker.model import dense_causal_attention

FP8_MAX = 448.0
E2M1_MAX = 6.0
CALIBRATION_TOKENS = 512
CALIBRATION_SEED = 0


class _AmaxRecorder:
    """AttentionOp that records |K|, |V| maxima per layer and attends densely."""

    def __init__(self, num_layers: int) -> None:
        self.k_amax = [0.0] * num_layers
        self.v_amax = [0.0] * num_layers

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k_amax[layer] = max(self.k_amax[layer], float(k.abs().max()))
        self.v_amax[layer] = max(self.v_amax[layer], float(v.abs().max()))
        return dense_causal_attention(q, k, v)


def calibration_ids(vocab_size: int, n: int = CALIBRATION_TOKENS, *, seed: int = CALIBRATION_SEED) -> list[int]:
    """Deterministic token ids for calibration when none are given."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n,), generator=g).tolist()


@torch.inference_mode()
def measure_kv_amax(model: torch.nn.Module, num_layers: int, ids: Seq[int], *, device: torch.device) -> tuple[list[float], list[float]]:
    """Per-layer max |K| and max |V| over one forward pass of ``ids``."""
    if not ids:
        raise ValueError("calibration needs at least one token")
    rec = _AmaxRecorder(num_layers)
    model(torch.tensor(list(ids), dtype=torch.long, device=device), torch.arange(len(ids), device=device), rec)
    return rec.k_amax, rec.v_amax


def scales_from_amax(kv_dtype: str, amax: Seq[float]) -> list[float]:
    """Global scale per layer that maps the measured amax to the format's top."""
    if kv_dtype == "nvfp4":
        top = E2M1_MAX * FP8_MAX
    elif kv_dtype == "fp8_e4m3":
        top = FP8_MAX
    else:
        raise ValueError(f"kv dtype {kv_dtype!r} has no global scale to calibrate")
    # An all-zero layer keeps 1.0 (any positive scale encodes zeros exactly).
    return [a / top if a > 0 else 1.0 for a in amax]
