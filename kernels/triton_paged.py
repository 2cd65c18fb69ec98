"""Triton implementations of the paged-KV ops, under the names paged_ops dispatches to.

Arguments arrive checked (paged_ops runs paged_ref.check_*). The kernels
need power-of-two page size and head dim (tl.arange), as every supported
model has; other shapes are refused here and run on the reference.
"""

from __future__ import annotations

from .triton_decode import decode_attention
from .triton_gather import gather_kv
from .triton_write import write_int2_pages, write_kv

__all__ = ["decode_attention", "gather_kv", "write_int2_pages", "write_kv"]
