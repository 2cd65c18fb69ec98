"""GPU engine benchmark at real size: a Qwen3-8B-shaped model, each KV format, one table of ratios to bf16 + JSON.

Run on the device machine (docs/performance-log/engine-gpu.md)::

    python bench/engine_gpu.py --out $OUT/engine_gpu.json [--quick] [--formats bf16,nvfp4]
    python bench/engine_gpu.py --combine bench/results/engine_gpu_h200.json $OUT/engine_gpu.json \
        --out bench/results/engine_gpu_h200.json

The result file holds one section per configuration (``bench/results_file.py``): ``default`` (every
format as the product runs it: triaxial under the config's bit-budget control, ``hold``), ``iso`` (``--iso``),
``fixed`` (``--bit-budget-control fixed``: triaxial by the bits table alone), ``hold_2.7`` (``--bit-budget 2.7``),
``weights_fp8_block`` (``--weights fp8_block``), ``extend`` (``--extend``: an agent's next turn on a prefill
worker, ``EXTEND_SHAPES``), with ``_quick`` after a ``--quick`` run's name; a run
rewrites its own section of ``--out`` and keeps the others, ``--combine`` joins files of runs made
elsewhere.

Model: Qwen3-8B's shape (36 layers, hidden 4096, 32 query / 8 KV heads,
head_dim 128, intermediate 12288, vocab 151936, q/k-norm), random bf16
weights (``--weights fp8`` / ``fp8_block``: then quantized to FP8) drawn on the device from a seed (nothing is read or downloaded).
Everything runs through ``LLMEngine.step`` (scheduler, runner, kernels,
sampling on the device, CUDA graphs for decode unless ``--enforce-eager``).

Per format:

(a) capacity: in a pool of ``--kv-gib`` (40 GiB), 8K-token sequences are
    admitted until a page allocation fails; then ONE engine step runs all of
    them (their last prompt token + a sampled token). Triaxial prompts carry
    tags in runs at the default class shares (``kvserving.bits``), oldest turn
    first, so INT2 pages are what the bits table makes of realistic tags;
(b) decode: batch x context in {1, 16, 64, 256} x {4K, 32K}, in a pool of
    ``--speed-kv-gib`` (so more shapes fit bf16 too; a shape that does not fit
    a format's pool is skipped and said so). Sequences are placed directly in
    the running set with their KV pages filled by our write kernels (random
    K/V; prefilling 2M tokens per shape would take minutes) and the timed
    steps are real engine decode steps. The prompt is ``context - 96`` tokens so
    the timed steps (at most 50) stay inside the context. Time per output token = median
    step time; tokens/s = batch / TPOT;
(c) prefill: one 8K-token prompt in one step (chunk 8192), tokens/s;
(d) triaxial: the share of INT2 pages among the pages stored, vs the share
    the bit budget's table expects (``KVCache.int2_share``).
Roofline (DESIGN.md, Measuring on a GPU): per decode shape, the bytes the step
must read (the weights without the embedding table, plus the KV pages of every
sequence at their stored precision) divided by the chip's read bandwidth
measured in the same run by a streaming-read kernel (``decode_gpu.read_bandwidth``);
the table prints measured / roofline. Where the step's time goes: the kernels
of three steps of the same shape as the engine runs them (CUDA graphs; torch.profiler
traces the replayed kernels; a kernel that starts while the one before it runs,
as PDL launches them, is charged from that one's end) summed by class (GEMMs,
attention, KV writes, norms and rotary, activation, sampling, other), each class's
kernels by name beside it (``by_kernel``: where a class's time goes, e.g. the
decode against its merge launch at batch 1); the step's wall time minus their sum
is ``host_gap`` (launch gaps, host work the device waits for).
Step overhead at batch 64 / 4K: step time minus the sum of the step's kernel
times (torch.profiler), with CUDA graphs and asynchronous decode (the default:
the next step is launched before this one's sampled ids are back), graphs with
every step waiting for its ids (``graphs_sync``), and eager. Step time is the
wall time of one ``engine.step()`` call in steady state, whichever step's tokens
it returns; ``host_wait_ms`` is the part of it the host spent waiting for the
device (asynchronous decode: the rest is host work overlapped with the device).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import re
import statistics
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch

from kvserving.argtypes import decode_shapes
from kvserving.bits import MODAL_SHARE, SEMANTIC_SHARE, TEMPORAL_SHARE
from kvserving.config import KV_LAYOUTS, KVCacheConfig, ModelConfig, SchedulerConfig, ServingConfig
from kvserving.kernels.options import KernelOptions
from kvserving.kernels.page_ids import INT2_PAGE_FLAG
from kvserving.progress import add_quiet_argument, progress
from kvserving.tags import TEMPORAL, decode_tag, encode_tag
from kvserving.worker.engine import LLMEngine
from kvserving.worker.model import DecoderModel, ModelArgs
from kvserving.worker.model import random_model as worker_random_model
from kvserving.worker.model import weight_bytes_per_step
from kvserving.worker.sampling import SamplingParams, make_generator
from kvserving.worker.sequence import Sequence, SeqStatus

sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file beside this file, also under PYTHONSAFEPATH
from results_file import combine, write_section  # noqa: E402

FORMATS = ("bf16", "fp8_e4m3", "nvfp4", "triaxial")
BATCHES = (1, 16, 64, 256)
CONTEXTS = (4096, 32768)
CAPACITY_TOKENS = 8192
HEADROOM = 96  # decode prompts are context - HEADROOM tokens: the timed steps stay inside the context
GIB = 1 << 30


def qwen3_8b_shape(vocab: int, *, smoke: bool = False) -> ModelArgs:
    if smoke:  # --smoke: the script's logic on CPU with a toy shape (no numbers)
        return ModelArgs(model_type="qwen3", vocab_size=vocab, hidden_size=256, intermediate_size=512, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=128, qk_norm=True, max_position_embeddings=40960)  # fmt: skip
    return ModelArgs(
        model_type="qwen3", vocab_size=vocab, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0, qk_norm=True,
        max_position_embeddings=40960, eos_token_ids=(151645,),
    )  # fmt: skip


DEVICE = "cuda"


def random_model(args: ModelArgs, *, seed: int, weight_format: str = "bf16") -> DecoderModel:
    """The model with the dummy load format's bf16 weights (N(0, 0.02), norms 1) drawn on the GPU from ``seed``."""
    return worker_random_model(args, seed=seed, dtype=torch.bfloat16, device=DEVICE, weight_format=weight_format)


