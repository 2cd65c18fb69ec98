"""Pure rendering: golden objects per sample, exact container contract, a spec
change changes exactly what it should, every object validates against the
Kubernetes schema."""

from __future__ import annotations

import copy
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kvs_crd_tools import REPO, SAMPLES, apply_defaults, load_sample, root_schema

from kvserving.config import ServingConfig
from kvserving.operator.dashboard import DASHBOARD_METRICS, PANELS, build_dashboard, dashboard_json
from kvserving.operator.render import APPLIED_HASH, CONFIG_HASH, Owner, Rendered, internal_secret, render

GOLDEN = Path(__file__).parent / "golden"
K8S_VERSION = "1.37"
UID = "0b6f4a1e-5d2c-4c7e-9a43-6f1d2e3c4b5a"


def _render_sample(name: str, mutate: Any = None) -> Rendered:
    body = apply_defaults(root_schema(), load_sample(name))
    if mutate is not None:
        mutate(body["spec"])
    meta = body["metadata"]
    return render(body["spec"], owner=Owner(name=meta["name"], namespace=meta["namespace"], uid=UID))


def _by_key(rendered: Rendered) -> dict[str, dict[str, Any]]:
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in rendered.objects}


@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_golden(sample: str) -> None:
    """Regenerate with KVSERVING_UPDATE_GOLDEN=1 and review the diff."""
    text = yaml.safe_dump_all(_render_sample(sample).objects, sort_keys=True)
    path = GOLDEN / f"{sample}.yaml"
    if os.environ.get("KVSERVING_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), (
        f"rendering of {sample} changed; if intended (e.g. a new engine-config field), regenerate with "
        "KVSERVING_UPDATE_GOLDEN=1 and review the diff of tests/operator/golden/"
    )


@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_rendered_yaml_has_no_aliases(sample: str) -> None:
    """No dict is shared between places in an object: YAML would print anchors (&id001) that kubectl users trip on."""
    assert "&id" not in yaml.safe_dump_all(_render_sample(sample).objects)


def test_children_of_the_nvfp4_sample() -> None:
    objs = _by_key(_render_sample("nvfp4"))
    assert sorted(objs) == [
        "ConfigMap/qwen3-nvfp4-config",
        "ConfigMap/qwen3-nvfp4-dashboard",
        "Deployment/qwen3-nvfp4-decode",
        "Deployment/qwen3-nvfp4-gateway",
        "Deployment/qwen3-nvfp4-prefill",
        "NetworkPolicy/qwen3-nvfp4-gateway",
        "NetworkPolicy/qwen3-nvfp4-workers",
        "PodMonitor/qwen3-nvfp4",
        "Service/qwen3-nvfp4-decode",
        "Service/qwen3-nvfp4-gateway",
        "Service/qwen3-nvfp4-prefill",
    ]
    for obj in objs.values():
        assert obj["metadata"]["namespace"] == "default"
        assert obj["metadata"]["ownerReferences"] == [
            {"apiVersion": "kvserving.dev/v1alpha1", "kind": "KVServing", "name": "qwen3-nvfp4", "uid": UID, "controller": True}
        ]
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kvserving-operator"
        assert re.fullmatch(r"[0-9a-f]{16}", obj["metadata"]["annotations"][APPLIED_HASH])


def test_engine_config_is_the_shared_schema() -> None:
    rendered = _render_sample("triaxial")
    cm = _by_key(rendered)["ConfigMap/qwen3-triaxial-config"]
    cfg = ServingConfig.from_json(cm["data"]["config.json"])
    assert cfg.kv_cache.dtype == "triaxial"
    assert cfg.kv_cache.bit_budget == 2.7
    assert cfg.kv_cache.effective_page_size == 32
    assert (cfg.reuse.retention_ttl_s, cfg.reuse.lease_ttl_s, cfg.reuse.recompute_threshold_tokens) == (600.0, 540.0, 64)
    assert cfg.reuse.bidirectional is True
    assert (cfg.model.path, cfg.model.served_name) == ("/models/Qwen3-8B", "qwen3-8b")
    assert cfg.gateway.prefill_service == "qwen3-triaxial-prefill.default.svc"
    assert cfg.gateway.decode_service == "qwen3-triaxial-decode.default.svc"
    assert cfg.gateway.worker_port == 8000
    assert cm["data"]["config.json"] == cfg.to_json()
    assert rendered.kv_bits == 2.7


