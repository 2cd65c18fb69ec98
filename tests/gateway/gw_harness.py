"""Start a real gateway (uvicorn on 127.0.0.1, in a thread) over fake workers, for the gateway tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fake_worker import FakeWorker, ServerThread, start_fake
from prometheus_client import CollectorRegistry

from kvserving.config import GatewayConfig, ModelConfig, ReuseConfig, SecurityConfig, ServingConfig
from kvserving.gateway.app import GatewayState, build_app, build_state
from kvserving.gateway.completions import ModelInfo
from kvserving.gateway.main import KEEP_ALIVE_S

MODEL = "kvserving-tiny"


@dataclass
class Gateway:
    server: ServerThread
    state: GatewayState

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def base_url(self) -> str:
        return self.server.url + "/v1"

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.state.metrics.registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else float(value)

    def stop(self) -> None:
        self.server.stop()


def start_gateway(
    model_dir: Path,
    *,
    prefill: list[str] = (),
    decode: list[str] = (),
    reuse: ReuseConfig | None = None,  # type: ignore[assignment]
    max_model_len: int | None = None,
    security: SecurityConfig | None = None,
    **gateway: Any,
) -> Gateway:
    gateway.setdefault("health_interval_s", 0.2)
    config = ServingConfig(
        model=ModelConfig(path=str(model_dir), served_name=MODEL, max_model_len=max_model_len),
        reuse=reuse or ReuseConfig(),
        security=security or SecurityConfig(),
        gateway=GatewayConfig(prefill_urls=tuple(prefill), decode_urls=tuple(decode), **gateway),
    )
    model = ModelInfo.load(model_dir, served_name=MODEL, max_model_len=max_model_len, max_kept_tokens=config.gateway.max_kept_tokens)
    state = build_state(config, model=model, registry=CollectorRegistry())
    # served as `kvserving gateway` serves it: idle client connections kept longer than clients keep them
    return Gateway(ServerThread(build_app(state), timeout_keep_alive=KEEP_ALIVE_S).start(), state)


class Stack:
    """Fake workers and gateways started by one test, all stopped at the end."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.servers: list[Any] = []

    def worker(self, *, keep_alive_s: int = 5, **kwargs: Any) -> FakeWorker:
        worker = FakeWorker(**kwargs)
        self.servers.append(start_fake(worker, timeout_keep_alive=keep_alive_s))
        return worker

    def gateway(self, **kwargs: Any) -> Gateway:
        gw = start_gateway(self.model_dir, **kwargs)
        self.servers.append(gw)
        return gw

    def close(self) -> None:
        # the gateways stop as `kvserving gateway` does (its clients closed); the fakes keep nothing
        # worth waiting for, so their requests still in flight end with them
        for server in reversed(self.servers):
            if isinstance(server, Gateway):
                server.stop()
            else:
                server.stop(wait_for_requests=False)