def conversation_tags(n: int) -> list[int]:
    """Tags of an n-token context: turns oldest first, each turn's classes in runs at the default shares."""
    tags: list[int] = []
    for t in ("older", "turn_m2", "turn_m1", "current"):
        for m, m_share in MODAL_SHARE.items():
            for s, s_share in SEMANTIC_SHARE.items():
                tags += [encode_tag(t, m, s)] * round(n * TEMPORAL_SHARE[t] * m_share * s_share)
    tags = tags[:n]
    tags += [encode_tag("current", "text", "user")] * (n - len(tags))
    # the newest tokens are the current instruction (4 bits in every table): the page decode writes into is INT4
    return tags[: max(0, n - 64)] + [encode_tag("current", "text", "inst")] * min(n, 64)


# (cached prefix, new tokens) of --extend: an agent's next turn over a history of 8K and 16K tokens (the agent
# bench's histories end at 12-25K), a tool result of 2K tokens
EXTEND_SHAPES = ((8192, 2048), (16384, 2048))


def older_tag(tag: int) -> int:
    """``tag`` one turn older (current -> turn_m1 -> turn_m2 -> older), as the next turn's rendering tags it."""
    temporal, modal, semantic = decode_tag(tag)
    return encode_tag(TEMPORAL[min(TEMPORAL.index(temporal) + 1, len(TEMPORAL) - 1)], modal, semantic)