def test_worker_and_gateway_containers_follow_the_command_line() -> None:
    objs = _by_key(_render_sample("fp8_e4m3"))
    for role in ("prefill", "decode"):
        pod = objs[f"Deployment/qwen3-fp8-{role}"]["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert c["command"] + c["args"] == [
            "kvserving",
            "worker",
            "--role",
            role,
            "--config",
            "/etc/kvserving/config.json",
            "--host",
            "0.0.0.0",
            "--port",
            "8000",
        ]
        assert c["resources"] == {"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": 1}}
        assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
        assert {v["name"]: v for v in pod["volumes"]}["model"]["persistentVolumeClaim"] == {
            "claimName": "qwen3-8b-weights",
            "readOnly": True,
        }
    gw = objs["Deployment/qwen3-fp8-gateway"]["spec"]["template"]["spec"]
    (c,) = gw["containers"]
    assert c["command"] + c["args"] == [
        "kvserving",
        "gateway",
        "--config",
        "/etc/kvserving/config.json",
        "--host",
        "0.0.0.0",
        "--port",
        "8080",
    ]
    assert c["resources"] == {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}}
    assert objs["Service/qwen3-fp8-gateway"]["spec"]["ports"][0]["port"] == 8080
    for role in ("prefill", "decode"):
        svc = objs[f"Service/qwen3-fp8-{role}"]["spec"]
        assert svc["clusterIP"] == "None"
        assert svc["selector"] == {
            "app.kubernetes.io/name": "kvserving",
            "app.kubernetes.io/instance": "qwen3-fp8",
            "app.kubernetes.io/component": role,
        }
    assert "clusterIP" not in objs["Service/qwen3-fp8-gateway"]["spec"]


def test_probes_and_security_context() -> None:
    for obj in _render_sample("fp8_e4m3").objects:
        if obj["kind"] != "Deployment":
            continue
        pod = obj["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
        assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert c["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == 1000
        assert c["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
        assert pod["automountServiceAccountToken"] is False
        # the pod selector matches the template's labels
        assert obj["spec"]["selector"]["matchLabels"].items() <= obj["spec"]["template"]["metadata"]["labels"].items()


SUPPORTED_GPUS = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "nvidia.com/gpu.compute.major", "operator": "In", "values": ["9", "10", "12"]}]}
            ]  # fmt: skip
        }
    }
}


def test_nvfp4_workers_get_hopper_or_blackwell_affinity_and_the_pool_selector() -> None:
    objs = _by_key(_render_sample("nvfp4"))
    for role in ("prefill", "decode"):
        pod = objs[f"Deployment/qwen3-nvfp4-{role}"]["spec"]["template"]["spec"]
        assert pod["affinity"] == SUPPORTED_GPUS
        assert pod["nodeSelector"] == {"kvserving.dev/node-pool": "blackwell"}
        assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert "affinity" not in objs["Deployment/qwen3-nvfp4-gateway"]["spec"]["template"]["spec"]


def test_triaxial_workers_get_the_same_affinity() -> None:
    objs = _by_key(_render_sample("triaxial"))
    for role in ("prefill", "decode"):
        assert objs[f"Deployment/qwen3-triaxial-{role}"]["spec"]["template"]["spec"]["affinity"] == SUPPORTED_GPUS
    assert "affinity" not in objs["Deployment/qwen3-triaxial-gateway"]["spec"]["template"]["spec"]


