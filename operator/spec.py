"""The KVServing spec as typed values, and its mapping to the engine config.

``crds/kvserving.yaml`` is the source of truth for field names and defaults;
the API server applies those defaults before the operator sees an object. The
defaults here repeat them so that rendering a spec the API server did not
default (a test, ``kvserving operator --render``) gives the same objects; a
test holds the two to each other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvserving.config import GatewayConfig, KVCacheConfig, ModelConfig, ReuseConfig, SecurityConfig, ServingConfig
from kvserving.operator.quantity import parse_quantity, resources_problems

log = logging.getLogger(__name__)

DEFAULT_IMAGE = "ghcr.io/kvserving/kvserving:0.1.0"
WORKER_PORT = 8000
GATEWAY_PORT = 8080
# Nominal bits per KV value shown in `kubectl get kvs` (triaxial: its budget).
NOMINAL_BITS = {"bf16": 16.0, "fp8_e4m3": 8.0, "nvfp4": 4.0}
# Where a worker sees the calibration ConfigMap (kvCache.calibration), mounted read-only.
CALIBRATION_DIR = "/etc/kvserving/calibration"
# spec.kvCache.layout -> kv_cache.layout
_KV_LAYOUTS = {"layerMajor": "layer_major", "pageMajor": "page_major"}
CALIBRATION_KEY = "calibration.json"
# Secrets are files, never environment variables: the internal credential
# (Secret NAME-internal, key "token", made by the operator) in the gateway and
# every worker, the gateway's API keys (spec.gateway.apiKeysSecret) in the gateway.
INTERNAL_TOKEN_DIR = "/var/run/kvserving/internal"
INTERNAL_TOKEN_KEY = "token"
API_KEYS_DIR = "/var/run/kvserving/api-keys"
API_KEYS_KEY = "api-keys"
# Where manifests/ installs the operator (its KV-health sampler calls the workers).
OPERATOR_NAMESPACE = "kvserving-system"
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "kvserving-operator"}
# Who may reach /metrics when spec.monitoring.allowFrom is not set: pods named
# prometheus (prometheus-operator's label) in any namespace.
DEFAULT_MONITORING_PEER: dict[str, Any] = {
    "namespaceSelector": {},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}


@dataclass(slots=True, frozen=True)
class RoleSpec:
    """One component's pods: prefill, decode or gateway."""

    replicas: int = 1
    resources: dict[str, Any] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    service_type: str = "ClusterIP"  # gateway only
    api_keys_secret: str | None = None  # gateway only: Secret with the API keys
    api_keys_key: str = API_KEYS_KEY
    allow_from: tuple[dict[str, Any], ...] = ()  # gateway only: NetworkPolicy peers; () = any source


@dataclass(slots=True, frozen=True)
class MonitoringSpec:
    enabled: bool = True
    dashboard: bool = True
    scrape_interval: str = "30s"
    labels: dict[str, str] = field(default_factory=dict)
    allow_from: tuple[dict[str, Any], ...] = (DEFAULT_MONITORING_PEER,)  # NetworkPolicy peers for /metrics


@dataclass(slots=True, frozen=True)
class EgressSpec:
    """networkPolicy.egress: where this KVServing's pods may connect beyond its own workers."""

    enabled: bool = True
    dns_to: tuple[dict[str, Any], ...] = ()  # () = any destination on port 53
    allow_to: tuple[dict[str, Any], ...] = ()  # extra NetworkPolicy egress rules, every pod


@dataclass(slots=True, frozen=True)
class KVServingSpec:
    """Everything the renderer needs from ``.spec``; the engine config is nested as-is."""

    image: str
    image_pull_policy: str
    model_pvc: str | None
    serving: ServingConfig  # without gateway service names; render adds them
    prefill: RoleSpec
    decode: RoleSpec
    gateway: RoleSpec
    monitoring: MonitoringSpec
    # kvCache.allowOtherGPUs (deprecated alias allowEmulation): no compute-capability node affinity
    allow_other_gpus: bool = False
    calibration_config_map: str | None = None  # kvCache.calibration.configMap
    network_policy: bool = True  # networkPolicy.enabled
    operator_namespace: str = OPERATOR_NAMESPACE  # networkPolicy.operatorNamespace
    egress: EgressSpec = EgressSpec()  # networkPolicy.egress

    @property
    def kv_bits(self) -> float:
        kv = self.serving.kv_cache
        bits = kv.effective_bit_budget
        return bits if bits is not None else NOMINAL_BITS[kv.dtype]

    @property
    def kv_calibration(self) -> str:
        """One line for ``status.kvCalibration``: where the bits table or global scales come from."""
        kv, cm = self.serving.kv_cache, self.calibration_config_map
        if kv.dtype == "bf16":
            return "none: bf16 is not quantized"
        if kv.dtype == "triaxial":
            if cm is None:
                return f"default bits table for bitBudget {kv.effective_bit_budget:g} (no calibration ConfigMap)"
            return f"calibrated bits table for bitBudget {kv.effective_bit_budget:g} from ConfigMap {cm}"
        if kv.global_scale == "static":
            unused = f" (ConfigMap {cm}'s scales unused: globalScale is static)" if cm else ""
            return "global scales 1.0" + unused
        if cm is None:
            return "global scales measured at worker start (no calibration ConfigMap)"
        return f"calibrated global scales from ConfigMap {cm}"


