"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeds, stops.

``sample_tokens`` samples a whole step's rows where the logits are (the GPU in
serving): the logits never leave the device, one token id per row does.
``sample_one`` is the one-row reference it is tested against: on CPU both give
the same tokens for the same logits and seeds, because ``sample_tokens`` does
the same float operations row by row and draws as ``torch.multinomial`` does
for one sample (``argmax(p / q)``, ``q ~ Exp(1)`` from the row's generator),
without multinomial's host-side validity checks (two device syncs per row).
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """Per-request sampling; ``temperature == 0`` means greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(seed: int | None, *, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own random stream on ``device`` (where its logits are sampled)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return gen


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick one token from ``logits`` [vocab] (fp32)."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    scaled = logits.float() / params.temperature
    if params.top_k and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample_tokens(logits: torch.Tensor, params: Seq[SamplingParams], generators: Seq[torch.Generator]) -> torch.Tensor:
    """One token per row of ``logits`` [N, vocab] (fp32, any device) -> long [N] on that device.

    Greedy rows take the argmax; the others are scaled by their temperature,
    cut to their top-k and top-p, and drawn from their own generator (which must
    live on the logits' device). Row-wise the same float operations as
    ``sample_one``, batched over the rows that use each step.
    """
    n = logits.shape[0]
    if len(params) != n or len(generators) != n:
        raise ValueError(f"{n} rows of logits but {len(params)} params and {len(generators)} generators")
    tokens = torch.argmax(logits, dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    dev = logits.device

    def put(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
        # from pinned memory: a copy from pageable memory may wait for the device (async decode launches
        # the next step before this one's tokens are back)
        return torch.tensor(values, dtype=dtype, pin_memory=dev.type == "cuda").to(dev, non_blocking=True)

    sel = [params[i] for i in rows]
    index = put(rows, torch.long)
    temps = put([p.temperature for p in sel], torch.float32)
    scaled = logits.index_select(0, index).float() / temps[:, None]  # [R, vocab]
    vocab = scaled.shape[1]
    ks = [p.top_k if p.top_k and p.top_k < vocab else 0 for p in sel]
    if any(ks):
        kth_at = put([max(k, 1) - 1 for k in ks], torch.long)
        kth = torch.topk(scaled, max(ks), dim=-1).values.gather(1, kth_at[:, None])  # [R, 1]: each row's k-th largest
        cut = put([k > 0 for k in ks], torch.bool)
        kth = torch.where(cut[:, None], kth, float("-inf"))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    nucleus = [r for r, p in enumerate(sel) if p.top_p < 1.0]
    if nucleus:
        at = put(nucleus, torch.long)
        top_p = put([sel[r].top_p for r in nucleus], torch.float32)
        sub = probs.index_select(0, at)
        sorted_probs, order = torch.sort(sub, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p[:, None]
        sub = torch.zeros_like(sub).scatter(1, order, sorted_probs * keep)
        probs = probs.index_copy(0, at, sub / sub.sum(dim=-1, keepdim=True))
    # torch.multinomial's one-sample draw: argmax(p / q) with q ~ Exp(1) from each row's generator
    q = torch.empty_like(probs)
    for r, i in enumerate(rows):
        q[r].exponential_(1.0, generator=generators[i])
    return tokens.index_copy(0, index, torch.argmax(probs / q, dim=-1))
