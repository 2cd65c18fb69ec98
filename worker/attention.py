"""The engine's attention op: the three paths of DESIGN.md over the paged KV.

For each layer of one batched forward step:

1. quantize-on-write: the step's new K/V go into their pages (INT2 pages of
   triaxial are written whole, since their key scales span the page);
2. decode rows (one new token after a cached prefix) attend over the paged
   pool through the fused decode op;
3. initial prefill chunks (start 0) attend on the fresh, unquantized K/V;
4. extend chunks (start > 0) attend over the packed cached prefix and the
   fresh chunk through ``paged_ops.extend_attention`` (on a GPU the paged
   prefill kernel dequantizes pages in registers: no workspace pass).

Cost of the extend path per chunk and layer: one read of the cached prefix's
packed pages (``start`` tokens) per block of chunk tokens, which the L2 mostly
serves; the arithmetic (chunk x prefix) dominates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserving.kernels import paged_ops
from kvserving.worker.kv.storage import KVStorage


@dataclass(slots=True)
class PrefillSpan:
    """A prompt chunk: batch rows [row, row+n) hold positions [start, start+n)."""

    row: int
    start: int
    n: int
    prefix_pages: torch.Tensor  # int32 page ids covering [0, start), token order


@dataclass(slots=True)
class AttentionMetadata:
    """What one step's attention needs; built by the model runner."""

    write_rows: torch.Tensor  # long [W]: batch rows written token by token
    write_pages: torch.Tensor  # int32 [W]
    write_slots: torch.Tensor  # int32 [W]
    # triaxial: whole INT2 pages a prompt chunk writes, built once a step (a tensor made from a list in every layer
    # would copy to the device and wait for it there, 36 times a step)
    int2_rows: torch.Tensor | None = None  # long [N * P]: batch rows of the N pages, page by page
    int2_page_ids: torch.Tensor | None = None  # int32 [N]
    decode_rows: torch.Tensor | None = None  # long [B]
    page_table: torch.Tensor | None = None  # int32 [B, max_pages]
    seq_lens: torch.Tensor | None = None  # int32 [B]
    num_int2_pages: torch.Tensor | None = None  # int32 [B] (triaxial)
    prefills: list[PrefillSpan] = field(default_factory=list)
    # Every row is one decode token, rows in batch order (write_* and the decode fields cover all rows,
    # decode_rows is unused): the shape CUDA graphs capture, with no indexing by rows.
    all_decode: bool = False


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_offset: int, sm_scale: float) -> torch.Tensor:
    """q: [n, Hq, D] at positions q_offset.., k/v: [L, H, D] at 0..L-1 -> [n, Hq, D] (GQA)."""
    n, length = q.shape[0], k.shape[0]
    # [heads, tokens, dim] for SDPA
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if q_offset == 0 and n == length and q.is_cuda:
        # The fused (flash) kernel takes 4-D [batch, heads, tokens, dim] and equal head counts; 3-D or enable_gqa
        # falls back to the fp32 math path (8K-token prefill ~6x slower, docs/performance-log/engine-gpu.md).
        group = qh.shape[0] // kh.shape[0]
        kh, vh = kh.repeat_interleave(group, dim=0), vh.repeat_interleave(group, dim=0)
        out = F.scaled_dot_product_attention(qh[None], kh[None], vh[None], is_causal=True, scale=sm_scale)[0]
    elif q_offset == 0 and n == length:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=sm_scale, enable_gqa=True)
    else:
        q_pos = torch.arange(q_offset, q_offset + n, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=sm_scale, enable_gqa=True)
    return out.transpose(0, 1)


class PagedAttention:
    """AttentionOp of the model code, bound to one engine's storage."""

    def __init__(self, storage: KVStorage, *, head_dim: int, workspace_tokens: int, dtype: torch.dtype) -> None:
        self.storage = storage
        self.sm_scale = 1.0 / math.sqrt(head_dim)
        # No dequantize workspace any more (the extend path reads the pages): only its bound on a sequence.
        self.max_tokens = workspace_tokens
        self.meta: AttentionMetadata | None = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        if meta is None:
            raise RuntimeError("PagedAttention called without metadata for the step")
        st = self.storage
        if meta.all_decode:
            assert meta.page_table is not None and meta.seq_lens is not None
            st.write(layer, k, v, meta.write_pages, meta.write_slots)
            return st.decode(
                layer, q, meta.page_table, meta.seq_lens, sm_scale=self.sm_scale, num_int2_pages=meta.num_int2_pages,
            ).to(q.dtype)  # fmt: skip
        # 1. quantize-on-write
        if meta.write_rows.numel():
            rows = meta.write_rows
            st.write(layer, k[rows], v[rows], meta.write_pages, meta.write_slots)
        if meta.int2_page_ids is not None:
            assert meta.int2_rows is not None
            pages = (meta.int2_page_ids.numel(), st.page_size)
            # k, v rows of each page -> [N, P, H, D]
            ks = k[meta.int2_rows].view(*pages, *k.shape[1:])
            vs = v[meta.int2_rows].view(*pages, *v.shape[1:])
            st.write_int2_pages(layer, ks, vs, meta.int2_page_ids)

        out = torch.empty_like(q)
        # 2. decode over the paged pool
        if meta.decode_rows is not None and meta.decode_rows.numel():
            assert meta.page_table is not None and meta.seq_lens is not None
            out[meta.decode_rows] = st.decode(
                layer,
                q[meta.decode_rows],
                meta.page_table,
                meta.seq_lens,
                sm_scale=self.sm_scale,
                num_int2_pages=meta.num_int2_pages,
            ).to(q.dtype)
        # 3./4. prefill and extend
        for span in meta.prefills:
            r, n, s = span.row, span.n, span.start
            if s == 0:
                out[r : r + n] = causal_attention(q[r : r + n], k[r : r + n], v[r : r + n], q_offset=0, sm_scale=self.sm_scale)
                continue
            if s + n > self.max_tokens:
                raise ValueError(f"extend of {s + n} tokens exceeds the engine's max_model_len ({self.max_tokens})")
            # the paged prefill kernel reads the packed prefix itself (GPU); the reference dequantizes it (CPU)
            out[r : r + n] = paged_ops.extend_attention(
                q[r : r + n],
                k[r : r + n],
                v[r : r + n],
                st.layer(layer),
                span.prefix_pages,
                s,
                sm_scale=self.sm_scale,
                options=st.options,
            )
        return out
