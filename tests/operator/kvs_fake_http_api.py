"""A small HTTP Kubernetes API server (aiohttp) with discovery, list, watch,
get, server-side apply, JSON/merge patches and status subresource, enough to
run the real kopf operator in-process. Deployments become ready as soon as
they are applied. Every request is recorded as the (verb, group, resource)
RBAC would authorize.

It serves from its own thread and event loop: kopf, when it stops, waits for
every task of its loop, and a server's open watch streams would be among them.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import threading
from typing import Any

from aiohttp import web

_RESOURCES = {
    # (group, version): [(plural, kind, namespaced, verbs)]
    ("", "v1"): [
        ("events", "Event", True, ["create", "list"]),
        ("namespaces", "Namespace", False, ["list", "watch", "get"]),
        ("configmaps", "ConfigMap", True, ["list", "watch", "get", "patch", "create", "delete"]),
        ("services", "Service", True, ["list", "watch", "get", "patch", "create", "delete"]),
        ("secrets", "Secret", True, ["get", "create"]),
    ],
    ("networking.k8s.io", "v1"): [
        ("networkpolicies", "NetworkPolicy", True, ["list", "watch", "get", "patch", "create", "delete"]),
    ],
    ("apps", "v1"): [("deployments", "Deployment", True, ["list", "watch", "get", "patch", "create", "delete"])],
    ("kvserving.dev", "v1alpha1"): [("kvservings", "KVServing", True, ["list", "watch", "get", "patch"])],
}


def _discovery() -> dict[str, Any]:
    docs: dict[str, Any] = {"/api": {"versions": ["v1"]}}
    groups = []
    for (group, version), resources in _RESOURCES.items():
        listing = [
            {"name": plural, "singularName": kind.lower(), "namespaced": ns, "kind": kind, "verbs": verbs}
            for plural, kind, ns, verbs in resources
        ]
        if group == "kvserving.dev":
            listing.append(
                {"name": "kvservings/status", "singularName": "", "namespaced": True, "kind": "KVServing", "verbs": ["get", "patch"]}
            )
        docs[f"/api/{version}" if not group else f"/apis/{group}/{version}"] = {"resources": listing}
        if group:
            gv = {"groupVersion": f"{group}/{version}", "version": version}
            groups.append({"name": group, "versions": [gv], "preferredVersion": gv})
    docs["/apis"] = {"groups": groups}
    return docs


def _merge(dst: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if value is None:
            dst.pop(key, None)
        elif isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], value)
        else:
            dst[key] = copy.deepcopy(value)


def _json_patch(obj: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    for op in ops:
        *parents, leaf = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node = obj
        for key in parents:
            node = node.setdefault(key, {})
        if op["op"] == "test":
            if node.get(leaf) != op["value"]:
                raise web.HTTPConflict(text=json.dumps({"message": "test failed"}), content_type="application/json")
        elif op["op"] in ("add", "replace"):
            node[leaf] = op["value"]
        elif op["op"] == "remove":
            node.pop(leaf, None)


class FakeHttpApi:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self.calls: set[tuple[str, str, str]] = set()
        self.events: list[dict[str, Any]] = []
        self.paths: set[str] = set()  # every request path, to tell namespaced calls from cluster-wide ones
        self._rv = 100
        self._watchers: dict[tuple[str, str], list[asyncio.Queue[dict[str, Any]]]] = {}
        self._discovery = _discovery()
        self.discovery_paths = frozenset(self._discovery)
        self._runner: web.AppRunner | None = None
        self.url = ""

    def start(self) -> None:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        async def serve() -> None:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self._handle)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self.url = f"http://127.0.0.1:{port}"
            ready.set()

        def run() -> None:
            self._loop.run_until_complete(serve())
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert ready.wait(10), "fake API server did not start"

    def stop(self) -> None:
        def end() -> None:
            for queues in self._watchers.values():
                for q in queues:
                    q.put_nowait({})  # ends the stream

        self._loop.call_soon_threadsafe(end)
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _emit(self, group: str, plural: str, kind: str, obj: dict[str, Any]) -> None:
        for q in self._watchers.get((group, plural), []):
            q.put_nowait({"type": kind, "object": copy.deepcopy(obj)})

    def put(self, group: str, plural: str, obj: dict[str, Any]) -> None:
        """Create or replace an object as a user would (a watch event follows); from any thread."""
        done = threading.Event()

        def put() -> None:
            self._put(group, plural, obj)
            done.set()

        self._loop.call_soon_threadsafe(put)
        assert done.wait(10)

    def _put(self, group: str, plural: str, obj: dict[str, Any]) -> None:
        key = (group, plural, obj["metadata"]["namespace"], obj["metadata"]["name"])
        old = self.objects.get(key)
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = self._next_rv()
        if old is not None:
            obj["metadata"]["generation"] = old["metadata"]["generation"] + (old.get("spec") != obj.get("spec"))
            obj.setdefault("status", old.get("status"))
        self.objects[key] = obj
        self._emit(group, plural, "MODIFIED" if old else "ADDED", obj)

    def get(self, group: str, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.objects.get((group, plural, namespace, name)))

    def delete_with_dependents(self, group: str, plural: str, namespace: str, name: str) -> None:
        """Delete an object and, as the garbage collector does, every object whose owner reference names its uid."""
        done = threading.Event()

        def delete() -> None:
            owner = self.objects.pop((group, plural, namespace, name))
            self._emit(group, plural, "DELETED", owner)
            uid = owner["metadata"]["uid"]
            for key, obj in list(self.objects.items()):
                if any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or []):
                    del self.objects[key]
                    self._emit(key[0], key[1], "DELETED", obj)
            done.set()

        self._loop.call_soon_threadsafe(delete)
        assert done.wait(10)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.paths.add(path)
        if path in self._discovery:
            return web.json_response(self._discovery[path])
        parts = path.strip("/").split("/")
        group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
        namespace = None
        if rest[:1] == ["namespaces"]:
            namespace, rest = rest[1], rest[2:]
        plural, name, sub = rest[0], (rest[1] if len(rest) > 1 else None), (rest[2] if len(rest) > 2 else None)
        resource = f"{plural}/{sub}" if sub else plural
        key = (group, plural, namespace or "", name or "")
        method = request.method
        body = json.loads(await request.text() or "null")
        if method == "GET" and name is None:
            watch = request.query.get("watch") == "true"
            self.calls.add(("watch" if watch else "list", group, resource))
            return await (self._watch(request, group, plural, namespace) if watch else self._list(request, group, plural, namespace))
        if method == "GET":
            self.calls.add(("get", group, resource))
            obj = self.objects.get(key)
            return web.json_response(obj) if obj else web.json_response({"message": "not found"}, status=404)
        if method == "POST":
            self.calls.add(("create", group, resource))
            if plural != "secrets":  # kopf's Events: kept apart from the objects
                self.events.append(copy.deepcopy(body))
                return web.json_response(body, status=201)
            key = (group, plural, namespace or "", body["metadata"]["name"])
            if key in self.objects:
                return web.json_response({"message": "already exists", "reason": "AlreadyExists"}, status=409)
            stored = copy.deepcopy(body)
            stored["data"] = {k: base64.b64encode(v.encode()).decode() for k, v in stored.pop("stringData", {}).items()}
            stored["metadata"].update(resourceVersion=self._next_rv(), uid=f"uid-{self._rv}")
            self.objects[key] = stored
            return web.json_response(stored, status=201)
        if method == "DELETE":
            self.calls.add(("delete", group, resource))
            obj = self.objects.pop(key, None)
            if obj is None:
                return web.json_response({"message": "not found"}, status=404)
            self._emit(group, plural, "DELETED", obj)
            return web.json_response({})
        assert method == "PATCH", method
        self.calls.add(("patch", group, resource))
        ctype = request.headers.get("Content-Type")
        if ctype == "application/apply-patch+yaml":
            if key not in self.objects:
                self.calls.add(("create", group, resource))
            return web.json_response(self._apply(key, group, plural, body))
        obj = self.objects[key]
        if sub == "status":
            wanted = (body.get("metadata") or {}).get("resourceVersion")
            if wanted is not None and wanted != obj["metadata"]["resourceVersion"]:
                return web.json_response({"message": "conflict"}, status=409)
            _merge(obj, {"status": body["status"]})
        elif ctype == "application/json-patch+json":
            _json_patch(obj, body)
        else:
            _merge(obj, body)
        obj["metadata"]["resourceVersion"] = self._next_rv()
        self._emit(group, plural, "MODIFIED", obj)
        return web.json_response(obj)

    def _apply(self, key: tuple[str, str, str, str], group: str, plural: str, body: dict[str, Any]) -> dict[str, Any]:
        old = self.objects.get(key)
        new = copy.deepcopy(body)
        generation = 1 if old is None else old["metadata"]["generation"] + (old.get("spec") != new.get("spec"))
        new["metadata"].update(generation=generation, resourceVersion=self._next_rv(), uid=f"uid-{self._rv}")
        if plural == "deployments":  # the pods come up at once
            n = new["spec"]["replicas"]
            new["status"] = {
                "observedGeneration": generation,
                "replicas": n,
                "updatedReplicas": n,
                "readyReplicas": n,
                "conditions": [{"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}],
            }
        self.objects[key] = new
        self._emit(group, plural, "MODIFIED" if old else "ADDED", new)
        return new

    async def _list(self, request: web.Request, group: str, plural: str, namespace: str | None) -> web.Response:
        selector = dict(p.split("=", 1) for p in request.query.get("labelSelector", "").split(",") if p)
        items = [
            o
            for (g, p, ns, _), o in self.objects.items()
            if (g, p) == (group, plural) and namespace in (None, ns) and selector.items() <= o["metadata"].get("labels", {}).items()
        ]
        return web.json_response({"metadata": {"resourceVersion": str(self._rv)}, "items": items})

    async def _watch(self, request: web.Request, group: str, plural: str, namespace: str | None) -> web.StreamResponse:
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._watchers.setdefault((group, plural), []).append(queue)
        response = web.StreamResponse()
        await response.prepare(request)
        try:
            while event := await queue.get():
                if namespace in (None, event["object"]["metadata"].get("namespace")):
                    await response.write((json.dumps(event) + "\n").encode())
        finally:
            self._watchers[(group, plural)].remove(queue)
        return response
