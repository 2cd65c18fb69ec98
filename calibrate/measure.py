"""`kvserving calibrate`'s work (its command line: ``kvserving.calibrate.main``): measure a model's KV
sensitivity per token class and write the calibration file (kvserving.calibration) the engine config names.

    kvserving calibrate --model DIR --data a.py b.jsonl --bit-budget 2.5 2.7 3 --out calib.json

1. Calibration text becomes tagged prompts (``kvserving.calibrate.data``) through the gateway's own chat
   template and tagger (the real 56 classes): a ``.jsonl`` file holds one chat
   request per line (``{"messages": [...], "tools": [...]}`` or a bare message
   list); any other file is plain text, wrapped as agent conversations. With
   ``--wrap agent`` (the default) they have the shape of the agent load
   generator's agents (``kvserving.agents.load``: system prompt, tool schemas,
   turns of user request or tool result, then a reply that quotes the latest
   result and calls the next tool, until the context is full), the file's
   text standing in for every message, so the class shares are those of an
   agent context (tool results dominate, most tokens are old turns); with
   ``--wrap pieces`` (and for contexts too short for an agent's system prompt
   and tool schemas, under ~400 tokens), 17 equal pieces (system prompt and tool schema, then four
   user turns of request, reasoning + tool call, tool result and answer).
2. The worker's model code runs each prompt once; an attention op captures
   every layer's Q and the K/V as the KV cache would receive them (RoPE applied).
3. ``D_k(b)``, with only class k's tokens stored at b bits through the triaxial
   reference codec (kernels.intquant: INT4 K and V per token in groups of 32
   channels; at 2 bits INT2 V per token and INT2 K per channel over pages of
   32 of the class's tokens, in position order), the rest exact, summed over
   the prompts. ``--metric kl`` (the default, ``kvserving.calibrate.kl``): the
   KL divergence of the next-token distribution from the exact KV's, summed
   over positions, with class k quantized in every layer as the engine stores
   it and the prompt prefilled in chunks of ``--chunk`` tokens (512, the
   engine's chunk size: queries read the stored K/V of earlier chunks and
   their own chunk's exact K/V). ``--metric attn``: DESIGN.md's attention-output
   MSE per query head with each layer's inputs exact, max over heads, summed
   over layers. The attention-output MSE misranked the classes on a deeper
   model; the KL ranks whole tables as the evaluation does
   (docs/performance-log/fidelity.md, "Calibration by KL").
4. Per requested budget, the greedy rule of ``kvserving.bits`` over those
   measurements gives the table (``Calibration.derive_table``), with the budget
   counted in stored pages: the prompts' pages of 32 tokens (their class mix)
   are recorded, and a page is INT2 only when all of its tokens are 2-bit.
   ``--select`` keeps, per budget, whichever of the KL search's table, the
   attention-MSE search's and the default sensitivities' has the least KL
   measured whole on the calibration prompts.
   ``--page-seq-len N ...`` records instead the pages of the data wrapped at
   the context lengths served (a table met on 2K prompts stores other bits on
   8K ones: their class mix differs); ``--page-data FILE ...`` the pages of
   other data (a sample of the served traffic: text of another kind gives
   another page mix, and a table at the budget on the calibration text stores
   other bits there; docs/performance-log/fidelity.md, "Why the calibrated tables
   under-spend").
5. fp8 and nvfp4 global scales per layer from the K/V amax (``amax / 448``,
   ``amax / (6 * 448)``); with ``--scale-search`` each layer's K and V scale is
   instead the multiple of that which gives the lowest attention-output error
   (max over heads) with only that tensor quantized, when it beats amax.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kvserving.argtypes import check_device
from kvserving.bits import PageMix, count_page_mixes, default_sensitivity, page_records
from kvserving.calibrate import DEFAULT_CHUNK, METRICS
from kvserving.calibrate.codecs import PAGE, attend, head_mse, quantize_positions
from kvserving.calibrate.data import TaggedSeq, load_data
from kvserving.calibrate.kl import class_kl, log_probs, table_kl
from kvserving.calibration import SCALED_DTYPES, Calibration, LayerScales, budget_key
from kvserving.gateway.prompt.chat_template import ChatTemplate
from kvserving.gateway.prompt.tagger import ChatTagger
from kvserving.gateway.prompt.tokenizer import TextTokenizer
from kvserving.kernels.fp8 import dequantize_fp8, quantize_fp8
from kvserving.kernels.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from kvserving.progress import Steps
from kvserving.tags import NUM_TAGS
from kvserving.worker.model import DecoderModel, ModelArgs, load_model

FP8_MAX = 448.0
E2M1_MAX = 6.0
# Multiples of the amax scale that --scale-search tries (< 1 clips outliers, > 1 leaves headroom).
SEARCH_FACTORS = (0.25, 0.35, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 2.0)


# ---------------------------------------------------------------- capture and measure
class _Capture:
    """AttentionOp that keeps each layer's q, k, v (fp32, CPU) and attends densely."""

    def __init__(self) -> None:
        self.q: dict[int, torch.Tensor] = {}
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.q[layer], self.k[layer], self.v[layer] = q.float(), k.float(), v.float()
        return attend(q, k, v)