class Bench:
    def __init__(
        self,
        model: tuple[ModelArgs, DecoderModel],
        *,
        quick: bool,
        enforce_eager: bool,
        breakdown: bool = True,
        bit_budget: float | None = None,
        bit_budget_control: str = KVCacheConfig().bit_budget_control,
        kv_layout: str = KVCacheConfig().layout,
    ) -> None:
        self.model = model
        self.kv_layout = kv_layout  # kv_cache.layout
        self.bit_budget = bit_budget  # triaxial: kv_cache.bit_budget (None: the config's default)
        self.bit_budget_control = bit_budget_control  # triaxial: kv_cache.bit_budget_control
        self.breakdown = breakdown and DEVICE == "cuda"
        self.quick = quick
        self.enforce_eager = enforce_eager
        self.vocab = model[0].vocab_size
        self.counter = 0
        self.kv_chunk: tuple[torch.Tensor, torch.Tensor] | None = None

    def engine(self, fmt: str, gib: float, *, max_len: int | None = None) -> LLMEngine:
        margs, model = self.model
        if max_len is not None and max_len > margs.max_position_embeddings:
            # RoPE is computed from inv_freq, so the same weights serve a longer context (the timing does not
            # depend on the RoPE scaling type a real 128K checkpoint would use)
            margs = dataclasses.replace(margs, max_position_embeddings=max_len)
        config = ServingConfig(
            model=ModelConfig(served_name="qwen3-8b-shape"),
            kv_cache=KVCacheConfig(
                dtype=fmt,
                memory_bytes=int(gib * GIB),
                layout=self.kv_layout,
                **({"bit_budget": self.bit_budget, "bit_budget_control": self.bit_budget_control} if fmt == "triaxial" else {}),
            ),
            scheduler=SchedulerConfig(max_num_seqs=4096, max_num_batched_tokens=8192, chunk_size=8192),
        )
        # graphs captured on first use: each shape's first step is a warm-up step here
        return LLMEngine(
            config, device=DEVICE, dtype=torch.bfloat16, model=(margs, model), enforce_eager=self.enforce_eager, warm_graphs=False
        )

    # -- sequences placed in the running set, their pages filled by the write kernels --------------------
    def place(self, engine: LLMEngine, n: int, prompt_len: int, *, computed: int) -> list[Sequence]:
        """Up to n running sequences of prompt_len tokens with pages for them and ``computed`` tokens marked
        computed (fewer when the pool runs out)."""
        g = torch.Generator().manual_seed(prompt_len)
        base = torch.randint(10, self.vocab, (prompt_len,), generator=g).tolist()
        tags = conversation_tags(prompt_len) if engine.storage.triaxial else [0] * prompt_len
        params = SamplingParams(max_tokens=4096, ignore_eos=True)
        seqs: list[Sequence] = []
        for _ in range(n):
            self.counter += 1
            rid = f"s{self.counter}"
            prompt = [10 + self.counter % (self.vocab - 10)] + base[1:]  # distinct prefix hashes per sequence
            seq = Sequence(rid, prompt, params, make_generator(0, device=DEVICE), tags=tags)
            if engine.kv.controller is not None:
                # admission's path: the bit-budget controller counts the prompt's pages and moves its cut
                # (the prefix is distinct: nothing matches)
                engine.kv.match_prefix(seq)
            if not engine.kv.allocate_until(seq, prompt_len):
                engine.kv.free(seq)
                break
            seq.num_computed = computed
            seq.status = SeqStatus.RUNNING
            seq.arrival = self.counter
            engine.scheduler.running.append(seq)
            engine.requests[rid] = seq
            seqs.append(seq)
        self.fill(engine, seqs)
        return seqs

    @torch.no_grad()
    def fill(self, engine: LLMEngine, seqs: list[Sequence]) -> None:
        """Random K/V into every page of ``seqs`` through the write kernels (layer 0, copied to all layers; a
        page-major storage is one buffer: every layer is written)."""
        st = engine.storage
        p = st.page_size
        pages4 = [pid for s in seqs for pid in s.page_ids if not pid & INT2_PAGE_FLAG]
        pages2 = [pid for s in seqs for pid in s.page_ids if pid & INT2_PAGE_FLAG]
        chunk = 1 << 16
        h, d = st.shape.num_kv_heads, st.shape.head_dim
        if self.kv_chunk is None:
            k = torch.randn(chunk, h, d, device=DEVICE, dtype=torch.bfloat16)
            self.kv_chunk = (k, torch.randn_like(k))
        k, v = self.kv_chunk
        ids4 = torch.tensor(pages4, dtype=torch.int32, device=DEVICE).repeat_interleave(p)
        slots4 = torch.arange(p, dtype=torch.int32, device=DEVICE).repeat(len(pages4))
        per = chunk // p
        ids2 = torch.tensor(pages2, dtype=torch.int32, device=DEVICE)
        for layer in range(st.shape.num_layers if st.page_major else 1):
            for t0 in range(0, ids4.numel(), chunk):
                n = min(chunk, ids4.numel() - t0)
                st.write(layer, k[:n], v[:n], ids4[t0 : t0 + n], slots4[t0 : t0 + n])
            for i0 in range(0, ids2.numel(), per):
                n = min(per, ids2.numel() - i0)
                st.write_int2_pages(layer, k[: n * p].view(n, p, h, d), v[: n * p].view(n, p, h, d), ids2[i0 : i0 + n])
        if not st.page_major:
            st.buffers[1:].copy_(st.buffers[0].expand(st.buffers.shape[0] - 1, -1))
        sync()

    @staticmethod
    def clear(engine: LLMEngine) -> None:
        for rid in list(engine.requests):
            engine.abort(rid)

    def timed_steps(self, engine: LLMEngine, *, warmup: int = 2, budget_s: float = 0.6) -> list[float]:
        for _ in range(warmup):  # graph capture, Triton specializations
            engine.step()
        times: list[float] = []
        start = time.perf_counter()
        limit = 3 if self.quick else 20
        while len(times) < limit and (len(times) < 3 or time.perf_counter() - start < budget_s):
            t0 = time.perf_counter()
            engine.step()  # asynchronous decode: launches a step, returns the one before it (steady state: one step)
            times.append(time.perf_counter() - t0)
        return times

    # -- measurements ------------------------------------------------------------------------------------
    def capacity(self, fmt: str, gib: float) -> dict[str, Any]:
        engine = self.engine(fmt, gib)
        t0 = time.perf_counter()
        seqs = self.place(engine, 100_000, CAPACITY_TOKENS, computed=CAPACITY_TOKENS - 1)
        pages = [pid for s in seqs for pid in s.page_ids]
        n2 = sum(1 for pid in pages if pid & INT2_PAGE_FLAG)
        outs = engine.step() + engine.flush()  # all of them: the last prompt token of each, one sampled token
        ran = sum(1 for o in outs if o.new_token_ids)
        row = {
            "kv_gib": gib, "seqs": len(seqs), "ran_step": ran, "tokens": len(seqs) * CAPACITY_TOKENS,
            "pool_capacity_tokens": engine.capacity_tokens, "bytes_per_token_int4": engine.storage.bytes_per_token,
            "int2_pages_stored": n2, "pages_stored": len(pages),
            "int2_share_stored": n2 / max(1, len(pages)), "int2_share_budget": engine.kv_cache.int2_share,
            # nominal bits per value over the pages stored (4 / 2; metadata excluded), the budget, the controller's cut
            "stored_bits": (4 * (len(pages) - n2) + 2 * n2) / max(1, len(pages)),
            "bit_budget": engine.kv_cache.bit_budget, "bit_budget_control": self.bit_budget_control if fmt == "triaxial" else None,
            "bits_cut": engine.kv.controller.cut if engine.kv.controller is not None else None,
            "seconds": time.perf_counter() - t0,
        }  # fmt: skip
        print(f"  capacity {fmt}: {len(seqs)} x 8K sequences in {gib:g} GiB (step ran {ran}); "
              f"INT2 pages {row['int2_share_stored']:.3f} of stored (budget table {row['int2_share_budget']:.3f})"
              + (f"; stored bits {row['stored_bits']:.3f} (budget {row['bit_budget']}, {row['bit_budget_control']}"
                 + (f", cut {row['bits_cut']:.2f})" if row["bits_cut"] is not None else ")") if fmt == "triaxial" else ""),
              flush=True)  # fmt: skip
        self.clear(engine)
        del engine
        release()
        return row

    def decode(self, engine: LLMEngine, batch: int, ctx: int) -> dict[str, Any]:
        seqs = self.place(engine, batch, ctx - HEADROOM, computed=ctx - HEADROOM - 1)
        if len(seqs) < batch:
            self.clear(engine)
            return {"batch": batch, "context": ctx, "skipped": f"{batch} x {ctx} tokens do not fit the pool"}
        times = self.timed_steps(engine)
        graphs = engine.runner.graphs
        tpot = statistics.median(times)
        row: dict[str, Any] = {"batch": batch, "context": ctx, "tpot_ms": 1e3 * tpot, "tok_s": batch / tpot,
                               "steps": len(times), "graph_replays": graphs.replays if graphs is not None else 0,
                               "kv_bytes_read": kv_bytes(engine, seqs)}  # fmt: skip
        if self.breakdown:
            row["breakdown_ms"] = self.kernel_classes(engine, tpot_ms=1e3 * tpot)
        self.clear(engine)
        return row

    def kernel_classes(self, engine: LLMEngine, *, tpot_ms: float, steps: int = 3) -> dict[str, Any] | None:
        """ms per step by kernel class over ``steps`` steps as the engine runs them (CUDA graphs, asynchronous
        decode: the profiler traces the replayed kernels one by one), ``host_gap``: the step's time the kernels do
        not fill, and the five most expensive kernels the classes do not name."""
        table = profile_kernel_names(engine, steps=steps)
        return None if table is None else class_breakdown(table, wall_ms=tpot_ms)

    def prefill(self, engine: LLMEngine, n: int = 8192) -> dict[str, Any]:
        g = torch.Generator().manual_seed(1)
        tags = conversation_tags(n) if engine.storage.triaxial else None
        times = []
        for i in range(2 if self.quick else 3):
            prompt = [11 + i] + torch.randint(10, self.vocab, (n - 1,), generator=g).tolist()  # no prefix hit
            engine.add_request(f"prefill-{i}", prompt, SamplingParams(max_tokens=1, ignore_eos=True), tags=tags)
            t0 = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            times.append(time.perf_counter() - t0)
        best = min(times[1:])  # the first run compiles
        row: dict[str, Any] = {"tokens": n, "seconds": best, "tok_s": n / best}
        if engine.storage.kv_dtype == "bf16" and DEVICE == "cuda":  # where the prefill time goes (once)
            from torch.profiler import ProfilerActivity, profile

            prompt = [99] + torch.randint(10, self.vocab, (n - 1,), generator=g).tolist()
            engine.add_request("prefill-profiled", prompt, SamplingParams(max_tokens=1, ignore_eos=True), tags=tags)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                while engine.has_unfinished():
                    engine.step()
                sync()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60)
            print(table, flush=True)
            row["profile_top"] = table
        return row

    def extend(self, engine: LLMEngine, prefix: int, new: int) -> dict[str, Any]:
        """An agent's next turn on a prefill worker: a conversation of ``prefix`` tokens computed and cached, then
        the same tokens and ``new`` more (the earlier ones a turn older in the tags, as the gateway tags the next
        turn), computed over the cached prefix. The second request's wall time (best of the runs after the first,
        which compiles), the prompt tokens it computed, and on a GPU its kernels by class (``host_gap``: the wall
        time they do not fill)."""
        g = torch.Generator().manual_seed(prefix + new)
        tri = engine.storage.triaxial
        turn = [encode_tag("current", "text", "obs")] * max(0, new - 64) + [encode_tag("current", "text", "inst")] * min(new, 64)
        tags1 = conversation_tags(prefix) if tri else None
        tags2 = [older_tag(t) for t in tags1] + turn if tags1 is not None else None
        params = SamplingParams(max_tokens=1, ignore_eos=True)

        spans: list[tuple[str, float]] | None = None

        def next_turn(name: str, *, profiled: bool = False) -> tuple[float, int]:
            nonlocal spans
            first = [21 + len(name)] + torch.randint(10, self.vocab, (prefix - 1,), generator=g).tolist()
            engine.add_request(f"{name}-1", first, params, tags=tags1)
            while engine.has_unfinished():
                engine.step()
            second = first + torch.randint(10, self.vocab, (new,), generator=g).tolist()
            computed0 = engine.stats.prompt_tokens_computed
            sync()
            t0 = time.perf_counter()
            engine.add_request(f"{name}-2", second, params, tags=tags2)

            def finish() -> None:
                while engine.has_unfinished():
                    engine.step()

            if profiled:
                spans = gpu_spans(finish)
            else:
                finish()
            sync()
            return time.perf_counter() - t0, engine.stats.prompt_tokens_computed - computed0

        runs = [next_turn("x" * (i + 1)) for i in range(2 if self.quick else 3)]
        seconds, computed = min(runs[1:])
        row: dict[str, Any] = {
            "prefix": prefix,
            "new": new,
            "seconds": seconds,
            "computed": computed,
            "ms_per_1k_new": 1e3 * seconds / (new / 1024),
        }
        if self.breakdown:
            profiled_s, _ = next_turn("profiled", profiled=True)
            if spans is not None:  # the profiled run's (the profiler slows its host side)
                row["breakdown_ms"] = class_breakdown(ms_by_name(spans), wall_ms=1e3 * profiled_s)
        return row

    def overhead(self, engine: LLMEngine, batch: int = 64, ctx: int = 4096) -> dict[str, Any]:
        """Step time minus the kernels' time, with graphs (if the engine has them) and eager."""
        seqs = self.place(engine, batch, ctx - HEADROOM, computed=ctx - HEADROOM - 1)
        assert len(seqs) == batch
        graphs = engine.runner.graphs
        out: dict[str, Any] = {"batch": batch, "context": ctx}
        for mode in ("graphs", "graphs_sync", "eager"):
            if mode != "eager" and graphs is None:
                continue
            engine.flush()
            engine.runner.graphs = graphs if mode != "eager" else None  # the same engine, graphs taken away
            engine.async_decode = mode == "graphs"
            if mode != "eager" and graphs is not None:
                graphs.replay_events = []
            wait0, overlapped0 = engine.stats.wait_seconds, engine.stats.overlapped_steps
            times = self.timed_steps(engine, warmup=2)
            waited = (engine.stats.wait_seconds - wait0) / (len(times) + 2)
            overlapped = engine.stats.overlapped_steps - overlapped0
            step = statistics.median(times)
            kernels, count = profile_kernels(engine, steps=3)
            out[mode] = {"step_ms": 1e3 * step, "kernel_ms": kernels, "kernels_per_step": count,
                         "overhead_ms": 1e3 * step - kernels if kernels else None,
                         "overhead_share": (1 - kernels / (1e3 * step)) if kernels else None,
                         "host_wait_ms": 1e3 * waited, "overlapped_steps": overlapped}  # fmt: skip
            if mode != "eager" and graphs is not None and graphs.replay_events:
                # GPU time of the replay alone; synchronous: step - replay = host time the GPU waits;
                # replay - kernels = gaps in the graph
                replay = statistics.median(a.elapsed_time(b) for a, b in graphs.replay_events[2:] or graphs.replay_events)
                out[mode]["replay_ms"] = replay
                graphs.replay_events = None
        engine.flush()
        engine.async_decode = True
        engine.runner.graphs = graphs
        for mode in ("graphs", "graphs_sync"):
            if mode in out and "eager" in out and out[mode]["kernels_per_step"] < 0.5 * out["eager"]["kernels_per_step"]:
                # the profiler did not see the replayed kernels one by one: the graph runs the eager step's kernels
                g = out[mode]
                g["kernel_ms"] = out["eager"]["kernel_ms"]
                g["kernel_ms_from"] = "eager profile (graph kernels not traced one by one)"
                g["overhead_ms"] = g["step_ms"] - g["kernel_ms"]
                g["overhead_share"] = g["overhead_ms"] / g["step_ms"]
        self.clear(engine)
        return out


