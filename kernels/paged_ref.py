"""Reference paged-KV ops in readable torch: quantize-on-write, extend gather and decode attention.

These functions are the spec the Triton kernels (``triton_write``,
``triton_gather``, ``triton_decode``, ``gluon_decode``) are held to, and what
the engine runs on CPU. They read and write exactly the page bytes of
``kernels.layout`` through ``PageLayout.views`` and quantize with the
reference codecs (``fp8``, ``nvfp4``, ``intquant``), so a page written here and
a page written by a kernel are the same bytes.

Addressing: one layer's KV is a ``PagedKV`` (a flat uint8 buffer, its
layouts and scales). Page ``i`` of a plain layout starts at byte
``i * page_bytes``; an INT2 page id carries ``INT2_PAGE_FLAG`` and counts down
from ``total_bytes``: ``page_ids.page_byte_offsets``, through
``PagedKV.page_offsets`` (layout.py draws it).

The ``check_*`` functions validate arguments for both backends (paged_ops.py
calls them before dispatching). Shape and dtype checks are free; checks of
*values* (page ids in range, lengths that fit the page table) need the data on
the host, so the dispatcher runs them only on CPU tensors unless asked to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .fp8 import dequantize_fp8, quantize_fp8
from .intquant import dequantize_groups, dequantize_int2_keys, quantize_groups, quantize_int2_keys
from .nvfp4 import dequantize_nvfp4, quantize_nvfp4
from .page_ids import INT2_PAGE_FLAG
from .paged_kv import PagedKV

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# ----------------------------------------------------------------------------
# argument checks (shared by both backends; the PagedKV checked itself when built)
# ----------------------------------------------------------------------------


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _check_index(t: Tensor, name: str, shape: tuple[int, ...], device: torch.device) -> None:
    _need(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
    _need(tuple(t.shape) == shape, f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    _need(t.device == device, f"{name} is on {t.device}, the buffer on {device}")


def _check_floats(kv: PagedKV, **tensors: Tensor) -> None:
    for name, x in tensors.items():
        _need(x.dtype in FLOAT_DTYPES, f"{name} must be float32/float16/bfloat16, got {x.dtype}")
        _need(x.device == kv.buffer.device, f"{name} is on {x.device}, the buffer on {kv.buffer.device}")


def check_page_ids(page_ids: Tensor, kv: PagedKV) -> None:
    """Every id addresses a page that lies inside ``[0, total_bytes)`` (values; host sync on GPU)."""
    ids = page_ids.reshape(-1).long().cpu()
    _need(bool((ids >= 0).all()), "page ids must be >= 0")
    flagged = (ids & INT2_PAGE_FLAG) != 0
    index = ids & ~INT2_PAGE_FLAG
    if not kv.triaxial:
        _need(not bool(flagged.any()), "page id carries INT2_PAGE_FLAG but the KV has no INT2 pages (not triaxial)")
    else:
        n2 = kv.num_int2_pages
        _need(bool((index[flagged] < n2).all()), f"INT2 page index out of range (at most {n2} INT2 pages fit in {kv.total_bytes} bytes)")
    n = kv.num_pages
    _need(bool((index[~flagged] < n).all()), f"page id out of range (at most {n} {kv.layout.fmt} pages fit in {kv.total_bytes} bytes)")


def check_write_kv(kv: PagedKV, k: Tensor, v: Tensor, page_ids: Tensor, slots: Tensor, *, values: bool) -> None:
    layout = kv.layout
    _need(k.dim() == 3, f"k must be [T, H, D], got {list(k.shape)}")
    t, h, d = k.shape
    _need(
        (h, d) == (layout.kv_heads, layout.head_dim), f"k heads/dim {h}, {d} do not match the layout's {layout.kv_heads}, {layout.head_dim}"
    )
    _need(v.shape == k.shape, f"v shape {list(v.shape)} != k shape {list(k.shape)}")
    _check_floats(kv, k=k, v=v)
    _check_index(page_ids, "page_ids", (t,), kv.buffer.device)
    _check_index(slots, "slots", (t,), kv.buffer.device)
    if values and t:
        ids = page_ids.long().cpu()
        _need(
            not bool((ids & INT2_PAGE_FLAG).any()),
            "write_kv writes INT4 / plain pages: an id carries INT2_PAGE_FLAG (INT2 pages: write_int2_pages)",
        )
        check_page_ids(ids, kv)
        s = slots.long().cpu()
        _need(bool(((s >= 0) & (s < layout.page_size)).all()), f"slots must be in 0..{layout.page_size - 1}")
        key = ids * layout.page_size + s
        _need(key.unique().numel() == t, "two tokens write the same (page, slot)")


def check_write_int2_pages(kv: PagedKV, k: Tensor, v: Tensor, page_ids: Tensor, *, values: bool) -> None:
    _need(kv.triaxial, f"write_int2_pages needs a triaxial KV (int4 + int2 layouts), got {kv.layout.fmt!r} pages only")
    layout = kv.int2
    _need(k.dim() == 4, f"k must be [N, P, H, D], got {list(k.shape)}")
    n, p, h, d = k.shape
    shape = (layout.page_size, layout.kv_heads, layout.head_dim)
    _need((p, h, d) == shape, f"k pages [P, H, D] = {[p, h, d]} must be whole pages of the layout, {list(shape)}")
    _need(v.shape == k.shape, f"v shape {list(v.shape)} != k shape {list(k.shape)}")
    _check_floats(kv, k=k, v=v)
    _check_index(page_ids, "page_ids", (n,), kv.buffer.device)
    if values and n:
        ids = page_ids.long().cpu()
        _need(bool(((ids & INT2_PAGE_FLAG) != 0).all()), "write_int2_pages page ids must carry INT2_PAGE_FLAG")
        _need(ids.unique().numel() == n, "two pages of one write have the same id")
        check_page_ids(ids, kv)


def check_decode(q: Tensor, kv: PagedKV, page_table: Tensor, seq_lens: Tensor, *, num_int2_pages: Tensor | None, values: bool) -> None:
    """Validate decode arguments."""
    layout, dev = kv.layout, kv.buffer.device
    _need(q.dim() == 3, f"q must be [B, Hq, D], got {list(q.shape)}")
    b, hq, d = q.shape
    _check_floats(kv, q=q)
    _need(d == layout.head_dim, f"q head_dim {d} != layout head_dim {layout.head_dim}")
    _need(hq % layout.kv_heads == 0, f"query heads {hq} must be a multiple of kv heads {layout.kv_heads}")
    _need(page_table.dim() == 2, f"page_table must be [B, max_pages], got {list(page_table.shape)}")
    _check_index(page_table, "page_table", (b, page_table.shape[1]), dev)
    _check_index(seq_lens, "seq_lens", (b,), dev)
    _need(kv.triaxial == (num_int2_pages is not None), "num_int2_pages is given exactly when the KV is triaxial")
    if num_int2_pages is not None:
        _check_index(num_int2_pages, "num_int2_pages", (b,), dev)
    if values and b:
        p = layout.page_size
        lens = seq_lens.long().cpu()
        _need(bool((lens >= 0).all()), "seq_lens must be >= 0")
        _need(bool((lens <= page_table.shape[1] * p).all()), f"a seq_len exceeds max_pages * page_size = {page_table.shape[1] * p}")
        used = (lens + p - 1) // p
        cols = torch.arange(page_table.shape[1])
        mask = cols[None, :] < used[:, None]
        pt = page_table.long().cpu()
        check_page_ids(pt[mask], kv)
        if num_int2_pages is not None:
            n2 = num_int2_pages.long().cpu()
            _need(bool(((n2 >= 0) & (n2 * p <= lens)).all()), "num_int2_pages must be in 0..seq_len // page_size")
            flagged = (pt & INT2_PAGE_FLAG) != 0
            want = cols[None, :] < n2[:, None]
            _need(
                bool((flagged[mask] == want[mask]).all()),
                "each page_table row must list exactly its num_int2_pages INT2 pages first, then INT4 pages",
            )


def check_gather(kv: PagedKV, page_ids: Tensor, num_tokens: int, out_k: Tensor, out_v: Tensor, *, values: bool) -> None:
    layout = kv.layout
    _need(page_ids.dim() == 1, f"page_ids must be [N], got {list(page_ids.shape)}")
    _check_index(page_ids, "page_ids", (page_ids.shape[0],), kv.buffer.device)
    _need(
        0 <= num_tokens <= page_ids.shape[0] * layout.page_size,
        f"num_tokens={num_tokens} does not fit {page_ids.shape[0]} pages of {layout.page_size}",
    )
    _check_floats(kv, out_k=out_k, out_v=out_v)
    for name, x in (("out_k", out_k), ("out_v", out_v)):
        _need(
            x.dim() == 3 and x.shape[0] >= num_tokens and tuple(x.shape[1:]) == (layout.kv_heads, layout.head_dim),
            f"{name} must be [>= {num_tokens}, {layout.kv_heads}, {layout.head_dim}], got {list(x.shape)}",
        )
    if values and num_tokens:
        used = (num_tokens + layout.page_size - 1) // layout.page_size
        check_page_ids(page_ids[:used], kv)


def check_extend(q: Tensor, k: Tensor, v: Tensor, kv: PagedKV, prefix_pages: Tensor, prefix_len: int, *, values: bool) -> None:
    """Validate extend arguments: a chunk ``q: [n, Hq, D]``, ``k, v: [n, H, D]`` after ``prefix_len`` cached tokens."""
    layout = kv.layout
    _need(q.dim() == 3 and k.dim() == 3, f"q must be [n, Hq, D] and k [n, H, D], got {list(q.shape)}, {list(k.shape)}")
    _check_floats(kv, q=q, k=k, v=v)
    n, hq, d = q.shape
    _need(
        tuple(k.shape) == (n, layout.kv_heads, layout.head_dim),
        f"k must be [{n}, {layout.kv_heads}, {layout.head_dim}], got {list(k.shape)}",
    )
    _need(v.shape == k.shape and v.dtype == k.dtype, f"v {v.dtype} {list(v.shape)} must match k {k.dtype} {list(k.shape)}")
    _need(
        d == layout.head_dim and hq % layout.kv_heads == 0,
        f"q [n, Hq, D] = {list(q.shape)}: D must be {layout.head_dim}, Hq a multiple of {layout.kv_heads}",
    )
    _need(prefix_pages.dim() == 1, f"prefix_pages must be [N], got {list(prefix_pages.shape)}")
    _check_index(prefix_pages, "prefix_pages", (prefix_pages.shape[0],), kv.buffer.device)
    cap = prefix_pages.shape[0] * layout.page_size
    _need(0 <= prefix_len <= cap, f"prefix_len={prefix_len} does not fit {prefix_pages.shape[0]} pages of {layout.page_size}")
    if values and prefix_len:
        check_page_ids(prefix_pages[: (prefix_len + layout.page_size - 1) // layout.page_size], kv)


# ----------------------------------------------------------------------------
# page addressing
# ----------------------------------------------------------------------------


def _byte_index(offsets: Tensor, page_bytes: int) -> Tensor:
    # [N] page offsets -> [N, page_bytes] byte indices into the flat buffer
    return offsets[:, None] + torch.arange(page_bytes, device=offsets.device)


def _dequant_pages(views: dict[str, Tensor], fmt: str, which: str, scale: float, dtype: torch.dtype) -> Tensor:
    """One of K or V, dequantized: fields [..., packed] -> [..., D] in ``dtype`` (pages or token rows)."""
    x = views[which]
    if fmt in ("bf16", "fp32"):
        return x.to(dtype)
    if fmt == "fp8_e4m3":
        return dequantize_fp8(x, scale, dtype=dtype)
    if fmt == "nvfp4":
        return dequantize_nvfp4(x, views[which + "_scale"], scale, dtype=dtype)
    if fmt == "int4":
        return dequantize_groups(x, views[which + "_scale"], views[which + "_zero"], 4, dtype=dtype)
    if fmt == "int2" and which == "k":
        return dequantize_int2_keys(x, views["k_scale"], views["k_zero"], dtype=dtype)
    if fmt == "int2":
        return dequantize_groups(x, views["v_scale"], views["v_zero"], 2, dtype=dtype)
    raise ValueError(f"unknown page format {fmt!r}")


def _dequant_tokens(kv: PagedKV, page_ids: Tensor, num_tokens: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """K and V of the first ``num_tokens`` tokens of ``page_ids`` (list order, then slot order): [num_tokens, H, D] each.

    Only written slots are decoded: the bytes past the last token of a partial
    page are whatever the pool held before (possibly the E4M3 NaN code).
    """
    layout, buffer = kv.layout, kv.buffer
    p, h, d = layout.page_size, layout.kv_heads, layout.head_dim
    k = torch.empty(num_tokens, h, d, dtype=dtype, device=buffer.device)
    v = torch.empty_like(k)
    is_int2 = (page_ids.long() & INT2_PAGE_FLAG) != 0
    for lay, sel in ((layout, ~is_int2), (kv.int2_layout, is_int2)):
        if lay is None or not bool(sel.any()):
            continue
        views = lay.views(buffer[_byte_index(kv.page_offsets(page_ids[sel]), lay.page_bytes)])  # fields [n, H, P, ...]
        # token t of the list is page t // P, slot t % P; rows of these pages in token order:
        token = (torch.nonzero(sel)[:, 0, None] * p + torch.arange(p, device=buffer.device)).reshape(-1)  # [n*P]
        valid = token < num_tokens
        if lay.fmt == "int2":
            # INT2 pages are always full: decode whole pages (keys share per-page channel scales)
            kp = _dequant_pages(views, "int2", "k", kv.k_scale, dtype).transpose(1, 2).reshape(-1, h, d)
            vp = _dequant_pages(views, "int2", "v", kv.v_scale, dtype).transpose(1, 2).reshape(-1, h, d)
            k[token[valid]], v[token[valid]] = kp[valid], vp[valid]
            continue
        # per-token fields: [n, H, P, ...] -> token-major [n*P, H, ...], keep written tokens only
        rows = {name: x.transpose(1, 2).reshape(-1, *x.shape[1:2], *x.shape[3:])[valid] for name, x in views.items()}
        k[token[valid]] = _dequant_pages(rows, lay.fmt, "k", kv.k_scale, dtype)
        v[token[valid]] = _dequant_pages(rows, lay.fmt, "v", kv.v_scale, dtype)
    return k, v


# ----------------------------------------------------------------------------
# the ops
# ----------------------------------------------------------------------------


def write_kv(kv: PagedKV, k: Tensor, v: Tensor, page_ids: Tensor, slots: Tensor) -> None:
    """Quantize T new tokens ``k, v: [T, H, D]`` into ``(page_ids[t], slots[t])`` (plain or INT4 pages)."""
    check_write_kv(kv, k, v, page_ids, slots, values=True)
    if k.shape[0] == 0:
        return
    layout = kv.layout
    # read each touched page once, update it in place, write it back
    pages, local = torch.unique(page_ids.long(), return_inverse=True)
    index = _byte_index(kv.page_offsets(pages), layout.page_bytes)
    raw = kv.buffer[index]  # [U, page_bytes] (a copy)
    views = layout.views(raw)
    s = slots.long()
    fields: dict[str, Tensor] = {}
    for which, x, scale in (("k", k, kv.k_scale), ("v", v, kv.v_scale)):
        if layout.fmt in ("bf16", "fp32"):
            fields[which] = x.to(views[which].dtype)
        elif layout.fmt == "fp8_e4m3":
            fields[which] = quantize_fp8(x, scale)
        elif layout.fmt == "nvfp4":
            fields[which], fields[which + "_scale"] = quantize_nvfp4(x, scale)
        else:  # int4: per token, groups of 32 channels
            fields[which], fields[which + "_scale"], fields[which + "_zero"] = quantize_groups(x, 4)
    for name, value in fields.items():
        # views[name]: [U, H, P, ...]; token t goes to page local[t], slot s[t]
        views[name][local, :, s] = value
    kv.buffer[index] = raw


def write_int2_pages(kv: PagedKV, k: Tensor, v: Tensor, page_ids: Tensor) -> None:
    """Write N whole INT2 pages (``k, v: [N, P, H, D]``): keys per channel over the page, values per token groups."""
    check_write_int2_pages(kv, k, v, page_ids, values=True)
    if k.shape[0] == 0:
        return
    layout = kv.int2
    kh = k.permute(0, 2, 1, 3)  # [N, H, P, D]
    vh = v.permute(0, 2, 1, 3)
    raw = torch.zeros(k.shape[0], layout.page_bytes, dtype=torch.uint8, device=kv.buffer.device)
    views = layout.views(raw)
    views["k"][:], views["k_scale"][:], views["k_zero"][:] = quantize_int2_keys(kh)
    views["v"][:], views["v_scale"][:], views["v_zero"][:] = quantize_groups(vh, 2)
    kv.buffer[_byte_index(kv.page_offsets(page_ids), layout.page_bytes)] = raw


def gather_kv(kv: PagedKV, page_ids: Tensor, num_tokens: int, out_k: Tensor, out_v: Tensor) -> None:
    """Extend path: dequantize the first ``num_tokens`` tokens of ``page_ids`` into ``out_k/out_v[:num_tokens]``."""
    check_gather(kv, page_ids, num_tokens, out_k, out_v, values=True)
    if num_tokens == 0:
        return
    used = (num_tokens + kv.layout.page_size - 1) // kv.layout.page_size
    k, v = _dequant_tokens(kv, page_ids[:used], num_tokens, out_k.dtype)
    out_k[:num_tokens] = k
    out_v[:num_tokens] = v


def decode_attention(
    q: Tensor, kv: PagedKV, page_table: Tensor, seq_lens: Tensor, *, sm_scale: float, num_int2_pages: Tensor | None = None
) -> Tensor:
    """One query token per sequence over its cached tokens; GQA; fp32 softmax. -> [B, Hq, D] in q.dtype.

    ``num_int2_pages`` (int32 [B], triaxial only): INT2 pages leading each page-table row.
    A sequence with seq_len 0 (batch padding) gets zeros.
    """
    check_decode(q, kv, page_table, seq_lens, num_int2_pages=num_int2_pages, values=True)
    b, hq, d = q.shape
    h, p = kv.layout.kv_heads, kv.layout.page_size
    out = torch.zeros(b, hq, d, dtype=q.dtype, device=q.device)
    for i in range(b):
        n = int(seq_lens[i])
        if n == 0:
            continue
        ids = page_table[i, : (n + p - 1) // p]
        # k, v: [n, H, D] fp32 (token order does not matter: RoPE was applied before caching)
        k, v = _dequant_tokens(kv, ids, n, torch.float32)
        qi = q[i].float().view(h, hq // h, d)  # [H, G, D]: the G query heads of each kv head
        scores = torch.einsum("hgd,nhd->hgn", qi, k) * sm_scale
        probs = torch.softmax(scores, dim=-1)
        out[i] = torch.einsum("hgn,nhd->hgd", probs, v).reshape(hq, d).to(q.dtype)
    return out


def extend_attention(q: Tensor, k: Tensor, v: Tensor, kv: PagedKV, prefix_pages: Tensor, prefix_len: int, *, sm_scale: float) -> Tensor:
    """Extend (chunked prefill): a chunk of n new tokens after ``prefix_len`` cached ones -> [n, Hq, D] in q.dtype.

    ``q: [n, Hq, D]`` at positions prefix_len.., ``k, v: [n, H, D]`` the chunk's own (unquantized) K/V;
    ``prefix_pages`` lists the cached pages in token order (INT2 and INT4 pages mixed, as the ids say).
    Dequantize-then-attend: the prefix in q's dtype, the chunk appended, causal SDPA (what the engine ran
    before the paged prefill kernel, kernels/triton_prefill.py, and what that kernel is held to).
    """
    check_extend(q, k, v, kv, prefix_pages, prefix_len, values=True)
    n = q.shape[0]
    used = (prefix_len + kv.layout.page_size - 1) // kv.layout.page_size
    pk, pv = _dequant_tokens(kv, prefix_pages[:used], prefix_len, q.dtype)
    keys = torch.cat([pk, k.to(q.dtype)]).transpose(0, 1)  # [H, L + n, D]
    vals = torch.cat([pv, v.to(q.dtype)]).transpose(0, 1)
    q_pos = torch.arange(prefix_len, prefix_len + n, device=q.device)
    mask = torch.arange(prefix_len + n, device=q.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, vals, attn_mask=mask, scale=sm_scale, enable_gqa=True)
    return out.transpose(0, 1)
