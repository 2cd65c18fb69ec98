"""What workers say to each other about KV pages, apart from the engine state behind it:
``kv_transfer_params`` (the wire form, checked field by field), the layout identity two
workers must share for a page to mean the same (``layout_hash``), and the pooled HTTP
client a puller calls its sender with (DESIGN.md, Worker; docs/worker-api.md). The digest
a hold compares is ``leases.lease_digest``."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from kvserving.config import WORKER_CLIENT_IDLE_S
from kvserving.tags import NUM_TAGS

if TYPE_CHECKING:
    import aiohttp

    from kvserving.worker.engine import LLMEngine

MAX_PAGES = 1 << 20
HTTP_TIMEOUT_S = 2.0
_HASH_LIMIT = 1 << 63


# --------------------------------------------------------------------------- wire params
@dataclass(slots=True, frozen=True)
class KVTransferParams:
    """Where a prompt's KV may be pulled from (docs/worker-api.md)."""

    engine_id: str
    agent_url: str
    lease_id: str
    page_ids: tuple[int, ...]
    page_hashes: tuple[int, ...]
    num_tokens: int
    page_size: int
    dtype: str
    layout_hash: str
    expires_at: float  # unix seconds
    # the deployment's bit-budget cut and the ranking it is a position on (triaxial with
    # bit_budget_control "hold"; both None otherwise): the leader's cut, carried with its pages
    bits_cut: float | None = None
    bits_ranking: str | None = None

    @classmethod
    def from_dict(cls, data: object) -> KVTransferParams:
        """Parse the wire form; ValueError naming the field on any wrong type, value or length."""
        if not isinstance(data, dict):
            raise ValueError(f"kv_transfer_params must be an object, got {type(data).__name__}")
        names = [f for f in cls.__dataclass_fields__]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(f"kv_transfer_params has unknown fields: {unknown}")
        missing = [n for n in names if n not in data and n not in _OPTIONAL]
        if missing:
            raise ValueError(f"kv_transfer_params is missing fields: {missing}")
        for name in ("engine_id", "agent_url", "lease_id", "dtype", "layout_hash"):
            if not isinstance(data[name], str) or not data[name]:
                raise ValueError(f"kv_transfer_params.{name} must be a non-empty string")
        for name in ("num_tokens", "page_size"):
            if not _is_int(data[name]) or data[name] < 0:
                raise ValueError(f"kv_transfer_params.{name} must be an integer >= 0")
        if data["page_size"] < 1:
            raise ValueError("kv_transfer_params.page_size must be >= 1")
        exp = data["expires_at"]
        if isinstance(exp, bool) or not isinstance(exp, (int, float)) or not math.isfinite(exp):
            raise ValueError("kv_transfer_params.expires_at must be a finite number (unix seconds)")
        cut, ranking = data.get("bits_cut"), data.get("bits_ranking")
        if (cut is None) != (ranking is None):
            raise ValueError("kv_transfer_params.bits_cut and bits_ranking come together or not at all")
        if cut is not None:
            if isinstance(cut, bool) or not isinstance(cut, (int, float)) or not math.isfinite(cut) or not 0 <= cut <= NUM_TAGS:
                raise ValueError(f"kv_transfer_params.bits_cut must be a number in [0, {NUM_TAGS}]")
            if not isinstance(ranking, str) or not 1 <= len(ranking) <= 64:
                raise ValueError("kv_transfer_params.bits_ranking must be a non-empty string of at most 64 characters")
        ids = _int_list(data["page_ids"], "page_ids", limit=1 << 31)
        hashes = _int_list(data["page_hashes"], "page_hashes", limit=_HASH_LIMIT)
        if len(hashes) != len(ids):
            raise ValueError(f"kv_transfer_params.page_hashes has {len(hashes)} entries for {len(ids)} page_ids")
        if data["num_tokens"] > len(ids) * data["page_size"]:
            raise ValueError(f"kv_transfer_params.num_tokens ({data['num_tokens']}) exceeds {len(ids)} pages of {data['page_size']}")
        return cls(
            data["engine_id"],
            data["agent_url"],
            data["lease_id"],
            ids,
            hashes,
            data["num_tokens"],
            data["page_size"],
            data["dtype"],
            data["layout_hash"],
            float(exp),
            float(cut) if cut is not None else None,
            ranking,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "agent_url": self.agent_url,
            "lease_id": self.lease_id,
            "page_ids": list(self.page_ids),
            "page_hashes": list(self.page_hashes),
            "num_tokens": self.num_tokens,
            "page_size": self.page_size,
            "dtype": self.dtype,
            "layout_hash": self.layout_hash,
            "expires_at": self.expires_at,
        } | ({"bits_cut": self.bits_cut, "bits_ranking": self.bits_ranking} if self.bits_cut is not None else {})


