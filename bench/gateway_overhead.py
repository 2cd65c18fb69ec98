"""The gateway's added latency: TTFT through the gateway minus TTFT straight to
the worker, at 1, 50 and 200 concurrent multi-turn sessions, against a fake
worker (tests/gateway/fake_worker.py) that answers instantly.

    PYTHONSAFEPATH=1 .venv/bin/python bench/gateway_overhead.py [--turns 4] [--sessions 1,50,200]

Three processes on loopback: the fake worker, `kvserving gateway` (role
`both`: one worker request per turn), and this client (asyncio + httpx). Each
session is an agent conversation: a system prompt, then per turn a user
message, the streamed reply appended, the next user message. The direct run
sends each turn's exact input ids to the worker's `/internal/generate`; the
gateway run sends the OpenAI chat request (rendering, tagging, routing, lease
table, detokenizing and re-framing are the overhead). TTFT is measured at the
client from the request's first byte to the first token event. The table
gives p50 and p99 of each and their difference (goal at 200 sessions: p50
added <= 2 ms, p99 added <= 10 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from kvserving.config import ServingConfig
from kvserving.gateway.chat_template import ChatTemplate
from kvserving.gateway.tagger import ChatTagger
from kvserving.gateway.tokenizer import TextTokenizer
from kvserving.model_dir import resolve_model_dir
from kvserving.stack import free_port

ROOT = Path(__file__).resolve().parents[1]
MODEL = "kvserving-tiny"
SYSTEM = "You are a coding agent in a large repository. Use the tools, think step by step, keep answers short. " * 6


def spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONSAFEPATH="1", OMP_NUM_THREADS="1")
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} not ready in {timeout_s} s")


def user_text(session: int, turn: int) -> str:
    return f"Session {session}, step {turn}: open the next file, run the tests and tell me what failed."


async def first_token_time(client: httpx.AsyncClient, url: str, body: dict[str, Any], *, openai: bool) -> tuple[float, str]:
    """Seconds to the first token event, and the full text/ids of the reply (drains the stream)."""
    start = time.perf_counter()
    ttft = None
    pieces: list[str] = []
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200, (r.status_code, await r.aread())
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if openai:
                choices = event.get("choices") or []
                text = choices[0]["delta"].get("content") if choices else None
                if text:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    pieces.append(text)
            elif event.get("token_ids"):
                ttft = ttft if ttft is not None else time.perf_counter() - start
                pieces.extend(str(t) for t in event["token_ids"])
    assert ttft is not None, "no token"
    return ttft, "".join(pieces)


def conversation(sid: int, turns: int, reply: str) -> list[list[dict[str, Any]]]:
    """The messages each turn of session ``sid`` sends (the reply appended after each turn)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    out = []
    for turn in range(turns):
        messages = messages + [{"role": "user", "content": user_text(sid, turn)}]
        out.append(messages)
        messages = messages + [{"role": "assistant", "content": reply}]
    return out


def bodies(sessions: int, turns: int, reply: str, tagger: ChatTagger, *, via_gateway: bool) -> list[list[dict[str, Any]]]:
    """Every request body, built before the clock starts (the direct run's ids and tags are what the gateway sends)."""
    run = uuid.uuid4().hex[:8]
    out = []
    for sid in range(sessions):
        per_turn = []
        for turn, messages in enumerate(conversation(sid, turns, reply)):
            if via_gateway:
                per_turn.append({"model": MODEL, "messages": messages, "stream": True, "max_tokens": 16})
            else:
                prompt = tagger.build(messages)
                per_turn.append({"request_id": f"{run}-{sid}-{turn}", "input_ids": prompt.input_ids, "tags": prompt.tags,
                                 "sampling": {"max_tokens": 16}, "conversation_key": f"{run}-{sid}", "retain": True})
        out.append(per_turn)
    return out


