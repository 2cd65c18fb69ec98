"""Bidirectional KV reuse on CPU: a growing agent conversation through a prefill
worker and a decode worker (two engines, two NIXL agents, real UCX READs over
CPU memory), TTFT per turn with reuse off and on (recompute threshold 0 / 64 /
auto), tokens the prefill computed and bytes moved per turn; one table of ratios.

    PYTHONSAFEPATH=1 .venv/bin/python bench/reuse_cpu.py [--model DIR] [--dtype bf16] [--new 512] [--json OUT]

Each turn appends the decode worker's reply and ``--new`` fresh user tokens to
the history, as agents do. Per turn and mode:

- off: the prefill worker recomputes the whole history; the decode worker
  pulls the prompt pages from it (P->D) and generates;

Before every turn the prefill worker's prefix cache is emptied: the history
lives only on the decode worker, as when other conversations pushed it out of
the prefill worker's cache or another prefill worker takes the turn.
- on: the prefill worker first pulls the decode worker's retained conversation
  (D->P), computes only the new tokens, then P->D as above;
- new-only: one engine with the history already in its own prefix cache
  prefills only the new tokens: the floor reuse is measured against.

TTFT = from the request reaching the prefill worker to the decode worker's
first token (both pulls included; no HTTP: the agent-info and lease calls go
straight to the other worker's ``KVTransfer``). Goal (issue 11): TTFT(on) of
turn n within 1.2x of new-only, while TTFT(off) grows with the history.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserving.config import KVCacheConfig, ModelConfig, ReuseConfig, SchedulerConfig, ServingConfig
from kvserving.worker.engine import LLMEngine, RequestOutput
from kvserving.worker.kv.local_pair import LocalPair, flush_prefix_cache
from kvserving.worker.kv.transfer import KVTransfer, PullResult
from kvserving.worker.kv.protocol import KVTransferParams
from kvserving.worker.sampling import SamplingParams
from kvserving.tiny_model import build_tiny_model

MODES = ("off", "on-0", "on-64", "on-auto")


def make_engine(model: Path, dtype: str, threshold: int | str) -> LLMEngine:
    return LLMEngine(
        ServingConfig(
            model=ModelConfig(path=str(model)),
            kv_cache=KVCacheConfig(dtype=dtype, memory_bytes=96 << 20),
            reuse=ReuseConfig(recompute_threshold_tokens=threshold),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, chunk_size=512),
        )
    )


def run_request(
    kvt: KVTransfer,
    rid: str,
    ids: list[int],
    max_tokens: int,
    params: KVTransferParams | None,
    *,
    key: str = "warm",
    first_token_at: list[tuple[float, float]] | None = None,
) -> tuple[PullResult, RequestOutput, list[int]]:
    pull = kvt.pull(ids, None, params)
    eng = kvt.engine
    eng.add_request(
        rid,
        ids,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        retain=kvt.retain_spec(conversation_key=key, input_ids=ids),
        admission_pin=pull.admission_pin,
    )
    tokens: list[int] = []
    while True:
        for out in eng.step():
            if out.request_id != rid:
                continue
            if not tokens and first_token_at is not None:
                first_token_at.append((time.perf_counter(), time.thread_time()))
            tokens.extend(out.new_token_ids)
            if out.finished:
                return pull, out, tokens


def warm_up(pair: LocalPair) -> None:
    """One short turn each way: NIXL connections and first-call costs stay out of the table."""
    ids = list(range(10, 10 + 100))
    _, po, reply = run_request(pair.p, "warm-p", ids, 1, None)
    assert po.retained is not None
    _, do, reply = run_request(pair.d, "warm-d", ids, 4, pair.p.params_for(po.retained))
    assert do.retained is not None
    flush_prefix_cache(pair.p)
    run_request(pair.p, "warm-p2", ids + reply + [11] * 20, 1, pair.d.params_for(do.retained))
    for kvt in (pair.p, pair.d):
        for lease in kvt.leases():
            kvt.release(lease["lease_id"])


@dataclass
class TurnResult:
    ttft_s: float  # wall clock
    ttft_cpu_s: float  # CPU time of the thread that drives both workers (see --clock)
    p_computed: int
    d_computed: int
    bytes_d_to_p: int
    regions_d_to_p: int
    fallback: str | None


class Conversation:
    """One conversation of one mode; ``pair`` None = the new-only baseline on ``local``."""

    def __init__(self, key: str, pair: LocalPair | None, local: LLMEngine | None, *, reuse: bool, gen: int) -> None:
        self.key, self.pair, self.local, self.reuse, self.gen = key, pair, local, reuse, gen
        self.d_params: KVTransferParams | None = None
        self.results: list[TurnResult] = []
        self.history: list[int] = []
        self.n = 0

    def turn(self, new_ids: list[int]) -> None:
        prompt = self.history + new_ids
        self.n += 1
        res, reply = self._local(prompt) if self.local is not None else self._pair(prompt, self.d_params)
        self.results.append(res)
        self.history = prompt + reply

    def _local(self, prompt: list[int]) -> tuple[TurnResult, list[int]]:
        eng = self.local
        assert eng is not None
        before = eng.stats.prompt_tokens_computed
        t0, c0 = time.perf_counter(), time.thread_time()
        eng.add_request(f"{self.key}-{self.n}", prompt, SamplingParams(max_tokens=self.gen, ignore_eos=True))
        first: tuple[float, float] | None = None
        reply: list[int] = []
        while eng.has_unfinished():
            for o in eng.step():
                if first is None:
                    first = time.perf_counter(), time.thread_time()
                reply.extend(o.new_token_ids)
        assert first is not None
        return TurnResult(first[0] - t0, first[1] - c0, eng.stats.prompt_tokens_computed - before, 0, 0, 0, None), reply

    def _pair(self, prompt: list[int], params: KVTransferParams | None) -> tuple[TurnResult, list[int]]:
        pair = self.pair
        assert pair is not None
        flush_prefix_cache(pair.p)
        t0, c0 = time.perf_counter(), time.thread_time()
        pp, po, _ = run_request(pair.p, f"{self.key}-p{self.n}", prompt, 1, params if self.reuse else None, key=self.key)
        assert po.retained is not None
        first_at: list[tuple[float, float]] = []
        _, do, reply = run_request(
            pair.d, f"{self.key}-d{self.n}", prompt, self.gen, pair.p.params_for(po.retained), key=self.key, first_token_at=first_at
        )
        assert do.retained is not None
        self.d_params = pair.d.params_for(do.retained)
        res = TurnResult(
            first_at[0][0] - t0,
            first_at[0][1] - c0,
            len(prompt) - po.num_cached_tokens,
            len(prompt) - do.num_cached_tokens,
            pp.num_bytes,
            pp.num_regions,
            pp.fallback,
        )
        return res, reply


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--model", type=Path, help="model directory (default: build the tiny model)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp8_e4m3", "nvfp4", "triaxial"))
    ap.add_argument("--new", type=int, default=512, help="fresh user tokens per turn")
    ap.add_argument("--gen", type=int, default=16, help="tokens the decode worker generates per turn")
    ap.add_argument("--turns", type=int, default=0, help="default: as many as the context holds")
    ap.add_argument("--reps", type=int, default=3, help="conversations per mode; each turn's fastest TTFT is kept")
    ap.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall", help="cpu: TTFT as the driving thread's CPU time (on a shared, loaded machine)"
    )
    ap.add_argument("--json", type=Path, help="also write the raw numbers here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_tiny_model(Path(tmp) / "tiny")
        ctx = json.loads((Path(model) / "config.json").read_text())["max_position_embeddings"]
        turns = args.turns or (ctx - args.gen) // (args.new + args.gen)
        pairs: dict[str, LocalPair] = {}
        convs: dict[str, list[Conversation]] = {}
        local = make_engine(model, args.dtype, 0)
        for mode in MODES:
            threshold: int | str = "auto" if mode == "on-auto" else int(mode.split("-")[1]) if mode != "off" else 64
            pairs[mode] = LocalPair(*(make_engine(model, args.dtype, threshold) for _ in range(2)), name=mode)
            warm_up(pairs[mode])
            convs[mode] = [Conversation(f"{mode}-{r}", pairs[mode], None, reuse=mode != "off", gen=args.gen) for r in range(args.reps)]
        convs["new-only"] = [Conversation(f"new-{r}", None, local, reuse=True, gen=args.gen) for r in range(args.reps)]
        # turn-major and interleaved: every mode runs turn t before any runs turn t+1, so machine
        # noise hits all alike; ``reps`` independent conversations per mode, the fastest TTFT kept
        g = torch.Generator().manual_seed(7)
        new_ids = [[torch.randint(10, 4000, (args.new,), generator=g).tolist() for _ in range(turns)] for _ in range(args.reps)]
        for t in range(turns):
            for r in range(args.reps):
                for mode in convs:
                    convs[mode][r].turn(new_ids[r][t])
        clock = "ttft_s" if args.clock == "wall" else "ttft_cpu_s"
        results = {m: [min((c.results[t] for c in cs), key=lambda x: getattr(x, clock)) for t in range(turns)] for m, cs in convs.items()}
        auto = pairs["on-auto"].p.puller
        measured = {
            "prefill_tokens_per_s": auto.prefill_tokens_per_s,
            "transfer_bytes_per_s": auto.transfer_bytes_per_s,
            "pull_overhead_s": auto.pull_overhead_s,
        }
        for p in pairs.values():
            p.close()
    print_table(results, args, measured)
    if args.json:
        args.json.write_text(json.dumps({k: [vars(r) for r in v] for k, v in results.items()} | {"measured": measured}, indent=2))
    return 0


def print_table(results: dict[str, list[TurnResult]], args: Any, measured: dict[str, Any]) -> None:
    print(
        f"# reuse_cpu: dtype {args.dtype}, +{args.new} user tokens and {args.gen} generated per turn; "
        f"TTFT in ms ({args.clock} clock, fastest of {args.reps} conversations)"
    )
    head = [
        "turn",
        "prompt",
        "off",
        "on-0",
        "on-64",
        "auto",
        "new-only",
        "off/new",
        "on-0/new",
        "auto/new",
        "P computed off",
        "P computed on-0",
        "MiB D->P on-0",
        "regions",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    prompt = 0
    for t in range(len(results["off"])):
        prompt += args.new + (args.gen if t else 0)
        ms = {m: getattr(results[m][t], "ttft_s" if args.clock == "wall" else "ttft_cpu_s") * 1e3 for m in results}
        on0 = results["on-0"][t]
        row = [
            t + 1,
            prompt,
            *(f"{ms[m]:.1f}" for m in ("off", "on-0", "on-64", "on-auto", "new-only")),
            *(f"{ms[m] / ms['new-only']:.2f}" for m in ("off", "on-0", "on-auto")),
            results["off"][t].p_computed,
            on0.p_computed,
            f"{on0.bytes_d_to_p / 2**20:.2f}",
            on0.regions_d_to_p,
        ]
        print("| " + " | ".join(str(c) for c in row) + " |")
    print(f"measured by the auto worker: {json.dumps({k: (round(v, 6) if v else v) for k, v in measured.items()})}")


if __name__ == "__main__":
    raise SystemExit(main())
