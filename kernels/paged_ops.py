"""The one dispatch point for paged-KV ops: torch reference, Triton ``tl`` kernels or the Gluon decode.

The engine calls only these five functions, each with one layer's ``PagedKV``.
Each validates its arguments (paged_ref.check_*) and then runs one backend:

- ``backend=None`` (default): ``options.backend`` if set, else ``"triton"`` when
  the buffer is on CUDA and ``"reference"`` otherwise (fp32 pages: always the
  reference); ``backend="reference"`` or ``"triton"`` forces one (Triton on CPU
  tensors runs under ``TRITON_INTERPRET=1``, which is how CI tests the kernels);
- which kernel a GPU runs is capability.py's table (compute capability ->
  decode / extend / write kernels, the E2M1 unpacker); the kernels'
  ``supported`` checks read it, and nothing else reads the device's capability;
- decode on the Triton backend: the Gluon kernel (gluon_decode.py) where
  ``gluon_decode.supported`` holds and ``options.decode_kernel`` allows it,
  else the ``tl`` kernel (triton_decode.py). Nothing below this module
  dispatches again;
- extend (a chunk after a cached prefix) on the Triton backend: the paged
  prefill kernel (triton_prefill.py), which reads the packed prefix pages
  itself -- on Hopper (the table's extend "gluon") the Gluon kernels where their ``supported`` holds:
  gluon_extend.py for nvfp4 pages, gluon_extend_tri.py for triaxial ones;
  the reference dequantizes the prefix and attends with SDPA.

``options`` (kernels/options.py) carries the environment overrides; a caller
that passes none gets ``KernelOptions.from_env()``, read here and nowhere else.
The worker's storage reads it once and passes it on every call.

Value checks (page ids in range, lengths that fit the page table) read the
index tensors on the host. On CUDA that is a device sync per call, which a
decode loop (and CUDA graph capture) cannot afford, so they run only on CPU
tensors unless ``check_values=True`` or ``options.check_values``. Shape,
dtype and device checks always run.
"""

from __future__ import annotations

from torch import Tensor

from . import paged_ref
from .capability import device_choice
from .options import BACKENDS, KernelOptions
from .paged_kv import PagedKV


def _options(options: KernelOptions | None) -> KernelOptions:
    return KernelOptions.from_env() if options is None else options


def _backend(kv: PagedKV, backend: str | None, opts: KernelOptions) -> str:
    name = backend or opts.backend or ("triton" if kv.buffer.is_cuda else "reference")
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r}; expected one of {BACKENDS}")
    if kv.layout.fmt == "fp32":
        return "reference"  # fp32 pages exist for fp32 models on CPU; the reference runs on any device
    return name


def _values(kv: PagedKV, check_values: bool | None, opts: KernelOptions) -> bool:
    if check_values is not None:
        return check_values
    return not kv.buffer.is_cuda or opts.check_values


def decode_kernel(q: Tensor, kv: PagedKV, *, backend: str | None = None, options: KernelOptions | None = None) -> str:
    """Which implementation ``decode_attention`` runs for this call: "reference", "tl" or "gluon"."""
    opts = _options(options)
    if _backend(kv, backend, opts) == "reference":
        return "reference"
    if opts.decode_kernel != "tl" and q.is_cuda:  # Gluon runs on a GPU only (never in the interpreter)
        # imported on first use so CPU engines never load Triton
        from . import gluon_decode

        if gluon_decode.supported(kv, q):
            return "gluon"
    if opts.decode_kernel == "gluon" and kv.layout.fmt in ("nvfp4", "int4", "fp8_e4m3"):
        # "gluon" asks for Gluon wherever its page formats are used: a call it cannot run is an error
        raise ValueError("decode_kernel='gluon' but the Gluon decode does not support this call (see gluon_decode.supported)")
    return "tl"


def write_kv(
    kv: PagedKV,
    k: Tensor,
    v: Tensor,
    page_ids: Tensor,
    slots: Tensor,
    *,
    backend: str | None = None,
    check_values: bool | None = None,
    options: KernelOptions | None = None,
) -> None:
    """Quantize-on-write of T tokens ``k, v: [T, H, D]`` into ``(page_ids[t], slots[t])`` (plain or INT4 pages)."""
    opts = _options(options)
    if _backend(kv, backend, opts) == "reference":
        paged_ref.write_kv(kv, k, v, page_ids, slots)
        return
    paged_ref.check_write_kv(kv, k, v, page_ids, slots, values=_values(kv, check_values, opts))
    from . import triton_write

    triton_write.write_kv(kv, k, v, page_ids, slots, pdl=opts.overlaps(k.device))


