"""Reconcile and status refresh against an in-memory API server: first
creation, idempotence, spec changes, monitoring off, a cluster without
prometheus-operator, API failures and an invalid spec; the kopf handlers."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import kopf
import pytest
from kvs_crd_tools import apply_defaults, load_sample, root_schema
from kvs_fake_api import FakeApiServer

from kvserving.operator import handlers
from kvserving.operator.kube import KubeApi
from kvserving.operator.kv_sampler import KVSampler
from kvserving.operator.reconcile import reconcile, refresh_status, retry_delay

T0, T1, T2 = "2026-11-29T10:00:00Z", "2026-11-29T10:01:00Z", "2026-11-29T10:02:00Z"


def _body(sample: str = "fp8_e4m3", generation: int = 1, **spec_changes: Any) -> dict[str, Any]:
    body = apply_defaults(root_schema(), load_sample(sample))
    body["metadata"].update(uid="kvs-uid-1", generation=generation)
    for section, change in spec_changes.items():
        body["spec"][section].update(change)
    return body


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def _with_status(body: dict[str, Any], server: FakeApiServer) -> dict[str, Any]:
    body = copy.deepcopy(body)
    body["status"] = copy.deepcopy(server.statuses[("default", body["metadata"]["name"])])
    return body


def _conds(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_first_reconcile_creates_children_then_status_follows_readiness() -> None:
    server = FakeApiServer()
    api = KubeApi(server)
    outcome = _run(reconcile(api, _body(), now=T0))
    assert outcome.error is None and not outcome.permanent
    assert server.names("deployments") == ["qwen3-fp8-decode", "qwen3-fp8-gateway", "qwen3-fp8-prefill"]
    assert server.names("services") == ["qwen3-fp8-decode", "qwen3-fp8-gateway", "qwen3-fp8-prefill"]
    assert server.names("configmaps") == ["qwen3-fp8-config", "qwen3-fp8-dashboard"]
    assert server.names("podmonitors") == ["qwen3-fp8"]
    assert server.names("networkpolicies") == ["qwen3-fp8-gateway", "qwen3-fp8-workers"]
    assert server.names("secrets") == ["qwen3-fp8-internal"]
    # the Secret and the ConfigMap are written before the Deployments that mount them
    written = [name for _, _, name in server.writes]
    assert written.index("qwen3-fp8-internal") < written.index("qwen3-fp8-config") < written.index("qwen3-fp8-prefill")
    assert [e[:2] for e in outcome.events] == [("Normal", "Created"), ("Normal", "Applied")]
    status = server.statuses[("default", "qwen3-fp8")]
    assert status["phase"] == "Progressing"
    assert status["observedGeneration"] == 1
    assert status["endpoint"] == "http://qwen3-fp8-gateway.default.svc:8080"
    assert _conds(status)["Ready"] == ("False", "ComponentsNotReady")

    server.settle_deployments()
    written = _run(refresh_status(api, _with_status(_body(), server), now=T1))
    assert written is not None and written["phase"] == "Ready"
    assert written["prefill"]["ready"] == "1/1" and written["decode"]["ready"] == "1/1"
    assert _conds(written)["Ready"] == ("True", "AllComponentsReady")
    # nothing changed: no write
    before = len(server.writes)
    assert _run(refresh_status(api, _with_status(_body(), server), now=T2)) is None
    assert len(server.writes) == before


def test_internal_secret_is_created_once_and_kept_across_reconciles_and_spec_changes() -> None:
    server = FakeApiServer()
    api = KubeApi(server)
    _run(reconcile(api, _body(), now=T0))
    secret = server.objects[("", "secrets", "default", "qwen3-fp8-internal")]
    token = server.secret_value("default", "qwen3-fp8-internal", "token")
    assert token is not None and len(token) == 43  # secrets.token_urlsafe(32): 32 random bytes, base64url
    assert secret["type"] == "Opaque" and set(secret["data"]) == {"token"}
    # owned by the KVServing: garbage collection deletes it with the KVServing
    assert secret["metadata"]["ownerReferences"] == [
        {"apiVersion": "kvserving.dev/v1alpha1", "kind": "KVServing", "name": "qwen3-fp8", "uid": "kvs-uid-1", "controller": True}
    ]
    server.settle_deployments()
    for generation, change in ((1, {}), (2, {"decode": {"replicas": 3}}), (3, {"reuse": {"retentionTTLSeconds": 900}})):
        outcome = _run(reconcile(api, _with_status(_body(generation=generation, **change), server), now=T1))
        assert outcome.error is None
        assert ("Normal", "Created") not in [e[:2] for e in outcome.events]
    assert server.secret_value("default", "qwen3-fp8-internal", "token") == token
    assert [w for w in server.writes if w[1] == "secrets"] == [("create", "secrets", "qwen3-fp8-internal")]
    # the value lives only in the Secret: not in a ConfigMap, a Deployment, the status or an event
    others = [o for k, o in server.objects.items() if k[1] != "secrets"]
    assert token not in repr(others) + repr(server.statuses) + repr(outcome.events)
    # a Secret that was removed is made again (a new value) by the next reconcile
    del server.objects[("", "secrets", "default", "qwen3-fp8-internal")]
    outcome = _run(reconcile(api, _with_status(_body(generation=3), server), now=T2))
    assert [e[:2] for e in outcome.events][0] == ("Normal", "Created")
    assert server.secret_value("default", "qwen3-fp8-internal", "token") not in (None, token)


def test_an_existing_secret_of_that_name_is_kept_as_it_is() -> None:
    """Created by someone else (or by a reconcile that raced): the POST's 409 keeps it."""
    server = FakeApiServer()
    api = KubeApi(server)
    server._create("", "secrets", "default", {"metadata": {"name": "qwen3-fp8-internal"}, "stringData": {"token": "given"}})
    created = _run(api.create_once({"metadata": {"name": "qwen3-fp8-internal", "namespace": "default"}, "stringData": {"token": "x"}}))
    assert created is False
    outcome = _run(reconcile(api, _body(), now=T0))
    assert outcome.error is None
    assert server.secret_value("default", "qwen3-fp8-internal", "token") == "given"


