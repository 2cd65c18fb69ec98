"""Prefill and decode workers on two GPUs: NIXL READ bandwidth GPU->GPU and the seed's multi-turn TTFT experiment.

Run on a two-GPU device machine (docs/performance-log/pd-gpu.md gives the command)::

    python3 bench/pd_gpu.py --out DIR [--phases bw,seed,faults] [--formats bf16,nvfp4,fp8_e4m3,triaxial] [--budget-s 540]
    python3 bench/pd_gpu.py --tiny --out DIR      # the same end to end on CPU: tiny model, CPU memory
    # CPU, the GPU run's lengths and pool page counts (1-layer tiny model at 32K context; "off" and
    # the gateway turn left out: minutes of CPU prefill), for the pull's per-phase split:
    python3 bench/pd_gpu.py --tiny --like-gpu --tiny-layers 1 --skip off,gw --phases seed --formats bf16 --new 64 --reps 5
    # one result file per machine: each phase from the last of these runs that holds it
    python3 bench/pd_gpu.py --combine bench/results/pd_gpu_h200x2.json DIR/pd_gpu.json --out bench/results/pd_gpu_h200x2.json

Phases (in this order; each one is skipped when the time budget cannot hold it, and the
JSON is rewritten after every step, so a run cut short still leaves its numbers):

bw
    Two processes, one per GPU (``CUDA_VISIBLE_DEVICES``), each with a KV pool of one format
    (``KVStorage``, the worker's own layer buffers, scales included) registered with NIXL
    (``NixlIO``, the worker's transport). The reader READs 1, 64, 1024 and 16K pages from the
    other, pages contiguous (one region per layer, as a prompt allocated in one go) and
    scattered (one region per page per layer); the bytes read are checked against the
    source's pattern. The same bytes are then copied by torch peer-to-peer in one process.
    ``UCX_PROTO_INFO=y`` makes UCX print the protocols it selected (which transport) into
    the reader's log.
seed
    A Qwen3-8B-shaped model with seeded random weights (written once as safetensors), one
    prefill ``kvserving worker`` on GPU 0 and one decode worker on GPU 1 per KV format.
    Per prompt length L: the decode worker holds the conversation's history (computed and
    retained there, as after earlier turns; the prefill worker has never seen it, i.e. no
    prefix caching on the prefill side) and a new user message of ``--new`` tokens arrives:

    - on: the prefill worker READs the history from the decode worker (D->P), computes only
      the new tokens, the decode worker READs only the pages it lacks (P->D) and samples;
    - off: the prefill worker computes all L tokens, the decode worker READs all of them;
    - new-only: the decode worker, holding the history in its own cache, computes only the
      new tokens itself: the floor (on another process and device than "on", right after that
      worker computed the history);
    - new-only P: after "on", the prefill worker itself, now holding the history it pulled in
      its own cache, computes a fresh new message: the floor on the same process, device,
      pages and kernel path as "on" (on / new-only P isolates the pull).

    Per length the bench also prints where the prefill worker's time went on "on" (the final
    event's ``timings``: the pull's phases, queueing, the wait for the engine step, the step)
    and one round trip of each sender call (agent, lease listing, renew, hold) from the client.

    TTFT = from the request reaching the prefill worker to its first token: the prefill worker
    samples the reply's first token and the gateway streams it at once; the decode worker then
    continues after it (``output_ids``), so its hop shows in the second token's time ("2nd
    token on"). Client side, HTTP included. The prefill time is split into the D->P READ (the
    prefill worker's own transfer seconds) and the rest (compute, scheduling, HTTP). With a
    gateway per pair ("gw on"), the same "on" turn also runs through ``kvserving gateway``
    (``/v1/completions`` with token ids and ``prompt_cache_key``, streamed): the gateway finds
    the decode worker's lease, routes and relays; its cached tokens confirm the reuse.
faults
    On the bf16 pair: the decode worker frozen (SIGSTOP) while the prefill worker pulls, and
    killed between turns; each turn must recompute (usage.reuse_fallback) and its tokens are
    compared with the decode worker's own (after SIGCONT, or after a restart).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import statistics
import subprocess
import sys
import tarfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvserving import jsonfmt
from kvserving.local.stack import free_port, free_ports, new_token_file
from kvserving.tags import encode_tag

FORMATS = ("bf16", "nvfp4", "fp8_e4m3", "triaxial")
INT2_SHARE = 0.65  # triaxial pages at INT2: 0.65 * 2 + 0.35 * 4 = 2.7 average code bits
# vocab_size: the built-in tiny model's tokenizer (4096 ids) is copied next to the weights so
# that a gateway can render, tokenize and detokenize for this model; the LM head is then 4096
# wide (runs only at sampled positions: no effect on prefill or transfer time).
QWEN3_8B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 4096,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "initializer_range": 0.02,
    "use_cache": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": None,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
TRANSPORTS = ("cuda_ipc", "cuda_copy", "gdr_copy", "rc_mlx5", "dc_mlx5", "ud_mlx5", "tcp", "sysv", "posix", "cma", "self")


@dataclass
class Plan:
    tiny: bool
    out: Path
    work: Path
    formats: list[str]
    lengths: list[int]
    new: int
    gen: int
    reps: int
    bw_pages: list[int]
    scattered_max: int
    pool_bytes: int
    deadline: float
    results: dict[str, Any]
    gateways: list[Any] = field(default_factory=list)  # gateway processes (Worker records), killed at the end
    ctx: int = 32768  # the model's context (tiny: 4096 unless --like-gpu)
    tiny_layers: int = 0  # tiny: layers of the model (0: the built-in tiny model's)
    skip: frozenset[str] = frozenset()  # modes left out of each length: "off", "gw"
    like_gpu: bool = False  # tiny: pools of the GPU run's page counts (8 GiB of Qwen3-8B pages per format)
    pair_ports: dict[str, list[int]] = field(default_factory=dict)  # format -> [prefill, decode] port

    @property
    def token_path(self) -> Path:
        """The workers' internal credential (one per run; written on first use)."""
        path = self.work / "internal-token"
        if not path.exists():
            new_token_file(path)
        return path

    @property
    def internal_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token_path.read_text().strip()}"}

    def pool_bytes_for(self, fmt: str) -> int:
        """The KV pool of ``fmt``: ``pool_bytes``, or with ``like_gpu`` as many pages as the GPU run's
        8 GiB pool of Qwen3-8B pages holds (so placement and regions match) in the tiny model's sizes."""
        if not (self.tiny and self.like_gpu):
            return self.pool_bytes
        from kvserving.config import DEFAULT_PAGE_SIZE
        from kvserving.kernels.layout import PageLayout

        ps = DEFAULT_PAGE_SIZE[fmt]
        lay = "int4" if fmt == "triaxial" else fmt
        gpu_page = PageLayout.build(lay, page_size=ps, kv_heads=QWEN3_8B["num_key_value_heads"], head_dim=QWEN3_8B["head_dim"]).page_bytes
        pages = (self.pool_bytes // QWEN3_8B["num_hidden_layers"]) // gpu_page
        layers, heads, dim = shape_of(True)
        layers = self.tiny_layers or layers
        tiny_page = PageLayout.build("fp32" if fmt == "bf16" else lay, page_size=ps, kv_heads=heads, head_dim=dim).page_bytes
        return pages * tiny_page * layers

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        (self.out / "pd_gpu.json").write_text(jsonfmt.dumps(self.results))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------ bw
def shape_of(tiny: bool) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of the model the pools are laid out for."""
    if tiny:
        from kvserving.tiny_model import TINY_CONFIG

        return int(TINY_CONFIG["num_hidden_layers"]), int(TINY_CONFIG["num_key_value_heads"]), int(TINY_CONFIG["head_dim"])  # type: ignore[call-overload]
    return QWEN3_8B["num_hidden_layers"], QWEN3_8B["num_key_value_heads"], QWEN3_8B["head_dim"]


def page_split(fmt: str, n: int) -> tuple[int, int]:
    """(full-precision pages, INT2 pages) among ``n`` pages of ``fmt``."""
    if fmt != "triaxial":
        return n, 0
    n2 = int(round(n * INT2_SHARE))
    return n - n2, n2


def make_storage(fmt: str, max_pages: int, *, tiny: bool, device: torch.device) -> Any:
    """A KV pool of ``fmt`` holding ``max_pages`` pages (triaxial: at the 2.7-bit mix)."""
    from kvserving.config import DEFAULT_PAGE_SIZE
    from kvserving.kernels.layout import ALIGN, PageLayout
    from kvserving.worker.kv.storage import KVShape, KVStorage

    layers, heads, dim = shape_of(tiny)
    ps = DEFAULT_PAGE_SIZE[fmt]
    dims = dict(page_size=ps, kv_heads=heads, head_dim=dim)
    model_dtype = torch.float32 if tiny else torch.bfloat16
    if fmt == "triaxial":
        n4, n2 = page_split(fmt, max_pages)
        per_layer = n4 * PageLayout.build("int4", **dims).page_bytes + n2 * PageLayout.build("int2", **dims).page_bytes + ALIGN
    else:
        per_layer = max_pages * PageLayout.build("fp32" if tiny and fmt == "bf16" else fmt, **dims).page_bytes
    return KVStorage(
        fmt, KVShape(layers, heads, dim), page_size=ps, budget_bytes=layers * per_layer, device=device, model_dtype=model_dtype
    )


def pattern(idx: torch.Tensor) -> torch.Tensor:
    """The byte at global index ``idx`` of the source pool (a multiplicative hash: every page differs)."""
    return ((idx * 0x9E3779B1) >> 17).bitwise_and(255).to(torch.uint8)


def fill_pattern(buf: torch.Tensor) -> None:
    layers, total = buf.shape
    chunk = 1 << 26
    for layer in range(layers):
        for s in range(0, total, chunk):
            n = min(chunk, total - s)
            idx = torch.arange(layer * total + s, layer * total + s + n, device=buf.device, dtype=torch.int64)
            buf[layer, s : s + n] = pattern(idx)


def page_ids(fmt: str, n: int, *, total: int, scattered: bool, rng: random.Random) -> list[int]:
    """``n`` page ids among ``total`` (triaxial: INT2 ids carry the flag)."""
    from kvserving.kernels.page_ids import make_page_id

    n4, n2 = page_split(fmt, n)
    t4, t2 = page_split(fmt, total)
    i4 = rng.sample(range(t4), n4) if scattered else list(range(n4))
    i2 = rng.sample(range(t2), n2) if scattered else list(range(n2))
    return [make_page_id(i, bits=4) for i in i4] + [make_page_id(i, bits=2) for i in i2]


def bw_peer(role: str, gpu: int, conn: Any, cfg: dict[str, Any]) -> None:
    """One side of the bandwidth test, in its own process (spawned)."""
    fd = os.open(cfg["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    if cfg["cuda"]:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    os.environ.update(cfg["env"])
    try:
        _bw_peer(role, conn, cfg)
    except BaseException as exc:  # noqa: BLE001 - report, then exit
        import traceback

        traceback.print_exc()
        conn.send(("error", f"{role}: {type(exc).__name__}: {exc}"))
    finally:
        sys.stdout.flush()


def _bw_peer(role: str, conn: Any, cfg: dict[str, Any]) -> None:
    from kvserving.worker.kv.nixl_io import NixlIO, PageGeometry

    device = torch.device("cuda:0" if cfg["cuda"] else "cpu")
    max_pages = max(cfg["pages"])
    total = max_pages + 8
    out: dict[str, Any] = {}
    for fmt in cfg["formats"]:
        st = make_storage(fmt, total, tiny=not cfg["cuda"], device=device)
        geo = PageGeometry(st.layout.page_bytes, st.int2_layout.page_bytes if st.int2_layout else 0, st.total_bytes)
        if role == "source":
            fill_pattern(st.buffers)
        if cfg["cuda"]:
            torch.cuda.synchronize()
        io = NixlIO(f"bw-{role}-{fmt}-{os.getpid()}", st.buffers, geometry=geo)
        if role == "source":
            io.start_progress()
            conn.send(("meta", io.metadata(), io.addrs, io.device_id))
            msg = conn.recv()  # the reader is done with this format
            assert msg == "next", msg
        else:
            _, meta, addrs, dev = conn.recv()
            peer = io.add_remote(f"src-{fmt}", 0, meta, addrs=addrs, device_id=dev, geometry=geo)
            out[fmt] = bw_measure(io, peer, fmt, total, cfg, st)
            conn.send("next")
        io.close()
        del io, st
        if cfg["cuda"]:
            torch.cuda.empty_cache()
    if role == "reader":
        conn.send(("result", out))


def bw_measure(io: Any, peer: Any, fmt: str, total: int, cfg: dict[str, Any], st: Any) -> list[dict[str, Any]]:
    rng = random.Random(5)
    rows: list[dict[str, Any]] = []
    for n in cfg["pages"]:
        for scattered in (False, True):
            if scattered and n > cfg["scattered_max"]:
                continue
            prev = [r for r in rows if r["scattered"] == scattered]
            if prev and prev[-1]["median_s"] * n / prev[-1]["pages"] * 4 > cfg["max_read_s"]:
                rows.append({"pages": n, "scattered": scattered, "skipped": "predicted over max_read_s"})
                print(json.dumps({"fmt": fmt, **rows[-1]}), flush=True)
                continue
            local = page_ids(fmt, n, total=total, scattered=scattered, rng=rng)
            remote = page_ids(fmt, n, total=total, scattered=scattered, rng=rng)
            t0 = time.perf_counter()
            ldesc, _ = io.descriptors(peer, local, remote)
            desc_s = time.perf_counter() - t0
            reps = 10 if n <= 64 else 5 if n <= 1024 else 3
            first = io.read(peer, local, remote, timeout_s=60.0)
            times = [io.read(peer, local, remote, timeout_s=60.0).seconds for _ in range(reps)]
            ok = check_pages(st, local, remote, rng)
            med = statistics.median(times)
            rows.append(
                {
                    "pages": n,
                    "scattered": scattered,
                    "bytes": first.num_bytes,
                    "regions": first.num_regions,
                    "first_s": first.seconds,
                    "median_s": med,
                    "min_s": min(times),
                    "descriptor_build_s": desc_s,
                    "gb_per_s": first.num_bytes / med / 1e9,
                    "bytes_checked": ok,
                    "descs": len(ldesc),
                }
            )
            print(json.dumps({"fmt": fmt, **rows[-1]}), flush=True)
    return rows


def check_pages(st: Any, local: list[int], remote: list[int], rng: random.Random) -> bool:
    """A sample of the pages read hold exactly the source's bytes, in every layer."""
    from kvserving.worker.kv.nixl_io import PageGeometry

    geo = PageGeometry(st.layout.page_bytes, st.int2_layout.page_bytes if st.int2_layout else 0, st.total_bytes)
    buf = st.buffers
    total = buf.shape[1]
    for k in rng.sample(range(len(local)), min(8, len(local))):
        lo, n = geo.span(local[k])
        ro, _ = geo.span(remote[k])
        for layer in range(buf.shape[0]):
            idx = torch.arange(layer * total + ro, layer * total + ro + n, device=buf.device, dtype=torch.int64)
            if not torch.equal(buf[layer, lo : lo + n], pattern(idx)):
                return False
    return True


def run_bw(plan: Plan) -> None:
    cuda = not plan.tiny
    env = {"UCX_PROTO_INFO": "y"} if cuda else {}
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()  # the source's end, the reader's end
    base = {
        "formats": plan.formats,
        "pages": plan.bw_pages,
        "scattered_max": plan.scattered_max,
        "cuda": cuda,
        "env": env,
        "max_read_s": 15.0,
    }
    src = ctx.Process(target=bw_peer, args=("source", 1, a, {**base, "log": str(plan.work / "bw_source.log")}))
    rdr = ctx.Process(target=bw_peer, args=("reader", 0, b, {**base, "log": str(plan.work / "bw_reader.log")}))
    src.start()
    rdr.start()
    res: dict[str, Any] = {"error": None}
    try:
        res |= relay_bw(a, b, plan, src, rdr)
    finally:
        for p in (src, rdr):
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    res["transports"] = ucx_transports(plan.work / "bw_reader.log")
    res["transports_source"] = ucx_transports(plan.work / "bw_source.log")
    if cuda and res.get("nixl"):
        res["torch_p2p"] = torch_p2p(res["nixl"])
    plan.results["bw"] = res
    plan.save()


def relay_bw(a: Any, b: Any, plan: Plan, src: Any, rdr: Any) -> dict[str, Any]:
    """The two peers talk over one pipe (a: source end, b: reader end); this process only
    watches the deadline. The reader's result arrives on its end after the last format."""
    # Pipes are point to point: let the peers use (a, b) directly; we poll for the end.
    limit = time.monotonic() + min(plan.left() - 30, 150 if not plan.tiny else 120)
    while time.monotonic() < limit:
        if not rdr.is_alive() and not src.is_alive():
            break
        time.sleep(0.5)
    # the reader's final message went to the source's end (a), after the source finished reading
    result: dict[str, Any] = {}
    while a.poll(0.1):
        msg = a.recv()
        if isinstance(msg, tuple) and msg[0] == "result":
            result["nixl"] = msg[1]
        elif isinstance(msg, tuple) and msg[0] == "error":
            result["error"] = msg[1]
    while b.poll(0.1):
        msg = b.recv()
        if isinstance(msg, tuple) and msg[0] == "error":
            result["error"] = msg[1]
    if rdr.is_alive() or src.is_alive():
        result["error"] = (result.get("error") or "") + " bw phase hit its time limit"
    return result


def ucx_transports(path: Path) -> dict[str, Any]:
    """Transport names UCX printed (UCX_PROTO_INFO) and the protocol lines that name one."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {}
    lines = [ln.strip() for ln in text.splitlines() if any(t in ln for t in TRANSPORTS) and not ln.startswith("{")]
    counts = {t: sum(t in ln for ln in lines) for t in TRANSPORTS}
    return {"counts": {k: v for k, v in counts.items() if v}, "lines": lines[:40]}


def torch_p2p(nixl: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The same bytes as each contiguous NIXL READ, copied GPU1 -> GPU0 by torch in one process."""
    out: dict[str, Any] = {"can_access_peer": torch.cuda.can_device_access_peer(0, 1), "rows": []}
    for fmt, rows in nixl.items():
        for r in rows:
            if r["scattered"] or "skipped" in r:
                continue
            src = torch.empty(r["bytes"], dtype=torch.uint8, device="cuda:1")
            dst = torch.empty(r["bytes"], dtype=torch.uint8, device="cuda:0")
            times = []
            for i in range(8):
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(1)
                t0 = time.perf_counter()
                dst.copy_(src)
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(1)
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            out["rows"].append({"fmt": fmt, "pages": r["pages"], "bytes": r["bytes"], "median_s": med, "gb_per_s": r["bytes"] / med / 1e9})
            del src, dst
    torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------------- model
def build_model(plan: Plan) -> Path:
    out = plan.work / "model"
    if plan.tiny:
        from kvserving.tiny_model import build_tiny_model

        built = build_tiny_model(out)
        if plan.ctx > 4096 or plan.tiny_layers:  # RoPE: longer contexts need only the config to say so
            from safetensors.torch import save_file

            from kvserving.tiny_model import random_weights

            cfg = json.loads((built / "config.json").read_text())
            cfg |= {"max_position_embeddings": plan.ctx, "num_hidden_layers": plan.tiny_layers or cfg["num_hidden_layers"]}
            (built / "config.json").write_text(json.dumps(cfg, indent=1))
            save_file(random_weights(cfg), str(built / "model.safetensors"), metadata={"format": "pt"})
        return built
    from safetensors.torch import save_file

    import shutil

    from kvserving.config import ModelConfig
    from kvserving.model_dir import resolve_model_dir

    out.mkdir(parents=True, exist_ok=True)
    tiny = resolve_model_dir(ModelConfig())  # the built-in tiny model, built locally once (no download)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny / name, out / name)
    cfg = dict(QWEN3_8B, vocab_size=json.loads((tiny / "config.json").read_text())["vocab_size"])
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator(device="cuda:0").manual_seed(1234)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda:0", dtype=torch.bfloat16) * std).cpu()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    layers = cfg["num_hidden_layers"]
    shards = 4
    per = -(-layers // shards)
    for s in range(shards):
        w: dict[str, torch.Tensor] = {}
        if s == 0:
            w["model.embed_tokens.weight"] = normal(v, h, std=1.0)
            w["lm_head.weight"] = normal(v, h)
            w["model.norm.weight"] = ones(h)
        for i in range(s * per, min(layers, (s + 1) * per)):
            p = f"model.layers.{i}."
            w |= {
                p + "input_layernorm.weight": ones(h),
                p + "post_attention_layernorm.weight": ones(h),
                p + "self_attn.q_proj.weight": normal(q * d, h),
                p + "self_attn.k_proj.weight": normal(kv * d, h),
                p + "self_attn.v_proj.weight": normal(kv * d, h),
                p + "self_attn.o_proj.weight": normal(h, q * d),
                p + "self_attn.q_norm.weight": ones(d),
                p + "self_attn.k_norm.weight": ones(d),
                p + "mlp.gate_proj.weight": normal(inter, h),
                p + "mlp.up_proj.weight": normal(inter, h),
                p + "mlp.down_proj.weight": normal(h, inter),
            }
        save_file(w, str(out / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"), metadata={"format": "pt"})
        del w
    torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------- workers
@dataclass
class Worker:
    name: str
    role: str
    gpu: int
    url: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env, start_new_session=True
            )

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def make_worker(plan: Plan, model: Path, fmt: str, role: str, gpu: int) -> Worker:
    cfg = {
        "model": {"path": str(model), "served_name": "bench", "max_model_len": plan.ctx},
        "kv_cache": {"dtype": fmt, "memory_bytes": plan.pool_bytes_for(fmt)},
        "reuse": {"recompute_threshold_tokens": 64, "transfer_timeout_s": 5.0},
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 2048, "chunk_size": 2048},
    }
    # the pair are each other's peers (the only workers a worker contacts), on ports picked together
    ports = plan.pair_ports.setdefault(fmt, free_ports(2))
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    cfg["gateway"] = {"prefill_urls": urls[:1], "decode_urls": urls[1:]}
    cfg["security"] = {"internal_token_file": str(plan.token_path)}
    name = f"{role}-{fmt}"
    path = plan.work / f"{name}.json"
    path.write_text(json.dumps(cfg))
    port = ports[0] if role == "prefill" else ports[1]
    argv = [
        sys.executable,
        "-m",
        "kvserving.cli",
        "worker",
        "--role",
        role,
        "--config",
        str(path),
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--engine-id",
        f"{name}-{uuid.uuid4().hex[:6]}",
        "--log-level",
        "warning",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1" if plan.tiny else "4")
    if not plan.tiny:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        env["UCX_PROTO_INFO"] = "y"  # UCX prints the protocols (transports) it selects into the worker's log
    return Worker(name, role, gpu, f"http://127.0.0.1:{port}", argv, env, plan.work / f"{name}.log")


def make_gateway(plan: Plan, model: Path, fmt: str, prefill: Worker, decode: Worker) -> Worker:
    """``kvserving gateway`` in front of one pair, from the prefill worker's engine config (CPU only)."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "kvserving.cli",
        "gateway",
        "--config",
        str(plan.work / f"prefill-{fmt}.json"),
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prefill",
        prefill.url,
        "--decode",
        decode.url,
        "--log-level",
        "warning",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return Worker(f"gateway-{fmt}", "gateway", -1, f"http://127.0.0.1:{port}", argv, env, plan.work / f"gateway-{fmt}.log")


def wait_ready(client: Any, workers: list[Worker], deadline: float) -> dict[str, str]:
    """Worker name -> error for those not ready by ``deadline`` (or exited)."""
    pending = {w.name: w for w in workers}
    errors: dict[str, str] = {}
    while pending and time.monotonic() < deadline:
        for name, w in list(pending.items()):
            if w.proc is not None and w.proc.poll() is not None:
                errors[name] = f"exited {w.proc.returncode}: {w.tail()}"
                del pending[name]
                continue
            try:
                if client.get(w.url + "/ready", timeout=2).status_code == 200:
                    del pending[name]
            except Exception:  # noqa: BLE001 - not listening yet
                pass
        time.sleep(0.3)
    for name, w in pending.items():
        errors[name] = f"not ready in time: {w.tail()}"
    return errors


@dataclass
class Gen:
    tokens: list[int]
    final: dict[str, Any]
    t0: float
    first: float
    end: float


def generate(
    client: Any,
    url: str,
    ids: list[int],
    *,
    max_tokens: int,
    params: dict[str, Any] | None = None,
    key: str | None = None,
    retain: bool = False,
    output_ids: list[int] | None = None,
    tags: list[int] | None = None,
) -> Gen:
    body = {
        "request_id": uuid.uuid4().hex,
        "input_ids": ids,
        "sampling": {"max_tokens": max_tokens, "ignore_eos": True},
        "kv_transfer_params": params,
        "conversation_key": key,
        "retain": retain,
    }
    if tags is not None:
        body["tags"] = tags
    if output_ids:
        body["output_ids"] = output_ids
    t0 = time.perf_counter()
    first = 0.0
    tokens: list[int] = []
    final: dict[str, Any] = {}
    with client.stream("POST", url + "/internal/generate", json=body, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line or line.startswith(":"):  # a blank separator or a keep-alive comment
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                raise RuntimeError(f"{url}: {ev['error']}")
            if ev["token_ids"] and not first:
                first = time.perf_counter()
            tokens.extend(ev["token_ids"])
            if "finish_reason" in ev:
                final = ev
    return Gen(tokens, final, t0, first, time.perf_counter())


def sender_calls(client: Any, w: Worker, params: dict[str, Any] | None, n: int = 8) -> dict[str, Any]:
    """Round trips a puller makes to the worker it pulls from, timed from here against ``w``'s lease
    ``params`` (ms, min and median of ``n``): the agent fetch, the lease listing and the renewal
    (the pull's checks before this change), and the hold + its release (the one check now; a
    worker without the route answers 404)."""
    if not params:
        return {}
    url, lid = w.url, params["lease_id"]
    try:
        from kvserving.worker.kv.leases import lease_digest

        digest = lease_digest(params["page_ids"], params["page_hashes"], params["num_tokens"])
    except ImportError:  # a worker from before holds (bench A/B runs): it has no hold route either
        digest = "0" * 32
    calls = {
        "agent": lambda: client.get(f"{url}/internal/kv/agent", timeout=10),
        "leases": lambda: client.get(f"{url}/internal/kv/leases", timeout=10),
        "renew": lambda: client.post(f"{url}/internal/kv/leases/{lid}/renew", json={}, timeout=10),
        "hold": lambda: client.post(f"{url}/internal/kv/leases/{lid}/hold", json={"digest": digest, "hold_s": 5.0}, timeout=10),
    }
    out: dict[str, Any] = {"pages": len(params["page_ids"])}
    for name, call in calls.items():
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            r = call()
            times.append((time.perf_counter() - t0) * 1e3)
            if name == "hold" and r.status_code == 200:
                client.delete(f"{url}/internal/kv/leases/{r.json()['hold_id']}", timeout=10)
            elif name == "hold":
                out["hold_status"] = r.status_code
        out[name] = {"min": min(times), "median": statistics.median(times), "bytes": len(r.content)}
    return out


def xfer_seconds(client: Any, w: Worker) -> float:
    return float(client.get(w.url + "/internal/kv/stats", timeout=10).json()["transfer"]["transfer_seconds"])


def release_all(client: Any, *workers: Worker) -> None:
    for w in workers:
        for lease in client.get(w.url + "/internal/kv/leases", timeout=10).json()["leases"]:
            client.delete(f"{w.url}/internal/kv/leases/{lease['lease_id']}", timeout=10)


# ---------------------------------------------------------------------------------- seed
def rand_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def gateway_turn(client: Any, url: str, ids: list[int], *, key: str, max_tokens: int) -> dict[str, Any]:
    """One streamed /v1/completions turn through the gateway (token-id prompt, prompt_cache_key
    as the conversation): client-side TTFT (first text chunk) and the usage it reports."""
    body = {
        "model": "bench",
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "prompt_cache_key": key,
    }
    t0 = time.perf_counter()
    first = 0.0
    usage: dict[str, Any] = {}
    with client.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"gateway: {r.status_code} {r.read().decode()[:300]}")
        for line in r.iter_lines():
            data = line.removeprefix("data: ") if line else ""
            if not data or data == "[DONE]":
                continue
            ev = json.loads(data)
            if "error" in ev:
                raise RuntimeError(f"gateway: {ev['error']}")
            if ev.get("choices") and not first:
                first = time.perf_counter()
            usage = ev.get("usage") or usage
    return {"ttft_ms": (first - t0) * 1e3, "total_ms": (time.perf_counter() - t0) * 1e3, "usage": usage}


# Tags of an agent's history as the gateway's tagger gives them: per 1024 tokens, 352 of
# older-turn user text and 672 of older-turn tool results (obs). At bit budget 2.7 the
# default table stores older obs at 2 bits and older user text at 4 (kvserving.bits), and
# both runs are whole 32-token pages: 65.6% of the history's pages INT2 (triaxial's 2.7-bit
# mix; the other formats ignore tags). The reply is last turn's assistant text and the new
# message current user text, both 4-bit.
OLDER_USER, OLDER_OBS = encode_tag("older", "text", "user"), encode_tag("older", "text", "obs")
REPLY_TAG, NEW_TAG = encode_tag("turn_m1", "text", "assistant"), encode_tag("current", "text", "user")


def history_tags(n: int) -> list[int]:
    return [OLDER_USER if i % 1024 < 352 else OLDER_OBS for i in range(n)]


def one_length(
    client: Any, p: Worker, d: Worker, L: int, plan: Plan, rng: random.Random, vocab: int, gateway: str | None = None
) -> dict[str, Any]:
    """Setup, new-only, on and off for prompt length ``L`` (see the module docstring)."""
    key = uuid.uuid4().hex
    hist = rand_ids(rng, L - plan.new - plan.gen, vocab)
    setup = generate(client, d.url, hist, max_tokens=plan.gen, key=key, retain=True, tags=history_tags(len(hist)))
    held = hist + setup.tokens
    tags = history_tags(len(hist)) + [REPLY_TAG] * len(setup.tokens) + [NEW_TAG] * plan.new
    d_params = setup.final["kv_transfer_params"]
    # new-only: the decode worker holds the history and computes the new tokens itself
    x_base = held + rand_ids(rng, plan.new, vocab)
    base = generate(client, d.url, x_base, max_tokens=1, tags=tags)
    # on: D->P pull, compute the new tokens, P->D pull of what D lacks, first token
    x_on = held + rand_ids(rng, plan.new, vocab)
    sp0, sd0 = xfer_seconds(client, p), xfer_seconds(client, d)
    # The prefill samples the first token (TTFT); the decode continues after it (output_ids)
    pon = generate(client, p.url, x_on, max_tokens=1, params=d_params, key=key, tags=tags)
    don = generate(client, d.url, x_on, max_tokens=2, params=pon.final["kv_transfer_params"], key=key, output_ids=pon.tokens, tags=tags)
    sp1, sd1 = xfer_seconds(client, p), xfer_seconds(client, d)
    rtt = sender_calls(client, d, d_params)  # the history's lease (still held: "on" did not retain on D)
    # new-only on P: the same prefill worker, now holding the history it pulled in its own prefix
    # cache, computes a fresh new message: the floor on the same process, device and pages
    # (new-only above runs on the decode worker, right after it computed the history)
    x_pl = held + rand_ids(rng, plan.new, vocab)
    pl = generate(client, p.url, x_pl, max_tokens=1, tags=tags)
    # off: a prompt nobody has seen: P computes all, D pulls all
    x_off = rand_ids(rng, L, vocab)
    if "off" in plan.skip:  # (CPU phase runs: computing L tokens twice would take minutes)
        poff = doff = Gen([], {"usage": {}}, 0.0, float("nan"), float("nan"))
    else:
        poff = generate(client, p.url, x_off, max_tokens=1, tags=tags)
        doff = generate(client, d.url, x_off, max_tokens=2, params=poff.final["kv_transfer_params"], output_ids=poff.tokens, tags=tags)
    sp2, sd2 = xfer_seconds(client, p), xfer_seconds(client, d)
    release_all(client, p, d)
    pu, du = pon.final["usage"], don.final["usage"]
    row = {
        "L": L,
        "setup_ms": (setup.end - setup.t0) * 1e3,
        "new_only_ms": (base.first - base.t0) * 1e3,
        "new_only_usage": base.final["usage"],
        "new_only_p_ms": (pl.first - pl.t0) * 1e3,
        "new_only_p_usage": pl.final["usage"],
        "sender_calls_ms": rtt,
        "new_only_timings": base.final.get("timings"),
        "new_only_p_timings": pl.final.get("timings"),
        "on_p_timings": pon.final.get("timings"),
        "on_d_timings": don.final.get("timings"),
        "on_ms": (pon.first - pon.t0) * 1e3,
        "on_second_ms": (don.first - pon.t0) * 1e3,
        "on_p_ms": (pon.end - pon.t0) * 1e3,
        "on_p_pull_ms": (sp1 - sp0) * 1e3,
        "on_d_ms": (don.first - don.t0) * 1e3,
        "on_d_pull_ms": (sd1 - sd0) * 1e3,
        "on_p_usage": pu,
        "on_d_usage": du,
        "off_ms": (poff.first - poff.t0) * 1e3,
        "off_second_ms": (doff.first - poff.t0) * 1e3,
        "off_p_ms": (poff.end - poff.t0) * 1e3,
        "off_p_pull_ms": (sp2 - sp1) * 1e3,
        "off_d_ms": (doff.first - doff.t0) * 1e3,
        "off_d_pull_ms": (sd2 - sd1) * 1e3,
        "off_p_usage": poff.final["usage"],
        "off_d_usage": doff.final["usage"],
    }
    if gateway is not None and "gw" not in plan.skip:
        # the same "on" turn through the gateway: the decode holds the history under the
        # conversation key the gateway derives from prompt_cache_key; the gateway finds the
        # lease by asking the decode worker (a lease-table miss), routes, relays
        gkey = uuid.uuid4().hex
        # tagged as the gateway tags a prompt given as token ids (current user text: 4-bit), so
        # that the turn's own tags want no page at a higher precision than the decode stored
        gsetup = generate(client, d.url, hist, max_tokens=plan.gen, key=f"cache:{gkey}", retain=True, tags=[NEW_TAG] * len(hist))
        x_gw = hist + gsetup.tokens + rand_ids(rng, plan.new, vocab)
        row["gw_on"] = gateway_turn(client, gateway, x_gw, key=gkey, max_tokens=plan.gen)
        release_all(client, p, d)
    return row


def run_seed(plan: Plan, client: Any, model: Path) -> dict[str, tuple[Worker, Worker]]:
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    pairs = {f: (make_worker(plan, model, f, "prefill", 0), make_worker(plan, model, f, "decode", 1)) for f in plan.formats}
    gateways = {f: make_gateway(plan, model, f, pw, dw) for f, (pw, dw) in pairs.items()}
    plan.gateways = list(gateways.values())
    t0 = time.monotonic()
    for pw, dw in pairs.values():
        pw.start()
        dw.start()
    for gw in gateways.values():
        gw.start()
    everyone = [w for pair in pairs.values() for w in pair] + list(gateways.values())
    errors = wait_ready(client, everyone, time.monotonic() + min(600, plan.left() - 60))  # workers warm up before /ready
    seed: dict[str, Any] = {"start_s": time.monotonic() - t0, "errors": errors, "formats": {}}
    plan.results["seed"] = seed
    plan.save()
    log(f"workers up in {seed['start_s']:.1f} s; errors: {list(errors)}")
    for fmt, (pw, dw) in pairs.items():
        if pw.name in errors or dw.name in errors:
            continue
        gw_url = gateways[fmt].url if gateways[fmt].name not in errors else None
        if plan.left() < (60 if not plan.tiny else 20):
            seed["formats"][fmt] = {"skipped": "time budget"}
            continue
        res: dict[str, Any] = {"rows": [], "warm_ms": None}
        seed["formats"][fmt] = res
        rng = random.Random(17)
        try:
            w0 = time.monotonic()
            warm = {min(plan.lengths)} if plan.tiny else {min(plan.lengths), max(plan.lengths)}
            for L in sorted(warm):  # compile kernels, connect NIXL both ways
                one_length(client, pw, dw, L, plan, rng, vocab, gw_url)
            res["warm_ms"] = (time.monotonic() - w0) * 1e3
            for L in plan.lengths:
                for _ in range(plan.reps):
                    if plan.left() < (45 if not plan.tiny else 10):
                        res["cut_short"] = f"time budget at L={L}"
                        break
                    res["rows"].append(one_length(client, pw, dw, L, plan, rng, vocab, gw_url))
                    plan.save()
        except Exception as exc:  # noqa: BLE001 - keep the other formats
            res["error"] = f"{type(exc).__name__}: {exc}"
            log(f"{fmt}: {res['error']}\n{pw.tail()}\n{dw.tail()}")
        try:
            res["prefill_stats"] = client.get(pw.url + "/internal/kv/stats", timeout=10).json()
            res["decode_stats"] = client.get(dw.url + "/internal/kv/stats", timeout=10).json()
        except Exception as exc:  # noqa: BLE001
            res["stats_error"] = str(exc)
        res["transports"] = {w.name: ucx_transports(w.log_path).get("counts") for w in (pw, dw)}
        plan.save()
        print_seed_table(fmt, res)
    return pairs


def best_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per length, each mode's fastest rep (its own row's split with it)."""
    out = []
    for L in sorted({r["L"] for r in rows}):
        rs = [r for r in rows if r["L"] == L]
        on = min(rs, key=lambda r: r["on_ms"])
        off = min(rs, key=lambda r: r["off_ms"])
        base = min(rs, key=lambda r: r["new_only_ms"])
        out.append({"L": L, "on": on, "off": off, "base": base})
    return out


def print_seed_table(fmt: str, res: dict[str, Any]) -> None:
    print(f"\n# seed experiment, kv {fmt}: TTFT ms (fastest of reps), prefill split, bytes per reused token")
    head = [
        "L",
        "off",
        "on",
        "new-only",
        "on/new",
        "off/on",
        "gw on",
        "gw/new",
        "gw cached",
        "2nd token on",
        "P on",
        "P pull on",
        "P rest on",
        "D on",
        "D pull on",
        "P off",
        "D off",
        "D pull off",
        "pulled D->P",
        "MiB D->P",
        "B/token",
        "regions D->P",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for b in best_rows(res.get("rows", [])):
        on, off, base = b["on"], b["off"], b["base"]
        pu = on["on_p_usage"]
        pulled = pu["remote_pulled_tokens"]
        gws = [r["gw_on"] for r in res.get("rows", []) if r["L"] == b["L"] and "gw_on" in r]
        gw = min(gws, key=lambda g: g["ttft_ms"]) if gws else None
        gw_cells = (
            [
                f"{gw['ttft_ms']:.1f}",
                f"{gw['ttft_ms'] / base['new_only_ms']:.2f}",
                (gw["usage"].get("prompt_tokens_details") or {}).get("cached_tokens"),
            ]
            if gw
            else ["", "", ""]
        )
        row = [
            b["L"],
            f"{off['off_ms']:.1f}",
            f"{on['on_ms']:.1f}",
            f"{base['new_only_ms']:.1f}",
            f"{on['on_ms'] / base['new_only_ms']:.2f}",
            f"{off['off_ms'] / on['on_ms']:.2f}",
            *gw_cells,
            f"{on.get('on_second_ms', float('nan')):.1f}",
            f"{on['on_p_ms']:.1f}",
            f"{on['on_p_pull_ms']:.1f}",
            f"{on['on_p_ms'] - on['on_p_pull_ms']:.1f}",
            f"{on['on_d_ms']:.1f}",
            f"{on['on_d_pull_ms']:.1f}",
            f"{off['off_p_ms']:.1f}",
            f"{off['off_d_ms']:.1f}",
            f"{off['off_d_pull_ms']:.1f}",
            pulled,
            f"{pu['kv_bytes_pulled'] / 2**20:.1f}",
            f"{pu['kv_bytes_pulled'] / max(1, pulled):.0f}",
            pu["kv_regions_pulled"],
        ]
        print("| " + " | ".join(str(c) for c in row) + " |")
    if res.get("error") or res.get("cut_short"):
        print(f"({res.get('error') or res.get('cut_short')})")
    print_phase_table(fmt, res)
    xf = (res.get("prefill_stats") or {}).get("transfer") or {}
    print(
        f"prefill worker measured: {xf.get('prefill_tokens_per_s')} prefill tokens/s, {xf.get('transfer_bytes_per_s')} "
        f"READ bytes/s; UCX transports in the worker logs: {res.get('transports')}"
    )


# The prefill worker's own split of an "on" request, from admission to its first token (the final
# event's ``timings``, worker/service.py): the pull's phases (``kv/puller.py`` PULL_PHASES; older
# workers named theirs agent / lease_check / alloc / lease_recheck), then queueing, the wait for the
# engine step and that step. "HTTP+parse" is the client's TTFT minus the worker's admit-to-token.
PHASE_ORDER = (
    "pull_plan",
    "pull_agent",
    "pull_lease_check",
    "pull_alloc",
    "pull_descriptors",
    "pull_read",
    "pull_lease_recheck",
    "pull_adopt",
    "pull_release",
    "pull_contact_agent",
    "pull_contact_hold",
    "queue",
    "wait_step",
)


def print_phase_table(fmt: str, res: dict[str, Any]) -> None:
    """Per length: TTFTs (fastest rep) and each phase's median and minimum over the reps (ms; on a
    loaded machine the minimum is the closer estimate of a phase's own cost)."""
    rows = [r for r in res.get("rows", []) if r.get("on_p_timings")]
    if not rows:
        return
    keys = [k for k in PHASE_ORDER if any(k in r["on_p_timings"] for r in rows)]
    print(
        f"\n# kv {fmt}: where the prefill worker's time goes on 'on', ms (TTFTs: fastest rep; phases: median, then "
        f"minimum, of {max(Counter(r['L'] for r in rows).values())} reps; new-only P: the same prefill worker with the "
        "history in its own cache)"
    )
    head = [
        "L",
        "stat",
        "on TTFT",
        "new-only P",
        "new-only D",
        "on/newP",
        "HTTP+parse",
        "pull total",
        *(k.removeprefix("pull_") for k in keys),
        "first_step",
        "newP: queue",
        "newP: wait_step",
        "newP: first_step",
        "regions",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for L, stat in ((L, stat) for L in sorted({r["L"] for r in rows}) for stat in ("median", "min")):
        rs = [r for r in rows if r["L"] == L]

        def med(get: Any) -> float:
            vals = [v for v in (get(r) for r in rs) if v is not None]
            return (statistics.median(vals) if stat == "median" else min(vals)) if vals else float("nan")

        on = min(r["on_ms"] for r in rs)
        newp = min(r.get("new_only_p_ms", float("inf")) for r in rs)
        cells = [
            L,
            stat,
            f"{on:.1f}",
            f"{newp:.1f}",
            f"{min(r['new_only_ms'] for r in rs):.1f}",
            f"{on / newp:.2f}",
            f"{med(lambda r: r['on_ms'] - r['on_p_timings']['admit_to_first_token']):.1f}",
            f"{med(lambda r: r['on_p_timings'].get('pull')):.2f}",
            *(f"{med(lambda r, k=k: r['on_p_timings'].get(k, 0.0)):.2f}" for k in keys),
            f"{med(lambda r: r['on_p_timings'].get('first_step')):.1f}",
            *(f"{med(lambda r, k=k: (r.get('new_only_p_timings') or {}).get(k)):.2f}" for k in ("queue", "wait_step")),
            f"{med(lambda r: (r.get('new_only_p_timings') or {}).get('first_step')):.1f}",
            "/".join(str(r["on_p_usage"]["kv_regions_pulled"]) for r in rs),
        ]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    calls = [r["sender_calls_ms"] for r in rows if r.get("sender_calls_ms")]
    if calls:
        print(
            f"\n# kv {fmt}: one round trip to the decode worker, from the bench client, ms (min / median of 8, "
            "fastest rep), against the conversation's lease"
        )
        print("| L | lease pages | GET agent | GET leases | POST renew | POST hold (+ DELETE after) | bytes agent/leases/renew/hold |")
        print("|---|---|---|---|---|---|---|")
        for L in sorted({r["L"] for r in rows}):
            cs = [r["sender_calls_ms"] for r in rows if r["L"] == L and r.get("sender_calls_ms")]
            if not cs:
                continue

            def cell(name: str) -> str:
                best = min((c[name] for c in cs), key=lambda x: x["min"])
                return f"{best['min']:.2f} / {best['median']:.2f}"

            hold = cell("hold") if not cs[0].get("hold_status") else f"({cs[0]['hold_status']}: no route)"
            sizes = "/".join(str(cs[0][k]["bytes"]) for k in ("agent", "leases", "renew", "hold"))
            print(f"| {L} | {cs[0]['pages']} | {cell('agent')} | {cell('leases')} | {cell('renew')} | {hold} | {sizes} |")


# -------------------------------------------------------------------------------- faults
def run_faults(plan: Plan, client: Any, pw: Worker, dw: Worker, model: Path) -> None:
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(23)
    L = plan.lengths[len(plan.lengths) // 2]
    n_tok = 8
    out: dict[str, Any] = {"L": L}
    plan.results["faults"] = out

    def conversation() -> tuple[list[int], dict[str, Any]]:
        hist = rand_ids(rng, L - plan.new - plan.gen, vocab)
        s = generate(client, dw.url, hist, max_tokens=plan.gen, key=uuid.uuid4().hex, retain=True)
        return hist + s.tokens + rand_ids(rng, plan.new, vocab), s.final["kv_transfer_params"]

    # 1. decode frozen while the prefill worker pulls: its lease check / READ times out
    x, params = conversation()
    dw.signal(signal.SIGSTOP)
    try:
        g = generate(client, pw.url, x, max_tokens=n_tok, params=params)
    finally:
        dw.signal(signal.SIGCONT)
    ref = generate(client, dw.url, x, max_tokens=n_tok)
    out["frozen"] = {
        "usage": g.final["usage"],
        "ttft_ms": (g.first - g.t0) * 1e3,
        "tokens": g.tokens,
        "ref_tokens": ref.tokens,
        "same_tokens": g.tokens == ref.tokens,
        "ref_usage": ref.final["usage"],
    }
    plan.save()
    # 2. decode killed between turns; restarted, it computes the same prompt from scratch
    x, params = conversation()
    dw.kill()
    g = generate(client, pw.url, x, max_tokens=n_tok, params=params)
    dw.start()
    errs = wait_ready(client, [dw], time.monotonic() + min(600, plan.left() - 10))
    rec: dict[str, Any] = {"usage": g.final["usage"], "ttft_ms": (g.first - g.t0) * 1e3, "tokens": g.tokens, "restart_errors": errs}
    if not errs:
        ref = generate(client, dw.url, x, max_tokens=n_tok)
        rec |= {"ref_tokens": ref.tokens, "same_tokens": g.tokens == ref.tokens, "ref_usage": ref.final["usage"]}
    out["killed"] = rec
    out["prefill_fallbacks"] = client.get(pw.url + "/internal/kv/stats", timeout=10).json()["fallbacks"]
    plan.save()
    for name in ("frozen", "killed"):
        r = out[name]
        print(
            f"fault {name}: fallback {r['usage']['reuse_fallback']}, computed {r['usage']['computed_prompt_tokens']}"
            f"/{r['usage']['prompt_tokens']}, TTFT {r['ttft_ms']:.0f} ms, same tokens as the decode worker's own run: "
            f"{r.get('same_tokens')}"
        )


# ---------------------------------------------------------------------------------- main
def print_bw_table(bw: dict[str, Any]) -> None:
    print("\n# NIXL READ between two worker-layout pools (one process per device) vs torch peer-to-peer")
    print(f"transports (UCX_PROTO_INFO lines, reader): {bw.get('transports', {}).get('counts')}; error: {bw.get('error')}")
    p2p = {(r["fmt"], r["pages"]): r for r in (bw.get("torch_p2p") or {}).get("rows", [])}
    head = [
        "format",
        "pages",
        "MiB",
        "layout",
        "regions",
        "NIXL GB/s",
        "first ms",
        "median ms",
        "descr ms",
        "p2p GB/s",
        "NIXL/p2p",
        "bytes ok",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for fmt, rows in (bw.get("nixl") or {}).items():
        for r in rows:
            if "skipped" in r:
                print(f"| {fmt} | {r['pages']} | | {'scattered' if r['scattered'] else 'contiguous'} | skipped: {r['skipped']} |")
                continue
            t = p2p.get((fmt, r["pages"])) if not r["scattered"] else None
            row = [
                fmt,
                r["pages"],
                f"{r['bytes'] / 2**20:.2f}",
                "scattered" if r["scattered"] else "contiguous",
                r["regions"],
                f"{r['gb_per_s']:.1f}",
                f"{r['first_s'] * 1e3:.2f}",
                f"{r['median_s'] * 1e3:.3f}",
                f"{r['descriptor_build_s'] * 1e3:.2f}",
                f"{t['gb_per_s']:.1f}" if t else "",
                f"{r['gb_per_s'] / t['gb_per_s']:.2f}" if t else "",
                r["bytes_checked"],
            ]
            print("| " + " | ".join(str(c) for c in row) + " |")


# a phase's keys in the result (``ucx_transport``: the transports UCX chose, noted beside a bw run)
PHASE_KEYS = {"bw": ("bw", "ucx_transport"), "seed": ("seed",), "faults": ("faults", "faults_error")}
PART_KEYS = ("what", "machine", "runs", "setup", "elapsed_s")


def combine(files: list[Path], out: Path) -> dict[str, Any]:
    """One result from runs of some phases each: every phase from the last file holding it; each
    file's header (setup, machine, notes) kept in ``parts``, ``phases`` says which part each phase
    came from, ``setup`` is the seed phase's."""
    doc: dict[str, Any] = {"what": "bench/pd_gpu.py: each phase from the run named in phases", "parts": [], "phases": {}}
    for path in files:
        run = json.loads(path.read_text())
        inner = run.get("parts") or [{k: run[k] for k in PART_KEYS if k in run} | {"file": path.name}]
        offset = len(doc["parts"])
        doc["parts"] += inner
        held = run.get("phases") or {phase: 0 for phase in PHASE_KEYS if phase in run}
        for phase, index in held.items():
            for key in PHASE_KEYS[phase]:
                doc.pop(key, None)
                if key in run:
                    doc[key] = run[key]
            doc["phases"][phase] = offset + index
    if "seed" in doc["phases"]:
        doc["setup"] = doc["parts"][doc["phases"]["seed"]].get("setup")
    out.write_text(jsonfmt.dumps(doc))
    return doc


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="pd_gpu.json and logs.tgz go here (with --combine: the result file)")
    ap.add_argument(
        "--combine", type=Path, nargs="+", default=None, metavar="FILE", help="join these results phase by phase into --out, and exit"
    )
    ap.add_argument("--work", type=Path, default=None, help="model, configs and logs (default: OUT/work)")
    ap.add_argument("--tiny", action="store_true", help="CPU: tiny model, CPU memory, small sizes")
    ap.add_argument(
        "--like-gpu",
        action="store_true",
        help="with --tiny: the GPU run's lengths (2K-24K), new/gen tokens and pool page counts (tiny model at 32K context)",
    )
    ap.add_argument("--phases", default="bw,seed,faults", help="comma-separated, of bw, seed, faults")
    ap.add_argument("--skip", default="", help="seed modes to leave out: off, gw (CPU runs of the pull's phases)")
    ap.add_argument("--tiny-layers", type=int, default=0, help="with --tiny: layers of the tiny model (default 4)")
    ap.add_argument("--formats", default=",".join(FORMATS), help="KV formats, in order of priority")
    ap.add_argument("--lengths", default="", help="prompt lengths (default 2K..24K; tiny 512..2K)")
    ap.add_argument("--new", type=int, default=0, help="new user tokens per turn (default 1024; tiny 128)")
    ap.add_argument("--gen", type=int, default=0, help="reply tokens the decode worker generated (default 16; tiny 4)")
    ap.add_argument("--reps", type=int, default=2, help="repetitions per length (fastest kept)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop starting work after this many seconds")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.combine:
        doc = combine(args.combine, args.out)
        print(f"wrote {args.out}: " + ", ".join(f"{phase} from {doc['parts'][i]['file']}" for phase, i in doc["phases"].items()))
        return 0
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    tiny = args.tiny
    small = tiny and not args.like_gpu
    lengths = [int(x) for x in args.lengths.split(",") if x] or (
        [512, 1024, 2048] if small else [2048, 8192, 24576] if tiny else [2048, 4096, 8192, 12288, 16384, 20480, 24576]
    )
    plan = Plan(
        tiny=tiny,
        out=args.out,
        work=work,
        formats=[f for f in args.formats.split(",") if f],
        lengths=lengths,
        new=args.new or (128 if small else 1024),
        gen=args.gen or (4 if small else 16),
        reps=args.reps,
        bw_pages=[1, 64, 256] if tiny else [1, 64, 1024, 16384],
        scattered_max=256 if tiny else 1024,
        pool_bytes=(48 << 20) if small else (8 << 30),
        deadline=start + args.budget_s,
        results={},
        ctx=4096 if small else 32768,
        like_gpu=bool(args.like_gpu),
        tiny_layers=args.tiny_layers,
        skip=frozenset(x for x in args.skip.split(",") if x),
    )
    phases = set(args.phases.split(","))
    plan.results["setup"] = {
        "tiny": tiny,
        "formats": plan.formats,
        "lengths": lengths,
        "new": plan.new,
        "gen": plan.gen,
        "reps": plan.reps,
        "model": "tiny"
        if tiny
        else {
            k: QWEN3_8B[k]
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "vocab_size",
                "max_position_embeddings",
            )
        },
        "torch": torch.__version__,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    plan.save()
    import httpx

    pairs: dict[str, tuple[Worker, Worker]] = {}
    try:
        if "bw" in phases:
            log("bw phase")
            run_bw(plan)
            print_bw_table(plan.results["bw"])
        if "seed" in phases or "faults" in phases:
            from kvserving.worker.kv.nixl_io import import_nixl

            plan.results["setup"]["nixl"] = import_nixl().__name__  # workers need it: fail before building the model
            log(f"building the model ({plan.left():.0f} s left)")
            t0 = time.monotonic()
            model = build_model(plan)
            plan.results["setup"]["model_build_s"] = time.monotonic() - t0
            log(f"model built in {time.monotonic() - t0:.1f} s")
            with httpx.Client(headers=plan.internal_headers) as client:
                pairs = run_seed(plan, client, model)
                if "faults" in phases and "bf16" in pairs and plan.left() > (90 if not tiny else 20):
                    pw, dw = pairs["bf16"]
                    if pw.name not in plan.results["seed"]["errors"] and dw.name not in plan.results["seed"]["errors"]:
                        log("faults phase")
                        try:
                            run_faults(plan, client, pw, dw, model)
                        except Exception as exc:  # noqa: BLE001
                            plan.results["faults_error"] = f"{type(exc).__name__}: {exc}"
                            log(plan.results["faults_error"])
                elif "faults" in phases:
                    plan.results["faults"] = {"skipped": "time budget or no bf16 pair"}
    finally:
        for w in [w for pair in pairs.values() for w in pair] + plan.gateways:
            w.kill()
        plan.results["elapsed_s"] = time.monotonic() - start
        plan.save()
        with tarfile.open(args.out / "logs.tgz", "w:gz") as tar:
            for f in sorted(work.glob("*.log")):
                tar.add(f, arcname=f.name)
    if "bw" in plan.results:
        print_bw_table(plan.results["bw"])
    for fmt, res in (plan.results.get("seed") or {}).get("formats", {}).items():
        print_seed_table(fmt, res)
    log(f"done in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
