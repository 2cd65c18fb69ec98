"""The worker's Prometheus metrics, created against a registry passed in.

Names follow DESIGN.md (Metrics): ``kvserving_worker_`` prefix, base units,
``_total`` counters, ``_seconds`` histograms. The first four are the ones the
Grafana dashboard queries (``operator/dashboard.py DASHBOARD_METRICS``); a
test holds their names and types to that list.

Two kinds of updates:

- events, counted where they happen (a request finishes: tokens by source,
  a transfer ends: bytes, seconds, regions; a reuse falls back: its reason);
- engine state, copied from a ``KVStats`` snapshot when ``/metrics`` is
  scraped (pool use and capacity, leases, queue depth, and the engine's own
  counters: prompt tokens computed, preemptions, evicted pages, reclaimed leases, aged pages;
  the puller's: pulls skipped, tokens they missed, waits for free pages;
  stored bits per value with and without metadata, the bit budget and the controller's cut).

Kernel compiles are events too (``kernel_compiled``, from ``compiles.CompileWatch``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvserving.worker.compiles import PHASES, CompileEvent
from kvserving.worker.engine import STEP_KINDS
from kvserving.worker.kv.puller import FALLBACK_REASONS, PULL_PHASES, SKIP_REASONS
from kvserving.worker.kv_stats import KVStats

# Where a prompt token's KV came from.
TOKEN_SOURCES = ("local_cache", "remote_pull", "computed")
# A pull runs toward the worker that issues the NIXL READ.
DIRECTIONS = ("prefill_to_decode", "decode_to_prefill")
FINISH_REASONS = ("stop", "length", "abort", "error")
# Where a request's time from admission to its first token goes (``WorkerService._timings``): the pull's phases
# on its path (the sender calls beside its planning, ``contact_*``, are not), adding it to the engine, waiting
# for the step that first runs it, and that step.
FIRST_TOKEN_PHASES = (*(f"pull_{p}" for p in PULL_PHASES if not p.startswith("contact_")), "queue", "wait_step", "first_step")

_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_REGION_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)


class WorkerMetrics:
    """Every metric one worker exports; ``registry`` is the one ``/metrics`` serves."""

    def __init__(self, registry: CollectorRegistry, *, role: str) -> None:
        r = registry
        # -- the dashboard's four (names and types fixed by DASHBOARD_METRICS) --
        self.prompt_tokens = Counter("kvserving_worker_prompt_tokens_total", "prompt tokens a worker computed (prefill)", registry=r)
        self.generation_tokens = Counter("kvserving_worker_generation_tokens_total", "tokens a worker generated (decode)", registry=r)
        self.kv_cache_usage = Gauge("kvserving_worker_kv_cache_usage_ratio", "used fraction of the KV pool", registry=r)
        self.kv_transfer_bytes = Counter(
            "kvserving_worker_kv_transfer_bytes_total", "KV bytes moved over NIXL, by direction", ["direction"], registry=r
        )
        # -- reuse ------------------------------------------------------------------
        self.reuse_fallbacks = Counter(
            "kvserving_worker_kv_reuse_fallbacks_total",
            "KV reuses that fell back to recompute, by reason",
            ["reason"],
            registry=r,
        )
        self.pull_skips = Counter(
            "kvserving_worker_kv_pull_skips_total", "pulls that brought nothing without a fault, by reason", ["reason"], registry=r
        )
        self.pull_missed_tokens = Counter(
            "kvserving_worker_kv_pull_missed_tokens_total",
            "prompt tokens a pull planned and did not bring (computed instead), by skip or fallback reason",
            ["reason"],
            registry=r,
        )
        self.pulled_tokens_lost = Counter(
            "kvserving_worker_kv_pulled_tokens_lost_total",
            "prompt tokens a pull had in place (held or READ) and its request no longer found at admission "
            "(the admission pin yielded to pressure and the pages were evicted): computed instead",
            registry=r,
        )
        self.pull_page_waits = Counter(
            "kvserving_worker_kv_pull_page_waits_total", "pulls that found no free pages to READ into at once and waited", registry=r
        )
        self.pull_page_wait_seconds = Counter(
            "kvserving_worker_kv_pull_page_wait_seconds_total", "seconds pulls waited for free pages to READ into", registry=r
        )
        self.prompt_tokens_by_source = Counter(
            "kvserving_worker_prompt_tokens_by_source_total",
            "prompt tokens of finished requests by where their KV came from",
            ["source"],
            registry=r,
        )
        self.kv_transfer_seconds = Histogram(
            "kvserving_worker_kv_transfer_seconds",
            "wall time of one NIXL pull, by direction",
            ["direction"],
            buckets=_TRANSFER_BUCKETS,
            registry=r,
        )
        self.kv_transfer_regions = Histogram(
            "kvserving_worker_kv_transfer_regions",
            "contiguous memory regions (NIXL descriptors after merging) per pull",
            ["direction"],
            buckets=_REGION_BUCKETS,
            registry=r,
        )
        self.prefill_tokens_per_second = Gauge(
            "kvserving_worker_prefill_tokens_per_second", "measured prefill speed (recompute threshold 'auto')", registry=r
        )
        self.kv_transfer_bytes_per_second = Gauge(
            "kvserving_worker_kv_transfer_bytes_per_second", "measured NIXL pull speed (recompute threshold 'auto')", registry=r
        )
        # -- requests and engine state ---------------------------------------------
        self.requests = Counter(
            "kvserving_worker_requests_total", "finished generate requests by finish reason", ["finish_reason"], registry=r
        )
        self.preemptions = Counter(
            "kvserving_worker_preemptions_total", "sequences preempted (recomputed later) for lack of pages", registry=r
        )
        self.kv_evicted_pages = Counter("kvserving_worker_kv_evicted_pages_total", "cached KV pages evicted (LRU) to make room", registry=r)
        self.kv_reclaimed_leases = Counter(
            "kvserving_worker_kv_leases_reclaimed_total",
            "reclaimable pins (retained-KV leases; admission pins trimmed to nothing) released before expiry because live requests needed the pages",
            registry=r,
        )
        self.kv_admission_pages_trimmed = Counter(
            "kvserving_worker_kv_admission_pages_trimmed_total",
            "pulled KV pages whose admission pin gave them up (its tail) because a live request needed the pages",
            registry=r,
        )
        self.kv_aged_pages = Counter(
            "kvserving_worker_kv_pages_aged_total",
            "triaxial KV pages re-stored from 4 to 2 bits because a later request's tags wanted 2 (age-down)",
            registry=r,
        )
        self.kv_age_down_skipped_pages = Counter(
            "kvserving_worker_kv_age_down_skipped_pages_total",
            "triaxial KV pages a request matched at 4 bits and wanted at 2, kept at 4 for want of INT2 room once it was placed",
            registry=r,
        )
        self.kv_admissions_from_scratch = Counter(
            "kvserving_worker_kv_admissions_from_scratch_total",
            "admissions placed without any of the cached pages they matched (a placement fit only without them)",
            registry=r,
        )
        self.kv_admission_dropped_tokens = Counter(
            "kvserving_worker_kv_admission_dropped_tokens_total",
            "cached prompt tokens admissions gave up to be placed (from scratch, or keeping only the pages that stay held): computed again",
            registry=r,
        )
        self.steps = Counter(
            "kvserving_worker_steps_total", "engine steps by kind: decode (one token a row) or mixed (prompt chunks)", ["kind"], registry=r
        )
        self.step_seconds = Counter(
            "kvserving_worker_step_seconds_total",
            "wall time of engine steps by kind (over steps_total: the mean step)",
            ["kind"],
            registry=r,
        )
        self.kernel_compiles = Counter(
            "kvserving_worker_kernel_compiles_total",
            "GPU kernel specializations compiled (or loaded from Triton's disk cache), by phase: start (before "
            "ready, the warm-up included) or serving (a served step waited for it)",
            ["phase"],
            registry=r,
        )
        self.kernel_compile_seconds = Counter(
            "kvserving_worker_kernel_compile_seconds_total", "seconds spent in those compiles, by phase", ["phase"], registry=r
        )
        self.first_token_requests = Counter(
            "kvserving_worker_first_token_requests_total", "requests that reached their first token (or ended before one)", registry=r
        )
        self.first_token_seconds = Counter(
            "kvserving_worker_first_token_phase_seconds_total",
            "seconds from admission to the first token, by phase (FIRST_TOKEN_PHASES), summed over requests",
            ["phase"],
            registry=r,
        )
        self.queue_depth = Gauge("kvserving_worker_queue_depth", "sequences in the scheduler, by state", ["state"], registry=r)
        self.kv_leases = Gauge("kvserving_worker_kv_leases", "KV leases held now", registry=r)
        self.kv_leased_tokens = Gauge("kvserving_worker_kv_leased_tokens", "tokens of KV pinned by leases now", registry=r)
        self.kv_pool_capacity_tokens = Gauge(
            "kvserving_worker_kv_pool_capacity_tokens",
            "tokens the pool holds if every page has this precision",
            ["precision"],
            registry=r,
        )
        self.kv_pool_pages = Gauge(
            "kvserving_worker_kv_pool_pages",
            "pages by precision and state (capacity, owned, cached)",
            ["precision", "state"],
            registry=r,
        )
        self.kv_stored_bits = Gauge(
            "kvserving_worker_kv_stored_bits",
            "average bits per KV value over the pages the pool holds (owned and cached); "
            "metadata=included counts the fp16 scales and zeros (triaxial INT4 5, INT2 3), excluded the 4 / 2",
            ["metadata"],
            registry=r,
        )
        self.kv_owned_stored_bits = Gauge(
            "kvserving_worker_kv_owned_stored_bits",
            "average nominal bits per KV value over the pages running requests and leases own "
            "(what the bit-budget controller holds; cached pages left out)",
            registry=r,
        )
        self.kv_bit_budget = Gauge(
            "kvserving_worker_kv_bit_budget", "triaxial: the bit budget the pool is held to (0: a fixed table)", registry=r
        )
        self.kv_bits_cut = Gauge(
            "kvserving_worker_kv_bits_cut",
            "triaxial, bit_budget_control hold: ranked tag classes at 4 bits (the controller's cut)",
            registry=r,
        )
        self.info = Gauge("kvserving_worker_info", "1, labelled with the worker's role", ["role"], registry=r)
        self.info.labels(role=role).set(1)
        self.ready = Gauge("kvserving_worker_ready", "1 while the worker admits requests", registry=r)
        for reason in FALLBACK_REASONS:
            self.reuse_fallbacks.labels(reason=reason)
        for reason in SKIP_REASONS:
            self.pull_skips.labels(reason=reason)
        for reason in (*SKIP_REASONS, *FALLBACK_REASONS):
            self.pull_missed_tokens.labels(reason=reason)
        for source in TOKEN_SOURCES:
            self.prompt_tokens_by_source.labels(source=source)
        for direction in DIRECTIONS:
            self.kv_transfer_bytes.labels(direction=direction)
        for reason in FINISH_REASONS:
            self.requests.labels(finish_reason=reason)
        self._seen: dict[object, float] = {}  # each engine counter's value at the last ``observe`` (by child)
        for phase in PHASES:
            self.kernel_compiles.labels(phase=phase)
            self.kernel_compile_seconds.labels(phase=phase)
        for kind in STEP_KINDS:
            self.steps.labels(kind=kind)
            self.step_seconds.labels(kind=kind)
        for phase in FIRST_TOKEN_PHASES:
            self.first_token_seconds.labels(phase=phase)
        # the same counts as plain numbers, for GET /internal/kv/stats
        self.first_token_totals: dict[str, float] = dict.fromkeys(FIRST_TOKEN_PHASES, 0.0)
        self.first_token_count = 0
        self.prompt_token_totals = dict.fromkeys(TOKEN_SOURCES, 0)
        self.lost_before_admission_total = 0

    # ------------------------------------------------------------------- events
    def request_finished(self, *, finish_reason: str, local_cached: int, remote_pulled: int, computed: int, lost: int = 0) -> None:
        """``lost``: prompt tokens the request's pull had in place that were gone at its admission (computed)."""
        self.requests.labels(finish_reason=finish_reason).inc()
        if finish_reason == "abort":
            return  # aborted before it finished: where its prompt came from is not known
        self.pulled_tokens_lost.inc(lost)
        self.lost_before_admission_total += lost
        for source, n in zip(TOKEN_SOURCES, (local_cached, remote_pulled, computed)):
            self.prompt_tokens_by_source.labels(source=source).inc(n)
            self.prompt_token_totals[source] += n

    def first_token(self, timings_ms: Mapping[str, float]) -> None:
        """One request's ``timings`` (milliseconds by phase, ``WorkerService._timings``) into the phase counters;
        names outside ``FIRST_TOKEN_PHASES`` (the whole, the pull's sum, its sender calls) are not phases."""
        self.first_token_requests.inc()
        self.first_token_count += 1
        for phase in FIRST_TOKEN_PHASES:
            seconds = timings_ms.get(phase, 0.0) / 1e3
            if seconds > 0:
                self.first_token_seconds.labels(phase=phase).inc(seconds)
                self.first_token_totals[phase] += seconds

    def kernel_compiled(self, event: CompileEvent) -> None:
        """``CompileWatch``'s report: one compile, in its phase."""
        self.kernel_compiles.labels(phase=event.phase).inc()
        self.kernel_compile_seconds.labels(phase=event.phase).inc(event.seconds)

    def transfer_done(self, *, direction: str, num_bytes: int, seconds: float, regions: int) -> None:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        self.kv_transfer_bytes.labels(direction=direction).inc(num_bytes)
        self.kv_transfer_seconds.labels(direction=direction).observe(seconds)
        self.kv_transfer_regions.labels(direction=direction).observe(regions)

    # ------------------------------------------------------------ engine state
    def observe(self, stats: KVStats) -> None:
        """Copy an engine snapshot into the gauges; move the engine's counters by their growth."""
        self._grow(self.prompt_tokens, stats.prompt_tokens_computed)
        self._grow(self.preemptions, stats.preemptions)
        self._grow(self.kv_evicted_pages, stats.evicted_pages)
        self._grow(self.kv_reclaimed_leases, stats.reclaimed_leases)
        self._grow(self.kv_admission_pages_trimmed, stats.admission_pages_trimmed)
        self._grow(self.kv_aged_pages, stats.aged_pages)
        self._grow(self.kv_age_down_skipped_pages, stats.age_down_skipped_pages)
        self._grow(self.kv_admissions_from_scratch, stats.admissions_from_scratch)
        self._grow(self.kv_admission_dropped_tokens, stats.admission_dropped_tokens)
        for kind, count in stats.step_counts.items():
            self._grow(self.steps.labels(kind=kind), count)
            self._grow(self.step_seconds.labels(kind=kind), stats.step_seconds[kind])
        self.kv_cache_usage.set(stats.usage_ratio)
        self.queue_depth.labels(state="running").set(stats.running)
        self.queue_depth.labels(state="waiting").set(stats.waiting)
        nan = float("nan")  # no page held: no average
        self.kv_stored_bits.labels(metadata="excluded").set(nan if stats.stored_bits is None else stats.stored_bits)
        self.kv_stored_bits.labels(metadata="included").set(
            nan if stats.stored_bits_with_metadata is None else stats.stored_bits_with_metadata
        )
        self.kv_owned_stored_bits.set(nan if stats.owned_stored_bits is None else stats.owned_stored_bits)
        self.kv_bit_budget.set(stats.bit_budget or 0.0)
        self.kv_bits_cut.set(stats.bits_cut if stats.bits_cut is not None else nan)
        for name, p in stats.precisions.items():
            self.kv_pool_capacity_tokens.labels(precision=name).set(p.capacity_tokens)
            self.kv_pool_pages.labels(precision=name, state="capacity").set(p.capacity_pages)
            self.kv_pool_pages.labels(precision=name, state="owned").set(p.owned_pages)
            self.kv_pool_pages.labels(precision=name, state="cached").set(p.cached_pages)

    def _grow(self, counter: Counter, value: float) -> None:
        """Move ``counter`` by what the engine's own count ``value`` grew since the last look (never back)."""
        seen = self._seen.get(counter, 0)
        counter.inc(max(0, value - seen))
        self._seen[counter] = max(seen, value)

    def observe_transfer(self, counters: Mapping[str, Any]) -> None:
        """Copy ``KVTransfer.stats()`` in: leases, the two "auto" threshold measurements (0 until
        measured); move the pull fallback, skip, missed-token and page-wait counters by their growth."""
        self.kv_leases.set(counters["leases"])
        self.kv_leased_tokens.set(counters["leased_tokens"])
        self.prefill_tokens_per_second.set(counters["prefill_tokens_per_s"] or 0.0)
        self.kv_transfer_bytes_per_second.set(counters["transfer_bytes_per_s"] or 0.0)
        for reason, n in counters["fallbacks"].items():
            self._grow(self.reuse_fallbacks.labels(reason=reason), n)
        for reason, n in counters["skips"].items():
            self._grow(self.pull_skips.labels(reason=reason), n)
        for reason, n in counters["missed_tokens"].items():
            self._grow(self.pull_missed_tokens.labels(reason=reason), n)
        self._grow(self.pull_page_waits, counters["page_waits"])
        self._grow(self.pull_page_wait_seconds, counters["page_wait_seconds"])