def test_reconcile_is_idempotent() -> None:
    server = FakeApiServer()
    api = KubeApi(server)
    _run(reconcile(api, _body(), now=T0))
    server.settle_deployments()
    server.writes.clear()
    outcome = _run(reconcile(api, _with_status(_body(), server), now=T1))
    assert server.writes == [("status", "kvservings", "qwen3-fp8")]
    assert outcome.events == []
    assert outcome.status["phase"] == "Ready"


def test_replica_change_patches_only_the_decode_deployment() -> None:
    server = FakeApiServer()
    api = KubeApi(server)
    _run(reconcile(api, _body(), now=T0))
    server.settle_deployments()
    server.writes.clear()
    changed = _body(generation=2, decode={"replicas": 3})
    outcome = _run(reconcile(api, _with_status(changed, server), now=T1))
    assert server.writes == [("apply", "deployments", "qwen3-fp8-decode"), ("status", "kvservings", "qwen3-fp8")]
    assert server.objects[("apps", "deployments", "default", "qwen3-fp8-decode")]["spec"]["replicas"] == 3
    status = outcome.status
    assert status["observedGeneration"] == 2
    assert status["decode"] == {"replicas": 3, "readyReplicas": 1, "updatedReplicas": 1, "ready": "1/3"}
    assert _conds(status)["DecodeReady"] == ("False", "RollingOut")
    assert status["phase"] == "Progressing"


def test_monitoring_off_deletes_monitor_and_dashboard() -> None:
    server = FakeApiServer()
    api = KubeApi(server)
    _run(reconcile(api, _body(), now=T0))
    server.writes.clear()
    _run(reconcile(api, _body(generation=2, monitoring={"enabled": False}), now=T1))
    assert sorted(w for w in server.writes if w[0] == "delete") == [
        ("delete", "configmaps", "qwen3-fp8-dashboard"),
        ("delete", "podmonitors", "qwen3-fp8"),
    ]
    assert server.names("podmonitors") == []
    assert server.names("configmaps") == ["qwen3-fp8-config"]


def test_cluster_without_prometheus_operator_skips_the_podmonitor() -> None:
    server = FakeApiServer()
    server.missing_groups.add("monitoring.coreos.com")
    api = KubeApi(server)
    outcome = _run(reconcile(api, _body(), now=T0))
    assert outcome.error is None
    assert ("Warning", "MonitoringUnavailable", "PodMonitor not installed in this cluster; skipped") in outcome.events
    assert server.names("deployments") == ["qwen3-fp8-decode", "qwen3-fp8-gateway", "qwen3-fp8-prefill"]
    server.settle_deployments()
    assert _run(refresh_status(api, _with_status(_body(), server), now=T1))["phase"] == "Ready"