@torch.inference_mode()
def capture_qkv(model: DecoderModel, ids: Sequence[int], *, device: torch.device) -> _Capture:
    cap = _Capture()
    model(torch.tensor(list(ids), dtype=torch.long, device=device), torch.arange(len(ids), device=device), cap)
    return cap


def class_distortion(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tags: torch.Tensor) -> dict[int, torch.Tensor]:
    """One layer of one prompt: bits -> D_k(bits) [56] (max over heads of the attention-output MSE
    with only class k's tokens at ``bits``). q: [T, Hq, D], k/v: [T, Hkv, D], tags: long [T]."""
    ref = attend(q, k, v)
    none = tags.new_empty(0)
    out = {2: torch.zeros(NUM_TAGS, dtype=torch.float64), 4: torch.zeros(NUM_TAGS, dtype=torch.float64)}
    for c in torch.unique(tags).tolist():
        idx = (tags == c).nonzero().squeeze(1)
        for bits in (2, 4):
            kq, vq = quantize_positions(k, v, idx, none) if bits == 4 else quantize_positions(k, v, none, idx)
            out[bits][c] = float(head_mse(attend(q, kq, vq), ref).max())
    return out


def qdq_scaled(x: torch.Tensor, kv_dtype: str, scale: float) -> torch.Tensor:
    """x through the fp8 or nvfp4 reference codec at global ``scale`` and back (fp32)."""
    if kv_dtype == "fp8_e4m3":
        return dequantize_fp8(quantize_fp8(x, scale), scale, dtype=torch.float32)
    packed, block = quantize_nvfp4(x, scale)
    return dequantize_nvfp4(packed, block, scale, dtype=torch.float32)


def scale_top(kv_dtype: str) -> float:
    return FP8_MAX if kv_dtype == "fp8_e4m3" else E2M1_MAX * FP8_MAX


def scale_errors(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_dtype: str, k_scales: Sequence[float], v_scales: Sequence[float]
) -> tuple[list[float], list[float]]:
    """Attention-output MSE (max over heads) with only K (resp. only V) quantized at each candidate scale."""
    ref = attend(q, k, v)
    ek = [float(head_mse(attend(q, qdq_scaled(k, kv_dtype, s), v), ref).max()) for s in k_scales]
    ev = [float(head_mse(attend(q, k, qdq_scaled(v, kv_dtype, s)), ref).max()) for s in v_scales]
    return ek, ev


