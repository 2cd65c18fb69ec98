"""Input checks shared by the reference quantizers, so every codec refuses bad input the same way.

Quantizers take fp32/bf16/fp16 tensors of finite values and compute in fp32;
fp64 is refused rather than silently rounded to fp32 first. Scales are held
in fp32 by the kernels, so a scale that under- or overflows fp32 is refused.
"""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_float_tensor(x: torch.Tensor, name: str = "x") -> None:
    """Raise ValueError unless ``x`` is an fp32/bf16/fp16 tensor of finite values."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must have dtype float32, bfloat16 or float16, got {x.dtype}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or Inf")


def check_positive_scale(value: float, name: str) -> torch.Tensor:
    """Return ``value`` as an fp32 scalar tensor; raise ValueError unless it is finite and > 0 in fp32."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a real number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value}")
    as_f32 = torch.tensor(value, dtype=torch.float32)
    if not (bool(torch.isfinite(as_f32)) and float(as_f32) > 0):
        raise ValueError(f"{name} must be a positive finite fp32 value, got {value}")
    return as_f32


def check_out_dtype(dtype: torch.dtype) -> None:
    """Raise ValueError unless ``dtype`` is a dequantization output dtype (fp32/bf16/fp16)."""
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
