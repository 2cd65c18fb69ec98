"""Pure rendering: a KVServing's spec in, its child objects out (no I/O).

Children of KVServing ``NAME`` in namespace ``NS``:

    NAME-config      ConfigMap   engine config (kvserving.config JSON) at /etc/kvserving/config.json
                                 (kvCache.calibration: the user's ConfigMap, mounted in the workers at
                                 /etc/kvserving/calibration; the engine config names the file there)
    NAME-prefill     Deployment  `kvserving worker --role prefill`, + headless Service
    NAME-decode      Deployment  `kvserving worker --role decode`,  + headless Service
    NAME-gateway     Deployment  `kvserving gateway`,               + Service
    NAME-workers     NetworkPolicy  workers: any port from this KVServing's workers (HTTP and NIXL),
                                 the worker port from its gateway, /metrics from spec.monitoring.allowFrom;
                                 out only to its workers, DNS and networkPolicy.egress.allowTo
    NAME-gateway     NetworkPolicy  gateway: its port from spec.gateway.allowFrom (unset: any source),
                                 /metrics from spec.monitoring.allowFrom; out only to the worker
                                 port of its workers, DNS and egress.allowTo   (networkPolicy.enabled)
    NAME             PodMonitor  scrapes /metrics of all pods        (monitoring.enabled)
    NAME-dashboard   ConfigMap   Grafana dashboard                   (monitoring.enabled and .dashboard)

    NAME-internal    Secret      the internal credential (key "token"), mounted as a file at
                                 /var/run/kvserving/internal/token in the gateway and every worker.
                                 Not in ``objects``: its value is random, so it is created once
                                 (``internal_secret``) and never re-applied, and the same value
                                 lives as long as the KVServing (owner reference).

Every pod template carries the engine config's hash, so a spec change that
changes the config rolls the pods; every object carries the hash of its own
rendering, so the reconciler only writes what changed (status.plan_children).
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from kvserving.operator.dashboard import dashboard_json
from kvserving.operator.names import GROUP, KIND, VERSION
from kvserving.operator.spec import (
    API_KEYS_DIR,
    CALIBRATION_DIR,
    GATEWAY_PORT,
    INTERNAL_TOKEN_DIR,
    OPERATOR_POD_LABELS,
    INTERNAL_TOKEN_KEY,
    WORKER_PORT,
    KVServingSpec,
    RoleSpec,
    engine_config,
    parse_spec,
)

MANAGED_BY = "kvserving-operator"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
CONFIG_HASH = "kvserving.dev/config-hash"
APPLIED_HASH = "kvserving.dev/applied-hash"
CONFIG_DIR = "/etc/kvserving"
CONFIG_FILE = "config.json"
MODEL_DIR = "/models"
ROLES = ("prefill", "decode", "gateway")
WORKER_ROLES = ("prefill", "decode")
SECRET_FILE_MODE = 0o440  # owner and fsGroup read; nobody writes
# GPU feature discovery labels: the compute capabilities whose kernels are
# compiled in CI for nvfp4 and triaxial KV (kernels/capability.py
# PLACEMENT_MAJORS; a test keeps the two equal): Hopper 9.x (H100, H200) and
# Blackwell 10.x (B200, GB200) and 12.x (RTX PRO 6000).
GPU_COMPUTE_MAJOR = "nvidia.com/gpu.compute.major"
PACKED_KV_COMPUTE_MAJORS = ("9", "10", "12")
PACKED_KV_DTYPES = ("nvfp4", "triaxial")


@dataclass(slots=True, frozen=True)
class Owner:
    """The KVServing object the children belong to (their owner reference)."""

    name: str
    namespace: str
    uid: str


@dataclass(slots=True, frozen=True)
class Rendered:
    objects: tuple[dict[str, Any], ...]  # in apply order: config before the pods that mount it
    config_hash: str
    replicas: dict[str, int]  # role -> desired replicas
    endpoint: str
    kv_bits: float
    kv_calibration: str = ""  # status.kvCalibration


def short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def selector_labels(name: str, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "kvserving", LABEL_INSTANCE: name, LABEL_COMPONENT: component}


def instance_labels(name: str) -> dict[str, str]:
    """Labels on every child: the reconciler lists children by these."""
    return {"app.kubernetes.io/name": "kvserving", LABEL_INSTANCE: name, LABEL_MANAGED_BY: MANAGED_BY}


def render(spec: dict[str, Any], *, owner: Owner) -> Rendered:
    """All child objects of one KVServing. Raises ``ValueError`` for a spec the engine config refuses."""
    parsed = parse_spec(spec)
    config_text = engine_config(parsed, name=owner.name, namespace=owner.namespace).to_json()
    config_hash = short_hash(config_text)
    objects: list[dict[str, Any]] = [
        _config_map(owner, f"{owner.name}-config", "engine", {CONFIG_FILE: config_text}, {}),
    ]
    for role in ("prefill", "decode"):
        objects.append(_service(owner, role, WORKER_PORT, headless=True, service_type="ClusterIP"))
        objects.append(_deployment(owner, parsed, role, config_hash))
    objects.append(_service(owner, "gateway", GATEWAY_PORT, headless=False, service_type=parsed.gateway.service_type))
    objects.append(_deployment(owner, parsed, "gateway", config_hash))
    if parsed.network_policy:
        objects += [_worker_network_policy(owner, parsed), _gateway_network_policy(owner, parsed)]
    if parsed.monitoring.enabled:
        objects.append(_pod_monitor(owner, parsed))
        if parsed.monitoring.dashboard:
            dashboard = {f"kvserving-{owner.namespace}-{owner.name}.json": dashboard_json(namespace=owner.namespace, instance=owner.name)}
            labels = {"grafana_dashboard": "1", **parsed.monitoring.labels}
            objects.append(_config_map(owner, f"{owner.name}-dashboard", "dashboard", dashboard, labels))
    return Rendered(
        objects=tuple(_with_applied_hash(obj) for obj in objects),
        config_hash=config_hash,
        replicas={role: _role_spec(parsed, role).replicas for role in ROLES},
        endpoint=f"http://{owner.name}-gateway.{owner.namespace}.svc:{GATEWAY_PORT}",
        kv_bits=parsed.kv_bits,
        kv_calibration=parsed.kv_calibration,
    )


def internal_secret_name(name: str) -> str:
    return f"{name}-internal"


def internal_secret(owner: Owner, *, token: str) -> dict[str, Any]:
    """The Secret holding the deployment's internal credential (created once, never re-applied)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(owner, internal_secret_name(owner.name), "credential", {}),
        "type": "Opaque",
        "stringData": {INTERNAL_TOKEN_KEY: token},
    }


