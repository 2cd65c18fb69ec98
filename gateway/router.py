"""Pure routing: which worker gets a turn's prefill and which its decode.

Policies (DESIGN.md, Gateway; issue 12, Routing):

- decode: the worker that holds the conversation's lease, when it is healthy
  and not overloaded (its KV is there, no transfer needed); else the least
  loaded healthy decode worker: fewest requests in flight, then fewest
  retained conversations, then the first by URL (so tests are exact).
- prefill: consistent hashing with bounded loads. Rendezvous
  (highest-random-weight) hashing of the prompt's first pages orders the
  healthy workers, so every conversation that starts with the same system
  prompt prefers the same worker and hits its prefix cache; the first worker
  in that order whose load stays within the bound takes the turn: in flight
  + 1 (this request) <= ceil((1 + eps) * (total in flight + 1) / healthy
  workers), ``eps`` = ``PREFILL_LOAD_EPS``. No turn takes a worker over
  (1 + eps) x the mean load (rounded up), and a popular prefix overflows to
  its second, third ... choice in turn (each the same for every turn with
  that prefix), not to whichever worker happens to be idle.
- ``both`` workers (local mode) take both parts of a turn in one request; the
  gateway routes a both-turn with the decode policy.
- Unhealthy workers are not candidates; when they become healthy again they
  are candidates again (the caller's view says which are healthy).

No I/O: the caller passes a snapshot of the workers and gets a decision.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

# How many leading tokens decide the prefill worker: a few pages of the
# system prompt, which agent frameworks share between conversations.
PREFIX_HASH_TOKENS = 64

# Bounded-load slack of the prefill policy: a worker takes a turn while its load
# with the turn is at most (1 + eps) x the mean (rounded up). Smaller spreads
# load more evenly and moves more turns off their prefix's first choice. 0: the
# rounding up is slack enough at prefill loads (a few requests per worker), and
# with one system prompt shared by every agent (one key, one hash order) any
# eps > 0 leaves the last ~eps / (1 + eps) of the order idle under load: 3 of 16
# workers, TTFT p50 x2.8 in the simulator (docs/performance-log/simulate.md, "Prefill
# routing with bounded loads").
PREFILL_LOAD_EPS = 0.0


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
    reason: str  # "lease" | "least_loaded" | "prefix_hash" | "lease_overloaded" | "prefix_overflow"


def prefix_key(input_ids: Sequence[int], *, num_tokens: int = PREFIX_HASH_TOKENS) -> bytes:
    """A stable key of the prompt's first ``num_tokens`` tokens (its first pages)."""
    head = ",".join(str(t) for t in input_ids[:num_tokens])
    return hashlib.blake2b(head.encode(), digest_size=16).digest()


@functools.lru_cache(maxsize=1 << 16)
def _weight(key: bytes, url: str) -> int:
    # cached: a prompt prefix is ranked again on every turn of its conversations
    return int.from_bytes(hashlib.blake2b(key + url.encode(), digest_size=8).digest(), "big")


@functools.lru_cache(maxsize=1 << 14)
def _rendezvous_order(key: bytes, urls: tuple[str, ...]) -> tuple[int, ...]:
    """Indices of ``urls`` in rendezvous order of ``key``: highest weight first, then URL (a
    stable sort). Cached: every turn of a prefix ranks the same workers again."""
    return tuple(sorted(range(len(urls)), key=lambda i: (-_weight(key, urls[i]), urls[i])))


def _least_loaded(candidates: Sequence[WorkerView]) -> WorkerView:
    return min(candidates, key=lambda w: (w.inflight, w.leases, w.url))


def choose_decode(workers: Sequence[WorkerView], *, lease_url: str | None, max_inflight: int) -> Decision | None:
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


def prefill_load_bound(total_inflight: int, workers: int, *, eps: float = PREFILL_LOAD_EPS) -> int:
    """The most requests a prefill worker may hold with the new one: ceil((1 + eps) (total + 1) / workers)."""
    return math.ceil((1 + eps) * (total_inflight + 1) / workers)


def choose_prefill(workers: Sequence[WorkerView], *, key: bytes, eps: float = PREFILL_LOAD_EPS) -> Decision | None:
    """Consistent hashing with bounded loads over the healthy workers; None if none is healthy.

    The workers in rendezvous order of ``key`` (highest weight first, then URL); the first one
    with ``inflight + 1 <= prefill_load_bound(total in flight, healthy workers, eps)`` wins:
    reason "prefix_hash" when it is the key's first choice, "prefix_overflow" when the first
    choice was over the bound. One always qualifies: the least loaded holds at most the mean.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    healthy = [w for w in workers if w.healthy]
    if not healthy:
        return None
    bound = prefill_load_bound(sum([w.inflight for w in healthy]), len(healthy), eps=eps)
    order = _rendezvous_order(key, tuple([w.url for w in healthy]))
    first = healthy[order[0]]
    if first.inflight + 1 <= bound:
        return Decision(first.url, "prefix_hash")
    for i in order[1:]:
        w = healthy[i]
        if w.inflight + 1 <= bound:
            return Decision(w.url, "prefix_overflow")
    raise AssertionError("unreachable: the least loaded worker is within the bound")