_OPTIONAL = ("bits_cut", "bits_ranking")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_list(value: object, name: str, *, limit: int) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"kv_transfer_params.{name} must be a list of integers")
    if len(value) > MAX_PAGES:
        raise ValueError(f"kv_transfer_params.{name} has {len(value)} entries (at most {MAX_PAGES})")
    if any(not _is_int(v) or not 0 <= v < limit for v in value):
        raise ValueError(f"kv_transfer_params.{name} must hold integers in [0, {limit})")
    return tuple(value)


# --------------------------------------------------------------------------- layout identity
def weights_identity(model_dir: str | Path) -> str:
    """Hex digest of config.json and, per safetensors file, its name, size and first MiB
    (header and leading tensor bytes): different weights never share KV pages."""
    root = Path(model_dir)
    h = hashlib.sha256()
    cfg = root / "config.json"
    h.update(cfg.read_bytes() if cfg.is_file() else b"")
    for path in sorted(root.glob("*.safetensors")):
        h.update(path.name.encode() + b"\0" + str(path.stat().st_size).encode() + b"\0")
        with path.open("rb") as f:
            h.update(f.read(1 << 20))
    return h.hexdigest()


def layout_info(engine: LLMEngine) -> dict[str, Any]:
    """The pool layout peers need: dtype, page size, per-layer page bytes and fields, model shape."""
    st = engine.storage
    layouts = [st.layout] + ([st.int2_layout] if st.int2_layout is not None else [])
    return {
        "dtype": st.kv_dtype,
        "page_format": st.layout.fmt,
        "page_size": st.page_size,
        "num_layers": st.shape.num_layers,
        "num_kv_heads": st.shape.num_kv_heads,
        "head_dim": st.shape.head_dim,
        "page_bytes": st.layout.page_bytes,
        "int2_page_bytes": st.int2_layout.page_bytes if st.int2_layout is not None else 0,
        "total_bytes": st.total_bytes,
        "kv_layout": "page_major" if st.page_major else "layer_major",
        # (page bytes, INT2 page bytes, total bytes) of each registered region (KVStorage.region_geometry)
        "region_geometry": list(st.region_geometry()),
        "fields": [
            [lay.fmt, [[f.name, str(f.dtype), list(f.shape), f.offset, list(f.storage or ())] for f in lay.fields]] for lay in layouts
        ],
        "k_scales": list(st.k_scales),
        "v_scales": list(st.v_scales),
    }


def layout_hash(engine: LLMEngine, *, weights_id: str | None = None) -> str:
    """Hash of everything that must agree for a page to mean the same on two workers:
    dtype, page size, page layout (fields with scales and zeros), global scales,
    model shape, KV layout and weights identity (buffer size is not in it: it is per worker)."""
    info = {k: v for k, v in layout_info(engine).items() if k not in ("total_bytes", "region_geometry")}
    info["weights"] = weights_id if weights_id is not None else weights_identity(engine.config.model.path)
    info["bits_table"] = list(engine.kv.bits_table) if engine.kv.bits_table is not None else None
    return hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:32]


