"""The inference engine: schedule -> run -> postprocess, one step at a time.

``LLMEngine`` is the synchronous core (tests and the offline CLI drive it
directly); ``async_engine.AsyncEngine`` streams tokens on top of it.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from kvserving.config import ServingConfig
from kvserving.model_dir import resolve_model_dir
from kvserving.tags import NUM_TAGS
from kvserving.worker.attention import PagedAttention
from kvserving.worker.bit_budget import class_bits_at_cut
from kvserving.worker.kv.cache import KVCache, build_kv_cache, kv_budget_bytes
from kvserving.worker.kv.manager import KVCacheManager
from kvserving.worker.kv.scales import CALIBRATION_TOKENS, calibration_ids, measure_kv_amax, scales_from_amax
from kvserving.worker.kv.storage import KVShape, KVStorage
from kvserving.worker.kv.leases import RetainedKV, RetainSpec, release_admission, retain
from kvserving.worker.model import DecoderModel, ModelArgs, load_dummy_model, load_model
from kvserving.worker.cuda_graphs import is_decode_step, table_widths
from kvserving.worker.model_runner import ModelRunner
from kvserving.worker.kv.page_pool import PagePoolBase
from kvserving.worker.sampling import SamplingParams, make_generator, sample_tokens
from kvserving.worker.scheduler import Scheduler
from kvserving.worker.sequence import ScheduledChunk, SchedulerOutput, Sequence, SeqStatus
from kvserving.worker.warm_up import WarmUpPlan, WarmUpReport, due, plan_warm_up, prompts_of, tags_of

logger = logging.getLogger("kvserving.worker")


class ContextLengthError(ValueError):
    """A request longer than the context or the KV pool can hold: the client's to shorten
    (the server answers 400 with this ``code``)."""

    code = "context_length_exceeded"


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens from the prefix cache, pulled pages included
    num_output_tokens: int = 0
    num_pulled_tokens: int = 0  # of num_cached_tokens: pages READ from another worker for this request
    retained: RetainedKV | None = None  # the lease a finished request's pages went to (add_request(retain=))
    first_step_at: float | None = None  # perf_counter when a step first ran this request (latency split)


STEP_KINDS = ("decode", "mixed")


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prompt_tokens_computed: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    # requests admitted after their admission pin (pages pulled for them) had expired or yielded whole (trimmed to
    # nothing): their pulled pages were cached then, and the ones evicted before admission were computed again; a
    # pin that gave up only its tail is not gone (``PagePoolBase.trimmed_pages`` counts those pages)
    admission_pins_gone: int = 0
    prefill_seconds: float = 0.0  # model time spent on prompt tokens (prefill tokens/s for reuse "auto")
    wait_seconds: float = 0.0  # asynchronous decode: time the host waited for a step's sampled ids
    overlapped_steps: int = 0  # decode steps launched before the previous step's ids were back
    # wall time of ``step`` calls by what they ran: "decode" (every row one token after its prompt) or "mixed"
    # (prompt chunks, alone or beside decode rows); an overlapped decode call lasts about one device step
    step_counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0))
    step_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0.0))


# A launched step's output token until its id is back from the device (never an input id: the
# next step reads that token on the device).
PLACEHOLDER_TOKEN = -1


@dataclass(slots=True)
class _InFlight:
    """An asynchronous decode step: launched, its sampled ids on their way to the host."""

    chunks: list[ScheduledChunk]
    tokens: torch.Tensor  # long [n] on the device: the next step's input ids are read from here
    host: torch.Tensor  # the same ids in pinned memory, valid once ``ready`` has passed
    ready: torch.cuda.Event | None  # None on CPU (the copy is done when launched)
    out_index: list[int]  # where each row's token goes in its sequence's output_ids
    live: list[bool] = field(default_factory=list)  # False: finished or aborted meanwhile, the token is dropped
    held: list[int] = field(default_factory=list)  # pages of dropped rows that this step writes: freed when done
    row_of: dict[int, int] = field(default_factory=dict)  # id(sequence) -> row
    live_ids: set[int] = field(default_factory=set)  # id() of the live rows' sequences

    def __post_init__(self) -> None:
        self.live = [True] * len(self.chunks)
        self.row_of = {id(c.seq): i for i, c in enumerate(self.chunks)}
        self.live_ids = set(self.row_of)

    @property
    def num_live(self) -> int:
        return len(self.live_ids)

    def drop(self, seq: Sequence, pool: PagePoolBase, page_size: int) -> None:
        """``seq`` leaves this step (it finished at the previous one, or is aborted): its token will be
        dropped; the page its KV write lands in is held until the step is done, so it is not handed to
        anyone (a pull, another sequence) before that write. That page holds positions past everything
        published, retained or shared (the write is at the sequence's last position, one past its last
        full page or inside its own unpublished partial page). Undoes ``_launch``'s placeholder."""
        i = self.row_of[id(seq)]
        if not self.live[i]:
            return
        self.live[i] = False
        self.live_ids.discard(id(seq))
        c = self.chunks[i]
        page = seq.page_ids[c.start // page_size]
        pool.incref([page])
        self.held.append(page)
        if len(seq.output_ids) == self.out_index[i] + 1:
            seq.output_ids.pop()
        seq.num_computed = c.start


class LLMEngine:
    def __init__(
        self,
        config: ServingConfig,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        bits_table: Seq[int] | None = None,
        enforce_eager: bool = False,
        model: tuple[ModelArgs, DecoderModel] | None = None,
        async_decode: bool = True,
        warm_graphs: bool = True,
    ) -> None:
        """Load the model and build the KV cache, scheduler and runner that ``config`` asks for.

        ``bits_table`` (triaxial only) overrides the table derived from ``kv_cache.bit_budget``.
        ``enforce_eager``: no CUDA graphs for decode steps (they are on by default on CUDA,
        never on CPU). ``model``: an already built model on ``device`` in ``dtype`` instead of
        loading ``config.model`` (benchmarks with generated weights). ``async_decode``: steady
        decode steps on the graphs overlap the host's work with the device (``step``); off: every
        step waits for its sampled ids. ``warm_graphs``: capture every decode graph now (see
        ``cuda_graphs.warm_up``) rather than each on its first step.
        """
        self.config = config
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        if model is None:
            model_dir = resolve_model_dir(config.model)
            if config.model.load_format == "dummy":
                self.args, self.model = load_dummy_model(
                    model_dir, seed=config.model.seed, dtype=self.dtype, device=self.device, weight_format=config.model.weight_format
                )
            else:
                self.args, self.model = load_model(
                    model_dir, dtype=self.dtype, device=self.device, weight_format=config.model.weight_format
                )
        else:
            self.args, self.model = model
        args = self.args
        self.vocab_size = args.vocab_size
        self.max_model_len = min(config.model.max_model_len or args.max_position_embeddings, args.max_position_embeddings)
        self.eos_token_ids = args.eos_token_ids  # config.json and generation_config.json

        # The extend workspace (K and V of a full context) is allocated after the pool.
        elem = torch.empty((), dtype=self.dtype).element_size()
        workspace = 2 * self.max_model_len * args.num_kv_heads * args.head_dim * elem
        self.kv_cache: KVCache = build_kv_cache(
            config.kv_cache,
            KVShape(args.num_layers, args.num_kv_heads, args.head_dim),
            budget_bytes=kv_budget_bytes(config.kv_cache, device=self.device, reserved_bytes=workspace),
            device=self.device,
            model_dtype=self.dtype,
            bits_table=bits_table,
        )
        logger.info("%s", self.kv_cache.describe())
        self.scheduler = Scheduler(config.scheduler, self.kv_cache.manager)
        self.attention = PagedAttention(self.storage, head_dim=args.head_dim, workspace_tokens=self.max_model_len, dtype=self.dtype)
        # Graphs need ops without host syncs: not the reference ops (they validate page ids on
        # the host) nor value checks, which KVSERVING_PAGED_BACKEND / _CHECK_VALUES ask for.
        opts = self.storage.options
        capturable = opts.backend != "reference" and not opts.check_values
        self.runner = ModelRunner(
            self.model,
            self.attention,
            device=self.device,
            use_graphs=self.device.type == "cuda" and not enforce_eager and capturable,
            max_batch=config.scheduler.max_num_seqs,
            max_model_len=self.max_model_len,
            pool=self.pool,
        )
        self.requests: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self.async_decode = async_decode
        self._inflight: _InFlight | None = None
        # the sampled ids of the last two launched steps come back here (pinned: the copy does not wait)
        bmax = max(1, config.scheduler.max_num_seqs)
        self._host_ids = [torch.empty(bmax, dtype=torch.long, pin_memory=self.device.type == "cuda") for _ in range(2)]
        self._slot = 0
        if config.kv_cache.global_scale == "calibrated" and self.kv_cache.scales_source == "static":
            # no calibration file gave the scales: measure them on a calibration prompt at start
            self.calibrate_scales(calibration_ids(self.vocab_size, min(CALIBRATION_TOKENS, self.max_model_len)))
        if self.runner.graphs is not None and warm_graphs:  # after the scales: a graph keeps the tensors it read
            start = time.perf_counter()
            n = self.runner.graphs.warm_up()
            logger.info("decode graphs: %d shapes captured in %.1f s", n, time.perf_counter() - start)

    @property
    def storage(self) -> KVStorage:
        return self.kv_cache.storage

    @property
    def pool(self) -> PagePoolBase:
        return self.kv_cache.pool

    @property
    def kv(self) -> KVCacheManager:
        return self.kv_cache.manager

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
        """Tokens the KV cache holds (triaxial: at the expected INT2 share, see ``KVCache``)."""
        return self.kv_cache.capacity_tokens

    def check_request(
        self, prompt_ids: Seq[int], params: SamplingParams, *, tags: Seq[int] | None = None, output_ids: Seq[int] = ()
    ) -> tuple[list[int], list[int], list[int]]:
        """The prompt, its tags and the output ids already generated, as lists; a ValueError
        (``ContextLengthError`` for what cannot fit) when the request cannot run here. Reads only
        what does not change while the engine runs, so the server checks a request before it
        opens the response (``add_request`` checks again)."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt is empty: at least one input token is needed")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if len(prompt) >= self.max_model_len:
            raise ContextLengthError(
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
        generated = [int(t) for t in output_ids]
        bad = [t for t in generated if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"output_ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if len(generated) >= params.max_tokens or len(prompt) + len(generated) >= self.max_model_len:
            raise ValueError(
                f"{len(generated)} output_ids already reach max_tokens {params.max_tokens} "
                f"or the context length {self.max_model_len}: nothing is left to generate"
            )
        total = min(len(prompt) + params.max_tokens, self.max_model_len)
        # Worst case every page is 4-bit (decode-generated tokens always are).
        capacity = self.kv_cache.capacity_tokens_at(0.0)
        if total > capacity:
            pages = " with every page at 4 bits" if self.kv_cache.dtype == "triaxial" else ""
            raise ContextLengthError(
                f"request needs {total} tokens of KV cache ({len(prompt)} of prompt, {total - len(prompt)} of "
                f"completion) but this worker's {self.kv_cache.dtype} KV pool holds {capacity} tokens{pages}"
            )
        return prompt, tag_list, generated

    def add_request(
        self,
        request_id: str,
        prompt_ids: Seq[int],
        params: SamplingParams,
        *,
        tags: Seq[int] | None = None,
        retain: RetainSpec | None = None,
        admission_pin: str | None = None,
        output_ids: Seq[int] = (),
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request; raises ValueError (and queues nothing) on bad input.

        ``retain``: when it finishes, its full pages stay pinned under that lease
        (``RequestOutput.retained``). ``admission_pin``: the pin holding pages pulled
        for it (``KVTransfer.pull``), released once it is admitted.
        ``output_ids``: tokens already generated for this request elsewhere (the
        prefill worker samples the first token and the gateway streams it at
        once): their KV is computed with the prompt, they count toward
        ``max_tokens``, and sampling continues after them.
        ``cache_salt``: its tenant; its pages match only requests with the same salt
        (``page_pool.chain_hashes``).
        """
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt, tag_list, generated = self.check_request(prompt_ids, params, tags=tags, output_ids=output_ids)
        gen = make_generator(params.seed, device=self.device)
        seq = Sequence(
            request_id, prompt, params, gen, tags=tag_list, output_ids=generated, cache_salt=cache_salt.encode() if cache_salt else None
        )
        seq.retain, seq.admission_pin = retain, admission_pin
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None and not seq.finished:
            inflight = self._inflight
            if inflight is not None and id(seq) in inflight.live_ids:
                # launched in the step in flight: its token is dropped (a finished stream gets no more)
                inflight.drop(seq, self.pool, self.storage.page_size)
                if not inflight.num_live:
                    self.flush()
            self.scheduler.abort(seq)
            if seq.admission_pin is not None:
                release_admission(self.pool, seq.admission_pin, ())
                seq.admission_pin = None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    # -------------------------------------------------------------------- step
    def _finish_reason(self, seq: Sequence, token: int, num_output: int | None = None) -> str | None:
        """Why ``seq`` stops at ``token``, its ``num_output``-th output token (default: all of them so far)."""
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        n = len(seq.output_ids) if num_output is None else num_output
        if n >= p.max_tokens or len(seq.prompt_ids) + n >= self.max_model_len:
            return "length"
        return None

    def step(self) -> list[RequestOutput]:
        """Run one step: schedule -> run -> postprocess; returns what it produced for each
        request, in streaming order.

        Asynchronous decode (``async_decode``, on CUDA graphs): an all-decode step
        is launched and its sampled ids copied back without waiting; the next call
        launches the following step with its input ids taken on the device
        (``ModelRunner.execute(prev=...)``), and only then waits for the earlier
        step's ids and returns its outputs. So a call returns the previous step's
        tokens (the first call of a run returns none) and the host's scheduling
        and post-processing run while the device computes. Whatever is not a
        steady decode batch (``_continues``) waits for the step in flight first
        and runs as before. Tokens and their order are the same either way.
        """
        start = time.perf_counter()
        outputs, kind = self._step()
        if kind is not None:
            self.stats.step_counts[kind] += 1
            self.stats.step_seconds[kind] += time.perf_counter() - start
        return outputs

    def _step(self) -> tuple[list[RequestOutput], str | None]:
        """``step``'s outputs and the kind of step it ran (None: none ran)."""
        self.pool.expire_pins()
        prev = self._inflight
        if prev is not None and self._continues(prev):
            return self._step_overlapped(prev), "decode"
        outputs = self.flush()
        plan = self._schedule()
        if not plan.chunks:
            return outputs, None  # nothing can run: every free page is pinned until its pin expires
        if self.async_decode and self.runner.graphs_fit(plan.chunks):
            self._inflight = self._launch(plan.chunks, None)
            return outputs, "decode"
        tokens = self._run(plan)
        return outputs + self._postprocess(plan, tokens), "decode" if is_decode_step(plan.chunks) else "mixed"

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's plan for this step; its requests admitted (their admission pins go:
        each holds its own refs on its pulled pages now) and stamped with their first step."""
        plan = self.scheduler.schedule()
        self.stats.preemptions += len(plan.preempted)
        p = self.storage.page_size
        now = time.perf_counter()
        for c in plan.chunks:
            seq = c.seq
            if seq.admission_pin is not None:
                if self.pool.get_pin(seq.admission_pin) is None:
                    self.stats.admission_pins_gone += 1
                used = release_admission(self.pool, seq.admission_pin, seq.page_ids[: seq.num_computed // p])
                seq.num_pulled_prompt = used * p
                seq.admission_pin = None
            if seq.first_step_at is None:
                seq.first_step_at = now
        return plan

    def _run(self, plan: SchedulerOutput) -> list[int]:
        """Run the model on ``plan`` and sample where the logits are: one token id per sampling
        sequence, in chunk order (the step's only device sync)."""
        t0 = time.perf_counter()
        logits = self.runner.execute(plan.chunks)
        sampling = [c.seq for c in plan.chunks if c.samples]
        tokens = sample_tokens(logits, [s.params for s in sampling], [s.generator for s in sampling]).tolist() if sampling else []
        prompt_share = sum(c.num_tokens for c in plan.chunks if c.start < len(c.seq.prompt_ids)) / max(1, plan.num_tokens)
        self.stats.prefill_seconds += (time.perf_counter() - t0) * prompt_share
        self.stats.steps += 1
        return tokens

    def _postprocess(self, plan: SchedulerOutput, tokens: list[int]) -> list[RequestOutput]:
        """Advance each sequence past its chunk, publish its full pages, append its sampled token
        and finish it where that token ends it."""
        outputs: list[RequestOutput] = []
        sampled = iter(tokens)
        p = self.storage.page_size
        for c in plan.chunks:
            seq = c.seq
            if c.start >= len(seq.prompt_ids):
                self.stats.decode_tokens += c.num_tokens
            else:
                self.stats.prompt_tokens_computed += c.num_tokens
            seq.num_computed = c.start + c.num_tokens
            if seq.num_computed // p > seq.num_registered_pages:
                self.kv.publish_full_pages(seq)
            if not c.samples:  # a prompt chunk before the last
                continue
            token = next(sampled)
            seq.output_ids.append(token)
            outputs.append(self._output(seq, token, self._finish_reason(seq, token)))
        return outputs

    def _output(self, seq: Sequence, token: int, reason: str | None) -> RequestOutput:
        """``seq``'s output for ``token``, its last output token; a ``reason`` finishes it (retain, free)."""
        retained = None
        if reason is not None:
            if seq.retain is not None:  # pin the full pages before finish frees them
                self.kv.publish_full_pages(seq)
                n = seq.num_registered_pages
                retained = retain(self.pool, seq.retain, seq.page_ids[:n], seq.page_hashes[:n], self.storage.page_size)
            self.scheduler.finish(seq, reason)
            self.requests.pop(seq.request_id, None)
        return RequestOutput(
            seq.request_id, [token], reason is not None, reason,
            len(seq.prompt_ids), seq.num_cached_prompt, len(seq.output_ids),
            seq.num_pulled_prompt, retained, seq.first_step_at,
        )  # fmt: skip

    # ----------------------------------------------------- asynchronous decode
    def _step_overlapped(self, prev: _InFlight) -> list[RequestOutput]:
        """Launch the continuation of ``prev`` (its sequences one token further), then wait for
        ``prev``'s ids and post-process them while the new step runs."""
        plan = self.scheduler.schedule()
        self._check_continuation(plan, prev)
        self._inflight = self._launch(plan.chunks, prev)
        self.stats.overlapped_steps += 1
        outputs = self._complete(prev, self._inflight)
        if not any(self._inflight.live):  # everyone in it finished in prev: nothing to wait for but its writes
            self.flush()
        return outputs

    def _continues(self, prev: _InFlight) -> bool:
        """Whether the next step can be launched before ``prev``'s tokens are back: it is ``prev``'s
        live sequences, each one token further, and nothing else can change that plan: no request
        waits, every sequence runs (budget), none stops by length at ``prev``'s token, and the free
        pages cover the pages it opens (no preemption, no pin reclaimed). Stops at ``prev``'s
        token (EOS, stop ids) are known later: that row's next token is computed and dropped."""
        if not self.async_decode or self.runner.graphs is None:
            return False
        sched = self.scheduler
        running = sched.running
        if sched.waiting or len(running) > sched.config.max_num_batched_tokens or len(running) != prev.num_live:
            return False
        p = self.storage.page_size
        need = 0
        for seq in running:
            if seq.status is not SeqStatus.RUNNING or seq.admission_pin is not None or id(seq) not in prev.live_ids:
                return False
            n = len(seq.output_ids)  # prev's token included (a placeholder until it is back)
            if n >= seq.params.max_tokens or len(seq.prompt_ids) + n >= self.max_model_len:
                return False
            need += len(seq.prompt_ids) + n > len(seq.page_ids) * p
        return need == 0 or need <= self.pool.num_free_pages(bits=4)

    @staticmethod
    def _check_continuation(plan: SchedulerOutput, prev: _InFlight) -> None:
        live = [c.seq for c, ok in zip(prev.chunks, prev.live) if ok]
        if (
            plan.preempted
            or [c.seq for c in plan.chunks] != live
            or any(c.num_tokens != 1 or c.start != c.seq.num_computed for c in plan.chunks)
        ):
            raise RuntimeError("internal error: the step after an asynchronous decode step is not its continuation")

    def _launch(self, chunks: list[ScheduledChunk], prev: _InFlight | None) -> _InFlight:
        """Launch the decode step ``chunks`` (input ids from ``prev``'s sampled ids on the device when
        given), sample on the device, start copying the ids back; mark each sequence one token further
        (a placeholder output token until ``_complete``)."""
        sources: list[int] | None = None
        if prev is not None:
            row = prev.row_of
            sources = [row[id(c.seq)] for c in chunks]
        logits = self.runner.execute(chunks, prev=(prev.tokens, sources) if prev is not None and sources is not None else None)
        seqs = [c.seq for c in chunks]
        tokens = sample_tokens(logits, [s.params for s in seqs], [s.generator for s in seqs])
        n = len(chunks)
        self._slot ^= 1
        host = self._host_ids[self._slot][:n]
        host.copy_(tokens, non_blocking=True)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        out_index = []
        for c in chunks:
            seq = c.seq
            out_index.append(len(seq.output_ids))
            seq.output_ids.append(PLACEHOLDER_TOKEN)
            seq.num_computed = c.start + 1
        self.stats.steps += 1
        return _InFlight(chunks, tokens, host, ready, out_index)

    def _complete(self, done: _InFlight, nxt: _InFlight | None) -> list[RequestOutput]:
        """Wait for ``done``'s ids and post-process its live rows (``nxt``: the step launched after it)."""
        if done.ready is not None:
            t0 = time.perf_counter()
            done.ready.synchronize()
            self.stats.wait_seconds += time.perf_counter() - t0
        if done.held:  # its KV writes have landed: those pages may go back
            self.pool.free(done.held)
        tokens = done.host.tolist()
        outputs: list[RequestOutput] = []
        kv = self.kv
        p = self.storage.page_size
        eos = self.eos_token_ids
        max_len = self.max_model_len
        live = done.live
        for i, c in enumerate(done.chunks):
            if not live[i]:
                continue
            seq, token, idx = c.seq, tokens[i], done.out_index[i]
            seq.output_ids[idx] = token
            computed = c.start + 1
            if computed // p > seq.num_registered_pages:  # publish the pages full as of this step only
                ahead, seq.num_computed = seq.num_computed, computed
                kv.publish_full_pages(seq)
                seq.num_computed = ahead
            sp, plen = seq.params, len(seq.prompt_ids)
            if (
                token not in sp.stop_token_ids
                and (sp.ignore_eos or token not in eos)
                and idx + 1 < sp.max_tokens
                and plen + idx + 1 < max_len
            ):  # the common case, without a call per row
                outputs.append(RequestOutput(
                    seq.request_id, [token], False, None, plen, seq.num_cached_prompt, idx + 1,
                    seq.num_pulled_prompt, None, seq.first_step_at,
                ))  # fmt: skip
                continue
            reason = self._finish_reason(seq, token, idx + 1)
            if nxt is not None and id(seq) in nxt.live_ids:
                nxt.drop(seq, self.pool, p)  # its next token was launched: undo that, keep its KV page until written
            outputs.append(self._output(seq, token, reason))
        self.stats.decode_tokens += len(outputs)
        return outputs

    def flush(self) -> list[RequestOutput]:
        """Wait for the step in flight (asynchronous decode) and return its outputs; [] when none is."""
        done, self._inflight = self._inflight, None
        return self._complete(done, None) if done is not None else []

    @property
    def step_in_flight(self) -> bool:
        """A decode step runs on the device whose outputs the next ``step`` (or ``flush``) returns."""
        return self._inflight is not None

    @contextlib.contextmanager
    def state_kept(self) -> Iterator[None]:
        """Requests run inside leave no trace: the pool (pages, prefix cache, pins), the KV manager (with the
        bit-budget controller), the scheduler and the counters are put back from a copy taken on entry. The pages'
        bytes are not (a free page's bytes are never read). Only on an idle engine (a ValueError otherwise)."""
        if self.requests or self.has_unfinished():
            raise ValueError("state_kept needs an idle engine: requests are queued or running")
        kept = (self.kv_cache.pool, self.kv_cache.manager, self.scheduler, self.stats)
        saved = copy.deepcopy(kept, {id(self.storage): self.storage})  # the storage (tensors) is shared, not copied
        try:
            yield
        finally:
            self.flush()
            self.requests.clear()
            self.kv_cache.pool, self.kv_cache.manager, self.scheduler, self.stats = saved

    def warm_up_plan(self, *, decode: bool) -> WarmUpPlan:
        """The warm-up for this engine's limits (``warm_up.plan_warm_up``): prompts of at most a quarter of the pool and
        the context length less 8 tokens (room for what they generate), the long one alone of up to the pool less
        two chunks."""
        sc = self.config.scheduler
        cap = self.kv_cache.capacity_tokens_at(0.0)
        return plan_warm_up(
            max_num_batched_tokens=sc.max_num_batched_tokens,
            chunk_size=sc.chunk_size,
            max_num_seqs=sc.max_num_seqs,
            page_size=self.storage.page_size,
            max_prompt=min(self.max_model_len - 8, cap // 4),
            decode=decode,
            age_down=self.kv.age_down,
            longest=min(self.max_model_len - 8, cap - 2 * sc.chunk_size),
        )

    def warm_up(self, *, decode: bool) -> WarmUpReport:
        """Run every step shape this engine's requests can reach once (``warm_up.py``), so that their kernels compile
        now and not in a served turn, and leave the engine as it was (``state_kept``). ``decode``: the worker runs
        decode steps (roles decode and both; a prefill worker's requests end at their first token)."""
        start = time.perf_counter()
        warm = self.warm_up_plan(decode=decode)
        with self.state_kept():
            requests, steps = self._run_groups(warm, tags_table=self._tag_bits())
        shapes = self._sweep_decode_shapes() if decode else 0
        return WarmUpReport(
            groups=len(warm.groups), requests=requests, steps=steps, seconds=time.perf_counter() - start, decode_shapes=shapes
        )

    @torch.inference_mode()
    def _sweep_decode_shapes(self) -> int:
        """Launch the decode attention once at every (rows, page-table width) a step outside the CUDA graphs gives
        it (decode rows beside prompt chunks: 1 .. max_num_seqs rows, every ``table_widths`` width), on one layer's
        pages (every layer runs the same kernels); returns the launches. The split plan, and with it the launch's
        integer arguments, follows from the rows and the width alone, so this is every specialization those steps
        can meet. The rows read the same few free pages over and over, written with zeros first (a free page's
        bytes are never read by a request)."""
        args = self.args
        page = self.storage.page_size
        ids_in_pool = range(self.pool.capacity_tokens() // page)
        free = list(itertools.islice((i for i in ids_in_pool if self.pool.page(i) is None), 64))  # the first 64 free
        ids = torch.tensor(free, dtype=torch.int32, device=self.device)
        zeros = torch.zeros(len(free) * page, args.num_kv_heads, args.head_dim, dtype=self.dtype, device=self.device)
        slots = torch.arange(page, dtype=torch.int32, device=self.device).repeat(len(free))
        self.storage.write(0, zeros, zeros, ids.repeat_interleave(page), slots)
        launches = 0
        for width in table_widths(self.runner.max_pages):
            for rows in range(1, self.config.scheduler.max_num_seqs + 1):
                q = torch.randn(rows, args.num_heads, args.head_dim, dtype=self.dtype, device=self.device)
                table = ids[torch.arange(rows * width, device=self.device) % len(free)].view(rows, width)
                lens = torch.full((rows,), width * page, dtype=torch.int32, device=self.device)
                n2 = torch.zeros(rows, dtype=torch.int32, device=self.device)
                self.storage.decode(0, q, table, lens, sm_scale=args.head_dim**-0.5, num_int2_pages=n2)
                launches += 1
        return launches

    def _run_groups(self, warm: WarmUpPlan, *, tags_table: Seq[int] | None, max_steps: int = 100_000) -> tuple[int, int]:
        """Run ``warm``'s groups one after the other, each to completion; returns the requests added and the engine
        steps run. ``tags_table``: tag -> bits a full page of that tag is stored at (triaxial)."""
        steps = requests = 0
        page = self.storage.page_size
        for g, (group, prompts) in enumerate(zip(warm.groups, prompts_of(warm, vocab_size=self.vocab_size))):
            ids = [f"warm-up-{g}-{i}" for i in range(len(group.turns))]
            started = [False] * len(group.turns)
            added = 0
            while True:
                while due(group, added, started):
                    turn = group.turns[added]
                    params = SamplingParams(max_tokens=turn.max_tokens, temperature=0.0, ignore_eos=True)
                    tags = tags_of(turn.prompt_len, page_size=page, bits_table=tags_table, four_bit=turn.four_bit)
                    self.add_request(ids[added], prompts[added], params, tags=tags)
                    added += 1
                    requests += 1
                if not self.has_unfinished():
                    break
                if steps >= max_steps:
                    raise RuntimeError(f"the warm-up's group {group.name!r} did not finish in {max_steps} engine steps")
                for out in self.step():
                    if out.new_token_ids:
                        started[ids.index(out.request_id)] = True
                steps += 1
        return requests, steps

    def _tag_bits(self) -> list[int] | None:
        """Tag -> bits a full page of that tag is stored at (triaxial; None otherwise): the bits table, or where the
        bit-budget controller holds the budget its cut (0 for the class at the cut, whose pages are dithered)."""
        manager = self.kv
        if manager.bits_table is None:
            return None
        c = manager.controller
        if c is None:
            return list(manager.bits_table)
        return [class_bits_at_cut(c.rank[t], c.cut) for t in range(len(manager.bits_table))]

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
