"""Triaxial age-down on CPU: a tagged agent conversation through a prefill and a decode
worker (two engines, two NIXL agents, real UCX READs over CPU memory, bidirectional
reuse as in bench/reuse_cpu.py), with ``kv_cache.age_down`` off and on. Per turn: the
decode worker's retained conversation in bytes per token and INT2 page share, the share
a fresh computation of the same prompt would store at INT2 (the bits table's promise),
KV bytes moved each way, pages aged; then the attention-output error of an aged page
against a page quantized to INT2 directly, on the tiny model's real q/k/v.

    PYTHONSAFEPATH=1 .venv/bin/python bench/age_down_cpu.py [--model DIR] [--obs 448] [--gen 32] [--json OUT]

Each turn appends a tool result (``--obs`` tokens, tagged obs) between template
delimiters, and the decode worker's reply (tagged assistant when it comes back).
Tags age with the turn: current, turn_m1, turn_m2, older (DESIGN.md, Token tags);
the bits table is the default one for bit budget 2.7. Before every turn the prefill
worker's prefix cache is emptied (the history lives on the decode worker only).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvserving.config import KVCacheConfig, ModelConfig, ReuseConfig, SchedulerConfig, ServingConfig
from kvserving.kernels.intquant import dequantize_groups, dequantize_int2_keys, quantize_groups, quantize_int2_keys
from kvserving.kernels.layout import PageLayout
from kvserving.kernels.page_ids import page_id_bits
from kvserving.tags import TEMPORAL, encode_tag
from kvserving.worker.engine import LLMEngine, RequestOutput
from kvserving.worker.kv.local_pair import LocalPair, flush_prefix_cache
from kvserving.worker.kv.transfer import KVTransfer, PullResult
from kvserving.worker.kv.protocol import KVTransferParams
from kvserving.worker.precision import page_bits
from kvserving.worker.sampling import SamplingParams
from kvserving.tiny_model import build_tiny_model

P = 32


def make_engine(model: Path, age_down: bool) -> LLMEngine:
    return LLMEngine(
        ServingConfig(
            model=ModelConfig(path=str(model)),
            kv_cache=KVCacheConfig(dtype="triaxial", memory_bytes=96 << 20, age_down=age_down),
            reuse=ReuseConfig(recompute_threshold_tokens=0),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, chunk_size=512),
        ),
        device="cpu",
    )


def run_request(
    kvt: KVTransfer, rid: str, ids: list[int], tags: list[int], max_tokens: int, params: KVTransferParams | None
) -> tuple[PullResult, RequestOutput, list[int]]:
    pull = kvt.pull(ids, tags, params)
    eng = kvt.engine
    eng.add_request(
        rid,
        ids,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        tags=tags,
        retain=kvt.retain_spec(conversation_key="conv", input_ids=ids),
        admission_pin=pull.admission_pin,
    )
    tokens: list[int] = []
    while True:
        for out in eng.step():
            if out.request_id == rid:
                tokens.extend(out.new_token_ids)
                if out.finished:
                    return pull, out, tokens


@dataclass
class TurnRow:
    turn: int
    prompt: int
    retained_tokens: int
    bytes_per_token: float  # decode worker's retained conversation, all layers, K and V
    int2_share: float  # of its full pages
    fresh_int2_share: float  # of the prompt's full pages, were it computed now with these tags
    bytes_d_to_p: int
    bytes_p_to_d: int
    aged_p: int
    aged_d: int


class Conversation:
    """Segments (tokens, semantic class, turn index); tags are derived per turn from the turn's age."""

    def __init__(self, pair: LocalPair, *, obs: int, gen: int, seed: int) -> None:
        self.pair, self.obs, self.gen = pair, obs, gen
        self.g = torch.Generator().manual_seed(seed)
        self.segments: list[tuple[list[int], str, int]] = []
        self.d_params: KVTransferParams | None = None
        self.n = 0
        self.add(96, "inst")  # system prompt and tool schemas
        self.add(4, "delim")
        self.add(60, "user")  # the task
        self.add(4, "delim")

    def add(self, n: int, semantic: str, ids: list[int] | None = None) -> None:
        ids = ids if ids is not None else torch.randint(10, 4000, (n,), generator=self.g).tolist()
        self.segments.append((ids, semantic, self.n))

    def prompt(self) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        tags: list[int] = []
        for seg, semantic, turn in self.segments:
            age = TEMPORAL[min(self.n - turn, len(TEMPORAL) - 1)]
            ids += seg
            tags += [encode_tag(age, "text", semantic)] * len(seg)
        return ids, tags

    def turn(self) -> TurnRow:
        if self.n:  # a tool result came back for the last reply
            self.add(4, "delim")
            self.add(self.obs, "obs")
            self.add(4, "delim")
        ids, tags = self.prompt()
        pair = self.pair
        flush_prefix_cache(pair.p)
        aged0 = pair.p.engine.kv.aged_pages, pair.d.engine.kv.aged_pages
        pp, po, _ = run_request(pair.p, f"p{self.n}", ids, tags, 1, self.d_params)
        assert po.retained is not None
        pd, do, reply = run_request(pair.d, f"d{self.n}", ids, tags, self.gen, pair.p.params_for(po.retained))
        assert do.retained is not None
        self.d_params = pair.d.params_for(do.retained)
        kv = pair.d.engine.kv_cache
        pids = do.retained.page_ids
        stored = sum(kv.page_bytes[page_id_bits(p)] for p in pids) * kv.storage.shape.num_layers
        n2 = sum(1 for p in pids if page_id_bits(p) == 2)
        table = kv.bits_table
        assert table is not None
        full = len(ids) // P
        fresh = page_bits(tags[: full * P], table, P)
        row = TurnRow(
            self.n + 1,
            len(ids),
            len(pids) * P,
            stored / (len(pids) * P),
            n2 / len(pids),
            fresh.count(2) / max(1, len(fresh)),
            pp.num_bytes,
            pd.num_bytes,
            pair.p.engine.kv.aged_pages - aged0[0],
            pair.d.engine.kv.aged_pages - aged0[1],
        )
        self.add(0, "assistant", reply)  # the reply comes back as the assistant's text
        self.n += 1
        return row


