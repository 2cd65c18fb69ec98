"""The gateway's Prometheus metrics, created against a registry passed in.

The first three names are the dashboard's contract (operator/dashboard.py
DASHBOARD_METRICS, same name and type); the rest are for operators:

    kvserving_gateway_requests_total{route,code}          counter
    kvserving_gateway_time_to_first_token_seconds{route}  histogram
    kvserving_gateway_kv_reused_tokens_total{source}      counter   source: local | remote
    kvserving_gateway_requests_in_flight                  gauge
    kvserving_gateway_inter_token_latency_seconds         histogram
    kvserving_gateway_request_duration_seconds{route}     histogram
    kvserving_gateway_prompt_tokens_total                 counter
    kvserving_gateway_completion_tokens_total             counter
    kvserving_gateway_leases                              gauge     entries in the lease table
    kvserving_gateway_lease_lookups_total{result}         counter   hit | miss (a miss asked the decode workers)
    kvserving_gateway_lease_renewals_total                counter
    kvserving_gateway_lease_releases_total                counter
    kvserving_gateway_lease_expiries_total                counter
    kvserving_gateway_routing_decisions_total{role,reason} counter
    kvserving_gateway_upstream_errors_total{kind}         counter   connect | first_byte_timeout | unresponsive | event_timeout | timeout |
                                                                    status | stream | worker_error | draining
    kvserving_gateway_reuse_fallbacks_total{reason}       counter   holder_unresponsive: the lease holder was frozen or
                                                                    gone, the turn recomputed on another decode worker
    kvserving_gateway_workers_healthy{role}               gauge
    kvserving_gateway_conversation_identities_total{source} counter  x-session-id | ... | prompt_cache_key | user | prefix | new
    kvserving_gateway_prompt_reuse_total{part,result}     counter   part: tokens | labels | parse | render; result: hit | miss
    kvserving_gateway_prompt_prefix_tokens                gauge     tokens the kept prompt prefixes hold

The last two are read at scrape time from the tagger (`PromptReuse`): how much
of each chat prompt's tokenization, labels and marked-render parse came from
the previous turn's kept prefix, and how many prompts were marked only in the turn
they append (`render`, turn_render.py); a template that rewrites earlier turns shows
up as misses.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# Seconds; dense below 50 ms where the gateway's own overhead lives.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
DURATION_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class GatewayMetrics:
    """Every gateway metric, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        p = "kvserving_gateway_"
        self.requests = Counter(p + "requests", "Requests by route and HTTP status code", ["route", "code"], registry=registry)
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Time from request to first streamed token, by whether the prompt reused KV",
            ["route", "reuse"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        for route in ("chat", "completions"):  # series exist from the start: a first observation is a rate, not a jump
            for reuse in ("yes", "no"):
                self.ttft.labels(route, reuse)
        self.reused_tokens = Counter(
            p + "kv_reused_tokens",
            "Prompt tokens served from reused KV instead of recompute, by source",
            ["source"],
            registry=registry,
        )
        self.in_flight = Gauge(p + "requests_in_flight", "Requests being served", registry=registry)
        self.itl = BatchedHistogram(
            p + "inter_token_latency_seconds", "Time between streamed tokens", buckets=ITL_BUCKETS, registry=registry
        )
        self.duration = Histogram(
            p + "request_duration_seconds",
            "Time from request to its last byte",
            ["route"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of served requests", registry=registry)
        self.completion_tokens = Counter(p + "completion_tokens", "Tokens generated for clients", registry=registry)
        self.leases = Gauge(p + "leases", "Conversations in the lease table", registry=registry)
        self.lease_lookups = Counter(
            p + "lease_lookups", "Lease-table misses answered by the decode workers", ["result"], registry=registry
        )
        self.lease_renewals = Counter(p + "lease_renewals", "Leases renewed on their worker", registry=registry)
        self.lease_releases = Counter(p + "lease_releases", "Leases released (idle or superseded)", registry=registry)
        self.lease_expiries = Counter(p + "lease_expiries", "Leases that expired or their worker forgot", registry=registry)
        self.routing = Counter(p + "routing_decisions", "Routing decisions by role and reason", ["role", "reason"], registry=registry)
        self.upstream_errors = Counter(p + "upstream_errors", "Worker failures by kind", ["kind"], registry=registry)
        self.reuse_fallbacks = Counter(
            p + "reuse_fallbacks",
            "Turns whose retained KV could not be used, by reason (the prompt was recomputed)",
            ["reason"],
            registry=registry,
        )
        self.reuse_fallbacks.labels("holder_unresponsive")  # the series exists from the start
        self.identities = Counter(
            p + "conversation_identities", "How each request's conversation was identified", ["source"], registry=registry
        )
        self.exact_history = Counter(
            p + "exact_history",
            "Chat prompts that start with the previous turn's held ids (spliced) or as rendered",
            ["result"],
            registry=registry,
        )
        self.workers_healthy = Gauge(p + "workers_healthy", "Healthy workers by role", ["role"], registry=registry)

    # LeaseEvents (leases.LeaseKeeper)
    def lease_event(self, kind: str, n: int = 1) -> None:
        if kind in ("lookup_hit", "lookup_miss"):
            self.lease_lookups.labels(kind.removeprefix("lookup_")).inc(n)
            return
        {"renewed": self.lease_renewals, "released": self.lease_releases, "expired": self.lease_expiries}[kind].inc(n)

    def set_leases(self, n: int) -> None:
        self.leases.set(n)

    def upstream_error(self, kind: str) -> None:
        self.upstream_errors.labels(kind).inc()

    def reuse_fallback(self, reason: str) -> None:
        self.reuse_fallbacks.labels(reason).inc()

    def route(self, role: str, reason: str) -> None:
        self.routing.labels(role, reason).inc()


@dataclass(slots=True)
class RequestRecord:
    """What one request did, for its access-log line (app.Requests): filled while it runs by
    the worker client from what it sends and what the workers answer (``REQUEST``)."""

    conversation: str | None = None  # the conversation key as workers see it (a tenant-scoped digest)
    prompt_tokens: int | None = None
    computed_tokens: int | None = None  # prompt tokens computed this turn (the rest were reused)
    first_token_s: float | None = None  # perf_counter when the first token arrived


# The record of the request being served: set by the middleware for each request, seen by every
# task that request starts (they copy its context).
REQUEST: ContextVar[RequestRecord | None] = ContextVar("kvserving_gateway_request", default=None)


class ReuseCounts(Protocol):
    """What the tagger counts (`tagger.ChatTagger.reuse_counts`)."""

    def reuse_counts(self) -> tuple[dict[str, tuple[int, int]], int]: ...


class PromptReuse(Collector):
    """Scrape-time counters of the tagger's prompt-prefix reuse (nothing on the request path)."""

    def __init__(self, source: ReuseCounts) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        parts, tokens = self.source.reuse_counts()
        reuse = CounterMetricFamily(
            "kvserving_gateway_prompt_reuse",
            "Chat prompts whose tokens, labels or marked-render "
            "parse came from the previous turn's kept prefix (hit) or were done whole (miss)",
            labels=["part", "result"],
        )
        for part, (hits, misses) in parts.items():
            reuse.add_metric([part, "hit"], hits)
            reuse.add_metric([part, "miss"], misses)
        yield reuse
        yield GaugeMetricFamily("kvserving_gateway_prompt_prefix_tokens", "Tokens the kept prompt prefixes hold", value=tokens)


class BatchedHistogram(Collector):
    """A histogram without labels that takes a stream's values in one call (``observe_many``):
    the relay reports a response's inter-token gaps when it ends, not one ``observe`` per token
    (prometheus_client's costs a lock and a few us each). Exposed as a ``Histogram`` with the
    same buckets is: ``_bucket``, ``_count`` and ``_sum`` series. One event loop feeds it."""

    def __init__(self, name: str, documentation: str, *, buckets: Sequence[float], registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = [float(b) for b in buckets]
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf only)
        self.sum = 0.0
        registry.register(self)

    def observe_many(self, values: Iterable[float], *, zeros: int = 0) -> None:
        """Observe ``values`` and ``zeros`` more observations of 0.0."""
        bounds, counts = self.bounds, self.counts
        total = 0.0
        for v in values:
            counts[bisect.bisect_left(bounds, v)] += 1  # the first bucket whose bound is >= v, as prometheus_client
            total += v
        if zeros:
            counts[bisect.bisect_left(bounds, 0.0)] += zeros
        self.sum += total

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.documentation)

    def collect(self) -> Iterator[Metric]:
        buckets, seen = [], 0
        for bound, n in zip([*self.bounds, float("inf")], self.counts, strict=True):
            seen += n
            buckets.append((floatToGoString(bound), seen))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=self.sum)
