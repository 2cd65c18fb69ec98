"""Metrics: every gateway metric of the dashboard exported with its name and
type, and the counters move by what happened."""

from __future__ import annotations

import httpx
import openai
import pytest
from gw_harness import MODEL, Stack
from kvs_poll import wait_until
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvserving.gateway.metrics import ITL_BUCKETS, BatchedHistogram
from kvserving.operator.dashboard import DASHBOARD_METRICS


def families(url: str) -> dict[str, str]:
    text = httpx.get(url + "/metrics", timeout=5).text
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def test_every_dashboard_gateway_metric_is_exported_with_its_type(stack: Stack) -> None:
    worker = stack.worker(role="both")
    gw = stack.gateway(decode=[worker.url])
    openai.OpenAI(base_url=gw.base_url, api_key="x", max_retries=0).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}]
    )
    exported = families(gw.url)
    wanted = [(name, kind) for name, kind, _ in DASHBOARD_METRICS if name.startswith("kvserving_gateway_")]
    assert len(wanted) == 4
    for name, kind in wanted:
        base = name.removesuffix("_total") if kind == "counter" else name
        assert exported.get(base) == kind, (name, exported.get(base))
    for name, kind in [
        ("kvserving_gateway_requests_in_flight", "gauge"),
        ("kvserving_gateway_inter_token_latency", "histogram"),
        ("kvserving_gateway_leases", "gauge"),
        ("kvserving_gateway_lease_renewals", "counter"),
        ("kvserving_gateway_lease_releases", "counter"),
        ("kvserving_gateway_lease_expiries", "counter"),
        ("kvserving_gateway_routing_decisions", "counter"),
        ("kvserving_gateway_upstream_errors", "counter"),
        ("kvserving_gateway_reuse_fallbacks", "counter"),
        ("kvserving_gateway_prompt_reuse", "counter"),
        ("kvserving_gateway_prompt_prefix_tokens", "gauge"),
    ]:
        name = name + "_seconds" if kind == "histogram" else name
        assert exported.get(name) == kind, name


def test_counters_move_by_what_happened(stack: Stack) -> None:
    worker = stack.worker(role="both", reply_ids=[11, 12, 13])
    gw = stack.gateway(decode=[worker.url])
    c = openai.OpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
    for _ in range(2):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True))
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    route = "/v1/chat/completions"
    assert gw.metric("kvserving_gateway_requests_total", {"route": route, "code": "200"}) == 3
    assert gw.metric("kvserving_gateway_requests_total", {"route": route, "code": "404"}) == 1
    ttft = {
        r: gw.metric("kvserving_gateway_time_to_first_token_seconds_count", {"route": "chat", "reuse": r}) for r in ("yes", "no", "unknown")
    }
    assert sum(ttft.values()) == 3 and ttft["unknown"] == 0  # each observed once its reuse was known
    assert gw.metric("kvserving_gateway_inter_token_latency_seconds_count") == 3 * 2
    assert gw.metric("kvserving_gateway_completion_tokens_total") == 9
    decisions = sum(
        gw.metric("kvserving_gateway_routing_decisions_total", {"role": "decode", "reason": r})
        for r in ("least_loaded", "lease", "lease_overloaded")
    )
    assert decisions == 3
    # decremented after the last byte
    wait_until(lambda: gw.metric("kvserving_gateway_requests_in_flight") == 0, what="no request in flight")
    httpx.get(gw.url + "/metrics", timeout=5)
    assert gw.metric("kvserving_gateway_workers_healthy", {"role": "both"}) == 1


def test_prompt_reuse_counts_the_turns_that_extended_a_kept_prefix(stack: Stack) -> None:
    """A conversation's second turn tokenizes, labels and parses only what its first
    turn's prompt did not have; a new conversation with another system prompt does all."""
    worker = stack.worker(role="both", reply_ids=[11, 12, 13])
    gw = stack.gateway(decode=[worker.url])
    c = openai.OpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "list the files"}]
    reply = c.chat.completions.create(model=MODEL, messages=messages).choices[0].message.content
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "now read setup.py"}]
    c.chat.completions.create(model=MODEL, messages=messages)
    c.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Another agent."}, {"role": "user", "content": "hi"}])

    def reuse(part: str, result: str) -> float:
        return gw.metric("kvserving_gateway_prompt_reuse_total", {"part": part, "result": result})

    for part in ("tokens", "labels", "parse"):
        assert (reuse(part, "hit"), reuse(part, "miss")) == (1, 2), part
    assert gw.metric("kvserving_gateway_prompt_prefix_tokens") > 0


def test_a_batched_histogram_exports_what_a_histogram_fed_one_value_at_a_time_exports() -> None:
    """The relay's inter-token histogram takes a response's gaps in one call: its exposition
    (buckets, count, sum) equals prometheus_client's Histogram observing each value, zeros too."""
    values = [0.0004, 0.0005, 0.0007, 0.001, 0.02, 0.3, 2.5, 7.0]
    batched_registry, reference_registry = CollectorRegistry(), CollectorRegistry()
    batched = BatchedHistogram("itl_seconds", "gaps", buckets=ITL_BUCKETS, registry=batched_registry)
    reference = Histogram("itl_seconds", "gaps", buckets=ITL_BUCKETS, registry=reference_registry)
    batched.observe_many(values[:3], zeros=2)
    batched.observe_many(values[3:])
    for v in [*values, 0.0, 0.0]:
        reference.observe(v)

    def samples(registry: CollectorRegistry) -> list[tuple[str, dict[str, str], float]]:
        text = generate_latest(registry).decode()
        return [
            (s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples if not s.name.endswith("_created")
        ]

    assert samples(batched_registry) == samples(reference_registry)
    assert batched_registry.get_sample_value("itl_seconds_count") == len(values) + 2
