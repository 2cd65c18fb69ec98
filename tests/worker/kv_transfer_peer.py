"""A KV-transfer test host: engines with a ``KVTransfer`` each, behind a tiny
stdlib HTTP server with the endpoints a peer worker calls (GET /internal/kv/agent,
POST .../renew, POST .../hold, DELETE /internal/kv/leases/{id}).

The test process imports it (by path) to host workers in-process; run as a
script it is the other process: it reads one JSON command per stdin line and
answers one JSON line on stdout (first line: ``{"port": P}``).
Worker ``name`` is served under ``http://127.0.0.1:P/w/<name>``.
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from kvserving.config import KVCacheConfig, ModelConfig, ReuseConfig, SchedulerConfig, ServingConfig
from kvserving.worker.engine import LLMEngine
from kvserving.worker.kv.leases import LeaseMismatchError
from kvserving.worker.kv.transfer import KVTransfer
from kvserving.worker.kv.protocol import KVTransferParams
from kvserving.worker.peers import PeerSet, url_key
from kvserving.worker.sampling import SamplingParams

torch.set_num_threads(1)
REPLY = "@@ "  # marks answer lines (libraries may print to stdout too)


def serving_config(spec: dict[str, Any]) -> ServingConfig:
    """The engine config of a test worker (and of its reference engine)."""
    retention = spec.get("retention_ttl_s", 480.0)
    reuse = ReuseConfig(
        retention_ttl_s=retention,
        lease_ttl_s=retention * 0.9,
        recompute_threshold_tokens=spec.get("threshold", 0),
        transfer_timeout_s=spec.get("transfer_timeout_s", 5.0),
    )
    return ServingConfig(
        model=ModelConfig(path=spec["model"]),
        kv_cache=KVCacheConfig(
            dtype=spec["dtype"], memory_bytes=spec.get("memory_bytes", 4 << 20), layout=spec.get("layout", "layer_major")
        ),
        reuse=reuse,
        scheduler=SchedulerConfig(chunk_size=512, max_num_batched_tokens=512),
    )


class LoopbackPeers(PeerSet):
    """Every worker on this machine's loopback is a peer: the hosts of these tests serve theirs
    on ports picked at start (the peer rule itself is tested in test_peers.py)."""

    def allows(self, url: str) -> bool:
        key = url_key(url)
        return key is not None and key[1] == "127.0.0.1"


class Worker:
    """One engine + KVTransfer; ``lock`` serialises engine access (steps and KVTransfer hops)."""

    def __init__(self, url: str, spec: dict[str, Any], **kvt_kwargs: Any) -> None:
        self.lock = threading.RLock()
        cfg = serving_config(spec)
        self.engine = LLMEngine(cfg)
        kvt_kwargs.setdefault("peers", LoopbackPeers())
        self.kvt = KVTransfer(
            self.engine,
            cfg.reuse,
            engine_id=spec["engine_id"],
            agent_url=url,
            role=spec.get("role", "both"),
            run_on_engine=self._locked,
            **kvt_kwargs,
        )

    def _locked(self, fn: Any) -> Any:
        with self.lock:
            return fn()

    def generate(self, cmd: dict[str, Any]) -> dict[str, Any]:
        params = KVTransferParams.from_dict(cmd["params"]) if cmd.get("params") else None
        ids, tags = cmd["input_ids"], cmd.get("tags")
        spec = self.kvt.retain_spec(conversation_key=cmd.get("conversation_key"), input_ids=ids) if cmd.get("retain") else None
        rid = cmd["request_id"]

        def add(pin: str | None) -> None:  # on the engine thread (under ``lock``)
            sampling = SamplingParams(max_tokens=cmd["max_tokens"], ignore_eos=True)
            self.engine.add_request(rid, ids, sampling, tags=tags, retain=spec, admission_pin=pin)

        # as the worker server does: the pull adds the request in its adopt hop when it pins pages
        res = self.kvt.pull(ids, tags, params, admit=add)
        if not res.admitted:
            with self.lock:
                add(res.admission_pin)
        tokens: list[int] = []
        while True:
            with self.lock:
                outs = self.engine.step()
            done = [o for o in outs if o.request_id == rid]
            for o in done:
                tokens.extend(o.new_token_ids)
            if done and done[-1].finished:
                last = done[-1]
                break
        return {
            "tokens": tokens,
            "cached": last.num_cached_tokens,
            "pulled": last.num_pulled_tokens,
            "computed": last.num_prompt_tokens - last.num_cached_tokens,
            "fallback": res.fallback,
            "skipped": res.skipped,
            "pull_tokens": res.pulled_tokens,
            "bytes": res.num_bytes,
            "regions": res.num_regions,
            "params": self.kvt.params_for(last.retained).to_dict() if last.retained else None,
        }

    def close(self) -> None:
        self.kvt.close()


class Host:
    """Workers by name, served over HTTP on 127.0.0.1 (``port`` 0: a free one)."""

    def __init__(self, port: int = 0) -> None:
        self.workers: dict[str, Worker] = {}
        host = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self) -> tuple[Worker, list[str]] | None:
                parts = self.path.strip("/").split("/")
                if len(parts) < 4 or parts[0] != "w" or parts[1] not in host.workers:
                    self._reply(404, {"error": "no such worker"})
                    return None
                return host.workers[parts[1]], parts[2:]

            def do_GET(self) -> None:  # .../internal/kv/agent or .../internal/kv/leases
                r = self._route()
                if r is None:
                    return
                if r[1][-1] == "leases":
                    self._reply(200, {"leases": r[0].kvt.leases()})
                else:
                    self._reply(200, r[0].kvt.agent_info())

            def do_POST(self) -> None:  # .../internal/kv/leases/{id}/renew or .../hold
                r = self._route()
                if r is None:
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                try:
                    if r[1][-1] == "hold":
                        self._reply(
                            200, r[0].kvt.hold(r[1][3], digest=body["digest"], hold_s=body["hold_s"], consume=body.get("consume", False))
                        )
                    else:
                        self._reply(200, {"lease_id": r[1][3], "expires_at": r[0].kvt.renew(r[1][3])})
                except KeyError:
                    self._reply(404, {"error": "unknown lease"})
                except LeaseMismatchError:
                    self._reply(409, {"error": "lease mismatch"})

            def do_DELETE(self) -> None:
                r = self._route()
                if r is None:
                    return
                try:
                    r[0].kvt.release(r[1][3])
                    self._reply(200, {"lease_id": r[1][3], "released": True})
                except KeyError:
                    self._reply(404, {"error": "unknown lease"})

        ThreadingHTTPServer.allow_reuse_address = True
        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/w/{name}"

    def open(self, name: str, spec: dict[str, Any], **kvt_kwargs: Any) -> Worker:
        self.workers[name] = Worker(self.url(name), spec, **kvt_kwargs)
        return self.workers[name]

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "open":
            self.open(cmd["name"], cmd["spec"])
            return {"ok": True}
        w = self.workers[cmd["name"]]
        if op == "generate":
            return w.generate(cmd)
        if op == "leases":
            return {"leases": w.kvt.leases(cmd.get("conversation_key"))}
        if op == "release":
            w.kvt.release(cmd["lease_id"])
            return {"ok": True}
        if op == "stats":
            return w.kvt.stats()
        raise ValueError(f"unknown op {op!r}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        for w in self.workers.values():
            w.close()


def main() -> None:
    host = Host(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    print(REPLY + json.dumps({"port": host.port}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            out = host.handle(cmd)
        except Exception as exc:  # noqa: BLE001 - report to the test, keep serving
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(REPLY + json.dumps(out), flush=True)
    host.close()


if __name__ == "__main__":
    main()
