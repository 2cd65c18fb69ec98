"""manifests/: every object validates against the Kubernetes schema, the
kustomization installs CRD + operator + RBAC + dashboard, and the operator
Deployment runs `kvserving operator` as DESIGN.md's command line says."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kvs_crd_tools import REPO, SAMPLES

from kvserving.operator.main import add_arguments, run

MANIFESTS = REPO / "manifests"
K8S_VERSION = "1.37"


def _kustomize_resources(root: Path) -> list[Path]:
    """Files a kustomization lists, following directories that are kustomizations themselves."""
    files = []
    for entry in yaml.safe_load((root / "kustomization.yaml").read_text())["resources"]:
        path = (root / entry).resolve()
        files += _kustomize_resources(path) if path.is_dir() else [path]
    return files


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_kustomization_lists_existing_files_and_covers_everything() -> None:
    files = _kustomize_resources(MANIFESTS)
    assert all(f.exists() for f in files)
    kinds = sorted(d["kind"] for f in files for d in _docs(f))
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Deployment", "Namespace", "ServiceAccount"]
    (gen,) = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())["configMapGenerator"]
    assert all((MANIFESTS / f).exists() for f in gen["files"])


@pytest.mark.parametrize("path", sorted(p.relative_to(REPO).as_posix() for p in _kustomize_resources(MANIFESTS)))
def test_every_manifest_validates(path: str) -> None:
    for doc in _docs(REPO / path):
        assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == K8S_VERSION


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed: kustomize build not checked")
def test_kubectl_kustomize_builds_valid_objects() -> None:
    out = subprocess.run(["kubectl", "kustomize", str(MANIFESTS)], capture_output=True, text=True, check=True, timeout=60).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert sorted(by_kind) == [
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "CustomResourceDefinition",
        "Deployment",
        "Namespace",
        "ServiceAccount",
    ]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    dashboard = by_kind["ConfigMap"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"]["kvserving-dashboard.json"] == (MANIFESTS / "grafana" / "kvserving-dashboard.json").read_text()
    # YAML anchors in the CRD expand identically through kustomize
    assert by_kind["CustomResourceDefinition"]["spec"] == yaml.safe_load((REPO / "crds" / "kvserving.yaml").read_text())["spec"]


NAMESPACED = MANIFESTS / "namespaced"


def test_namespaced_kustomization_has_no_cluster_wide_permission() -> None:
    files = _kustomize_resources(NAMESPACED)
    assert all(f.exists() for f in files)
    kinds = sorted(d["kind"] for f in files for d in _docs(f))
    assert kinds == ["CustomResourceDefinition", "Deployment", "Role", "RoleBinding", "ServiceAccount"]
    assert yaml.safe_load((NAMESPACED / "kustomization.yaml").read_text())["namespace"] == "kvserving"
    for f in files:
        for doc in _docs(f):
            assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == K8S_VERSION


def test_namespaced_operator_watches_its_own_namespace() -> None:
    (cluster,) = _docs(MANIFESTS / "operator.yaml")
    (namespaced,) = _docs(NAMESPACED / "operator.yaml")
    (c,) = namespaced["spec"]["template"]["spec"]["containers"]
    assert c["args"] == ["--liveness-port", "8081", "--namespace", "$(POD_NAMESPACE)"]
    assert {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}} in c["env"]
    # otherwise the same Deployment
    c.pop("args"), c.pop("env")
    (base,) = cluster["spec"]["template"]["spec"]["containers"]
    base.pop("args"), base.pop("env")
    namespaced["metadata"].pop("namespace"), cluster["metadata"].pop("namespace")
    assert namespaced == cluster
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--liveness-port", "8081", "--namespace", "team-a"]).namespace == ["team-a"]


def test_operator_deployment() -> None:
    (dep,) = _docs(MANIFESTS / "operator.yaml")
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"] == {"type": "Recreate"}  # standalone kopf: never two at once
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["kvserving", "operator"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert c["args"] == ["--liveness-port", "8081"]
    assert c["ports"][0]["containerPort"] == 8081
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(c["args"])
    assert (args.liveness_port, args.namespace) == (8081, [])


def test_samples_are_not_in_the_kustomization() -> None:
    """A KVServing cannot be applied in the same apply that creates its CRD."""
    listed = set(_kustomize_resources(MANIFESTS))
    assert not listed & {p.resolve() for p in SAMPLES.values()}


def test_render_command_prints_the_children(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(["--render", str(SAMPLES["triaxial"])])) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [f"{d['kind']}/{d['metadata']['name']}" for d in docs] == [
        "ConfigMap/qwen3-triaxial-config",
        "Service/qwen3-triaxial-prefill",
        "Deployment/qwen3-triaxial-prefill",
        "Service/qwen3-triaxial-decode",
        "Deployment/qwen3-triaxial-decode",
        "Service/qwen3-triaxial-gateway",
        "Deployment/qwen3-triaxial-gateway",
        "NetworkPolicy/qwen3-triaxial-workers",
        "NetworkPolicy/qwen3-triaxial-gateway",
        "PodMonitor/qwen3-triaxial",
        "ConfigMap/qwen3-triaxial-dashboard",
    ]


def test_render_shows_the_secret_mounts_the_limits_and_the_network_policies(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(["--render", str(SAMPLES["triaxial"])])) == 0
    out = capsys.readouterr().out
    assert out.startswith("# Secret/qwen3-triaxial-internal (key 'token'): made once by the operator")
    docs = {f"{d['kind']}/{d['metadata']['name']}": d for d in yaml.safe_load_all(out)}
    for role in ("prefill", "decode", "gateway"):
        pod = docs[f"Deployment/qwen3-triaxial-{role}"]["spec"]["template"]["spec"]
        assert {"name": "internal-token", "mountPath": "/var/run/kvserving/internal", "readOnly": True} in pod["containers"][0][
            "volumeMounts"
        ]
        limits = pod["containers"][0]["resources"]["limits"]
        assert {"cpu", "memory"} <= limits.keys()
    gateway = docs["Deployment/qwen3-triaxial-gateway"]["spec"]["template"]["spec"]
    assert {"name": "api-keys", "mountPath": "/var/run/kvserving/api-keys", "readOnly": True} in gateway["containers"][0]["volumeMounts"]
    assert docs["NetworkPolicy/qwen3-triaxial-workers"]["spec"]["policyTypes"] == ["Ingress", "Egress"]
    for doc in docs.values():
        if doc["kind"] != "PodMonitor":
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_render_refuses_a_limit_below_its_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    body = yaml.safe_load(SAMPLES["fp8_e4m3"].read_text())
    body["spec"]["decode"]["resources"] = {"requests": {"memory": "80Gi"}}
    path = tmp_path / "kvs.yaml"
    path.write_text(yaml.safe_dump(body))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(["--render", str(path)])) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"kvserving operator: error: {path}: spec.decode.resources.limits.memory: 64Gi is below the request 80Gi\n"


def test_cli_has_the_operator_subcommand() -> None:
    from kvserving.cli import COMMANDS

    assert COMMANDS["operator"] == ("kvserving.operator.main", "run the kopf operator")