def iso(
    bench: Bench, formats: list[str], gib: float, contexts: list[int], *, read: int, bw_tb_s: float, base: str = "fp8_e4m3"
) -> dict[str, Any]:
    """Iso-capacity and iso-concurrency at long contexts (the seed's serving comparison): in the same KV memory,
    how many ``context``-token sequences each format decodes at once, the decode throughput at that
    concurrency (peak) and at ``base``'s concurrency."""
    out: dict[str, Any] = {"kv_gib": gib, "base": base, "contexts": {}}
    for ctx in contexts:
        rows: dict[str, Any] = {}
        for fmt in [base] + [f for f in formats if f != base]:
            engine = bench.engine(fmt, gib, max_len=ctx + 1024)
            n = len(bench.place(engine, 100_000, ctx - HEADROOM, computed=ctx - HEADROOM - 1))
            bench.clear(engine)
            row: dict[str, Any] = {"max_concurrency": n}
            if n:
                row["peak"] = bench.decode(engine, n, ctx)
                at = rows[base]["max_concurrency"] if fmt != base else n
                if fmt != base and 0 < at <= n:
                    row["at_base_concurrency"] = bench.decode(engine, at, ctx)
                for r in (row.get("peak"), row.get("at_base_concurrency")):
                    if r and "tpot_ms" in r:
                        r["roofline_ms"] = (read + r["kv_bytes_read"]) / (bw_tb_s * 1e12) * 1e3
                        r["of_roofline"] = r["roofline_ms"] / r["tpot_ms"]
            rows[fmt] = row
            peak = row.get("peak", {})
            print(f"  iso {ctx // 1024}K {fmt}: {n} sequences in {gib:g} GiB; peak {peak.get('tok_s', 0):.0f} tok/s "
                  f"(TPOT {peak.get('tpot_ms', 0):.2f} ms)"
                  + (f"; at {base}'s {rows[base]['max_concurrency']}: {row['at_base_concurrency']['tok_s']:.0f} tok/s"
                     if "at_base_concurrency" in row else ""), flush=True)  # fmt: skip
            del engine
            release()
        out["contexts"][str(ctx)] = rows
    return out


