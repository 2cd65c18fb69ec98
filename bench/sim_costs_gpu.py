"""Fit the simulator's GPU cost profile of one card (``kvserving simulate --costs gpu-h200`` /
``gpu-h100``) from the committed GPU measurements of that card and write
bench/results/sim_costs_gpu_<card>.json; prints every fit's residuals. Nothing runs on a GPU
here: it reads JSON.

    PYTHONSAFEPATH=1 .venv/bin/python bench/sim_costs_gpu.py [--card h200|h100] [--out FILE]

Sources and formulas for the H200 (``kvserving.sim.costs`` docstring); the H100 reads its own
files of each kind (``CARDS``) and borrows the H200's where it has none (``Card.borrowed``, written
into the profile's notes):

- decode step: bench/results/engine_gpu_h200.json section ``default``, its ``decode`` rows (batch 1..256 x context 4K/32K,
  CUDA graphs, 25 rows over four formats): one least squares of ``step + seq_s * B +
  ctx_s[dtype] * B * context`` (step and per-sequence shared, per-context-token per format);
  the same file's ``iso`` section, its peak rows (32K/128K at each format's largest batch)
  are held out and printed as a check.
- prefill attention over a cached prefix: bench/results/extend_gpu_h200.json (the paged extend
  kernel, one layer, new tokens 512/2048 over prefixes 8K/32K/128K), per format, through the
  origin: ``attn_s[dtype] * new * (prefix + new / 2)`` x 36 layers.
- prefill step: a step that computes prompt tokens runs the model eagerly (no CUDA graph), so it
  costs the eager step's host overhead (engine_gpu_h200.json ``overhead_b64_4k``: the eager step
  less its kernels) once, plus per token: ``prefill_8k`` (8192 fresh tokens in one step), less
  that overhead and the step's attention (``attn_s * 8192 * 4096``), averaged over formats. Other lengths are
  assumed to follow the same linear + attention formula (chunked at the scheduler's chunk size);
  the two-H200 full prefills at 2K/8K/24K (bench/results/pd_gpu_h200x2.json ``off_p_ms``,
  through HTTP) are printed beside the formula as a check, not fitted.
- KV pull: bench/results/pd_gpu_h200x2.json ``bw.nixl`` rows (NIXL READ between two
  H200s, 1..16384 pages, contiguous and scattered): least squares (relative errors) of
  ``overhead + regions * region_s + bytes / bandwidth``. The agent bench pulls on the same device; assumed no slower.
- request overheads from pd_gpu_h200x2.json's seed rows: ``prefill_request_s`` = median of the
  prefill request's time (``new_only_ms``: 1K computed over a local prefix) less its modelled
  step; ``decode_request_s`` = median of the gateway turn's time after the first token
  (``gw_on`` total - ttft) less its 15 modelled decode steps at batch 1. The gateway's own work
  per request (3.4 ms) is docs/performance-log/gateway.md's figure. These are medians of few
  noisy rows: two significant digits are kept.
- two global parameters of the serving loop, fitted once to the agent bench
  (bench/results/agents_gpu_h200.json; the H100's: agents_gpu_h100.json; its points without
  preemptions; line searches, two rounds):
  per sequence per decode step (sampling, detokenizing, streaming each token through the
  gateway, outside the engine bench's bare steps) on TPOT p50, added to ``decode_seq_s``; and
  per prefill request on TTFT p50, added to ``prefill_request_s``. Nothing else is fitted to it.
- one GPU under both workers: bench/results/sim_shared_gpu_h200.json (bench/sim_shared_gpu.py on
  the device machine), the share of its speed each process keeps while both run steps.
- KV bytes per token: the format arithmetic at 36 layers, 8 KV heads, head_dim 128
  (``kvserving.kernels.capacity``), checked against the engine's ``bytes_per_token_int4``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from results_file import read_section  # noqa: E402
from kvserving import jsonfmt  # noqa: E402

RESULTS = HERE / "results"
FORMATS = ("bf16", "fp8_e4m3", "nvfp4", "triaxial")
LAYERS, KV_HEADS, HEAD_DIM = 36, 8, 128


def _read(name: str) -> Any:
    return json.loads((RESULTS / name).read_text())


def _round(x: float, digits: int = 3) -> float:
    """``x`` to ``digits`` significant digits (what the fits support)."""
    return float(f"{x:.{digits}g}")


def fit_decode(engine: dict[str, Any]) -> tuple[float, float, dict[str, float], list[tuple[str, int, int, float, float]]]:
    rows = [(f, r["batch"], r["context"], r["tpot_ms"] / 1e3) for f in FORMATS for r in engine["formats"][f]["decode"] if "tpot_ms" in r]
    a = np.array([[1.0, b] + [b * c if g == f else 0.0 for g in FORMATS] for f, b, c, _ in rows])
    y = np.array([t for *_, t in rows])
    sol = np.linalg.lstsq(a, y, rcond=None)[0]
    step, seq = float(sol[0]), float(sol[1])
    ctx = {f: float(sol[2 + i]) for i, f in enumerate(FORMATS)}
    pred = a @ sol
    return step, seq, ctx, [(f, b, c, t, float(p)) for (f, b, c, t), p in zip(rows, pred)]


def fit_extend(extend: dict[str, Any]) -> tuple[dict[str, float], list[tuple[str, int, int, float, float]]]:
    out: dict[str, float] = {}
    resid = []
    for f in FORMATS:
        rows = [(r["new"], r["prefix"], r["ms"] * LAYERS / 1e3) for r in extend["rows"] if r["format"] == f and r["impl"] == "ours"]
        if not rows:
            continue  # a format the card's bench did not run (fit_engine borrows the H200's)
        x = np.array([n * (p + n / 2) for n, p, _ in rows])
        y = np.array([t for *_, t in rows])
        k = float(x @ y / (x @ x))
        out[f] = k
        resid += [(f, n, p, t, k * xi) for (n, p, t), xi in zip(rows, x)]
    return out, resid


def _fit_relative(a: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least squares of ``a @ sol ~ y`` in relative errors (the rows span 0.1 ms .. 190 ms): the solution and
    its predictions."""
    w = 1.0 / y
    sol = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)[0]
    return sol, a @ sol


