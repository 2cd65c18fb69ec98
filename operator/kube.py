"""The one module that talks to the Kubernetes API (kopf aside).

Every call goes through ``KubeApi._call`` with a verb and a resource from
``API_CALLS``; the RBAC test derives the ClusterRole's rules from that table
(plus what kopf itself needs, see rbac.py) and exercises every method against
a recording transport, so the table cannot drift from the code.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import kopf

from kvserving.operator.names import GROUP, PLURAL, VERSION

FIELD_MANAGER = "kvserving-operator"


@dataclass(slots=True, frozen=True)
class Resource:
    group: str  # "" for the core group
    version: str
    plural: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        root = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        path = f"{root}/namespaces/{namespace}/{self.plural}"
        if name is not None:
            path += f"/{name}"
        if subresource is not None:
            path += f"/{subresource}"
        return path


# Kinds the renderer produces, in the order they are listed.
CHILD_RESOURCES: dict[str, Resource] = {
    "ConfigMap": Resource("", "v1", "configmaps"),
    "Service": Resource("", "v1", "services"),
    "Deployment": Resource("apps", "v1", "deployments"),
    "NetworkPolicy": Resource("networking.k8s.io", "v1", "networkpolicies"),
    "PodMonitor": Resource("monitoring.coreos.com", "v1", "podmonitors"),
}
KVSERVINGS = Resource(GROUP, VERSION, PLURAL)
PODS = Resource("", "v1", "pods")  # read only: worker pod IPs for the KV-health sampler
# The internal credential: created once (never patched: its value must not
# change), read by the KV-health sampler, deleted by garbage collection.
SECRETS = Resource("", "v1", "secrets")
# Children whose API may be absent from a cluster (prometheus-operator not installed).
OPTIONAL_GROUPS = frozenset({"monitoring.coreos.com"})

# (verb, group, resource[/subresource]) — everything this module may call.
# Server-side apply of an object that does not exist yet creates it, which the
# API server authorizes as "create" as well as "patch".
API_CALLS: frozenset[tuple[str, str, str]] = frozenset(
    {(verb, r.group, r.plural) for r in CHILD_RESOURCES.values() for verb in ("list", "create", "patch", "delete")}
    | {("get", GROUP, PLURAL), ("patch", GROUP, f"{PLURAL}/status"), ("list", "", "pods")}
    | {("create", "", "secrets"), ("get", "", "secrets")}
)


DELETE_OPTIONS = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}


class ApiError(Exception):
    """A non-2xx answer of the API server."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class Transport(Protocol):
    async def request(
        self, method: str, path: str, *, params: dict[str, str] | None = None, body: Any = None, content_type: str | None = None
    ) -> dict[str, Any]: ...


