"""A worker app (`kvserving.worker.server`) served by uvicorn on a thread, on a
free loopback port: the real HTTP stack in the test process."""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from prometheus_client import CollectorRegistry

from kvserving.config import ServingConfig
from kvserving.worker.engine import LLMEngine
from kvserving.worker.metrics import WorkerMetrics
from kvserving.worker.server import create_app
from kvserving.worker.service import WorkerService


@dataclass
class Live:
    url: str
    service: WorkerService
    server: uvicorn.Server
    thread: threading.Thread
    config: ServingConfig
    token: str  # the internal credential its /internal/* routes need

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def start_live(
    config: ServingConfig,
    *,
    role: str = "both",
    startup: Callable[[WorkerService], Coroutine[Any, Any, None]] | None = None,
    wait_ready: bool = True,
    max_body_bytes: int | None = None,
) -> Live:
    """A worker app on uvicorn in a thread, on a free loopback port. ``startup(service)``
    replaces building the engine (default: build it, then start with KV transfer); with
    ``wait_ready`` it returns once /ready answers 200, else once /health answers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    registry = CollectorRegistry()
    token = secrets.token_urlsafe(16)
    service = WorkerService(
        config, role=role, metrics=WorkerMetrics(registry, role=role), engine_id=f"test-{role}", advertise_url=url, internal_token=token
    )
    if startup is None:
        engine = LLMEngine(config)

        async def default_startup(svc: WorkerService) -> None:
            await svc.start(engine)

        startup = default_startup
    run = startup

    async def app_startup() -> None:
        await run(service)

    limit = {} if max_body_bytes is None else {"max_body_bytes": max_body_bytes}
    app = create_app(service, registry=registry, internal_token=token, startup=app_startup, **limit)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    live = Live(url, service, server, thread, config, token)
    path = "/ready" if wait_ready else "/health"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return live
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    stop_live(live)
    raise AssertionError(f"worker did not answer {path} within 60 s")


def stop_live(live: Live) -> None:
    live.server.should_exit = True
    live.thread.join(timeout=30)
    assert not live.thread.is_alive(), "uvicorn thread did not stop"