# --------------------------------------------------------------------------- HTTP defaults
class PeerHttp:
    """The HTTP calls a puller makes to the worker it pulls from, over ONE pooled
    ``aiohttp.ClientSession`` (the package's one HTTP client library): building a client per
    call cost ~21 ms each on the H200 machines (docs/performance-log/pd-gpu.md); a pull makes
    one (the hold), plus the agent fetch once per sender incarnation and the hold's release
    after the READ. The session lives on an event loop of its own, in a daemon thread; the
    server's pull threads call in through ``run_coroutine_threadsafe`` and wait.

    Every call carries the deployment's internal credential (``token``: the sender's
    ``/internal/*`` routes refuse calls without it) and ends within ``timeout_s`` per
    phase (connect, each read): a frozen peer costs a bounded wait and the pull
    falls back to recomputing (``remote_unreachable``)."""

    def __init__(self, *, timeout_s: float = HTTP_TIMEOUT_S, token: str | None = None) -> None:
        import aiohttp  # noqa: F401 - loaded with the worker, not on its first pull

        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="peer-http", daemon=True)
        self._thread.start()
        self._session: aiohttp.ClientSession | None = None

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if self._session is not None:
            asyncio.run_coroutine_threadsafe(self._session.close(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()

    def fetch_agent_info(self, agent_url: str) -> dict[str, Any]:
        status, body = self._call("GET", f"{agent_url.rstrip('/')}/internal/kv/agent")
        self._raise_for(status, agent_url)
        return cast(dict[str, Any], json.loads(body))

    def hold(self, agent_url: str, lease_id: str, digest: str, hold_s: float, consume: bool, wait_s: float | None = None) -> dict[str, Any]:
        """``POST .../hold``: the sender's answer (``KVTransfer.hold``), ``{"refused": "unknown_lease"}``
        on 404 and ``{"refused": "lease_mismatch"}`` on 409; raises for anything else. ``wait_s``: how
        long to wait for the answer, when longer than ``timeout_s`` (the sender answers after its
        engine step)."""
        status, body = self._call(
            "POST",
            f"{agent_url.rstrip('/')}/internal/kv/leases/{lease_id}/hold",
            {"digest": digest, "hold_s": hold_s, "consume": consume},
            read_s=wait_s,
        )
        if status in (404, 409):
            return {"refused": "unknown_lease" if status == 404 else "lease_mismatch"}
        self._raise_for(status, agent_url)
        return cast(dict[str, Any], json.loads(body))

    def release(self, agent_url: str, lease_id: str) -> None:
        status, _ = self._call("DELETE", f"{agent_url.rstrip('/')}/internal/kv/leases/{lease_id}")
        if status not in (200, 404):
            self._raise_for(status, agent_url)

    def _call(self, method: str, url: str, body: dict[str, Any] | None = None, *, read_s: float | None = None) -> tuple[int, bytes]:
        """(status, body) of one call, made on the client's loop (RuntimeError once closed); ``read_s``:
        each read's deadline when longer than the session's."""
        if self._loop.is_closed() or not self._thread.is_alive():
            raise RuntimeError("the peer client is closed")
        read = max(self._timeout_s, read_s or 0.0)
        # every phase is bounded by the session's timeouts; this bound only guards a loop stopped mid-call
        return asyncio.run_coroutine_threadsafe(self._request(method, url, body, read), self._loop).result(10 * read)

    async def _request(self, method: str, url: str, body: dict[str, Any] | None, read_s: float) -> tuple[int, bytes]:
        import aiohttp

        if self._session is None:
            # idle connections are dropped before the peer's server closes them (WORKER_KEEP_ALIVE_S): reusing
            # one it is closing failed a hold under agent load (ServerDisconnectedError, a recomputed pull)
            connector = aiohttp.TCPConnector(keepalive_timeout=WORKER_CLIENT_IDLE_S)
            self._session = aiohttp.ClientSession(headers=self._headers, connector=connector)
        timeout = aiohttp.ClientTimeout(sock_connect=self._timeout_s, sock_read=read_s)  # read_s: at least timeout_s (``_call``)
        async with self._session.request(method, url, json=body, timeout=timeout) as response:
            return response.status, await response.read()

    @staticmethod
    def _raise_for(status: int, url: str) -> None:
        if not 200 <= status < 300:
            raise ConnectionError(f"peer {url} answered HTTP {status}")


def http_hold(
    agent_url: str, lease_id: str, digest: str, hold_s: float, consume: bool, wait_s: float | None = None, *, token: str | None = None
) -> dict[str, Any]:
    """One-off ``PeerHttp.hold`` (tests and tools)."""
    http = PeerHttp(token=token)
    try:
        return http.hold(agent_url, lease_id, digest, hold_s, consume, wait_s)
    finally:
        http.close()