def fit_transfer(bw: dict[str, Any]) -> tuple[float, float, float, list[tuple[str, int, int, float, float]]]:
    rows = [(f, r["regions"], r["bytes"], r["median_s"]) for f, rs in bw["bw"]["nixl"].items() for r in rs]
    sol, pred = _fit_relative(np.array([[1.0, reg, nb] for _, reg, nb, _ in rows]), np.array([t for *_, t in rows]))
    return float(sol[0]), float(sol[1]), 1.0 / float(sol[2]), [(f, reg, nb, t, float(p)) for (f, reg, nb, t), p in zip(rows, pred)]


def fit_read_rows(docs: list[dict[str, Any]]) -> tuple[float, float, float, list[tuple[str, int, int, float, float]]]:
    """The pull's cost from bench/nixl_read_gpu.py results (NIXL READs between two processes on
    one device, as the one-GPU agent stack pulls): least squares (relative errors) of
    ``regions * region_s + bytes / bandwidth``. Every row reads the same bytes, so a fixed
    overhead is not told apart from their time: it is 0."""
    rows = [(f"{d['kv_layout']} {r['case']}", r["regions"], int(r["mb"] * 1e6), r["read_ms"] / 1e3) for d in docs for r in d["rows"]]
    sol, pred = _fit_relative(np.array([[reg, nb] for _, reg, nb, _ in rows]), np.array([t for *_, t in rows]))
    return 0.0, float(sol[0]), 1.0 / float(sol[1]), [(f, reg, nb, t, float(p)) for (f, reg, nb, t), p in zip(rows, pred)]


SERVE_RANGE_S = (0.0, 4e-3, 5e-5)  # per sequence per decode step: low, high, resolution
REQUEST_RANGE_S = (0.0, 0.5, 5e-3)  # per prefill request


