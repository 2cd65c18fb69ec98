"""The KVServing CRD: a valid, structural CRD; samples pass its schema and CEL
rules; each invalid combination is refused with its own rule's message."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest
from kvs_crd_tools import SAMPLES, admit, apply_defaults, load_crd, load_sample, root_schema

from kvserving.config import KVCacheConfig, ReuseConfig
from kvserving.operator.names import CRD_NAME, GROUP, KIND, PLURAL, SHORT_NAME, VERSION
from kvserving.operator.render import Owner, render
from kvserving.operator.spec import DEFAULT_MONITORING_PEER, GATEWAY_RESOURCES, WORKER_RESOURCES, parse_spec

K8S_VERSION = "1.37"
OWNER = Owner(name="demo", namespace="default", uid="uid-1")


def _spec_schema() -> dict[str, Any]:
    return root_schema()["properties"]["spec"]


def test_crd_is_a_valid_customresourcedefinition() -> None:
    crd = load_crd()
    assert kubernetes_validate.validate(crd, K8S_VERSION, strict=True) == K8S_VERSION
    assert crd["metadata"]["name"] == CRD_NAME
    spec = crd["spec"]
    assert (spec["group"], spec["scope"], spec["names"]["kind"], spec["names"]["plural"]) == (GROUP, "Namespaced", KIND, PLURAL)
    assert spec["names"]["shortNames"] == [SHORT_NAME]
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == (VERSION, True, True)
    assert version["subresources"] == {"status": {}}


def test_printer_columns() -> None:
    (version,) = load_crd()["spec"]["versions"]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {
        "DType": ".spec.kvCache.dtype",
        "Bits": ".status.kv.bits",
        "Prefill": ".status.prefill.ready",
        "Decode": ".status.decode.ready",
        "Capacity": ".status.kv.decode.capacityTokens",
        "Reuse": ".status.kv.reuseRatio",
        "Phase": ".status.phase",
        "Endpoint": ".status.endpoint",
        "Age": ".metadata.creationTimestamp",
    }


def _walk(schema: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    out = [(path, schema)]
    for key, sub in (schema.get("properties") or {}).items():
        out += _walk(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        out += _walk(schema["items"], f"{path}[]")
    return out


def test_every_spec_field_has_a_type_and_description() -> None:
    nodes = _walk(_spec_schema(), "spec")
    assert len(nodes) > 40
    for path, node in nodes:
        if "[]" in path:  # toleration items mirror core/v1 Toleration
            continue
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        assert node.get("description"), f"{path} has no description"


# Fields left unset on purpose: their default depends on other fields or is "none".
OPTIONAL = {
    "spec.model.maxModelLen",
    "spec.model.pvcName",
    "spec.kvCache.bitBudget",
    "spec.kvCache.pageSize",
    "spec.kvCache.calibration",
    "spec.gateway.apiKeysSecret",
    "spec.kvCache.allowEmulation",  # deprecated alias of allowOtherGPUs: only its presence is read (and logged)
}


def test_every_top_level_field_of_each_section_has_a_default() -> None:
    spec = _spec_schema()
    for section, node in spec["properties"].items():
        assert "default" in node, f"spec.{section}"
        for key, sub in (node.get("properties") or {}).items():
            if f"spec.{section}.{key}" not in OPTIONAL:
                assert "default" in sub, f"spec.{section}.{key} has no default"


def test_design_defaults() -> None:
    defaulted, errors = admit({"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": {"name": "d"}})
    assert errors == []
    spec = defaulted["spec"]
    assert spec["reuse"] == {
        "bidirectional": True,
        "retentionTTLSeconds": 480,
        "leaseTTLSeconds": 420,
        "recomputeThresholdTokens": 64,
        "tenantsShareCache": False,
        "peerTimeoutSeconds": 1,
    }
    assert parse_spec(spec).serving.reuse.peer_timeout_s == ReuseConfig().peer_timeout_s
    assert spec["kvCache"] == {
        "dtype": "bf16", "memoryFraction": 0.9, "globalScale": "static", "allowOtherGPUs": False, "ageDown": True, "layout": "pageMajor",
    }  # fmt: skip
    assert parse_spec(spec).serving.kv_cache.layout == KVCacheConfig().layout
    assert spec["prefill"]["resources"] == {
        "requests": {"cpu": "4", "memory": "32Gi"},
        "limits": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": 1},
    }
    assert spec["prefill"]["resources"] == WORKER_RESOURCES and spec["gateway"]["resources"] == GATEWAY_RESOURCES
    assert spec["networkPolicy"] == {
        "enabled": True,
        "operatorNamespace": "kvserving-system",
        "egress": {"enabled": True, "dnsTo": [], "allowTo": []},
    }
    assert spec["gateway"]["allowFrom"] == []
    assert "apiKeysSecret" not in spec["gateway"]
    assert spec["monitoring"] == {
        "enabled": True,
        "dashboard": True,
        "scrapeInterval": "30s",
        "labels": {},
        "allowFrom": [DEFAULT_MONITORING_PEER],
    }


@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_renderer_defaults_equal_the_crd_defaults(sample: str) -> None:
    """Rendering the spec as written and as the API server defaults it gives the same objects."""
    body = load_sample(sample)
    defaulted = apply_defaults(root_schema(), body)
    assert parse_spec(body["spec"]) == parse_spec(defaulted["spec"])
    assert render(body["spec"], owner=OWNER) == render(defaulted["spec"], owner=OWNER)


def test_empty_spec_renders_like_its_defaulted_self() -> None:
    defaulted = apply_defaults(root_schema(), {"spec": {}})
    assert render({}, owner=OWNER) == render(defaulted["spec"], owner=OWNER)


@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_samples_are_admitted(sample: str) -> None:
    body = load_sample(sample)
    assert (body["apiVersion"], body["kind"]) == (f"{GROUP}/{VERSION}", KIND)
    _, errors = admit(body)
    assert errors == []


def test_sample_set_covers_the_three_formats() -> None:
    dtypes = {name: load_sample(name)["spec"]["kvCache"]["dtype"] for name in SAMPLES}
    assert dtypes == {"nvfp4": "nvfp4", "triaxial": "triaxial", "fp8_e4m3": "fp8_e4m3"}
    assert load_sample("triaxial")["spec"]["kvCache"]["bitBudget"] == 2.7


def _with(path: str, value: Any, *, base: str = "fp8_e4m3") -> dict[str, Any]:
    body = copy.deepcopy(load_sample(base))
    node = body
    *parents, leaf = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return body


INVALID = [
    ("bitBudget without triaxial", _with("spec.kvCache.bitBudget", 3.0), "spec.kvCache: bitBudget is only valid with dtype triaxial"),
    ("bitBudget below 2", _with("spec.kvCache.bitBudget", 1.5, base="triaxial"), "spec.kvCache.bitBudget: bitBudget must be within [2, 4]"),
    ("bitBudget above 4", _with("spec.kvCache.bitBudget", 4.5, base="triaxial"), "spec.kvCache.bitBudget: bitBudget must be within [2, 4]"),
    (
        "lease not below retention",
        _with("spec.reuse", {"retentionTTLSeconds": 300, "leaseTTLSeconds": 300}),
        "spec.reuse: leaseTTLSeconds must be less than retentionTTLSeconds",
    ),
    ("zero lease", _with("spec.reuse.leaseTTLSeconds", 0), "spec.reuse.leaseTTLSeconds: leaseTTLSeconds must be positive"),
    ("negative lease", _with("spec.reuse.leaseTTLSeconds", -5), "spec.reuse.leaseTTLSeconds: leaseTTLSeconds must be positive"),
    ("negative prefill replicas", _with("spec.prefill.replicas", -1), "spec.prefill.replicas: replicas must not be negative"),
    ("negative decode replicas", _with("spec.decode.replicas", -2), "spec.decode.replicas: replicas must not be negative"),
    ("negative gateway replicas", _with("spec.gateway.replicas", -1), "spec.gateway.replicas: replicas must not be negative"),
    ("page size not a power of two", _with("spec.kvCache.pageSize", 24), "spec.kvCache.pageSize: pageSize must be a power of two"),
    (
        "triaxial page size not 32",
        _with("spec.kvCache.pageSize", 16, base="triaxial"),
        "spec.kvCache: pageSize must be 32 for dtype triaxial",
    ),
    (
        "calibrated scale without one",
        _with("spec.kvCache.globalScale", "calibrated", base="triaxial"),
        "spec.kvCache: globalScale calibrated needs dtype fp8_e4m3 or nvfp4",
    ),
    (
        "calibration with bf16",
        _with("spec.kvCache", {"dtype": "bf16", "calibration": {"configMap": "cal"}}),
        "spec.kvCache: calibration needs dtype triaxial, fp8_e4m3 or nvfp4",
    ),
    (
        "calibration key ..",
        _with("spec.kvCache.calibration", {"configMap": "cal", "key": ".."}, base="triaxial"),
        "spec.kvCache.calibration.key: key must be a file name",
    ),
    ("zero peer timeout", _with("spec.reuse.peerTimeoutSeconds", 0), "spec.reuse.peerTimeoutSeconds: peerTimeoutSeconds must be positive"),
    (
        "negative recompute threshold",
        _with("spec.reuse.recomputeThresholdTokens", -3),
        'spec.reuse.recomputeThresholdTokens: recomputeThresholdTokens must be an integer >= 0 or "auto"',
    ),
    (
        "recompute threshold neither integer nor auto",
        _with("spec.reuse.recomputeThresholdTokens", "sometimes"),
        'spec.reuse.recomputeThresholdTokens: recomputeThresholdTokens must be an integer >= 0 or "auto"',
    ),
    (
        "a GPU for the gateway",
        _with("spec.gateway.resources", {"limits": {"nvidia.com/gpu": 1}}),
        "spec.gateway.resources: the gateway uses no GPU: remove nvidia.com/gpu from spec.gateway.resources.limits",
    ),
    (
        "API keys key ..",
        _with("spec.gateway.apiKeysSecret", {"name": "keys", "key": ".."}),
        "spec.gateway.apiKeysSecret.key: key must be a file name",
    ),
]

# Refused by the CRD alone (the renderer copies NetworkPolicy peers as given).
INVALID_PEERS = [
    ("ipBlock with a podSelector", [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]),
    ("an empty peer", [{}]),
]


@pytest.mark.parametrize(("case", "peers"), INVALID_PEERS, ids=[c[0] for c in INVALID_PEERS])
@pytest.mark.parametrize("where", ["spec.gateway.allowFrom", "spec.monitoring.allowFrom", "spec.networkPolicy.egress.dnsTo"])
def test_a_peer_is_an_ip_block_or_selectors(case: str, peers: list[dict[str, Any]], where: str) -> None:
    _, errors = admit(_with(where, peers))
    assert errors == [f"{where}[0]: a peer is an ipBlock, or a podSelector and/or namespaceSelector"]


def test_an_egress_rule_names_its_peers_and_valid_ports() -> None:
    where = "spec.networkPolicy.egress.allowTo"
    _, errors = admit(_with(where, [{"to": [{}]}]))
    assert errors == [f"{where}[0].to[0]: a peer is an ipBlock, or a podSelector and/or namespaceSelector"]
    _, errors = admit(_with(where, [{"to": [{"podSelector": {}}], "ports": [{"port": 9100, "endPort": 9000}]}]))
    assert errors == [f"{where}[0].ports[0]: endPort must not be below port"]
    _, errors = admit(_with(where, [{"ports": [{"port": 53}]}]))
    assert len(errors) == 1 and "to" in errors[0], errors


@pytest.mark.parametrize(("case", "body", "message"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_spec_is_refused_with_its_rules_message(case: str, body: dict[str, Any], message: str) -> None:
    _, errors = admit(body)
    assert len(errors) == 1, errors
    assert errors[0].startswith(message)


def test_zero_retention_also_breaks_the_lease_rule() -> None:
    _, errors = admit(_with("spec.reuse.retentionTTLSeconds", 0))
    assert [e.split(" (")[0] for e in errors] == [
        "spec.reuse: leaseTTLSeconds must be less than retentionTTLSeconds",
        "spec.reuse.retentionTTLSeconds: retentionTTLSeconds must be positive",
    ]


@pytest.mark.parametrize(("case", "body", "message"), INVALID, ids=[c[0] for c in INVALID])
def test_engine_config_refuses_what_the_crd_refuses(case: str, body: dict[str, Any], message: str) -> None:
    defaulted, _ = admit(body)
    with pytest.raises(ValueError):
        render(defaulted["spec"], owner=OWNER)


@pytest.mark.parametrize(
    ("path", "value", "base"),
    [
        ("spec.kvCache.bitBudget", 2.0, "triaxial"),
        ("spec.kvCache.bitBudget", 4, "triaxial"),  # an integer in YAML is still a number
        ("spec.kvCache.pageSize", 32, "triaxial"),
        ("spec.kvCache.pageSize", 64, "fp8_e4m3"),
        ("spec.reuse", {"retentionTTLSeconds": 60, "leaseTTLSeconds": 59}, "fp8_e4m3"),
        ("spec.decode.replicas", 0, "fp8_e4m3"),
        ("spec.reuse.recomputeThresholdTokens", 0, "fp8_e4m3"),
        ("spec.reuse.recomputeThresholdTokens", "auto", "fp8_e4m3"),
        ("spec.kvCache.calibration", {"configMap": "my-model.calib"}, "triaxial"),
        ("spec.kvCache.calibration", {"configMap": "c", "key": "qwen3-8b_v2.json"}, "fp8_e4m3"),
        ("spec.gateway.apiKeysSecret", {"name": "gw-keys"}, "fp8_e4m3"),
        ("spec.gateway.allowFrom", [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.9.0.0/16"]}}], "fp8_e4m3"),
        ("spec.gateway.allowFrom", [{"namespaceSelector": {"matchLabels": {"team": "a"}}}], "fp8_e4m3"),
        ("spec.monitoring.allowFrom", [], "fp8_e4m3"),
        ("spec.decode.resources", {"limits": {"memory": "200Gi", "nvidia.com/gpu": 2}}, "fp8_e4m3"),
        ("spec.reuse.tenantsShareCache", True, "fp8_e4m3"),
        ("spec.networkPolicy", {"enabled": False}, "fp8_e4m3"),
        ("spec.networkPolicy.egress", {"enabled": False}, "fp8_e4m3"),
        ("spec.reuse.peerTimeoutSeconds", 0.25, "fp8_e4m3"),
        ("spec.kvCache.layout", "pageMajor", "triaxial"),
        (
            "spec.networkPolicy.egress.allowTo",
            [
                {
                    "to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}],
                    "ports": [{"port": 4317}, {"protocol": "UDP", "port": 9000, "endPort": 9100}],
                }
            ],
            "fp8_e4m3",
        ),
    ],
)
def test_boundary_values_are_admitted(path: str, value: Any, base: str) -> None:
    _, errors = admit(_with(path, value, base=base))
    assert errors == []


def test_other_schema_errors_are_refused() -> None:
    _, errors = admit(_with("spec.kvCache.dtype", "int3"))
    assert any("kvCache.dtype" in e for e in errors)
    _, errors = admit(_with("spec.kvCache.layout", "page_major"))  # the engine config's spelling, not the CRD's
    assert any("kvCache.layout" in e for e in errors)
    with pytest.raises(ValueError, match="spec.kvCache.layout must be one of"):
        parse_spec(_with("spec.kvCache.layout", "page_major")["spec"])
    _, errors = admit(_with("spec.kvCache.memoryFraction", 1.5))
    assert errors == ["spec.kvCache.memoryFraction: memoryFraction must be in (0, 1]"]
    _, errors = admit(_with("spec.kvCache.bitsBudget", 3.0))
    assert errors == ["spec.kvCache.bitsBudget: unknown field"]
    _, errors = admit(_with("metadata.name", "n" * 51))
    assert errors == ["<root>: metadata.name must be at most 50 characters (child Services append -prefill, -decode, -gateway)"]


def test_the_kv_layout_reaches_the_engine_config() -> None:
    defaulted, errors = admit(_with("spec.kvCache.layout", "pageMajor", base="triaxial"))
    assert errors == []
    assert parse_spec(defaulted["spec"]).serving.kv_cache.layout == "page_major"


def test_auto_recompute_threshold_reaches_the_engine_config() -> None:
    defaulted, errors = admit(_with("spec.reuse.recomputeThresholdTokens", "auto"))
    assert errors == []
    assert parse_spec(defaulted["spec"]).serving.reuse.recompute_threshold_tokens == "auto"
