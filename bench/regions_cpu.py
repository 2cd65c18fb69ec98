"""Regions per pulled conversation after churn, lowest-id-first vs runs placement (CPU, real
workers): a decode worker serves many conversations of varied lengths at once (each prompt
prefilled by a prefill worker and pulled P->D, then decoded, retained under a lease), then
the prefill worker, with an empty cache, pulls a long conversation back D->P; regions (NIXL
descriptors after merging, per layer buffer) and READ time per pull, one table.

    PYTHONSAFEPATH=1 .venv/bin/python bench/regions_cpu.py [--dtype bf16] [--conversations 40] [--json OUT]

"lowest" reproduces the previous ``PagePool`` placement (lowest free id first, then LRU
evictions in LRU order) by replacing ``PagePool.allocate_next`` for that run only; "runs" is
the pool as it is. Both runs see the same seeded prompts and lengths. The H200 column is
the READ cost those regions and bytes would have on the GPU pair (DESIGN.md "Worker":
~7.2 us per region + bytes / ~330 GB/s); the CPU column is measured here (UCX cma).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvserving.config import KVCacheConfig, ModelConfig, ReuseConfig, SchedulerConfig, ServingConfig
from kvserving.worker.engine import LLMEngine, RequestOutput
from kvserving.worker.kv.local_pair import LocalPair, flush_prefix_cache
from kvserving.worker.kv.transfer import KVTransfer
from kvserving.worker.kv.protocol import KVTransferParams
from kvserving.worker.kv.page_pool import PagePool
from kvserving.worker.sampling import SamplingParams
from kvserving.tiny_model import build_tiny_model


US_PER_REGION_H200 = 7.2e-6
BYTES_PER_S_H200 = 330e9


def lowest_id_first(pool: PagePool, page_bits: Sequence[int], *, after: int | None, expect: int = 0) -> list[int] | None:
    """The previous placement: lowest free ids first, then evict cached pages in LRU order."""
    n = len(page_bits)
    if n > pool.num_free:
        return None
    ids: list[int] = []
    for start, length in pool.free_runs():
        k = min(length, n - len(ids))
        ids += pool._region.take(start, k, start)
        if len(ids) == n:
            break
    while len(ids) < n:
        pid = pool.cached_page_ids()[0]
        pool._evict(pid)
        ids.append(pid)
    return pool._own(ids)


def run_request(kvt: KVTransfer, rid: str, ids: list[int], params: KVTransferParams | None) -> RequestOutput:
    """One prefill-only request (1 token) on ``kvt``'s engine, pulling first when ``params``."""
    pull = kvt.pull(ids, None, params)
    eng = kvt.engine
    eng.add_request(
        rid,
        ids,
        SamplingParams(max_tokens=1, ignore_eos=True),
        retain=kvt.retain_spec(conversation_key=rid, input_ids=ids),
        admission_pin=pull.admission_pin,
    )
    while True:
        for out in eng.step():
            if out.request_id == rid and out.finished:
                return out


def make_engine(model: Path, dtype: str, num_pages: int | None, *, page_bytes: int | None = None) -> LLMEngine:
    memory = 96 << 20 if num_pages is None else num_pages * (page_bytes or PAGE_BYTES[dtype])
    return LLMEngine(
        ServingConfig(
            model=ModelConfig(path=str(model)),
            kv_cache=KVCacheConfig(dtype=dtype, memory_bytes=memory),
            reuse=ReuseConfig(recompute_threshold_tokens=0),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, chunk_size=512),
        )
    )


PAGE_BYTES: dict[str, int] = {}


def run(model: Path, args: argparse.Namespace, policy: str) -> dict[str, Any]:
    saved = PagePool.allocate_next
    if policy == "lowest":
        PagePool.allocate_next = lowest_id_first  # type: ignore[method-assign,assignment]
    try:
        return _run(model, args, policy)
    finally:
        PagePool.allocate_next = saved  # type: ignore[method-assign]


