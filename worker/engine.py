"""The inference engine: schedule -> run -> postprocess, one step at a time.

``LLMEngine`` is the synchronous core (tests and the offline CLI drive it
directly); ``async_engine.AsyncEngine`` streams tokens on top of it.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserving.config import ServingConfig
from kvserving.tags import NUM_TAGS, default_bits_table, validate_bits_table
from kvserving.worker.attention import PagedAttention
from kvserving.worker.kv_manager import KVCacheManager
from kvserving.worker.kv_scales import CALIBRATION_TOKENS, calibration_ids, measure_kv_amax, scales_from_amax
from kvserving.worker.kv_storage import KVShape, KVStorage
from kvserving.worker.model import load_model
from kvserving.worker.model_runner import ModelRunner
from kvserving.worker.page_pool import PagePool, PagePoolBase
from kvserving.worker.sampling import SamplingParams, make_generator, sample_one
from kvserving.worker.scheduler import Scheduler
from kvserving.worker.sequence import Sequence
from kvserving.worker.triaxial_pool import TriaxialPagePool

# KV budget on a machine without a GPU when the config names no byte count.
DEFAULT_CPU_KV_BYTES = 256 * 2**20


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prompt_tokens_computed: int = 0
    decode_tokens: int = 0
    preemptions: int = 0


class LLMEngine:
    def __init__(
        self,
        config: ServingConfig,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        bits_table: Seq[int] | None = None,
    ) -> None:
        if not config.model.path:
            raise ValueError("model.path is empty: give a local model directory (e.g. from `kvserving tiny-model DIR`)")
        self.config = config
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        model_dir = Path(config.model.path)
        self.args, self.model = load_model(model_dir, dtype=self.dtype, device=self.device)
        args = self.args
        self.vocab_size = args.vocab_size
        self.max_model_len = min(config.model.max_model_len or args.max_position_embeddings, args.max_position_embeddings)
        self.eos_token_ids = args.eos_token_ids  # config.json and generation_config.json

        kvc = config.kv_cache
        page_size = kvc.effective_page_size
        budget = kvc.memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                # the extend workspace (K and V of a full context) is allocated after the pool
                elem = torch.empty((), dtype=self.dtype).element_size()
                workspace = 2 * self.max_model_len * args.num_kv_heads * args.head_dim * elem
                budget = int(free * kvc.memory_fraction) - workspace
            else:
                budget = int(DEFAULT_CPU_KV_BYTES * kvc.memory_fraction)
        shape = KVShape(args.num_layers, args.num_kv_heads, args.head_dim)
        self.storage = KVStorage(kvc.dtype, shape, page_size=page_size, budget_bytes=budget, device=self.device, model_dtype=self.dtype)
        table = None
        if kvc.dtype == "triaxial":
            table = validate_bits_table(tuple(bits_table) if bits_table is not None else default_bits_table())
            assert self.storage.int2_layout is not None
            pool: PagePoolBase = TriaxialPagePool(
                self.storage.total_bytes,
                int4_page_bytes=self.storage.layout.page_bytes,
                int2_page_bytes=self.storage.int2_layout.page_bytes,
                page_size=page_size,
            )
        else:
            pool = PagePool(self.storage.num_pages, page_size=page_size)
        self.pool = pool
        self.kv = KVCacheManager(pool, page_size=page_size, bits_table=table)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.attention = PagedAttention(self.storage, head_dim=args.head_dim, workspace_tokens=self.max_model_len, dtype=self.dtype)
        self.runner = ModelRunner(self.model, self.attention, device=self.device)
        self.requests: dict[str, Sequence] = {}
        self.stats = EngineStats()
        if kvc.global_scale == "calibrated":
            self.calibrate_scales(calibration_ids(self.vocab_size, min(CALIBRATION_TOKENS, self.max_model_len)))
        # request id -> logits of each sampled position (set to a dict to record; tests, calibration)
        self.capture_logits: dict[str, list[torch.Tensor]] | None = None

    def calibrate_scales(self, ids: Seq[int]) -> None:
        """Set per-layer global K/V scales from one forward pass over ``ids``.

        Only before any page is written: pages keep the scale they were written with.
        """
        if self.storage.kv_dtype not in ("fp8_e4m3", "nvfp4"):
            raise ValueError(f"kv dtype {self.storage.kv_dtype!r} has no global scale to calibrate")
        if self.pool.num_owned or self.pool.num_cached:
            raise ValueError("global scales can only be calibrated before any KV page is written")
        k_amax, v_amax = measure_kv_amax(self.model, self.args.num_layers, ids, device=self.device)
        self.storage.k_scales = scales_from_amax(self.storage.kv_dtype, k_amax)
        self.storage.v_scales = scales_from_amax(self.storage.kv_dtype, v_amax)

    # ------------------------------------------------------------------ intake
    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool holds when every page is at full (4-bit for triaxial) precision."""
        return self.storage.num_pages * self.storage.page_size

    def add_request(
        self,
        request_id: str,
        prompt_ids: Seq[int],
        params: SamplingParams,
        *,
        tags: Seq[int] | None = None,
    ) -> None:
        """Queue a request; raises ValueError (and queues nothing) on bad input."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt is empty: at least one input token is needed")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens does not fit the context length {self.max_model_len} "
                "(at least one token must be generated)"
            )
        if tags is None:
            tag_list = [0] * len(prompt)  # current x text x inst: untagged prompts stay at 4 bits
        else:
            tag_list = [int(t) for t in tags]
            if len(tag_list) != len(prompt):
                raise ValueError(f"tags has {len(tag_list)} entries for {len(prompt)} input tokens")
            if any(not 0 <= t < NUM_TAGS for t in tag_list):
                raise ValueError(f"tags must be in 0..{NUM_TAGS - 1}")
        total = min(len(prompt) + params.max_tokens, self.max_model_len)
        if -(-total // self.storage.page_size) > self.storage.num_pages:
            raise ValueError(
                f"request needs {total} tokens of KV but the pool holds {self.capacity_tokens}"
            )
        seq = Sequence(request_id, prompt, params, make_generator(params.seed), tags=tag_list)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None and not seq.finished:
            self.scheduler.abort(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -------------------------------------------------------------------- step
    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def step(self) -> list[RequestOutput]:
        self.pool.expire_leases()
        plan = self.scheduler.schedule()
        self.stats.preemptions += len(plan.preempted)
        if not plan.chunks:
            # Nothing can run: every free page is held by leases until they expire.
            return []
        logits = self.runner.execute(plan.chunks)
        self.stats.steps += 1
        outputs: list[RequestOutput] = []
        i = 0
        for c in plan.chunks:
            seq = c.seq
            if c.start >= len(seq.prompt_ids):
                self.stats.decode_tokens += c.num_tokens
            else:
                self.stats.prompt_tokens_computed += c.num_tokens
            seq.num_computed = c.start + c.num_tokens
            self.kv.publish_full_pages(seq)
            if not c.samples:
                continue
            if self.capture_logits is not None:
                self.capture_logits.setdefault(seq.request_id, []).append(logits[i].clone())
            token = sample_one(logits[i], seq.params, seq.generator)
            i += 1
            seq.output_ids.append(token)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self.requests.pop(seq.request_id, None)
            outputs.append(
                RequestOutput(
                    seq.request_id, [token], reason is not None, reason,
                    len(seq.prompt_ids), seq.num_cached_prompt, len(seq.output_ids),
                )
            )
        return outputs

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams, *, tags: Seq[Seq[int]] | None = None) -> list[list[int]]:
        """Offline batch: run all prompts to completion, return their output ids."""
        ids = [f"offline-{n}" for n in range(len(prompts))]
        for n, (rid, prompt) in enumerate(zip(ids, prompts)):
            self.add_request(rid, prompt, params, tags=tags[n] if tags is not None else None)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                results[out.request_id].extend(out.new_token_ids)
        return [results[rid] for rid in ids]