def test_the_affinity_lists_the_majors_the_kernels_are_compiled_for() -> None:
    # the operator imports no kernels module: the two lists are held equal here
    from kvserving.kernels.capability import COMPILE_TARGETS, PLACEMENT_MAJORS, choose

    values = SUPPORTED_GPUS["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert values["matchExpressions"][0]["values"] == [str(m) for m in PLACEMENT_MAJORS]
    assert sorted(PLACEMENT_MAJORS) == sorted(major for major, _ in COMPILE_TARGETS)
    assert all(choose((m, 0)).decode == "gluon" for m in PLACEMENT_MAJORS)  # placed where the fast decode runs


@pytest.mark.parametrize("flag", ["allowOtherGPUs", "allowEmulation"])
def test_allow_other_gpus_or_its_deprecated_alias_or_other_formats_get_no_gpu_affinity(flag: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvserving.operator.spec"):
        lifted = [_render_sample(name, lambda s: s["kvCache"].update({flag: True})) for name in ("nvfp4", "triaxial")]
    deprecated = [r.getMessage() for r in caplog.records if "allowEmulation is deprecated" in r.getMessage()]
    assert len(deprecated) == (2 if flag == "allowEmulation" else 0)
    for rendered in [_render_sample("fp8_e4m3"), *lifted]:
        for obj in rendered.objects:
            if obj["kind"] == "Deployment":
                assert "affinity" not in obj["spec"]["template"]["spec"], obj["metadata"]["name"]


def _changed(before: Rendered, after: Rendered) -> set[str]:
    a, b = _by_key(before), _by_key(after)
    return {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


def test_replica_change_touches_only_that_deployment() -> None:
    before = _render_sample("triaxial")
    after = _render_sample("triaxial", lambda s: s["decode"].update(replicas=5))
    assert _changed(before, after) == {"Deployment/qwen3-triaxial-decode"}
    assert after.config_hash == before.config_hash
    dep = _by_key(after)["Deployment/qwen3-triaxial-decode"]
    assert dep["spec"]["replicas"] == 5
    assert dep["spec"]["template"] == _by_key(before)["Deployment/qwen3-triaxial-decode"]["spec"]["template"]
    assert after.replicas == {"prefill": 1, "decode": 5, "gateway": 1}


def test_engine_config_change_rolls_every_pod() -> None:
    before = _render_sample("triaxial")
    after = _render_sample("triaxial", lambda s: s["reuse"].update(retentionTTLSeconds=900))
    assert after.config_hash != before.config_hash
    assert _changed(before, after) == {
        "ConfigMap/qwen3-triaxial-config",
        "Deployment/qwen3-triaxial-prefill",
        "Deployment/qwen3-triaxial-decode",
        "Deployment/qwen3-triaxial-gateway",
    }
    for role in ("prefill", "decode", "gateway"):
        template = _by_key(after)[f"Deployment/qwen3-triaxial-{role}"]["spec"]["template"]
        assert template["metadata"]["annotations"] == {CONFIG_HASH: after.config_hash}


def test_image_change_touches_deployments_only() -> None:
    before = _render_sample("fp8_e4m3")
    after = _render_sample("fp8_e4m3", lambda s: s.update(image="registry.example/kvserving:0.2.0"))
    assert _changed(before, after) == {f"Deployment/qwen3-fp8-{r}" for r in ("prefill", "decode", "gateway")}


def test_monitoring_off_drops_monitor_and_dashboard() -> None:
    before = _render_sample("fp8_e4m3")
    after = _render_sample("fp8_e4m3", lambda s: s["monitoring"].update(enabled=False))
    assert _changed(before, after) == {"PodMonitor/qwen3-fp8", "ConfigMap/qwen3-fp8-dashboard"}
    assert set(_by_key(before)) - set(_by_key(after)) == {"PodMonitor/qwen3-fp8", "ConfigMap/qwen3-fp8-dashboard"}


def test_monitoring_objects() -> None:
    objs = _by_key(_render_sample("nvfp4"))
    monitor = objs["PodMonitor/qwen3-nvfp4"]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("http", "/metrics", "30s")
    assert monitor["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "kvserving",
        "app.kubernetes.io/instance": "qwen3-nvfp4",
    }
    dash = objs["ConfigMap/qwen3-nvfp4-dashboard"]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(dash["data"]["kvserving-default-qwen3-nvfp4.json"])
    assert board["uid"] == "kvs-default-qwen3-nvfp4"
    assert len(board["panels"]) == len(PANELS)


# What a PodMonitor must look like (prometheus-operator's CRD is not in the
# Kubernetes schemas); the fields the renderer sets, with their types.
POD_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "spec": {
            "type": "object",
            "required": ["selector", "podMetricsEndpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {"type": "object", "properties": {"matchLabels": {"type": "object"}}, "additionalProperties": False},
                "podMetricsEndpoints": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {
                                "type": "string",
                                "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
                            },
                            "relabelings": {"type": "array"},
                        },
                    },
                },
            },
        }
    },
}


