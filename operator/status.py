"""Pure decisions of the reconciler: what to write given the observed children
(``plan_children``), and what to report given the owned Deployments
(``compute_status``). No I/O; kube.py does the calls, reconcile.py glues.

Conditions follow metav1.Condition (type, status, observedGeneration,
lastTransitionTime, reason, message); lastTransitionTime moves only when a
condition's status changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserving.operator.kv_health import kv_degraded
from kvserving.operator.render import APPLIED_HASH, CONFIG_HASH, ROLES

CONDITION_TYPES = ("Ready", "PrefillReady", "DecodeReady", "GatewayReady", "Progressing", "Degraded")
ROLE_CONDITION = {"prefill": "PrefillReady", "decode": "DecodeReady", "gateway": "GatewayReady"}
# Only the reconciler, which applies the children, sets or clears this reason:
# a status refresh between its retries carries it over.
APPLY_FAILED = "ApplyFailed"

ObjectKey = tuple[str, str, str]  # (apiVersion, kind, name)


def object_key(obj: dict[str, Any]) -> ObjectKey:
    return (obj["apiVersion"], obj["kind"], obj["metadata"]["name"])


@dataclass(slots=True, frozen=True)
class Plan:
    """Children to apply (missing or changed), to delete (ours, no longer rendered), and left alone."""

    apply: tuple[dict[str, Any], ...]
    delete: tuple[ObjectKey, ...]
    unchanged: tuple[ObjectKey, ...]


def plan_children(desired: tuple[dict[str, Any], ...], observed: list[dict[str, Any]], *, owner_uid: str) -> Plan:
    """Decide the writes. An observed child counts only if this KVServing owns
    it (owner uid): a same-named object of someone else is never deleted, and
    applying over it is left to the API server's field ownership."""
    ours = {
        object_key(obj): obj
        for obj in observed
        if any(ref.get("uid") == owner_uid for ref in obj.get("metadata", {}).get("ownerReferences", []))
    }
    apply, unchanged = [], []
    for obj in desired:
        current = ours.get(object_key(obj))
        if current is not None and not _drifted(obj, current):
            unchanged.append(object_key(obj))
        else:
            apply.append(obj)
    wanted = {object_key(obj) for obj in desired}
    delete = tuple(sorted(key for key in ours if key not in wanted))
    return Plan(apply=tuple(apply), delete=delete, unchanged=tuple(unchanged))


def _drifted(desired: dict[str, Any], current: dict[str, Any]) -> bool:
    want = desired["metadata"]["annotations"][APPLIED_HASH]
    if (current["metadata"].get("annotations") or {}).get(APPLIED_HASH) != want:
        return True
    # Someone scaled a Deployment by hand: the spec's replicas win.
    if desired["kind"] == "Deployment":
        return current.get("spec", {}).get("replicas") != desired["spec"]["replicas"]
    return False


@dataclass(slots=True, frozen=True)
class RoleObservation:
    """What one owned Deployment says about its role."""

    exists: bool
    replicas: int = 0  # the Deployment's spec.replicas
    ready: int = 0
    updated: int = 0
    config_hash: str | None = None  # pod template annotation
    settled: bool = False  # the Deployment controller observed its latest generation
    complete: bool = False  # Progressing=NewReplicaSetAvailable: the rollout finished once
    failure: str | None = None  # ProgressDeadlineExceeded / ReplicaFailure message


MISSING = RoleObservation(exists=False)


def observe_deployment(obj: dict[str, Any] | None) -> RoleObservation:
    if obj is None:
        return MISSING
    status = obj.get("status") or {}
    failure, complete = None, False
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            failure = cond.get("message") or "progress deadline exceeded"
        elif cond.get("type") == "Progressing" and cond.get("reason") == "NewReplicaSetAvailable":
            complete = True
        elif cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            failure = cond.get("message") or cond.get("reason") or "replica failure"
    template_meta = obj.get("spec", {}).get("template", {}).get("metadata", {})
    return RoleObservation(
        exists=True,
        replicas=int(obj.get("spec", {}).get("replicas", 1)),
        ready=int(status.get("readyReplicas") or 0),
        updated=int(status.get("updatedReplicas") or 0),
        config_hash=(template_meta.get("annotations") or {}).get(CONFIG_HASH),
        settled=int(status.get("observedGeneration") or 0) >= int(obj.get("metadata", {}).get("generation") or 0),
        complete=complete,
        failure=failure,
    )


@dataclass(slots=True, frozen=True)
class Desired:
    """What the current spec asks for (from render.Rendered)."""

    generation: int
    replicas: dict[str, int]
    config_hash: str
    endpoint: str
    kv_bits: float
    kv_calibration: str = ""  # where the bits table / global scales come from (spec.KVServingSpec.kv_calibration)


