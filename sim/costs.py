"""Per-operation costs of the cluster simulator (``kvserving simulate``): a
self-checking dataclass loaded from JSON, and the built-in profiles with where
each number was measured.

Every cost is a small formula over what the simulator knows of an operation::

    prefill step   prefill_step_s + prefill_token_s * T + attn_s(dtype) * sum(n_i * ctx_i)
                   (T tokens in the step; chunk i has n_i tokens over a mean context ctx_i;
                   attn_s is prefill_attn_dtype_s[dtype], else prefill_attn_s)
    decode step    decode_step_s + decode_seq_s * B + decode_ctx_s[dtype] * sum(ctx)   (B sequences)
                   (a step with prompt chunks and decodes costs both: on a GPU only a step of decodes
                   alone replays a CUDA graph; prefill_step_s is the eager step's host overhead)
    KV pull        transfer_overhead_s + regions * transfer_region_s + bytes / transfer_bytes_per_s
                   (regions = layers * transfer_runs: NIXL merges adjacent pages, DESIGN.md Worker;
                   page_major, kv_cache.layout's: transfer_runs, a run of pages one region for every layer)
                   on a GPU shared by both roles the copy (regions and bytes, ``copy_s``) is GPU work of the
                   receiver's process and the fixed part its post (kvserving.sim.shared_gpu)
    shared GPU     a prefill and a decode worker on one GPU run their steps at shared_gpu_prefill_share /
                   shared_gpu_decode_share of their speed while both run one (time-slicing, measured)
    a turn         gateway_s (tagging, routing) + prefill_request_s and decode_request_s
                   (HTTP and per-request work outside the engine loop) on top of queueing and steps

KV bytes per token come from the real format arithmetic (``kvserving.kernels.capacity``);
``fp32_unquantized`` says the unquantized format stores fp32 (the CPU engine runs the
model in fp32, ``worker/kv/storage.py``).

Token counts: the agent generator's lengths are nominal (words); the server's tokenizer
and chat template add to them. ``prompt_token_scale`` / ``prompt_token_offset`` map a
nominal prompt length to the server's, and ``reply_lost_tokens`` is how many tokens
at the end of a reply the next prompt does not reproduce (the template closes the
message differently than the model stopped), measured with the real template.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kvserving.config import DEFAULT_PAGE_SIZE, KV_DTYPES
from kvserving.kernels.capacity import bytes_per_token, frac_int2_for_budget

DTYPE_ALIASES = {"fp8": "fp8_e4m3", "int4": "triaxial"}


def canonical_dtype(name: str) -> str:
    """``fp8`` -> ``fp8_e4m3``; ValueError for an unknown format."""
    dtype = DTYPE_ALIASES.get(name, name)
    if dtype not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {name!r}; expected one of {', '.join(KV_DTYPES)} (or fp8)")
    return dtype


@dataclass(slots=True, frozen=True)
class CostModel:
    """What one prefill/decode worker costs (see the module docstring for the formulas)."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    kv_bytes_per_worker: int
    prefill_token_s: float
    prefill_attn_s: float
    decode_step_s: float
    decode_ctx_s: dict[str, float]
    prefill_step_s: float = 0.0
    prefill_attn_dtype_s: dict[str, float] = field(default_factory=dict)  # per format; else prefill_attn_s
    decode_seq_s: float = 0.0
    fp32_unquantized: bool = False
    transfer_region_s: float = 7.2e-6
    transfer_bytes_per_s: float = 330e9
    transfer_overhead_s: float = 0.0
    transfer_runs: int = 1
    page_major: bool = False  # the workers' kv_cache.layout is page_major (regions_per_pull)
    gateway_s: float = 0.0
    prefill_request_s: float = 0.0
    decode_request_s: float = 0.0
    prompt_token_scale: float = 1.0
    prompt_token_offset: float = 0.0
    reply_lost_tokens: int = 0
    triaxial_bit_budget: float = 2.7
    triaxial_int2_share: float | None = None  # share of pages stored INT2; None: what the bit budget gives
    # two workers' processes time-slicing one GPU: the rate each gets while both run (kvserving.sim.shared_gpu)
    shared_gpu_prefill_share: float = 0.5
    shared_gpu_decode_share: float = 0.5
    source: str = ""
    notes: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("costs.name must not be empty")
        for key in ("layers", "kv_heads", "head_dim", "kv_bytes_per_worker", "transfer_runs"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"costs.{key} must be an integer >= 1, got {value!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "float" and (
                not isinstance(value, (int, float)) or not math.isfinite(value) or (value < 0 and f.name != "prompt_token_offset")
            ):
                raise ValueError(f"costs.{f.name} must be a finite number >= 0, got {value!r}")
        if not isinstance(self.page_major, bool):
            raise ValueError(f"costs.page_major must be true or false, got {self.page_major!r}")
        if self.transfer_bytes_per_s <= 0:
            raise ValueError(f"costs.transfer_bytes_per_s must be > 0, got {self.transfer_bytes_per_s}")
        for key in ("shared_gpu_prefill_share", "shared_gpu_decode_share"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"costs.{key} must be in (0, 1], got {getattr(self, key)}")
        if self.prompt_token_scale <= 0:
            raise ValueError(f"costs.prompt_token_scale must be > 0, got {self.prompt_token_scale}")
        if not isinstance(self.reply_lost_tokens, int) or self.reply_lost_tokens < 0:
            raise ValueError(f"costs.reply_lost_tokens must be an integer >= 0, got {self.reply_lost_tokens!r}")
        if not isinstance(self.decode_ctx_s, dict) or not self.decode_ctx_s:
            raise ValueError("costs.decode_ctx_s must map KV dtypes to seconds per context token")
        if not isinstance(self.prefill_attn_dtype_s, dict):
            raise ValueError("costs.prefill_attn_dtype_s must map KV dtypes to seconds per token x context token")
        for name, table in (("decode_ctx_s", self.decode_ctx_s), ("prefill_attn_dtype_s", self.prefill_attn_dtype_s)):
            for dtype, value in table.items():
                if dtype not in KV_DTYPES:
                    raise ValueError(f"costs.{name} has unknown dtype {dtype!r}")
                if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                    raise ValueError(f"costs.{name}[{dtype!r}] must be a finite number >= 0, got {value!r}")
        frac_int2_for_budget(self.triaxial_bit_budget)  # ValueError outside [2, 4]
        share = self.triaxial_int2_share
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0):
            raise ValueError(f"costs.triaxial_int2_share must be in [0, 1] or null, got {share!r}")

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> CostModel:
        if not isinstance(data, dict):
            raise ValueError(f"a cost model must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"cost model has unknown keys: {unknown}")
        missing = sorted(f.name for f in fields(cls) if f.name not in data and f.default is MISSING and f.default_factory is MISSING)
        if missing:
            raise ValueError(f"cost model lacks keys: {missing}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"bad cost model: {exc}") from exc

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    # ------------------------------------------------------------------ derived
    def supports(self, dtype: str) -> bool:
        return dtype in self.decode_ctx_s

    def page_bytes(self, dtype: str, page_size: int) -> float:
        """Bytes one page takes in every layer (triaxial: the INT2/INT4 page mix, measured or the
        bit budget's: a page is INT2 only when all its tokens are 2-bit, so short agent histories
        store far fewer INT2 pages than the budget allows)."""
        shape = {"layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim}
        if dtype == "triaxial":
            share = self.triaxial_int2_share
            frac = frac_int2_for_budget(self.triaxial_bit_budget) if share is None else float(share)
            per_token = bytes_per_token(dtype, frac_int2=frac, **shape)
        else:
            per_token = bytes_per_token(dtype, **shape)
            if dtype == "bf16" and self.fp32_unquantized:
                per_token *= 2
        return per_token * page_size

    def pool_pages(self, dtype: str, page_size: int | None = None, *, kv_bytes: int | None = None) -> int:
        """Pages of ``page_size`` tokens a worker's KV budget holds in ``dtype``."""
        p = page_size or DEFAULT_PAGE_SIZE[dtype]
        budget = self.kv_bytes_per_worker if kv_bytes is None else kv_bytes
        return int(budget // self.page_bytes(dtype, p))

    def attn_s(self, dtype: str) -> float:
        """Prefill attention seconds per (new token x context token) in ``dtype``."""
        return self.prefill_attn_dtype_s.get(dtype, self.prefill_attn_s)

    def prefill_step(self, dtype: str, tokens: int, attn_work: float) -> float:
        return self.prefill_step_s + self.prefill_token_s * tokens + self.attn_s(dtype) * attn_work

    def decode_step(self, dtype: str, batch: int, context_tokens: float) -> float:
        a, c = self.decode_step_parts(dtype, batch)
        return a + c * context_tokens

    def decode_step_parts(self, dtype: str, batch: int) -> tuple[float, float]:
        """``(a, c)`` with ``decode_step(dtype, batch, ctx) == a + c * ctx``: a run of decode steps of
        one batch times each step from its context alone, bit for bit as ``decode_step`` does."""
        return self.decode_step_s + self.decode_seq_s * batch, self.decode_ctx_s[dtype]

    def regions_per_pull(self) -> int:
        """NIXL regions a pull moves: a region per run of pages per layer buffer, one buffer page-major."""
        return (1 if self.page_major else self.layers) * self.transfer_runs

    def pull_s(self, nbytes: float) -> float:
        return self.transfer_overhead_s + self.regions_per_pull() * self.transfer_region_s + nbytes / self.transfer_bytes_per_s

    def copy_s(self, nbytes: float) -> float:
        """Of ``pull_s``, the copy's GPU time: its regions and bytes (the fixed part is the READ's post)."""
        return self.regions_per_pull() * self.transfer_region_s + nbytes / self.transfer_bytes_per_s

    def server_tokens(self, nominal: int) -> int:
        """A nominal length (agent generator) as the server's token count."""
        return max(1, int(round(nominal * self.prompt_token_scale + self.prompt_token_offset)))


def _h200_8b() -> CostModel:
    """The Qwen3-8B-shaped model on one H200 (bench/results/engine_gpu_h200.json, bench/results/extend_gpu_h200.json,
    docs/performance-log/pd-gpu.md)."""
    return CostModel(
        name="h200-8b",
        layers=36,
        kv_heads=8,
        head_dim=128,
        kv_bytes_per_worker=90 * 2**30,  # the engine benchmark's pool (speed_kv_gib)
        # engine_gpu prefill_8k: 8192 fresh tokens in 0.29 s in every format (fresh K/V attention is
        # unquantized) -> 3.4e-5 s/token; over a cached prefix the paged extend kernel costs, per
        # format (extend_gpu_h200 "ours", 2048 new over 32768, x 36 layers), per token x context:
        prefill_token_s=3.4e-5,
        prefill_attn_s=3.13e-8,  # the dequantize + SDPA extend path of the two-H200 seed run (unused below)
        prefill_attn_dtype_s={"bf16": 2.06e-9, "fp8_e4m3": 2.51e-9, "nvfp4": 4.28e-9, "triaxial": 4.06e-9},
        # engine_gpu decode TPOT, 25 rows (batch 1..256 x context 4K/32K, CUDA graphs), least squares:
        # 10.85 ms + 26 us per sequence + per context token (max error 1.4 ms)
        decode_step_s=0.01085,
        decode_seq_s=2.63e-5,
        decode_ctx_s={"bf16": 3.69e-8, "fp8_e4m3": 2.52e-8, "nvfp4": 1.58e-8, "triaxial": 1.57e-8},
        transfer_region_s=7.2e-6,
        transfer_bytes_per_s=330e9,
        transfer_overhead_s=1.5e-3,
        transfer_runs=1,
        gateway_s=3.4e-3,
        # two-H200 seed run after the pooled HTTP client: the prefill request's non-READ part is
        # 53-90 ms above new-only, the decode request 114 ms (docs/performance-log/pd-gpu.md)
        prefill_request_s=0.06,
        decode_request_s=0.114,
        source="bench/results/engine_gpu_h200.json, bench/results/extend_gpu_h200.json, docs/performance-log/pd-gpu.md, docs/performance-log/gateway.md",
        notes={"kv_bytes_per_worker": "the engine benchmark's 90 GiB pool on a 141 GB H200 (16.4 GB of weights)"},
    )


BUILTIN: dict[str, Any] = {"h200-8b": _h200_8b}
BUILTIN_FILES = {
    "cpu-tiny": "sim_costs_cpu.json",
    "gpu-h200": "sim_costs_gpu_h200.json",  # bench/sim_costs_gpu.py fits these two
    "gpu-h100": "sim_costs_gpu_h100.json",  # (--card h100: the H100 agent points ran on one H100)
}


def load_costs(name_or_path: str, *, bench_dir: Path | None = None) -> CostModel:
    """A built-in profile (``h200-8b``; ``cpu-tiny`` / ``gpu-h200`` / ``gpu-h100`` from bench/results/sim_costs_{cpu,gpu_h200,gpu_h100}.json) or a JSON file."""
    if name_or_path in BUILTIN:
        model: CostModel = BUILTIN[name_or_path]()
        return model
    if name_or_path in BUILTIN_FILES:
        root = bench_dir if bench_dir is not None else Path(__file__).resolve().parents[1] / "bench" / "results"
        return CostModel.load(root / BUILTIN_FILES[name_or_path])
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"--costs {name_or_path!r}: not a built-in profile ({', '.join([*BUILTIN, *BUILTIN_FILES])}) nor a file")
    return CostModel.load(path)
