"""The HTTP transport against a local aiohttp server posing as the API server:
credentials from KUBECONFIG, re-read once on 401, errors as ApiError."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from aiohttp import web

from kvserving.operator.kube import ApiError, AiohttpTransport, KubeApi

pytestmark = pytest.mark.skipif(
    os.path.exists("/var/run/secrets/kubernetes.io/serviceaccount/token"),
    reason="running inside a pod: the service account would take precedence over the test kubeconfig",
)


def _kubeconfig(path: Path, server: str, token: str) -> None:
    path.write_text(
        yaml.safe_dump(
            {
                "current-context": "test",
                "contexts": [{"name": "test", "context": {"cluster": "c", "user": "u"}}],
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"token": token}}],
            }
        )
    )


def test_transport_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []
    config = tmp_path / "kubeconfig"
    monkeypatch.setenv("KUBECONFIG", str(config))

    async def handler(request: web.Request) -> web.Response:
        seen.append(
            {
                "method": request.method,
                "path": request.path,
                "query": dict(request.query),
                "auth": request.headers.get("Authorization"),
                "type": request.headers.get("Content-Type"),
                "body": await request.text(),
            }
        )
        if request.headers.get("Authorization") == "Bearer old":
            _kubeconfig(config, str(request.url.origin()), "new")  # the token was rotated on disk
            return web.json_response({"kind": "Status", "message": "Unauthorized"}, status=401)
        if request.method == "GET" and request.path.endswith("/deployments"):
            return web.json_response({"items": [{"metadata": {"name": "d1"}}]})
        if request.method == "PATCH":
            return web.json_response(json.loads(await request.text()))
        return web.json_response({"kind": "Status", "message": 'configmaps "x" is forbidden'}, status=403)

    async def scenario() -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        _kubeconfig(config, f"http://127.0.0.1:{port}", "old")
        transport = AiohttpTransport(kopf.OperatorSettings(), logging.getLogger("test"))
        api = KubeApi(transport)
        try:
            children = await api.list_children("team", {"app.kubernetes.io/instance": "demo"}, kinds=("Deployment",))
            assert children == [{"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d1"}}]
            obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "demo-config", "namespace": "team"}, "data": {"a": "b"}}
            assert await api.apply(obj) == obj
            with pytest.raises(ApiError) as excinfo:
                await api.delete("ConfigMap", "team", "x")
            assert (excinfo.value.status, excinfo.value.message) == (403, 'configmaps "x" is forbidden')
        finally:
            await transport.close()
            await runner.cleanup()

    asyncio.run(scenario())
    assert [s["auth"] for s in seen] == ["Bearer old", "Bearer new", "Bearer new", "Bearer new"]
    assert seen[1]["path"] == "/apis/apps/v1/namespaces/team/deployments"
    assert seen[1]["query"] == {"labelSelector": "app.kubernetes.io/instance=demo"}
    assert (seen[2]["method"], seen[2]["path"]) == ("PATCH", "/api/v1/namespaces/team/configmaps/demo-config")
    assert seen[2]["query"] == {"fieldManager": "kvserving-operator", "force": "true"}
    assert seen[2]["type"] == "application/apply-patch+yaml"
    assert seen[3]["method"] == "DELETE" and json.loads(seen[3]["body"]) == {
        "apiVersion": "v1",
        "kind": "DeleteOptions",
        "propagationPolicy": "Background",
    }


def test_no_credentials_is_a_login_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kvserving.operator.kube import connection_info

    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(kopf.LoginError):
        connection_info(kopf.OperatorSettings())
