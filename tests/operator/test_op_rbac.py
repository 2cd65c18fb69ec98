"""RBAC derived from the code: every API call the operator makes is granted by
the ClusterRole, and the ClusterRole grants nothing the code does not use."""

from __future__ import annotations

import argparse
import asyncio
import types
from typing import Any

import kopf
import pytest
import yaml
from kvs_crd_tools import REPO, apply_defaults, load_sample, root_schema
from kvs_fake_api import FakeApiServer

from kvserving.operator import handlers, kube, rbac
from kvserving.operator.kube import KubeApi
from kvserving.operator.main import add_arguments, run
from kvserving.operator.reconcile import reconcile, refresh_status


RBAC_FILES = {"cluster": REPO / "manifests" / "rbac.yaml", "namespaced": REPO / "manifests" / "namespaced" / "rbac.yaml"}


def _docs(which: str = "cluster") -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(RBAC_FILES[which].read_text()) if d]


def _manifest(kind: str, which: str = "cluster") -> dict[str, Any]:
    (doc,) = [d for d in _docs(which) if d["kind"] == kind]
    return doc


def _granted() -> set[tuple[str, str, str]]:
    return {
        (verb, group, resource)
        for rule in _manifest("ClusterRole")["rules"]
        for verb in rule["verbs"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }


def _exercise_every_call() -> set[tuple[str, str, str]]:
    """Drive the reconciler through create, refresh, change, monitoring off,
    stale children, a cluster without prometheus-operator and a delete of a
    gone object."""
    body = apply_defaults(root_schema(), load_sample("nvfp4"))
    body["metadata"].update(uid="u1", generation=1)
    server = FakeApiServer()
    api = KubeApi(server)
    asyncio.run(reconcile(api, body, now="2026-11-29T10:00:00Z"))
    server.settle_deployments()
    asyncio.run(refresh_status(api, body, now="2026-11-29T10:00:01Z"))
    body["spec"]["monitoring"]["enabled"] = False
    body["spec"]["networkPolicy"]["enabled"] = False
    body["metadata"]["generation"] = 2
    asyncio.run(reconcile(api, body, now="2026-11-29T10:00:02Z"))
    # Children an older rendering left behind (owned, labelled, no longer rendered) are deleted.
    for plural, group in (("services", ""), ("deployments", "apps")):
        stale = server.objects[(group, plural, "default", "qwen3-nvfp4-prefill")]
        server.objects[(group, plural, "default", "qwen3-nvfp4-old")] = {
            **stale,
            "metadata": {**stale["metadata"], "name": "qwen3-nvfp4-old"},
        }
    server.writes.clear()
    asyncio.run(reconcile(api, body, now="2026-11-29T10:00:03Z"))
    assert sorted(w for w in server.writes if w[0] == "delete") == [
        ("delete", "deployments", "qwen3-nvfp4-old"),
        ("delete", "services", "qwen3-nvfp4-old"),
    ]
    asyncio.run(api.delete("Deployment", "default", "gone"))  # already gone: not an error
    asyncio.run(api.list_pods("default", {"app.kubernetes.io/instance": "qwen3-nvfp4"}))  # the KV-health sampler
    assert asyncio.run(api.read_secret("default", "qwen3-nvfp4-internal", "token"))  # ... and its credential
    # an owned Deployment changed: the handler reads its KVServing and refreshes the status
    server.put_kvserving(body)
    deployment = kopf.Body(server.objects[("apps", "deployments", "default", "qwen3-nvfp4-decode")])
    asyncio.run(handlers.deployment_changed(body=deployment, memo=types.SimpleNamespace(kube=api)))
    calls = set(server.calls)
    bare = FakeApiServer()
    bare.missing_groups.add("monitoring.coreos.com")
    asyncio.run(reconcile(KubeApi(bare), body, now="2026-11-29T10:00:03Z"))
    return calls | set(bare.calls)


def test_the_code_makes_exactly_the_declared_calls() -> None:
    assert _exercise_every_call() == set(kube.API_CALLS)


def test_an_undeclared_call_is_refused_before_it_is_made() -> None:
    server = FakeApiServer()
    with pytest.raises(ValueError, match="undeclared API call get apps/deployments"):
        asyncio.run(KubeApi(server)._call("get", kube.CHILD_RESOURCES["Deployment"], "/apis/apps/v1/namespaces/x/deployments/y"))
    assert server.calls == []


def test_cluster_role_grants_exactly_what_the_code_needs() -> None:
    needed = rbac.required_permissions()
    granted = _granted()
    assert needed - granted == set(), "missing from manifests/rbac.yaml"
    assert granted - needed == set(), "granted but never used"
    # what kopf itself needs for our handlers: watch the KVServings and patch
    # their annotations, watch our Deployments (status follows them), post Events
    assert needed - set(kube.API_CALLS) == {
        ("list", "kvserving.dev", "kvservings"),
        ("watch", "kvserving.dev", "kvservings"),
        ("patch", "kvserving.dev", "kvservings"),
        ("watch", "apps", "deployments"),
        ("create", "", "events"),
    }
    assert _manifest("ClusterRole")["rules"] == rbac.cluster_role_rules()


def test_no_wildcards_and_secrets_only_created_and_read() -> None:
    for verb, group, resource in _granted():
        assert "*" not in (verb, group, resource)
        assert resource not in ("pods/exec", "clusterroles", "clusterrolebindings", "roles", "rolebindings")
    # the internal credential: created once, read by the KV-health sampler; never listed, watched, changed or deleted
    assert {(v, r) for v, g, r in _granted() if r == "secrets"} == {("create", "secrets"), ("get", "secrets")}
    assert {v for v, g, r in _granted() if r == "networkpolicies"} == {"create", "patch", "list", "delete"}


def test_namespaced_role_grants_the_same_rules_in_its_namespace_only() -> None:
    docs = _docs("namespaced")
    assert sorted(d["kind"] for d in docs) == ["Role", "RoleBinding", "ServiceAccount"]
    role, binding, sa = (_manifest(k, "namespaced") for k in ("Role", "RoleBinding", "ServiceAccount"))
    assert role["rules"] == rbac.cluster_role_rules()
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == sa["metadata"]["namespace"] == "kvserving"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "kvserving"}]


def test_rbac_objects_per_watched_namespace() -> None:
    objs = rbac.rbac_objects(["team-a", "team-b"])
    assert [(o["kind"], o["metadata"].get("namespace")) for o in objs] == [
        ("ServiceAccount", "team-a"),
        ("Role", "team-a"),
        ("RoleBinding", "team-a"),
        ("Role", "team-b"),
        ("RoleBinding", "team-b"),
    ]
    assert all(
        o["subjects"] == [{"kind": "ServiceAccount", "name": "kvserving-operator", "namespace": "team-a"}]
        for o in objs
        if o["kind"] == "RoleBinding"
    )


def test_binding_ties_the_role_to_the_operators_service_account() -> None:
    binding = _manifest("ClusterRoleBinding")
    sa = _manifest("ServiceAccount")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": _manifest("ClusterRole")["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": sa["metadata"]["namespace"]}]
    (deployment,) = [d for d in yaml.safe_load_all((REPO / "manifests" / "operator.yaml").read_text())]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    assert deployment["metadata"]["namespace"] == sa["metadata"]["namespace"]


@pytest.mark.parametrize(("which", "args"), [("cluster", []), ("namespaced", ["--namespace", "kvserving"])])
def test_print_rbac_matches_the_manifest(which: str, args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(["--print-rbac", *args])) == 0
    assert [d for d in yaml.safe_load_all(capsys.readouterr().out) if d] == _docs(which)
