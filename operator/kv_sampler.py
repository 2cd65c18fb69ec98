"""The KV-health sampler: every ``kv_health.INTERVAL_S`` it asks each ready
worker pod of every known KVServing for ``GET /internal/kv/stats`` (pod IPs,
bounded timeouts, concurrently) and folds the answers into the status.

It runs as one background task of the operator (started and cancelled by the
handlers), not as a kopf timer: timers would put a finalizer on every
KVServing. A slow or dead pod costs at most ``timeout_s`` and counts as not
reporting; the sampler never blocks reconciliation (it only refreshes status,
guarded by resourceVersion like every other status refresh).

``/internal/*`` requires the deployment's internal credential: the sampler
reads it from the KVServing's Secret through the Kubernetes API (kube.py) on
every sample, so a replaced Secret is used at once, and sends it as a Bearer
token. The token is never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, MutableSet
from typing import Any

import aiohttp

from kvserving.operator.kube import KubeApi
from kvserving.operator.kv_health import INTERVAL_S, WORKER_ROLES, Stats, summarize
from kvserving.operator.reconcile import refresh_status, utc_now
from kvserving.operator.render import LABEL_COMPONENT, LABEL_INSTANCE, internal_secret_name
from kvserving.operator.spec import INTERNAL_TOKEN_KEY, WORKER_PORT

log = logging.getLogger("kvserving.operator.kv_sampler")
TIMEOUT_S = 2.0

Fetch = Callable[[str, str | None], Awaitable[Stats | None]]  # (url, internal token)


def pod_stats_url(pod: dict[str, Any]) -> str | None:
    """``http://IP:PORT/internal/kv/stats`` of a Ready pod with an IP, else None."""
    status = pod.get("status") or {}
    ip = status.get("podIP")
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    if not ip or not ready:
        return None
    port = WORKER_PORT
    for container in (pod.get("spec") or {}).get("containers") or []:
        for p in container.get("ports") or []:
            if p.get("name") == "http" and isinstance(p.get("containerPort"), int):
                port = p["containerPort"]
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}/internal/kv/stats"


def http_fetcher(session: aiohttp.ClientSession, *, timeout_s: float = TIMEOUT_S) -> Fetch:
    async def fetch(url: str, token: str | None) -> Stats | None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status != 200:
                    return None
                body = await resp.json()
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None
        return body if isinstance(body, dict) else None

    return fetch


async def sample(api: KubeApi, namespace: str, name: str, fetch: Fetch) -> dict[str, list[Stats | None]]:
    """role -> the stats of each ready pod of that role (None where a pod did not answer)."""
    out: dict[str, list[Stats | None]] = {}
    token = await api.read_secret(namespace, internal_secret_name(name), INTERNAL_TOKEN_KEY)
    for role in WORKER_ROLES:
        pods = await api.list_pods(namespace, {LABEL_INSTANCE: name, LABEL_COMPONENT: role})
        urls = [u for u in (pod_stats_url(p) for p in pods) if u is not None]
        out[role] = list(await asyncio.gather(*(fetch(u, token) for u in urls)))
    return out


async def refresh_kv(api: KubeApi, body: dict[str, Any], fetch: Fetch) -> dict[str, Any] | None:
    """One KVServing (as just read): sample its workers and write the status if
    it changed. Returns the status written, or None."""
    meta = body["metadata"]
    if meta.get("deletionTimestamp"):
        return None
    samples = await sample(api, meta["namespace"], meta["name"], fetch)
    kv = summarize(samples, previous=(body.get("status") or {}).get("kv"))
    return await refresh_status(api, body, now=utc_now(), kv=kv)


async def run_sampler(api: KubeApi, known: MutableSet[tuple[str, str]], fetch: Fetch, *, interval_s: float = INTERVAL_S) -> None:
    """Forever (until cancelled): refresh every known KVServing's KV health;
    one that no longer exists leaves ``known``."""
    while True:
        for namespace, name in sorted(known):
            try:
                body = await api.get_kvserving(namespace, name)
                if body is None:
                    known.discard((namespace, name))
                    continue
                await refresh_kv(api, body, fetch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # one KVServing's failure must not stop the others' sampling
                log.warning("KV-health sampling of %s/%s failed: %s", namespace, name, exc)
        await asyncio.sleep(interval_s)


class KVSampler:
    """The operator's one sampler task and its HTTP session; ``known`` holds
    the (namespace, name) of every KVServing the reconciler has seen."""

    def __init__(self, api: KubeApi, *, interval_s: float = INTERVAL_S, timeout_s: float = TIMEOUT_S) -> None:
        self.api = api
        self.known: set[tuple[str, str]] = set()
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._session = aiohttp.ClientSession()
        fetch = http_fetcher(self._session, timeout_s=self.timeout_s)
        self._task = asyncio.create_task(run_sampler(self.api, self.known, fetch, interval_s=self.interval_s))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None