def _role_spec(spec: KVServingSpec, role: str) -> RoleSpec:
    return {"prefill": spec.prefill, "decode": spec.decode, "gateway": spec.gateway}[role]


def _with_applied_hash(obj: dict[str, Any]) -> dict[str, Any]:
    digest = short_hash(json.dumps(obj, sort_keys=True))
    obj["metadata"].setdefault("annotations", {})[APPLIED_HASH] = digest
    return obj


def _metadata(owner: Owner, name: str, component: str, extra_labels: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": {**instance_labels(owner.name), LABEL_COMPONENT: component, **extra_labels},
        # No blockOwnerDeletion: it would need update on kvservings/finalizers,
        # and garbage collection deletes the children either way.
        "ownerReferences": [{"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": owner.name, "uid": owner.uid, "controller": True}],
    }


def _config_map(owner: Owner, name: str, component: str, data: dict[str, str], labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(owner, name, component, labels), "data": data}


def _service(owner: Owner, role: str, port: int, *, headless: bool, service_type: str) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "type": service_type,
        "selector": selector_labels(owner.name, role),
        "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
    }
    if headless:
        # Headless: DNS returns every ready worker pod, which the gateway resolves
        # to route per worker (prefix holder for prefill, load for decode).
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(owner, f"{owner.name}-{role}", role, {}), "spec": spec}


