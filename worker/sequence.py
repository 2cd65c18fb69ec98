"""One request's state as the scheduler sees it (tokens, tags, pages, progress),
and the plain step plan the scheduler hands the model runner."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from kvserving.tags import encode_tag
from kvserving.worker.kv.leases import RetainSpec
from kvserving.worker.sampling import SamplingParams

# Tokens a decode step generates are the current turn's assistant text.
GENERATED_TAG = encode_tag("current", "text", "assistant")


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    """Prompt + generated tokens, their tags, and the pages holding their KV.

    ``page_ids`` are in token order: page i holds tokens [i*P, (i+1)*P).
    ``num_computed`` tokens have KV in those pages; the rest still need a
    forward pass (a prompt chunk, or the one token sampled last step).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    tags: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    page_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_prompt: int = 0  # prompt tokens served from the prefix cache at first admission
    page_hashes: list[int] = field(default_factory=list)  # chained hashes of the leading full pages
    # the token chain (page_pool.chain_hashes) of the leading full pages, hashed once per request: the
    # prefix-cache keys before a precision mark (KVCacheManager._token_chain_upto)
    token_chain: list[int] = field(default_factory=list)
    num_registered_pages: int = 0  # leading full pages already published to the prefix cache
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    arrival: int = 0  # admission order, for choosing whom to preempt
    queued: int = 0  # queue order (Scheduler.add), for how many may overtake an idle queue's head
    num_preemptions: int = 0
    # KV reuse (worker/kv/transfer.py): keep the full pages under a lease when finished;
    # the pin holding this request's pulled pages until admission; how many prompt tokens it pulled
    retain: RetainSpec | None = None
    admission_pin: str | None = None
    num_pulled_prompt: int = 0
    first_step_at: float | None = None  # perf_counter when a step first ran it (worker timings)
    # The tenant's salt of the prefix-cache hashes (page_pool.chain_hashes): its pages match only its own
    cache_salt: bytes | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without copying the whole sequence."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:end] + self.output_ids[: max(0, end - n)]

    def token_tags(self, start: int, end: int) -> list[int]:
        """Tags of tokens [start, end); generated tokens are current assistant text."""
        n = len(self.prompt_ids)
        return self.tags[start:end] + [GENERATED_TAG] * (max(n, end) - max(n, start))

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(slots=True)
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of ``seq`` run this step."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        # Logits are needed only once the chunk reaches the sequence's end.
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan: the chunks to run, in batch order, and who was preempted for room."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)