def test_api_failure_is_degraded_retried_and_cleared_by_the_next_success() -> None:
    server = FakeApiServer()
    api = KubeApi(server)
    _run(reconcile(api, _body(), now=T0))
    server.settle_deployments()
    server.fail[("patch", "deployments")] = 500
    outcome = _run(reconcile(api, _with_status(_body(generation=2, prefill={"replicas": 2}), server), now=T1))
    assert outcome.error == "applying children failed: HTTP 500: injected failure on patch deployments"
    assert not outcome.permanent
    assert ("Warning", "ApplyFailed", outcome.error) in outcome.events
    status = server.statuses[("default", "qwen3-fp8")]
    assert status["phase"] == "Degraded"
    assert status["observedGeneration"] == 1  # generation 2 is not applied
    assert _conds(status)["Degraded"] == ("True", "ApplyFailed")
    # a status refresh between retries (here: pods lost readiness) keeps the failure visible
    server.settle_deployments(ready=False)
    refreshed = _run(refresh_status(api, _with_status(_body(generation=2, prefill={"replicas": 2}), server), now=T2))
    assert refreshed is not None and _conds(refreshed)["Degraded"] == ("True", "ApplyFailed")
    assert refreshed["prefill"]["ready"] == "0/2" and refreshed["observedGeneration"] == 1
    del server.fail[("patch", "deployments")]
    server.settle_deployments()
    outcome = _run(reconcile(api, _with_status(_body(generation=2, prefill={"replicas": 2}), server), now=T2))
    assert outcome.error is None
    assert _conds(outcome.status)["Degraded"] == ("False", "AsExpected")
    assert outcome.status["observedGeneration"] == 2


def test_forbidden_list_is_an_apply_failure_not_a_crash() -> None:
    server = FakeApiServer()
    server.fail[("list", "deployments")] = 403
    outcome = _run(reconcile(KubeApi(server), _body(), now=T0))
    assert outcome.error is not None and "HTTP 403" in outcome.error
    assert outcome.status["phase"] == "Degraded"
    assert "observedGeneration" not in outcome.status


def test_invalid_spec_is_a_permanent_error_and_keeps_the_children() -> None:
    server = FakeApiServer()
    api = KubeApi(server)
    _run(reconcile(api, _body(), now=T0))
    bad = _with_status(_body(generation=2), server)
    bad["spec"]["reuse"].update(leaseTTLSeconds=600)  # the CEL rule would refuse this; the operator must not crash
    server.writes.clear()
    outcome = _run(reconcile(api, bad, now=T1))
    assert outcome.permanent
    assert "lease_ttl_s" in (outcome.error or "")
    assert server.writes == [("status", "kvservings", "qwen3-fp8")]
    status = server.statuses[("default", "qwen3-fp8")]
    assert status["phase"] == "Degraded"
    assert _conds(status)["Degraded"] == ("True", "InvalidSpec")
    assert status["observedGeneration"] == 1
    assert _run(refresh_status(api, bad, now=T2)) is None


def test_retry_delay_backs_off_exponentially() -> None:
    assert [retry_delay(r) for r in (0, 1, 2, 3, 6, 20)] == [5.0, 10.0, 20.0, 40.0, 300.0, 300.0]


# --- the kopf handlers ---------------------------------------------------------


class _Memo:
    def __init__(self, server: FakeApiServer) -> None:
        self.kube = KubeApi(server)
        self.sampler = KVSampler(self.kube)  # not started: the handler only records the KVServing


