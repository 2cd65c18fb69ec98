"""A worker app (`kvserving.worker.server`) served by uvicorn on a thread, on a
free loopback port: the real HTTP stack in the test process."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

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


def start_live(config: ServingConfig, *, role: str = "both") -> Live:
    """A worker app on uvicorn in a thread, on a free loopback port; ready when returned."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    registry = CollectorRegistry()
    service = WorkerService(config, role=role, metrics=WorkerMetrics(registry, role=role), engine_id=f"test-{role}",
                            advertise_url=url)
    engine = LLMEngine(config)

    async def startup() -> None:
        await service.start(engine)

    app = create_app(service, registry=registry, startup=startup)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return Live(url, service, server, thread, config)
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    stop_live(Live(url, service, server, thread, config))
    raise AssertionError("worker did not become ready within 60 s")


def stop_live(live: Live) -> None:
    live.server.should_exit = True
    live.thread.join(timeout=30)
    assert not live.thread.is_alive(), "uvicorn thread did not stop"
