"""An in-memory Kubernetes API server behind kube.Transport, for reconcile and
RBAC tests: stores objects, answers lists by label selector, server-side apply,
delete and status patches, and records every call as the (verb, group,
resource) the real API server would authorize."""

from __future__ import annotations

import base64
import copy
import re
from typing import Any

from kvserving.operator.kube import ApiError

_PATH = re.compile(
    r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))/namespaces/(?P<ns>[^/]+)/(?P<plural>[^/]+)"
    r"(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$"
)


class FakeApiServer:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}  # (group, plural, ns, name)
        self.statuses: dict[tuple[str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str, str]] = []  # authorized (verb, group, resource)
        self.writes: list[tuple[str, str, str]] = []  # (verb, plural, name) of every write, in order
        self.missing_groups: set[str] = set()
        self.fail: dict[tuple[str, str], int] = {}  # (verb, plural) -> HTTP status to answer
        self._rv = 0

    async def request(
        self, method: str, path: str, *, params: dict[str, str] | None = None, body: Any = None, content_type: str | None = None
    ) -> dict[str, Any]:
        m = _PATH.match(path)
        assert m, path
        group = m["group"] or ""
        plural, ns, name, sub = m["plural"], m["ns"], m["name"], m["sub"]
        resource = f"{plural}/{sub}" if sub else plural
        verb = {"GET": "get" if name else "list", "POST": "create", "PATCH": "patch", "DELETE": "delete"}[method]
        key = (group, plural, ns, name or "")
        if verb == "patch" and content_type == "application/apply-patch+yaml" and key not in self.objects:
            self.calls.append(("create", group, resource))  # apply that creates is authorized as create too
        self.calls.append((verb, group, resource))
        if group in self.missing_groups:
            raise ApiError(404, "the server could not find the requested resource")
        if (verb, plural) in self.fail:
            raise ApiError(self.fail[(verb, plural)], f"injected failure on {verb} {plural}")
        if verb == "list":
            wanted = dict(pair.split("=", 1) for pair in (params or {}).get("labelSelector", "").split(",") if pair)
            items = [
                copy.deepcopy(o)
                for (g, p, n, _), o in sorted(self.objects.items())
                if (g, p, n) == (group, plural, ns) and wanted.items() <= o["metadata"].get("labels", {}).items()
            ]
            for item in items:  # list items come without apiVersion/kind
                item.pop("apiVersion", None)
                item.pop("kind", None)
            return {"items": items}
        if sub == "status":
            assert content_type == "application/merge-patch+json"
            stored = self.objects.get(key)
            wanted_rv = body.get("metadata", {}).get("resourceVersion")
            if wanted_rv is not None and stored is not None and stored["metadata"]["resourceVersion"] != wanted_rv:
                raise ApiError(409, "the object has been modified; please apply your changes to the latest version")
            self.statuses[(ns, name or "")] = copy.deepcopy(body["status"])
            if stored is not None:
                stored["status"] = copy.deepcopy(body["status"])
                self._rv += 1
                stored["metadata"]["resourceVersion"] = str(self._rv)
            self.writes.append(("status", plural, name or ""))
            return {}
        if verb == "create":
            return copy.deepcopy(self._create(group, plural, ns, body))
        if verb == "get":
            if key not in self.objects:
                raise ApiError(404, f"{plural} {name!r} not found")
            return copy.deepcopy(self.objects[key])
        if verb == "patch":
            assert content_type == "application/apply-patch+yaml" and params == {"fieldManager": "kvserving-operator", "force": "true"}
            self.writes.append(("apply", plural, name or ""))
            return copy.deepcopy(self._apply(key, body))
        if verb == "delete":
            self.writes.append(("delete", plural, name or ""))
            if key not in self.objects:
                raise ApiError(404, "not found")
            del self.objects[key]
            return {}
        raise AssertionError(f"unexpected call {method} {path}")

    def _apply(self, key: tuple[str, str, str, str], body: dict[str, Any]) -> dict[str, Any]:
        self._rv += 1
        old = self.objects.get(key)
        new = copy.deepcopy(body)
        generation = 1
        if old is not None:
            generation = old["metadata"]["generation"] + (old.get("spec") != new.get("spec"))
            if "status" in old:
                new["status"] = old["status"]
        new["metadata"].update(generation=generation, resourceVersion=str(self._rv), uid=f"child-{self._rv}")
        self.objects[key] = new
        return new

    def _create(self, group: str, plural: str, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST: AlreadyExists (409) for a taken name; a Secret's stringData is stored base64 under data."""
        key = (group, plural, ns, body["metadata"]["name"])
        self.writes.append(("create", plural, key[3]))
        if key in self.objects:
            raise ApiError(409, f"{plural} {key[3]!r} already exists")
        new = copy.deepcopy(body)
        if plural == "secrets":
            data = {k: base64.b64encode(v.encode()).decode() for k, v in new.pop("stringData", {}).items()}
            new["data"] = {**new.get("data", {}), **data}
        self._rv += 1
        new["metadata"].update(resourceVersion=str(self._rv), uid=f"child-{self._rv}")
        self.objects[key] = new
        return new

    def secret_value(self, ns: str, name: str, key: str) -> str | None:
        obj = self.objects.get(("", "secrets", ns, name))
        value = (obj or {}).get("data", {}).get(key)
        return None if value is None else base64.b64decode(value).decode()

    def put_kvserving(self, body: dict[str, Any]) -> dict[str, Any]:
        """Store a KVServing as the API server holds it (with a resourceVersion); returns the stored copy."""
        self._rv += 1
        stored = copy.deepcopy(body)
        stored["metadata"]["resourceVersion"] = str(self._rv)
        self.objects[("kvserving.dev", "kvservings", stored["metadata"]["namespace"], stored["metadata"]["name"])] = stored
        return copy.deepcopy(stored)

    def settle_deployments(self, *, ready: bool = True) -> None:
        """What the Deployment controller would report once the pods are up (or are not)."""
        for (group, plural, _, _), obj in self.objects.items():
            if plural != "deployments":
                continue
            n = obj["spec"]["replicas"]
            obj["status"] = {
                "observedGeneration": obj["metadata"]["generation"],
                "replicas": n,
                "updatedReplicas": n,
                "readyReplicas": n if ready else 0,
                "conditions": [{"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}],
            }

    def names(self, plural: str) -> list[str]:
        return sorted(k[3] for k in self.objects if k[1] == plural)