def _run(model: Path, args: argparse.Namespace, policy: str) -> dict[str, Any]:
    pair = LocalPair(*(make_engine(model, args.dtype, args.pool_pages) for _ in range(2)), name=policy)
    d = pair.d.engine
    rng = random.Random(args.seed)
    active: dict[str, list[int]] = {}  # request id on D -> its prompt (for the D->P pulls)
    retained: dict[str, KVTransferParams] = {}
    p_to_d_regions: list[int] = []
    pulls: list[dict[str, Any]] = []

    def admit(rid: str, prompt: list[int], gen: int) -> None:
        po = run_request(pair.p, f"{rid}-p", prompt, None)
        assert po.retained is not None
        # retained conversations yield to the new request's pages (as they do to a running one's)
        while d.pool.num_free < -(-len(prompt) // d.pool.page_size) and d.pool.reclaim_one() is not None:
            pass
        pull = pair.d.pull(prompt, None, pair.p.params_for(po.retained))
        assert pull.fallback is None and pull.pulled_tokens, pull
        p_to_d_regions.append(pull.num_regions)
        d.add_request(
            rid,
            prompt,
            SamplingParams(max_tokens=gen, ignore_eos=True),
            retain=pair.d.retain_spec(conversation_key=rid, input_ids=prompt),
            admission_pin=pull.admission_pin,
        )
        active[rid] = prompt
        flush_prefix_cache(pair.p)  # P keeps nothing: the history lives on D

    def step() -> None:
        for out in d.step():
            if out.request_id in targets:
                targets[out.request_id] += out.new_token_ids  # the pull back covers the reply too
            if out.finished:
                active.pop(out.request_id)
                assert out.retained is not None
                retained[out.request_id] = pair.d.params_for(out.retained)

    def pull_back(rid: str) -> None:
        flush_prefix_cache(pair.p)
        prompt = targets[rid]
        t0 = time.perf_counter()
        res = pair.p.pull(prompt + [7], None, retained[rid])
        assert res.fallback is None and res.pulled_tokens, res
        pulls.append(
            {
                "conversation": rid,
                "tokens": res.pulled_tokens,
                "regions": res.num_regions,
                "bytes": res.num_bytes,
                "pull_s": time.perf_counter() - t0,
                "h200_s": res.num_regions * US_PER_REGION_H200 + res.num_bytes / BYTES_PER_S_H200,
            }
        )
        if res.admission_pin:
            pair.p.engine.pool.release(res.admission_pin)

    targets: dict[str, list[int]] = {}
    n = 0
    for i in range(args.conversations + args.long):
        long = i >= args.conversations
        while len(active) >= args.width:
            step()
        n += 1
        rid = f"long{n}" if long else f"c{n}"
        length = args.long_tokens if long else rng.randint(64, args.max_prompt)
        prompt = [rng.randrange(10, 4000) for _ in range(length)]
        if long:
            targets[rid] = list(prompt)
        admit(rid, prompt, args.gen if long else rng.randint(1, 160))
    while active:
        step()
    for rid in targets:
        pull_back(rid)
    pool = d.pool
    assert isinstance(pool, PagePool)
    out = {
        "policy": policy,
        "pulls": pulls,
        "p_to_d_regions": p_to_d_regions,
        "d_pages": pool.num_pages,
        "d_evicted": pool.evicted_pages,
        "d_reclaimed": pool.reclaimed_pins,
    }
    pair.close()
    return out


def pool_bench(pool_cls: Any, *, num_pages: int, width: int, steps: int, seed: int) -> dict[str, float]:
    """Scheduler-like pool traffic, no engine: ``width`` sequences at once, each step one
    32-page prefill chunk or one decode page each, full pages registered, finished ones freed
    (cached, then evicted LRU). Seconds of pool calls per step and per allocate call."""
    now = [0.0]
    pool = pool_cls(num_pages, page_size=16, clock=lambda: now[0])
    rng = random.Random(seed)
    seqs: list[list[Any]] = []  # [page ids, prompt pages, decode pages]
    calls = 0
    spent = 0.0
    hashes = iter(range(1, 1 << 62))
    for step in range(steps):
        now[0] = float(step)
        while len(seqs) < width:
            seqs.append([[], rng.randint(4, 400), rng.randint(1, 40)])
        t0 = time.thread_time()
        for s in list(seqs):
            ids, prompt, gen = s
            if len(ids) >= prompt + gen:
                pool.free(ids)
                seqs.remove(s)
                continue
            n = min(32, prompt - len(ids)) if len(ids) < prompt else 1
            if hasattr(pool, "allocate_next"):
                got = pool.allocate_next([4] * n, after=ids[-1] if ids else None, expect=max(n, prompt - len(ids)))
            else:
                got = pool.allocate([4] * n)
            calls += 1
            assert got is not None
            for pid in got:
                pool.register(pid, next(hashes))
            ids += got
        spent += time.thread_time() - t0
    return {"us_per_step": spent / steps * 1e6, "us_per_call": spent / calls * 1e6}


def load_old_pool(rev: str) -> Any:
    """``PagePool`` as it was at git revision ``rev`` (pure Python: loads from a temp file)."""
    root = Path(__file__).resolve().parent.parent
    for where in ("worker/kv/page_pool.py", "worker/page_pool.py"):  # the pool's path then, newest first
        got = subprocess.run(["git", "show", f"{rev}:{where}"], capture_output=True, text=True, cwd=root)
        if got.returncode == 0:
            break
    got.check_returncode()
    src = got.stdout
    path = Path(tempfile.mkdtemp()) / "old_page_pool.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_page_pool", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_page_pool"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod.PagePool


# ------------------------------------------------------------------ replay of bench/pd_gpu.py
GPU_POOL_BYTES = 8 << 30  # per worker in the H200 pair's run
GPU_SHAPE = (36, 8, 128)  # Qwen3-8B: layers, kv heads, head dim


def gpu_pages(dtype: str) -> int:
    """Pages of ``dtype`` in the GPU run's 8 GiB pool of Qwen3-8B pages."""
    from kvserving.config import DEFAULT_PAGE_SIZE
    from kvserving.kernels.layout import PageLayout

    layers, heads, dim = GPU_SHAPE
    page = PageLayout.build(dtype, page_size=DEFAULT_PAGE_SIZE[dtype], kv_heads=heads, head_dim=dim).page_bytes
    return (GPU_POOL_BYTES // layers) // page


def no_compute(eng: LLMEngine) -> None:
    """Replace the model run by zero logits: the pages are placed, pinned, pulled and freed as
    in a real run (placement never looks at their bytes), at no compute cost."""
    vocab = eng.vocab_size

    def execute(chunks: Sequence[Any]) -> torch.Tensor:
        return torch.zeros(sum(1 for c in chunks if c.samples), vocab)

    eng.runner.execute = execute  # type: ignore[method-assign]


def runs_of(ids: Sequence[int]) -> int:
    """Runs of consecutive page ids in ``ids`` (in order)."""
    return sum(1 for i, pid in enumerate(ids) if i == 0 or pid != ids[i - 1] + 1)


class Replay:
    """bench/pd_gpu.py's seed phase on a LocalPair with GPU page counts and no compute."""

    def __init__(self, model: Path, dtype: str, *, new: int, gen: int, seed: int) -> None:
        engines = []
        probe = LLMEngine(ServingConfig(model=ModelConfig(path=str(model)), kv_cache=KVCacheConfig(dtype=dtype, memory_bytes=8 << 20)))
        per_page = probe.storage.shape.num_layers * probe.storage.layout.page_bytes
        for _ in range(2):
            cfg = ServingConfig(
                model=ModelConfig(path=str(model), max_model_len=32768),
                kv_cache=KVCacheConfig(dtype=dtype, memory_bytes=gpu_pages(dtype) * per_page),
                reuse=ReuseConfig(recompute_threshold_tokens=64, transfer_timeout_s=5.0),
                scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, chunk_size=2048),
            )
            eng = LLMEngine(cfg, model=(probe.args, probe.model))
            no_compute(eng)
            engines.append(eng)
        self.pair = LocalPair(*engines, name=f"replay-{dtype}")
        self.new, self.gen = new, gen
        self.rng = random.Random(seed)
        self.n = 0
        self.rows: list[dict[str, Any]] = []

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(10, 4000) for _ in range(n)]

    def turn(
        self,
        kvt: KVTransfer,
        prompt: list[int],
        max_tokens: int,
        params: KVTransferParams | None = None,
        *,
        retain: bool = False,
        key: str | None = None,
        output_ids: Sequence[int] = (),
    ) -> tuple[Any, RequestOutput]:
        self.n += 1
        rid = f"r{self.n}"
        pull = kvt.pull(prompt, None, params)
        spec = kvt.retain_spec(conversation_key=key, input_ids=prompt) if kvt.role == "prefill" or retain else None
        eng = kvt.engine
        eng.add_request(
            rid,
            prompt,
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            retain=spec,
            admission_pin=pull.admission_pin,
            output_ids=output_ids,
        )
        while True:
            for out in eng.step():
                if out.request_id == rid and out.finished:
                    return pull, out

    def release_all(self) -> None:
        for kvt in (self.pair.p, self.pair.d):
            for lease in kvt.leases():
                kvt.release(lease["lease_id"])

    def on_turn(self, L: int, label: str, key: str, *, d_gen: int) -> list[int]:
        """Setup on D (history + reply, retained); for "on" the new-only turn on D; then P pulls
        the history back (D->P) and D pulls the new pages (P->D). The row records each side's
        runs of that D->P READ. Returns the prompt the history held (for new-only on P)."""
        p, d = self.pair.p, self.pair.d
        hist = self.ids(L - self.new - self.gen)
        _, setup = self.turn(d, hist, self.gen, retain=True, key=key)
        assert setup.retained is not None
        d_params = d.params_for(setup.retained)
        held = hist + [0] * self.gen  # the reply (zero logits: token 0)
        if label == "on":
            self.turn(d, held + self.ids(self.new), 1)  # new-only on D
        x = held + self.ids(self.new)
        pull, pout = self.turn(p, x, 1, d_params, key=key)
        assert pout.retained is not None
        first = pull.local_tokens // p.page_size
        n = pull.pulled_tokens // p.page_size
        self.rows.append(
            {
                "L": L,
                "mode": label,
                "pulled_tokens": pull.pulled_tokens,
                "regions": pull.num_regions,
                "layers": p.engine.storage.shape.num_layers,
                "fallback": pull.fallback,
                "remote_runs": runs_of(list(d_params.page_ids[first : first + n])),
                "local_runs": runs_of(list(pout.retained.page_ids[first : first + n])),
                "phases_ms": {k: round(v * 1e3, 3) for k, v in pull.phases.items()},
            }
        )
        d_pull, _ = self.turn(d, x, d_gen, p.params_for(pout.retained), retain=True, key=key, output_ids=[0])
        self.rows[-1]["p_to_d_regions"] = d_pull.num_regions
        return held

    def length(self, L: int) -> None:
        """One length as ``pd_gpu.one_length``: setup, new-only, on, new-only on P, off, then the gateway turn."""
        p, d = self.pair.p, self.pair.d
        self.n += 1
        held = self.on_turn(L, "on", f"k{self.n}", d_gen=2)
        self.turn(p, held + self.ids(self.new), 1)  # new-only on P
        x_off = self.ids(L)
        _, poff = self.turn(p, x_off, 1)
        assert poff.retained is not None
        self.turn(d, x_off, 2, p.params_for(poff.retained), output_ids=[0])
        self.release_all()
        self.on_turn(L, "gw on", f"cache:g{self.n}", d_gen=self.gen)
        self.release_all()