def iso_report(result: dict[str, Any]) -> None:
    base = result["base"]
    print(f"\niso-capacity, {result['kv_gib']:g} GiB of KV: concurrency and decode tokens/s, ratios to {base}")
    print(f"{'context':>8} {'format':<9} {'sequences':>14} {'peak tok/s':>18} {f'tok/s at {base} N':>22}")
    for ctx, rows in result["contexts"].items():
        b = rows.get(base, {})
        for fmt, r in rows.items():
            n, bn = r["max_concurrency"], b.get("max_concurrency")
            peak = r.get("peak", {}).get("tok_s")
            bpeak = b.get("peak", {}).get("tok_s")
            at = r.get("at_base_concurrency", r.get("peak") if fmt == base else None) or {}
            cells = [
                f"{n:>5} ({n / bn:4.2f}x)" if bn else f"{n:>14}",
                f"{peak:>9.0f} ({peak / bpeak:4.2f}x)" if peak and bpeak else f"{'-':>18}",
                f"{at['tok_s']:>13.0f} ({at['tok_s'] / bpeak:4.2f}x)" if at.get("tok_s") and bpeak else f"{'-':>22}",
            ]
            print(f"{int(ctx) // 1024:>7}K {fmt:<9} " + " ".join(cells))
    print(
        "seed (SGLang NVFP4 KV, FP8 weights, its card): 32K nvfp4 70 / fp8 44 sequences (1.59x), peak +37.4 %, +26-30 % at iso-concurrency"
    )


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def release() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


# Kernel classes of a decode step, by kernel name (first match wins; ours are Triton kernels named in kernels/,
# cuBLAS GEMMs are nvjet / sm90 xmma / cutlass kernels, the sampler is torch's reductions and sorts; act_quant is
# the FP8 weights' activation quantizer, a launch before each block GEMM).
KERNEL_CLASSES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("gemm", re.compile(r"gemm|gemv|_sum_splits|nvjet|cutlass|xmma|cublas|matmul|splitk|wgmma", re.I)),
    ("act_quant", re.compile(r"_quantize_kernel", re.I)),
    ("kv_write", re.compile(r"write_kv|write_int2|_write_", re.I)),
    ("attention", re.compile(r"decode|extend|attn|attention|_merge|flash", re.I)),
    ("norm_rotary", re.compile(r"rms|norm|rope|rotary", re.I)),
    ("activation", re.compile(r"silu|gelu|act_and_mul", re.I)),
    (
        "sampling",
        re.compile(
            r"sampl|argmax|argmin|topk|top_k|sort|softmax|exponential|multinomial|cumsum|gumbel|"
            r"reduce_kernel|radix",
            re.I,
        ),
    ),  # fmt: skip
)


def kernel_class(name: str) -> str:
    for cls, pattern in KERNEL_CLASSES:
        if pattern.search(name):
            return cls
    return "other"


def kv_bytes(engine: LLMEngine, seqs: list[Sequence]) -> int:
    """Bytes of KV a decode step of ``seqs`` reads: every page of every sequence, all layers, at its precision."""
    sizes = engine.kv_cache.page_bytes
    pages = [pid for s in seqs for pid in s.page_ids]
    n2 = sum(1 for pid in pages if pid & INT2_PAGE_FLAG)
    per_layer = (len(pages) - n2) * sizes[4] + n2 * sizes.get(2, 0)
    return per_layer * engine.storage.shape.num_layers  # not the rows of `buffers`: one row in page_major