def _line_fit(
    measured: dict[str, Any],
    costs: dict[str, Any],
    key: str,
    base: float,
    span: tuple[float, float, float],
    metric: str,
    clean: set[tuple[str, int]],
) -> tuple[float, list[tuple[str, int, float, float]]]:
    """The value (added to ``costs[key]``, which starts at ``base``) in ``span`` whose simulated
    ``metric`` is closest (squared log ratio) to the measured one over the ``clean`` points:
    golden-section search down to the span's resolution (the error is unimodal in either
    parameter: more per-step or per-request cost only lengthens every simulated time)."""
    import math

    from kvserving.sim.costs import CostModel
    from kvserving.sim.gpu import reproduce

    seen: dict[float, tuple[float, list[tuple[str, int, float, float]]]] = {}

    def err(extra: float) -> float:
        if extra not in seen:
            model = CostModel.from_dict({**costs, key: base + extra})
            rows = [r for r in reproduce(measured, model, only=clean) if r["mode"] == "lease"]
            pairs = [(r["format"], r["concurrency"], r["sim"][metric], r["measured"][metric]) for r in rows]
            seen[extra] = (sum(math.log(s / m) ** 2 for _, _, s, m in pairs), pairs)
        return seen[extra][0]

    lo, hi, resolution = span
    ratio = (math.sqrt(5) - 1) / 2
    x1, x2 = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    while hi - lo > resolution:
        if err(x1) <= err(x2):
            hi, x2 = x2, x1
            x1 = hi - ratio * (hi - lo)
        else:
            lo, x1 = x1, x2
            x2 = lo + ratio * (hi - lo)
    best = min(seen, key=lambda x: seen[x][0])
    return best, seen[best][1]


def fit_serving(costs: dict[str, Any], agents: str) -> tuple[float, float, dict[str, list[tuple[str, int, float, float]]]]:
    """The two serving-loop parameters, one value each for every point, fitted on the agent
    bench's points without measured preemptions (there the serving loop is what the step costs
    leave unknown; the cliff points add the pool's dynamics): per sequence per decode step (on
    TPOT p50) and per prefill request (on TTFT p50); two rounds of one line search each.
    Returns (seconds per sequence per step, seconds per prefill request, residual rows)."""
    measured = _read(agents)
    clean = {
        (p["format"], p["concurrency"])
        for p in measured["points"]
        if p["mode"] == "lease" and p.get("prefill_preemptions", 0) + p.get("decode_preemptions", 0) == 0
    }
    seq0, req0 = costs["decode_seq_s"], costs["prefill_request_s"]
    seq_x, req_x = 0.0, 0.0
    rows: dict[str, list[tuple[str, int, float, float]]] = {}
    for _ in range(2):
        seq_x, rows["tpot_p50_ms"] = _line_fit(
            measured, {**costs, "prefill_request_s": req0 + req_x}, "decode_seq_s", seq0, SERVE_RANGE_S, "tpot_p50_ms", clean
        )
        req_x, rows["ttft_p50_ms"] = _line_fit(
            measured, {**costs, "decode_seq_s": seq0 + seq_x}, "prefill_request_s", req0, REQUEST_RANGE_S, "ttft_p50_ms", clean
        )
    return _round(seq_x, 2), _round(req_x, 2), rows


DATA = HERE.parent / "docs" / "performance-log" / "data"


@dataclass(frozen=True, slots=True)
class Card:
    """The measurements one card's profile is fitted from (files under bench/results unless
    named otherwise). Where the card has no measurement of a kind, the H200's is used and
    ``borrowed`` says which and why; each entry becomes a note of the profile."""

    name: str  # the profile's name
    label: str  # the card as the notes name it
    engine: str  # bench/engine_gpu.py (section ``engine_section``): decode rows, prefill_8k, eager overhead, pool
    extend: str  # bench/extend_gpu.py: the paged extend kernel per format
    agents: str  # bench/agents.py --gpu: the sweep the serving loop is fitted to
    held_out: bool  # the engine file has an ``iso`` section of peak rows to check the decode fit on
    reads: tuple[str, ...]  # bench/nixl_read_gpu.py results under docs/performance-log/data; () : the two-H200 rows
    borrowed: tuple[tuple[str, str], ...] = ()  # (note key, what is borrowed and why)
    # the engine file's section: the engine as it ran the agent sweep (a later run of the engine bench may sit
    # beside it under ``default``)
    engine_section: str = "default"


