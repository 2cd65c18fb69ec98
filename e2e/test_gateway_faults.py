"""The gateway's bounded stalls and its drain, with real processes (`kvserving
gateway`, one prefill and two decode `kvserving worker`s, NIXL on CPU memory,
the built-in tiny model), driven by the official `openai` client and raw SSE:

- a lease holder frozen (SIGSTOP) before a conversation's second turn costs
  that turn a recompute on the other decode worker, with the tokens of a
  fault-free run, within twice its fault-free time, counted once as
  ``holder_unresponsive``; a busy holder is not taken for frozen: its turn
  keeps its reuse (the cached tokens of a run without the load);
- a decode worker killed before its part of a turn is retried on the other
  one before its first byte: the client sees one whole, clean stream;
- SIGTERM: no new connection, a short stream finishes, a long one ends with an
  SSE error event (code ``gateway_draining``) at the grace, never a bare
  close, and the gateway exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvs_workers import WorkerFactory, WorkerProc
from test_gateway_e2e import MODEL, GatewayProc, metric

WORKER: dict[str, Any] = {
    "model": {"max_model_len": 1024, "served_name": MODEL},
    "kv_cache": {"dtype": "bf16", "memory_bytes": 16 << 20},
    "reuse": {"recompute_threshold_tokens": 0, "transfer_timeout_s": 2.0},
}
NOISE_S = 0.05  # a turn's time varies this much between runs on the shared CPU machine
ATTEMPTS = 3  # timed pairs of a frozen-holder case before it fails
FIRST_BYTE_S = 4.0  # > the prefill's pull from a frozen holder (the workers' 2 s peer deadline) with room for a loaded machine
SYSTEM = {"role": "system", "content": "You are a coding agent. Work step by step and use the tools. " * 6}
TURNS = [
    {"role": "user", "content": "Find the failing test in the repository and explain it."},
    {"role": "user", "content": "Now look at the next file and report back."},
]


def gateway_config(**gateway: Any) -> dict[str, Any]:
    # Health polls far apart: what the gateway learns of a fault here, it learns from the turn itself.
    return {**WORKER, "gateway": {"first_byte_timeout_s": FIRST_BYTE_S, "event_timeout_s": 4.0, "health_interval_s": 30.0, **gateway}}


@pytest.fixture(scope="module")
def pd(workers: WorkerFactory) -> tuple[WorkerProc, list[WorkerProc]]:
    """One prefill and two decode workers, the decode workers in the router's tie order (URL)."""
    prefill = workers.start("prefill", WORKER, wait=False)
    decoders = [workers.start("decode", WORKER, wait=False) for _ in range(2)]
    for w in (prefill, *decoders):
        w.wait_ready()
    return prefill, sorted(decoders, key=lambda w: w.url)


def start_gateway(tmp: Path, model_dir: Path, prefill: WorkerProc, decoders: list[WorkerProc], **gateway: Any) -> GatewayProc:
    tmp.mkdir(parents=True, exist_ok=True)
    token_file = tmp / "internal-token"  # the workers' credential, as their factory gave it to them
    token_file.write_text(prefill.headers["Authorization"].removeprefix("Bearer "))
    gw = GatewayProc(
        tmp, model_dir, prefill=prefill.url, decode=[d.url for d in decoders], token_file=token_file, config=gateway_config(**gateway)
    )
    gw.wait_ready()
    return gw


def served(worker: WorkerProc) -> float:
    """Requests the worker has finished (any finish reason)."""
    text = httpx.get(worker.url + "/metrics", timeout=10).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == "kvserving_worker_requests_total")


def sse_lines(
    url: str, body: dict[str, Any], out: list[str], errors: list[BaseException], *, started: threading.Event | None = None
) -> None:
    """The `data:` lines of one streamed completion (into ``out``); a transport error (a bare close
    mid-body among them) into ``errors``."""
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.append(line[6:])
                    if started is not None:
                        started.set()
    except BaseException as exc:  # noqa: BLE001 - reported to the test thread
        errors.append(exc)
    finally:
        if started is not None:
            started.set()


def content(lines: list[str]) -> str:
    return "".join(
        json.loads(x)["choices"][0]["delta"].get("content") or "" for x in lines if x != "[DONE]" and json.loads(x).get("choices")
    )


def worker_metric(worker: WorkerProc, name: str, **labels: str) -> float:
    return metric(worker.url, name, **labels)