def cuda_kernels(engine: LLMEngine, *, steps: int) -> list[tuple[str, float]] | None:
    """(name, microseconds charged: ``charged_us``) of every GPU kernel and copy of ``steps`` engine steps, as the
    engine runs them; None (and a line) when the profiler fails."""
    engine.flush()  # no step launched before the profile runs inside it
    sync()

    def steps_run() -> None:
        for _ in range(steps):
            engine.step()  # ``steps`` steps launched (asynchronous decode: the last one finishes in flush)
        engine.flush()

    return gpu_spans(steps_run)


def gpu_spans(run: Callable[[], object]) -> list[tuple[str, float]] | None:
    """(name, microseconds charged: ``charged_us``) of every GPU kernel and copy ``run`` launches; None (and a
    line) when the profiler fails."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            sync()
    except Exception as exc:  # noqa: BLE001 - the profiler is a measurement aid; report and go on
        print(f"  profiler failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return None
    return charged_us([(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA])


def charged_us(spans: list[tuple[str, float, float]]) -> list[tuple[str, float]]:
    """(name, microseconds charged) of GPU activities given as (name, start, end): each is charged the time from the
    later of its start and the end of everything that started before it, to its end (nothing when that is earlier).
    With programmatic dependent launch a kernel starts while the one before it runs and waits for it; charged whole,
    that wait would be counted twice and the classes' sum would exceed the step. The charges add up to the time the
    GPU was busy; without overlap each is the activity's own duration."""
    out: list[tuple[str, float]] = []
    busy_until = float("-inf")
    for name, start, end in sorted(spans, key=lambda s: (s[1], s[2])):
        out.append((name, max(0.0, end - max(start, busy_until))))
        busy_until = max(busy_until, end)
    return out


def profile_kernel_names(engine: LLMEngine, *, steps: int) -> dict[str, float] | None:
    """ms per step of each GPU kernel name over ``steps`` engine steps."""
    events = cuda_kernels(engine, steps=steps)
    return None if events is None else ms_by_name(events, steps=steps)


def ms_by_name(events: list[tuple[str, float]], *, steps: int = 1) -> dict[str, float]:
    """ms per step of each kernel name in (name, microseconds) ``events`` of ``steps`` steps."""
    out: dict[str, float] = {}
    for name, us in events:
        out[name] = out.get(name, 0.0) + us / 1e3 / steps
    return out


def class_breakdown(table: dict[str, float], *, wall_ms: float) -> dict[str, Any]:
    """ms by kernel class of a (kernel name -> ms) ``table``, their sum (``kernels``), ``host_gap``: the wall time
    they do not fill, the five most expensive kernels the classes do not name (``top_other``), and each named
    class's kernels by name, most expensive first, four at most (``by_kernel``: class -> [[name, ms], ...])."""
    out: dict[str, Any] = dict.fromkeys([name for name, _ in KERNEL_CLASSES] + ["other"], 0.0)
    ranked: dict[str, list[tuple[str, float]]] = {}  # class -> (name, ms), most expensive first
    for name, ms in sorted(table.items(), key=lambda e: (-e[1], e[0])):
        cls = kernel_class(name)
        out[cls] += ms
        ranked.setdefault(cls, []).append((name, ms))
    out["kernels"] = sum(out.values())
    out["host_gap"] = wall_ms - out["kernels"]
    out["top_other"] = [[name[:120], round(ms, 4)] for name, ms in ranked.get("other", [])[:5]]
    out["by_kernel"] = {cls: [[name[:80], round(ms, 4)] for name, ms in ranked[cls][:4]] for cls, _ in KERNEL_CLASSES if cls in ranked}
    return out