def test_handlers_registered() -> None:
    changing = handlers.registry._changing.get_all_handlers()
    # (reason, initial): create, update, and resume (initial listing, no reason); no deletion handler
    assert sorted((str(h.reason), h.initial) for h in changing) == [("None", True), ("create", None), ("update", None)]
    assert {h.id for h in changing} == {"reconcile_kvserving"}
    assert all(h.errors == kopf.ErrorsMode.TEMPORARY for h in changing)
    assert not any(h.requires_finalizer for h in changing)
    # no timers or daemons: kopf would put a finalizer on every KVServing for them
    assert handlers.registry._spawning.get_all_handlers() == []
    assert handlers.registry._indexing.get_all_handlers() == []
    (watching,) = handlers.registry._watching.get_all_handlers()
    assert (watching.id, watching.selector.group, watching.selector.plural) == ("deployment_changed", "apps", "deployments")
    activities = sorted(str(h.activity) for h in handlers.registry._activities.get_all_handlers())
    assert activities == ["authentication", "cleanup", "startup"]


def test_reconcile_handler_posts_events_and_raises_for_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    posted: list[tuple[str, str]] = []
    monkeypatch.setattr(kopf, "event", lambda body, *, type, reason, message: posted.append((type, reason)))
    server = FakeApiServer()
    memo = _Memo(server)
    _run(handlers.reconcile_kvserving(body=_body(), retry=0, memo=memo))
    assert posted == [("Normal", "Created"), ("Normal", "Applied")]
    assert memo.sampler.known == {(_body()["metadata"]["namespace"], _body()["metadata"]["name"])}
    server.fail[("list", "configmaps")] = 500
    with pytest.raises(kopf.TemporaryError) as excinfo:
        _run(handlers.reconcile_kvserving(body=_body(), retry=2, memo=_Memo(server)))
    assert excinfo.value.delay == 20.0
    assert posted[-1] == ("Warning", "ApplyFailed")
    bad = _body()
    bad["spec"]["kvCache"]["bitBudget"] = 3.0
    del server.fail[("list", "configmaps")]
    with pytest.raises(kopf.PermanentError):
        _run(handlers.reconcile_kvserving(body=bad, retry=0, memo=_Memo(server)))


def test_deployment_event_refreshes_its_owners_status() -> None:
    server = FakeApiServer()
    _run(reconcile(KubeApi(server), _body(), now=T0))
    server.settle_deployments()
    server.put_kvserving(_with_status(_body(), server))
    deployment = kopf.Body(copy.deepcopy(server.objects[("apps", "deployments", "default", "qwen3-fp8-decode")]))
    _run(handlers.deployment_changed(body=deployment, memo=_Memo(server)))
    assert server.statuses[("default", "qwen3-fp8")]["phase"] == "Ready"
    # an owner being deleted is left alone: its children are going away
    server.settle_deployments(ready=False)
    server.objects[("kvserving.dev", "kvservings", "default", "qwen3-fp8")]["metadata"]["deletionTimestamp"] = T1
    _run(handlers.deployment_changed(body=deployment, memo=_Memo(server)))
    assert server.statuses[("default", "qwen3-fp8")]["phase"] == "Ready"
    # an owner already gone: nothing to do
    del server.objects[("kvserving.dev", "kvservings", "default", "qwen3-fp8")]
    _run(handlers.deployment_changed(body=deployment, memo=_Memo(server)))


def test_refresh_never_overwrites_a_newer_status() -> None:
    """A refresh that read generation 1 must not undo the status a reconcile of
    generation 2 wrote meanwhile (seen with the real kopf against a fake server)."""
    server = FakeApiServer()
    api = KubeApi(server)
    _run(reconcile(api, _body(), now=T0))
    server.settle_deployments()
    stale = server.put_kvserving(_with_status(_body(), server))  # what the refresh read
    newer = _body(generation=2, decode={"replicas": 3})
    server.put_kvserving(newer)
    _run(reconcile(api, _with_status(newer, server), now=T1))
    assert server.statuses[("default", "qwen3-fp8")]["observedGeneration"] == 2
    server.writes.clear()
    assert _run(refresh_status(api, stale, now=T2)) is None
    assert server.statuses[("default", "qwen3-fp8")]["observedGeneration"] == 2
    assert server.writes == []  # refused with 409, nothing written


def test_configure_keeps_kopf_out_of_status_and_peering() -> None:
    settings = kopf.OperatorSettings()
    handlers.configure(settings)
    assert settings.peering.standalone is True
    assert settings.scanning.disabled is True
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert isinstance(settings.persistence.diffbase_storage, kopf.AnnotationsDiffBaseStorage)
    assert list(settings.watching.label_selectors.values()) == ["app.kubernetes.io/managed-by=kvserving-operator"]