H200 = Card("gpu-h200", "H200", "engine_gpu_h200.json", "extend_gpu_h200.json", "agents_gpu_h200.json", True, ())
H100 = Card(
    "gpu-h100",
    "H100",
    "engine_gpu_h100.json",
    "extend_gpu_h100.json",
    "agents_gpu_h100.json",
    False,
    tuple(f"page_major/nixl_read_{layout}.json" for layout in ("page_major", "layer_major", "layer_major_2")),
    (
        (
            "borrowed_prefill_attn_bf16",
            "no bf16 row in extend_gpu_h100.json: the H200's bf16 extend fit (the same compute; the H100's fp8, nvfp4 and "
            "triaxial rows are within 6 % of the H200's)",
        ),
        (
            "borrowed_request_s",
            "no P/D run on H100s: prefill_request_s and decode_request_s before the serving loop are the two-H200 "
            "P/D rows less the H200 profile's modelled steps (host and HTTP work of the requests)",
        ),
        (
            "borrowed_shared_gpu",
            "no bench/sim_shared_gpu.py run on an H100: the H200's shares (sim_shared_gpu_h200.json)",
        ),
        ("borrowed_gateway_s", "docs/performance-log/gateway.md's figure, measured off the GPU"),
    ),
    engine_section="sweep",
)
CARDS = {"h200": H200, "h100": H100}


@dataclass(frozen=True, slots=True)
class EngineFit:
    """A card's decode and prefill step fits (``kvserving.sim.costs`` formulas)."""

    engine: dict[str, Any]
    step: float
    seq: float
    ctx: dict[str, float]
    dec_rows: list[tuple[str, int, int, float, float]]
    attn: dict[str, float]
    ext_rows: list[tuple[str, int, int, float, float]]
    eager_s: float
    token_s: float
    per_tok: list[float]

    def prefill_s(self, f: str, computed: int, prefix: int, chunk: int = 2048) -> float:
        t, pos, left = 0.0, prefix, computed
        while left > 0:
            n = min(chunk, left)
            t += self.eager_s + self.token_s * n + self.attn[f] * n * (pos + n / 2)
            pos += n
            left -= n
        return t

    def decode_s(self, f: str, batch: int, ctx_tokens: float) -> float:
        return self.step + self.seq * batch + self.ctx[f] * ctx_tokens


def fit_engine(card: Card) -> EngineFit:
    engine = read_section(RESULTS / card.engine, card.engine_section)
    step, seq, ctx, dec_rows = fit_decode(engine)
    attn, ext_rows = fit_extend(_read(card.extend))
    if len(attn) < len(FORMATS):  # formats the card's extend bench did not run: the H200's (Card.borrowed)
        h200_attn, _ = fit_extend(_read(H200.extend))
        attn = {f: attn.get(f, h200_attn[f]) for f in FORMATS}
    # a step that computes prompt tokens runs the model eagerly (no CUDA graph): the host's
    # launches cost what the eager decode step at batch 64 / 4K takes beyond its kernels
    eager = engine["formats"]["fp8_e4m3"]["overhead_b64_4k"]["eager"]
    eager_s = eager["overhead_ms"] / 1e3
    per_tok = []
    for f in FORMATS:
        p8 = engine["formats"][f]["prefill_8k"]
        n = p8["tokens"]
        per_tok.append((p8["seconds"] - eager_s - attn[f] * n * (n / 2)) / n)
    return EngineFit(engine, step, seq, ctx, dec_rows, attn, ext_rows, eager_s, statistics.mean(per_tok), per_tok)


