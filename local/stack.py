"""The local stack: gateway + prefill + decode workers (and optionally a real
Prometheus) as child processes on loopback, supervised as one unit.

``kvserving up`` runs it from the command line; the demo and the e2e tests use
``LocalStack`` directly. Every part is started from ONE engine-config file
written with ``kvserving.config`` (the schema the operator renders into its
ConfigMap), so local mode and the cluster run the same configuration code.

Supervision rules, exact so tests can assert them:

- each child runs in its own process group (``start_new_session``), so stopping
  it also stops anything it started; stop = SIGTERM to the group, then SIGKILL
  after ``grace_s``, and ``stop()`` returns once no process of the group is
  alive (zombies aside: reaping a grandchild is its new parent's job), within
  ``GROUP_EXIT_S`` (a process killed by a signal still has to be scheduled to
  die: on a loaded machine a grandchild outlived its group's SIGKILL by a
  moment and a test saw it);
- ``wait_ready`` polls every child's ``/ready`` until all answer 200 or the
  deadline passes; a child that exits meanwhile fails the start with its name,
  exit code and the last lines of its log;
- ``check()`` reports the first child that died; the caller then stops the rest
  (no orphans: ``stop()`` is idempotent and runs from ``__exit__``).

Every stack has its own internal credential: a random token written to a 0600
file in the run directory (``INTERNAL_TOKEN_FILE``), named by the config's
``security.internal_token_file``; the gateway and the workers read it there, and
``internal_headers`` carries it for callers of the workers' ``/internal/*``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from kvserving.config import ServingConfig

LOG_TAIL_LINES = 15
# A log line that states an error: logging's " ERROR name: " prefix, or a Python exception's last line.
_ERROR_LINE = re.compile(r"^.*? ERROR [\w.]+: |^(?:[\w.]+\.)?[A-Z]\w*(?:Error|Exception): ")
INTERNAL_TOKEN_FILE = "internal-token"
GROUP_EXIT_S = 5.0  # how long stop() waits for a killed process group to be gone


class StackError(RuntimeError):
    """A part of the stack could not start or died: ``summary`` is one line; the message may add the
    last lines of the log of the part that died."""

    def __init__(self, summary: str, detail: str = "") -> None:
        super().__init__(f"{summary}\n{detail}" if detail else summary)
        self.summary = summary


@dataclass(slots=True, frozen=True)
class StackSpec:
    """What to start. ``single``: one worker of role ``both`` instead of prefill + decode."""

    config: ServingConfig
    host: str = "127.0.0.1"
    gateway_port: int = 8000
    prefill_port: int = 8001
    decode_port: int = 8002
    single: bool = False
    prometheus_port: int | None = None  # None: no Prometheus
    run_dir: Path | None = None  # logs and config; None: a temp dir removed on stop
    python: str = sys.executable
    # GPU of each worker, in start order (prefill, decode; or the one `both` worker),
    # as CUDA_VISIBLE_DEVICES values; one entry is shared by all; () leaves the env alone.
    gpus: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if any(not g or not all(part.strip().isdigit() for part in g.split(",")) for g in self.gpus):
            raise ValueError(f"gpus must be GPU indices such as '0' or '0,1', got {list(self.gpus)}")
        ports = [self.gateway_port, self.prefill_port] + ([] if self.single else [self.decode_port])
        if self.prometheus_port is not None:
            ports.append(self.prometheus_port)
        for port in ports:
            if not 1 <= port <= 65535:
                raise ValueError(f"port must be in 1..65535, got {port}")
        if len(set(ports)) != len(ports):
            raise ValueError(f"ports must be distinct, got {ports}")


@dataclass(slots=True)
class Child:
    name: str
    argv: list[str]
    ready_url: str | None
    log_path: Path
    env: dict[str, str] | None = None  # added to the stack's environment for this child
    proc: subprocess.Popen[bytes] | None = None
    log_file: object = None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def new_token_file(path: Path) -> str:
    """A new random internal credential, written to ``path`` (0600); returns it."""
    token = secrets.token_urlsafe(32)
    write_private(path, token)
    return token


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600, also when it existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the OS picks it)."""
    return free_ports(1, host)[0]


# Ports are picked below the OS's ephemeral range: outgoing connections (HTTP clients, NIXL's sockets)
# take their source ports from that range and could take a picked port before its server binds it.
PICK_LOW = 10000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    """The first port of the OS's ephemeral range (Linux's default where it does not say)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that were free a moment ago, picked at random below the ephemeral range
    (``PICK_LOW`` up; the OS picks them where that range leaves too few)."""
    low = _ephemeral_low()
    picked: list[int] = []
    if low - PICK_LOW >= 64 * n:
        rng = secrets.SystemRandom()
        for port in rng.sample(range(PICK_LOW, low), min(low - PICK_LOW, 16 * n)):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue  # taken
            picked.append(port)
            if len(picked) == n:
                return picked
    socks = []
    try:
        for _ in range(n - len(picked)):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            socks.append(sock)
        return picked + [s.getsockname()[1] for s in socks]
    finally:
        for sock in socks:
            sock.close()