@dataclass(slots=True)
class Measurement:
    """Running sums over the calibration prompts."""

    args: ModelArgs
    counts: list[int]
    d2: list[float]
    d4: list[float]
    k_amax: list[float]
    v_amax: list[float]
    # kv dtype -> per layer: candidate factor -> summed error (K and V)
    k_err: dict[str, list[list[float]]]
    v_err: dict[str, list[list[float]]]
    # class mix of every full page of PAGE tokens -> number of such pages; tokens of partial pages
    pages: Counter[PageMix] = field(default_factory=Counter)
    residual: int = 0
    # with ``measure(..., also_attn=True)`` under the KL metric: the attention-MSE D_k too (bits -> [56])
    attn: dict[int, list[float]] = field(default_factory=dict)

    def add_distortion(self, d: dict[int, torch.Tensor]) -> None:
        for c in range(NUM_TAGS):
            self.d2[c] += float(d[2][c])
            self.d4[c] += float(d[4][c])

    def add_attn(self, d: dict[int, torch.Tensor]) -> None:
        for b in (2, 4):
            row = self.attn.setdefault(b, [0.0] * NUM_TAGS)
            for c in range(NUM_TAGS):
                row[c] += float(d[b][c])

    def set_pages(self, groups: Sequence[Sequence[TaggedSeq]]) -> None:
        """Replace the recorded page layout by that of prompts of other shapes (e.g. the data wrapped at
        each served context length: one group per length). The calibration file counts pages on as
        many tokens as were measured, so each group gives an equal share of them: its prompts in
        order (again from the first if they run out), the last one cut to fit."""
        groups = [g for g in groups if any(g)]
        if not groups:
            raise ValueError("no prompts to count pages on")
        total = sum(self.counts)
        self.pages, self.residual = Counter(), 0
        for i, group in enumerate(groups):
            need = total // len(groups) + (1 if i < total % len(groups) else 0)
            j = 0
            while need > 0:
                tags = group[j % len(group)].tags[:need]
                self.add_pages(tags)
                need -= len(tags)
                j += 1

    def add_pages(self, tags: Sequence[int]) -> None:
        """Record a prompt's page layout (its tokens from position 0 in pages of PAGE)."""
        self.residual += count_page_mixes(self.pages, tags, PAGE)

    @classmethod
    def empty(cls, args: ModelArgs) -> Measurement:
        n = args.num_layers
        zeros = {d: [[0.0] * len(SEARCH_FACTORS) for _ in range(n)] for d in SCALED_DTYPES}
        return cls(
            args,
            [0] * NUM_TAGS,
            [0.0] * NUM_TAGS,
            [0.0] * NUM_TAGS,
            [0.0] * n,
            [0.0] * n,
            zeros,
            {d: [list(r) for r in rows] for d, rows in zeros.items()},
        )


