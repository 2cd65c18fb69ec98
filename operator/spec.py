"""The KVServing spec as typed values, and its mapping to the engine config.

``crds/kvserving.yaml`` is the source of truth for field names and defaults;
the API server applies those defaults before the operator sees an object. The
defaults here repeat them so that rendering a spec the API server did not
default (a test, ``kvserving operator --render``) gives the same objects; a
test holds the two to each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserving.config import GatewayConfig, KVCacheConfig, ModelConfig, ReuseConfig, ServingConfig

DEFAULT_IMAGE = "ghcr.io/kvserving/kvserving:0.1.0"
WORKER_PORT = 8000
GATEWAY_PORT = 8080
# Nominal bits per KV value shown in `kubectl get kvs` (triaxial: its budget).
NOMINAL_BITS = {"bf16": 16.0, "fp8_e4m3": 8.0, "nvfp4": 4.0}
# Where a worker sees the calibration ConfigMap (kvCache.calibration), mounted read-only.
CALIBRATION_DIR = "/etc/kvserving/calibration"
CALIBRATION_KEY = "calibration.json"


@dataclass(slots=True, frozen=True)
class RoleSpec:
    """One component's pods: prefill, decode or gateway."""

    replicas: int = 1
    resources: dict[str, Any] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    service_type: str = "ClusterIP"  # gateway only


@dataclass(slots=True, frozen=True)
class MonitoringSpec:
    enabled: bool = True
    dashboard: bool = True
    scrape_interval: str = "30s"
    labels: dict[str, str] = field(default_factory=dict)


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
    calibration_config_map: str | None = None  # kvCache.calibration.configMap

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


_GPU_RESOURCES = {"limits": {"nvidia.com/gpu": 1}}
_GATEWAY_RESOURCES = {"requests": {"cpu": "500m", "memory": "1Gi"}}


def _role(data: dict[str, Any], default_resources: dict[str, Any]) -> RoleSpec:
    return RoleSpec(
        replicas=int(data.get("replicas", 1)),
        resources=data.get("resources", default_resources),
        node_selector=dict(data.get("nodeSelector", {})),
        tolerations=tuple(data.get("tolerations", ())),
        service_type=data.get("serviceType", "ClusterIP"),
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
    serving = ServingConfig(
        model=ModelConfig(
            path=model.get("path", ""),
            served_name=model.get("servedName", "kvserving-tiny"),
            max_model_len=model.get("maxModelLen"),
        ),
        kv_cache=KVCacheConfig(
            dtype=kv.get("dtype", "bf16"),
            page_size=kv.get("pageSize"),
            bit_budget=float(bit_budget) if bit_budget is not None else None,
            memory_fraction=float(kv.get("memoryFraction", 0.9)),
            global_scale=kv.get("globalScale", "static"),
            allow_emulation=bool(kv.get("allowEmulation", False)),
            calibration=f"{CALIBRATION_DIR}/{key}" if calibration is not None else None,
            age_down=bool(kv.get("ageDown", True)),
        ),
        reuse=ReuseConfig(
            bidirectional=bool(reuse.get("bidirectional", True)),
            retention_ttl_s=float(reuse.get("retentionTTLSeconds", 480)),
            lease_ttl_s=float(reuse.get("leaseTTLSeconds", 420)),
            recompute_threshold_tokens=_threshold(reuse.get("recomputeThresholdTokens", 64)),
        ),
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
        prefill=_role(roles["prefill"], _GPU_RESOURCES),
        decode=_role(roles["decode"], _GPU_RESOURCES),
        gateway=_role(roles["gateway"], _GATEWAY_RESOURCES),
        monitoring=MonitoringSpec(
            enabled=bool(mon.get("enabled", True)),
            dashboard=bool(mon.get("dashboard", True)),
            scrape_interval=mon.get("scrapeInterval", "30s"),
            labels=dict(mon.get("labels", {})),
        ),
        calibration_config_map=calibration["configMap"] if calibration is not None else None,
    )


def engine_config(spec: KVServingSpec, *, name: str, namespace: str) -> ServingConfig:
    """The engine config of one KVServing: the spec's, plus where the gateway
    finds the workers (the headless Services, resolved through cluster DNS)."""
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
    )


def _threshold(value: Any) -> int | str:
    """recomputeThresholdTokens: an integer, or "auto" (the CRD's CEL rule admits nothing else)."""
    return "auto" if value == "auto" else int(value)