def request_overheads(
    pd: dict[str, Any], e: EngineFit
) -> tuple[float, float, list[float], list[float], list[tuple[str, int, float, float]]]:
    """``prefill_request_s`` and ``decode_request_s`` from the P/D seed rows less ``e``'s modelled
    steps (``e``: the fit of the card the rows ran on); the lists they are medians of; the full
    prefills beside the formula."""
    pre_over, dec_over, full_rows = [], [], []
    for f, v in pd["seed"]["formats"].items():
        if f not in FORMATS:
            continue  # a run with a known defect keeps its own name
        for r in v["rows"]:
            length = r["L"]
            u = r["new_only_usage"]
            pre_over.append(r["new_only_ms"] / 1e3 - e.prefill_s(f, u["computed_prompt_tokens"], u["local_cached_tokens"]))
            gw = r.get("gw_on") or {}
            if gw:
                gen = gw["usage"]["completion_tokens"]
                dec_over.append((gw["total_ms"] - gw["ttft_ms"]) / 1e3 - (gen - 1) * e.decode_s(f, 1, length))
            full_rows.append((f, length, r["off_p_ms"] / 1e3, e.prefill_s(f, length, 0)))
    prefill_request_s = _round(max(0.0, statistics.median(pre_over)), 2)
    decode_request_s = _round(max(0.0, statistics.median(dec_over)), 2)
    return prefill_request_s, decode_request_s, pre_over, dec_over, full_rows


def _notes(card: Card, bpt: dict[str, float], speed_kv_gib: float) -> dict[str, str]:
    common = {
        "prefill_lengths": "every length: prefill_token_s per token + the extend kernel's per-format attention over what precedes it (8K fresh rate less its attention); chunked by the scheduler",
        "bytes_per_token": json.dumps({f: int(b) for f, b in bpt.items()}) + "; triaxial: the 2.7-bit budget's INT2/INT4 page mix",
    }
    if card is H200:
        return {
            **common,
            "kv_bytes_per_worker": "the engine benchmark's 90 GiB pool on one H200 (speed_kv_gib); bench/agents.py --gpu ran 8 GiB per worker",
            "transfer": "two H200s over NVLink (cuda_ipc); the one-GPU agent stack pulls on the same device, assumed no slower",
            "prefill_step_s": "a step with prompt tokens runs eagerly: engine_gpu_h200.json overhead_b64_4k, the eager step "
            "less its kernels (fp8, batch 64 at 4K); a step with prompt chunks and decodes costs both formulas",
            "shared_gpu": "bench/sim_shared_gpu.py: a prefill-shaped and a decode-shaped process time-slicing one H200, "
            "each one's steps per second together over alone",
        }
    return {
        **common,
        "kv_bytes_per_worker": f"the engine benchmark's {speed_kv_gib:g} GiB pool on one {card.label} (speed_kv_gib); "
        "bench/agents.py --gpu ran 8 GiB per worker",
        "transfer": f"NIXL READs between two processes on one {card.label} (cuda_ipc), page-major and layer-major "
        "(docs/performance-log/data/" + ", ".join(card.reads) + ")",
        "prefill_step_s": f"a step with prompt tokens runs eagerly: {card.engine} overhead_b64_4k, the eager step "
        "less its kernels (fp8, batch 64 at 4K); a step with prompt chunks and decodes costs both formulas",
        "shared_gpu": "bench/sim_shared_gpu.py on an H200 (see borrowed_shared_gpu)",
        **dict(card.borrowed),
    }


def _source(card: Card) -> str:
    if card is H200:
        return (
            "bench/sim_costs_gpu.py from bench/results/engine_gpu_h200.json, extend_gpu_h200.json, "
            "pd_gpu_h200x2.json, sim_shared_gpu_h200.json; docs/performance-log/gateway.md (gateway_s)"
        )
    return (
        f"bench/sim_costs_gpu.py --card {card.label.lower()} from bench/results/{card.engine} (section {card.engine_section}), "
        f"{card.extend}, {card.agents}, "
        + ", ".join(f"docs/performance-log/data/{r}" for r in card.reads)
        + "; borrowed from the H200: extend_gpu_h200.json (bf16), pd_gpu_h200x2.json (request overheads), "
        "sim_shared_gpu_h200.json; docs/performance-log/gateway.md (gateway_s)"
    )