def http_ok(url: str, *, timeout_s: float = 1.0) -> bool:
    """Whether ``url`` answers a GET with 200 within ``timeout_s`` (aiohttp, the package's one HTTP client)."""
    return asyncio.run(_http_ok(url, timeout_s))


async def _http_ok(url: str, timeout_s: float) -> bool:
    import aiohttp

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session, session.get(url) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return False


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def install_prometheus() -> str:
    """Install Debian's ``prometheus`` package (says so on stderr); returns the binary path."""
    found = prometheus_binary()
    if found:
        return found
    print("prometheus is not installed: installing the Debian package 'prometheus' (apt-get)", file=sys.stderr)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"]):
        result = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise StackError(f"could not install prometheus ({' '.join(argv[:2])}): {last}")
    found = prometheus_binary()
    if not found:
        raise StackError("prometheus package installed but no 'prometheus' binary on PATH")
    return found


def scrape_config(targets: dict[str, str], *, interval_s: float = 1.0) -> str:
    """Prometheus config scraping each ``name -> host:port`` target, labelled like the cluster's PodMonitor."""
    jobs = []
    for name, target in targets.items():
        jobs.append(
            {
                "job_name": name,
                "scrape_interval": f"{interval_s:g}s",
                "static_configs": [{"targets": [target], "labels": {"namespace": "local", "kvserving": "local", "pod": name}}],
            }
        )
    # JSON is valid YAML: no YAML writer needed.
    return json.dumps({"global": {"scrape_interval": f"{interval_s:g}s"}, "scrape_configs": jobs}, indent=2)


