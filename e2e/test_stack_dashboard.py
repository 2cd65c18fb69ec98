"""The whole local stack with a real Prometheus: `kvserving up`'s LocalStack
(gateway + prefill + decode workers + Debian's prometheus), a short agent
conversation through the official openai client, then EVERY PromQL
expression of the Grafana dashboard (operator/dashboard.py), with its
instance variables filled in, evaluated against that Prometheus: each must
return at least one series with a finite value (a label combination with no
traffic in the window, e.g. a quantile of reuse="no", may be NaN).
"""

from __future__ import annotations

import math
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvserving.local.agent_demo import run_conversation
from kvserving.config import KVCacheConfig, ModelConfig, ServingConfig
from kvserving.operator.dashboard import PANELS
from kvserving.local.stack import LocalStack, StackSpec, free_ports

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="prometheus not installed (`make test` installs Debian's package)"
)

NAMESPACE = INSTANCE = "local"  # the labels LocalStack's scrape config gives every target


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    from kvserving.model_dir import resolve_model_dir

    model = resolve_model_dir(ModelConfig())
    gateway, prefill, decode, prom = free_ports(4)
    config = ServingConfig(model=ModelConfig(path=str(model)), kv_cache=KVCacheConfig(dtype="nvfp4", memory_bytes=16 * 2**20))
    spec = StackSpec(
        config=config,
        gateway_port=gateway,
        prefill_port=prefill,
        decode_port=decode,
        prometheus_port=prom,
        run_dir=tmp_path_factory.mktemp("stack"),
    )
    with LocalStack(spec) as s:
        s.start()
        s.wait_ready(timeout_s=180)
        yield s


def _query(prom: str, expr: str) -> list[dict]:
    resp = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    body = resp.json()
    assert resp.status_code == 200 and body["status"] == "success", (expr, body)
    return list(body["data"]["result"])


def _wait_for_scrape(prom: str, expr: str, want: float, *, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = _query(prom, expr)
        if result and float(result[0]["value"][1]) >= want:
            return
        time.sleep(0.5)
    raise AssertionError(f"Prometheus did not see {expr} >= {want} within {timeout_s} s")


def test_every_dashboard_query_returns_finite_data(stack: LocalStack, tmp_path: Path) -> None:
    results = run_conversation(
        stack.openai_base_url, stack.spec.config.model.served_name, max_tokens=16, session_id="dashboard-e2e", timeout_s=120
    )
    assert len(results) >= 3 and results[-1].cached_tokens > 0
    prom = stack.prometheus_url
    assert prom is not None
    # every request counted by the gateway, scraped at least twice after the load (rates need two samples)
    _wait_for_scrape(prom, f'sum(kvserving_gateway_requests_total{{namespace="{NAMESPACE}"}})', len(results))
    # a rate needs a second scrape after the load: look until every panel has data (one scrape a
    # second; a loaded machine may scrape late, never wrongly)
    deadline = time.monotonic() + 60
    while True:
        empty, nonfinite = [], []
        for title, expr, _unit in PANELS:
            filled = expr.replace("$namespace", NAMESPACE).replace("$kvserving", INSTANCE)
            assert "$" not in re.sub(r"\{\{.*?\}\}", "", filled), filled
            series = _query(prom, filled)
            if not series:
                empty.append(title)
            elif not any(math.isfinite(float(s["value"][1])) for s in series):
                nonfinite.append((title, [s["value"][1] for s in series]))
        if (empty == [] and nonfinite == []) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert empty == [] and nonfinite == [], (empty, nonfinite)