def replay_pd_gpu(model: Path, dtype: str, lengths: list[int], reps: int, *, new: int, gen: int, seed: int) -> list[dict[str, Any]]:
    r = Replay(model, dtype, new=new, gen=gen, seed=seed)
    for L in sorted({min(lengths), max(lengths)}):  # the bench's warm-up
        r.length(L)
    r.rows.clear()
    for L in lengths:
        for _ in range(reps):
            r.length(L)
    r.pair.close()
    return r.rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--model", type=Path, help="model directory (default: build the tiny model)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp8_e4m3", "nvfp4"))
    ap.add_argument("--conversations", type=int, default=40, help="churn: conversations before the long ones")
    ap.add_argument("--width", type=int, default=6, help="conversations at once on the decode worker")
    ap.add_argument("--max-prompt", type=int, default=1500)
    ap.add_argument("--long", type=int, default=3, help="long conversations pulled back at the end")
    ap.add_argument("--long-tokens", type=int, default=3000)
    ap.add_argument("--gen", type=int, default=64, help="tokens the long conversations generate")
    ap.add_argument("--pool-pages", type=int, default=1024, help="pages per worker")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--pd-gpu",
        action="store_true",
        help="replay bench/pd_gpu.py's seed phase (GPU page counts, no "
        "compute): regions of each D->P pull and which side's pages are split",
    )
    ap.add_argument("--lengths", default="2048,8192,24576", help="--pd-gpu: prompt lengths")
    ap.add_argument("--reps", type=int, default=2, help="--pd-gpu: repetitions per length")
    ap.add_argument(
        "--pool-bench",
        metavar="OLD_REV",
        help="only time the pool's calls per scheduler step, now and at git revision OLD_REV (e.g. the commit before runs placement)",
    )
    args = ap.parse_args(argv)
    if args.pool_bench:
        # CPU time of this thread, old and new interleaved, fastest of 3 each (a loaded machine)
        print("| pages | sequences | pool | us per step | us per allocate |\n|---|---|---|---|---|")
        pools = {args.pool_bench: load_old_pool(args.pool_bench), "runs (now)": PagePool}
        for pages, width in ((4096, 8), (16384, 32), (65536, 64)):
            best: dict[str, dict[str, float]] = {}
            for rep in range(3):
                for name, cls in pools.items():
                    t = pool_bench(cls, num_pages=pages, width=width, steps=2000, seed=rep)
                    if name not in best or t["us_per_step"] < best[name]["us_per_step"]:
                        best[name] = t
            for name, t in best.items():
                print(f"| {pages} | {width} | {name} | {t['us_per_step']:.1f} | {t['us_per_call']:.2f} |")
        return 0
    torch.set_num_threads(1)
    if args.pd_gpu:
        return main_pd_gpu(args)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_tiny_model(Path(tmp) / "tiny")
        probe = make_engine(model, args.dtype, None)
        page_size = probe.pool.page_size
        assert isinstance(probe.pool, PagePool), "runs placement is the plain pool's (not triaxial)"
        PAGE_BYTES[args.dtype] = (96 << 20) // probe.pool.num_pages
        del probe
        results = [run(model, args, policy) for policy in ("lowest", "runs")]
    print(
        f"# regions_cpu: dtype {args.dtype}, page size {page_size}, {args.pool_pages} pages per worker, "
        f"{args.conversations} conversations (64-{args.max_prompt} prompt tokens, {args.width} at once), "
        f"then {args.long} of {args.long_tokens} pulled back D->P"
    )
    head = [
        "policy",
        "conversation",
        "tokens",
        "MiB",
        "regions",
        "pull ms (CPU)",
        "H200 READ ms (model)",
        "P->D regions mean/max",
        "D evicted pages",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in results:
        pd = r["p_to_d_regions"]
        for p in r["pulls"]:
            row = [
                r["policy"],
                p["conversation"],
                p["tokens"],
                f"{p['bytes'] / 2**20:.2f}",
                p["regions"],
                f"{p['pull_s'] * 1e3:.1f}",
                f"{p['h200_s'] * 1e3:.2f}",
                f"{sum(pd) / len(pd):.1f}/{max(pd)}",
                r["d_evicted"],
            ]
            print("| " + " | ".join(str(c) for c in row) + " |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def main_pd_gpu(args: argparse.Namespace) -> int:
    lengths = [int(x) for x in args.lengths.split(",") if x]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_tiny_model(Path(tmp) / "tiny")
        cfg = json.loads((model / "config.json").read_text())
        if cfg["max_position_embeddings"] < max(lengths) + 64:  # RoPE: a longer context is a config change
            cfg["max_position_embeddings"] = 32768
            (model / "config.json").write_text(json.dumps(cfg))
        results: dict[str, list[dict[str, Any]]] = {}
        saved = PagePool.allocate_next
        for policy in ("lowest", "runs"):
            if policy == "lowest":  # the placement before runs (dd48d37): the H200 run of 00:12 had it
                PagePool.allocate_next = lowest_id_first  # type: ignore[method-assign,assignment]
            try:
                results[policy] = replay_pd_gpu(model, args.dtype, lengths, args.reps, new=1024, gen=16, seed=args.seed)
            finally:
                PagePool.allocate_next = saved  # type: ignore[method-assign]
    print(
        f"# regions_cpu --pd-gpu: dtype {args.dtype}, {gpu_pages(args.dtype)} pages per worker (the H200 run's), "
        "bench/pd_gpu.py's order of turns, no compute; runs = regions per layer buffer"
    )
    head = [
        "policy",
        "L",
        "turn",
        "pulled tokens",
        "D->P runs (regions/layer)",
        "runs on D (sender)",
        "runs on P (receiver)",
        "P->D runs",
        "fallback",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for policy, rows in results.items():
        for r in rows:
            row = [
                policy,
                r["L"],
                r["mode"],
                r["pulled_tokens"],
                r["regions"] // r["layers"],
                r["remote_runs"],
                r["local_runs"],
                r["p_to_d_regions"] // r["layers"],
                r["fallback"],
            ]
            print("| " + " | ".join(str(c) for c in row) + " |")
    # the pull's own steps (no HTTP here: the peer calls are direct), median over the D->P pulls
    rows = results["runs"]
    keys = sorted({k for r in rows for k in r["phases_ms"]}, key=lambda k: (PHASE_ORDER + [k]).index(k))
    print("\n# D->P pull phases, ms (median of the 'on' and 'gw on' pulls per length; runs placement; direct peer calls)")
    print("| L | " + " | ".join(keys) + " | total |")
    print("|---|" + "---|" * (len(keys) + 1))
    for L in lengths:
        rs = [r["phases_ms"] for r in rows if r["L"] == L]
        med = {k: statistics.median(r.get(k, 0.0) for r in rs) for k in keys}
        total = statistics.median(sum(v for k, v in r.items() if not k.startswith("contact_")) for r in rs)
        print(f"| {L} | " + " | ".join(f"{med[k]:.2f}" for k in keys) + f" | {total:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


# phase names of kv/puller.py PULL_PHASES and of the pull before the hold (agent, lease_check, alloc, lease_recheck)
PHASE_ORDER = [
    "plan",
    "agent",
    "lease_check",
    "alloc",
    "descriptors",
    "read",
    "lease_recheck",
    "adopt",
    "release",
    "contact_agent",
    "contact_hold",
]


if __name__ == "__main__":
    raise SystemExit(main())