@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_every_rendered_object_validates(sample: str) -> None:
    import jsonschema

    kinds = set()
    for obj in _render_sample(sample).objects:
        kinds.add(obj["kind"])
        if obj["apiVersion"] == "monitoring.coreos.com/v1":
            jsonschema.validate(obj, POD_MONITOR_SCHEMA)
            # metadata is a plain ObjectMeta: validate it through a ConfigMap shell
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}, K8S_VERSION, strict=True)
        else:
            assert kubernetes_validate.validate(obj, K8S_VERSION, strict=True) == K8S_VERSION
    assert kinds >= {"ConfigMap", "Service", "Deployment"}


def test_a_broken_object_would_fail_validation() -> None:
    """The validator is not a no-op."""
    obj = copy.deepcopy(_by_key(_render_sample("fp8_e4m3"))["Deployment/qwen3-fp8-prefill"])
    obj["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def _histogram_base(name: str) -> str:
    return re.sub(r"_(bucket|sum|count)$", "", name)


def test_every_dashboard_panel_queries_a_listed_metric() -> None:
    listed = {name for name, _, _ in DASHBOARD_METRICS}
    kinds = {name: kind for name, kind, _ in DASHBOARD_METRICS}
    for name in listed:
        assert re.fullmatch(r"kvserving_(gateway|worker)_[a-z0-9_]+", name)
        assert kinds[name] != "counter" or name.endswith("_total")
        assert kinds[name] != "histogram" or name.endswith("_seconds")
    used = set()
    for panel in build_dashboard()["panels"]:
        (target,) = panel["targets"]
        names = set(re.findall(r"\bkvserving_[a-z0-9_]+", target["expr"]))
        assert names, panel["title"]
        for name in names:
            assert _histogram_base(name) in listed, f"{panel['title']} queries {name}"
            used.add(_histogram_base(name))
    assert used == listed  # no metric listed that no panel shows


def test_manifest_dashboard_is_the_generated_one() -> None:
    path = REPO / "manifests" / "grafana" / "kvserving-dashboard.json"
    assert path.read_text() == dashboard_json()


def _pod(rendered: Rendered, name: str) -> dict[str, Any]:
    spec: dict[str, Any] = _by_key(rendered)[f"Deployment/{name}"]["spec"]["template"]["spec"]
    return spec


def test_internal_token_is_a_read_only_file_in_the_gateway_and_every_worker() -> None:
    rendered = _render_sample("fp8_e4m3")
    cfg = ServingConfig.from_json(_by_key(rendered)["ConfigMap/qwen3-fp8-config"]["data"]["config.json"])
    assert cfg.security.internal_token_file == "/var/run/kvserving/internal/token"
    assert cfg.security.api_keys_file is None and cfg.security.tenants_share_cache is False
    for role in ("prefill", "decode", "gateway"):
        pod = _pod(rendered, f"qwen3-fp8-{role}")
        assert {v["name"]: v for v in pod["volumes"]}["internal-token"] == {
            "name": "internal-token",
            "secret": {"secretName": "qwen3-fp8-internal", "items": [{"key": "token", "path": "token"}], "defaultMode": 0o440},
        }
        (c,) = pod["containers"]
        assert {"name": "internal-token", "mountPath": "/var/run/kvserving/internal", "readOnly": True} in c["volumeMounts"]
        assert "api-keys" not in {v["name"] for v in pod["volumes"]}
        assert "secretKeyRef" not in json.dumps(c["env"])  # secrets as files, never env
        assert pod["automountServiceAccountToken"] is False
    # the Secret itself is not among the applied objects (its value is made once, by the reconciler)
    assert "Secret" not in {o["kind"] for o in rendered.objects}
    assert internal_secret(Owner("qwen3-fp8", "default", UID), token="t0k")["stringData"] == {"token": "t0k"}


def test_api_keys_secret_is_mounted_in_the_gateway_only() -> None:
    rendered = _render_sample("fp8_e4m3", lambda s: s["gateway"].update(apiKeysSecret={"name": "gw-keys", "key": "keys.txt"}))
    cfg = ServingConfig.from_json(_by_key(rendered)["ConfigMap/qwen3-fp8-config"]["data"]["config.json"])
    assert cfg.security.api_keys_file == "/var/run/kvserving/api-keys/keys.txt"
    gw = _pod(rendered, "qwen3-fp8-gateway")
    assert {v["name"]: v for v in gw["volumes"]}["api-keys"]["secret"] == {
        "secretName": "gw-keys",
        "items": [{"key": "keys.txt", "path": "keys.txt"}],
        "defaultMode": 0o440,
    }
    assert {"name": "api-keys", "mountPath": "/var/run/kvserving/api-keys", "readOnly": True} in gw["containers"][0]["volumeMounts"]
    for role in ("prefill", "decode"):
        assert "api-keys" not in {v["name"] for v in _pod(rendered, f"qwen3-fp8-{role}")["volumes"]}
    default_key = _render_sample("fp8_e4m3", lambda s: s["gateway"].update(apiKeysSecret={"name": "gw-keys"}))
    cfg = ServingConfig.from_json(_by_key(default_key)["ConfigMap/qwen3-fp8-config"]["data"]["config.json"])
    assert cfg.security.api_keys_file == "/var/run/kvserving/api-keys/api-keys"


def test_tenants_share_cache_reaches_the_engine_config_and_rolls_the_pods() -> None:
    before = _render_sample("fp8_e4m3")
    after = _render_sample("fp8_e4m3", lambda s: s["reuse"].update(tenantsShareCache=True))
    cfg = ServingConfig.from_json(_by_key(after)["ConfigMap/qwen3-fp8-config"]["data"]["config.json"])
    assert cfg.security.tenants_share_cache is True
    assert after.config_hash != before.config_hash


WORKERS = {"app.kubernetes.io/name": "kvserving", "app.kubernetes.io/instance": "qwen3-fp8"}
WORKER_PODS = {
    "matchLabels": WORKERS,
    "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In", "values": ["prefill", "decode"]}],
}
GATEWAY_PODS = {"matchLabels": {**WORKERS, "app.kubernetes.io/component": "gateway"}}
OPERATOR_HERE = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvserving-operator"}}}
OPERATOR_SYSTEM = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kvserving-system"}}, **OPERATOR_HERE}
PROMETHEUS = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