def upstream_errors(url: str) -> float:
    """The gateway's failed worker calls, every kind."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == "kvserving_gateway_upstream_errors_total"
    )


def test_a_frozen_lease_holder_costs_the_turn_a_recompute_on_the_other_decode_worker(
    pd: tuple[WorkerProc, list[WorkerProc]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A two-turn conversation, fault-free and with its holder frozen (SIGSTOP) before turn 2, in
    two cases. Cold (a ``cache_salt`` of its own): the prefill's pull from the holder waits, and
    the holder check's verdict ends that prefill and sends it again without the lease. Warm (the
    reference run's cache: the prefill holds every page, nothing to pull): the verdict, in during
    the prefill, sends the decode to the other worker, never to the holder. Each frozen turn gives
    the client the tokens of the fault-free run within twice the time of the same turn without
    the fault, plus NOISE_S."""
    prefill, decoders = pd
    # health polls every second: a holder thawed between the runs is back in the rotation soon
    gw = start_gateway(tmp_path / "gw", tiny_model_dir, prefill, decoders, health_interval_s=1.0)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=120)
    frozen: WorkerProc | None = None

    def all_healthy() -> None:
        deadline = time.monotonic() + 30
        while metric(gw.url, "kvserving_gateway_workers_healthy", role="decode") != 2:
            assert time.monotonic() < deadline, "a decode worker did not come back into the rotation"
            time.sleep(0.2)

    def conversation(session: str, salt: str, *, freeze: bool = False, stream: bool = False) -> tuple[list[str], float]:
        """Two greedy turns (24 tokens: the reply fills a page the prefill did not compute) under
        ``cache_salt`` ``salt``; the replies and the second turn's seconds; ``stream``: the second
        turn streamed, its reply the concatenation of its deltas (a token relayed twice would show)."""
        nonlocal frozen
        all_healthy()
        messages: list[dict[str, Any]] = [SYSTEM]
        replies, elapsed = [], 0.0
        for i, user in enumerate(TURNS):
            before = [served(d) for d in decoders] if freeze and i == 0 else []
            messages.append(user)
            t0 = time.monotonic()
            args: dict[str, Any] = dict(
                model=MODEL,
                messages=messages,
                max_tokens=24,
                temperature=0,
                extra_headers={"X-Session-ID": session},
                extra_body={"ignore_eos": True, "cache_salt": salt},
            )
            if stream and i == 1:
                chunks = list(client.chat.completions.create(stream=True, **args))
                finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
                assert finishes == ["length"], finishes
                replies.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
            else:
                out = client.chat.completions.create(**args)
                replies.append(out.choices[0].message.content or "")
            elapsed = time.monotonic() - t0
            messages.append({"role": "assistant", "content": replies[-1]})
            if freeze and i == 0:  # the decode worker that served turn 1 holds the conversation's lease
                (frozen,) = [d for d, n in zip(decoders, before) if served(d) > n]
                os.kill(frozen.proc.pid, signal.SIGSTOP)
        if frozen is not None:
            os.kill(frozen.proc.pid, signal.SIGCONT)
            frozen = None
        return replies, elapsed

    def fallbacks() -> float:
        return metric(gw.url, "kvserving_gateway_reuse_fallbacks_total", reason="holder_unresponsive")

    def within_bound(case: str, salt: str, *, warm: bool) -> None:
        """A fault-free turn 2 and the same turn with the holder frozen, each timed; up to ATTEMPTS
        pairs until the frozen one is within the bound (a regression misses it every time; one
        noisy pair on a loaded 2-core machine missed it by 73 ms). Every frozen turn is counted
        once and gives the reference. A pull the worker's own peer deadline ended instead of the verdict
        (the gateway starved of CPU for seconds on an overloaded machine) is a correct turn that shows
        nothing of the verdict: that pair is timed again too.

        The bound: twice the fault-free turn (the verdict takes FROZEN_FLOOR_S, mostly beside the
        prefill; then the turn's prefill or decode runs again), plus NOISE_S: the reference is one
        turn's time on a shared 2-core machine. (Unbounded, the case hung until the client gave up,
        102 s; with a fixed 1 s /health deadline it took 1.42-1.51 s against 0.17-0.21 s.)"""
        times: list[tuple[float, float, bool]] = []  # (frozen s, fault-free s, ended by the verdict)
        for attempt in range(ATTEMPTS):
            counted = fallbacks()
            unreachable = worker_metric(prefill, "kvserving_worker_kv_reuse_fallbacks_total", reason="remote_unreachable")
            ref_salt, frozen_salt = (salt, salt) if warm else (f"{salt}-ref-{attempt}", f"{salt}-frozen-{attempt}")
            replies, normal = conversation(f"{case}-fault-free-{attempt}", ref_salt)
            assert replies == reference
            replies, t_frozen = conversation(f"{case}-frozen-{attempt}", frozen_salt, freeze=True, stream=warm)
            assert replies == reference
            assert fallbacks() == counted + 1
            # the pull dropped at the verdict, not ended by the worker's peer deadline
            by_verdict = worker_metric(prefill, "kvserving_worker_kv_reuse_fallbacks_total", reason="remote_unreachable") == unreachable
            times.append((t_frozen, normal, by_verdict))
            print(f"turn 2, {case}: holder frozen {t_frozen:.2f} s against {normal:.2f} s fault-free, by verdict: {by_verdict}")
            if by_verdict and t_frozen <= 2 * normal + NOISE_S:
                return
        raise AssertionError(f"{case}: no frozen turn ended by the verdict within twice its fault-free time: {times}")

    try:
        # the reference: fault-free, cold; its cache (salt "a") is the warm case's below
        reference, _ = conversation("reference", "a")
        # cold: the prefill's pull waits on the frozen holder; the holder check's verdict ends it first
        # and the prefill runs again without the lease
        within_bound("at-pull", "cold", warm=False)
        # warm (the prefill holds every page): nothing to pull; the verdict sends the decode (streamed:
        # a token relayed twice would show) to the other worker, never to the holder
        within_bound("at-decode", "a", warm=True)
        assert upstream_errors(gw.url) == 0
    finally:
        if frozen is not None:
            os.kill(frozen.proc.pid, signal.SIGCONT)
        gw.stop()