def write_int2_pages(
    kv: PagedKV,
    k: Tensor,
    v: Tensor,
    page_ids: Tensor,
    *,
    backend: str | None = None,
    check_values: bool | None = None,
    options: KernelOptions | None = None,
) -> None:
    """Write N whole INT2 pages ``k, v: [N, P, H, D]`` of a triaxial KV to ids carrying INT2_PAGE_FLAG."""
    opts = _options(options)
    if _backend(kv, backend, opts) == "reference":
        paged_ref.write_int2_pages(kv, k, v, page_ids)
        return
    paged_ref.check_write_int2_pages(kv, k, v, page_ids, values=_values(kv, check_values, opts))
    from . import triton_write

    triton_write.write_int2_pages(kv, k, v, page_ids)


def decode_attention(
    q: Tensor,
    kv: PagedKV,
    page_table: Tensor,
    seq_lens: Tensor,
    *,
    sm_scale: float,
    num_int2_pages: Tensor | None = None,
    backend: str | None = None,
    check_values: bool | None = None,
    options: KernelOptions | None = None,
) -> Tensor:
    """Decode attention of ``q: [B, Hq, D]`` over each sequence's pages -> [B, Hq, D] in q.dtype.

    ``num_int2_pages`` (int32 [B]) is given exactly when ``kv.triaxial``: the INT2 pages leading each row.
    """
    opts = _options(options)
    which = decode_kernel(q, kv, backend=backend, options=opts)
    if which == "reference":
        return paged_ref.decode_attention(q, kv, page_table, seq_lens, sm_scale=sm_scale, num_int2_pages=num_int2_pages)
    paged_ref.check_decode(q, kv, page_table, seq_lens, num_int2_pages=num_int2_pages, values=_values(kv, check_values, opts))
    if which == "gluon":
        from . import gluon_decode

        return gluon_decode.decode_attention(q, kv, page_table, seq_lens, sm_scale=sm_scale, num_int2_pages=num_int2_pages,
                                             pdl=opts.overlaps(q.device), fused_merge=opts.fused_merge)  # fmt: skip
    from . import triton_decode

    fast = opts.fast_decoders(q.device)
    cvt = device_choice(q.device).e2m1 == "cvt"
    return triton_decode.decode_attention(q, kv, page_table, seq_lens, sm_scale=sm_scale, num_int2_pages=num_int2_pages, fast=fast,
                                          e2m1_cvt=cvt, pdl=opts.overlaps(q.device))  # fmt: skip


def gather_kv(
    kv: PagedKV,
    page_ids: Tensor,
    num_tokens: int,
    out_k: Tensor,
    out_v: Tensor,
    *,
    backend: str | None = None,
    check_values: bool | None = None,
    options: KernelOptions | None = None,
) -> None:
    """Extend path: dequantize the first ``num_tokens`` tokens of ``page_ids`` into the workspace ``out_k/out_v``."""
    opts = _options(options)
    if _backend(kv, backend, opts) == "reference":
        paged_ref.gather_kv(kv, page_ids, num_tokens, out_k, out_v)
        return
    paged_ref.check_gather(kv, page_ids, num_tokens, out_k, out_v, values=_values(kv, check_values, opts))
    from . import triton_gather

    triton_gather.gather_kv(kv, page_ids, num_tokens, out_k, out_v)


def extend_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv: PagedKV,
    prefix_pages: Tensor,
    prefix_len: int,
    *,
    sm_scale: float,
    backend: str | None = None,
    check_values: bool | None = None,
    options: KernelOptions | None = None,
) -> Tensor:
    """Extend: chunk ``q: [n, Hq, D]`` (k, v: [n, H, D]) after ``prefix_len`` cached tokens of ``prefix_pages``,
    causal over the chunk -> [n, Hq, D] in q.dtype."""
    opts = _options(options)
    if _backend(kv, backend, opts) == "reference":
        return paged_ref.extend_attention(q, k, v, kv, prefix_pages, prefix_len, sm_scale=sm_scale)
    paged_ref.check_extend(q, k, v, kv, prefix_pages, prefix_len, values=_values(kv, check_values, opts))
    from . import gluon_extend, gluon_extend_tri, triton_prefill

    fast = opts.fast_decoders(q.device)
    if fast and gluon_extend.supported(kv, q):  # faster than the tl kernel at every bench shape
        return gluon_extend.extend_attention(q, k, v, kv, prefix_pages, prefix_len, sm_scale=sm_scale)
    if fast and gluon_extend_tri.supported(kv, q):  # faster than the tl kernel at every bench shape
        return gluon_extend_tri.extend_attention(q, k, v, kv, prefix_pages, prefix_len, sm_scale=sm_scale)
    return triton_prefill.extend_attention(q, k, v, kv, prefix_pages, prefix_len, sm_scale=sm_scale, fast=fast)
