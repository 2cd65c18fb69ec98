"""``kvserving gateway``: the OpenAI-compatible front door, served by uvicorn.

    kvserving gateway --config FILE --host H --port P [--prefill URL ...] [--decode URL ...] [--model DIR]

``--prefill`` / ``--decode`` replace the config's static worker lists (a URL
given to both is a ``both`` worker); ``--model`` replaces ``model.path`` (with
neither, the built-in tiny model is resolved as the workers resolve it).
The workers' internal credential (``security.internal_token_file``) must be
configured and readable, as for workers, or the start stops with one line.
Worker URLs must be ``http://HOST:PORT``; ``--port`` in 0..65535. At start one
line names the model, the workers and the config source; then one access-log
line per request (app.py, ``--log-level``).
The keys in ``security.api_keys_file`` (one per line, from a mounted Secret)
are added to the API keys at start (an unreadable or empty file stops the
start with one line).
``KVSERVING_GATEWAY_API_KEYS`` (comma-separated, e.g. from a Secret) replaces
``gateway.api_keys``, so keys need not sit in the ConfigMap.

SIGTERM/SIGINT drains: no new connection is accepted, requests in flight run
for up to ``gateway.drain_grace_s``, then each still running ends with an
error (an SSE error event with code ``gateway_draining`` once streaming, else a
503), never a bare close; then the process exits 0. A second signal stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import math
import os
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType

import uvicorn

from kvserving.argtypes import check_base_url, check_listen_address, int_in
from kvserving.config import ServingConfig
from kvserving.model_dir import resolve_model_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="engine-config JSON (the operator's ConfigMap); defaults if absent")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int_in(0, 65535), default=8080, help="port to bind")
    parser.add_argument("--prefill", nargs="+", default=None, metavar="URL", help="prefill worker URLs (static list)")
    parser.add_argument("--decode", nargs="+", default=None, metavar="URL", help="decode worker URLs (static list)")
    parser.add_argument("--model", type=Path, default=None, metavar="DIR", help="model directory (tokenizer, template)")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="log level; one access-log line per API request at info, per probe and scrape at debug",
    )


API_KEYS_ENV = "KVSERVING_GATEWAY_API_KEYS"
# Seconds past the drain grace that uvicorn waits for the ended streams' last bytes before it
# cancels what is left (a client that stopped reading).
DRAIN_MARGIN_S = 5.0

log = logging.getLogger(__name__)

# Seconds an idle client connection is kept open. Longer than clients keep theirs (httpx, and so
# the openai SDK: 5 s; load balancers: 60 s): a server that closes an idle connection at the moment
# the client reuses it fails that request (uvicorn's default, 5 s, races the openai client's 5 s
# under load: a 200-session soak loses a request to it about one run in two).
KEEP_ALIVE_S = 75


def load_config(args: argparse.Namespace, *, environ: Mapping[str, str] = os.environ) -> ServingConfig:
    config = ServingConfig.load(args.config) if args.config else ServingConfig()
    gateway = config.gateway
    if environ.get(API_KEYS_ENV):
        keys = tuple(k.strip() for k in environ[API_KEYS_ENV].split(",") if k.strip())
        gateway = dataclasses.replace(gateway, api_keys=keys)
    if config.security.api_keys_file is not None:
        gateway = dataclasses.replace(gateway, api_keys=gateway.api_keys + read_api_keys(config.security.api_keys_file))
    if args.prefill is not None or args.decode is not None:
        gateway = dataclasses.replace(
            gateway,
            prefill_urls=tuple(args.prefill or ()),
            decode_urls=tuple(args.decode or ()),
            prefill_service=None,
            decode_service=None,
        )
    model = config.model
    if args.model is not None:
        model = dataclasses.replace(model, path=str(args.model))
    for flag, field, urls in (("--prefill", "prefill_urls", args.prefill), ("--decode", "decode_urls", args.decode)):
        where = flag if urls is not None else f"gateway.{field}"
        for url in getattr(gateway, field):
            check_base_url(url, where)
    return dataclasses.replace(config, gateway=gateway, model=model)


def read_api_keys(path: str) -> tuple[str, ...]:
    """The keys of an API keys file, one per line (blank lines skipped); ValueError, one line, when it
    cannot be read or holds none (a gateway meant to check keys never runs open)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"security.api_keys_file {path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from exc
    keys = tuple(line.strip() for line in text.splitlines() if line.strip())
    if not keys:
        raise ValueError(f"security.api_keys_file {path} holds no keys")
    return keys


