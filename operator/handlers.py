"""kopf glue: the handlers the operator registers, each a few lines.

    login                credentials from the service account or KUBECONFIG (kube.connection_info)
    startup              operator settings (configure), the API client in ``memo``, the KV-health sampler task
    reconcile_kvserving  on create / update / resume: render, apply, write status (reconcile.py);
                         remembers the KVServing for the sampler
    deployment_changed   an owned Deployment changed: recompute its KVServing's status
    cleanup              stop the sampler, close the API client

Deletion has no handler, and there is no timer or daemon either (kopf would
put a finalizer on every KVServing for those): the children carry owner
references and the garbage collector removes them. The KV-health sampler
(kv_sampler.py) is one plain background task for that reason.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf

from kvserving.operator.kube import AiohttpTransport, KubeApi, connection_info
from kvserving.operator.kv_sampler import KVSampler
from kvserving.operator.names import GROUP, PLURAL, VERSION
from kvserving.operator.reconcile import reconcile, refresh_status, retry_delay, utc_now
from kvserving.operator.render import LABEL_INSTANCE, LABEL_MANAGED_BY, MANAGED_BY

registry = kopf.OperatorRegistry()


def configure(settings: kopf.OperatorSettings) -> None:
    """Operator settings; rbac.py derives kopf's own API calls from the same ones."""
    settings.peering.standalone = True  # one replica (Recreate); no peering objects to read
    settings.scanning.disabled = True  # the CRD is known; no cluster-wide CRD/namespace watching
    # Keep kopf's bookkeeping in annotations: status belongs to the KVServing's schema.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING  # Events for problems; our own Events say what changed
    settings.posting.reporting_component = "kvserving-operator"
    # Watch only our Deployments, filtered by the API server, not every Deployment of the cluster.
    settings.watching.label_selectors["apps", "deployments"] = f"{LABEL_MANAGED_BY}={MANAGED_BY}"


def plain(value: Any) -> Any:
    """kopf's body views as plain dicts and lists (the pure code compares and copies them)."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


@kopf.on.login(registry=registry)
def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    return connection_info(settings)


@kopf.on.startup(registry=registry)
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    configure(settings)
    memo.transport = AiohttpTransport(settings, logger)
    memo.kube = KubeApi(memo.transport)
    memo.sampler = KVSampler(memo.kube)
    memo.sampler.start()


@kopf.on.cleanup(registry=registry)
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    await memo.sampler.stop()
    await memo.transport.close()


@kopf.on.resume(group=GROUP, version=VERSION, plural=PLURAL, registry=registry, errors=kopf.ErrorsMode.TEMPORARY, backoff=10)
@kopf.on.create(group=GROUP, version=VERSION, plural=PLURAL, registry=registry, errors=kopf.ErrorsMode.TEMPORARY, backoff=10)
@kopf.on.update(group=GROUP, version=VERSION, plural=PLURAL, registry=registry, errors=kopf.ErrorsMode.TEMPORARY, backoff=10)
async def reconcile_kvserving(body: kopf.Body, retry: int, memo: kopf.Memo, **_: Any) -> None:
    obj = plain(body)
    memo.sampler.known.add((obj["metadata"].get("namespace", ""), obj["metadata"]["name"]))
    outcome = await reconcile(memo.kube, obj, now=utc_now())
    for event_type, reason, message in outcome.events:
        kopf.event(body, type=event_type, reason=reason, message=message)
    if outcome.permanent:
        raise kopf.PermanentError(outcome.error)
    if outcome.error is not None:
        raise kopf.TemporaryError(outcome.error, delay=retry_delay(retry))


@kopf.on.event(group="apps", version="v1", plural="deployments", labels={LABEL_MANAGED_BY: MANAGED_BY}, registry=registry)
async def deployment_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    # Read the owner fresh: a cached copy could carry an older status and undo a reconcile's.
    owner = await memo.kube.get_kvserving(body.metadata.namespace or "", body.metadata.labels.get(LABEL_INSTANCE, ""))
    if owner is not None and not owner["metadata"].get("deletionTimestamp"):
        await refresh_status(memo.kube, owner, now=utc_now())