class LocalStack:
    """Start, wait for, check and stop the local stack's child processes."""

    def __init__(self, spec: StackSpec) -> None:
        self.spec = spec
        self._tmp: Path | None = None  # a run dir of our own, removed on close unless kept
        if spec.run_dir is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="kvserving-up-"))
            self.run_dir = self._tmp
        else:
            self.run_dir = spec.run_dir
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self.config_path = self.run_dir / "config.json"
        self.token_path = self.run_dir / INTERNAL_TOKEN_FILE
        self.internal_token = secrets.token_urlsafe(32)

    @property
    def internal_headers(self) -> dict[str, str]:
        """What a call to a worker's ``/internal/*`` routes sends."""
        return {"Authorization": f"Bearer {self.internal_token}"}

    # -------------------------------------------------------------- addresses
    def _url(self, port: int) -> str:
        return f"http://{self.spec.host}:{port}"

    @property
    def gateway_url(self) -> str:
        return self._url(self.spec.gateway_port)

    @property
    def openai_base_url(self) -> str:
        return f"{self.gateway_url}/v1"

    @property
    def worker_urls(self) -> dict[str, str]:
        if self.spec.single:
            return {"both": self._url(self.spec.prefill_port)}
        return {"prefill": self._url(self.spec.prefill_port), "decode": self._url(self.spec.decode_port)}

    @property
    def prometheus_url(self) -> str | None:
        port = self.spec.prometheus_port
        return None if port is None else self._url(port)

    # ------------------------------------------------------------------ start
    def engine_config(self) -> ServingConfig:
        """The spec's config with the gateway pointed at this stack's workers, and every part
        at this stack's internal credential."""
        workers = self.worker_urls
        both = self.spec.single
        gateway = replace(
            self.spec.config.gateway,
            prefill_urls=(workers["both"],) if both else (workers["prefill"],),
            decode_urls=(workers["both"],) if both else (workers["decode"],),
            prefill_service=None,
            decode_service=None,
        )
        security = replace(self.spec.config.security, internal_token_file=str(self.token_path))
        return replace(self.spec.config, gateway=gateway, security=security)

    def _check_ports(self) -> None:
        ports = {"gateway": self.spec.gateway_port, "prefill": self.spec.prefill_port}
        if not self.spec.single:
            ports["decode"] = self.spec.decode_port
        if self.spec.prometheus_port is not None:
            ports["prometheus"] = self.spec.prometheus_port
        busy = [f"{name} port {port}" for name, port in ports.items() if not port_is_free(self.spec.host, port)]
        if busy:
            raise StackError(f"already in use on {self.spec.host}: {', '.join(busy)} (choose other ports with --port)")

    def _plan(self) -> list[Child]:
        py, cfg, host = self.spec.python, str(self.config_path), self.spec.host
        cli = [py, "-m", "kvserving.cli"]
        children = []
        roles = (
            [("both", self.spec.prefill_port)]
            if self.spec.single
            else [("prefill", self.spec.prefill_port), ("decode", self.spec.decode_port)]
        )
        for n, (role, port) in enumerate(roles):
            name = "worker" if role == "both" else role
            argv = cli + ["worker", "--role", role, "--config", cfg, "--host", host, "--port", str(port)]
            gpus = self.spec.gpus
            env = {"CUDA_VISIBLE_DEVICES": gpus[n % len(gpus)]} if gpus else None
            children.append(Child(name, argv, self._url(port) + "/ready", self.run_dir / f"{name}.log", env=env))
        argv = cli + ["gateway", "--config", cfg, "--host", host, "--port", str(self.spec.gateway_port)]
        children.append(Child("gateway", argv, self.gateway_url + "/ready", self.run_dir / "gateway.log"))
        if self.spec.prometheus_port is not None:
            children.append(self._prometheus_child())
        return children

    def _prometheus_child(self) -> Child:
        binary = install_prometheus()
        targets = {c: url.split("://", 1)[1] for c, url in self.worker_urls.items()}
        targets["gateway"] = f"{self.spec.host}:{self.spec.gateway_port}"
        prom_cfg = self.run_dir / "prometheus.yml"
        prom_cfg.write_text(scrape_config(targets))
        data = self.run_dir / "prometheus-data"
        argv = [
            binary,
            f"--config.file={prom_cfg}",
            f"--storage.tsdb.path={data}",
            f"--web.listen-address={self.spec.host}:{self.spec.prometheus_port}",
        ]
        return Child("prometheus", argv, f"{self.prometheus_url}/-/ready", self.run_dir / "prometheus.log")

    def start(self) -> None:
        """Write the config and start every child (returns at once; then ``wait_ready``)."""
        self._check_ports()
        write_private(self.token_path, self.internal_token)
        self.config_path.write_text(self.engine_config().to_json())
        env = dict(os.environ, PYTHONSAFEPATH="1", PYTHONUNBUFFERED="1")
        for child in self._plan():
            child.log_file = open(child.log_path, "wb")  # noqa: SIM115 (closed in stop)
            child.proc = subprocess.Popen(
                child.argv,
                stdout=child.log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**env, **(child.env or {})},
                start_new_session=True,
            )
            self.children.append(child)

    def check(self) -> Child | None:
        """The first child that has exited, or None while all run."""
        for child in self.children:
            if child.proc is not None and child.proc.poll() is not None:
                return child
        return None

    def death(self, child: Child) -> StackError:
        """Who exited, with which code, and the error its log names last (a Python error's last
        line, or a line logged at ERROR); the log's last lines as the detail."""
        code = child.proc.returncode if child.proc is not None else None
        tail = child.log_tail()
        reason = next((ln.strip() for ln in reversed(tail.splitlines()) if _ERROR_LINE.search(ln)), "")
        said = f": {_ERROR_LINE.sub('', reason, count=1).strip()}" if reason else ""
        return StackError(f"{child.name} exited with code {code}{said} (log: {child.log_path})", f"its last lines:\n{tail}")

    def describe_death(self, child: Child) -> str:
        return str(self.death(child))

    def wait_ready(self, *, timeout_s: float = 120.0, poll_s: float = 0.25) -> None:
        deadline = time.monotonic() + timeout_s
        pending = [c for c in self.children if c.ready_url]
        while pending:
            dead = self.check()
            if dead is not None:
                raise self.death(dead)
            pending = [c for c in pending if not http_ok(c.ready_url or "")]
            if not pending:
                return
            if time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                raise StackError(f"not ready after {timeout_s:g} s: {names} (logs in {self.run_dir})")
            time.sleep(poll_s)

    # ------------------------------------------------------------------- stop
    def stop(self, *, grace_s: float = 10.0) -> None:
        """SIGTERM every child's process group, SIGKILL what is left after ``grace_s``."""
        # Gateway first (stop taking traffic), workers after.
        for child in reversed(self.children):
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in reversed(self.children):
            if child.proc is None:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            if child.proc.poll() is None:
                _signal_group(child, signal.SIGKILL)
                child.proc.wait(timeout=5.0)
            _signal_group(child, signal.SIGKILL)  # stragglers the child left in its group
            _wait_group_gone(child.proc.pid, GROUP_EXIT_S)
        for child in self.children:
            if child.log_file is not None:
                child.log_file.close()  # type: ignore[attr-defined]
                child.log_file = None
        self.children = []

    def close(self, *, keep_logs: bool = False) -> None:
        """Stop every child; remove the run dir made for this stack unless ``keep_logs`` (after a failure)."""
        self.stop()
        if self._tmp is not None and not keep_logs:
            shutil.rmtree(self._tmp, ignore_errors=True)
        elif self._tmp is not None:
            self.token_path.unlink(missing_ok=True)  # the logs stay; the credential of a stopped stack goes
        self._tmp = None

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def group_members(pgid: int) -> list[int]:
    """The live processes of group ``pgid`` (zombies and dying processes excluded), from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            out.append(int(entry.name))
    return out


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is alive (zombies and dying processes do not count)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not Path("/proc").is_dir():
        return True  # no way to tell zombies apart: a member exists
    return bool(group_members(pgid))


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.02)


def _signal_group(child: Child, sig: signal.Signals) -> None:
    if child.proc is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.proc.pid, sig)