def _container(spec: KVServingSpec, role: str, role_spec: RoleSpec) -> dict[str, Any]:
    config = f"{CONFIG_DIR}/{CONFIG_FILE}"
    if role == "gateway":
        args = ["gateway", "--config", config, "--host", "0.0.0.0", "--port", str(GATEWAY_PORT)]
        port = GATEWAY_PORT
    else:
        args = ["worker", "--role", role, "--config", config, "--host", "0.0.0.0", "--port", str(WORKER_PORT)]
        port = WORKER_PORT
    mounts = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if role != "gateway":
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})  # UCX/NIXL shared-memory transport
    if spec.model_pvc:  # the gateway reads the model's tokenizer and chat template from it
        mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
    if spec.calibration_config_map and role != "gateway":  # kv_cache.calibration points into it
        mounts.append({"name": "calibration", "mountPath": CALIBRATION_DIR, "readOnly": True})
    # security.internal_token_file and security.api_keys_file point into these
    mounts.append({"name": "internal-token", "mountPath": INTERNAL_TOKEN_DIR, "readOnly": True})
    if role == "gateway" and spec.gateway.api_keys_secret:
        mounts.append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
    return {
        "name": role if role == "gateway" else "worker",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["kvserving"],
        "args": args,
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "env": [
            {"name": "HOME", "value": "/tmp"},  # read-only root: caches (Triton, tokenizer) go to /tmp
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        ],
        "resources": role_spec.resources,
        # Model loading can take minutes: the startup probe holds off liveness until /health answers.
        "startupProbe": _probe("/health", period=10, failures=60),
        "readinessProbe": _probe("/ready", period=5, failures=3),
        "livenessProbe": _probe("/health", period=10, failures=6),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": mounts,
    }


def _probe(path: str, *, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "failureThreshold": failures, "timeoutSeconds": 5}


def _affinity(spec: KVServingSpec, role: str) -> dict[str, Any] | None:
    kv = spec.serving.kv_cache
    if role == "gateway" or kv.dtype not in PACKED_KV_DTYPES or spec.allow_other_gpus:
        return None
    term = {"matchExpressions": [{"key": GPU_COMPUTE_MAJOR, "operator": "In", "values": list(PACKED_KV_COMPUTE_MAJORS)}]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


def _deployment(owner: Owner, spec: KVServingSpec, role: str, config_hash: str) -> dict[str, Any]:
    role_spec = _role_spec(spec, role)
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": f"{owner.name}-config"}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if role != "gateway":
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    if spec.model_pvc:
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": spec.model_pvc, "readOnly": True}})
    if spec.calibration_config_map and role != "gateway":
        volumes.append({"name": "calibration", "configMap": {"name": spec.calibration_config_map}})
    volumes.append(_secret_volume("internal-token", internal_secret_name(owner.name), INTERNAL_TOKEN_KEY))
    if role == "gateway" and spec.gateway.api_keys_secret:
        volumes.append(_secret_volume("api-keys", spec.gateway.api_keys_secret, spec.gateway.api_keys_key))
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # workers and gateway never call the Kubernetes API
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_container(spec, role, role_spec)],
        "volumes": volumes,
        "nodeSelector": dict(role_spec.node_selector),
        "tolerations": [dict(t) for t in role_spec.tolerations],
    }
    affinity = _affinity(spec, role)
    if affinity is not None:
        pod_spec["affinity"] = affinity
    labels = selector_labels(owner.name, role)
    deployment_spec: dict[str, Any] = {
        "replicas": role_spec.replicas,
        "selector": {"matchLabels": labels},
        "template": {
            "metadata": {"labels": {**labels, LABEL_MANAGED_BY: MANAGED_BY}, "annotations": {CONFIG_HASH: config_hash}},
            "spec": pod_spec,
        },
    }
    if role != "gateway":
        # Replace GPU pods one at a time without surging: a surge pod would need
        # a spare GPU that a full node pool does not have.
        deployment_spec["strategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
        deployment_spec["progressDeadlineSeconds"] = 1200  # model loading counts as progress time
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, f"{owner.name}-{role}", role, {}),
        "spec": deployment_spec,
    }


def _secret_volume(volume: str, secret: str, key: str) -> dict[str, Any]:
    """One key of a Secret as a read-only file named after the key (only that key is exposed)."""
    return {
        "name": volume,
        "secret": {"secretName": secret, "items": [{"key": key, "path": key}], "defaultMode": SECRET_FILE_MODE},
    }


def _pods(owner: Owner, roles: tuple[str, ...]) -> dict[str, Any]:
    """A label selector for this KVServing's pods of these roles."""
    if len(roles) == 1:
        return {"matchLabels": selector_labels(owner.name, roles[0])}
    return {
        "matchLabels": {"app.kubernetes.io/name": "kvserving", LABEL_INSTANCE: owner.name},
        "matchExpressions": [{"key": LABEL_COMPONENT, "operator": "In", "values": list(roles)}],
    }