# Long requests kept in flight on a busy holder, each a LOAD_PROMPT_TOKENS prompt and LOAD_TOKENS
# generated (4 x 500 tokens of KV: half its pool): its engine thread is never idle.
LOAD_STREAMS = 4
LOAD_PROMPT_TOKENS, LOAD_TOKENS = 200, 300


def test_a_busy_lease_holder_is_not_taken_for_frozen_and_keeps_its_reuse(
    pd: tuple[WorkerProc, list[WorkerProc]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The holder of a conversation's lease kept busy (LOAD_STREAMS long requests sent to it
    directly) answers /health late, but within the holder check's floor: turn 2 pulls its KV and
    decodes on it, with the replies and cached tokens of the same conversation without the load
    (under another ``cache_salt``: a cache of its own, as cold)."""
    prefill, decoders = pd
    gw = start_gateway(tmp_path / "gw", tiny_model_dir, prefill, decoders)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=120)
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def turn(messages: list[dict[str, Any]], salt: str) -> tuple[str, int]:
        out = client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=24,
            temperature=0,
            extra_headers={"X-Session-ID": salt},
            extra_body={"ignore_eos": True, "cache_salt": salt},
        )
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        reply = out.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": reply})
        return reply, out.usage.prompt_tokens_details.cached_tokens or 0

    def keep_busy(worker: WorkerProc, i: int) -> None:
        n = 0
        while not stop.is_set():
            ids = [(i * 131 + n * 17 + k * 7) % 3500 + 300 for k in range(LOAD_PROMPT_TOKENS)]
            body = {"request_id": f"busy-{i}-{n}", "input_ids": ids, "sampling": {"max_tokens": LOAD_TOKENS, "ignore_eos": True}}
            with httpx.stream("POST", worker.url + "/internal/generate", json=body, headers=worker.headers, timeout=120) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        break
            n += 1

    try:
        deadline = time.monotonic() + 30
        while metric(gw.url, "kvserving_gateway_workers_healthy", role="decode") != 2:
            assert time.monotonic() < deadline, "a decode worker is not in the rotation"
            time.sleep(0.2)
        reference: list[tuple[str, int]] = []
        messages: list[dict[str, Any]] = [SYSTEM, TURNS[0]]
        reference.append(turn(messages, "fault-free"))
        messages.append(TURNS[1])
        reference.append(turn(messages, "fault-free"))

        before = [served(d) for d in decoders]
        messages = [SYSTEM, TURNS[0]]
        busy = [turn(messages, "busy")]
        (holder,) = [d for d, n in zip(decoders, before) if served(d) > n]
        (other,) = [d for d in decoders if d is not holder]
        threads += [threading.Thread(target=keep_busy, args=(holder, i), daemon=True) for i in range(LOAD_STREAMS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while worker_metric(holder, "kvserving_worker_queue_depth", state="running") < LOAD_STREAMS:
            assert time.monotonic() < deadline, "the holder never took the load"
            time.sleep(0.1)
        health_s = []
        with httpx.Client(timeout=10) as probe:  # how late the busy holder answers /health (for the record)
            for _ in range(20):
                t0 = time.perf_counter()
                probe.get(holder.url + "/health")
                health_s.append(time.perf_counter() - t0)
        other_served = served(other)
        messages.append(TURNS[1])
        busy.append(turn(messages, "busy"))
        assert served(other) == other_served  # the decode stayed on the holder
        print(f"busy holder: /health {min(health_s) * 1e3:.1f}-{max(health_s) * 1e3:.1f} ms; turns (reply, cached): {busy}")
        assert busy == reference, (busy, reference)
        assert reference[1][1] > reference[0][1]  # turn 2 reused turn 1 and its reply (pulled from the holder)
        assert metric(gw.url, "kvserving_gateway_reuse_fallbacks_total", reason="holder_unresponsive") == 0
        assert upstream_errors(gw.url) == 0
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        gw.stop()


def test_a_killed_decode_worker_is_left_for_the_other_before_its_first_byte(
    pd: tuple[WorkerProc, list[WorkerProc]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    prefill, decoders = pd
    for d in decoders:  # (a worker frozen by the test before has caught up)
        d.wait_ready(timeout=60)
    gw = start_gateway(tmp_path / "gw", tiny_model_dir, prefill, decoders)
    try:
        body = {"model": MODEL, "messages": [SYSTEM, TURNS[0]], "max_tokens": 8, "temperature": 0, "stream": True}

        def stream(session: str) -> tuple[list[str], list[BaseException]]:
            lines: list[str] = []
            errors: list[BaseException] = []
            sse_lines(gw.url, {**body, "user": session}, lines, errors)
            return lines, errors

        reference, errors = stream("first")  # a new gateway's first conversation: decoders[0] (ties go by URL)
        assert not errors and reference[-1] == "[DONE]"
        decoders[1].kill()  # the next new conversation's decode worker (fewer leases), not yet known dead
        lines, errors = stream("second")
        assert not errors and lines[-1] == "[DONE]"
        assert not any("error" in json.loads(x) for x in lines[:-1])
        assert content(lines) == content(reference)
        assert metric(gw.url, "kvserving_gateway_upstream_errors_total", kind="connect") == 1
        assert metric(gw.url, "kvserving_gateway_routing_decisions_total", role="retry", reason="connect") == 1
        assert metric(gw.url, "kvserving_gateway_requests_total", route="/v1/chat/completions", code="200") == 2
    finally:
        gw.stop()


GRACE_S = 2.0


def test_sigterm_lets_a_short_stream_finish_and_ends_long_ones_with_an_error_at_the_grace(
    pd: tuple[WorkerProc, list[WorkerProc]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    prefill, decoders = pd
    alive = [d for d in decoders if d.proc.poll() is None]
    gw = start_gateway(tmp_path / "gw", tiny_model_dir, prefill, alive, drain_grace_s=GRACE_S)
    try:

        def body(max_tokens: int) -> dict[str, Any]:
            return {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Count."}],
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
            }

        whole: list[httpx.Response] = []  # a long request that is not streamed: no byte before its end
        whole_thread = threading.Thread(
            target=lambda: whole.append(httpx.post(gw.url + "/v1/chat/completions", json={**body(950), "stream": False}, timeout=120)),
            daemon=True,
        )
        whole_thread.start()
        runs: dict[str, tuple[list[str], list[BaseException], threading.Event, threading.Thread]] = {}
        for name, max_tokens in (("long", 950), ("short", 16)):
            lines: list[str] = []
            errors: list[BaseException] = []
            started = threading.Event()
            thread = threading.Thread(
                target=sse_lines, args=(gw.url, body(max_tokens), lines, errors), kwargs={"started": started}, daemon=True
            )
            thread.start()
            assert started.wait(60) and not errors, errors
            runs[name] = (lines, errors, started, thread)
        t0 = time.monotonic()
        gw.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while True:  # no new connection once it drains
            try:
                httpx.get(gw.url + "/health", timeout=1)
            except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):  # refused, or closed unanswered
                break
            assert time.monotonic() < deadline, "the gateway still accepts connections after SIGTERM"
            time.sleep(0.05)
        runs["long"][3].join(GRACE_S + 30)
        long_ended = time.monotonic() - t0
        assert gw.proc.wait(timeout=30) == 0
        for thread in (runs["short"][3], whole_thread):
            thread.join(10)
        short, short_errors = runs["short"][:2]
        assert not short_errors and short[-1] == "[DONE]"
        assert [json.loads(x)["choices"][0]["finish_reason"] for x in short[-2:-1]] == ["length"]
        long, long_errors = runs["long"][:2]
        assert not long_errors, long_errors  # the body ended properly: no bare close
        assert json.loads(long[-1]) == {
            "error": {
                "message": "The gateway is shutting down; send the request again.",
                "type": "service_unavailable_error",
                "param": None,
                "code": "gateway_draining",
            }
        }
        assert "[DONE]" not in long and content(long)  # it had streamed text until the grace was over
        assert GRACE_S - 0.2 <= long_ended <= GRACE_S + 5, long_ended
        (r,) = whole
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert r.json()["error"]["code"] == "gateway_draining"
    finally:
        gw.stop()
