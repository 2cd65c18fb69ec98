"""One reconcile pass and one status refresh of a KVServing: render (pure),
observe and write through kube.KubeApi, decide with status.py (pure).

Nothing here raises on an API failure: the failure becomes the Degraded
condition and an ``Outcome.error`` that the kopf handler turns into an Event
and a retry with backoff, so the operator itself never crash-loops.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from kvserving.operator.kube import CHILD_RESOURCES, OPTIONAL_GROUPS, ApiError, KubeApi
from kvserving.operator.render import Owner, Rendered, instance_labels, internal_secret, internal_secret_name, render
from kvserving.operator.status import (
    Desired,
    RoleObservation,
    carried_apply_error,
    compute_status,
    object_key,
    observe_deployment,
    plan_children,
)

INVALID_SPEC = "InvalidSpec"


@dataclass(slots=True)
class Outcome:
    status: dict[str, Any]
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    error: str | None = None  # retry later
    permanent: bool = False  # retrying cannot help: the spec must change


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def retry_delay(retry: int) -> float:
    """Exponential backoff for a failed reconcile: 5 s, 10 s, ... capped at 5 min."""
    return float(min(300, 5 * 2 ** min(retry, 6)))


def _owner(body: dict[str, Any]) -> Owner:
    meta = body["metadata"]
    return Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


def _desired(body: dict[str, Any], rendered: Rendered) -> Desired:
    return Desired(
        generation=int(body["metadata"].get("generation") or 1),
        replicas=rendered.replicas,
        config_hash=rendered.config_hash,
        endpoint=rendered.endpoint,
        kv_bits=rendered.kv_bits,
        kv_calibration=rendered.kv_calibration,
    )


def _roles(name: str, children: list[dict[str, Any]]) -> dict[str, RoleObservation]:
    by_name = {c["metadata"]["name"]: c for c in children if c.get("kind") == "Deployment"}
    return {role: observe_deployment(by_name.get(f"{name}-{role}")) for role in ("prefill", "decode", "gateway")}


def invalid_spec_status(body: dict[str, Any], message: str, *, now: str) -> dict[str, Any]:
    """Keep the last status, mark it Degraded: the children keep running the last valid spec."""
    previous = dict(body.get("status") or {})
    generation = int(body["metadata"].get("generation") or 1)
    conditions = [c for c in previous.get("conditions") or [] if c.get("type") not in ("Degraded", "Ready")]
    conditions += [
        {"type": "Ready", "status": "False", "reason": INVALID_SPEC, "message": message},
        {"type": "Degraded", "status": "True", "reason": INVALID_SPEC, "message": message},
    ]
    for cond in conditions[-2:]:
        cond["observedGeneration"] = generation
        cond["lastTransitionTime"] = now
    return {**previous, "phase": "Degraded", "conditions": conditions}


async def reconcile(api: KubeApi, body: dict[str, Any], *, now: str) -> Outcome:
    """Apply what changed, delete what is no longer rendered, write the status."""
    owner = _owner(body)
    previous = body.get("status") or {}
    try:
        rendered = render(body.get("spec") or {}, owner=owner)
    except ValueError as exc:
        status = invalid_spec_status(body, str(exc), now=now)
        await api.patch_status(owner.namespace, owner.name, status)
        return Outcome(status, [("Warning", INVALID_SPEC, str(exc))], error=str(exc), permanent=True)

    events: list[tuple[str, str, str]] = []
    error: str | None = None
    children: list[dict[str, Any]] = []
    try:
        # Before the pods that mount it; an existing Secret keeps its value.
        secret = internal_secret_name(owner.name)
        if not await api.secret_exists(owner.namespace, secret) and await api.create_once(
            internal_secret(owner, token=secrets.token_urlsafe(32))
        ):
            events.append(("Normal", "Created", f"Secret/{secret} (the internal credential)"))
        children = await api.list_children(owner.namespace, instance_labels(owner.name))
        plan = plan_children(rendered.objects, children, owner_uid=owner.uid)
        current = {object_key(c): c for c in children}
        for obj in plan.apply:
            try:
                current[object_key(obj)] = {"apiVersion": obj["apiVersion"], "kind": obj["kind"], **await api.apply(obj)}
            except ApiError as exc:
                if exc.status != 404 or CHILD_RESOURCES[obj["kind"]].group not in OPTIONAL_GROUPS:
                    raise
                events.append(("Warning", "MonitoringUnavailable", f"{obj['kind']} not installed in this cluster; skipped"))
        for api_version, kind, name in plan.delete:
            await api.delete(kind, owner.namespace, name)
            current.pop((api_version, kind, name), None)
        children = list(current.values())
        if plan.apply or plan.delete:
            changed = [f"{o['kind']}/{o['metadata']['name']}" for o in plan.apply] + [f"{k}/{n}-deleted" for _, k, n in plan.delete]
            events.append(("Normal", "Applied", f"config {rendered.config_hash}: " + ", ".join(changed)))
    except ApiError as exc:
        error = f"applying children failed: {exc}"
        events.append(("Warning", "ApplyFailed", error))

    status = compute_status(
        name=owner.name,
        desired=_desired(body, rendered),
        observed=_roles(owner.name, children),
        observed_generation=_desired(body, rendered).generation if error is None else previous.get("observedGeneration"),
        previous=previous,
        apply_error=error,
        now=now,
    )
    await api.patch_status(owner.namespace, owner.name, status)
    return Outcome(status, events, error=error)


async def refresh_status(api: KubeApi, body: dict[str, Any], *, now: str, kv: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Recompute the status from the owned Deployments (and ``kv``, the
    workers' KV health, when given); write it only if it changed and only if
    ``body`` is still the latest version (a reconcile that wrote meanwhile
    knows better). Returns the status written, or None."""
    owner = _owner(body)
    previous = body.get("status") or {}
    try:
        rendered = render(body.get("spec") or {}, owner=owner)
    except ValueError:
        return None  # the reconciler reported it; nothing to add
    children = await api.list_children(owner.namespace, instance_labels(owner.name), kinds=("Deployment",))
    status = compute_status(
        name=owner.name,
        desired=_desired(body, rendered),
        observed=_roles(owner.name, children),
        observed_generation=previous.get("observedGeneration"),
        previous=previous,
        apply_error=carried_apply_error(previous),
        now=now,
        kv=kv,
    )
    if status == previous:
        return None
    try:
        await api.patch_status(owner.namespace, owner.name, status, resource_version=body["metadata"].get("resourceVersion"))
    except ApiError as exc:
        if exc.status == 409:  # changed since read; whoever changed it triggers the next refresh
            return None
        raise
    return status
