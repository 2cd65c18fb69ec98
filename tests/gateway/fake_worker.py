"""A deterministic fake of the worker HTTP API (docs/worker-api.md), served by
a real uvicorn on 127.0.0.1, for the gateway's tests and overhead benchmark.

What it does, exactly:

- generate: refuses unknown fields (422), empty input ids (422), a duplicate
  in-flight request id (409); keeps a prefix cache of every full prompt page
  it saw, keyed by a hash chained over token ids (``PAGE_SIZE`` 16); a
  prompt's leading pages in
  that cache are ``local_cached_tokens``; with ``kv_transfer_params`` it
  "pulls" the following pages whose hashes equal the params' (unexpired), which
  are ``remote_pulled_tokens``; the rest is ``computed_prompt_tokens``;
- it answers ``reply_ids`` (cut at ``max_tokens``: ``length``; else ``stop``),
  one token event each ``token_delay_s`` apart; a request with ``output_ids``
  (the prefill's first token) continues after them;
- a prefill-role fake holds the prompt's pages under a transfer lease; a
  decode/both fake with ``retain`` and a conversation key holds prompt +
  output under a retention lease (replacing the conversation's previous one);
- leases can be listed by conversation key, renewed (404 unknown) and
  released; every request body is logged in ``received`` (unless
  ``keep_received`` is off, as in the benchmark's process) and every request
  whose client went away before its end in ``aborted``;
- failure injection: ``fail_status`` (refuse before streaming),
  ``fail_after_tokens`` (an error event mid-stream), ``ready`` False (503),
  ``pull_fallback`` (every pull fails with that ``usage.reuse_fallback``),
  ``pull_delay_s`` (a pull takes that long behind the headers: one from a frozen holder),
  ``answer_after_s`` (response headers that late: a frozen worker), ``ready_delay_s``
  (``/ready`` answered that late: a busy one), ``health_delay_s`` (``/health``
  answered that late: frozen to the gateway's probe), ``keepalive_s``
  (a ``: keep-alive`` comment every so often before each token, for ``token_delay_s``),
  ``stall_after_tokens`` (silent after that many tokens, connection open, and ``/health``
  unanswered from then on: frozen mid-stream).
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from kvserving.local.stack import free_port

PAGE_SIZE = 16
GENERATE_FIELDS = {
    "request_id",
    "input_ids",
    "tags",
    "sampling",
    "kv_transfer_params",
    "conversation_key",
    "retain",
    "output_ids",
    "cache_salt",
}


def page_hashes(ids: list[int], *, page_size: int = PAGE_SIZE) -> list[int]:
    """Chained hashes of the full pages of ``ids``."""
    out: list[int] = []
    prev = b""
    for start in range(0, len(ids) - len(ids) % page_size, page_size):
        page = ",".join(map(str, ids[start : start + page_size])).encode()
        digest = hashlib.blake2b(prev + page, digest_size=8).digest()
        out.append(int.from_bytes(digest, "big") >> 1)
        prev = digest
    return out


@dataclass
class FakeLease:
    lease_id: str
    conversation_key: str | None
    hashes: list[int]
    expires_at: float


@dataclass
class FakeWorker:
    role: str = "both"
    reply_ids: list[int] = field(default_factory=lambda: [11, 12, 13, 14])
    token_delay_s: float = 0.0
    retention_ttl_s: float = 480.0
    transfer_ttl_s: float = 10.0
    fail_status: int | None = None
    fail_after_tokens: int | None = None
    ready: bool = True
    pull_fallback: str | None = None
    pull_delay_s: float = 0.0
    answer_after_s: float = 0.0
    ready_delay_s: float = 0.0
    health_delay_s: float = 0.0
    keepalive_s: float = 0.0
    stall_after_tokens: int | None = None
    url: str = ""
    cache: set[int] = field(default_factory=set)
    leases: dict[str, FakeLease] = field(default_factory=dict)
    received: list[dict[str, Any]] = field(default_factory=list)
    # the tests read ``received``; the benchmark's process keeps no bodies (a list that grows by
    # every request makes its full collections longer and longer: 176 ms at 9,000 bodies)
    keep_received: bool = True
    aborted: list[str] = field(default_factory=list)
    renewals: list[str] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)
    inflight: set[str] = field(default_factory=set)
    _next_lease: int = 0

    # -------------------------------------------------------------- helpers
    def params(self, lease: FakeLease) -> dict[str, Any]:
        return {
            "engine_id": f"fake-{self.url}",
            "agent_url": self.url,
            "lease_id": lease.lease_id,
            "page_ids": list(range(len(lease.hashes))),
            "page_hashes": list(lease.hashes),
            "num_tokens": len(lease.hashes) * PAGE_SIZE,
            "page_size": PAGE_SIZE,
            "dtype": "bf16",
            "layout_hash": "fake",
            "expires_at": lease.expires_at,
        }

    def _new_lease(self, key: str | None, hashes: list[int], ttl_s: float) -> FakeLease:
        self._next_lease += 1
        lease = FakeLease(f"{self.role}-{self._next_lease}", key, hashes, time.time() + ttl_s)
        self.leases[lease.lease_id] = lease
        return lease

    def _usage(self, ids: list[int], pull: dict[str, Any] | None) -> tuple[dict[str, Any], list[int]]:
        hashes = page_hashes(ids)
        local = 0
        while local < len(hashes) and hashes[local] in self.cache:
            local += 1
        remote, fallback = 0, None
        if pull:
            theirs = list(pull.get("page_hashes") or [])
            if self.pull_fallback is not None:
                fallback = self.pull_fallback
            elif float(pull.get("expires_at") or 0) <= time.time():
                fallback = "lease_expired"
            else:
                match = 0
                while match < min(len(theirs), len(hashes)) and theirs[match] == hashes[match]:
                    match += 1
                remote = max(0, match - local)
        self.cache.update(hashes)  # matched, pulled and computed full pages alike
        usage = {
            "prompt_tokens": len(ids),
            "completion_tokens": 0,
            "local_cached_tokens": local * PAGE_SIZE,
            "remote_pulled_tokens": remote * PAGE_SIZE,
            "computed_prompt_tokens": len(ids) - (local + remote) * PAGE_SIZE,
            "kv_bytes_pulled": remote * 1024,
            "kv_regions_pulled": 1 if remote else 0,
            "reuse_fallback": fallback,
        }
        return usage, hashes

    # ---------------------------------------------------------------- app
    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict[str, str]:
            if self.health_delay_s:
                await asyncio.sleep(self.health_delay_s)
            return {"status": "ok"}

        @app.get("/ready")
        async def ready() -> JSONResponse:
            if self.ready_delay_s:
                await asyncio.sleep(self.ready_delay_s)
            return JSONResponse({"ready": self.ready}, status_code=200 if self.ready else 503)

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            return PlainTextResponse("")

        @app.get("/internal/kv/leases")
        async def list_leases(conversation_key: str | None = None) -> dict[str, Any]:
            now = time.time()
            leases = [
                {
                    "lease_id": lease.lease_id,
                    "conversation_key": lease.conversation_key,
                    "num_pages": len(lease.hashes),
                    "num_tokens": len(lease.hashes) * PAGE_SIZE,
                    "expires_at": lease.expires_at,
                    "kv_transfer_params": self.params(lease),
                }
                for lease in self.leases.values()
                if lease.expires_at > now and (conversation_key is None or lease.conversation_key == conversation_key)
            ]
            return {"leases": leases}

        @app.post("/internal/kv/leases/{lease_id}/renew")
        async def renew(lease_id: str, request: Request) -> JSONResponse:
            lease = self.leases.get(lease_id)
            if lease is None or lease.expires_at <= time.time():
                return _error(404, f"unknown lease {lease_id}")
            body = json.loads(await request.body() or b"{}")
            ttl = min(float(body.get("ttl_s") or self.retention_ttl_s), self.retention_ttl_s)
            lease.expires_at = time.time() + ttl
            self.renewals.append(lease_id)
            return JSONResponse({"lease_id": lease_id, "expires_at": lease.expires_at})

        @app.delete("/internal/kv/leases/{lease_id}")
        async def release(lease_id: str) -> JSONResponse:
            if self.leases.pop(lease_id, None) is None:
                return _error(404, f"unknown lease {lease_id}")
            self.releases.append(lease_id)
            return JSONResponse({"lease_id": lease_id, "released": True})

        @app.post("/internal/generate", response_model=None)
        async def generate(request: Request) -> JSONResponse | StreamingResponse:
            body = await request.json()
            if self.keep_received:
                self.received.append(body)
            if self.answer_after_s:
                await asyncio.sleep(self.answer_after_s)
            if not self.ready:
                return _error(503, "not ready")
            if self.fail_status is not None:
                return _error(self.fail_status, "injected failure")
            unknown = set(body) - GENERATE_FIELDS
            if unknown or not body.get("input_ids"):
                return _error(422, f"bad body: unknown {sorted(unknown)}")
            rid = body["request_id"]
            if rid in self.inflight:
                return _error(409, f"duplicate request id {rid}")
            self.inflight.add(rid)
            return StreamingResponse(self._stream(body), media_type="text/event-stream")

        return app

    async def _stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        rid, ids = body["request_id"], list(body["input_ids"])
        sampling = body.get("sampling") or {}
        max_tokens = int(sampling.get("max_tokens") or 16)
        finished = False
        try:
            if self.pull_delay_s and body.get("kv_transfer_params"):
                await asyncio.sleep(self.pull_delay_s)
            usage, hashes = self._usage(ids, body.get("kv_transfer_params"))
            given = list(body.get("output_ids") or [])  # the prefill's first token, already streamed
            out = self.reply_ids[len(given) : max_tokens]
            for i, token in enumerate(out):
                if self.fail_after_tokens is not None and i == self.fail_after_tokens:
                    finished = True
                    yield _sse({"error": {"message": "injected mid-stream failure", "type": "server_error", "code": None}})
                    return
                if self.stall_after_tokens is not None and i == self.stall_after_tokens:
                    self.health_delay_s = max(self.health_delay_s, 5.0)  # the whole process is frozen
                    await asyncio.sleep(3600)
                waited = 0.0
                while self.keepalive_s and waited + self.keepalive_s < self.token_delay_s:
                    await asyncio.sleep(self.keepalive_s)
                    waited += self.keepalive_s
                    yield b": keep-alive\n\n"
                if self.token_delay_s > waited:
                    await asyncio.sleep(self.token_delay_s - waited)
                yield _sse({"request_id": rid, "token_ids": [token]})
            reason = "length" if len(self.reply_ids) > max_tokens else "stop"
            usage["completion_tokens"] = len(given) + len(out)
            params = self._keep(body, ids + given + out, hashes)
            finished = True
            yield _sse({"request_id": rid, "token_ids": [], "finish_reason": reason, "usage": usage, "kv_transfer_params": params})
            yield b"data: [DONE]\n\n"
        finally:
            self.inflight.discard(rid)
            if not finished:
                self.aborted.append(rid)

    def _keep(self, body: dict[str, Any], all_ids: list[int], prompt_hashes: list[int]) -> dict[str, Any] | None:
        if self.role == "prefill":
            return self.params(self._new_lease(None, prompt_hashes, self.transfer_ttl_s))
        key = body.get("conversation_key")
        if not body.get("retain") or not key:
            return None
        for old in [lease for lease in self.leases.values() if lease.conversation_key == key]:
            del self.leases[old.lease_id]
        hashes = page_hashes(all_ids)
        self.cache.update(hashes)
        return self.params(self._new_lease(key, hashes, self.retention_ttl_s))


def _sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": None}}, status_code=status)


class ServerThread:
    """Serve an ASGI app with uvicorn on 127.0.0.1 in a daemon thread (bounded start and stop)."""

    def __init__(self, app: Any, *, port: int | None = None, timeout_keep_alive: int = 5) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on", timeout_keep_alive=timeout_keep_alive
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, *, timeout_s: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"server on {self.url} did not start in {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self, *, timeout_s: float = 10.0, wait_for_requests: bool = True) -> None:
        """Stop serving; ``wait_for_requests=False`` ends requests still in flight instead of waiting for
        them (a frozen fake's health answer or stream sleeps for seconds to an hour)."""
        self.server.force_exit = not wait_for_requests
        self.server.should_exit = True
        self.thread.join(timeout_s)


def start_fake(worker: FakeWorker, *, timeout_keep_alive: int = 5) -> ServerThread:
    """Start ``worker`` on a free port; sets ``worker.url``. ``timeout_keep_alive``: how long it keeps an
    idle connection (a worker's WORKER_KEEP_ALIVE_S by default)."""
    server = ServerThread(worker.app(), timeout_keep_alive=timeout_keep_alive)
    worker.url = server.url
    return server.start()


def main() -> None:
    """``python tests/gateway/fake_worker.py --port P [--reply-ids 1,2,3]``: serve one fake (the benchmark's worker)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--role", default="both", choices=("prefill", "decode", "both"))
    parser.add_argument("--reply-ids", default="11,12,13,14")
    parser.add_argument("--token-delay-ms", type=float, default=0.0, help="wait before each token (a decode step)")
    args = parser.parse_args()
    worker = FakeWorker(role=args.role, reply_ids=[int(t) for t in args.reply_ids.split(",")])
    worker.token_delay_s = args.token_delay_ms / 1e3
    worker.url = f"http://127.0.0.1:{args.port}"
    worker.keep_received = False
    # what was built at start is never collected again; collections scan only what requests keep
    # (as the gateway's and the floor's processes do: neither side of the comparison pays more)
    gc.collect()
    gc.freeze()
    uvicorn.run(worker.app(), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
