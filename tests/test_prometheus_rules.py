"""manifests/prometheus-rules.yaml: promtool accepts the rules, and each alert
fires on the series it is for and stays quiet on a healthy neighbour
(`promtool test rules`, from Debian's prometheus package, which `make test`
installs when missing)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvserving.operator.dashboard import DASHBOARD_METRICS

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "manifests" / "prometheus-rules.yaml"

UNIT_TESTS = """
rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      # a: half of the requests fall back; b: 5 % do
      - series: 'kvserving_worker_kv_reuse_fallbacks_total{namespace="team",kvserving="a",reason="transfer_timeout",pod="a-decode-0"}'
        values: '0+60x30'
      - series: 'kvserving_gateway_requests_total{namespace="team",kvserving="a",route="/v1/chat/completions",code="200",pod="a-gateway-0"}'
        values: '0+120x30'
      # scrapes and probes are no requests: counted, a's ratio would fall under the threshold
      - series: 'kvserving_gateway_requests_total{namespace="team",kvserving="a",route="/metrics",code="200",pod="a-gateway-0"}'
        values: '0+600x30'
      - series: 'kvserving_worker_kv_reuse_fallbacks_total{namespace="team",kvserving="b",reason="lease_expired",pod="b-decode-0"}'
        values: '0+6x30'
      - series: 'kvserving_gateway_requests_total{namespace="team",kvserving="b",route="/v1/completions",code="200",pod="b-gateway-0"}'
        values: '0+120x30'
      # a's decode pool is 97 % full; b's half
      - series: 'kvserving_worker_kv_cache_usage_ratio{namespace="team",kvserving="a",pod="a-decode-0"}'
        values: '0.97x30'
      - series: 'kvserving_worker_kv_cache_usage_ratio{namespace="team",kvserving="b",pod="b-decode-0"}'
        values: '0.5x30'
      # a: both decode workers down; b: one of two up
      - series: 'up{namespace="team",kvserving="a",component="decode",pod="a-decode-0"}'
        values: '0x30'
      - series: 'up{namespace="team",kvserving="a",component="decode",pod="a-decode-1"}'
        values: '0x30'
      - series: 'up{namespace="team",kvserving="b",component="decode",pod="b-decode-0"}'
        values: '0x30'
      - series: 'up{namespace="team",kvserving="b",component="decode",pod="b-decode-1"}'
        values: '1x30'
      # a's prefill worker compiled a kernel in a served step at minute 10; b's compiled only before ready
      - series: 'kvserving_worker_kernel_compiles_total{namespace="team",kvserving="a",phase="serving",pod="a-prefill-0"}'
        values: '0x10 1x20'
      - series: 'kvserving_worker_kernel_compiles_total{namespace="team",kvserving="b",phase="serving",pod="b-prefill-0"}'
        values: '0x30'
      - series: 'kvserving_worker_kernel_compiles_total{namespace="team",kvserving="b",phase="start",pod="b-prefill-0"}'
        values: '40x30'
    alert_rule_test:
      - eval_time: 20m
        alertname: KVServingReuseFallbacksHigh
        exp_alerts:
          - exp_labels: {severity: warning, namespace: team, kvserving: a}
            exp_annotations:
              summary: "team/a: 50% of requests fall back to recompute"
              description: KV reuse keeps failing (see kvserving_worker_kv_reuse_fallbacks_total by reason); agents pay a full prefill every turn.
      - eval_time: 5m
        alertname: KVServingReuseFallbacksHigh
        exp_alerts: []
      - eval_time: 20m
        alertname: KVServingKVPoolNearlyFull
        exp_alerts:
          - exp_labels: {severity: warning, namespace: team, kvserving: a, pod: a-decode-0}
            exp_annotations:
              summary: "team/a a-decode-0: KV pool 97% full"
              description: Add decode replicas, lower retentionTTLSeconds, or use a denser kvCache.dtype.
      - eval_time: 5m
        alertname: KVServingNoReadyDecodeWorker
        exp_alerts:
          - exp_labels: {severity: critical, namespace: team, kvserving: a}
            exp_annotations:
              summary: "team/a: no decode worker is up"
              description: Every decode worker of this KVServing is down or unreachable; requests get 503.
      - eval_time: 9m
        alertname: KVServingKernelCompiledWhileServing
        exp_alerts: []
      - eval_time: 12m
        alertname: KVServingKernelCompiledWhileServing
        exp_alerts:
          - exp_labels: {severity: info, namespace: team, kvserving: a, pod: a-prefill-0}
            exp_annotations:
              summary: "team/a a-prefill-0: kernels compiled while serving (1 in 15 min)"
              description: Served turns waited for GPU kernel compiles that the warm-up did not cover; the worker's log names each kernel ("compiled while serving").
"""


def _promtool() -> str:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool not found: `make test` installs Debian's prometheus package")
    return binary


def _rules_file(tmp_path: Path) -> Path:
    doc = yaml.safe_load(RULES.read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(doc["spec"]))
    return path


def test_promtool_checks_the_rules(tmp_path: Path) -> None:
    result = subprocess.run([_promtool(), "check", "rules", str(_rules_file(tmp_path))], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 6 rules found" in result.stdout


def test_each_alert_fires_on_its_condition_only(tmp_path: Path) -> None:
    _rules_file(tmp_path)
    tests = tmp_path / "tests.yaml"
    tests.write_text(UNIT_TESTS)
    result = subprocess.run([_promtool(), "test", "rules", str(tests)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_use_exported_metric_names() -> None:
    names = set(re.findall(r"\bkvserving_(?:worker|gateway)_[a-z_]+", RULES.read_text()))
    known = {name for name, _, _ in DASHBOARD_METRICS} | {
        "kvserving_worker_kv_reuse_fallbacks_total",
        "kvserving_worker_kernel_compiles_total",
    }
    assert names and names <= known, names - known