def measure(
    model: DecoderModel,
    args: ModelArgs,
    seqs: Sequence[TaggedSeq],
    *,
    device: torch.device,
    search: bool,
    progress: Callable[[str], None] | None = None,
    metric: str = "kl",
    chunk: int = DEFAULT_CHUNK,
    also_attn: bool = False,
) -> Measurement:
    """Distortions (``metric``, see METRICS), token counts and K/V amax over ``seqs``; with
    ``search``, scale errors too.

    Two passes when searching: amax first (the candidates are multiples of it), then errors."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")

    m = Measurement.empty(args)
    caps: Iterator[tuple[TaggedSeq, _Capture]] = ((s, capture_qkv(model, s.ids, device=device)) for s in seqs)
    for seq, cap in caps:
        tags = torch.tensor(seq.tags, dtype=torch.long, device=device)
        for c, n in zip(*torch.unique(tags, return_counts=True)):
            m.counts[int(c)] += int(n)
        m.add_pages(seq.tags)
        for layer in range(args.num_layers):
            q, k, v = cap.q[layer], cap.k[layer], cap.v[layer]
            m.k_amax[layer] = max(m.k_amax[layer], float(k.abs().max()))
            m.v_amax[layer] = max(m.v_amax[layer], float(v.abs().max()))
            if metric == "attn":
                m.add_distortion(class_distortion(q, k, v, tags))
            elif also_attn:
                m.add_attn(class_distortion(q, k, v, tags))
        if metric == "kl":
            m.add_distortion(class_kl(model, seq.ids, tags, device=device, chunk=chunk))
        if progress is not None:
            progress("distortion")
    if search:
        for seq in seqs:
            cap = capture_qkv(model, seq.ids, device=device)
            for layer in range(args.num_layers):
                for kv_dtype in SCALED_DTYPES:
                    ks = [_amax_scale(kv_dtype, m.k_amax[layer]) * f for f in SEARCH_FACTORS]
                    vs = [_amax_scale(kv_dtype, m.v_amax[layer]) * f for f in SEARCH_FACTORS]
                    ek, ev = scale_errors(cap.q[layer], cap.k[layer], cap.v[layer], kv_dtype, ks, vs)
                    m.k_err[kv_dtype][layer] = [a + b for a, b in zip(m.k_err[kv_dtype][layer], ek)]
                    m.v_err[kv_dtype][layer] = [a + b for a, b in zip(m.v_err[kv_dtype][layer], ev)]
            if progress is not None:
                progress("scale search")
    return m


def _amax_scale(kv_dtype: str, amax: float) -> float:
    return amax / scale_top(kv_dtype) if amax > 0 else 1.0


def _best_scales(m: Measurement, kv_dtype: str, search: bool) -> LayerScales:
    k = [_amax_scale(kv_dtype, a) for a in m.k_amax]
    v = [_amax_scale(kv_dtype, a) for a in m.v_amax]
    if not search:
        return LayerScales(tuple(k), tuple(v), "amax")
    one = SEARCH_FACTORS.index(1.0)
    changed = False
    for layer in range(m.args.num_layers):
        for scales, errs in ((k, m.k_err[kv_dtype][layer]), (v, m.v_err[kv_dtype][layer])):
            best = min(range(len(SEARCH_FACTORS)), key=lambda i: (errs[i], abs(SEARCH_FACTORS[i] - 1.0)))
            if errs[best] < errs[one]:
                scales[layer] *= SEARCH_FACTORS[best]
                changed = True
    return LayerScales(tuple(k), tuple(v), "search" if changed else "amax")


def build_calibration(m: Measurement, budgets: Sequence[float], *, search: bool, frequency_source: str = "data") -> Calibration:
    total = sum(m.counts)
    if total == 0:
        raise ValueError("the calibration data produced no tokens")
    a = m.args
    cal = Calibration(
        num_layers=a.num_layers,
        num_kv_heads=a.num_kv_heads,
        head_dim=a.head_dim,
        tokens=total,
        frequency=tuple(c / total for c in m.counts),
        frequency_source=frequency_source,
        distortion={2: tuple(m.d2), 4: tuple(m.d4)},
        tables={},
        scales={d: _best_scales(m, d, search) for d in SCALED_DTYPES},
        pages=page_records(m.pages),
        page_size=PAGE,
        residual=m.residual,
    )
    for b in budgets:
        cal.tables[budget_key(b)] = cal.derive_table(b)
    return cal


def calibrate(
    model_dir: Path,
    data: Sequence[Path],
    budgets: Sequence[float],
    *,
    seq_len: int = 2048,
    max_tokens: int = 16384,
    search: bool = False,
    frequency_source: str = "data",
    device: str | None = None,
    show_progress: bool = True,
    wrap: str = "agent",
    metric: str = "kl",
    page_seq_lens: Sequence[int] = (),
    chunk: int = DEFAULT_CHUNK,
    select: bool = False,
    selection: dict[str, dict[str, float | str]] | None = None,
    attn_out: dict[int, list[float]] | None = None,
    page_data: Sequence[Path] = (),
) -> Calibration:
    """The whole job (module docstring) as a library call. ``page_seq_lens``: count the budget's
    pages on the data wrapped at these context lengths (the lengths served; tagging only; as many
    tokens as were measured, an equal share per length: ``Measurement.set_pages``) instead of on the
    measured prompts. ``page_data``: count them on these files instead of ``data`` (wrapped at ``page_seq_lens``,
    else at ``seq_len``; tagging only). ``attn_out``, if given under the KL metric, gets the attention-MSE D_k (bits -> 56
    sums; measured with the KL D_k, as ``select`` needs them), so a selection can be run on other pages
    (``select_tables``) without this one's."""
    for b in budgets:
        if not 2.0 <= b <= 4.0:
            raise ValueError(f"bit budget must be in [2, 4], got {b:g}")
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    if chunk < 0:
        raise ValueError(f"chunk must be >= 0, got {chunk}")
    check_device(device)
    tagger = ChatTagger(TextTokenizer.from_dir(model_dir), ChatTemplate.from_dir(model_dir))
    seqs = load_data(data, tagger, seq_len=seq_len, max_tokens=max_tokens, wrap=wrap)
    if not seqs:
        raise ValueError("the calibration data produced no prompt of 2 or more tokens")
    page_lens = list(page_seq_lens) or ([seq_len] if page_data else [])
    page_groups = [load_data(page_data or data, tagger, seq_len=n, max_tokens=max(max_tokens, n), wrap=wrap) for n in page_lens]
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args, model = load_model(model_dir, dtype=torch.float32, device=dev)
    with Steps(len(seqs) * (2 if search else 1), desc="calibrate", quiet=not show_progress, leave=True) as steps:
        m = measure(
            model,
            args,
            seqs,
            device=dev,
            search=search,
            progress=steps.step,
            metric=metric,
            chunk=chunk,
            also_attn=(select or attn_out is not None) and metric == "kl",
        )
    if not any(m.d2):
        raise ValueError(
            f"no calibration prompt is longer than one prefill chunk ({chunk} tokens): nothing to measure "
            "(give longer prompts or a smaller --chunk)"
        )
    if page_groups:
        m.set_pages(page_groups)
    cal = build_calibration(m, budgets, search=search, frequency_source=frequency_source)
    if select and metric == "kl":
        cal = select_tables(cal, m.attn, model, seqs, device=dev, chunk=chunk, record=selection)
    if attn_out is not None:
        attn_out.update({b: list(d) for b, d in m.attn.items()})
    return cal