# Every container gets CPU and memory requests and limits; a spec's resources
# override these key by key (a key left out keeps its default).
GPU = "nvidia.com/gpu"
WORKER_RESOURCES: dict[str, dict[str, Any]] = {
    "requests": {"cpu": "4", "memory": "32Gi"},
    "limits": {"cpu": "8", "memory": "64Gi", GPU: 1},
}
GATEWAY_RESOURCES: dict[str, dict[str, Any]] = {
    "requests": {"cpu": "500m", "memory": "1Gi"},
    "limits": {"cpu": "2", "memory": "4Gi"},
}


def resources(given: dict[str, Any] | None, default: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The container resources: ``default`` overridden key by key by ``given``.
    A limit given without its request caps the default request (as Kubernetes
    makes the request equal to a lone limit)."""
    given = given or {}
    requests = {**default["requests"], **(given.get("requests") or {})}
    limits = {**default["limits"], **(given.get("limits") or {})}
    for name, limit in (given.get("limits") or {}).items():
        if name in requests and name not in (given.get("requests") or {}):
            req, lim = parse_quantity(requests[name]), parse_quantity(limit)
            if req is not None and lim is not None and lim < req:
                requests[name] = limit
    return {"requests": requests, "limits": limits}


def _role(data: dict[str, Any], default_resources: dict[str, dict[str, Any]], *, where: str) -> RoleSpec:
    merged = resources(data.get("resources"), default_resources)
    problems = resources_problems(merged, where=f"{where}.resources")
    if where == "spec.gateway" and any(GPU in merged[kind] for kind in ("requests", "limits")):
        problems.append(f"the gateway uses no GPU: remove {GPU} from spec.gateway.resources")
    if problems:
        raise ValueError("; ".join(problems))
    keys = data.get("apiKeysSecret")
    key = (keys or {}).get("key", API_KEYS_KEY)
    if keys is not None and (not keys.get("name") or key in (".", "..") or "/" in key):
        raise ValueError(f"{where}.apiKeysSecret needs a Secret name and a file-name key")
    return RoleSpec(
        replicas=int(data.get("replicas", 1)),
        resources=merged,
        node_selector=dict(data.get("nodeSelector", {})),
        tolerations=tuple(data.get("tolerations", ())),
        service_type=data.get("serviceType", "ClusterIP"),
        api_keys_secret=keys["name"] if keys else None,
        api_keys_key=key,
        allow_from=tuple(data.get("allowFrom", ())),
    )


def parse_spec(spec: dict[str, Any]) -> KVServingSpec:
    """Typed view of ``.spec``. Raises ``ValueError`` (naming the field) when the
    engine config refuses it — the CRD's CEL rules should have refused it first."""
    model = spec.get("model", {})
    kv = spec.get("kvCache", {})
    reuse = spec.get("reuse", {})
    mon = spec.get("monitoring", {})
    bit_budget = kv.get("bitBudget")
    calibration = kv.get("calibration")
    if calibration is not None and kv.get("dtype", "bf16") == "bf16":
        raise ValueError("spec.kvCache.calibration needs dtype triaxial, fp8_e4m3 or nvfp4 (bf16 has nothing to calibrate)")
    key = (calibration or {}).get("key", CALIBRATION_KEY)
    if calibration is not None and (not calibration.get("configMap") or key in (".", "..") or "/" in key):
        raise ValueError("spec.kvCache.calibration needs a configMap name and a file-name key")
    layout = kv.get("layout", "pageMajor")
    if layout not in _KV_LAYOUTS:
        raise ValueError(f"spec.kvCache.layout must be one of {sorted(_KV_LAYOUTS)}, got {layout!r}")
    serving = ServingConfig(
        model=ModelConfig(
            path=model.get("path", ""),
            served_name=model.get("servedName", "kvserving-tiny"),
            max_model_len=model.get("maxModelLen"),
            weight_format=model.get("weightFormat", "auto"),
        ),
        kv_cache=KVCacheConfig(
            dtype=kv.get("dtype", "bf16"),
            page_size=kv.get("pageSize"),
            bit_budget=float(bit_budget) if bit_budget is not None else None,
            memory_fraction=float(kv.get("memoryFraction", 0.9)),
            global_scale=kv.get("globalScale", "static"),
            calibration=f"{CALIBRATION_DIR}/{key}" if calibration is not None else None,
            age_down=bool(kv.get("ageDown", True)),
            layout=_KV_LAYOUTS[layout],
        ),
        reuse=ReuseConfig(
            bidirectional=bool(reuse.get("bidirectional", True)),
            retention_ttl_s=float(reuse.get("retentionTTLSeconds", 480)),
            lease_ttl_s=float(reuse.get("leaseTTLSeconds", 420)),
            recompute_threshold_tokens=_threshold(reuse.get("recomputeThresholdTokens", 64)),
            peer_timeout_s=float(reuse.get("peerTimeoutSeconds", 1.0)),
        ),
        security=SecurityConfig(tenants_share_cache=bool(reuse.get("tenantsShareCache", False))),
    )
    roles = {name: spec.get(name, {}) for name in ("prefill", "decode", "gateway")}
    for name, role in roles.items():
        if int(role.get("replicas", 1)) < 0:
            raise ValueError(f"spec.{name}.replicas must not be negative, got {role['replicas']}")
    return KVServingSpec(
        image=spec.get("image", DEFAULT_IMAGE),
        image_pull_policy=spec.get("imagePullPolicy", "IfNotPresent"),
        model_pvc=model.get("pvcName") or None,
        serving=serving,
        allow_other_gpus=_allow_other_gpus(kv),
        prefill=_role(roles["prefill"], WORKER_RESOURCES, where="spec.prefill"),
        decode=_role(roles["decode"], WORKER_RESOURCES, where="spec.decode"),
        gateway=_role(roles["gateway"], GATEWAY_RESOURCES, where="spec.gateway"),
        monitoring=MonitoringSpec(
            enabled=bool(mon.get("enabled", True)),
            dashboard=bool(mon.get("dashboard", True)),
            scrape_interval=mon.get("scrapeInterval", "30s"),
            labels=dict(mon.get("labels", {})),
            allow_from=tuple(mon.get("allowFrom", (DEFAULT_MONITORING_PEER,))),
        ),
        calibration_config_map=calibration["configMap"] if calibration is not None else None,
        network_policy=bool(spec.get("networkPolicy", {}).get("enabled", True)),
        operator_namespace=spec.get("networkPolicy", {}).get("operatorNamespace", OPERATOR_NAMESPACE),
        egress=_egress(spec.get("networkPolicy", {}).get("egress", {})),
    )


def _egress(data: dict[str, Any]) -> EgressSpec:
    # A port's protocol defaults to TCP in the CRD; the renderer writes it out
    # so a spec the API server did not default renders the same objects.
    rules = []
    for rule in data.get("allowTo", ()):
        ports = [{"protocol": "TCP", **port} for port in rule.get("ports", ())]
        rules.append({"to": list(rule["to"]), **({"ports": ports} if "ports" in rule else {})})
    return EgressSpec(
        enabled=bool(data.get("enabled", True)),
        dns_to=tuple(data.get("dnsTo", ())),
        allow_to=tuple(rules),
    )


def _allow_other_gpus(kv: dict[str, Any]) -> bool:
    """kvCache.allowOtherGPUs, or its deprecated alias allowEmulation (logged once per parse: nothing is emulated,
    the flag only lifts the node affinity)."""
    if "allowEmulation" in kv:
        log.warning("spec.kvCache.allowEmulation is deprecated: use allowOtherGPUs (same meaning: workers may run "
                    "on GPUs outside the supported compute capabilities)")  # fmt: skip
    return bool(kv.get("allowOtherGPUs", False) or kv.get("allowEmulation", False))


def engine_config(spec: KVServingSpec, *, name: str, namespace: str) -> ServingConfig:
    """The engine config of one KVServing: the spec's, plus where the gateway
    finds the workers (the headless Services, resolved through cluster DNS) and
    where the mounted credentials are."""
    keys = spec.gateway.api_keys_secret
    return ServingConfig(
        model=spec.serving.model,
        kv_cache=spec.serving.kv_cache,
        reuse=spec.serving.reuse,
        scheduler=spec.serving.scheduler,
        gateway=GatewayConfig(
            prefill_service=f"{name}-prefill.{namespace}.svc",
            decode_service=f"{name}-decode.{namespace}.svc",
            worker_port=WORKER_PORT,
        ),
        security=SecurityConfig(
            internal_token_file=f"{INTERNAL_TOKEN_DIR}/{INTERNAL_TOKEN_KEY}",
            api_keys_file=f"{API_KEYS_DIR}/{spec.gateway.api_keys_key}" if keys else None,
            tenants_share_cache=spec.serving.security.tenants_share_cache,
            max_hold_s=spec.serving.security.max_hold_s,
        ),
    )


def _threshold(value: Any) -> int | str:
    """recomputeThresholdTokens: an integer, or "auto" (the CRD's CEL rule admits nothing else)."""
    return "auto" if value == "auto" else int(value)
