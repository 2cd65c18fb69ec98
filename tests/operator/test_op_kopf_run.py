"""The real kopf operator, in-process, against a fake HTTP API server: it
creates the children and the internal-credential Secret, reports Ready,
follows a spec change (the Secret keeps its value), and every API call it
makes — kopf's own included — is granted by manifests/rbac.yaml; watching one
namespace, the namespaced Role of manifests/namespaced/ suffices."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
import logging
import os
import time
from collections.abc import AsyncIterator
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


def _granted(path: Path = REPO / "manifests" / "rbac.yaml", kind: str = "ClusterRole") -> set[tuple[str, str, str]]:
    (role,) = [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == kind]
    return {(v, g, r) for rule in role["rules"] for v in rule["verbs"] for g in rule["apiGroups"] for r in rule["resources"]}


def _kubeconfig(tmp_path: Path, url: str) -> Path:
    config = tmp_path / "kubeconfig"
    config.write_text(
        yaml.safe_dump(
            {
                "current-context": "t",
                "contexts": [{"name": "t", "context": {"cluster": "c", "user": "u"}}],
                "clusters": [{"name": "c", "cluster": {"server": url}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
            }
        )
    )
    return config


def _token(api: FakeHttpApi, name: str) -> str | None:
    secret = api.get("", "secrets", "default", f"{name}-internal")
    return None if secret is None else base64.b64decode(secret["data"]["token"]).decode()


async def _until(what: str, predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def running_operator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sample: str, **scope: Any
) -> AsyncIterator[tuple[FakeHttpApi, str]]:
    """kopf running the operator's handlers against a fake API server that holds one defaulted
    KVServing of ``sample``; ``scope``: kopf.operator's clusterwide/namespaces. Stops both on exit."""
    body = apply_defaults(root_schema(), load_sample(sample))
    body["metadata"].update(uid="kvs-uid", generation=1)
    api = FakeHttpApi()
    api.start()
    monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path, api.url)))
    api.put("kvserving.dev", "kvservings", body)
    stop = asyncio.Event()
    operator = asyncio.create_task(kopf.operator(registry=handlers.registry, standalone=True, stop_flag=stop, **scope))
    try:
        yield api, body["metadata"]["name"]
    finally:
        stop.set()
        await asyncio.wait_for(operator, timeout=20)
        api.stop()


def test_kopf_operator_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)

    async def scenario() -> FakeHttpApi:
        async with running_operator(tmp_path, monkeypatch, "fp8_e4m3", clusterwide=True) as (api, name):

            def kvs() -> dict[str, Any]:
                return api.get("kvserving.dev", "kvservings", "default", name) or {}

            def status() -> dict[str, Any]:
                return kvs().get("status") or {}

            await _until("Ready at generation 1", lambda: status().get("observedGeneration") == 1 and status().get("phase") == "Ready")
            assert api.get("apps", "deployments", "default", f"{name}-decode") is not None
            assert status()["decode"]["ready"] == "1/1"
            token = _token(api, name)
            assert token is not None and len(token) == 43
            secret = api.get("", "secrets", "default", f"{name}-internal")
            assert secret is not None and secret["metadata"]["ownerReferences"] == [
                {"apiVersion": "kvserving.dev/v1alpha1", "kind": "KVServing", "name": name, "uid": "kvs-uid", "controller": True}
            ]

            changed = copy.deepcopy(kvs())
            changed["spec"]["decode"]["replicas"] = 3
            api.put("kvserving.dev", "kvservings", changed)
            await _until(
                "Ready at generation 2 with 3 decode workers",
                lambda: (
                    status().get("observedGeneration") == 2
                    and status().get("decode", {}).get("ready") == "3/3"
                    and status().get("phase") == "Ready"
                ),
            )
            assert api.get("apps", "deployments", "default", f"{name}-decode")["spec"]["replicas"] == 3
            assert not kvs()["metadata"].get("finalizers")  # deletion is left to garbage collection
            assert _token(api, name) == token  # kept across reconciles and the spec change
            # the value is nowhere but in the Secret: not in a ConfigMap, the status, an Event or a log line
            others = [o for (_, plural, _, _), o in api.objects.items() if plural != "secrets"]
            assert token not in json.dumps(others) + json.dumps(api.events) + caplog.text
            # garbage collection follows the owner reference: the Secret goes with the KVServing
            api.delete_with_dependents("kvserving.dev", "kvservings", "default", name)
            assert _token(api, name) is None
            assert api.get("apps", "deployments", "default", f"{name}-decode") is None
            await asyncio.sleep(0.5)
            assert _token(api, name) is None  # not made again for a KVServing that is gone
        return api

    api = asyncio.run(scenario())
    granted = _granted()
    assert api.calls - granted == set(), "the operator made calls its ClusterRole does not grant"
    # kopf's own calls were seen, not just ours
    assert {
        ("watch", "kvserving.dev", "kvservings"),
        ("watch", "apps", "deployments"),
        ("patch", "kvserving.dev", "kvservings"),
        ("patch", "kvserving.dev", "kvservings/status"),
        ("create", "apps", "deployments"),
    } <= api.calls


def test_kopf_operator_watching_one_namespace_needs_only_the_namespaced_role(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> FakeHttpApi:
        async with running_operator(tmp_path, monkeypatch, "triaxial", clusterwide=False, namespaces=["default"]) as (api, name):
            await _until(
                "Ready",
                lambda: ((api.get("kvserving.dev", "kvservings", "default", name) or {}).get("status") or {}).get("phase") == "Ready",
            )
            assert _token(api, name) is not None
            assert api.get("networking.k8s.io", "networkpolicies", "default", f"{name}-workers") is not None
        return api

    api = asyncio.run(scenario())
    assert api.calls - _granted(REPO / "manifests" / "namespaced" / "rbac.yaml", "Role") == set()
    # every call but API discovery is inside the watched namespace: a Role there grants them all
    namespaced = {p for p in api.paths - api.discovery_paths if "/namespaces/default/" in p}
    assert api.paths - api.discovery_paths - namespaced == set()
    assert any("/namespaces/default/kvservings" in p for p in namespaced)
