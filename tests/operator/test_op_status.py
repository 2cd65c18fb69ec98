"""The reconciler's pure decisions: which children to write, and the status
reported for missing children, partial readiness, a failed rollout and a spec
change in the middle of a rollout."""

from __future__ import annotations

import copy
from typing import Any

from kvserving.operator.render import APPLIED_HASH, Owner, render
from kvserving.operator.status import (
    APPLY_FAILED,
    CONDITION_TYPES,
    MISSING,
    Desired,
    RoleObservation,
    carried_apply_error,
    compute_status,
    object_key,
    observe_deployment,
    plan_children,
)

OWNER = Owner(name="demo", namespace="team", uid="uid-1")
T0, T1 = "2026-11-29T10:00:00Z", "2026-11-29T10:05:00Z"


def _desired(replicas: tuple[int, int, int] = (1, 2, 1), config_hash: str = "cfg-a", generation: int = 3) -> Desired:
    return Desired(
        generation=generation,
        replicas=dict(zip(("prefill", "decode", "gateway"), replicas)),
        config_hash=config_hash,
        endpoint="http://demo-gateway.team.svc:8080",
        kv_bits=4.0,
    )


def _ready(n: int, config_hash: str = "cfg-a") -> RoleObservation:
    return RoleObservation(exists=True, replicas=n, ready=n, updated=n, config_hash=config_hash, settled=True, complete=True)


