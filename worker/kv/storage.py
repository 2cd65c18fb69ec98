"""KV bytes: flat uint8 buffers in the page layout of the format, plus per-layer
global scales; reads and writes go through the paged ops.

Two layouts (``kv_cache.layout``)::

    layer_major  buffers [layers, total_bytes]      row l: page 0 of layer l | page 1 of layer l | ...
    page_major   buffers [1, layers * total_bytes]  page 0 of layers 0, 1, ... | page 1 of layers 0, 1, ... | ...

Each row of ``buffers`` is one NIXL region; a run of consecutive pages is one
contiguous span per row (``region_geometry``), so a transfer moves one region
per run in ``page_major`` and one per run per layer in ``layer_major``. Page ids
and the pools are the same in both (kernels/page_ids.py: the page-major offsets).

Sizes come from a byte budget. For triaxial, each layer's buffer is a whole
number of slabs, each holding INT4 or INT2 pages (kernels.page_ids.Slabs;
the pool places them, worker/triaxial_pool.py). Each
layer is handed to the ops as one ``PagedKV`` (buffer, layouts, scales), built
once and rebuilt only when the scales change; the kernel options
(environment overrides) are read once, when the storage is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserving.kernels import paged_ops
from kvserving.kernels.layout import PageLayout
from kvserving.kernels.options import KernelOptions
from kvserving.kernels.page_ids import slab_bytes
from kvserving.kernels.paged_kv import PagedKV

# kv dtype -> page formats of its layout and of its INT2 layout (triaxial only)
_PAGE_FORMATS: dict[str, tuple[str, str | None]] = {
    "bf16": ("bf16", None),
    "fp8_e4m3": ("fp8_e4m3", None),
    "nvfp4": ("nvfp4", None),
    "triaxial": ("int4", "int2"),
}


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
        options: KernelOptions | None = None,
        page_major: bool = False,
    ) -> None:
        if kv_dtype not in _PAGE_FORMATS:
            raise ValueError(f"unknown kv dtype {kv_dtype!r}; expected one of {sorted(_PAGE_FORMATS)}")
        fmt, int2_fmt = _PAGE_FORMATS[kv_dtype]
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
        self.int2_layout = PageLayout.build(int2_fmt, **dims) if int2_fmt else None
        per_layer = budget_bytes // shape.num_layers
        # triaxial: whole slabs (the pool's total_bytes, from which INT2 offsets count)
        unit, name = self.layout.page_bytes, "page"
        if self.int2_layout is not None:
            unit, name = slab_bytes(self.layout.page_bytes, self.int2_layout.page_bytes), "slab"
        self.total_bytes = per_layer // unit * unit
        self.num_pages = self.total_bytes // self.layout.page_bytes  # triaxial: in INT4 pages
        if self.total_bytes < 1:
            raise ValueError(
                f"KV budget of {budget_bytes} bytes holds no {kv_dtype} {name} "
                f"({unit} bytes per {name} per layer x {shape.num_layers} layers)"
            )
        self.page_major = page_major
        rows = (1, shape.num_layers * self.total_bytes) if page_major else (shape.num_layers, self.total_bytes)
        self.buffers = torch.zeros(*rows, dtype=torch.uint8, device=self.device)  # one NIXL region a row
        self.options = KernelOptions.from_env() if options is None else options
        # Per-layer global scales (fp8: tensor scale; nvfp4: FP32 global scale g), set through the properties.
        self._k_scales = [1.0] * shape.num_layers
        self._v_scales = [1.0] * shape.num_layers
        self._layers = self._build_layers()

    def _build_layers(self) -> list[PagedKV]:
        n = self.shape.num_layers
        if self.page_major:
            whole = self.buffers[0]
            return [
                PagedKV(whole, self.layout, self._k_scales[i], self._v_scales[i], self.int2_layout, whole.numel(), layers=n, layer=i)
                for i in range(n)
            ]
        return [
            PagedKV(self.buffers[i], self.layout, self._k_scales[i], self._v_scales[i], self.int2_layout, self.total_bytes)
            for i in range(n)
        ]

    def region_geometry(self) -> tuple[int, int, int]:
        """(bytes of one page, of one INT2 page (0 unless triaxial), total) in each row of ``buffers``: the
        page's bytes of every layer in ``page_major``, of one layer in ``layer_major`` (a layer's strides)."""
        kv = self._layers[0]
        return kv.page_stride, kv.int2_stride, kv.total_bytes

    @property
    def k_scales(self) -> list[float]:
        """Global K scale per layer (a copy: assign a new list to change them)."""
        return list(self._k_scales)

    @k_scales.setter
    def k_scales(self, scales: list[float]) -> None:
        self._k_scales = self._checked_scales(scales, "k_scales")
        self._layers = self._build_layers()

    @property
    def v_scales(self) -> list[float]:
        """Global V scale per layer (a copy: assign a new list to change them)."""
        return list(self._v_scales)

    @v_scales.setter
    def v_scales(self, scales: list[float]) -> None:
        self._v_scales = self._checked_scales(scales, "v_scales")
        self._layers = self._build_layers()

    def _checked_scales(self, scales: list[float], name: str) -> list[float]:
        if len(scales) != self.shape.num_layers:
            raise ValueError(f"{name} needs one scale per layer ({self.shape.num_layers}), got {len(scales)}")
        return [float(s) for s in scales]

    @property
    def triaxial(self) -> bool:
        """INT4 and INT2 pages in each layer's buffer."""
        return self.int2_layout is not None

    @property
    def bytes_per_token(self) -> float:
        return self.layout.page_bytes * self.shape.num_layers / self.page_size

    def layer(self, layer: int) -> PagedKV:
        """Layer ``layer``'s KV as the paged ops take it."""
        return self._layers[layer]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, page_ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Quantize-on-write of tokens into (page, slot); k, v: [T, H, D]."""
        paged_ops.write_kv(self._layers[layer], k, v, page_ids, slots, options=self.options)

    def write_int2_pages(self, layer: int, k: torch.Tensor, v: torch.Tensor, page_ids: torch.Tensor) -> None:
        """Whole INT2 pages; k, v: [N, P, H, D]."""
        paged_ops.write_int2_pages(self._layers[layer], k, v, page_ids, options=self.options)

    def requantize_to_int2(self, src_ids: list[int], dst_ids: list[int]) -> None:
        """Age-down: re-store full INT4 pages ``src_ids`` as INT2 pages ``dst_ids`` (same order),
        every layer. The INT4 codes are dequantized to fp32 (exact: ``code*scale+zero``) and
        quantized again by the INT2 rules (values per token groups, keys per channel over the
        page), the same ops a fresh INT2 page is written with; the source pages are only read."""
        if not self.triaxial:
            raise ValueError(f"requantize_to_int2 needs triaxial KV, got {self.kv_dtype!r}")
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source pages for {len(dst_ids)} destination pages")
        if not src_ids:
            return
        n, p = len(src_ids), self.page_size
        h, d = self.shape.num_kv_heads, self.shape.head_dim
        src = torch.tensor(src_ids, dtype=torch.int32, device=self.device)
        dst = torch.tensor(dst_ids, dtype=torch.int32, device=self.device)
        k = torch.empty(n * p, h, d, dtype=torch.float32, device=self.device)  # [n*P, H, D]
        v = torch.empty_like(k)
        for layer in range(self.shape.num_layers):
            self.gather(layer, src, n * p, k, v)
            self.write_int2_pages(layer, k.view(n, p, h, d), v.view(n, p, h, d), dst)

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
        """q: [B, Hq, D] against each row's cached tokens -> [B, Hq, D].

        num_int2_pages (int32 [B]): INT2 pages leading each row; required when triaxial, ignored otherwise."""
        n2 = num_int2_pages if self.triaxial else None
        return paged_ops.decode_attention(
            q, self._layers[layer], page_table, seq_lens, sm_scale=sm_scale, num_int2_pages=n2, options=self.options,
        )  # fmt: skip

    def gather(self, layer: int, page_ids: torch.Tensor, num_tokens: int, out_k: torch.Tensor, out_v: torch.Tensor) -> None:
        """Dequantize the first ``num_tokens`` tokens of ``page_ids`` into out_k/out_v [>=num_tokens, H, D]."""
        paged_ops.gather_kv(self._layers[layer], page_ids, num_tokens, out_k, out_v, options=self.options)