def test_worker_network_policy_admits_only_its_own_pods_and_monitoring() -> None:
    policy = _by_key(_render_sample("fp8_e4m3"))["NetworkPolicy/qwen3-fp8-workers"]["spec"]
    assert policy["podSelector"] == WORKER_PODS
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    assert policy["ingress"] == [
        {"from": [{"podSelector": WORKER_PODS}]},  # every port: HTTP and NIXL between workers
        {"from": [{"podSelector": GATEWAY_PODS}, OPERATOR_HERE, OPERATOR_SYSTEM], "ports": [{"protocol": "TCP", "port": 8000}]},
        {"from": [PROMETHEUS], "ports": [{"protocol": "TCP", "port": 8000}]},
    ]
    # the selectors match the pods the Deployments make, and no other instance's
    objs = _by_key(_render_sample("fp8_e4m3"))
    for role in ("prefill", "decode"):
        labels = objs[f"Deployment/qwen3-fp8-{role}"]["spec"]["template"]["metadata"]["labels"]
        assert WORKER_PODS["matchLabels"].items() <= labels.items() and labels["app.kubernetes.io/component"] in ("prefill", "decode")
    gw_labels = objs["Deployment/qwen3-fp8-gateway"]["spec"]["template"]["metadata"]["labels"]
    assert GATEWAY_PODS["matchLabels"].items() <= gw_labels.items()