def profile_kernels(engine: LLMEngine, *, steps: int) -> tuple[float | None, float]:
    """(ms of GPU kernels and copies per step, their number per step) over ``steps`` engine steps."""
    events = cuda_kernels(engine, steps=steps)
    if events is None:
        return None, 0.0
    return sum(us for _, us in events) / 1e3 / steps, len(events) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_quiet_argument(ap)
    ap.add_argument("--out", default="engine_gpu.json", help="the result file; this run writes its section of it")
    ap.add_argument("--section", default=None, help="the run's section (default: default, iso, extend or hold_<budget>, from the options)")
    ap.add_argument(
        "--combine", nargs="+", default=None, metavar="FILE", help="join the sections of these result files into --out, and exit"
    )
    ap.add_argument("--quick", action="store_true", help="batch 1 and 64 at 4K only, short loops")
    ap.add_argument(
        "--shapes",
        type=decode_shapes,
        default=None,
        help="decode shapes BATCHxCONTEXT, comma-separated (default: BATCHES x CONTEXTS; --quick: 1x4096,64x4096)",
    )
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--kv-gib", type=float, default=40.0, help="KV budget of the capacity measurement")
    ap.add_argument("--kv-layout", choices=KV_LAYOUTS, default=KVCacheConfig().layout, help="kv_cache.layout of every engine")
    ap.add_argument("--speed-kv-gib", type=float, default=90.0, help="KV budget of the decode and prefill runs")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument(
        "--weights",
        choices=("bf16", "fp8", "fp8_block"),
        default="bf16",
        help="the model's linear layers: bf16, or FP8 with per-channel / 128x128 block scales",
    )
    ap.add_argument("--no-breakdown", action="store_true", help="skip the per-shape kernel-class profile")
    ap.add_argument(
        "--iso", action="store_true", help="only the iso-capacity / iso-concurrency comparison at --iso-contexts in --iso-kv-gib"
    )
    ap.add_argument(
        "--extend",
        action="store_true",
        help="only an agent's next turn on a prefill worker: new tokens over a cached prefix (EXTEND_SHAPES)",
    )
    ap.add_argument("--iso-kv-gib", type=float, default=100.0, help="KV memory of the iso comparison")
    ap.add_argument("--iso-contexts", default="32768,131072")
    ap.add_argument("--smoke", action="store_true", help="CPU, toy shape, tiny pools: checks the script, measures nothing")
    ap.add_argument("--bit-budget", type=float, default=None, help="triaxial: kv_cache.bit_budget (default: the config's)")
    ap.add_argument(
        "--bit-budget-control",
        choices=("fixed", "hold"),
        default=KVCacheConfig().bit_budget_control,
        help="triaxial: kv_cache.bit_budget_control (default: the config's, hold: the controller holds the stored bits at "
        "the budget; fixed: the bits table alone)",
    )
    args = ap.parse_args()
    if args.combine:
        doc = combine([Path(f) for f in args.combine], Path(args.out), what=WHAT, name_of=section_name)
        print(f"wrote {args.out}: sections {', '.join(doc['sections'])}")
        return
    global DEVICE
    if args.smoke:
        DEVICE = "cpu"
        args.kv_gib, args.speed_kv_gib, args.vocab = 0.03, 0.6, 1024
    t_start = time.perf_counter()
    formats = args.formats.split(",")
    if unknown := [f for f in formats if f not in FORMATS]:
        ap.error(f"--formats: unknown {', '.join(unknown)}; expected some of {', '.join(FORMATS)}")
    if args.shapes and not args.section:
        ap.error("--shapes: name the run's --section too (a table of other shapes must not replace a full one)")
    shapes = args.shapes or ([(1, 4096), (64, 4096)] if args.quick else [(b, c) for c in CONTEXTS for b in BATCHES])
    over = (64, 4096)
    if args.smoke:
        shapes, over = [(1, 512), (4, 512)], (4, 512)
    margs = qwen3_8b_shape(args.vocab, smoke=args.smoke)
    model = random_model(margs, seed=args.seed, weight_format=args.weights)
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    # weights a decode step reads: every linear layer at its format and the lm_head, not the embedding table
    # (rows are gathered, not streamed)
    read = weight_bytes_per_step(margs, args.weights)
    if DEVICE == "cuda" and (need := max(args.speed_kv_gib, args.kv_gib) * 2**30) > (free := torch.cuda.mem_get_info()[0]):
        ap.error(f"--speed-kv-gib / --kv-gib: {need / 2**30:g} GiB of KV does not fit the {free / 2**30:.1f} GiB free beside the weights")
    dev = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)"
    if DEVICE == "cuda":
        from decode_gpu import read_bandwidth  # bench/ beside this file

        bw_tb_s, _ = read_bandwidth()
    else:
        bw_tb_s = 0.05  # --smoke: a stand-in so the roofline columns are exercised (no meaning on CPU)
    print(f"read bandwidth {bw_tb_s:.2f} TB/s (streaming read, this run); weights read per step {read / 1e9:.2f} GB", flush=True)
    print(f"device {dev}, torch {torch.__version__}; Qwen3-8B shape, vocab {args.vocab}, weights {weights / 1e9:.2f} GB "
          f"(random {args.weights}, seed {args.seed}); capacity pool {args.kv_gib:g} GiB, speed pool {args.speed_kv_gib:g} GiB", flush=True)  # fmt: skip
    bench = Bench(
        (margs, model),
        quick=args.quick,
        enforce_eager=args.enforce_eager,
        breakdown=not args.no_breakdown,
        bit_budget=args.bit_budget,
        bit_budget_control=args.bit_budget_control,
        kv_layout=args.kv_layout,
    )
    results: dict[str, Any] = {}
    if args.iso:
        contexts = [512, 1024] if args.smoke else [int(c) for c in args.iso_contexts.split(",")]
        gib = 0.03 if args.smoke else args.iso_kv_gib
        results["iso"] = iso(bench, formats, gib, contexts, read=read, bw_tb_s=bw_tb_s)
        iso_report(results["iso"])
        dump(args, dev, weights, results, time.perf_counter() - t_start, read=read, bw_tb_s=bw_tb_s)
        return
    if args.extend:
        results["extend"] = {}
        extend_shapes = [(256, 64)] if args.smoke else EXTEND_SHAPES
        for fmt in formats:
            engine = bench.engine(fmt, args.speed_kv_gib)
            results["extend"][fmt] = [bench.extend(engine, prefix, new) for prefix, new in extend_shapes]
            for r in results["extend"][fmt]:
                print(f"  extend {fmt} {r['new']} on {r['prefix']}: {1e3 * r['seconds']:.1f} ms ({r['ms_per_1k_new']:.1f} ms per 1K new), "
                      f"{r['computed']} computed" + breakdown_line(r.get("breakdown_ms")), flush=True)  # fmt: skip
            del engine
            release()
        dump(args, dev, weights, results, time.perf_counter() - t_start, read=read, bw_tb_s=bw_tb_s)
        return
    for fmt in formats:
        t0 = time.perf_counter()
        row: dict[str, Any] = {"capacity": bench.capacity(fmt, args.kv_gib)}
        engine = bench.engine(fmt, args.speed_kv_gib)
        row["prefill_8k"] = bench.prefill(engine)
        print(f"  prefill {fmt}: {row['prefill_8k']['tok_s']:.0f} tok/s", flush=True)
        row["decode"] = []
        for b, c in progress(shapes, desc=f"decode {fmt}", quiet=args.quiet):
            r = bench.decode(engine, b, c)
            if "skipped" not in r:
                r["roofline_ms"] = (read + r["kv_bytes_read"]) / (bw_tb_s * 1e12) * 1e3
                r["of_roofline"] = r["roofline_ms"] / r["tpot_ms"]
            row["decode"].append(r)
            print(f"  decode {fmt} {b}x{c}: " + (r["skipped"] if "skipped" in r else
                  f"TPOT {r['tpot_ms']:.2f} ms, {r['tok_s']:.0f} tok/s, roofline {r['roofline_ms']:.2f} ms "
                  f"({100 * r['of_roofline']:.0f} %)" + breakdown_line(r.get("breakdown_ms"))), flush=True)  # fmt: skip
        row["overhead_b64_4k"] = bench.overhead(engine, *over)
        print(f"  overhead {fmt}: {json.dumps(row['overhead_b64_4k'])}", flush=True)
        row["seconds"] = time.perf_counter() - t0
        results[fmt] = row
        del engine
        release()
        dump(args, dev, weights, results, time.perf_counter() - t_start, read=read, bw_tb_s=bw_tb_s)  # so far
    report(results, shapes)
    dump(args, dev, weights, results, time.perf_counter() - t_start, read=read, bw_tb_s=bw_tb_s)


