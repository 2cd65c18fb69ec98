"""The real kopf operator, in-process, against a fake HTTP API server: it
creates the children, reports Ready, follows a spec change, and every API call
it makes — kopf's own included — is granted by manifests/rbac.yaml."""

from __future__ import annotations

import asyncio
import copy
import os
import time
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from kvs_crd_tools import REPO, apply_defaults, load_sample, root_schema
from kvs_fake_http_api import FakeHttpApi

from kvserving.operator import handlers

pytestmark = pytest.mark.skipif(
    os.path.exists("/var/run/secrets/kubernetes.io/serviceaccount/token"),
    reason="running inside a pod: the service account would take precedence over the test kubeconfig",
)


def _granted() -> set[tuple[str, str, str]]:
    (role,) = [d for d in yaml.safe_load_all((REPO / "manifests" / "rbac.yaml").read_text()) if d["kind"] == "ClusterRole"]
    return {(v, g, r) for rule in role["rules"] for v in rule["verbs"] for g in rule["apiGroups"] for r in rule["resources"]}


async def _until(what: str, predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def test_kopf_operator_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    body = apply_defaults(root_schema(), load_sample("fp8_e4m3"))
    body["metadata"].update(uid="kvs-uid", generation=1)
    name = body["metadata"]["name"]

    async def scenario() -> FakeHttpApi:
        api = FakeHttpApi()
        api.start()
        config = tmp_path / "kubeconfig"
        config.write_text(yaml.safe_dump({
            "current-context": "t",
            "contexts": [{"name": "t", "context": {"cluster": "c", "user": "u"}}],
            "clusters": [{"name": "c", "cluster": {"server": api.url}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
        }))
        monkeypatch.setenv("KUBECONFIG", str(config))
        api.put("kvserving.dev", "kvservings", body)

        def kvs() -> dict[str, Any]:
            return api.get("kvserving.dev", "kvservings", "default", name) or {}

        def status() -> dict[str, Any]:
            return kvs().get("status") or {}

        stop = asyncio.Event()
        operator = asyncio.create_task(kopf.operator(registry=handlers.registry, standalone=True, clusterwide=True, stop_flag=stop))
        try:
            await _until("Ready at generation 1", lambda: status().get("observedGeneration") == 1 and status().get("phase") == "Ready")
            assert api.get("apps", "deployments", "default", f"{name}-decode") is not None
            assert status()["decode"]["ready"] == "1/1"

            changed = copy.deepcopy(kvs())
            changed["spec"]["decode"]["replicas"] = 3
            api.put("kvserving.dev", "kvservings", changed)
            await _until("Ready at generation 2 with 3 decode workers",
                         lambda: status().get("observedGeneration") == 2 and status().get("decode", {}).get("ready") == "3/3"
                         and status().get("phase") == "Ready")
            assert api.get("apps", "deployments", "default", f"{name}-decode")["spec"]["replicas"] == 3
            assert not kvs()["metadata"].get("finalizers")  # deletion is left to garbage collection
        finally:
            stop.set()
            await asyncio.wait_for(operator, timeout=20)
            api.stop()
        return api

    api = asyncio.run(scenario())
    granted = _granted()
    assert api.calls - granted == set(), "the operator made calls its ClusterRole does not grant"
    # kopf's own calls were seen, not just ours
    assert {("watch", "kvserving.dev", "kvservings"), ("watch", "apps", "deployments"), ("patch", "kvserving.dev", "kvservings"),
            ("patch", "kvserving.dev", "kvservings/status"), ("create", "apps", "deployments")} <= api.calls