def fit(out: Path, card: Card = H200) -> dict[str, Any]:
    from kvserving.kernels.capacity import bytes_per_token
    from kvserving.sim.costs import CostModel

    e = fit_engine(card)
    engine, step, seq, ctx, attn = e.engine, e.step, e.seq, e.ctx, e.attn
    pd = _read("pd_gpu_h200x2.json")
    if card.reads:
        overhead, region_s, bw_bps, bw_rows = fit_read_rows([json.loads((DATA / r).read_text()) for r in card.reads])
    else:
        overhead, region_s, bw_bps, bw_rows = fit_transfer(pd)
    shared = _read("sim_shared_gpu_h200.json")
    # the P/D rows ran on H200s: their steps are the H200's, whichever card is fitted
    prefill_request_s, decode_request_s, pre_over, dec_over, full_rows = request_overheads(pd, e if card is H200 else fit_engine(H200))

    shape = {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM}
    bpt = {f: bytes_per_token(f, **shape) for f in ("bf16", "fp8_e4m3", "nvfp4")}
    for f, b in bpt.items():
        measured = engine["formats"][f]["capacity"]["bytes_per_token_int4"]
        assert b == measured, f"{f}: format arithmetic {b} B/token, the engine reported {measured}"

    costs = {
        "name": card.name,
        "layers": LAYERS,
        "kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "kv_bytes_per_worker": int(engine["speed_kv_gib"] * 2**30),
        "prefill_step_s": _round(e.eager_s),
        "prefill_token_s": _round(e.token_s),
        "prefill_attn_s": _round(attn["bf16"]),
        "prefill_attn_dtype_s": {f: _round(v) for f, v in attn.items()},
        "decode_step_s": _round(step),
        "decode_seq_s": _round(seq),
        "decode_ctx_s": {f: _round(v) for f, v in ctx.items()},
        "transfer_overhead_s": _round(max(0.0, overhead)),
        "transfer_region_s": _round(region_s),
        "transfer_bytes_per_s": _round(bw_bps),
        "transfer_runs": 1,
        "gateway_s": 3.4e-3,
        "prefill_request_s": prefill_request_s,
        "decode_request_s": decode_request_s,
        "triaxial_bit_budget": 2.7,
        "shared_gpu_prefill_share": _round(shared["share"]["prefill"], 2),
        "shared_gpu_decode_share": _round(shared["share"]["decode"], 2),
        "source": _source(card),
        "notes": _notes(card, bpt, engine["speed_kv_gib"]),
    }
    engine_seq_s, pd_request_s = costs["decode_seq_s"], costs["prefill_request_s"]
    serve_seq_s, serve_req_s, serve_rows = fit_serving(costs, card.agents)
    costs["decode_seq_s"] = _round(engine_seq_s + serve_seq_s)
    costs["prefill_request_s"] = _round(pd_request_s + serve_req_s, 2)
    costs["notes"]["decode_seq_s"] = (
        f"{engine_seq_s:.3g} s per sequence per step from the engine table + {serve_seq_s:.3g} s of the serving loop, "
        "fitted to the agent bench (bench/sim_costs_gpu.py fit_serving): the engine bench times bare steps; the stack "
        "also samples, detokenizes and streams every sequence's token through the gateway"
    )
    costs["notes"]["prefill_request_s"] = (
        f"{pd_request_s:.2g} s from the two-H200 P/D rows + {serve_req_s:.2g} s fitted to the agent bench's TTFT p50 "
        "(bench/sim_costs_gpu.py fit_serving): the gateway renders and tokenizes the whole 5-25K-token history each turn, "
        "where the P/D bench sent 2-24K-token prompts at one request at a time"
    )
    CostModel.from_dict(costs)  # refuses a bad profile before writing it
    out.write_text(jsonfmt.dumps(costs, sort_keys=True))
    _report(card, e, bw_rows, (overhead, region_s, bw_bps), (prefill_request_s, pre_over), (decode_request_s, dec_over), full_rows)
    print(
        f"fitted to the agent bench: {serve_seq_s * 1e3:.2f} ms per sequence per decode step, "
        f"{serve_req_s * 1e3:.0f} ms per prefill request; sim / measured at the fitted values:"
    )
    for metric, pairs in serve_rows.items():
        for fmt, n, sim_ms, meas_ms in pairs:
            print(f"  {metric:>11} {fmt:>9} N={n:>3} {sim_ms:>7.1f} {meas_ms:>7.1f} ms {(sim_ms - meas_ms) / meas_ms:>+7.1%}")
    print(f"wrote {out}")
    return costs