def test_the_operators_sampler_may_reach_the_workers_from_its_namespace() -> None:
    moved = _render_sample("fp8_e4m3", lambda s: s.update(networkPolicy={"operatorNamespace": "platform"}))
    rule = _by_key(moved)["NetworkPolicy/qwen3-fp8-workers"]["spec"]["ingress"][1]
    assert rule["from"][2] == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "platform"}}, **OPERATOR_HERE}
    # an operator in the KVServing's own namespace (manifests/namespaced/): one peer, no namespace selector
    same = _render_sample("fp8_e4m3", lambda s: s.update(networkPolicy={"operatorNamespace": "default"}))
    assert _by_key(same)["NetworkPolicy/qwen3-fp8-workers"]["spec"]["ingress"][1]["from"] == [{"podSelector": GATEWAY_PODS}, OPERATOR_HERE]
    # the labels and namespace the rule names are the operator's own (manifests/)
    (dep,) = yaml.safe_load_all((REPO / "manifests" / "operator.yaml").read_text())
    assert dep["metadata"]["namespace"] == "kvserving-system"
    assert OPERATOR_HERE["podSelector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_gateway_network_policy_defaults_to_any_source_and_follows_allow_from() -> None:
    policy = _by_key(_render_sample("fp8_e4m3"))["NetworkPolicy/qwen3-fp8-gateway"]["spec"]
    assert policy["podSelector"] == GATEWAY_PODS
    assert policy["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8080}]}]  # no "from": any source
    team = {"namespaceSelector": {"matchLabels": {"team": "agents"}}}
    rendered = _render_sample("fp8_e4m3", lambda s: s["gateway"].update(allowFrom=[team]))
    assert _by_key(rendered)["NetworkPolicy/qwen3-fp8-gateway"]["spec"]["ingress"] == [
        {"from": [team], "ports": [{"protocol": "TCP", "port": 8080}]},
        {"from": [PROMETHEUS], "ports": [{"protocol": "TCP", "port": 8080}]},  # /metrics
    ]


def test_monitoring_selector_is_configurable_and_can_be_closed() -> None:
    mine = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}, "podSelector": {}}
    rendered = _render_sample("fp8_e4m3", lambda s: s["monitoring"].update(allowFrom=[mine]))
    assert _by_key(rendered)["NetworkPolicy/qwen3-fp8-workers"]["spec"]["ingress"][2] == {
        "from": [mine],
        "ports": [{"protocol": "TCP", "port": 8000}],
    }
    closed = _render_sample("fp8_e4m3", lambda s: s["monitoring"].update(allowFrom=[]))
    assert len(_by_key(closed)["NetworkPolicy/qwen3-fp8-workers"]["spec"]["ingress"]) == 2


DNS_ANYWHERE = {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}


def test_workers_connect_only_to_their_own_workers_and_dns() -> None:
    objs = _by_key(_render_sample("fp8_e4m3"))
    assert objs["NetworkPolicy/qwen3-fp8-workers"]["spec"]["egress"] == [
        {"to": [{"podSelector": WORKER_PODS}]},  # every port: HTTP and NIXL to peers
        DNS_ANYWHERE,
    ]
    gateway = objs["NetworkPolicy/qwen3-fp8-gateway"]["spec"]
    assert gateway["policyTypes"] == ["Ingress", "Egress"]
    assert gateway["egress"] == [{"to": [{"podSelector": WORKER_PODS}], "ports": [{"protocol": "TCP", "port": 8000}]}, DNS_ANYWHERE]
    # another KVServing's workers are not this one's peers
    spec = apply_defaults(root_schema(), load_sample("fp8_e4m3"))["spec"]
    other = _by_key(render(spec, owner=Owner(name="other", namespace="default", uid=UID)))
    assert (
        other["NetworkPolicy/other-workers"]["spec"]["egress"][0]["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"]
        == "other"
    )


def test_extra_egress_and_dns_peers_are_configurable() -> None:
    otlp = {"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": [{"port": 4317}]}
    store = {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "storage"}}}]}
    kube_dns = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
        "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
    }
    rendered = _by_key(
        _render_sample("fp8_e4m3", lambda s: s.update(networkPolicy={"egress": {"allowTo": [otlp, store], "dnsTo": [kube_dns]}}))
    )
    for name in ("workers", "gateway"):
        assert rendered[f"NetworkPolicy/qwen3-fp8-{name}"]["spec"]["egress"][1:] == [
            {"to": [kube_dns], **DNS_ANYWHERE},
            {"to": otlp["to"], "ports": [{"protocol": "TCP", "port": 4317}]},  # the CRD's default protocol, written out
            store,  # no ports: every port of those peers
        ]
        kubernetes_validate.validate(rendered[f"NetworkPolicy/qwen3-fp8-{name}"], K8S_VERSION, strict=True)