async def measure(target: str, plan: list[list[dict[str, Any]]], *, via_gateway: bool) -> list[float]:
    """Run every session concurrently (each its own connection, like separate agents); TTFT of every turn."""
    path = "/v1/chat/completions" if via_gateway else "/internal/generate"
    run = uuid.uuid4().hex[:8]

    async def one(sid: int, turns: list[dict[str, Any]]) -> list[float]:
        headers = {"X-Session-ID": f"bench-{run}-{sid}"} if via_gateway else {}
        async with httpx.AsyncClient(timeout=120, headers=headers) as client:
            return [(await first_token_time(client, target + path, body, openai=via_gateway))[0] for body in turns]

    results: list[float] = []
    for times in await asyncio.gather(*(one(sid, turns) for sid, turns in enumerate(plan))):
        results.extend(times)
    return results


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", default="1,50,200")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="alternating direct/gateway rounds per row")
    parser.add_argument("--profile", default=None, metavar="FILE", help="run the gateway under cProfile, stats to FILE")
    args = parser.parse_args()
    model_dir = resolve_model_dir(ServingConfig().model)
    tok = TextTokenizer.from_dir(model_dir)
    tagger = ChatTagger(tok, ChatTemplate.from_dir(model_dir))
    reply_ids = tok.encode_ids("I ran the tests; two failed in test_parser.py. Next I will read it.")
    reply = tok.decode(reply_ids)

    tmp = Path(tempfile.mkdtemp(prefix="gw-bench-"))
    worker_port, gw_port = free_port(), free_port()
    worker_url, gw_url = f"http://127.0.0.1:{worker_port}", f"http://127.0.0.1:{gw_port}"
    (tmp / "config.json").write_text(json.dumps({"model": {"path": str(model_dir), "served_name": MODEL}}))
    procs = [
        spawn([sys.executable, str(ROOT / "tests/gateway/fake_worker.py"), "--port", str(worker_port),
               "--reply-ids", ",".join(map(str, reply_ids))], tmp / "worker.log"),
        spawn([sys.executable, *(["-m", "cProfile", "-o", args.profile] if args.profile else []), "-m", "kvserving.cli", "gateway", "--config", str(tmp / "config.json"),
               "--port", str(gw_port), "--decode", worker_url, "--log-level", "warning"], tmp / "gateway.log"),
    ]
    try:
        wait_ready(worker_url, procs[0], tmp / "worker.log")
        wait_ready(gw_url, procs[1], tmp / "gateway.log")
        rows = []
        for n in [int(x) for x in args.sessions.split(",")]:
            direct: list[float] = []
            gateway: list[float] = []
            gw_cpu = 0.0
            for _ in range(args.rounds):  # interleave so drift on a shared machine hits both alike
                plan = bodies(n, args.turns, reply, tagger, via_gateway=False)
                direct += asyncio.run(measure(worker_url, plan, via_gateway=False))
                plan = bodies(n, args.turns, reply, tagger, via_gateway=True)
                before = cpu_s(procs[1].pid)
                gateway += asyncio.run(measure(gw_url, plan, via_gateway=True))
                gw_cpu += cpu_s(procs[1].pid) - before
            rows.append((n, len(gateway), direct, gateway, gw_cpu / len(gateway)))
        print(f"gateway overhead: TTFT through the gateway minus straight to the worker "
              f"({args.turns} turns per session, fake worker answering instantly, {os.cpu_count()} cores)\n")
        print("| sessions | requests | direct p50 ms | direct p99 ms | gateway p50 ms | gateway p99 ms "
              "| added p50 ms | added p99 ms | gateway CPU ms/request |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for n, count, direct, gateway, cpu in rows:
            d50, d99, g50, g99 = (1e3 * pct(v, q) for v, q in ((direct, 0.5), (direct, 0.99), (gateway, 0.5), (gateway, 0.99)))
            print(f"| {n} | {count} | {d50:.2f} | {d99:.2f} | {g50:.2f} | {g99:.2f} | {g50 - d50:.2f} | {g99 - d99:.2f} "
                  f"| {1e3 * cpu:.2f} |")
        print(f"\nmean direct {1e3 * statistics.mean(rows[-1][2]):.2f} ms, gateway {1e3 * statistics.mean(rows[-1][3]):.2f} ms "
              f"at {rows[-1][0]} sessions")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
