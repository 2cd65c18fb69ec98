"""Calibrate the simulator's CPU cost profile (``kvserving simulate --costs cpu-tiny``) on the
real engine with the built-in tiny model, and write bench/results/sim_costs_cpu.json.

    PYTHONSAFEPATH=1 .venv/bin/python bench/sim_costs_cpu.py [--out bench/results/sim_costs_cpu.json]

Measured here (the engine in this process, ``torch.set_num_threads(1)``, medians of a few steps):

- prefill steps: one chunk of n new tokens over a cached prefix of c tokens, for n in {32, 128,
  512} and c in {0, 512}: least squares of ``step + token_s * n + attn_s * n * (c + n/2)``;
- decode steps: batch b in {1, 4, 16} at ~300 tokens of context, per format: ``step + seq_s * b
  + ctx_s[dtype] * sum(ctx)``;
- prompt tokens: the agents of bench/agents.py's CPU load rendered with the tiny model's chat
  template and tokenized (what the gateway sends), against their nominal lengths: a linear fit;
  and whether each prompt starts with the previous prompt plus the reply (tokens lost at the
  reply's end: ``reply_lost_tokens``).

Not measured here, taken from the pages that hold them: the gateway's CPU per request (3.3 ms,
docs/performance-log/gateway.md) and a CPU NIXL descriptor (1.4 us, DESIGN.md Worker). The worker
requests' HTTP and lease round trips (``prefill_request_s``, ``decode_request_s``,
``transfer_overhead_s``) are set from the bench's own measurements when bench/results/agents_cpu.json
holds them (see docs/performance-log/simulate.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from kvserving import jsonfmt  # noqa: E402
from kvserving.config import KVCacheConfig, ModelConfig, SchedulerConfig, ServingConfig  # noqa: E402
from kvserving.model_dir import tiny_model_dir  # noqa: E402
from kvserving.worker.engine import LLMEngine  # noqa: E402
from kvserving.worker.sampling import SamplingParams  # noqa: E402

FORMATS = ("bf16", "fp8_e4m3", "nvfp4", "triaxial")


def engine(model: Path, dtype: str) -> LLMEngine:
    return LLMEngine(
        ServingConfig(
            model=ModelConfig(path=str(model)),
            kv_cache=KVCacheConfig(dtype=dtype, memory_bytes=64 << 20),
            scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=1024, chunk_size=512),
        )
    )


def _lstsq(rows: list[list[float]], ys: list[float], *, clamp: bool = True) -> list[float]:
    """Least squares; ``clamp``: negative coefficients (noise on a loaded machine) become 0."""
    a = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
    sol = torch.linalg.lstsq(a, y).solution.squeeze(1)
    return [max(0.0, float(v)) if clamp else float(v) for v in sol]


def prefill_points(eng: LLMEngine) -> list[tuple[int, int, float]]:
    """(new tokens, cached prefix, seconds) of single prefill steps."""
    out = []
    g = torch.Generator().manual_seed(1)
    for c in (0, 512):
        for n in (32, 128, 512):
            times = []
            for rep in range(3):
                prefix = torch.randint(10, eng.vocab_size, (c,), generator=g).tolist()
                if c:
                    eng.generate([prefix + [7]], SamplingParams(max_tokens=1, ignore_eos=True))
                ids = prefix + torch.randint(10, eng.vocab_size, (n,), generator=g).tolist()
                eng.add_request(f"p{c}-{n}-{rep}", ids, SamplingParams(max_tokens=1, ignore_eos=True))
                t0 = time.perf_counter()
                eng.step()  # the whole chunk (n <= chunk_size) and the first token
                times.append(time.perf_counter() - t0)
                while eng.has_unfinished():
                    eng.step()
            out.append((n, c, statistics.median(times)))
    return out


def decode_points(eng: LLMEngine) -> list[tuple[int, int, float]]:
    """(batch, context tokens in the batch, seconds) of decode steps."""
    out = []
    g = torch.Generator().manual_seed(2)
    for b in (1, 4, 16):
        for n in range(b):
            ids = torch.randint(10, eng.vocab_size, (300,), generator=g).tolist()
            eng.add_request(f"d{b}-{n}", ids, SamplingParams(max_tokens=12, ignore_eos=True))
        while (
            eng.stats.decode_tokens == 0 or any(s.num_computed < len(s.prompt_ids) for s in eng.scheduler.running) or eng.scheduler.waiting
        ):
            eng.step()
        times = []
        while eng.has_unfinished():
            t0 = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
        out.append((b, b * 305, statistics.median(times)))
        eng.stats.decode_tokens = 0
    return out


def token_fit(model: Path) -> tuple[float, float, int, list[tuple[int, int]]]:
    """Nominal vs rendered prompt lengths of the bench's CPU agents; tokens lost at replies."""
    from agents import cpu_load  # bench/agents.py

    from kvserving.agents.load import WORDS, Conversation, agent
    from kvserving.gateway.prompt.chat_template import ChatTemplate, normalize_messages, normalize_tools
    from kvserving.gateway.prompt.tokenizer import TextTokenizer

    tok = TextTokenizer.from_dir(model)
    tmpl = ChatTemplate.from_dir(model)
    load = cpu_load(0, think_s=0.5)
    pairs: list[tuple[int, int]] = []
    lost: list[int] = []
    for i in range(24):
        spec = agent(load, i)
        conv = Conversation(spec)
        prev: list[int] | None = None
        for turn in spec.turns:
            msgs = normalize_messages(conv.request(turn))
            text = tmpl.render(msgs, tools=normalize_tools(conv.tools))
            ids = tok.encode(text).ids if hasattr(tok.encode(text), "ids") else tok.encode(text)
            if prev is not None:
                common = next((k for k, (a, b) in enumerate(zip(prev, ids)) if a != b), min(len(prev), len(ids)))
                lost.append(len(prev) - common)
            pairs.append((turn.history_tokens, len(ids)))
            reply = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(turn.output_tokens))
            conv.reply(turn, reply)
            reply_ids = tok.encode(reply)
            prev = list(ids) + list(reply_ids.ids if hasattr(reply_ids, "ids") else reply_ids)
    xs = [float(n) for n, _ in pairs]
    ys = [float(r) for _, r in pairs]
    scale, offset = _lstsq([[x, 1.0] for x in xs], ys, clamp=False)
    return scale, offset, int(statistics.median(lost)) if lost else 0, pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "results" / "sim_costs_cpu.json")
    ap.add_argument("--kv-kib", type=int, default=1536, help="KV pool per worker (bench/agents.py's default)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = tiny_model_dir()
    cfg = json.loads((model / "config.json").read_text())
    pre = prefill_points(engine(model, "bf16"))
    step, token_s, attn_s = _lstsq([[1.0, n, n * (c + n / 2)] for n, c, _ in pre], [t for _, _, t in pre])
    ctx_s: dict[str, float] = {}
    dec_rows: dict[str, list[tuple[int, int, float]]] = {}
    base = []
    for fmt in FORMATS:
        pts = decode_points(engine(model, fmt))
        dec_rows[fmt] = pts
        d_step, seq_s, c_s = _lstsq([[1.0, b, ctx] for b, ctx, _ in pts], [t for _, _, t in pts])
        ctx_s[fmt] = c_s + seq_s / 305  # the batch and its context grow together here: fold per-seq cost in
        base.append(d_step)
    scale, offset, lost, pairs = token_fit(model)
    old = json.loads(args.out.read_text()) if args.out.is_file() else {}
    costs = {
        "name": "cpu-tiny",
        "layers": int(cfg["num_hidden_layers"]),
        "kv_heads": int(cfg["num_key_value_heads"]),
        "head_dim": int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]),
        "kv_bytes_per_worker": args.kv_kib * 1024,
        "fp32_unquantized": True,
        "prefill_step_s": step,
        "prefill_token_s": token_s,
        "prefill_attn_s": attn_s,
        "decode_step_s": statistics.median(base),
        "decode_seq_s": 0.0,
        "decode_ctx_s": ctx_s,
        "transfer_region_s": 1.4e-6,
        "transfer_bytes_per_s": old.get("transfer_bytes_per_s", 2e9),
        "transfer_overhead_s": old.get("transfer_overhead_s", 0.004),
        "transfer_runs": 1,
        "gateway_s": 3.3e-3,
        "prefill_request_s": old.get("prefill_request_s", 0.004),
        "decode_request_s": old.get("decode_request_s", 0.004),
        "prompt_token_scale": scale,
        "prompt_token_offset": offset,
        "reply_lost_tokens": lost,
        "triaxial_bit_budget": 2.7,
        "source": "bench/sim_costs_cpu.py on the dev machine (2 shared cores): PYTHONSAFEPATH=1 .venv/bin/python bench/sim_costs_cpu.py --out bench/results/sim_costs_cpu.json",
        "notes": {
            "prefill_points": json.dumps([[n, c, round(t * 1e3, 3)] for n, c, t in pre]),
            "decode_points": json.dumps({k: [[b, c, round(t * 1e3, 3)] for b, c, t in v] for k, v in dec_rows.items()}),
            "token_pairs": f"{len(pairs)} prompts; server = {scale:.3f} x nominal + {offset:.1f}",
            **{k: v for k, v in old.get("notes", {}).items() if k.startswith("bench_")},
        },
    }
    from kvserving.sim.costs import CostModel

    CostModel.from_dict(costs)  # refuses a bad profile before writing it
    args.out.write_text(jsonfmt.dumps(costs, sort_keys=True))
    print(json.dumps({k: v for k, v in costs.items() if k != "notes"}, indent=1))
    print(costs["notes"])


if __name__ == "__main__":
    main()
