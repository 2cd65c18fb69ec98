"""The fault matrix on CPU: real processes (`kvserving gateway`, one prefill and
two decode `kvserving worker`s, NIXL on CPU memory, the built-in tiny model),
a fixed set of multi-turn agent conversations sent through the official
`openai` client (greedy, ``ignore_eos``, a fixed ``max_tokens``, one
``X-Session-ID`` per conversation), once fault-free for the reference replies,
then once per fault. Every request is classified:

- ``ok``: 200 and the reply equals the reference (text, ``finish_reason``
  ``length``, ``completion_tokens`` = ``max_tokens``);
- ``failed_clear``: an HTTP 4xx/5xx or an SSE error event whose body is an
  OpenAI error (``message``, ``type``, ``param``, ``code``);
- ``failed_unclear``: anything else that is not a reply (a transport error, a
  bare close, an error without that shape);
- ``silently_wrong``: 200 with a reply other than the reference (for a
  malformed request: any 200).

    PYTHONSAFEPATH=1 .venv/bin/python bench/faults_cpu.py [--quick] [--json bench/results/faults_cpu.json]
    PYTHONSAFEPATH=1 .venv/bin/python bench/faults_cpu.py --faults busy_lone_decode --json bench/results/faults_cpu.json --update

Faults (in this order; each run uses its own conversation ids):

- ``none``: fault-free again (the reference must repeat);
- ``malformed``: before every later turn, malformed requests (nested JSON, a
  lone surrogate, ``"stream": "yes"``, an unknown role): each must be a 4xx;
- ``attacker``: before every later turn, a caller without the internal
  credential calls every worker's ``/internal/*`` route (the victim's real lease
  ids in the path; no token and a guessed one; a generate among them whose
  ``agent_url`` names a listening trap); a caller with the credential sends
  that generate to the prefill worker, and a client sends the ``agent_url``
  through the gateway: every call without the credential must be a 401, the
  credentialed one a recompute (``unknown_peer``), nothing may connect to the
  trap, and the victim's turns stay ok;
- ``nixl_attacker``: before every later turn, an attacker with a NIXL agent
  of its own and no credential asks every worker for its agent metadata (must
  be 401), loads made-up metadata (NIXL must refuse it) and sets up a READ and
  a WRITE naming the victim's agent (must be refused: no metadata, no
  connection); the victim's turns stay ok;
- ``other_tenant``: after every victim turn, another tenant (``cache_salt``)
  sends the victim's exact messages: its ``cached_tokens`` must be 0;
- ``prefill_sigstop``: the prefill worker frozen for ``PREFILL_STOP_S`` while a
  later turn is sent;
- ``holder_sigstop``: the decode worker holding the conversation's lease
  frozen before its second turn, thawed after it (those turns' seconds beside
  the same turns without the fault, and their ratio: the issue asks for 2x at
  most); the conversations under a ``cache_salt`` of their own, so the
  prefill lacks turn 1's reply and pulls it from the frozen holder: the
  gateway's holder check (gateway/workers.py) ends that prefill at its verdict
  and sends it again without the lease. Then the prefill worker's part of a
  turn whose KV only the holder has, sent to the prefill directly, the holder
  alive and frozen (``reuse.peer_timeout_s`` bounds the frozen pull);
- ``holder_sigstop_warm``: as ``holder_sigstop``, but the prefill worker
  already holds every page of the turn (the same messages were sent once under
  another conversation id): it has nothing to pull, and the holder check's
  verdict, in during the prefill, sends the decode to the other worker, never
  to the frozen holder;
- ``gateway_sigterm``: the gateway SIGTERMed with long streams, a short one
  and a long request that is not streamed in flight (``gateway.drain_grace_s``
  = ``DRAIN_GRACE_S``): what finishes equals its reference, the rest ends with
  an error event (text so far a prefix of the reference) or a 503, never a
  bare close; the gateway is started again;
- ``busy_lone_decode``: one prefill and one decode worker (the other decode
  worker stopped), the decode worker's engine kept busy by ``LOAD_STREAMS``
  long generate requests sent to it directly (their KV about its pool) while
  the turns arrive: every turn must complete with the reference reply, waited
  for (the lone worker is not probed out; it sends keep-alives while it
  computes), not a 503 nor a deadline; how late the busy worker answers
  ``/health`` is recorded (the holder check's floor stands on it); the stopped
  worker is started again;
- ``decode_sigkill``: the decode worker holding the first conversation's lease
  killed between its turns (the rest of the run has one decode worker);
- ``transfer_timeout``: every worker restarted with
  ``reuse.transfer_timeout_s`` = 1 us (each KV READ misses its deadline);
- ``decode_pool_small``: every worker restarted, the decode workers with a KV
  pool of ``SMALL_POOL_BYTES`` (the prefill's is 16 MiB); the conversations run
  as before, and after every turn one prompt the prefill's pool holds but no
  decode worker's does, streamed and not: each must be a 400
  ``context_length_exceeded`` before any stream starts.

Writes one JSON record per fault (sent, ok, failed_clear, failed_unclear,
silently_wrong, fallback reasons seen in ``usage.kvserving.reuse_fallback``,
notes, the gateway's fallback / upstream-error / retry counters moved) and
prints a table. Exits 1 when a request was silently wrong, a malformed request
was not a clear 4xx, a worker call without the credential was answered, the
trap was contacted, another tenant saw cached tokens, NIXL accepted made-up
metadata or a transfer to an agent it has no metadata for, or the drained
gateway exited non-zero or past its grace.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from kvserving import jsonfmt
from kvserving.config import ServingConfig
from kvserving.gateway.tenants import DEFAULT_TENANT
from kvserving.local.stack import free_ports, new_token_file

MODEL = "kvserving-tiny"
MAX_TOKENS = 16
FIRST_BYTE_S = 4.0  # > the prefill's pull from a frozen holder (the workers' reuse.peer_timeout_s)
TRANSFER_TIMEOUT_S = 2.0  # reuse.transfer_timeout_s (the gateway's first-byte deadline must exceed it)
TINY_TIMEOUT_S = 1e-6  # shorter than any READ (bench/up_gpu.py's `timeout` mode)
PREFILL_STOP_S = 1.5
PROBE_PROMPT_TOKENS = 300
SMALL_POOL_BYTES = 2 << 20  # decode_pool_small: the decode workers' KV pool (512 tokens; the prefill's: 16 MiB, 4096)
FILLER = "the quick brown fox jumps over the lazy dog "  # ~18 tokens a repeat
DRAIN_GRACE_S = 1.0  # gateway.drain_grace_s: the long streams outlast it
LONG_TOKENS = 200
SHORT_TOKENS = 3  # a stream that ends within the grace
# busy_lone_decode: long requests sent to the decode worker at once, each a LOAD_PROMPT_TOKENS
# prompt and LOAD_TOKENS generated: 8 x 500 tokens of KV, about the decode pool (4096 tokens)
LOAD_STREAMS = 8
LOAD_PROMPT_TOKENS = 200
LOAD_TOKENS = 300
HEALTH_PROBES = 20  # /health calls to the busy worker before each turn (how late it answers)
READY_S = 180.0
SYSTEM = "You are a coding agent. Work step by step, use the tools, and report what you changed. "
CONVERSATIONS = [  # (system prompt repeats, user turns, streamed)
    (
        6,
        [
            "Find the failing test in the repository and explain it.",
            "Now look at the next file and report back.",
            "Write the fix and run the tests again.",
        ],
        False,
    ),
    (
        5,
        [
            "List the modules that import the config loader.",
            "Which of them read the retention setting?",
            "Summarise the change in one paragraph.",
        ],
        True,
    ),
    (
        7,
        [
            "Open the gateway log and find the slowest request.",
            "What did its worker do meanwhile?",
            "Propose one change that makes it faster.",
        ],
        False,
    ),
]
ALL_FAULTS = (
    "none",
    "malformed",
    "attacker",
    "nixl_attacker",
    "other_tenant",
    "prefill_sigstop",
    "holder_sigstop",
    "holder_sigstop_warm",
    "gateway_sigterm",
    "busy_lone_decode",
    "decode_sigkill",
    "transfer_timeout",
    "decode_pool_small",
)
QUICK_FAULTS = ("attacker", "nixl_attacker", "holder_sigstop")
CLASSES = ("ok", "failed_clear", "failed_unclear", "silently_wrong")


# ------------------------------------------------------------------ processes
@dataclass
class Proc:
    name: str
    url: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = dict(os.environ, PYTHONSAFEPATH="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def send(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """``sig`` (then SIGKILL after 20 s) to the process group; a frozen group is thawed first."""
        if self.proc is None:
            return
        self.send(signal.SIGCONT)
        self.send(sig)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.send(signal.SIGKILL)
            self.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything it left in its group

    def wait_ready(self, timeout: float = READY_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{tail(self.log_path)}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready in {timeout:.0f} s:\n{tail(self.log_path)}")


def tail(path: Path, n: int = 20) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    return "(no log)"


class Cluster:
    """One gateway, one prefill, two decode workers on loopback, one internal credential, one config."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.token = new_token_file(tmp / "internal-token")
        self.headers = {"Authorization": f"Bearer {self.token}"}
        ports = free_ports(4)
        self.gateway_url, prefill_url, *decode_urls = (f"http://127.0.0.1:{p}" for p in ports)
        self.prefill = self._worker("prefill", "prefill", prefill_url)
        self.decoders = [self._worker(f"decode-{i}", "decode", url) for i, url in enumerate(decode_urls)]
        self.gateway = Proc(
            "gateway",
            self.gateway_url,
            [
                sys.executable,
                "-m",
                "kvserving.cli",
                "gateway",
                "--config",
                str(tmp / "gateway.json"),
                "--host",
                "127.0.0.1",
                "--port",
                str(ports[0]),
            ],
            tmp / "gateway.log",
        )
        self.write_config("gateway.json", TRANSFER_TIMEOUT_S)

    def _worker(self, name: str, role: str, url: str) -> Proc:
        port = url.rsplit(":", 1)[1]
        argv = [
            sys.executable,
            "-m",
            "kvserving.cli",
            "worker",
            "--role",
            role,
            "--config",
            str(self.tmp / "worker.json"),
            "--host",
            "127.0.0.1",
            "--port",
            port,
        ]
        return Proc(name, url, argv, self.tmp / f"{name}.log")

    @property
    def workers(self) -> list[Proc]:
        return [self.prefill, *self.decoders]

    def write_config(self, name: str, transfer_timeout_s: float, *, memory_bytes: int = 16 << 20) -> None:
        config = {
            "model": {"max_model_len": 1024, "served_name": MODEL},  # path empty: the built-in tiny model
            "kv_cache": {"dtype": "bf16", "memory_bytes": memory_bytes},
            "reuse": {"recompute_threshold_tokens": 0, "transfer_timeout_s": transfer_timeout_s},
            "security": {"internal_token_file": str(self.tmp / "internal-token")},
            "gateway": {
                "prefill_urls": [self.prefill.url],
                "decode_urls": [d.url for d in self.decoders],
                "first_byte_timeout_s": FIRST_BYTE_S,
                "event_timeout_s": FIRST_BYTE_S,
                "health_interval_s": 1.0,
                "drain_grace_s": DRAIN_GRACE_S,
            },
        }
        (self.tmp / name).write_text(json.dumps(config))

    def start_workers(self, transfer_timeout_s: float, *, decode_memory_bytes: int | None = None) -> None:
        self.write_config("worker.json", transfer_timeout_s)
        decode_config = self.tmp / "worker.json"
        if decode_memory_bytes is not None:
            self.write_config("worker-decode.json", transfer_timeout_s, memory_bytes=decode_memory_bytes)
            decode_config = self.tmp / "worker-decode.json"
        for d in self.decoders:
            d.argv[d.argv.index("--config") + 1] = str(decode_config)
        for w in self.workers:
            w.start()
        for w in self.workers:
            w.wait_ready()

    def start(self) -> None:
        self.start_workers(TRANSFER_TIMEOUT_S)
        self.gateway.start()
        self.gateway.wait_ready()

    def restart_workers(self, transfer_timeout_s: float, *, decode_memory_bytes: int | None = None) -> None:
        for w in self.workers:
            w.stop()
        self.start_workers(transfer_timeout_s, decode_memory_bytes=decode_memory_bytes)
        self.all_healthy()

    def all_healthy(self, timeout: float = 60.0) -> None:
        """Every worker answers /ready and the gateway routes to every worker again."""
        for w in self.workers:
            w.wait_ready()
        deadline = time.monotonic() + timeout
        while (
            gauge(self.gateway_url, "kvserving_gateway_workers_healthy", role="decode") != 2
            or gauge(self.gateway_url, "kvserving_gateway_workers_healthy", role="prefill") != 1
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("a decode worker did not come back into the gateway's rotation")
            time.sleep(0.2)

    def close(self) -> None:
        for p in (self.gateway, *self.workers):
            try:
                p.stop()
            except Exception as exc:  # noqa: BLE001 - the others are stopped all the same
                print(f"stopping {p.name}: {exc!r}", file=sys.stderr)
                p.send(signal.SIGKILL)


def gauge(url: str, name: str, *, timeout: float = 10.0, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=timeout).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


GATEWAY_COUNTERS = (
    "kvserving_gateway_reuse_fallbacks_total",
    "kvserving_gateway_upstream_errors_total",
    "kvserving_gateway_routing_decisions_total",
)


def gateway_counters(url: str) -> dict[str, float]:
    """The gateway's fallback, upstream error and retry counters, one entry per series."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in GATEWAY_COUNTERS and (s.name != GATEWAY_COUNTERS[2] or s.labels.get("role") == "retry"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name.removeprefix('kvserving_gateway_').removesuffix('_total')}{{{labels}}}"] = s.value
    return out


def served(worker: Proc) -> float:
    """Requests the worker has finished (0 when it does not answer: killed or frozen)."""
    try:
        return gauge(worker.url, "kvserving_worker_requests_total", timeout=2.0)
    except httpx.TransportError:
        return 0.0


# ------------------------------------------------------------------ requests
@dataclass
class Result:
    kind: str  # one of CLASSES
    text: str = ""
    fallback: str | None = None
    cached_tokens: int | None = None
    detail: str = ""
    seconds: float = 0.0  # the request, sent to answered (set by Matrix.run)


def openai_shaped(body: object) -> bool:
    return (
        isinstance(body, dict)
        and isinstance(body.get("message"), str)
        and isinstance(body.get("type"), str)
        and "code" in body
        and "param" in body
    )


def ask(
    client: openai.OpenAI,
    messages: list[dict[str, Any]],
    conversation_id: str,
    *,
    stream: bool,
    salt: str | None = None,
    reference: str | None = None,
    max_tokens: int = MAX_TOKENS,
    started: threading.Event | None = None,
) -> Result:
    """One request through the openai client, classified against ``reference``. ``started`` is
    set once a streamed reply's first chunk has arrived. A stream that ends with an error event
    keeps the text streamed before it (``Result.text``); one that ends with neither a
    finish_reason nor an error event was cut bare (``failed_unclear``)."""
    extra: dict[str, Any] = {"ignore_eos": True}
    if salt is not None:
        extra["cache_salt"] = salt
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "extra_headers": {"X-Session-ID": conversation_id},
        "extra_body": extra,
    }
    text: list[str] = []
    try:
        if stream:
            finish, usage = None, None
            for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
                if started is not None:
                    started.set()
                for choice in chunk.choices:
                    text.append(choice.delta.content or "")
                    finish = choice.finish_reason or finish
                usage = chunk.usage or usage
            reply = "".join(text)
            if finish is None:
                return Result("failed_unclear", reply, detail="stream ended without a finish_reason or an error event")
        else:
            out = client.chat.completions.create(**kw)
            reply, finish, usage = out.choices[0].message.content or "", out.choices[0].finish_reason, out.usage
    except openai.APIStatusError as exc:  # an HTTP 4xx/5xx
        kind = "failed_clear" if openai_shaped(exc.body) else "failed_unclear"
        return Result(kind, detail=f"{exc.status_code} {getattr(exc, 'code', None)}")
    except (openai.APIConnectionError, openai.APITimeoutError) as exc:
        return Result("failed_unclear", detail=type(exc).__name__)
    except openai.APIError as exc:  # an SSE error event
        kind = "failed_clear" if openai_shaped(exc.body) else "failed_unclear"
        return Result(kind, "".join(text), detail=f"error event {getattr(exc, 'code', None)}")
    extra_usage = (usage.model_dump().get("kvserving") or {}) if usage is not None else {}
    details = usage.prompt_tokens_details if usage is not None else None
    cached = details.cached_tokens if details is not None else None
    whole = usage is not None and usage.completion_tokens == max_tokens and finish == "length"
    kind = "ok" if whole and (reference is None or reply == reference) else "silently_wrong"
    return Result(kind, reply, extra_usage.get("reuse_fallback"), cached, "" if kind == "ok" else f"finish {finish}, usage {usage}")


def raw_post(url: str, body: bytes) -> tuple[int, object]:
    r = httpx.post(url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
    try:
        return r.status_code, r.json().get("error")
    except ValueError:
        return r.status_code, None


def malformed_bodies() -> dict[str, bytes]:
    def nested(depth: int) -> Any:
        value: Any = "x"
        for _ in range(depth):
            value = [value]
        return value

    base: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return {
        "nested_json": json.dumps({**base, "metadata": {"deep": nested(200)}}).encode(),
        "lone_surrogate": json.dumps({**base, "messages": [{"role": "user", "content": "a\ud800b"}]}).encode(),
        "stream_yes": json.dumps({**base, "stream": "yes"}).encode(),
        "unknown_role": json.dumps({**base, "messages": [{"role": "root", "content": "hi"}]}).encode(),
    }


def worker_generate(url: str, headers: dict[str, str], body: dict[str, Any]) -> tuple[list[int], dict[str, Any]] | str:
    """POST a worker's /internal/generate: the streamed token ids and the final event, or "error ..."."""
    tokens: list[int] = []
    final: dict[str, Any] = {}
    with httpx.stream("POST", url + "/internal/generate", json=body, headers=headers, timeout=60) as r:
        if r.status_code != 200:
            return f"error {r.status_code}"
        for line in r.iter_lines():
            data = line.removeprefix("data: ")
            if not line or line.startswith(":") or data == "[DONE]":
                continue
            event = json.loads(data)
            if "error" in event:
                return f"error {event['error'].get('code')}"
            tokens += event.get("token_ids", [])
            if "finish_reason" in event:
                final = event
    return tokens, final


def peer_generate(url: str, headers: dict[str, str], body: dict[str, Any]) -> str | None:
    """POST a worker's /internal/generate; the final event's ``usage.reuse_fallback`` ("error ..." on a failure)."""
    got = worker_generate(url, headers, body)
    return got if isinstance(got, str) else (got[1].get("usage") or {}).get("reuse_fallback")


class Trap:
    """A listening socket that records every connection made to it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


# ------------------------------------------------------------------ faults
@dataclass
class Run:
    fault: str
    results: list[Result] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)  # security expectations broken (exit 1)
    extra: dict[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        counts = Counter(r.kind for r in self.results)
        fallbacks = Counter(r.fallback for r in self.results if r.fallback)
        wrong = [r.detail for r in self.results if r.kind != "ok" and r.detail]
        return {
            "fault": self.fault,
            "sent": len(self.results),
            **{k: counts.get(k, 0) for k in CLASSES},
            "fallback_reasons": dict(sorted(fallbacks.items())),
            "violations": self.violations,
            "notes": self.notes + ([f"not ok: {sorted(set(wrong))}"] if wrong else []),
            **self.extra,
        }


Hook = Callable[[int, int], None]  # (conversation, turn)


class Matrix:
    def __init__(self, cluster: Cluster, conversations: list[tuple[int, list[str], bool]]) -> None:
        self.c = cluster
        self.conversations = conversations
        self.client = openai.OpenAI(base_url=cluster.gateway_url + "/v1", api_key="none", max_retries=0, timeout=120)
        self.reference: list[list[str]] = []
        self.last_decoder: dict[int, Proc] = {}  # conversation -> the decode worker that served its last turn
        self.turn_seconds: dict[str, list[list[float]]] = {}  # run -> conversation -> seconds per turn
        self.counter = 0

    def history(self, conv: int, turn: int) -> list[dict[str, Any]]:
        """The messages of a turn: the fixed user turns and the reference replies before it."""
        repeats, users, _ = self.conversations[conv]
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM * repeats}]
        for t in range(turn):
            messages += [{"role": "user", "content": users[t]}, {"role": "assistant", "content": self.reference[conv][t]}]
        return [*messages, {"role": "user", "content": users[turn]}]

    def conversation_id(self, fault: str, conv: int) -> str:
        return f"{fault}-c{conv}"

    def run(self, fault: str, *, before: Hook | None = None, after: Hook | None = None, salt: str | None = None) -> Run:
        run = Run(fault)
        for conv, (_, users, stream) in enumerate(self.conversations):
            for turn in range(len(users)):
                counts = [served(d) for d in self.c.decoders]  # (before a hook freezes one)
                if before is not None:
                    before(conv, turn)
                building = len(self.reference[conv]) == turn  # the reference run: replies become the history
                ref = None if building else self.reference[conv][turn]
                t0 = time.monotonic()
                result = ask(
                    self.client, self.history(conv, turn), self.conversation_id(fault, conv), stream=stream, reference=ref, salt=salt
                )
                result.seconds = round(time.monotonic() - t0, 2)
                run.results.append(result)
                if building:
                    self.reference[conv].append(result.text)
                self.turn_seconds.setdefault(fault, [[] for _ in self.conversations])[conv].append(result.seconds)
                if after is not None:
                    after(conv, turn)
                moved = [d for d, n in zip(self.c.decoders, counts, strict=True) if served(d) > n]
                if moved:
                    self.last_decoder[conv] = moved[0]
        return run

    def reference_run(self) -> None:
        self.reference = [[] for _ in self.conversations]
        run = self.run("reference")
        bad = [r for r in run.results if r.kind != "ok"]
        if bad:
            raise RuntimeError(f"the fault-free reference run failed: {[r.detail for r in bad]}")

    def holder(self, fault: str, conv: int) -> Proc:
        """The decode worker holding the conversation's longest lease (its last turn's), from the
        workers' lease tables; the worker that served its last turn when none lists one."""
        key = DEFAULT_TENANT.scope(f"session:{self.conversation_id(fault, conv)}")
        best: tuple[int, Proc] | None = None
        for d in self.c.decoders:
            with contextlib.suppress(httpx.TransportError, ValueError, KeyError):
                leases = httpx.get(
                    d.url + "/internal/kv/leases", params={"conversation_key": key}, headers=self.c.headers, timeout=10
                ).json()["leases"]
                for le in leases:
                    if best is None or le["num_tokens"] > best[0]:
                        best = (le["num_tokens"], d)
        return best[1] if best is not None else self.last_decoder[conv]

    # ---- one method per fault
    def none(self) -> Run:
        return self.run("none")

    def malformed(self) -> Run:
        bodies = malformed_bodies()
        extra: list[Result] = []

        def before(conv: int, turn: int) -> None:
            if turn == 0:
                return
            for name, body in bodies.items():
                status, error = raw_post(self.c.gateway_url, body)
                if 400 <= status < 500 and openai_shaped(error):
                    extra.append(Result("failed_clear", detail=f"{name}: {status} {error['code']}"))  # type: ignore[index]
                elif status == 200:
                    extra.append(Result("silently_wrong", detail=f"{name}: 200"))
                else:
                    extra.append(Result("failed_unclear", detail=f"{name}: {status} {error}"))

        run = self.run("malformed", before=before)
        victim = Counter(r.kind for r in run.results)
        run.results += extra
        run.notes.append(
            f"victim turns {dict(victim)}; malformed requests {len(extra)} "
            f"({', '.join(bodies)} before each later turn), each expected failed_clear (a 4xx)"
        )
        run.extra["expected"] = "victim turns ok, every malformed request failed_clear with a 4xx"
        if any(r.kind != "failed_clear" for r in extra):
            run.violations.append("a malformed request was not a clear 4xx")
        return run

    def attacker(self) -> Run:
        trap = Trap()
        probes = Counter[str]()
        answered: list[str] = []
        gateway_codes = Counter[int]()
        insider: list[str | None] = []

        def before(conv: int, turn: int) -> None:
            if turn == 0:
                return
            key = DEFAULT_TENANT.scope(f"session:{self.conversation_id('attacker', conv)}")
            lease_ids = []
            for w in self.c.decoders:  # the victim's real lease ids (the attacker cannot list them; it is given them)
                with contextlib.suppress(httpx.TransportError, ValueError, KeyError):
                    leases = httpx.get(
                        w.url + "/internal/kv/leases", params={"conversation_key": key}, headers=self.c.headers, timeout=10
                    ).json()["leases"]
                    lease_ids += [le["lease_id"] for le in leases]
            lid = lease_ids[0] if lease_ids else "unknown"
            evil = {
                "request_id": f"evil-{conv}",
                "input_ids": [5, 6, 7],
                "conversation_key": key,
                "retain": True,
                "sampling": {"max_tokens": 2, "ignore_eos": True},
                "kv_transfer_params": {"agent_url": trap.url, "engine_id": "evil", "lease_id": lid},
            }
            calls: list[tuple[str, str, dict[str, Any] | None]] = [
                ("GET", "/internal/kv/leases", None),
                ("GET", "/internal/kv/agent", None),
                ("GET", "/internal/kv/stats", None),
                ("POST", f"/internal/kv/leases/{lid}/hold", {"digest": "0" * 32, "hold_s": 120}),
                ("POST", f"/internal/kv/leases/{lid}/renew", {"ttl_s": 1}),
                ("DELETE", f"/internal/kv/leases/{lid}", None),
                ("POST", "/internal/generate", evil),
            ]
            for w in self.c.workers:
                for method, path, body in calls:
                    for headers in ({}, {"Authorization": "Bearer guessed"}):
                        r = httpx.request(method, w.url + path, json=body, headers=headers, timeout=10)
                        probes[f"{method} {path.split('/leases/')[0] + ('/leases/{id}' if '/leases/' in path else '')}"] += 1
                        if r.status_code != 401:
                            answered.append(f"{w.name} {method} {path}: {r.status_code}")
            # a caller with the credential (past the gateway) naming the trap: recomputed, nothing contacted
            insider.append(
                peer_generate(
                    self.c.prefill.url,
                    self.c.headers,
                    {
                        "request_id": f"insider-{conv}",
                        "input_ids": [5, 6, 7, 8],
                        "sampling": {"max_tokens": 2, "ignore_eos": True},
                        "kv_transfer_params": {
                            "engine_id": "evil",
                            "agent_url": trap.url,
                            "lease_id": lid,
                            "page_ids": [0],
                            "page_hashes": [1],
                            "num_tokens": 16,
                            "page_size": 16,
                            "dtype": "bf16",
                            "layout_hash": "0" * 16,
                            "expires_at": time.time() + 60,
                        },
                    },
                )
            )
            # through the gateway: a client naming the trap as the KV source (an unknown field: ignored)
            r = httpx.post(
                self.c.gateway_url + "/v1/chat/completions",
                timeout=60,
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                    "kv_transfer_params": {"agent_url": trap.url, "lease_id": lid},
                    "conversation_key": key,
                    "retain": True,
                },
            )
            gateway_codes[r.status_code] += 1

        try:
            run = self.run("attacker", before=before)
            time.sleep(0.5)  # a connection the trap would get arrives now at the latest
        finally:
            trap.close()
        run.extra["probes"] = {
            "worker_calls_without_credential": sum(probes.values()),
            "answered_not_401": len(answered),
            "trap_connections": trap.connections,
            "gateway_requests_naming_the_trap": dict(gateway_codes),
            "credentialed_generates_naming_the_trap": insider,
        }
        run.notes.append(f"a credentialed worker generate naming the trap as agent_url, before each later turn: reuse_fallback {insider}")
        if any(f != "unknown_peer" for f in insider):
            run.violations.append(f"a generate naming a foreign agent_url was not refused as unknown_peer: {insider}")
        run.notes.append(
            f"every /internal route of 3 workers, no token and a guessed one, before each later turn: "
            f"{sum(probes.values())} calls, {len(answered)} not 401; trap connections {trap.connections}"
        )
        if answered:
            run.violations.append(f"answered without the credential: {answered[:5]}")
        if trap.connections:
            run.violations.append(f"the trap was contacted {trap.connections} times")
        return run

    def nixl_attacker(self) -> Run:
        """Before every later turn, an attacker on the worker network with a NIXL agent of its own
        and no credential goes for the victim's KV pool itself: the metadata a NIXL connection
        needs (401), made-up metadata (NIXL refuses to load it), a READ and a WRITE naming the
        victim's agent (its engine id is public on /health; the generation part of the agent name
        is random): nothing may be loaded or started, and the victim's turns stay ok."""
        from kvserving.worker.kv.nixl_io import import_nixl

        api = import_nixl()
        if isinstance(getattr(api, "logger", None), logging.Logger):
            api.logger.setLevel(logging.WARNING)  # its INFO lines go to stdout, where the table goes
        agent = api.nixl_agent("attacker", api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"]))
        loot = bytearray(1 << 16)  # where a READ would land, what a WRITE would send
        base = ctypes.addressof((ctypes.c_char * len(loot)).from_buffer(loot))
        agent.register_memory([(base, len(loot), 0, "")], "DRAM")
        own = bytes(agent.get_agent_metadata())
        probes: Counter[str] = Counter()
        violations: list[str] = []

        def before(conv: int, turn: int) -> None:
            if turn == 0:
                return
            for w in self.c.workers:
                r = httpx.get(w.url + "/internal/kv/agent", timeout=10)
                probes["agent_metadata_without_credential"] += 1
                if r.status_code != 401 or "metadata" in r.text:
                    violations.append(f"{w.name} /internal/kv/agent answered {r.status_code} without the credential")
                for made_up in (os.urandom(len(own)), own[: len(own) // 2], b""):
                    probes["made_up_metadata"] += 1
                    try:
                        name = agent.add_remote_agent(made_up)
                    except Exception:  # noqa: BLE001 - NIXL refuses it: the expected outcome
                        probes["made_up_metadata_refused"] += 1
                    else:
                        violations.append(f"NIXL loaded made-up metadata as agent {name!r}")
                engine_id = httpx.get(w.url + "/health", timeout=10).json()["engine_id"]
                victim = f"{engine_id}-{secrets.randbits(48):x}"
                local = agent.get_xfer_descs([(base, 4096, 0)], "DRAM")
                remote = agent.get_xfer_descs([(base, 4096, 0)], "DRAM")  # any address: the agent is what gates it
                for op in ("READ", "WRITE"):
                    probes["transfers_naming_the_victims_agent"] += 1
                    try:
                        agent.initialize_xfer(op, local, remote, victim)
                    except Exception:  # noqa: BLE001 - no metadata for that agent: refused before any connection
                        probes["transfers_refused"] += 1
                    else:
                        violations.append(f"a NIXL {op} naming {victim!r} was set up without its metadata")

        run = self.run("nixl_attacker", before=before)
        run.extra["probes"] = dict(probes)
        run.violations += violations
        run.notes.append(f"NIXL-level attacker without the credential before every later turn: {dict(probes)}")
        return run

    def other_tenant(self) -> Run:
        intruder: list[Result] = []
        repeat: list[Result] = []

        def after(conv: int, turn: int) -> None:
            # a new tenant per prompt: what it finds cached can only be another tenant's pages
            _, _, stream = self.conversations[conv]
            salt, ref = f"intruder-c{conv}-t{turn}", self.reference[conv][turn]
            intruder.append(ask(self.client, self.history(conv, turn), salt, stream=stream, salt=salt, reference=ref))
            # the same prompt again from that tenant: its own pages are found (the probe can see a cache hit)
            repeat.append(ask(self.client, self.history(conv, turn), salt + "-again", stream=stream, salt=salt, reference=ref))

        run = self.run("other_tenant", after=after)
        cached = [r.cached_tokens for r in intruder]
        run.results += intruder + repeat
        run.extra["intruder_cached_tokens"] = cached
        run.extra["intruder_repeat_cached_tokens"] = [r.cached_tokens for r in repeat]
        run.notes.append(
            f"a new tenant (cache_salt) sent each of the victim's {len(intruder)} prompts right after it: "
            f"cached_tokens {cached} (must be 0); the same tenant repeating it: "
            f"{[r.cached_tokens for r in repeat]}"
        )
        if any(c != 0 for c in cached):
            run.violations.append(f"another tenant saw cached tokens: {cached}")
        return run

    def prefill_sigstop(self) -> Run:
        stops = 0

        def before(conv: int, turn: int) -> None:
            nonlocal stops
            if turn != 1:
                return
            self.c.prefill.send(signal.SIGSTOP)
            threading.Timer(PREFILL_STOP_S, self.c.prefill.send, args=(signal.SIGCONT,)).start()
            stops += 1

        def after(conv: int, turn: int) -> None:
            if turn == 1:
                self.c.prefill.send(signal.SIGCONT)
                self.c.all_healthy()

        run = self.run("prefill_sigstop", before=before, after=after)
        run.notes.append(f"prefill frozen {PREFILL_STOP_S} s as turn 2 of each conversation was sent ({stops} times)")
        return run

    def _holder_frozen_at_turn_2(self, name: str, *, warm_up: Callable[[int, int], None] | None = None, salt: str | None = None) -> Run:
        """Run ``name`` with each conversation's lease holder SIGSTOPped just before its turn 2
        (after ``warm_up(conv, turn)``, when given) and continued once that turn ended; the run's
        extra holds those turns' seconds and the same turns' seconds without the fault."""
        frozen: list[Proc] = []
        seconds: list[float] = []
        t0 = 0.0

        def before(conv: int, turn: int) -> None:
            nonlocal t0
            if turn == 1:
                self.c.all_healthy()
                if warm_up is not None:
                    warm_up(conv, turn)
                holder = self.holder(name, conv)
                holder.send(signal.SIGSTOP)
                frozen.append(holder)
                t0 = time.monotonic()

        def after(conv: int, turn: int) -> None:
            if turn == 1:
                seconds.append(round(time.monotonic() - t0, 2))
                frozen[-1].send(signal.SIGCONT)

        try:
            run = self.run(name, before=before, after=after, salt=salt)
        finally:
            for p in frozen:
                p.send(signal.SIGCONT)
        # the same turns without a fault: cold (a salt of its own) -> the reference run's, the first
        # with these prompts; else the "none" run's when it ran (the same prompts, caches as warm)
        normal = (None if salt is not None else self.turn_seconds.get("none")) or self.turn_seconds["reference"]
        run.extra["frozen_turn_s"] = seconds
        run.extra["normal_turn_s"] = [normal[conv][1] for conv in range(len(self.conversations))]
        run.extra["frozen_over_normal"] = [round(f / n, 2) for f, n in zip(seconds, run.extra["normal_turn_s"], strict=True)]
        return run

    def holder_sigstop(self) -> Run:
        before_fb = gauge(self.c.gateway_url, "kvserving_gateway_reuse_fallbacks_total", reason="holder_unresponsive")
        run = self._holder_frozen_at_turn_2("holder_sigstop", salt="holder_sigstop")  # a cold cache: the prefill pulls
        moved = gauge(self.c.gateway_url, "kvserving_gateway_reuse_fallbacks_total", reason="holder_unresponsive") - before_fb
        run.extra["gateway_holder_unresponsive"] = int(moved)
        run.extra["frozen_turn_fallbacks"] = [
            run.results[sum(len(u) for _, u, _ in self.conversations[:conv]) + 1].fallback for conv in range(len(self.conversations))
        ]
        seconds = run.extra["frozen_turn_s"]
        run.notes.append(
            f"lease holder frozen before turn 2 of each conversation ({len(seconds)} times), the prefill pulling from it; "
            f"those turns took {seconds} s (without the fault, cold as they: {run.extra['normal_turn_s']} s; "
            f"ratio {run.extra['frozen_over_normal']}); gateway holder_unresponsive +{int(moved)}"
        )
        self.c.all_healthy()
        # The prefill's own bound: a turn whose KV only the (frozen) holder has
        pulls = [self.prefill_pull(self.c.decoders[0], freeze=f, seed=n) for n, f in enumerate((False, True, False, True))]
        run.extra["prefill_pull_from_holder"] = pulls
        run.notes.append(
            "prefill's part of a turn whose KV only the holder has, s: alive "
            f"{[p['seconds'] for p in pulls if not p['frozen']]}, frozen {[p['seconds'] for p in pulls if p['frozen']]} "
            f"(reuse.peer_timeout_s {ServingConfig().reuse.peer_timeout_s})"
        )
        if any(p["tokens"] != pulls[0]["tokens"] or p["fallback"] != ("remote_unreachable" if p["frozen"] else None) for p in pulls):
            run.violations.append(f"a pull from a frozen holder did not recompute the alive run's token: {pulls}")
        self.c.all_healthy()
        return run

    def holder_sigstop_warm(self) -> Run:
        warm: list[Result] = []

        def warm_up(conv: int, turn: int) -> None:
            # the prefill computes (and caches) this very turn's prompt: it will have nothing to pull
            warm.append(
                ask(
                    self.client,
                    self.history(conv, turn),
                    f"holder_sigstop_warm-w{conv}",
                    stream=False,
                    reference=self.reference[conv][turn],
                )
            )

        counters = gateway_counters(self.c.gateway_url)
        run = self._holder_frozen_at_turn_2("holder_sigstop_warm", warm_up=warm_up)
        moved = {k: int(v - counters.get(k, 0.0)) for k, v in gateway_counters(self.c.gateway_url).items()}
        seconds = run.extra["frozen_turn_s"]
        run.extra["warm_up_requests"] = dict(Counter(r.kind for r in warm))
        run.notes.append(
            f"the prefill warmed with each turn 2's messages, then the lease holder frozen before it "
            f"({len(seconds)} times); those turns took {seconds} s (without the fault: "
            f"{run.extra['normal_turn_s']} s; ratio {run.extra['frozen_over_normal']}); gateway upstream errors unresponsive "
            f"+{moved.get('upstream_errors{kind=unresponsive}', 0)}, holder_unresponsive "
            f"+{moved.get('reuse_fallbacks{reason=holder_unresponsive}', 0)}"
        )
        if any(r.kind != "ok" for r in warm):
            run.violations.append(f"a warm-up request was not ok: {[r.detail for r in warm]}")
        self.c.all_healthy()
        return run

    def decode_pool_small(self) -> Run:
        self.c.restart_workers(TRANSFER_TIMEOUT_S, decode_memory_bytes=SMALL_POOL_BYTES)
        decode_tokens = min(int(httpx.get(d.url + "/ready", timeout=10).json()["kv_capacity_tokens"]) for d in self.c.decoders)
        prefill_tokens = int(httpx.get(self.c.prefill.url + "/ready", timeout=10).json()["kv_capacity_tokens"])
        words = FILLER * ((decode_tokens + 40) // 18 + 1)  # a few dozen tokens over the decode pool
        extra: list[Result] = []

        def after(conv: int, turn: int) -> None:
            for stream in (False, True):
                got = ask(self.client, [{"role": "user", "content": words}], f"decode_pool_small-big{conv}-{turn}", stream=stream)
                # a 400 before the stream (ask saw an HTTP status, not an error event) is the expected refusal
                if got.kind == "failed_clear" and got.detail == "400 context_length_exceeded":
                    extra.append(got)
                else:
                    extra.append(got if got.kind != "failed_clear" else Result("failed_unclear", detail=got.detail))

        run = self.run("decode_pool_small", before=None, after=after)
        victim = Counter(r.kind for r in run.results)
        run.results += extra
        run.extra["decode_kv_capacity_tokens"] = decode_tokens
        run.extra["prefill_kv_capacity_tokens"] = prefill_tokens
        run.notes.append(
            f"decode pools {decode_tokens} tokens, the prefill's {prefill_tokens}; victim turns {dict(victim)}; "
            f"{len(extra)} prompts over the decode pools ({len(words.split())} words), half streamed, "
            "each expected 400 context_length_exceeded before any stream"
        )
        if any(r.detail != "400 context_length_exceeded" for r in extra):
            run.violations.append(f"a prompt over the decode pools was not a 400 before the stream: {[r.detail for r in extra]}")
        return run

    def prefill_pull(self, holder: Proc, *, freeze: bool, seed: int) -> dict[str, Any]:
        """The prefill worker's part of a turn whose KV only ``holder`` has (what the gateway sends
        when its prefill lacks the prefix): the holder computes and retains a prompt the prefill
        never saw, then the prefill gets the next turn with the holder's ``kv_transfer_params``,
        the holder frozen or not. Every probe sends the same tokens under its own ``cache_salt``
        (nothing cached from another probe is reused): the prefill's token is the same each time."""
        head = [(i * 37) % 3500 + 300 for i in range(PROBE_PROMPT_TOKENS)]
        body = {"sampling": {"max_tokens": 8, "ignore_eos": True}, "conversation_key": f"probe-{seed}", "cache_salt": f"probe-{seed}"}
        got = worker_generate(holder.url, self.c.headers, {**body, "request_id": f"probe-{seed}-d", "input_ids": head, "retain": True})
        if isinstance(got, str):
            raise RuntimeError(f"the holder's turn failed: {got}")
        reply, final = got
        nxt = [*head, *reply, *((i * 11) % 3500 + 300 for i in range(24))]
        if freeze:
            holder.send(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            got = worker_generate(
                self.c.prefill.url,
                self.c.headers,
                {
                    **body,
                    "request_id": f"probe-{seed}-p",
                    "input_ids": nxt,
                    "sampling": {"max_tokens": 1, "ignore_eos": True},
                    "kv_transfer_params": final["kv_transfer_params"],
                },
            )
            seconds = time.monotonic() - t0
        finally:
            if freeze:
                holder.send(signal.SIGCONT)
        if isinstance(got, str):
            raise RuntimeError(f"the prefill's turn failed: {got}")
        tokens, pf = got
        return {
            "frozen": freeze,
            "seconds": round(seconds, 2),
            "tokens": tokens,
            "fallback": pf["usage"]["reuse_fallback"],
            "pulled_tokens": pf["usage"]["remote_pulled_tokens"],
        }

    def gateway_sigterm(self) -> Run:
        """The gateway SIGTERMed with streams in flight: one long stream per conversation (
        ``LONG_TOKENS``), a short one and a long request that is not streamed. Each is sent once
        without the fault (all at once, as in the drain: the references), then again and the
        gateway gets SIGTERM once every stream has streamed its first chunk. What finishes within
        ``DRAIN_GRACE_S`` must equal its reference; the rest must end with an error event (a
        stream, its text so far a prefix of the reference) or an OpenAI-shaped 503 (the request
        not streamed): never a bare close, never other text. The gateway is started again after."""
        jobs = [(conv, 0, LONG_TOKENS, True) for conv in range(len(self.conversations))]
        jobs += [(len(self.conversations) - 1, 0, LONG_TOKENS, False), (0, 1, SHORT_TOKENS, True)]

        def send(tag: str, refs: list[str] | None) -> tuple[list[Result], list[float], float]:
            results: list[Result | None] = [None] * len(jobs)
            ended = [0.0] * len(jobs)
            started = [threading.Event() for _ in jobs]

            def one(i: int) -> None:
                conv, turn, max_tokens, stream = jobs[i]
                results[i] = ask(
                    self.client,
                    self.history(conv, turn),
                    f"gateway_sigterm-{tag}-{i}",
                    stream=stream,
                    reference=refs[i] if refs else None,
                    max_tokens=max_tokens,
                    started=started[i],
                )
                ended[i] = time.monotonic()

            threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(jobs))]
            for t in threads:
                t.start()
            t_term = 0.0
            if refs is not None:
                for i, (_, _, _, stream) in enumerate(jobs):
                    if stream and not started[i].wait(120):
                        raise RuntimeError("a stream did not start before the gateway's SIGTERM")
                t_term = time.monotonic()
                self.c.gateway.send(signal.SIGTERM)
            for t in threads:
                t.join(300)
            done = [r for r in results if r is not None]
            if len(done) != len(jobs):
                raise RuntimeError("a request of the drain fault did not return")
            return done, [round(e - t_term, 2) for e in ended], t_term

        fault_free, _, _ = send("reference", None)
        if any(r.kind != "ok" for r in fault_free):
            raise RuntimeError(f"the drain fault's references failed: {[r.detail for r in fault_free]}")
        refs = [r.text for r in fault_free]
        results, ended, _ = send("drain", refs)
        exit_code = self.c.gateway.proc.wait(timeout=DRAIN_GRACE_S + 30) if self.c.gateway.proc else None
        run = Run("gateway_sigterm")
        for (_, _, _, stream), result, ref in zip(jobs, results, refs, strict=True):
            if result.kind == "failed_clear" and stream and not ref.startswith(result.text):
                result.kind, result.detail = (
                    "silently_wrong",
                    f"streamed text before the error event is not the reference's: {result.detail}",
                )
            run.results.append(result)
        self.c.gateway.start()
        self.c.gateway.wait_ready()
        self.c.all_healthy()
        run.extra["ended_after_sigterm_s"] = ended
        run.extra["outcomes"] = [
            f"{'stream' if j[3] else 'whole'} {j[2]}: {r.kind} {r.detail}".strip() for j, r in zip(jobs, results, strict=True)
        ]
        run.extra["gateway_exit_code"] = exit_code
        if exit_code != 0:
            run.violations.append(f"the gateway exited {exit_code} after SIGTERM")
        late = [e for e in ended if e > DRAIN_GRACE_S + 5]
        if late:
            run.violations.append(f"requests ended {late} s after SIGTERM (grace {DRAIN_GRACE_S} s)")
        run.notes.append(
            f"gateway SIGTERM with {len(jobs)} requests in flight (grace {DRAIN_GRACE_S} s); ended "
            f"{ended} s after it; exit code {exit_code}; restarted"
        )
        return run

    def busy_lone_decode(self) -> Run:
        spare, busy = self.c.decoders[1], self.c.decoders[0]
        spare.stop()
        deadline = time.monotonic() + 30
        while gauge(self.c.gateway_url, "kvserving_gateway_workers_healthy", role="decode") != 1:  # the refusal takes it out
            if time.monotonic() > deadline:
                raise RuntimeError("the stopped decode worker did not leave the gateway's rotation")
            time.sleep(0.2)
        stop = threading.Event()
        load: list[str] = []  # each load request's outcome
        depth: list[tuple[float, float]] = []  # (running, waiting) on the busy worker before each turn

        def keep_busy(i: int) -> None:
            """Long requests to the busy worker, one after another, until ``stop`` (which closes
            the one in flight: the worker aborts it)."""
            n = 0
            while not stop.is_set():
                ids = [(i * 131 + n * 17 + k * 7) % 3500 + 300 for k in range(LOAD_PROMPT_TOKENS)]
                body = {"request_id": f"busy-{i}-{n}", "input_ids": ids, "sampling": {"max_tokens": LOAD_TOKENS, "ignore_eos": True}}
                outcome = "cut"  # closed at the end of the run
                try:
                    with httpx.stream("POST", busy.url + "/internal/generate", json=body, headers=self.c.headers, timeout=60) as r:
                        outcome = "refused" if r.status_code != 200 else outcome
                        for line in r.iter_lines():
                            if stop.is_set():
                                break
                            if line.startswith('data: {"error"'):
                                outcome = "error"
                            elif line == "data: [DONE]":
                                outcome = "ok"
                except httpx.HTTPError as exc:
                    outcome = f"error {type(exc).__name__}"
                load.append(outcome)
                n += 1

        health_s: list[float] = []  # the busy worker's /health answers (kept-alive connection)
        probe = httpx.Client(timeout=10)

        def before(conv: int, turn: int) -> None:
            depth.append(
                (
                    gauge(busy.url, "kvserving_worker_queue_depth", state="running"),
                    gauge(busy.url, "kvserving_worker_queue_depth", state="waiting"),
                )
            )
            for _ in range(HEALTH_PROBES):
                t0 = time.perf_counter()
                probe.get(busy.url + "/health")
                health_s.append(time.perf_counter() - t0)

        preempted = gauge(busy.url, "kvserving_worker_preemptions_total")
        refused = gauge(self.c.gateway_url, "kvserving_gateway_requests_total", code="503")
        threads = [threading.Thread(target=keep_busy, args=(i,), daemon=True) for i in range(LOAD_STREAMS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while sum(gauge(busy.url, "kvserving_worker_queue_depth", state=q) for q in ("running", "waiting")) < LOAD_STREAMS:
            if time.monotonic() > deadline:
                raise RuntimeError("the decode worker never took the load")
            time.sleep(0.1)
        try:
            run = self.run("busy_lone_decode", before=before)
            preempted = gauge(busy.url, "kvserving_worker_preemptions_total") - preempted
            refused = gauge(self.c.gateway_url, "kvserving_gateway_requests_total", code="503") - refused
        finally:
            probe.close()
            stop.set()
            for t in threads:
                t.join(timeout=120)
            spare.start()
            self.c.all_healthy()
        if refused:
            run.violations.append(f"the gateway answered {int(refused)} requests 503 while its lone decode worker was busy")
        normal = self.turn_seconds.get("none") or self.turn_seconds["reference"]
        run.extra["busy_turn_s"] = [r.seconds for r in run.results]
        run.extra["normal_turn_s"] = [s for conv in normal for s in conv]
        run.extra["busy_worker_running_waiting"] = depth
        run.extra["load_requests"] = dict(Counter(load))
        run.extra["busy_worker_preemptions"] = int(preempted)
        run.extra["gateway_503"] = int(refused)
        health_s.sort()
        run.extra["busy_worker_health_ms"] = {
            "probes": len(health_s),
            "p50": round(health_s[len(health_s) // 2] * 1e3, 1),
            "p99": round(health_s[int(len(health_s) * 0.99)] * 1e3, 1),
            "max": round(health_s[-1] * 1e3, 1),
        }
        run.notes.append(
            f"decode worker alone, {LOAD_STREAMS} requests of {LOAD_PROMPT_TOKENS}+{LOAD_TOKENS} tokens kept in flight on it "
            f"(running/waiting before each turn: {[(int(a), int(b)) for a, b in depth]}; {int(preempted)} preemptions); "
            f"turns took {run.extra['busy_turn_s']} s (without the load: {run.extra['normal_turn_s']} s); gateway 503s "
            f"{int(refused)}; load requests {run.extra['load_requests']} (cut: closed at the end of the run); "
            f"/health answered in {run.extra['busy_worker_health_ms']} ms (from this process, which reads the load "
            "streams on threads beside it: an upper bound)"
        )
        return run

    def decode_sigkill(self) -> Run:
        killed: list[str] = []

        def before(conv: int, turn: int) -> None:
            if conv == 0 and turn == 1:
                self.c.all_healthy()
                holder = self.holder("decode_sigkill", conv)
                holder.stop(signal.SIGKILL)
                killed.append(holder.name)

        run = self.run("decode_sigkill", before=before)
        run.notes.append(
            f"{killed} (the first conversation's lease holder) SIGKILLed before its turn 2; the rest of the run on the other decode worker"
        )
        return run

    def transfer_timeout(self) -> Run:
        self.c.restart_workers(TINY_TIMEOUT_S)
        run = self.run("transfer_timeout")
        run.notes.append(f"every worker restarted with reuse.transfer_timeout_s = {TINY_TIMEOUT_S:g}")
        run.notes.append(
            "a pull past its deadline moves that turn's decode to the other worker; only the health "
            "poll takes a worker out of the rotation, so slow pulls never leave a turn without a decode worker"
        )
        return run


def table(records: list[dict[str, Any]]) -> str:
    head = f"{'fault':<19} {'sent':>4} {'ok':>4} {'failed_clear':>12} {'failed_unclear':>14} {'silently_wrong':>14}  fallbacks"
    lines = [head, "-" * len(head)]
    for r in records:
        fb = ", ".join(f"{k} {v}" for k, v in r["fallback_reasons"].items()) or "-"
        lines.append(
            f"{r['fault']:<19} {r['sent']:>4} {r['ok']:>4} {r['failed_clear']:>12} {r['failed_unclear']:>14} "
            f"{r['silently_wrong']:>14}  {fb}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"one two-turn conversation and the faults {QUICK_FAULTS}")
    ap.add_argument("--faults", nargs="+", choices=ALL_FAULTS, help="the faults to run (default: all)")
    ap.add_argument("--json", type=Path, help="write the records here")
    ap.add_argument(
        "--update", action="store_true", help="with --json: replace the records of the faults run in that file, keep the others"
    )
    args = ap.parse_args(argv)
    if args.update and (args.json is None or not args.json.exists()):
        ap.error("--update needs an existing --json file")
    conversations = [(r, users[:2], s) for r, users, s in CONVERSATIONS[:1]] if args.quick else CONVERSATIONS
    faults = args.faults or (QUICK_FAULTS if args.quick else ALL_FAULTS)
    t_start = time.monotonic()
    # SIGTERM ends the run through the cleanup below, as Ctrl-C does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="kvserving-faults-") as tmp:
        cluster = Cluster(Path(tmp))
        records: list[dict[str, Any]] = []
        try:
            cluster.start()
            t_ready = time.monotonic() - t_start
            matrix = Matrix(cluster, conversations)
            matrix.reference_run()
            for fault in faults:
                t0 = time.monotonic()
                counters = gateway_counters(cluster.gateway_url)
                rec = getattr(matrix, fault)().record()
                rec["seconds"] = round(time.monotonic() - t0, 1)
                after = gateway_counters(cluster.gateway_url)
                if fault == "gateway_sigterm":  # a new gateway process: its counters start from zero
                    counters = {}
                rec["gateway_counters"] = {k: int(v - counters.get(k, 0.0)) for k, v in sorted(after.items()) if v != counters.get(k, 0.0)}
                records.append(rec)
                print(
                    f"{fault}: {rec['sent']} sent, {rec['ok']} ok, {rec['failed_clear']} failed_clear, "
                    f"{rec['failed_unclear']} failed_unclear, {rec['silently_wrong']} silently_wrong "
                    f"({rec['seconds']} s)",
                    file=sys.stderr,
                    flush=True,
                )
        except BaseException:
            for p in (cluster.gateway, *cluster.workers):
                print(f"--- {p.name}\n{tail(p.log_path)}", file=sys.stderr)
            raise
        finally:
            cluster.close()
    out = {
        "bench": "faults_cpu",
        "model": "built-in tiny (CPU)",
        "quick": args.quick,
        "setup": {
            "conversations": len(conversations),
            "turns": [len(u) for _, u, _ in conversations],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "streamed_conversations": [i for i, c in enumerate(conversations) if c[2]],
            "gateway_first_byte_timeout_s": FIRST_BYTE_S,
            "gateway_event_timeout_s": FIRST_BYTE_S,
            "gateway_drain_grace_s": DRAIN_GRACE_S,
            "reuse_transfer_timeout_s": TRANSFER_TIMEOUT_S,
            "reuse_peer_timeout_s": ServingConfig().reuse.peer_timeout_s,
        },
        "seconds": {"start": round(t_ready, 1), "total": round(time.monotonic() - t_start, 1)},
        "faults": records,
    }
    print(table(records))
    print(f"started in {out['seconds']['start']} s, {out['seconds']['total']} s in all")
    if args.update:
        old = json.loads(args.json.read_text())
        if old["quick"] != args.quick or old["setup"] != out["setup"]:
            print("--update: the file's setup differs from this run's; not merged", file=sys.stderr)
            return 1
        merged = {r["fault"]: r for r in old["faults"]} | {r["fault"]: r for r in records}
        out["faults"] = [merged[f] for f in ALL_FAULTS if f in merged]
        out["seconds"] = old["seconds"]  # the whole matrix's; this run's rows carry their own
        out["updated"] = {
            "faults": [r["fault"] for r in records],
            "seconds": {"start": round(t_ready, 1), "total": round(time.monotonic() - t_start, 1)},
        }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(jsonfmt.dumps(out))
    bad = [r["fault"] for r in records if r["silently_wrong"] or r["violations"]]
    for r in records:
        for v in r["violations"]:
            print(f"VIOLATION {r['fault']}: {v}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
