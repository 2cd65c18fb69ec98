"""The operator on a real cluster (e.g. kind): install with `kubectl apply -k
manifests/`, apply a sample, wait for its status, scale it, delete it.

Runs only when KUBECONFIG names a reachable cluster (see README, Operator);
the operator runs from the product image's CPU target (the root Dockerfile):

    docker build --target cpu -t kvserving-operator:e2e . && kind load docker-image kvserving-operator:e2e
    KUBECONFIG=~/.kube/config KVSERVING_E2E_IMAGE=kvserving-operator:e2e \\
        PYTHONSAFEPATH=1 .venv/bin/python -m pytest -q e2e/cluster

Worker pods need GPUs and the full image, so they are not expected to become
ready; the test checks what the operator owns: children, status, scaling,
garbage collection, and that the API server refuses invalid specs (CEL).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
OPERATOR_NS = "kvserving-system"


def _cluster_skip_reason() -> str | None:
    if not os.environ.get("KUBECONFIG"):
        return "no cluster given: set KUBECONFIG to a test cluster (e.g. kind) to run the operator e2e test"
    if shutil.which("kubectl") is None:
        return "kubectl not found on PATH"
    probe = subprocess.run(["kubectl", "version", "-o", "json"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0 or "serverVersion" not in probe.stdout:
        return f"cluster in KUBECONFIG not reachable: {probe.stderr.strip()[:200]}"
    return None


_REASON = _cluster_skip_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def kubectl(*args: str, input: str | None = None, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["kubectl", *args], input=input, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {proc.stderr}")
    return proc


def get_json(*args: str) -> dict[str, Any]:
    return json.loads(kubectl("get", *args, "-o", "json").stdout)


def wait_for(what: str, predicate: Any, timeout: float = 180) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except AssertionError as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(2)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


@pytest.fixture(scope="module")
def installed() -> Any:
    kubectl("apply", "-k", str(REPO / "manifests"))
    kubectl("wait", "--for=condition=Established", "crd/kvservings.kvserving.dev", "--timeout=60s")
    image = os.environ.get("KVSERVING_E2E_IMAGE")
    if image:
        kubectl("-n", OPERATOR_NS, "set", "image", "deployment/kvserving-operator", f"operator={image}")
    kubectl("-n", OPERATOR_NS, "rollout", "status", "deployment/kvserving-operator", "--timeout=180s", timeout=200)
    yield
    if not os.environ.get("KVSERVING_E2E_KEEP"):
        kubectl("delete", "-k", str(REPO / "manifests"), "--ignore-not-found", "--wait=false", check=False)


@pytest.fixture()
def namespace(installed: None) -> Any:
    name = f"kvs-e2e-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", name)
    yield name
    kubectl("delete", "namespace", name, "--wait=false", check=False)


def _sample(namespace: str) -> dict[str, Any]:
    body = yaml.safe_load((REPO / "manifests" / "samples" / "nvfp4.yaml").read_text())
    body["metadata"]["namespace"] = namespace
    body["spec"]["kvCache"]["allowOtherGPUs"] = True
    for role in ("prefill", "decode"):  # no GPU node pool in a test cluster, and small nodes
        body["spec"][role] = {
            "replicas": 1,
            "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "2Gi", "nvidia.com/gpu": 0}},
        }
    body["spec"]["model"].pop("pvcName")
    return body


def test_install_apply_scale_delete(namespace: str) -> None:
    body = _sample(namespace)
    name = body["metadata"]["name"]
    kubectl("apply", "-f", "-", input=yaml.safe_dump(body))

    def status_observed() -> dict[str, Any] | None:
        obj = get_json("kvs", name, "-n", namespace)
        status = obj.get("status") or {}
        return status if status.get("observedGeneration") == obj["metadata"]["generation"] else None

    status = wait_for("status of generation 1", status_observed)
    assert status["phase"] in ("Progressing", "Ready", "Degraded")
    assert [c["type"] for c in status["conditions"]] == ["Ready", "PrefillReady", "DecodeReady", "GatewayReady", "Progressing", "Degraded"]
    assert status["endpoint"] == f"http://{name}-gateway.{namespace}.svc:8080"
    assert status["kvBits"] == 4

    deployments = {d["metadata"]["name"]: d for d in get_json("deployments", "-n", namespace)["items"]}
    assert sorted(deployments) == [f"{name}-decode", f"{name}-gateway", f"{name}-prefill"]
    for dep in deployments.values():
        (ref,) = dep["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["controller"]) == ("KVServing", name, True)
        assert "affinity" not in dep["spec"]["template"]["spec"]  # allowOtherGPUs: no compute-capability affinity
    get_json("configmap", f"{name}-config", "-n", namespace)
    secret = get_json("secret", f"{name}-internal", "-n", namespace)  # the internal credential, owned by the KVServing
    assert secret["metadata"]["ownerReferences"][0]["uid"] == get_json("kvs", name, "-n", namespace)["metadata"]["uid"]
    policies = sorted(p["metadata"]["name"] for p in get_json("networkpolicies", "-n", namespace)["items"])
    assert policies == [f"{name}-gateway", f"{name}-workers"]

    # the API server refuses an invalid combination with the CEL rule's message
    bad = _sample(namespace)
    bad["spec"]["kvCache"]["bitBudget"] = 3.0
    refused = kubectl("apply", "-f", "-", input=yaml.safe_dump(bad), check=False)
    assert refused.returncode != 0 and "bitBudget is only valid with dtype triaxial" in refused.stderr

    kubectl("patch", "kvs", name, "-n", namespace, "--type=merge", "-p", json.dumps({"spec": {"decode": {"replicas": 3}}}))
    wait_for("decode Deployment scaled to 3", lambda: get_json("deployment", f"{name}-decode", "-n", namespace)["spec"]["replicas"] == 3)
    status = wait_for("status of generation 2", lambda: (s := status_observed()) and s["decode"]["replicas"] == 3 and s)
    assert status["decode"]["ready"].endswith("/3")
    printed = kubectl("get", "kvs", name, "-n", namespace).stdout
    assert "nvfp4" in printed and "/3" in printed

    kubectl("delete", "kvs", name, "-n", namespace, "--timeout=60s")
    wait_for(
        "children garbage-collected",
        lambda: not get_json("deployments", "-n", namespace)["items"] and not get_json("services", "-n", namespace)["items"],
    )