def fidelity(model_dir: Path, *, tokens: int = 512, seed: int = 5) -> list[dict[str, float]]:
    """Per layer: attention-output MSE (mean over heads) of the tiny model's real q/k/v with all
    full pages but the last stored INT2 directly from fp32 vs INT4 -> INT2 (age-down)."""
    from kvserving.calibrate.codecs import head_mse
    from kvserving.calibrate.measure import capture_qkv
    from kvserving.worker.attention import causal_attention
    from kvserving.worker.model import load_model

    _, model = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"))
    ids = torch.randint(10, 4000, (tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
    cap = capture_qkv(model, ids, device=torch.device("cpu"))

    def qdq(x: torch.Tensor, bits: int) -> torch.Tensor:
        return dequantize_groups(*quantize_groups(x, bits), bits, dtype=torch.float32)

    def int2(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kq = dequantize_int2_keys(*quantize_int2_keys(k.transpose(0, 1)), dtype=torch.float32).transpose(0, 1)
        return kq, qdq(v, 2)

    rows = []
    n = tokens - P
    for layer in sorted(cap.q):
        q, k, v = cap.q[layer], cap.k[layer], cap.v[layer]
        stores: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name in ("int4", "int2", "aged"):
            kq, vq = k.clone(), v.clone()
            for s in range(0, n, P):
                kp, vp = k[s : s + P], v[s : s + P]
                if name == "int4":
                    kq[s : s + P], vq[s : s + P] = qdq(kp, 4), qdq(vp, 4)
                    continue
                if name == "aged":
                    kp, vp = qdq(kp, 4), qdq(vp, 4)
                kq[s : s + P], vq[s : s + P] = int2(kp, vp)
            stores[name] = kq, vq
        scale = q.shape[-1] ** -0.5
        ref = causal_attention(q, k, v, q_offset=0, sm_scale=scale)
        row: dict[str, float] = {"layer": layer}
        for name, (kq, vq) in stores.items():
            row[name] = float(head_mse(causal_attention(q, kq, vq, q_offset=0, sm_scale=scale), ref).mean())
            row[name + "_max_abs_k"] = float((kq - k).abs().max())
            row[name + "_max_abs_v"] = float((vq - v).abs().max())
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--model", type=Path, help="model directory (default: build the tiny model)")
    ap.add_argument("--obs", type=int, default=448, help="tool-result tokens per turn")
    ap.add_argument("--gen", type=int, default=32, help="tokens the decode worker generates per turn")
    ap.add_argument("--turns", type=int, default=0, help="default: as many as the context holds")
    ap.add_argument("--json", type=Path, help="also write the raw numbers here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results: dict[str, list[TurnRow]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_tiny_model(Path(tmp) / "tiny")
        cfg = json.loads((Path(model) / "config.json").read_text())
        turns = args.turns or (cfg["max_position_embeddings"] - 164 - args.gen) // (args.obs + 8 + args.gen)
        for mode in ("off", "on"):
            pair = LocalPair(*(make_engine(model, mode == "on") for _ in range(2)), name=f"age-{mode}")
            conv = Conversation(pair, obs=args.obs, gen=args.gen, seed=7)
            results[mode] = [conv.turn() for _ in range(turns)]
            pair.close()
        fid = fidelity(Path(model))
        shape = (cfg["num_key_value_heads"], cfg["head_dim"], cfg["num_hidden_layers"])
    nvfp4 = PageLayout.build("nvfp4", page_size=16, kv_heads=shape[0], head_dim=shape[1]).page_bytes * shape[2] / 16
    print_tables(results, fid, args, nvfp4)
    print_projection(results)
    if args.json:
        args.json.write_text(json.dumps({m: [asdict(r) for r in rs] for m, rs in results.items()} | {"fidelity": fid}, indent=2))
    return 0


def per_token(fmt: str, *, layers: int = 36, heads: int = 8, head_dim: int = 128) -> float:
    """Bytes per token of one page format at the Qwen3-8B shape (all layers, K and V)."""
    page = 16 if fmt == "nvfp4" else P
    return PageLayout.build(fmt, page_size=page, kv_heads=heads, head_dim=head_dim).page_bytes * layers / page


def print_projection(results: dict[str, list[TurnRow]]) -> None:
    """The measured INT2 page shares at the Qwen3-8B KV shape (36 layers, 8 KV heads, 128 dims)."""
    b4, b2, nv = per_token("int4"), per_token("int2"), per_token("nvfp4")
    print()
    print(
        f"# at the Qwen3-8B KV shape: INT4 {b4:.0f}, INT2 {b2:.0f}, nvfp4 {nv:.0f} B/token; "
        "retained conversation at the measured INT2 page shares"
    )
    head = ["turn", "B/token off", "B/token on", "on/nvfp4", "bits/value on (incl. metadata)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for off, on in zip(results["off"], results["on"]):
        b_off = off.int2_share * b2 + (1 - off.int2_share) * b4
        b_on = on.int2_share * b2 + (1 - on.int2_share) * b4
        bits = b_on * 8 / (36 * 2 * 8 * 128)
        print(f"| {on.turn} | {b_off:.0f} | {b_on:.0f} | {b_on / nv:.3f} | {bits:.2f} |")


def print_tables(results: dict[str, list[TurnRow]], fid: list[dict[str, float]], args: Any, nvfp4: float) -> None:
    print(
        f"# age_down_cpu: triaxial (budget 2.7 default table), +{args.obs} tool-result tokens and {args.gen} "
        f"generated per turn; decode worker's retained conversation; nvfp4 = {nvfp4:.0f} B/token"
    )
    head = [
        "turn",
        "prompt",
        "B/token off",
        "B/token on",
        "on/off",
        "on/nvfp4",
        "INT2 share off",
        "INT2 share on",
        "fresh INT2 share",
        "KiB D->P off",
        "KiB D->P on",
        "KiB P->D off",
        "KiB P->D on",
        "moved B/token off",
        "moved B/token on",
        "aged P",
        "aged D",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for off, on in zip(results["off"], results["on"]):
        row = [
            on.turn,
            on.prompt,
            f"{off.bytes_per_token:.0f}",
            f"{on.bytes_per_token:.0f}",
            f"{on.bytes_per_token / off.bytes_per_token:.3f}",
            f"{on.bytes_per_token / nvfp4:.3f}",
            f"{off.int2_share:.3f}",
            f"{on.int2_share:.3f}",
            f"{on.fresh_int2_share:.3f}",
            f"{off.bytes_d_to_p / 1024:.0f}",
            f"{on.bytes_d_to_p / 1024:.0f}",
            f"{off.bytes_p_to_d / 1024:.0f}",
            f"{on.bytes_p_to_d / 1024:.0f}",
            f"{(off.bytes_d_to_p + off.bytes_p_to_d) / off.prompt:.0f}",
            f"{(on.bytes_d_to_p + on.bytes_p_to_d) / on.prompt:.0f}",
            on.aged_p,
            on.aged_d,
        ]
        print("| " + " | ".join(str(c) for c in row) + " |")
    print()
    print(
        "# fidelity: attention-output MSE (mean over heads) on the tiny model's real q/k/v, all full pages but "
        "the last stored at the named precision; aged = INT4 -> INT2"
    )
    head = ["layer", "INT4", "INT2 direct", "INT2 aged", "aged/direct", "max|dk| direct", "max|dk| aged", "max|dv| direct", "max|dv| aged"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in fid:
        row = [
            int(r["layer"]),
            f"{r['int4']:.3e}",
            f"{r['int2']:.3e}",
            f"{r['aged']:.3e}",
            f"{r['aged'] / r['int2']:.3f}",
            f"{r['int2_max_abs_k']:.3f}",
            f"{r['aged_max_abs_k']:.3f}",
            f"{r['int2_max_abs_v']:.3f}",
            f"{r['aged_max_abs_v']:.3f}",
        ]
        print("| " + " | ".join(str(c) for c in row) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
