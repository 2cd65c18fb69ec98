"""KV bytes: one flat uint8 buffer per layer in the page layout of the format,
plus per-layer global scales; reads and writes go through the paged ops.

Sizes come from a byte budget. For triaxial, each layer's buffer holds INT4
pages from the bottom and INT2 pages from the top (kernels.layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserving.kernels import paged_ops
from kvserving.kernels.layout import ALIGN, PageLayout

# kv dtype -> page format of its (first) layout
_PAGE_FORMAT = {"bf16": "bf16", "fp8_e4m3": "fp8_e4m3", "nvfp4": "nvfp4", "triaxial": "int4"}


@dataclass(slots=True, frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int


class KVStorage:
    """Owns the KV tensors of one engine."""

    def __init__(
        self,
        kv_dtype: str,
        shape: KVShape,
        *,
        page_size: int,
        budget_bytes: int,
        device: torch.device | str = "cpu",
        model_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if kv_dtype not in _PAGE_FORMAT:
            raise ValueError(f"unknown kv dtype {kv_dtype!r}; expected one of {sorted(_PAGE_FORMAT)}")
        fmt = _PAGE_FORMAT[kv_dtype]
        if fmt == "bf16" and model_dtype == torch.float32:
            # Unquantized KV is stored in the model's dtype: bf16 in serving,
            # fp32 where the model runs in fp32 (CPU tests against transformers).
            fmt = "fp32"
        self.kv_dtype = kv_dtype
        self.shape = shape
        self.page_size = page_size
        self.device = torch.device(device)
        dims = dict(page_size=page_size, kv_heads=shape.num_kv_heads, head_dim=shape.head_dim)
        self.layout = PageLayout.build(fmt, **dims)
        self.int2_layout = PageLayout.build("int2", **dims) if kv_dtype == "triaxial" else None
        per_layer = budget_bytes // shape.num_layers
        if kv_dtype == "triaxial":
            self.total_bytes = per_layer // ALIGN * ALIGN
            self.num_pages = self.total_bytes // self.layout.page_bytes  # in INT4 pages
        else:
            self.num_pages = per_layer // self.layout.page_bytes
            self.total_bytes = self.num_pages * self.layout.page_bytes
        if self.num_pages < 1:
            raise ValueError(
                f"KV budget of {budget_bytes} bytes holds no {kv_dtype} page "
                f"({self.layout.page_bytes} bytes per page per layer x {shape.num_layers} layers)"
            )
        self.buffers = torch.zeros(shape.num_layers, self.total_bytes, dtype=torch.uint8, device=self.device)
        # Per-layer global scales (fp8: tensor scale; nvfp4: FP32 global scale g).
        self.k_scales = [1.0] * shape.num_layers
        self.v_scales = [1.0] * shape.num_layers

    @property
    def bytes_per_token(self) -> float:
        return self.layout.page_bytes * self.shape.num_layers / self.page_size

    def _extra(self) -> dict:
        if self.int2_layout is None:
            return {}
        return {"int2_layout": self.int2_layout, "total_bytes": self.total_bytes}

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, page_ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Quantize-on-write of tokens into (page, slot); k, v: [T, H, D]."""
        paged_ops.write_kv(
            self.buffers[layer], self.layout, k, v, page_ids, slots,
            k_scale=self.k_scales[layer], v_scale=self.v_scales[layer],
        )

    def write_int2_pages(self, layer: int, k: torch.Tensor, v: torch.Tensor, page_ids: torch.Tensor) -> None:
        """Whole INT2 pages; k, v: [N, P, H, D]."""
        assert self.int2_layout is not None
        paged_ops.write_int2_pages(self.buffers[layer], self.int2_layout, k, v, page_ids, total_bytes=self.total_bytes)

    def decode(
        self,
        layer: int,
        q: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        sm_scale: float,
        num_int2_pages: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [B, Hq, D] against each row's cached tokens -> [B, Hq, D]."""
        extra = self._extra()
        if extra:
            extra["num_int2_pages"] = num_int2_pages
        return paged_ops.decode_attention(
            q, self.buffers[layer], self.layout, page_table, seq_lens, sm_scale=sm_scale,
            k_scale=self.k_scales[layer], v_scale=self.v_scales[layer], **extra,
        )

    def gather(
        self, layer: int, page_ids: torch.Tensor, num_tokens: int, out_k: torch.Tensor, out_v: torch.Tensor
    ) -> None:
        """Dequantize the first ``num_tokens`` tokens of ``page_ids`` into out_k/out_v [>=num_tokens, H, D]."""
        paged_ops.gather_kv(
            self.buffers[layer], self.layout, page_ids, num_tokens, out_k, out_v,
            k_scale=self.k_scales[layer], v_scale=self.v_scales[layer], **self._extra(),
        )