CANDIDATES = ("kl", "attn", "default")


def select_tables(
    cal: Calibration,
    attn: Mapping[int, Sequence[float]],
    model: DecoderModel,
    seqs: Sequence[TaggedSeq],
    *,
    device: torch.device,
    chunk: int,
    record: dict[str, dict[str, float | str]] | None = None,
) -> Calibration:
    """Per budget in ``cal.tables``, the candidate table with the least KL measured whole (every class at
    its bits, the page rule, chunked prefill) on the calibration prompts: the page search's table over
    the KL D_k (``cal``'s own), over the attention-MSE D_k (``attn``: bits -> 56 sums) and over the default
    sensitivities. The per-class sums predict a whole table's KL within a few % (docs/performance-log/fidelity.md),
    not exactly; this keeps the measured best of three good sets. Ties keep the earlier candidate.
    ``record``, if given, gets per budget each candidate's summed KL and the choice. Opt-in
    (``--select``): on the bench's CPU and H200 models it kept the KL table at 7 of 8 budgets and took
    an equal one at the 8th, for about twice the calibration time on CPU."""

    if not attn:
        raise ValueError("select_tables needs the attention-MSE measurements (measure(..., also_attn=True))")
    cal_attn = replace(cal, distortion={b: tuple(d) for b, d in attn.items()})
    cands = {
        key: {
            "kl": table,
            "attn": cal_attn.derive_table(float(key)),
            "default": cal.derive_table(float(key), per_token=default_sensitivity()),
        }
        for key, table in cal.tables.items()
    }
    distinct = sorted({t for c in cands.values() for t in c.values()})
    kl = dict.fromkeys(distinct, 0.0)
    for seq in seqs:
        tags = torch.tensor(seq.tags, dtype=torch.long, device=device)
        ref = log_probs(model, seq.ids, None, device=device)
        for t in distinct:
            kl[t] += table_kl(model, seq.ids, tags, t, device=device, chunk=chunk, ref=ref)
    tables = {}
    for key, c in cands.items():
        best = min(CANDIDATES, key=lambda name: (kl[c[name]], CANDIDATES.index(name)))
        tables[key] = c[best]
        if record is not None:
            record[key] = {**{name: kl[c[name]] for name in CANDIDATES}, "chosen": best}
    return replace(cal, tables=tables)