def _report(
    card: Card,
    e: EngineFit,
    bw_rows: list[tuple[str, int, int, float, float]],
    transfer: tuple[float, float, float],
    pre: tuple[float, list[float]],
    dec: tuple[float, list[float]],
    full_rows: list[tuple[str, int, float, float]],
) -> None:
    print(
        f"decode: step {e.step * 1e3:.2f} ms + {e.seq * 1e6:.1f} us/seq + per context token "
        + ", ".join(f"{f} {v * 1e9:.2f} ns" for f, v in e.ctx.items())
    )
    print(f"{'format':>9} {'B':>4} {'ctx':>6} {'meas ms':>8} {'fit ms':>7} {'resid':>7}")
    for f, b, c, t, p in e.dec_rows:
        print(f"{f:>9} {b:>4} {c:>6} {t * 1e3:>8.2f} {p * 1e3:>7.2f} {(p - t) / t:>+7.1%}")
    errs = [abs(p - t) / t for *_, t, p in e.dec_rows]
    print(f"  max |resid| {max(errs):.1%}, mean {statistics.mean(errs):.1%}")
    if card.held_out:
        print(f"held out ({card.engine} iso peak rows):")
        iso = read_section(RESULTS / card.engine, "iso")["formats"]["iso"]["contexts"]
        for length, per in iso.items():
            for f, v in per.items():
                pk = v.get("peak") if isinstance(v, dict) else None
                if f in FORMATS and pk and "tpot_ms" in pk:
                    p = e.decode_s(f, pk["batch"], pk["batch"] * pk["context"])
                    print(
                        f"{f:>9} {pk['batch']:>4} {pk['context']:>6} {pk['tpot_ms']:>8.2f} {p * 1e3:>7.2f} {(p - pk['tpot_ms'] / 1e3) / (pk['tpot_ms'] / 1e3):>+7.1%}"
                    )
    else:
        print(f"held out: {card.engine} has no iso section")
    print(
        f"prefill: {e.token_s * 1e6:.2f} us/token (8K rates less attention: "
        + ", ".join(f"{x * 1e6:.2f}" for x in e.per_tok)
        + "); attention per token x context: "
        + ", ".join(f"{f} {v * 1e9:.2f} ns" for f, v in e.attn.items())
    )
    ext_err = [abs(p - t) / t for *_, t, p in e.ext_rows]
    print(f"  extend fit: max |resid| {max(ext_err):.1%} over {len(e.ext_rows)} rows")
    print("  full prefill through HTTP (pd_gpu_h200x2 off_p, not fitted) vs formula:")
    for f, length, t, p in full_rows:
        print(f"{f:>9} {length:>6} {t * 1e3:>8.1f} {p * 1e3:>7.1f} ms (gap {(t - p) * 1e3:+.0f} ms)")
    overhead, region_s, bw_bps = transfer
    print(f"transfer: {overhead * 1e3:.3f} ms + {region_s * 1e6:.2f} us/region + {bw_bps / 1e9:.0f} GB/s")
    bw_err = [abs(p - t) / t for *_, t, p in bw_rows]
    for f, reg, nb, t, p in bw_rows:
        print(f"{f:>9} {reg:>6} regions {nb / 2**20:>9.1f} MiB {t * 1e3:>8.3f} {p * 1e3:>8.3f} ms {(p - t) / t:>+7.1%}")
    print(f"  max |resid| {max(bw_err):.1%}")
    prefill_request_s, pre_over = pre
    decode_request_s, dec_over = dec
    print(
        f"prefill_request_s {prefill_request_s} (median of {len(pre_over)}: "
        + ", ".join(f"{x * 1e3:.0f}" for x in sorted(pre_over))
        + " ms)"
    )
    print(
        f"decode_request_s {decode_request_s} (median of {len(dec_over)}: " + ", ".join(f"{x * 1e3:.0f}" for x in sorted(dec_over)) + " ms)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--card", choices=sorted(CARDS), default="h200", help="whose measurements to fit (default h200)")
    ap.add_argument("--out", type=Path, default=None, help="default: bench/results/sim_costs_gpu_<card>.json")
    args = ap.parse_args()
    fit(args.out or RESULTS / f"sim_costs_gpu_{args.card}.json", CARDS[args.card])


if __name__ == "__main__":
    main()
