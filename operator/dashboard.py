"""The Grafana dashboard of a KVServing, built in code so that its metric names
live in one list (``DASHBOARD_METRICS``).

DESIGN.md, Metrics: every panel must query a metric the worker or gateway
exports. The names below are the contract the gateway and worker metrics are
written against; a test checks every panel's query uses only these names, and
once the exporters exist a test can check each name is exported.
``manifests/grafana/kvserving-dashboard.json`` is this dashboard for any
instance (a test keeps the file equal to ``build_dashboard()``).
"""

from __future__ import annotations

import json
from typing import Any

# (metric, Prometheus type, what it counts) — base units, `_total` counters,
# `_seconds` histograms (DESIGN.md, Metrics).
DASHBOARD_METRICS: tuple[tuple[str, str, str], ...] = (
    ("kvserving_gateway_requests_total", "counter", "requests by route and HTTP status code"),
    ("kvserving_gateway_time_to_first_token_seconds", "histogram", "time from request to first streamed token"),
    ("kvserving_gateway_kv_reused_tokens_total", "counter", "prompt tokens served from reused KV instead of recompute"),
    ("kvserving_worker_prompt_tokens_total", "counter", "prompt tokens a worker computed (prefill)"),
    ("kvserving_worker_generation_tokens_total", "counter", "tokens a worker generated (decode)"),
    ("kvserving_worker_kv_cache_usage_ratio", "gauge", "used fraction of the KV pool"),
    ("kvserving_worker_kv_transfer_bytes_total", "counter", "KV bytes moved over NIXL, by direction"),
    ("kvserving_gateway_prompt_tokens_total", "counter", "prompt tokens of served requests"),
    ("kvserving_worker_kv_reuse_fallbacks_total", "counter", "KV reuses that fell back to recompute, by reason"),
    ("kvserving_worker_kv_leases", "gauge", "conversation KV leases a worker holds"),
    ("kvserving_worker_kv_pool_capacity_tokens", "gauge", "tokens a worker's KV pool holds, by precision"),
    ("kvserving_worker_kernel_compiles_total", "counter", "GPU kernels compiled, by phase: start (before ready) or serving"),
    ("kvserving_worker_first_token_requests_total", "counter", "requests that reached their first token on a worker"),
    ("kvserving_worker_first_token_phase_seconds_total", "counter", "time from admission to the first token, by phase"),
)

# (title, PromQL expression, unit); `$namespace` and `$kvserving` are dashboard
# variables, `kvserving` the target label the PodMonitor sets from the pods'
# app.kubernetes.io/instance label.
_SEL = 'namespace="$namespace", kvserving="$kvserving"'
_API = 'route=~"/v1/.+"'
PANELS: tuple[tuple[str, str, str], ...] = (
    # API routes only: /metrics scrapes and /ready, /health probes are no requests of users
    ("API requests / s", f"sum by (code) (rate(kvserving_gateway_requests_total{{{_SEL}, {_API}}}[5m]))", "reqps"),
    (
        "Time to first token p50, with and without KV reuse",
        f"histogram_quantile(0.5, sum by (le, reuse) (rate(kvserving_gateway_time_to_first_token_seconds_bucket{{{_SEL}}}[5m])))",
        "s",
    ),
    (
        "Time to first token p99, with and without KV reuse",
        f"histogram_quantile(0.99, sum by (le, reuse) (rate(kvserving_gateway_time_to_first_token_seconds_bucket{{{_SEL}}}[5m])))",
        "s",
    ),
    (
        "Reuse ratio (prompt tokens not recomputed)",
        f"sum(rate(kvserving_gateway_kv_reused_tokens_total{{{_SEL}}}[5m])) / sum(rate(kvserving_gateway_prompt_tokens_total{{{_SEL}}}[5m]))",
        "percentunit",
    ),
    ("Reused KV tokens / s", f"sum(rate(kvserving_gateway_kv_reused_tokens_total{{{_SEL}}}[5m]))", "short"),
    ("Prefill tokens / s", f"sum(rate(kvserving_worker_prompt_tokens_total{{{_SEL}}}[5m]))", "short"),
    ("Decode tokens / s", f"sum(rate(kvserving_worker_generation_tokens_total{{{_SEL}}}[5m]))", "short"),
    ("KV cache usage", f"max by (pod) (kvserving_worker_kv_cache_usage_ratio{{{_SEL}}})", "percentunit"),
    (
        "KV transfer bytes / s",
        f"sum by (direction) (rate(kvserving_worker_kv_transfer_bytes_total{{{_SEL}}}[5m]))",
        "Bps",
    ),
    ("Reuse fallbacks / s by reason", f"sum by (reason) (rate(kvserving_worker_kv_reuse_fallbacks_total{{{_SEL}}}[5m]))", "short"),
    ("Active KV leases", f"sum by (pod) (kvserving_worker_kv_leases{{{_SEL}}})", "short"),
    ("KV capacity by precision (tokens)", f"sum by (precision) (kvserving_worker_kv_pool_capacity_tokens{{{_SEL}}})", "short"),
    # where a worker's time from admission to a request's first token goes: the KV pull's phases, the add, the wait
    # for the step that runs it, that step (mean per request)
    (
        "Worker time to first token by phase (mean per request)",
        f"sum by (pod, phase) (rate(kvserving_worker_first_token_phase_seconds_total{{{_SEL}}}[5m])) / on (pod) group_left "
        f"sum by (pod) (rate(kvserving_worker_first_token_requests_total{{{_SEL}}}[5m]))",
        "s",
    ),
    # each one stalled a served step (the warm-up before /ready is meant to leave none)
    (
        "Kernels compiled while serving (per 15 min)",
        f'sum by (pod) (increase(kvserving_worker_kernel_compiles_total{{{_SEL}, phase="serving"}}[15m]))',
        "short",
    ),
)


def _variable(name: str, value: str | None, query: str) -> dict[str, Any]:
    if value is not None:  # one instance: a fixed value
        return {"name": name, "type": "constant", "query": value, "hide": 2}
    return {
        "name": name,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": query,
        "refresh": 2,
    }


def build_dashboard(*, namespace: str | None = None, instance: str | None = None) -> dict[str, Any]:
    """Dashboard JSON; with ``namespace``/``instance`` fixed to one KVServing, else chosen in Grafana."""
    panels = []
    for i, (title, expr, unit) in enumerate(PANELS):
        panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": title,
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [{"refId": "A", "expr": expr}],
            }
        )
    title = "kvserving" if instance is None else f"kvserving {namespace}/{instance}"
    uid = "kvserving" if instance is None else f"kvs-{namespace}-{instance}"[:40]
    return {
        "title": title,
        "uid": uid,
        "tags": ["kvserving"],
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus"},
                _variable("namespace", namespace, "label_values(kvserving_worker_kv_cache_usage_ratio, namespace)"),
                _variable(
                    "kvserving",
                    instance,
                    'label_values(kvserving_worker_kv_cache_usage_ratio{namespace="$namespace"}, kvserving)',
                ),
            ]
        },
        "panels": panels,
    }


def dashboard_json(*, namespace: str | None = None, instance: str | None = None) -> str:
    return json.dumps(build_dashboard(namespace=namespace, instance=instance), indent=2, sort_keys=True) + "\n"
