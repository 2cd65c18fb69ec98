"""The gateway's added latency: TTFT through the gateway minus TTFT straight to
the worker, at 1, 50 and 200 concurrent multi-turn sessions, against a fake
worker (tests/gateway/fake_worker.py) that answers instantly.

    PYTHONSAFEPATH=1 .venv/bin/python bench/gateway_overhead.py [--turns 6] [--sessions 1,50,200]
        [--think-s 1.0] [--saturation 200] [--rounds 2] [--json bench/results/gateway_overhead_cpu.json]
        [--baseline DIR]   # A/B: another revision's kvserving package tree (DIR/kvserving) as a second gateway
        [--timeline FILE | --cpu-samples FILE | --garbage FILE] [--requests-log FILE]   # where the time goes

Processes on loopback: the fake worker, `kvserving gateway` (role
`both`: one worker request per turn), the two reference paths below, and this client (asyncio + aiohttp, each
session its own connection, like separate agents). Each session is an agent
conversation: a system prompt, then per turn a user message, the streamed
reply appended, the next user message. The direct run sends each turn's exact
input ids and tags to the worker's `/internal/generate`; the gateway run sends
the OpenAI chat request (rendering, tagging, routing, lease table,
detokenizing and re-framing are the overhead). TTFT is measured at the client
from sending the request to the first token event.

Load model: an agent does not send its next turn the instant the previous one
ends; it runs tools and (against a real worker) waits seconds for the model's
reply. Before every turn each session waits a think time drawn from an
exponential distribution (mean `--think-s`, seeded per session, so the direct
and the gateway runs replay the same schedule); the first wait staggers the
sessions' starts. The `--saturation` row uses no think time at all: every
session fires its next turn at once, so the two cores are saturated and the
numbers measure queueing, not the gateway.

Two reference paths run in every round on the same schedule: the null proxy
(a uvloop process relaying the direct requests' bytes: the cost of one more
hop) and the floor (bench/gateway_floor.py: the gateway's chat requests served
by only the steps no gateway can skip -- parse, render the chat template,
tokenize, write the worker request, relay the reply as OpenAI chunks -- with the
product's own code on the same server; "gateway minus floor" is what kvserving
adds: tags, identity, exact history, leases, routing, metrics).

Two optional columns: vllm-router and sglang-router (the Rust routers; they
forward OpenAI JSON and tokenize nothing), each when installed (`vllm-router` on
PATH or beside the interpreter, the `sglang_router` module importable;
`make bench-peers` installs both, pinned, from bench/requirements-peers.txt;
never installed by the bench: a line says which were skipped), in front of a fake OpenAI backend (this file,
`--openai-backend`: a uvicorn app streaming the same reply as OpenAI chunks);
their added TTFT is against that backend straight, and their CPU per request
is read from /proc like the gateway's.

A last table says where each path's slowest 1 % came from: the share of them sent in bursts
(five or more within 100 ms in one round: requests slowed together by a stall of a process on
their path or of the machine, not by their own work) and each round's p99. `--requests-log`
writes every request (when it was sent, on the monotonic clock the gateway's timeline also
stamps, and its TTFT) to place them against `--timeline`'s collections and loop stalls.

The table gives p50 and p99 of each and their difference (goal at 200
sessions: p50 added <= 2 ms, p99 added <= 10 ms), and the gateway's CPU per
request from /proc (its background work, health polls and lease beats,
measured while idle and subtracted): the number that depends least on what
else runs on the machine; next to it, the floor's CPU per request (the same
requests, only the unskippable steps) and the fake worker's CPU per request in the
direct runs (a FastAPI server streaming the same tokens: the scale of one HTTP
hop in Python on the same machine at the same moment).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import importlib.util
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import aiohttp
import httpx

from kvserving import jsonfmt
from kvserving.config import ServingConfig
from kvserving.gateway.prompt.chat_template import ChatTemplate
from kvserving.gateway.prompt.tagger import ChatTagger
from kvserving.gateway.prompt.tokenizer import TextTokenizer
from kvserving.model_dir import resolve_model_dir
from kvserving.local.stack import free_port
from kvserving.progress import add_quiet_argument, progress

ROOT = Path(__file__).resolve().parents[1]
MODEL = "kvserving-tiny"
SYSTEM = "You are a coding agent in a large repository. Use the tools, think step by step, keep answers short. " * 6


# The gateway under cProfile timed by its own CPU clock (wall time would charge it for
# the moments the other processes held the two cores); stats written at exit.
PROFILED = """import cProfile, sys, time
from kvserving.cli import main
profile = cProfile.Profile(time.process_time)
out = sys.argv.pop(1)
try:
    profile.runcall(main, sys.argv[1:])
finally:
    profile.dump_stats(out)