def _status(observed: dict[str, RoleObservation], previous: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = {"desired": _desired(), "observed_generation": 3, "apply_error": None, "now": T0}
    args.update(kw)
    return compute_status(name="demo", observed=observed, previous=previous or {}, **args)


def _conds(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


# --- plan_children -----------------------------------------------------------


def _observed_copy(obj: dict[str, Any], uid: str = "uid-1") -> dict[str, Any]:
    seen = copy.deepcopy(obj)
    seen["metadata"]["ownerReferences"][0]["uid"] = uid
    seen["metadata"]["resourceVersion"] = "42"
    seen["status"] = {"readyReplicas": 1}
    return seen


def test_plan_creates_every_missing_child() -> None:
    desired = render({}, owner=OWNER).objects
    plan = plan_children(desired, [], owner_uid="uid-1")
    assert [object_key(o) for o in plan.apply] == [object_key(o) for o in desired]
    assert plan.delete == () and plan.unchanged == ()


def test_plan_leaves_up_to_date_children_alone() -> None:
    desired = render({}, owner=OWNER).objects
    plan = plan_children(desired, [_observed_copy(o) for o in desired], owner_uid="uid-1")
    assert plan.apply == () and plan.delete == ()
    assert len(plan.unchanged) == len(desired)


def test_plan_patches_only_changed_children_and_recreates_a_deleted_one() -> None:
    old = render({}, owner=OWNER).objects
    new = render({"decode": {"replicas": 3}}, owner=OWNER).objects
    observed = [_observed_copy(o) for o in old if o["metadata"]["name"] != "demo-gateway" or o["kind"] != "Service"]
    plan = plan_children(new, observed, owner_uid="uid-1")
    assert [object_key(o) for o in plan.apply] == [("apps/v1", "Deployment", "demo-decode"), ("v1", "Service", "demo-gateway")]


def test_plan_reverts_a_hand_scaled_deployment() -> None:
    desired = render({}, owner=OWNER).objects
    observed = [_observed_copy(o) for o in desired]
    (dep,) = [o for o in observed if o["metadata"]["name"] == "demo-prefill" and o["kind"] == "Deployment"]
    dep["spec"]["replicas"] = 7
    plan = plan_children(desired, observed, owner_uid="uid-1")
    assert [object_key(o) for o in plan.apply] == [("apps/v1", "Deployment", "demo-prefill")]


def test_plan_deletes_children_no_longer_rendered_but_only_its_own() -> None:
    old = render({}, owner=OWNER).objects
    new = render({"monitoring": {"enabled": False}}, owner=OWNER).objects
    observed = [_observed_copy(o) for o in old]
    stranger = _observed_copy(render({}, owner=Owner("other", "team", "uid-2")).objects[0], uid="uid-2")
    plan = plan_children(new, observed + [stranger], owner_uid="uid-1")
    assert plan.apply == ()
    assert plan.delete == (("monitoring.coreos.com/v1", "PodMonitor", "demo"), ("v1", "ConfigMap", "demo-dashboard"))
    assert ("v1", "ConfigMap", "other-config") not in plan.delete


def test_plan_reapplies_an_object_someone_else_owns() -> None:
    desired = render({}, owner=OWNER).objects
    foreign = [_observed_copy(o, uid="uid-old") for o in desired]  # e.g. a KVServing deleted and re-created
    plan = plan_children(desired, foreign, owner_uid="uid-1")
    assert len(plan.apply) == len(desired) and plan.delete == ()


def test_applied_hash_ignores_server_fields() -> None:
    desired = render({}, owner=OWNER).objects[0]
    seen = _observed_copy(desired)
    seen["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"] = "{}"
    assert plan_children((desired,), [seen], owner_uid="uid-1").apply == ()
    seen["metadata"]["annotations"][APPLIED_HASH] = "0" * 16
    assert len(plan_children((desired,), [seen], owner_uid="uid-1").apply) == 1


# --- observe_deployment --------------------------------------------------------


def _deployment(
    *,
    replicas: int,
    ready: int,
    updated: int,
    generation: int = 2,
    observed: int = 2,
    config_hash: str = "cfg-a",
    conditions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "metadata": {"name": "demo-decode", "generation": generation},
        "spec": {"replicas": replicas, "template": {"metadata": {"annotations": {"kvserving.dev/config-hash": config_hash}}}},
        "status": {"observedGeneration": observed, "readyReplicas": ready, "updatedReplicas": updated, "conditions": conditions or []},
    }


def test_observe_deployment_reads_counts_hash_and_failure() -> None:
    assert observe_deployment(None) == MISSING
    obs = observe_deployment(_deployment(replicas=2, ready=1, updated=2, generation=5, observed=4))
    assert obs == RoleObservation(exists=True, replicas=2, ready=1, updated=2, config_hash="cfg-a", settled=False, failure=None)
    done = observe_deployment(
        _deployment(
            replicas=2, ready=2, updated=2, conditions=[{"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}]
        )
    )
    assert (done.complete, done.settled, done.failure) == (True, True, None)
    failed = observe_deployment(
        _deployment(
            replicas=2,
            ready=0,
            updated=1,
            conditions=[
                {
                    "type": "Progressing",
                    "status": "False",
                    "reason": "ProgressDeadlineExceeded",
                    "message": 'ReplicaSet "demo-decode-5d9" has timed out progressing.',
                }
            ],
        )
    )
    assert failed.failure == 'ReplicaSet "demo-decode-5d9" has timed out progressing.'
    fresh = observe_deployment({"metadata": {"name": "x", "generation": 1}, "spec": {"replicas": 1}})
    assert (fresh.ready, fresh.updated, fresh.settled, fresh.config_hash) == (0, 0, False, None)


# --- compute_status ------------------------------------------------------------


def test_all_children_missing_is_pending() -> None:
    status = _status({})
    assert status["phase"] == "Pending"
    conds = _conds(status)
    assert conds["PrefillReady"] == ("False", "DeploymentMissing")
    assert conds["Ready"] == ("False", "ComponentsNotReady")
    assert conds["Progressing"] == ("True", "RollingOut")
    assert conds["Degraded"] == ("False", "AsExpected")
    assert [c["type"] for c in status["conditions"]] == list(CONDITION_TYPES)
    assert status["prefill"] == {"replicas": 1, "readyReplicas": 0, "updatedReplicas": 0, "ready": "0/1"}


def test_everything_ready() -> None:
    status = _status({"prefill": _ready(1), "decode": _ready(2), "gateway": _ready(1)})
    assert status["phase"] == "Ready"
    assert _conds(status) == {
        "Ready": ("True", "AllComponentsReady"),
        "PrefillReady": ("True", "ReplicasReady"),
        "DecodeReady": ("True", "ReplicasReady"),
        "GatewayReady": ("True", "ReplicasReady"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AsExpected"),
    }
    assert status["decode"]["ready"] == "2/2"
    assert status["observedGeneration"] == 3
    assert status["endpoint"] == "http://demo-gateway.team.svc:8080"
    assert (status["kvBits"], status["configHash"]) == (4.0, "cfg-a")
    for cond in status["conditions"]:
        assert cond["observedGeneration"] == 3 and cond["lastTransitionTime"] == T0 and cond["message"]


def test_partial_readiness_during_first_rollout() -> None:
    decode = RoleObservation(exists=True, replicas=2, ready=1, updated=2, config_hash="cfg-a", settled=True)
    status = _status({"prefill": _ready(1), "decode": decode, "gateway": _ready(1)})
    assert status["phase"] == "Progressing"
    conds = _conds(status)
    assert conds["DecodeReady"] == ("False", "ReplicasNotReady")
    assert conds["Ready"] == ("False", "ComponentsNotReady")
    assert conds["Progressing"] == ("True", "RollingOut")
    assert conds["Degraded"] == ("False", "AsExpected")
    assert "DecodeReady" in next(c["message"] for c in status["conditions"] if c["type"] == "Ready")
    assert status["decode"]["ready"] == "1/2"


def test_lost_replicas_after_rollout_are_degraded() -> None:
    decode = RoleObservation(exists=True, replicas=2, ready=1, updated=2, config_hash="cfg-a", settled=True, complete=True)
    status = _status({"prefill": _ready(1), "decode": decode, "gateway": _ready(1)})
    assert status["phase"] == "Degraded"
    conds = _conds(status)
    assert conds["DecodeReady"] == ("False", "ReplicasUnavailable")
    assert conds["Degraded"] == ("True", "ReplicasUnavailable")
    assert conds["Progressing"] == ("False", "RolloutComplete")


def test_failed_rollout() -> None:
    decode = RoleObservation(
        exists=True, replicas=2, ready=0, updated=1, config_hash="cfg-a", settled=True, failure="ReplicaSet has timed out progressing."
    )
    status = _status({"prefill": _ready(1), "decode": decode, "gateway": _ready(1)})
    assert status["phase"] == "Degraded"
    conds = _conds(status)
    assert conds["DecodeReady"] == ("False", "RolloutFailed")
    assert conds["Progressing"] == ("False", "RolloutFailed")
    assert conds["Degraded"] == ("True", "RolloutFailed")
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["message"] == "decode: 0/2 replicas ready: ReplicaSet has timed out progressing."


def test_spec_change_mid_rollout() -> None:
    """Generation 4 changed the config: the old pods are ready but run cfg-a, so
    nothing is Ready until the cfg-b pods are; transitions keep their times."""
    previous = _status({"prefill": _ready(1), "decode": _ready(2), "gateway": _ready(1)})
    new = _desired(config_hash="cfg-b", generation=4)
    # The Deployments were patched (template cfg-b) but the controller has not caught up.
    rolling = {
        "prefill": RoleObservation(exists=True, replicas=1, ready=1, updated=0, config_hash="cfg-b", settled=False),
        "decode": RoleObservation(exists=True, replicas=2, ready=2, updated=1, config_hash="cfg-b", settled=True),
        "gateway": _ready(1, "cfg-b"),
    }
    status = _status(rolling, previous, desired=new, observed_generation=4, now=T1)
    conds = _conds(status)
    assert conds["PrefillReady"] == ("False", "RollingOut")
    assert conds["DecodeReady"] == ("False", "RollingOut")
    assert conds["GatewayReady"] == ("True", "ReplicasReady")
    assert conds["Progressing"] == ("True", "RollingOut")
    assert conds["Degraded"] == ("False", "AsExpected")
    assert status["phase"] == "Progressing"
    times = {c["type"]: c["lastTransitionTime"] for c in status["conditions"]}
    assert times == {"Ready": T1, "PrefillReady": T1, "DecodeReady": T1, "GatewayReady": T0, "Progressing": T1, "Degraded": T0}
    assert all(c["observedGeneration"] == 4 for c in status["conditions"])
    assert status["configHash"] == "cfg-b"


def test_stale_config_hash_is_rolling_even_if_counts_match() -> None:
    conds = _conds(_status({"prefill": _ready(1, "cfg-old"), "decode": _ready(2), "gateway": _ready(1)}))
    assert conds["PrefillReady"] == ("False", "RollingOut")


def test_scaled_to_zero_is_ready() -> None:
    status = _status({"prefill": _ready(1), "decode": _ready(0), "gateway": _ready(1)}, desired=_desired((1, 0, 1)))
    assert _conds(status)["DecodeReady"] == ("True", "ScaledToZero")
    assert status["phase"] == "Ready"


def test_apply_error_is_degraded_and_keeps_the_last_observed_generation() -> None:
    status = _status(
        {"prefill": _ready(1), "decode": _ready(2), "gateway": _ready(1)},
        apply_error="applying children failed: HTTP 403: forbidden",
        observed_generation=2,
    )
    assert status["phase"] == "Degraded"
    assert status["observedGeneration"] == 2
    conds = _conds(status)
    assert conds["Degraded"] == ("True", APPLY_FAILED)
    assert conds["Ready"] == ("False", "ComponentsNotReady")
    assert carried_apply_error(status) == "applying children failed: HTTP 403: forbidden"
    assert carried_apply_error(_status({})) is None


def test_unchanged_status_is_identical() -> None:
    observed = {"prefill": _ready(1), "decode": _ready(2), "gateway": _ready(1)}
    first = _status(observed)
    assert _status(observed, first, now=T1) == first