def model_dir(config: ServingConfig) -> Path:
    """``model.path``, or the built-in tiny model (built into the cache on first use), as the workers resolve it."""
    return resolve_model_dir(config.model)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(args)
    if not (config.gateway.prefill_urls or config.gateway.decode_urls or config.gateway.decode_service):
        raise ValueError("no workers: give --decode URL (and --prefill URL) or gateway.decode_service")
    if config.security.read_internal_token() is None:
        raise ValueError(
            "security.internal_token_file is not set: workers serve /internal/* only to callers with "
            "the deployment's credential (kvserving up and the operator provide one)"
        )
    where = model_dir(config)
    check_listen_address(args.host, args.port)  # before the tokenizer loads, not after
    # the app's modules (FastAPI, the tokenizer's libraries) load once the input is known good: a refused start
    # answers at once
    from prometheus_client import CollectorRegistry

    from .app import build_app, build_state
    from .completions import ModelInfo

    model = ModelInfo.load(
        where,
        served_name=config.model.served_name,
        max_model_len=config.model.max_model_len,
        max_kept_tokens=config.gateway.max_kept_tokens,
    )
    log.info("%s", startup_line(config, args, model_name=model.name, max_model_len=model.max_model_len, model_dir=where))
    state = build_state(config, model=model, registry=CollectorRegistry())
    app = build_app(state)
    # Everything built so far (imports, the app, the tokenizer) lives as long as the process:
    # out of the cyclic GC's reach, a collection scans only what requests allocate
    # (otherwise the collections a template render triggers scan the whole heap).
    gc.collect()
    gc.freeze()
    # Young collections every 5,000 net allocations instead of 700: a request allocates thousands of
    # short-lived containers (renders, tag lists), so most young collections find nothing to free.
    # Not more: what a young collection scans is what the conversations kept since the last one, so
    # a larger threshold makes each collection a longer stall for every request in flight (9-21 ms
    # at 20,000 with 200 sessions, 4 ms at 5,000). Measurements: docs/performance-log/gateway.md.
    gc.set_threshold(5_000, 80, 20)
    grace = config.gateway.drain_grace_s
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=math.ceil(grace + DRAIN_MARGIN_S),
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    server = _Server(uv_config, grace_s=grace, end_streams=state.client.abort_streams)
    server.run()
    return 0


def startup_line(config: ServingConfig, args: argparse.Namespace, *, model_name: str, max_model_len: int, model_dir: Path) -> str:
    """What the gateway serves, from where, in front of which workers: one line (no keys)."""
    gw = config.gateway
    workers = []
    for role, urls, service in (("prefill", gw.prefill_urls, gw.prefill_service), ("decode", gw.decode_urls, gw.decode_service)):
        if urls:
            workers.append(f"{role} {','.join(urls)}")
        if service:
            workers.append(f"{role} service {service}:{gw.worker_port}")
    keys = f"{len(gw.api_keys)} API key(s)" if gw.api_keys else "no API keys"
    return (
        f"kvserving gateway on http://{args.host}:{args.port}: model {model_name} ({model_dir}, context "
        f"{max_model_len}); workers: {'; '.join(workers)}; config {args.config or 'built-in defaults'}; {keys}"
    )


class _Server(uvicorn.Server):
    """SIGTERM/SIGINT: drain (module docstring), release idle leases and exit 0; a second
    signal stops at once. (Plain uvicorn re-raises the signal after its graceful stop.)"""

    def __init__(self, config: uvicorn.Config, *, grace_s: float, end_streams: Callable[[], None]) -> None:
        super().__init__(config)
        self.grace_s = grace_s
        self.end_streams = end_streams  # ends every worker request in flight (WorkerClient.abort_streams)
        self._grace: asyncio.TimerHandle | None = None

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # uvicorn stops accepting, closes idle connections and waits for the others; the streams
        # still running when the grace is over are ended by their gateway with an error event
        log.info("draining: requests in flight have %.1f s", self.grace_s)
        self._grace = asyncio.get_running_loop().call_later(self.grace_s, self._grace_over)
        try:
            await super().shutdown(sockets)
        finally:
            self._grace.cancel()

    def _grace_over(self) -> None:
        log.info("drain grace over: ending the requests still in flight")
        self.end_streams()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True