"""


class _Relay(asyncio.Protocol):
    """One side of a relayed connection: bytes received are written to the peer as they come."""

    def __init__(self, peer: asyncio.Transport | None = None) -> None:
        self.peer = peer
        self.pending: list[bytes] = []  # bytes from the client while the upstream connection opens

    def data_received(self, data: bytes) -> None:
        if self.peer is None:
            self.pending.append(data)
        else:
            self.peer.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None:
            self.peer.close()


class _Downstream(_Relay):
    """The client's side: opens its upstream connection when accepted."""

    def __init__(self, upstream_port: int, tasks: set[asyncio.Task[None]]) -> None:
        super().__init__()
        self.upstream_port, self.tasks = upstream_port, tasks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are no asyncio.Transport subclasses; they have its methods
        task = asyncio.get_running_loop().create_task(self.connect(cast(asyncio.Transport, transport)))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def connect(self, down: asyncio.Transport) -> None:
        up, _ = await asyncio.get_running_loop().create_connection(lambda: _Relay(down), "127.0.0.1", self.upstream_port)
        up.write(b"".join(self.pending))
        self.pending.clear()
        self.peer = up


def relay_main(listen_port: int, upstream_port: int) -> None:
    """The null proxy: accept on ``listen_port``, relay every connection's bytes to ``upstream_port`` and back."""
    import uvloop

    async def serve() -> None:
        tasks: set[asyncio.Task[None]] = set()
        server = await asyncio.get_running_loop().create_server(lambda: _Downstream(upstream_port, tasks), "127.0.0.1", listen_port)
        await server.serve_forever()

    uvloop.run(serve())


def openai_backend_main(port: int, reply: str) -> None:
    """The fake OpenAI backend the routers forward to: every chat request is answered at once
    with ``reply`` streamed as OpenAI chunks (one per word); any GET is a 200 (health checks)."""
    import uvicorn

    words = reply.split(" ")
    head = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": MODEL}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        body = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    frames = [chunk({"role": "assistant", "content": ""})]
    frames += [chunk({"content": w if i == 0 else " " + w}) for i, w in enumerate(words)]
    frames += [chunk({}, "stop"), b"data: [DONE]\n\n"]

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        message = await receive()
        while message.get("more_body", False):
            message = await receive()
        if scope["method"] != "POST":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        for frame in frames[:-1]:
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": frames[-1], "more_body": False})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


@dataclass
class Router:
    """An optional comparison column: a router process in front of the fake OpenAI backend."""

    name: str
    url: str
    proc: subprocess.Popen[bytes]


def router_commands(backend_url: str) -> tuple[dict[str, list[str]], list[str]]:
    """The routers installed here, each as the command that starts it on {port}; lines for the ones skipped."""
    found: dict[str, list[str]] = {}
    skipped: list[str] = []
    # `make bench-peers` installs both into .venv, whose bin/ need not be on PATH
    binary = shutil.which("vllm-router", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    # each its own metrics port: both default to 29000, which another process may hold
    if binary:
        found["vllm-router"] = [
            binary,
            "--worker-urls",
            backend_url,
            "--host",
            "127.0.0.1",
            "--port",
            "{port}",
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            "{metrics_port}",
            "--log-level",
            "warning",
        ]
    else:
        skipped.append("vllm-router: not installed (`make bench-peers`), column skipped")
    if importlib.util.find_spec("sglang_router") is not None:
        found["sglang-router"] = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--worker-urls",
            backend_url,
            "--host",
            "127.0.0.1",
            "--port",
            "{port}",
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            "{metrics_port}",
            "--log-level",
            "warn",
        ]
    else:
        skipped.append("sglang-router: not installed (`make bench-peers`), column skipped")
    return found, skipped


def spawn(argv: list[str], log: Path, *, pythonpath: str | None = None) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONSAFEPATH="1", OMP_NUM_THREADS="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 60.0, *, path: str = "/ready") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + path, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} not ready in {timeout_s} s")


def user_text(session: int, turn: int) -> str:
    return f"Session {session}, step {turn}: open the next file, run the tests and tell me what failed."


async def first_token_time(session: aiohttp.ClientSession, url: str, body: bytes, *, openai: bool) -> float:
    """Seconds to the first token event (the stream is read to its end; only events before the first token are parsed)."""
    start = time.perf_counter()
    ttft = None
    done = False
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        assert r.status == 200, (r.status, await r.read())
        async for raw in r.content:
            line = raw.rstrip(b"\r\n")
            if line == b"data: [DONE]":
                done = True
            if ttft is not None or not line.startswith(b"data: ") or done:
                continue
            event = json.loads(line[6:])
            if openai:
                choices = event.get("choices") or []
                if choices and choices[0]["delta"].get("content"):
                    ttft = time.perf_counter() - start
            elif event.get("token_ids"):
                ttft = time.perf_counter() - start
    assert ttft is not None and done, "no token, or no end of stream"
    return ttft


