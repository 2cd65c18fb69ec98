"""Real `kvserving worker` processes on loopback for the e2e tests (the
fixtures in conftest.py hand them out).

Every process is started in its own session (process group) and killed with
its group when the test ends, also on failure; every wait has a deadline.

The workers of one factory share an internal credential (``token_path``; calls
to ``/internal/*`` send ``headers``) and know each other as peers: their ports
are picked up front and every config lists them as the deployment's workers
(``gateway.prefill_urls`` / ``decode_urls``) unless it names its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvserving.local.stack import free_port, free_ports, new_token_file

READY_TIMEOUT_S = 120.0
MAX_WORKERS = 16  # ports picked up front per factory (the peers every worker knows)


@dataclass
class WorkerProc:
    role: str
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    headers: dict[str, str] = field(default_factory=dict)  # what a call to its /internal/* sends
    extra: dict[str, Any] = field(default_factory=dict)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.role} worker exited {self.proc.returncode} before ready:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"{self.role} worker not ready within {timeout} s:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL the worker's whole process group (idempotent)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


class WorkerFactory:
    """Starts workers; ``close`` kills every one it started."""

    def __init__(self, tmp: Path, model_dir: Path) -> None:
        self.tmp = tmp
        self.model_dir = model_dir
        self.started: list[WorkerProc] = []
        self.token_path = tmp / "internal-token"
        self.token = new_token_file(self.token_path)
        self.headers = {"Authorization": f"Bearer {self.token}"}
        self.ports = free_ports(MAX_WORKERS)
        self.peer_urls = [f"http://127.0.0.1:{p}" for p in self.ports]

    def start(
        self, role: str, config: dict[str, Any], *, wait: bool = True, args: tuple[str, ...] = (), port: int | None = None
    ) -> WorkerProc:
        n = len(self.started)
        config = dict(config)
        config["security"] = {"internal_token_file": str(self.token_path), **config.get("security", {})}
        gateway = dict(config.get("gateway", {}))
        if not any(gateway.get(k) for k in ("prefill_urls", "decode_urls", "prefill_service", "decode_service")):
            gateway.update(prefill_urls=self.peer_urls, decode_urls=self.peer_urls)
        config["gateway"] = gateway
        cfg = self.tmp / f"config-{n}.json"
        cfg.write_text(json.dumps(config))
        log_path = self.tmp / f"worker-{n}-{role}.log"
        port = port or (self.ports[n] if n < len(self.ports) else free_port())
        argv = [
            sys.executable,
            "-m",
            "kvserving.cli",
            "worker",
            "--role",
            role,
            "--config",
            str(cfg),
            "--model",
            str(self.model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *args,
        ]
        # One torch thread per worker: several processes share 2 cores.
        env = dict(os.environ, PYTHONSAFEPATH="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        worker = WorkerProc(role, f"http://127.0.0.1:{port}", proc, log_path, dict(self.headers))
        self.started.append(worker)
        if wait:
            worker.wait_ready()
        return worker

    def close(self) -> None:
        for worker in self.started:
            worker.kill()


def stream_generate(worker: WorkerProc, body: dict[str, Any], *, timeout: float = 120) -> tuple[list[int], dict[str, Any]]:
    """POST /internal/generate; the streamed token ids and the final event (asserts [DONE])."""
    tokens: list[int] = []
    final: dict[str, Any] = {}
    with httpx.stream("POST", worker.url + "/internal/generate", json=body, headers=worker.headers, timeout=timeout) as r:
        if r.status_code != 200:
            raise AssertionError(f"{r.status_code}: {r.read().decode()}")
        for line in r.iter_lines():
            if not line or line.startswith(":"):  # a blank separator or a keep-alive comment
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                return tokens, final
            event = json.loads(data)
            if "error" in event:
                raise AssertionError(f"error event: {event}")
            tokens.extend(event["token_ids"])
            if "finish_reason" in event:
                final = event
    raise AssertionError("stream ended without [DONE]")
