"""End-to-end KV sensitivity for ``kvserving calibrate``: the KL divergence of
the model's next-token distribution when some tokens' K/V are stored at 2 or 4
bits, through every layer at once.

DESIGN.md's D_k(b) is the attention-output MSE of each layer with only class
k quantized (max over heads, summed over layers). On the 57M-parameter H200
model of ``bench/fidelity.py`` that proxy ranked the system prompt below small
classes (tool calls, delimiters) while the output distribution said otherwise
(docs/performance-log/fidelity.md, "Calibration by KL"). ``class_kl`` measures instead:

    D_k(b) = sum over positions t of KL(p(. | exact KV) || p(. | class k at b bits))

with the rest of the KV exact, every layer's K/V of class k quantized as it is
computed (so errors propagate through the layers as in the engine), queries
attending densely over the quantized cache. Class k's tokens are quantized
through the triaxial reference codec exactly as ``calibrate.class_distortion``
does (INT4 K and V per token; at 2 bits INT2 V per token and INT2 K per channel
over pages of 32 of the class's tokens in position order). One forward per
class present and bit width, plus one for the reference.

``table_bits`` / ``table_kl`` / ``table_attn_distortion`` score a whole bits
table under the engine's page rule (a page of 32 positions is INT2 only when
it is full and all its tokens are 2-bit): how additive the per-class D_k are
(bench/fidelity.py ``--diagnose``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from kvserving.calibrate.codecs import PAGE, attend, head_mse, quantize_positions
from kvserving.tags import NUM_TAGS
from kvserving.worker.attention import causal_attention
from kvserving.worker.model import DecoderModel

EXACT = 16  # a position whose K/V stay unquantized


class QuantizedKV:
    """AttentionOp: every layer's K/V at the positions' bits (EXACT, 4 or 2), then causal attention.
    2-bit positions are INT2-keyed in runs of ``PAGE`` of them, in position order.

    ``chunk`` > 0: the engine's chunked prefill -- the queries of each chunk of ``chunk`` positions
    attend to the stored (quantized) K/V of the earlier chunks and to their own chunk's exact K/V
    (DESIGN.md: prefill attends on the fresh K/V, extend on the dequantized cache plus the chunk).
    ``chunk`` = 0: every query reads the quantized K/V (the decode view)."""

    def __init__(self, bits: torch.Tensor, chunk: int = 0) -> None:
        if chunk < 0:
            raise ValueError(f"chunk must be >= 0, got {chunk}")
        self.chunk = chunk
        if bits.dim() != 1:
            raise ValueError(f"bits must be one value per position, got shape {list(bits.shape)}")
        bad = set(torch.unique(bits).tolist()) - {EXACT, 4, 2}
        if bad:
            raise ValueError(f"bits must be {EXACT}, 4 or 2, got {sorted(bad)}")
        self.idx4 = (bits == 4).nonzero().squeeze(1)
        self.idx2 = (bits == 2).nonzero().squeeze(1)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kf, vf, qf = k.float(), v.float(), q.float()
        kq, vq = quantize_positions(kf, vf, self.idx4, self.idx2)
        n = q.shape[0]
        if self.chunk <= 0 or self.chunk >= n:
            return (attend(qf, kq, vq) if self.chunk <= 0 else attend(qf, kf, vf)).to(q.dtype)
        out = torch.empty_like(qf)
        scale = 1.0 / math.sqrt(q.shape[-1])
        for s in range(0, n, self.chunk):
            e = min(n, s + self.chunk)
            kk, vv = torch.cat([kq[:s], kf[s:e]]), torch.cat([vq[:s], vf[s:e]])
            out[s:e] = causal_attention(qf[s:e], kk, vv, q_offset=s, sm_scale=scale)
        return out.to(q.dtype)


@torch.inference_mode()
def log_probs(model: DecoderModel, ids: Sequence[int], bits: torch.Tensor | None, *, device: torch.device, chunk: int = 0) -> torch.Tensor:
    """Next-token log-probabilities [T, V] (fp32) of one prompt with its K/V at ``bits`` (None: exact),
    prefilled in chunks of ``chunk`` (``QuantizedKV``)."""
    n = len(ids)
    op = QuantizedKV(bits if bits is not None else torch.full((n,), EXACT, dtype=torch.long, device=device), chunk)
    hidden = model(torch.tensor(list(ids), dtype=torch.long, device=device), torch.arange(n, device=device), op)
    return torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)


def kl_sum(ref: torch.Tensor, logp: torch.Tensor) -> float:
    """sum over positions of KL(exp(ref) || exp(logp)), both [T, V] log-probabilities."""
    return float((ref.exp() * (ref - logp)).sum())


def class_kl(
    model: DecoderModel, ids: Sequence[int], tags: torch.Tensor, *, device: torch.device, chunk: int = 0, ref: torch.Tensor | None = None
) -> dict[int, torch.Tensor]:
    """bits -> D_k(bits) [56] for one prompt (module docstring): the summed KL with only class k at
    ``bits``, prefilled in chunks of ``chunk``. ``tags`` long [T] on ``device``; ``ref`` the exact
    log-probabilities if already known."""
    if ref is None:
        ref = log_probs(model, ids, None, device=device)
    out = {2: torch.zeros(NUM_TAGS, dtype=torch.float64), 4: torch.zeros(NUM_TAGS, dtype=torch.float64)}
    for c in torch.unique(tags).tolist():
        for b in (2, 4):
            bits = torch.where(tags == c, b, EXACT)
            out[b][c] = kl_sum(ref, log_probs(model, ids, bits, device=device, chunk=chunk))
    return out


def table_bits(tags: torch.Tensor, table: Sequence[int], *, page_size: int = PAGE) -> torch.Tensor:
    """Per-position bits of one prompt stored under ``table`` by the engine's page rule: a page of
    ``page_size`` positions (from position 0) is 2-bit only when it is full and every token's class
    is 2-bit in ``table``; else 4-bit (residual tokens too)."""
    if len(table) != NUM_TAGS:
        raise ValueError(f"a bits table has {NUM_TAGS} entries, got {len(table)}")
    two = torch.tensor([b == 2 for b in table], device=tags.device)[tags]
    n = tags.shape[0]
    full = n - n % page_size
    out = torch.full((n,), 4, dtype=torch.long, device=tags.device)
    if full:
        page_two = two[:full].view(-1, page_size).all(dim=1)
        out[:full] = torch.where(page_two, 2, 4).repeat_interleave(page_size)
    return out


def table_kl(
    model: DecoderModel,
    ids: Sequence[int],
    tags: torch.Tensor,
    table: Sequence[int],
    *,
    device: torch.device,
    chunk: int = 0,
    ref: torch.Tensor | None = None,
) -> float:
    """Summed KL of one prompt stored under ``table`` (page rule) against exact K/V."""
    if ref is None:
        ref = log_probs(model, ids, None, device=device)
    return kl_sum(ref, log_probs(model, ids, table_bits(tags, table), device=device, chunk=chunk))


def table_attn_distortion(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bits: torch.Tensor) -> float:
    """One layer of one prompt: the attention-output MSE (max over heads) with the positions at
    ``bits`` and the layer's inputs exact (``calibrate.class_distortion``'s measure, whole table)."""
    idx4, idx2 = (bits == 4).nonzero().squeeze(1), (bits == 2).nonzero().squeeze(1)
    kq, vq = quantize_positions(k, v, idx4, idx2)
    return float(head_mse(attend(q, kq, vq), attend(q, k, v)).max())


def predicted(distortion: Mapping[int, Sequence[float]], counts: Sequence[float], tags: torch.Tensor, bits: torch.Tensor) -> float:
    """The additive prediction of a prompt's distortion at ``bits``: each token adds its class's
    ``D_c(b) / N_c`` (``counts`` the calibration's tokens per class)."""
    total = 0.0
    for c, b in zip(tags.tolist(), bits.tolist()):
        if counts[c] > 0 and b in distortion:
            total += distortion[b][c] / counts[c]
    return total