def breakdown_line(b: dict[str, Any] | None) -> str:
    if not b:
        return ""
    return "; " + ", ".join(f"{k} {v:.2f}" for k, v in b.items() if isinstance(v, float) and k != "kernels" and abs(v) >= 0.005)


WHAT = "bench/engine_gpu.py: the engine at the Qwen3-8B shape per KV format; one section per configuration"


def section_name(run: dict[str, Any]) -> str:
    """A run's section, from its options: ``iso``, ``extend``, ``default`` (triaxial, if it ran, as the product runs it:
    the config's bit-budget control and budget), else ``<control>[_<budget>]`` (``fixed``, ``hold_2.7``); ``weights_<format>`` for
    a run of FP8 weights, ``_<layout>`` after a run of a KV layout other than the default, and ``_quick`` after a
    ``--quick`` run's name (none of them replaces the full bf16 run). A run that does not record its layout ran
    layer-major (the layout before it was recorded)."""
    control = run.get("bit_budget_control") or "fixed"  # a run that records no control ran fixed
    budget = run.get("bit_budget")
    if "iso" in run["formats"]:
        name = "iso"
    elif "extend" in run["formats"]:
        name = "extend"
    elif "triaxial" in run["formats"] and (control != KVCacheConfig().bit_budget_control or budget is not None):
        name = control if budget is None else f"{control}_{budget:g}"  # triaxial not as the product runs it
    else:
        name = "default"
    if run.get("weights", "bf16") != "bf16":
        name = f"weights_{run['weights']}" if name == "default" else f"{name}_weights_{run['weights']}"
    layout = run.get("kv_layout", "layer_major")
    if layout != KVCacheConfig().layout:
        name = f"{name}_{layout}"
    return f"{name}_quick" if run.get("quick") else name


def dump(args: argparse.Namespace, dev: str, weights: int, results: dict[str, Any], seconds: float, *, read: int, bw_tb_s: float) -> None:
    out = {"device": dev, "torch": torch.__version__, "model": f"Qwen3-8B shape, random {args.weights} weights", "weights": args.weights, "vocab": args.vocab,
           "weights_bytes": weights, "weights_read_bytes": read, "read_bandwidth_tb_s": bw_tb_s, "kv_gib": args.kv_gib, "speed_kv_gib": args.speed_kv_gib, "quick": args.quick,
           "enforce_eager": args.enforce_eager, "bit_budget": args.bit_budget, "bit_budget_control": args.bit_budget_control,
           "pdl": KernelOptions.from_env().pdl, "kv_layout": args.kv_layout, "seconds": seconds, "formats": results}  # fmt: skip
    name = args.section or section_name(out)
    write_section(Path(args.out), name, out, what=WHAT, name_of=section_name)
    print(f"  ({seconds:.0f} s so far, section {name} of {args.out} written)", flush=True)


def report(results: dict[str, Any], shapes: list[tuple[int, int]]) -> None:
    base = results.get("bf16")

    def ratio(x: float | None, b: float | None) -> str:
        return f"({x / b:4.2f}x)" if x and b else "       "

    print(f"\n{'format':<9} {'8K seqs':>14} {'INT2 pages, bits':>16} {'prefill 8K tok/s':>24}")
    for fmt, r in results.items():
        cap, pf = r["capacity"], r["prefill_8k"]
        b_cap = base["capacity"]["seqs"] if base else None
        b_pf = base["prefill_8k"]["tok_s"] if base else None
        share = (
            f"{cap['int2_share_stored']:.2f}/{cap['int2_share_budget']:.2f} {cap.get('stored_bits', 0):.2f}b" if fmt == "triaxial" else "-"
        )
        print(f"{fmt:<9} {cap['seqs']:>5} {ratio(cap['seqs'], b_cap)} {share:>16} {pf['tok_s']:>14.0f} {ratio(pf['tok_s'], b_pf)}")
    print(f"\n{'format':<9} " + " ".join(f"{f'{b}x{c // 1024}K TPOT ms':>22}" for b, c in shapes))
    for fmt, r in results.items():
        cells = []
        for i, d in enumerate(r["decode"]):
            if "skipped" in d:
                cells.append(f"{'does not fit':>22}")
                continue
            bd = base["decode"][i] if base else None
            cells.append(f"{d['tpot_ms']:>13.2f} {ratio(bd.get('tpot_ms') if bd else None, d['tpot_ms'])}")
        print(f"{fmt:<9} " + " ".join(cells))
    print("(TPOT ratio = bf16 TPOT / this format's: > 1 is faster than bf16)")
    print(f"\n{'format':<9} " + " ".join(f"{f'{b}x{c // 1024}K % of roofline':>22}" for b, c in shapes))
    for fmt, r in results.items():
        cells = [f"{'-':>22}" if "skipped" in d else f"{100 * d['of_roofline']:>21.0f}%" for d in r["decode"]]
        print(f"{fmt:<9} " + " ".join(cells))
    print("(roofline = (weights read + KV read) / read bandwidth; goal >= 80 % at 1x4K, 64x4K, 16x32K)")
    for fmt, r in results.items():
        o = r["overhead_b64_4k"]
        parts = [f"{m}: step {o[m]['step_ms']:.2f} ms, kernels {o[m]['kernel_ms'] or 0:.2f} ms "
                 f"({o[m]['kernels_per_step']:.0f} kernels per step), overhead "
                 f"{100 * (o[m]['overhead_share'] or 0):.1f}%, host waits {o[m]['host_wait_ms']:.2f} ms"
                 for m in ("eager", "graphs_sync", "graphs") if m in o]  # fmt: skip
        print(f"overhead 64x4K {fmt}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
