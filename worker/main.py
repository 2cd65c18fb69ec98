"""``kvserving worker``: one worker process (prefill, decode or both) serving the
worker HTTP API on uvicorn, the engine in the same process.

Start-up: the config, the internal credential and the model directory are
checked before anything binds (one-line errors); the server then answers
``/health`` at once while the model loads on a thread, and ``/ready`` turns 200
when it has loaded and, on a GPU, run its warm-up (``build_engine``); kernel
compiles are counted by phase from the start (``compiles.CompileWatch``). A
worker never starts without the deployment's internal credential
(``security.internal_token_file``): its ``/internal/*`` routes move and pin KV,
and nothing unauthenticated may reach them.

Shutdown (SIGTERM or SIGINT): ``/ready`` and new requests get 503 at once,
requests in flight get ``--grace-period-s`` to finish and are aborted after
it, then the server closes, the engine and its NIXL agent are released and the
process exits 0. A second signal skips the wait.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import os
import socket
import uuid
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn
from prometheus_client import CollectorRegistry

from kvserving.argtypes import check_base_url, check_listen_address, float_in, int_in
from kvserving.config import LOAD_FORMATS, ROLES, WORKER_KEEP_ALIVE_S, ServingConfig
from kvserving.model_dir import resolve_model_dir
from kvserving.worker.compiles import CompileWatch

if TYPE_CHECKING:
    from kvserving.worker.engine import LLMEngine
    from kvserving.worker.service import WorkerService

log = logging.getLogger("kvserving.worker")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", required=True, choices=ROLES, help="what this worker does in the KV flow")
    parser.add_argument("--config", type=Path, default=None, help="engine config JSON (the operator's ConfigMap); defaults if absent")
    parser.add_argument("--model", type=Path, default=None, help="model directory (HF format); overrides model.path")
    parser.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        default=None,
        help="'dummy': seeded random weights from config.json alone (real-shape benchmarks); overrides model.load_format",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int_in(0, 65535), default=8000, help="port to bind")
    parser.add_argument(
        "--advertise-url", default=None, help="URL other workers reach this one at (kv_transfer_params.agent_url); default http://HOST:PORT"
    )
    parser.add_argument("--engine-id", default=None, help="engine id in kv_transfer_params (default: unique per process start)")
    parser.add_argument(
        "--grace-period-s",
        type=float_in(0.0, 3600.0),
        default=25.0,
        help="on SIGTERM, how long requests in flight may run before they are aborted",
    )
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"), help="log level")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps (on CPU there are none)")


def resolve_model(config: ServingConfig, model: Path | None) -> ServingConfig:
    """The config with ``model.path`` set to a directory that exists: ``--model`` first, then
    the config's own path, else the built-in tiny model (built into the cache on first use)."""
    if model is not None:
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, path=str(model)))
    path = resolve_model_dir(config.model)
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {path} has no config.json")
    return dataclasses.replace(config, model=dataclasses.replace(config.model, path=str(path)))


def advertise_url(host: str, port: int, explicit: str | None) -> str:
    if explicit:
        return explicit.rstrip("/")
    if host in ("0.0.0.0", "::", ""):
        host = os.environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())
    return f"http://{host}:{port}"


def build_engine(config: ServingConfig, *, role: str, enforce_eager: bool) -> LLMEngine:
    """The worker's engine, with its decode graphs captured (roles that decode: a prefill worker's requests end at
    their first token) and, on a GPU, warmed up: every step shape its requests can reach run once, so their kernels
    compile before /ready and not in a served turn (``warm_up.py``; on a CPU nothing compiles)."""
    from kvserving.worker.engine import LLMEngine

    decode = role != "prefill"
    engine = LLMEngine(config, enforce_eager=enforce_eager, warm_graphs=decode)
    if engine.device.type == "cuda":
        report = engine.warm_up(decode=decode)
        log.info(
            "warm-up: %d requests in %d steps, %d decode shapes, %.1f s",
            report.requests,
            report.steps,
            report.decode_shapes,
            report.seconds,
        )
    return engine


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServingConfig.load(args.config) if args.config is not None else ServingConfig()
    internal_token = config.security.read_internal_token()
    if internal_token is None:
        raise ValueError(
            "security.internal_token_file is not set: a worker serves /internal/* only to callers "
            "with the deployment's credential (kvserving up and the operator provide one)"
        )
    if args.advertise_url is not None:
        check_base_url(args.advertise_url, "--advertise-url")
    config = resolve_model(config, args.model)
    check_listen_address(args.host, args.port)  # before the model loads, not after
    if args.load_format is not None:
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, load_format=args.load_format))
    engine_id = args.engine_id or f"worker-{args.role}-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    # torch comes with these: imported once the arguments, the config and the address are known good, so a refused
    # start answers in a fraction of a second
    from kvserving.worker.metrics import WorkerMetrics
    from kvserving.worker.server import create_app
    from kvserving.worker.service import WorkerService

    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, role=args.role)
    watch = CompileWatch(metrics.kernel_compiled)  # kernel compiles, by phase: before ready, or in a served step
    watch.install()
    service = WorkerService(
        config,
        role=args.role,
        metrics=metrics,
        engine_id=engine_id,
        advertise_url=advertise_url(args.host, args.port, args.advertise_url),
        internal_token=internal_token,
    )
    failed: list[BaseException] = []
    server: DrainingServer | None = None

    async def startup() -> None:
        try:
            engine = await asyncio.get_running_loop().run_in_executor(
                None, functools.partial(build_engine, config, role=args.role, enforce_eager=args.enforce_eager)
            )
            await service.start(engine)
            watch.serving()
        except Exception as exc:  # a model that cannot load ends the process with one line
            log.error("could not start the engine: %s", " ".join(str(exc).split()) or type(exc).__name__)
            failed.append(exc)
            assert server is not None
            server.should_exit = True

    app = create_app(service, registry=registry, internal_token=internal_token, startup=startup)
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=WORKER_KEEP_ALIVE_S,
        lifespan="on",
    )
    server = DrainingServer(uv_config, service=service, grace_s=args.grace_period_s)
    try:
        server.run()
    finally:
        watch.uninstall()
    return 1 if failed else 0


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, with SIGTERM/SIGINT starting a drain instead of an immediate close."""

    def __init__(self, config: uvicorn.Config, *, service: WorkerService, grace_s: float) -> None:
        super().__init__(config)
        self.service = service
        self.grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's own: that one re-raises the signal after shutdown (exit -15, not 0).
        loop = self._loop
        if self._draining or loop is None or not self.started:
            self.force_exit = self._draining  # a second signal: stop waiting
            self.should_exit = True
            return
        self._draining = True
        log.info("signal %d: draining (grace %.1f s)", sig, self.grace_s)
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))

    async def _drain(self) -> None:
        try:
            await self.service.drain(grace_s=self.grace_s)
        finally:
            self.should_exit = True
