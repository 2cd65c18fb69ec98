"""Pure routing: which worker gets a turn's prefill and which its decode.

Policies (DESIGN.md, Gateway; issue 12, Routing):

- decode: the worker that holds the conversation's lease, when it is healthy
  and not overloaded (its KV is there, no transfer needed); else the least
  loaded healthy decode worker: fewest requests in flight, then fewest
  retained conversations, then the first by URL (so tests are exact).
- prefill: the worker chosen by rendezvous (highest-random-weight) hashing of
  the prompt's first pages, so every conversation that starts with the same
  system prompt lands on the same prefill worker and hits its prefix cache;
  unless that worker is busier than the least loaded one by more than
  ``slack`` requests, then the least loaded.
- ``both`` workers (local mode) take both parts of a turn in one request; the
  gateway routes a both-turn with the decode policy.
- Unhealthy workers are not candidates; when they become healthy again they
  are candidates again (the caller's view says which are healthy).

No I/O: the caller passes a snapshot of the workers and gets a decision.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

# How many leading tokens decide the prefill worker: a few pages of the
# system prompt, which agent frameworks share between conversations.
PREFIX_HASH_TOKENS = 64


@dataclass(slots=True, frozen=True)
class WorkerView:
    """One worker as the router sees it."""

    url: str
    healthy: bool
    inflight: int
    leases: int = 0  # conversations whose KV it retains (the gateway's count): KV it cannot give new ones


@dataclass(slots=True, frozen=True)
class Decision:
    """The chosen worker and why (the reason is a metric label)."""

    url: str
    reason: str  # "lease" | "least_loaded" | "prefix_hash" | "lease_overloaded"


def prefix_key(input_ids: Sequence[int], *, num_tokens: int = PREFIX_HASH_TOKENS) -> bytes:
    """A stable key of the prompt's first ``num_tokens`` tokens (its first pages)."""
    head = ",".join(str(t) for t in input_ids[:num_tokens])
    return hashlib.blake2b(head.encode(), digest_size=16).digest()


def _weight(key: bytes, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + url.encode(), digest_size=8).digest(), "big")


def _least_loaded(candidates: Sequence[WorkerView]) -> WorkerView:
    return min(candidates, key=lambda w: (w.inflight, w.leases, w.url))


def choose_decode(
    workers: Sequence[WorkerView], *, lease_url: str | None, max_inflight: int
) -> Decision | None:
    """The lease holder if usable, else the least loaded healthy worker; None if none is healthy."""
    healthy = [w for w in workers if w.healthy]
    if not healthy:
        return None
    if lease_url is not None:
        holder = next((w for w in healthy if w.url == lease_url), None)
        if holder is not None and holder.inflight < max_inflight:
            return Decision(holder.url, "lease")
        if holder is not None:
            return Decision(_least_loaded(healthy).url, "lease_overloaded")
    return Decision(_least_loaded(healthy).url, "least_loaded")


def choose_prefill(workers: Sequence[WorkerView], *, key: bytes, slack: int = 4) -> Decision | None:
    """The prefix-hash worker unless it is ``slack`` requests busier than the least loaded."""
    healthy = [w for w in workers if w.healthy]
    if not healthy:
        return None
    preferred = max(healthy, key=lambda w: _weight(key, w.url))
    least = _least_loaded(healthy)
    if preferred.inflight - least.inflight > slack:
        return Decision(least.url, "least_loaded")
    return Decision(preferred.url, "prefix_hash")