class KubeApi:
    """Typed calls on the children and the KVServing status."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    async def _call(self, verb: str, resource: Resource, path: str, *, subresource: str | None = None, **kwargs: Any) -> dict[str, Any]:
        plural = resource.plural if subresource is None else f"{resource.plural}/{subresource}"
        if (verb, resource.group, plural) not in API_CALLS:
            raise ValueError(f"undeclared API call {verb} {resource.group}/{plural}: add it to API_CALLS")
        method = {"list": "GET", "get": "GET", "create": "POST", "patch": "PATCH", "delete": "DELETE"}[verb]
        return await self._transport.request(method, path, **kwargs)

    async def list_children(
        self, namespace: str, labels: dict[str, str], *, kinds: tuple[str, ...] = tuple(CHILD_RESOURCES)
    ) -> list[dict[str, Any]]:
        """Children of these kinds with these labels; a kind whose API is not installed lists as empty."""
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        found: list[dict[str, Any]] = []
        for kind in kinds:
            resource = CHILD_RESOURCES[kind]
            try:
                answer = await self._call("list", resource, resource.path(namespace), params={"labelSelector": selector})
            except ApiError as exc:
                if exc.status == 404 and resource.group in OPTIONAL_GROUPS:
                    continue
                raise
            for item in answer.get("items", []):
                # List items carry no apiVersion/kind; the plan keys objects by them.
                found.append({"apiVersion": resource.api_version, "kind": kind, **item})
        return found

    async def list_pods(self, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        """Pods with these labels (the KV-health sampler reads their IPs and readiness)."""
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        answer = await self._call("list", PODS, PODS.path(namespace), params={"labelSelector": selector})
        return list(answer.get("items", []))

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply: creates or updates, idempotent; our field manager owns what we render."""
        resource = CHILD_RESOURCES[obj["kind"]]
        meta = obj["metadata"]
        path = resource.path(meta["namespace"], meta["name"])
        return await self._call(
            "patch",
            resource,
            path,
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            body=obj,
            content_type="application/apply-patch+yaml",
        )

    async def create_once(self, obj: dict[str, Any]) -> bool:
        """Create a Secret unless one of that name exists (an existing one is
        kept as it is). True when this call created it. Errors never carry the body."""
        meta = obj["metadata"]
        try:
            await self._call("create", SECRETS, SECRETS.path(meta["namespace"]), body=obj)
        except ApiError as exc:
            if exc.status == 409:  # AlreadyExists: its value stays
                return False
            raise
        return True

    async def _get_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._call("get", SECRETS, SECRETS.path(namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def secret_exists(self, namespace: str, name: str) -> bool:
        return await self._get_secret(namespace, name) is not None

    async def read_secret(self, namespace: str, name: str, key: str) -> str | None:
        """One key of a Secret, decoded; None if the Secret or the key is missing."""
        secret = await self._get_secret(namespace, name)
        value = ((secret or {}).get("data") or {}).get(key)
        if not isinstance(value, str):
            return None
        try:
            return base64.b64decode(value, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        resource = CHILD_RESOURCES[kind]
        try:
            await self._call("delete", resource, resource.path(namespace, name), body=DELETE_OPTIONS)
        except ApiError as exc:
            if exc.status != 404:  # already gone is what we wanted
                raise

    async def get_kvserving(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._call("get", KVSERVINGS, KVSERVINGS.path(namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any], *, resource_version: str | None = None) -> None:
        """Merge-patch ``.status``. With ``resource_version`` the write happens only if
        the object is unchanged since it was read (else ApiError 409)."""
        body: dict[str, Any] = {"status": status}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        path = KVSERVINGS.path(namespace, name, "status")
        await self._call("patch", KVSERVINGS, path, subresource="status", body=body, content_type="application/merge-patch+json")


def connection_info(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """The same credentials kopf's own login finds: in-cluster service account, else KUBECONFIG."""
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.LoginError("no service account token and no kubeconfig found")
    return info


class AiohttpTransport:
    """HTTP to the API server with kopf's ConnectionInfo; re-reads credentials once on 401
    (service-account tokens are rotated on disk)."""

    def __init__(self, settings: kopf.OperatorSettings, logger: logging.Logger | logging.LoggerAdapter[Any]) -> None:
        self._settings = settings
        self._logger = logger
        self._session: aiohttp.ClientSession | None = None
        self._server = ""

    def _connect(self) -> aiohttp.ClientSession:
        info = connection_info(self._settings)
        self._server = (info.server or "").rstrip("/")
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()),
            headers=info.as_http_headers(),
            timeout=aiohttp.ClientTimeout(total=60),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self, method: str, path: str, *, params: dict[str, str] | None = None, body: Any = None, content_type: str | None = None
    ) -> dict[str, Any]:
        for attempt in range(2):
            if self._session is None:
                self._session = self._connect()
            headers = {"Content-Type": content_type or "application/json"}
            data = None if body is None else json.dumps(body)
            async with self._session.request(method, self._server + path, params=params, data=data, headers=headers) as resp:
                text = await resp.text()
                if resp.status == 401 and attempt == 0:
                    self._logger.info("API server answered 401; re-reading credentials")
                    await self.close()
                    continue
                if resp.status >= 400:
                    try:
                        message = json.loads(text).get("message", text)
                    except ValueError:
                        message = text
                    raise ApiError(resp.status, message)
                return json.loads(text) if text else {}
        raise ApiError(401, "unauthorized after re-reading credentials")