def _condition(ctype: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
    return {"type": ctype, "status": "True" if ok else "False", "reason": reason, "message": message}


def _role_condition(role: str, name: str, want: int, config_hash: str, obs: RoleObservation) -> tuple[dict[str, Any], str]:
    """The role's condition and its state: ready, rolling, unavailable (replicas
    lost after a finished rollout) or failed."""
    ctype = ROLE_CONDITION[role]
    counts = f"{obs.ready}/{want} replicas ready"
    if not obs.exists:
        return _condition(ctype, False, "DeploymentMissing", f"Deployment {name}-{role} does not exist yet"), "rolling"
    if obs.failure is not None:
        return _condition(ctype, False, "RolloutFailed", f"{counts}: {obs.failure}"), "failed"
    current = obs.config_hash == config_hash and obs.replicas == want and obs.settled
    if current and want == 0:
        return _condition(ctype, True, "ScaledToZero", "0 replicas requested"), "ready"
    if not current or obs.updated < want:
        return _condition(ctype, False, "RollingOut", f"{counts}, {obs.updated}/{want} updated to config {config_hash}"), "rolling"
    if obs.ready < want and not obs.complete:
        return _condition(ctype, False, "ReplicasNotReady", f"{counts}, rollout in progress"), "rolling"
    if obs.ready < want:
        return _condition(ctype, False, "ReplicasUnavailable", f"{counts} after the rollout finished"), "unavailable"
    return _condition(ctype, True, "ReplicasReady", counts), "ready"


def compute_status(
    *,
    name: str,
    desired: Desired,
    observed: dict[str, RoleObservation],
    observed_generation: int | None,
    previous: dict[str, Any],
    apply_error: str | None,
    now: str,
    kv: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole ``.status``. ``observed_generation`` is the generation last
    applied successfully; ``apply_error`` the reconciler's failure, if any;
    ``kv`` the workers' KV health (kv_health.summarize), else the previous one is kept."""
    if kv is None:
        kv = previous.get("kv")
    kv_verdict = kv_degraded(kv) if kv is not None else None
    conditions, states = [], {}
    for role in ROLES:
        cond, states[role] = _role_condition(role, name, desired.replicas[role], desired.config_hash, observed.get(role, MISSING))
        conditions.append(cond)
    not_ready = [ROLE_CONDITION[r] for r in ROLES if states[r] != "ready"]
    all_ready = not not_ready and apply_error is None
    ready_msg = "all components ready" if all_ready else "not ready: " + ", ".join(not_ready or ["apply failed"])
    conditions.insert(0, _condition("Ready", all_ready, "AllComponentsReady" if all_ready else "ComponentsNotReady", ready_msg))

    rolling = [r for r in ROLES if states[r] == "rolling"]
    failed = [r for r in ROLES if states[r] == "failed"]
    if rolling:
        conditions.append(_condition("Progressing", True, "RollingOut", "rolling out: " + ", ".join(rolling)))
    elif failed:
        conditions.append(_condition("Progressing", False, "RolloutFailed", "rollout failed: " + ", ".join(failed)))
    else:
        conditions.append(_condition("Progressing", False, "RolloutComplete", "every Deployment runs the current spec"))

    unavailable = [r for r in ROLES if states[r] == "unavailable"]
    if apply_error is not None:
        degraded = _condition("Degraded", True, APPLY_FAILED, apply_error)
    elif failed:
        degraded = _condition(
            "Degraded", True, "RolloutFailed", "; ".join(f"{r}: {c['message']}" for r, c in zip(ROLES, conditions[1:4]) if r in failed)
        )
    elif unavailable:
        degraded = _condition("Degraded", True, "ReplicasUnavailable", "replicas lost after rollout: " + ", ".join(unavailable))
    elif kv_verdict is not None:
        degraded = _condition("Degraded", True, *kv_verdict)
    else:
        degraded = _condition("Degraded", False, "AsExpected", "no errors")
    conditions.append(degraded)

    previous_by_type = {c.get("type"): c for c in previous.get("conditions") or []}
    for cond in conditions:
        cond["observedGeneration"] = desired.generation
        before = previous_by_type.get(cond["type"])
        kept = before.get("lastTransitionTime") if before is not None and before.get("status") == cond["status"] else None
        cond["lastTransitionTime"] = kept or now

    if degraded["status"] == "True":
        phase = "Degraded"
    elif all_ready:
        phase = "Ready"
    elif not any(observed.get(r, MISSING).exists for r in ROLES):
        phase = "Pending"
    else:
        phase = "Progressing"

    status: dict[str, Any] = {
        "phase": phase,
        "configHash": desired.config_hash,
        "kvBits": desired.kv_bits,
        **({"kvCalibration": desired.kv_calibration} if desired.kv_calibration else {}),
        "endpoint": desired.endpoint,
        "conditions": conditions,
    }
    if observed_generation is not None:
        status["observedGeneration"] = observed_generation
    if kv is not None:
        status["kv"] = kv
    for role in ROLES:
        obs, want = observed.get(role, MISSING), desired.replicas[role]
        status[role] = {"replicas": want, "readyReplicas": obs.ready, "updatedReplicas": obs.updated, "ready": f"{obs.ready}/{want}"}
    return status


def carried_apply_error(previous: dict[str, Any]) -> str | None:
    """The reconciler's last failure, which a status refresh must not clear."""
    for cond in previous.get("conditions") or []:
        if cond.get("type") == "Degraded" and cond.get("status") == "True" and cond.get("reason") == APPLY_FAILED:
            return str(cond.get("message", ""))
    return None