def conversation(sid: int, turns: int, reply: str, *, tool_words: int = 0) -> list[list[dict[str, Any]]]:
    """The messages each turn of session ``sid`` sends (the reply appended after each turn).

    With ``tool_words``, each turn's reply is a tool call whose result (that many words
    of the standard library's sources) comes back before the next user message: an
    agent's history grows by about that many tokens a turn."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    out = []
    words = _library_words() if tool_words else []
    for turn in range(turns):
        messages = messages + [{"role": "user", "content": user_text(sid, turn)}]
        out.append(messages)
        if tool_words:
            call = {"id": f"call{turn}", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "os.py"}'}}
            start = (sid * 7919 + turn * tool_words) % (len(words) - tool_words)
            messages = messages + [
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"call{turn}", "content": " ".join(words[start : start + tool_words])},
            ]
        messages = messages + [{"role": "assistant", "content": reply}]
    return out


def _library_words() -> list[str]:
    return Path(os.__file__).read_text().split()


def bodies(
    sessions: int, turns: int, reply: str, tagger: ChatTagger, *, via_gateway: bool, max_tokens: int, tool_words: int = 0
) -> list[list[bytes]]:
    """Every request body, serialized before the clock starts (the direct run's ids and tags are what the gateway sends)."""
    run = uuid.uuid4().hex[:8]
    out = []
    for sid in range(sessions):
        per_turn = []
        for turn, messages in enumerate(conversation(sid, turns, reply, tool_words=tool_words)):
            if via_gateway:
                body: dict[str, Any] = {"model": MODEL, "messages": messages, "stream": True, "max_tokens": max_tokens}
            else:
                prompt = tagger.build(messages)
                body = {
                    "request_id": f"{run}-{sid}-{turn}",
                    "input_ids": prompt.input_ids,
                    "tags": prompt.tags,
                    "sampling": {"max_tokens": max_tokens},
                    "conversation_key": f"{run}-{sid}",
                    "retain": True,
                }
            per_turn.append(json.dumps(body).encode())
        out.append(per_turn)
    return out


def think_times(sessions: int, turns: int, mean_s: float, *, seed: int) -> list[list[float]]:
    """Each session's wait before each of its turns: exponential with mean ``mean_s`` (0: none)."""
    out = []
    for sid in range(sessions):
        rng = random.Random(seed * 100_003 + sid)
        out.append([rng.expovariate(1.0 / mean_s) if mean_s > 0 else 0.0 for _ in range(turns)])
    return out


async def _measure(
    target: str, plan: list[list[bytes]], waits: list[list[float]], *, via_gateway: bool, sent: list[float] | None = None
) -> list[float]:
    """Run every session concurrently (each its own connection, like separate agents); TTFT of every turn
    (and, into ``sent``, when each was sent: ``time.perf_counter``, the system's monotonic clock, which
    the gateway's timeline stamps too; in the same order)."""
    path = "/v1/chat/completions" if via_gateway else "/internal/generate"
    run = uuid.uuid4().hex[:8]
    when: dict[int, list[float]] = {}

    async def one(sid: int, turns: list[bytes]) -> list[float]:
        headers = {"X-Session-ID": f"bench-{run}-{sid}"} if via_gateway else {}
        # idle connections dropped before uvicorn's 5 s keep-alive closes them (a think time can be longer)
        connector = aiohttp.TCPConnector(limit=1, keepalive_timeout=4)
        async with aiohttp.ClientSession(connector=connector, headers=headers, timeout=aiohttp.ClientTimeout(total=120)) as session:
            out = []
            for body, wait in zip(turns, waits[sid], strict=True):
                if wait > 0:
                    await asyncio.sleep(wait)
                when.setdefault(sid, []).append(time.perf_counter())
                out.append(await first_token_time(session, target + path, body, openai=via_gateway))
            return out

    results: list[float] = []
    for sid, times in enumerate(await asyncio.gather(*(one(sid, turns) for sid, turns in enumerate(plan)))):
        results.extend(times)
        if sent is not None:
            sent.extend(when.get(sid, []))
    return results


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


@dataclass
class Row:
    sessions: int
    think_s: float
    direct: list[float]
    relay: list[float]  # the direct requests through the null proxy
    gateway: list[float]
    floor: list[float]  # the chat requests through bench/gateway_floor.py
    cpu_ms: float  # gateway CPU per request, background subtracted
    floor_cpu_ms: float  # the floor's CPU per request (it has no background work)
    worker_cpu_ms: float  # the fake worker's CPU per request in the direct runs: the same work without the gateway
    relay_cpu_ms: float = 0.0  # the null proxy's CPU per request
    openai_direct: list[float] = field(default_factory=list)  # the chat requests straight to the fake OpenAI backend
    routers: dict[str, tuple[list[float], float]] = field(default_factory=dict)  # name -> (TTFTs, CPU ms per request)
    baseline: list[float] = field(default_factory=list)  # the chat requests through the --baseline gateway
    baseline_cpu_ms: float = 0.0


def run_row(
    n: int,
    think_s: float,
    args: argparse.Namespace,
    *,
    tagger: ChatTagger,
    reply: str,
    worker_url: str,
    relay_url: str,
    gw_url: str,
    gw_pid: int,
    worker_pid: int,
    idle_cpu_per_s: float,
    floor_url: str,
    floor_pid: int,
    relay_pid: int,
    backend_url: str | None = None,
    routers: Sequence[Router] = (),
    baseline: tuple[str, int, float] | None = None,
    requests_log: list[dict[str, Any]] | None = None,
) -> Row:
    direct: list[float] = []
    relay: list[float] = []
    gateway: list[float] = []
    floor: list[float] = []
    openai_direct: list[float] = []
    routed: dict[str, list[float]] = {r.name: [] for r in routers}
    routed_cpu = {r.name: 0.0 for r in routers}
    gw_cpu = worker_cpu = floor_cpu = relay_cpu = base_cpu = 0.0
    base_times: list[float] = []
    rounds = max(args.rounds, -(-args.min_requests // (n * args.turns)))
    r = 0

    def measure(target: str, plan: list[list[bytes]], waits: list[list[float]], *, via_gateway: bool, name: str) -> list[float]:
        """One path's run of round ``r``, recorded request by request in ``requests_log`` when given."""
        sent: list[float] = []
        got = asyncio.run(_measure(target, plan, waits, via_gateway=via_gateway, sent=sent))
        if requests_log is not None:
            requests_log.append({"sessions": n, "think_s": think_s, "round": r, "path": name, "sent_s": sent, "ttft_s": got})
        return got

    for r in range(rounds):  # interleave so drift on a shared machine hits every path alike
        waits = think_times(n, args.turns, think_s, seed=r)

        plan = bodies(n, args.turns, reply, tagger, via_gateway=False, max_tokens=args.max_tokens)
        before = cpu_s(worker_pid)
        direct += measure(worker_url, plan, waits, via_gateway=False, name="direct")
        worker_cpu += cpu_s(worker_pid) - before
        plan = bodies(n, args.turns, reply, tagger, via_gateway=False, max_tokens=args.max_tokens)
        before = cpu_s(relay_pid)
        relay += measure(relay_url, plan, waits, via_gateway=False, name="null_relay")
        relay_cpu += cpu_s(relay_pid) - before
        plan = bodies(n, args.turns, reply, tagger, via_gateway=True, max_tokens=args.max_tokens)
        before = cpu_s(floor_pid)
        floor += measure(floor_url, plan, waits, via_gateway=True, name="floor")
        floor_cpu += cpu_s(floor_pid) - before
        # the gateway and the baseline gateway (--baseline) in alternating order, round by round
        for which in ("gateway", "baseline") if r % 2 == 0 else ("baseline", "gateway"):
            if which == "baseline" and baseline is None:
                continue
            url, pid, idle_s = (gw_url, gw_pid, idle_cpu_per_s) if which == "gateway" else baseline  # type: ignore[misc]
            plan = bodies(n, args.turns, reply, tagger, via_gateway=True, max_tokens=args.max_tokens)
            before, t0 = cpu_s(pid), time.monotonic()
            got = measure(url, plan, waits, via_gateway=True, name="kvserving" if which == "gateway" else "baseline")
            used = cpu_s(pid) - before - idle_s * (time.monotonic() - t0)
            if which == "gateway":
                gateway += got
                gw_cpu += used
            else:
                base_times += got
                base_cpu += used
        if backend_url is not None and routers:
            plan = bodies(n, args.turns, reply, tagger, via_gateway=True, max_tokens=args.max_tokens)
            openai_direct += measure(backend_url, plan, waits, via_gateway=True, name="openai_direct")
            for router in routers:
                plan = bodies(n, args.turns, reply, tagger, via_gateway=True, max_tokens=args.max_tokens)
                before = cpu_s(router.proc.pid)
                routed[router.name] += measure(router.url, plan, waits, via_gateway=True, name=router.name)
                routed_cpu[router.name] += cpu_s(router.proc.pid) - before
    return Row(
        n,
        think_s,
        direct,
        relay,
        gateway,
        floor,
        1e3 * gw_cpu / len(gateway),
        1e3 * floor_cpu / len(floor),
        1e3 * worker_cpu / len(direct),
        1e3 * relay_cpu / len(relay),
        openai_direct,
        {name: (times, 1e3 * routed_cpu[name] / len(times)) for name, times in routed.items()},
        base_times,
        1e3 * base_cpu / max(len(base_times), 1),
    )


def tails(requests_log: list[dict[str, Any]], *, window_s: float = 0.1, burst: int = 5) -> str:
    """Where each path's slowest 1 % came from, per row: how many of them were sent within
    ``window_s`` of at least ``burst - 1`` others of them in the same round (requests slowed
    together: a stall of a process on their path or of the machine, not one request's own work),
    and each round's p99."""
    lines = [
        f"Each path's slowest 1 % (TTFT at or over its p99): the share sent in bursts ({burst} or more of them within "
        f"{1e3 * window_s:.0f} ms of each other, in one round), and each round's p99\n",
        "| think time | sessions | path | p99 ms | slowest 1 % in bursts | p99 per round, ms |",
        "|---|---:|---|---:|---:|---|",
    ]
    rows: dict[tuple[int, float], dict[str, list[dict[str, Any]]]] = {}
    for entry in requests_log:
        rows.setdefault((entry["sessions"], entry["think_s"]), {}).setdefault(entry["path"], []).append(entry)
    for (sessions, think_s), paths in rows.items():
        load = f"exp. mean {think_s:g} s" if think_s > 0 else "none (saturation)"
        for name, runs in paths.items():
            every = [t for run in runs for t in run["ttft_s"]]
            cut = pct(every, 0.99)
            slow = 0
            together = 0
            for run in runs:
                sent = sorted(s for s, t in zip(run["sent_s"], run["ttft_s"], strict=True) if t >= cut)
                slow += len(sent)
                # a request is in a burst when a window of `window_s` around it holds `burst` of them
                lo = 0
                marked = [False] * len(sent)
                for hi in range(len(sent)):
                    while sent[hi] - sent[lo] > window_s:
                        lo += 1
                    if hi - lo + 1 >= burst:
                        marked[lo : hi + 1] = [True] * (hi - lo + 1)
                together += sum(marked)
            per_round = ", ".join(f"{1e3 * pct(run['ttft_s'], 0.99):.1f}" for run in runs)
            lines.append(f"| {load} | {sessions} | {name} | {1e3 * cut:.2f} | {together} / {slow} | {per_round} |")
    return "\n".join(lines) + "\n"


def row_json(row: Row) -> dict[str, Any]:
    """One row of the result file: p50 / p99 TTFT added over each path's direct reference, CPU per request."""

    def added(values: list[float], reference: list[float]) -> dict[str, float]:
        return {f"added_p{q}_ms": round(1e3 * (pct(values, q / 100) - pct(reference, q / 100)), 3) for q in (50, 99)}

    out: dict[str, Any] = {
        "sessions": row.sessions,
        "think_s": row.think_s,
        "requests_per_path": len(row.gateway),
        "direct": {
            "p50_ms": round(1e3 * pct(row.direct, 0.5), 3),
            "p99_ms": round(1e3 * pct(row.direct, 0.99), 3),
            "worker_cpu_ms_per_request": round(row.worker_cpu_ms, 3),
        },
        "kvserving": {**added(row.gateway, row.direct), "cpu_ms_per_request": round(row.cpu_ms, 3)},
        "floor": {**added(row.floor, row.direct), "cpu_ms_per_request": round(row.floor_cpu_ms, 3)},
        "null_relay": {**added(row.relay, row.direct), "cpu_ms_per_request": round(row.relay_cpu_ms, 3)},
        "kvserving_minus_floor": {
            "p50_ms": round(1e3 * (pct(row.gateway, 0.5) - pct(row.floor, 0.5)), 3),
            "p99_ms": round(1e3 * (pct(row.gateway, 0.99) - pct(row.floor, 0.99)), 3),
            "cpu_ms_per_request": round(row.cpu_ms - row.floor_cpu_ms, 3),
        },
    }
    for name, (times, cpu) in row.routers.items():
        out[name] = {**added(times, row.openai_direct), "cpu_ms_per_request": round(cpu, 3)}
    if row.baseline:
        out["baseline"] = {**added(row.baseline, row.direct), "cpu_ms_per_request": round(row.baseline_cpu_ms, 3)}
    return out


@dataclass
class LongRow:
    turns: int
    prompt_tokens: list[int]  # per turn
    direct: list[list[float]]  # per round, per turn
    gateway: list[list[float]]
    cpu_ms: list[float]  # gateway CPU per request, per round


def run_long(
    args: argparse.Namespace, *, tagger: ChatTagger, reply: str, worker_url: str, gw_url: str, gw_pid: int, idle_cpu_per_s: float
) -> LongRow:
    """One agent session whose history grows by a tool result each turn, alone on the machine."""
    turns, words = args.long_turns, args.long_tool_words
    tokens = [len(tagger.build(m).input_ids) for m in conversation(0, turns, reply, tool_words=words)]
    row = LongRow(turns, tokens, [], [], [])
    for r in range(args.rounds):
        waits = [[0.05] * turns]  # a short pause: each turn starts on an idle event loop
        plan = bodies(1, turns, reply, tagger, via_gateway=False, max_tokens=args.max_tokens, tool_words=words)
        row.direct.append(asyncio.run(_measure(worker_url, plan, waits, via_gateway=False)))
        plan = bodies(1, turns, reply, tagger, via_gateway=True, max_tokens=args.max_tokens, tool_words=words)
        before, t0 = cpu_s(gw_pid), time.monotonic()
        row.gateway.append(asyncio.run(_measure(gw_url, plan, waits, via_gateway=True)))
        row.cpu_ms.append(1e3 * (cpu_s(gw_pid) - before - idle_cpu_per_s * (time.monotonic() - t0)) / turns)
    return row


def print_long(row: LongRow) -> None:
    print(
        f"\nlong agent session: 1 session, {row.turns} turns, a tool result of ~{row.prompt_tokens[1] - row.prompt_tokens[0]} "
        f"tokens per turn, {len(row.direct)} rounds (median over rounds and the turns of each stretch)\n"
    )
    print("| turns | prompt tokens | direct TTFT ms | gateway TTFT ms | added ms |")
    print("|---|---:|---:|---:|---:|")
    stretch = max(1, row.turns // 4)
    for lo in range(0, row.turns, stretch):
        hi = min(row.turns, lo + stretch)
        d = [t for times in row.direct for t in times[lo:hi]]
        g = [t for times in row.gateway for t in times[lo:hi]]
        d50, g50 = 1e3 * pct(d, 0.5), 1e3 * pct(g, 0.5)
        print(f"| {lo + 1}-{hi} | {row.prompt_tokens[lo]}-{row.prompt_tokens[hi - 1]} | {d50:.2f} | {g50:.2f} | {g50 - d50:.2f} |")
    print(f"\ngateway CPU per request over the session: {sum(row.cpu_ms) / len(row.cpu_ms):.2f} ms (tick counts)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", default="1,50,200")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--think-s", type=float, default=1.0, help="mean think time before each turn (exponential)")
    parser.add_argument("--saturation", default="200", help="sessions of the rows with no think time ('' for none)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per reply (the fake worker's reply is 17)")
    parser.add_argument(
        "--reply-repeat",
        type=int,
        default=1,
        help="the fake worker's reply is its sentence this many times (17 tokens each; raise --max-tokens)",
    )
    parser.add_argument(
        "--token-delay-ms",
        type=float,
        default=0.0,
        help="the fake worker waits this long before each token (tokens then reach the gateway one event at a time)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating direct/gateway rounds per row")
    parser.add_argument("--min-requests", type=int, default=36, help="more rounds for a row with fewer requests per path")
    parser.add_argument("--profile", default=None, metavar="FILE", help="run the gateway under cProfile (CPU time), stats to FILE")
    parser.add_argument(
        "--timeline",
        default=None,
        metavar="FILE",
        help="stamp every request's stages (bench/gateway_timeline.py), print their percentiles at the end",
    )
    parser.add_argument(
        "--cpu-samples",
        default=None,
        metavar="FILE",
        help="sample the gateway in CPU time (bench/gateway_timeline.py sample), print where its CPU went",
    )
    parser.add_argument(
        "--garbage",
        default=None,
        metavar="FILE",
        help="count what the gateway's cyclic collector frees, per request and by kind (bench/gateway_timeline.py garbage; "
        "it changes when garbage is freed: a diagnostic run)",
    )
    parser.add_argument(
        "--requests-log",
        default=None,
        metavar="FILE",
        help="every request of every path as JSON: when it was sent (time.perf_counter) and its TTFT (where a percentile comes from)",
    )
    parser.add_argument("--long-turns", type=int, default=40, help="turns of the long agent session (0: none)")
    parser.add_argument("--long-tool-words", type=int, default=300, help="words of the tool result each long-session turn adds")
    parser.add_argument(
        "--json", default=str(ROOT / "bench/results/gateway_overhead_cpu.json"), metavar="FILE", help="the rows as JSON ('' for none)"
    )
    parser.add_argument("--no-routers", action="store_true", help="leave out the vllm-router / sglang-router columns")
    parser.add_argument(
        "--baseline",
        default=None,
        metavar="DIR",
        help="A/B: a second gateway, the kvserving package found in DIR (its PYTHONPATH: DIR/kvserving), measured in every "
        "round beside this checkout's, the two in alternating order (column 'baseline')",
    )
    add_quiet_argument(parser)
    parser.add_argument("--relay", default=None, help=argparse.SUPPRESS)  # LISTEN:UPSTREAM: run as the null proxy
    parser.add_argument("--openai-backend", type=int, default=None, help=argparse.SUPPRESS)  # PORT: run as the fake OpenAI backend
    parser.add_argument("--reply", default="", help=argparse.SUPPRESS)  # the fake OpenAI backend's reply
    args = parser.parse_args()
    if args.relay:
        listen, upstream = (int(x) for x in args.relay.split(":"))
        relay_main(listen, upstream)
        return 0
    if args.openai_backend:
        openai_backend_main(args.openai_backend, args.reply)
        return 0
    if args.think_s < 0:
        raise SystemExit("--think-s must be >= 0")
    model_dir = resolve_model_dir(ServingConfig().model)
    tok = TextTokenizer.from_dir(model_dir)
    tagger = ChatTagger(tok, ChatTemplate.from_dir(model_dir))
    if args.reply_repeat < 1 or args.token_delay_ms < 0:
        raise SystemExit("--reply-repeat must be >= 1 and --token-delay-ms >= 0")
    reply_ids = tok.encode_ids(" ".join(["I ran the tests; two failed in test_parser.py. Next I will read it."] * args.reply_repeat))
    reply = tok.decode(reply_ids)

    tmp = Path(tempfile.mkdtemp(prefix="gw-bench-"))  # the processes' logs: removed after a run that finished
    finished = False
    worker_port, gw_port, relay_port, floor_port = free_port(), free_port(), free_port(), free_port()
    worker_url, gw_url = f"http://127.0.0.1:{worker_port}", f"http://127.0.0.1:{gw_port}"
    relay_url, floor_url = f"http://127.0.0.1:{relay_port}", f"http://127.0.0.1:{floor_port}"
    # a context long enough for the long session (the fake worker holds no KV)
    # and the workers' credential, without which the gateway does not start
    (tmp / "internal-token").write_text(uuid.uuid4().hex)
    (tmp / "config.json").write_text(
        json.dumps(
            {
                "model": {"path": str(model_dir), "served_name": MODEL, "max_model_len": 131072},
                "security": {"internal_token_file": str(tmp / "internal-token")},
            }
        )
    )
    procs = [
        spawn(
            [
                sys.executable,
                str(ROOT / "tests/gateway/fake_worker.py"),
                "--port",
                str(worker_port),
                "--reply-ids",
                ",".join(map(str, reply_ids)),
                "--token-delay-ms",
                str(args.token_delay_ms),
            ],
            tmp / "worker.log",
        ),
        spawn(
            [
                sys.executable,
                *gateway_launcher(args),
                "gateway",
                "--config",
                str(tmp / "config.json"),
                "--port",
                str(gw_port),
                "--decode",
                worker_url,
                "--log-level",
                "warning",
            ],
            tmp / "gateway.log",
        ),
        spawn([sys.executable, __file__, "--relay", f"{relay_port}:{worker_port}"], tmp / "relay.log"),
        spawn(
            [
                sys.executable,
                str(Path(__file__).with_name("gateway_floor.py")),
                "--port",
                str(floor_port),
                "--worker",
                worker_url,
                "--model-dir",
                str(model_dir),
            ],
            tmp / "floor.log",
        ),
    ]
    baseline_port = free_port()
    baseline_url = f"http://127.0.0.1:{baseline_port}"
    baseline_proc: subprocess.Popen[bytes] | None = None
    if args.baseline:
        if not (Path(args.baseline) / "kvserving" / "gateway").is_dir():
            raise SystemExit(f"--baseline {args.baseline}: no kvserving/gateway package there")
        gw_argv = procs[1].args[procs[1].args.index("gateway") :]  # type: ignore[union-attr]
        gw_argv[gw_argv.index("--port") + 1] = str(baseline_port)
        baseline_proc = spawn([sys.executable, "-m", "kvserving.cli", *gw_argv], tmp / "baseline.log", pythonpath=args.baseline)
        procs.append(baseline_proc)
    backend_url: str | None = None
    routers: list[Router] = []
    commands, skipped = router_commands("http://127.0.0.1:0") if not args.no_routers else ({}, ["routers: left out (--no-routers)"])
    for line in skipped:
        print(line, flush=True)
    if commands:
        backend_port = free_port()
        backend_url = f"http://127.0.0.1:{backend_port}"
        procs.append(spawn([sys.executable, __file__, "--openai-backend", str(backend_port), "--reply", reply], tmp / "openai-backend.log"))
        for name, argv in router_commands(backend_url)[0].items():
            port, metrics_port = free_port(), free_port()
            argv = [a.replace("{port}", str(port)).replace("{metrics_port}", str(metrics_port)) for a in argv]
            routers.append(Router(name, f"http://127.0.0.1:{port}", spawn(argv, tmp / f"{name}.log")))
            procs.append(routers[-1].proc)
    try:
        wait_ready(worker_url, procs[0], tmp / "worker.log")
        wait_ready(gw_url, procs[1], tmp / "gateway.log")
        wait_ready(relay_url, procs[2], tmp / "relay.log")  # the worker's /ready, through the relay
        wait_ready(floor_url, procs[3], tmp / "floor.log")
        if baseline_proc is not None:
            wait_ready(baseline_url, baseline_proc, tmp / "baseline.log")
        if backend_url is not None:
            wait_ready(backend_url, procs[-1 - len(routers)], tmp / "openai-backend.log", path="/health")
        for router in routers:
            wait_ready(router.url, router.proc, tmp / f"{router.name}.log", timeout_s=120, path="/health")
        load_before = list(os.getloadavg())
        before = cpu_s(procs[1].pid)
        base_before = cpu_s(baseline_proc.pid) if baseline_proc is not None else 0.0
        time.sleep(3.0)  # the gateway's background work (health polls, lease beats) while idle
        idle = (cpu_s(procs[1].pid) - before) / 3.0
        baseline = None
        if baseline_proc is not None:
            baseline = (baseline_url, baseline_proc.pid, (cpu_s(baseline_proc.pid) - base_before) / 3.0)
        requests_log: list[dict[str, Any]] = []
        plan = [(int(x), args.think_s) for x in args.sessions.split(",") if x]
        plan += [(int(x), 0.0) for x in args.saturation.split(",") if x]
        rows = [
            run_row(
                n,
                think,
                args,
                tagger=tagger,
                reply=reply,
                worker_url=worker_url,
                relay_url=relay_url,
                gw_url=gw_url,
                gw_pid=procs[1].pid,
                worker_pid=procs[0].pid,
                idle_cpu_per_s=idle,
                floor_url=floor_url,
                floor_pid=procs[3].pid,
                relay_pid=procs[2].pid,
                backend_url=backend_url,
                routers=routers,
                baseline=baseline,
                requests_log=requests_log,
            )
            for n, think in progress(plan, desc="rows", quiet=args.quiet)
        ]
        if args.requests_log:
            Path(args.requests_log).write_text(json.dumps(requests_log))
        load_after = os.getloadavg()
        print(
            f"gateway overhead: TTFT through the gateway minus straight to the worker ({args.turns} turns per session, "
            f"fake worker answering instantly, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
            f"gateway idle CPU {1e3 * idle:.1f} ms/s subtracted)\n"
        )
        print(
            "| think time | sessions | requests | direct p50 ms | direct p99 ms | gateway p50 ms | gateway p99 ms "
            "| added p50 ms | added p99 ms | null proxy added p50 / p99 ms | floor added p50 / p99 ms "
            "| gateway minus floor p50 / p99 ms | gateway CPU ms/request | floor CPU ms/request "
            "| worker CPU ms/request (direct) |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for row in rows:
            d50, d99, r50, r99, g50, g99, f50, f99 = (
                1e3 * pct(v, q) for v in (row.direct, row.relay, row.gateway, row.floor) for q in (0.5, 0.99)
            )
            load = f"exp. mean {row.think_s:g} s" if row.think_s > 0 else "none (saturation)"
            print(
                f"| {load} | {row.sessions} | {len(row.gateway)} | {d50:.2f} | {d99:.2f} | {g50:.2f} | {g99:.2f} "
                f"| {g50 - d50:.2f} | {g99 - d99:.2f} | {r50 - d50:.2f} / {r99 - d99:.2f} "
                f"| {f50 - d50:.2f} / {f99 - d99:.2f} | {g50 - f50:.2f} / {g99 - f99:.2f} "
                f"| {row.cpu_ms:.2f} | {row.floor_cpu_ms:.2f} | {row.worker_cpu_ms:.2f} |"
            )
        print("\nCPU per request and added TTFT p50 / p99 by path (routers against the fake OpenAI backend straight)\n")
        names = ["kvserving", *(["baseline"] if args.baseline else []), "floor", "null_relay", *(r.name for r in routers)]
        print("| think time | sessions | " + " | ".join(f"{n} CPU ms | {n} added p50 / p99 ms" for n in names) + " |")
        print("|---|---:|" + "---:|---:|" * len(names))
        results = [row_json(row) for row in rows]
        for row, result in zip(rows, results, strict=True):
            load = f"exp. mean {row.think_s:g} s" if row.think_s > 0 else "none (saturation)"
            cells = [
                f"{result[n]['cpu_ms_per_request']:.2f} | {result[n]['added_p50_ms']:.2f} / {result[n]['added_p99_ms']:.2f}" for n in names
            ]
            print(f"| {load} | {row.sessions} | " + " | ".join(cells) + " |")
        print("\n" + tails(requests_log))
        if args.json:
            Path(args.json).write_text(
                jsonfmt.dumps(
                    {
                        "bench": "bench/gateway_overhead.py",
                        "turns": args.turns,
                        "rounds": args.rounds,
                        "max_tokens": args.max_tokens,
                        "cores": os.cpu_count(),
                        "load_average_before": load_before,
                        "load_average_after": list(load_after),
                        "gateway_idle_cpu_ms_per_s": round(1e3 * idle, 3),
                        "routers_skipped": skipped,
                        "rows": results,
                    }
                )
            )
            print(f"\nwritten: {args.json}")
        if args.long_turns > 0:
            print_long(
                run_long(args, tagger=tagger, reply=reply, worker_url=worker_url, gw_url=gw_url, gw_pid=procs[1].pid, idle_cpu_per_s=idle)
            )
        finished = True
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        if finished:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"the processes' logs: {tmp}", file=sys.stderr)
    tool = str(Path(__file__).with_name("gateway_timeline.py"))
    for what, path in (("report", args.timeline), ("report-samples", args.cpu_samples), ("report-garbage", args.garbage)):
        if path:
            print(flush=True)
            subprocess.run([sys.executable, tool, what, path], check=True)
    return 0


def gateway_launcher(args: argparse.Namespace) -> list[str]:
    """How the gateway process starts: plain, under cProfile, stamped, sampled or its garbage counted by bench/gateway_timeline.py."""
    if args.profile:
        return ["-c", PROFILED, args.profile]
    tool = str(Path(__file__).with_name("gateway_timeline.py"))
    if args.timeline:
        return [tool, "run", args.timeline]
    if args.cpu_samples:
        return [tool, "sample", args.cpu_samples]
    if args.garbage:
        return [tool, "garbage", args.garbage]
    return ["-m", "kvserving.cli"]


if __name__ == "__main__":
    raise SystemExit(main())