def test_egress_rules_can_be_turned_off_alone() -> None:
    before = _render_sample("fp8_e4m3")
    after = _by_key(_render_sample("fp8_e4m3", lambda s: s.update(networkPolicy={"egress": {"enabled": False}})))
    for name in ("workers", "gateway"):
        policy = after[f"NetworkPolicy/qwen3-fp8-{name}"]["spec"]
        assert policy["policyTypes"] == ["Ingress"] and "egress" not in policy
        assert policy["ingress"] == _by_key(before)[f"NetworkPolicy/qwen3-fp8-{name}"]["spec"]["ingress"]


def test_network_policies_can_be_turned_off() -> None:
    before = _render_sample("fp8_e4m3")
    after = _render_sample("fp8_e4m3", lambda s: s.update(networkPolicy={"enabled": False}))
    assert set(_by_key(before)) - set(_by_key(after)) == {"NetworkPolicy/qwen3-fp8-workers", "NetworkPolicy/qwen3-fp8-gateway"}
    assert _changed(before, after) == {"NetworkPolicy/qwen3-fp8-workers", "NetworkPolicy/qwen3-fp8-gateway"}


def test_resources_override_key_by_key() -> None:
    rendered = _render_sample(
        "fp8_e4m3", lambda s: s["decode"].update(resources={"limits": {"memory": "128Gi", "nvidia.com/gpu": 2}, "requests": {"cpu": "6"}})
    )
    (c,) = _pod(rendered, "qwen3-fp8-decode")["containers"]
    assert c["resources"] == {"requests": {"cpu": "6", "memory": "32Gi"}, "limits": {"cpu": "8", "memory": "128Gi", "nvidia.com/gpu": 2}}
    # a lone limit below the default request lowers the request to it (as Kubernetes pairs a lone limit)
    small = _render_sample("fp8_e4m3", lambda s: s["gateway"].update(resources={"limits": {"cpu": "250m"}}))
    (c,) = _pod(small, "qwen3-fp8-gateway")["containers"]
    assert c["resources"] == {"requests": {"cpu": "250m", "memory": "1Gi"}, "limits": {"cpu": "250m", "memory": "4Gi"}}


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        ({"requests": {"memory": "80Gi"}}, "spec.decode.resources.limits.memory: 64Gi is below the request 80Gi"),
        ({"requests": {"cpu": "8500m"}}, "spec.decode.resources.limits.cpu: 8 is below the request 8500m"),
        (
            {"requests": {"cpu": "2", "memory": "1G"}, "limits": {"cpu": "1500m", "memory": "1Gi"}},
            "spec.decode.resources.limits.cpu: 1500m is below the request 2",
        ),
    ],
)
def test_a_limit_below_its_request_is_refused(resources: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as exc:
        _render_sample("fp8_e4m3", lambda s: s["decode"].update(resources=resources))
    assert str(exc.value) == message


def test_quantities_compare_across_suffixes() -> None:
    from decimal import Decimal

    from kvserving.operator.quantity import parse_quantity

    assert parse_quantity("500m") == Decimal("0.5")
    assert parse_quantity("1Gi") == Decimal(2**30) > parse_quantity("1G") == Decimal(10**9)
    assert parse_quantity("1e3") == Decimal(1000) == parse_quantity(1000) == parse_quantity("1k")
    assert parse_quantity(".5") == Decimal("0.5")
    for bad in ("1GB", "", "m", True, None, "1.2.3"):
        assert parse_quantity(bad) is None


def test_security_options_and_the_secret_validate() -> None:
    def configure(spec: dict[str, Any]) -> None:
        spec["gateway"].update(
            apiKeysSecret={"name": "gw-keys", "key": "api-keys"},
            allowFrom=[
                {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.9.0.0/16"]}},
                {"namespaceSelector": {"matchLabels": {"team": "a"}}, "podSelector": {}},
            ],
        )
        spec["decode"].update(resources={"limits": {"memory": "100Gi"}})

    for obj in _render_sample("fp8_e4m3", configure).objects:
        if obj["apiVersion"] != "monitoring.coreos.com/v1":
            assert kubernetes_validate.validate(obj, K8S_VERSION, strict=True) == K8S_VERSION
    secret = internal_secret(Owner("qwen3-fp8", "default", UID), token="x" * 43)
    assert kubernetes_validate.validate(secret, K8S_VERSION, strict=True) == K8S_VERSION