def _tcp(*ports: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": port} for port in ports]


def _network_policy(
    owner: Owner, spec: KVServingSpec, name: str, roles: tuple[str, ...], ingress: list[dict[str, Any]], egress: list[dict[str, Any]]
) -> dict[str, Any]:
    policy: dict[str, Any] = {"podSelector": _pods(owner, roles), "policyTypes": ["Ingress"], "ingress": ingress}
    if spec.egress.enabled:
        policy["policyTypes"] = ["Ingress", "Egress"]
        policy["egress"] = [*egress, *_egress_common(spec)]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(owner, name, "network-policy", {}),
        "spec": policy,
    }


def _egress_common(spec: KVServingSpec) -> list[dict[str, Any]]:
    """Egress every pod of the KVServing has: DNS (the headless Services are
    resolved by name), to spec.networkPolicy.egress.dnsTo or, unset, to any
    destination on port 53 (node-local DNS caches listen on a link-local
    address no selector matches); then the configured extra rules."""
    dns: dict[str, Any] = {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
    if spec.egress.dns_to:
        dns = {"to": copy.deepcopy(list(spec.egress.dns_to)), **dns}
    return [dns, *copy.deepcopy(list(spec.egress.allow_to))]


def _worker_network_policy(owner: Owner, spec: KVServingSpec) -> dict[str, Any]:
    """Workers take connections only from this KVServing: any port from its
    workers (the worker port, and NIXL's UCX listeners, which take ephemeral
    ports), the worker port from its gateway and from the operator (the
    KV-health sampler, in the operator's namespace or, when the operator
    watches only its own namespace, this one); /metrics (on the worker port)
    from the monitoring peers. /internal/* still needs the token."""
    peers: list[dict[str, Any]] = [{"podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}}]
    if spec.operator_namespace != owner.namespace:
        peers.append(
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": spec.operator_namespace}},
                "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)},
            }
        )
    ingress: list[dict[str, Any]] = [
        {"from": [{"podSelector": _pods(owner, WORKER_ROLES)}]},
        {"from": [{"podSelector": _pods(owner, ("gateway",))}, *peers], "ports": _tcp(WORKER_PORT)},
    ]
    if spec.monitoring.allow_from:
        ingress.append({"from": copy.deepcopy(list(spec.monitoring.allow_from)), "ports": _tcp(WORKER_PORT)})
    # Out: this KVServing's workers only (any port, as in), so no request can
    # make a worker reach another deployment, the API server or the internet.
    egress = [{"to": [{"podSelector": _pods(owner, WORKER_ROLES)}]}]
    return _network_policy(owner, spec, f"{owner.name}-workers", WORKER_ROLES, ingress, egress)


def _gateway_network_policy(owner: Owner, spec: KVServingSpec) -> dict[str, Any]:
    """The gateway's port from spec.gateway.allowFrom, or from any source when
    that is unset (any pod of the cluster, and outside clients where the
    Service is a NodePort or LoadBalancer); the gateway authenticates clients
    itself when API keys are configured."""
    rule: dict[str, Any] = {"ports": _tcp(GATEWAY_PORT)}
    if spec.gateway.allow_from:
        rule["from"] = copy.deepcopy(list(spec.gateway.allow_from))
    ingress = [rule]
    if spec.gateway.allow_from and spec.monitoring.allow_from:
        ingress.append({"from": copy.deepcopy(list(spec.monitoring.allow_from)), "ports": _tcp(GATEWAY_PORT)})
    egress = [{"to": [{"podSelector": _pods(owner, WORKER_ROLES)}], "ports": _tcp(WORKER_PORT)}]
    return _network_policy(owner, spec, f"{owner.name}-gateway", ("gateway",), ingress, egress)


def _pod_monitor(owner: Owner, spec: KVServingSpec) -> dict[str, Any]:
    relabel = [
        {"sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"], "targetLabel": "kvserving"},
        {"sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_component"], "targetLabel": "component"},
    ]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _metadata(owner, owner.name, "monitoring", spec.monitoring.labels),
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": "kvserving", LABEL_INSTANCE: owner.name}},
            "podMetricsEndpoints": [
                {"port": "http", "path": "/metrics", "interval": spec.monitoring.scrape_interval, "relabelings": relabel}
            ],
        },
    }
