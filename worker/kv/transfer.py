"""One worker's KV connector: its pulls from peers (``puller.Puller``) and the leases peers
pull from it (``leases.LeaseStore``), over one NIXL agent (DESIGN.md, Worker:
kv_transfer_params; docs/worker-api.md). The wire form of ``kv_transfer_params``, the
layout identity and the peer HTTP client are ``protocol``'s.

The split follows vLLM v1's KV connector: the puller is its load side (``plan`` finds the
remote tokens this prompt can use, as ``get_num_new_matched_tokens`` does; the READ is
``start_load_kv``), the lease store its ``request_finished`` side (a finished request's
pages kept for a remote reader, named by the params returned to the caller).

API the worker server uses (one ``KVTransfer`` per worker process)::

    kvt = KVTransfer(engine, config.reuse, engine_id="worker-...",  # lease ids also carry a per-process generation
                     agent_url="http://host:port", role="decode",
                     run_on_engine=async_engine.run_sync)   # runs fn() on the engine thread, waits
    kvt.agent_info()                       # body of GET /internal/kv/agent
    # POST /internal/generate, before the request reaches the engine (blocking: run it in a thread,
    # never on the engine thread itself):
    params = KVTransferParams.from_dict(body["kv_transfer_params"]) if body.get(...) else None  # ValueError -> 400
    spec = kvt.retain_spec(conversation_key=key, input_ids=input_ids) if retain else None   # prefill role: always
    add = lambda pin: engine.add_request(rid, input_ids, sampling, tags=tags, retain=spec, admission_pin=pin,
                                         cache_salt=salt)   # runs on the engine thread
    res = kvt.pull(input_ids, tags, params, cache_salt=salt, admit=add)  # -> PullResult; never raises for
    #   transfer faults; add's ValueError leaves it, its pin already released
    if not res.admitted:                   # no adopt hop (no params, nothing pinned): add it yourself
        add(res.admission_pin)             #   (on the engine thread; if it raises: kvt.drop_admission(res))
    # final RequestOutput `out`:
    usage: local_cached_tokens = out.num_cached_tokens - out.num_pulled_tokens,
           remote_pulled_tokens = out.num_pulled_tokens, computed = prompt - out.num_cached_tokens,
           kv_bytes_pulled = res.num_bytes, kv_regions_pulled = res.num_regions, reuse_fallback = res.fallback
    kv_transfer_params = kvt.params_for(out.retained).to_dict() if out.retained else None
    # leases
    kvt.leases(conversation_key=None) -> list[dict]    # GET /internal/kv/leases
    kvt.renew(lease_id, ttl_s=None) -> expires_at      # KeyError -> 404; capped at retention_ttl_s
    kvt.hold(lease_id, digest=..., hold_s=..., consume=False) -> dict  # POST .../hold; KeyError -> 404,
                                                       # LeaseMismatchError -> 409
    kvt.release(lease_id)                              # KeyError -> 404 (a lease or a hold)
    kvt.stats() -> dict; kvt.puller (counters, the two "auto" measurements); kvt.close() at shutdown.

Threads: every method that touches engine state hops onto the engine thread through
``run_on_engine(fn)`` (default: call ``fn`` under a private lock, for a synchronous
engine loop in tests). Call them from any thread EXCEPT the engine thread (they would
wait on themselves), e.g. ``asyncio.to_thread``. The engine never calls back: a
finished request's lease is made by ``leases.retain`` from its ``RetainSpec``.

Retaining: a request added with ``retain=kvt.retain_spec(...)`` keeps its full pages
(prompt + generated) under a lease when it finishes, for ``reuse.transfer_timeout_s`` on
a prefill worker and ``reuse.retention_ttl_s`` otherwise; a newer lease of a
conversation key releases the older one when its prompt continues the older one's.
Every peer call carries the internal credential and a deadline (``protocol.PeerHttp``);
a hold pins pages for at most ``max_hold_s`` (``security.max_hold_s``). Released or
expired leases' pages go back to the prefix cache's LRU.
"""

from __future__ import annotations

import base64
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from kvserving.config import ROLES, ReuseConfig
from kvserving.worker.engine import LLMEngine
from kvserving.worker.kv.leases import LeaseStore, RetainedKV, RetainSpec
from kvserving.worker.kv.nixl_io import NixlIO, PageGeometry
from kvserving.worker.kv.page_pool import PAGE_WAIT_SHARE
from kvserving.worker.kv.protocol import KVTransferParams, PeerHttp, layout_hash, layout_info
from kvserving.worker.kv.puller import Admit, FetchAgent, HoldRemote, PullResult, Puller, ReleaseRemote
from kvserving.worker.peers import PeerSet

T = TypeVar("T")


class KVTransfer:
    """KV export/import and leases of one engine (see the module docstring for the API)."""

    def __init__(
        self,
        engine: LLMEngine,
        reuse: ReuseConfig,
        *,
        engine_id: str,
        agent_url: str,
        role: str = "both",
        run_on_engine: Callable[[Callable[[], Any]], Any] | None = None,
        fetch_agent_info: FetchAgent | None = None,
        hold_remote: HoldRemote | None = None,
        release_remote: ReleaseRemote | None = None,
        weights_id: str | None = None,
        poll_interval_s: float = 0.002,
        internal_token: str | None = None,
        peers: PeerSet | None = None,
        max_hold_s: float = 60.0,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if not engine_id:
            raise ValueError("engine_id must not be empty")
        self.engine = engine
        self.reuse = reuse
        self.engine_id = engine_id
        self.agent_url = agent_url
        self.role = role
        self.generation = uuid.uuid4().int >> 80  # this process's metadata generation (48 bits)
        self._lock = threading.Lock()
        self._run = run_on_engine or self._run_locked
        self._http = PeerHttp(token=internal_token, timeout_s=reuse.peer_timeout_s)
        st = engine.storage
        self.page_size = st.page_size
        self.dtype = st.kv_dtype
        self.layout = layout_info(engine)
        self.layout_hash = layout_hash(engine, weights_id=weights_id)
        self.geometry = PageGeometry(*st.region_geometry())
        self.nixl = NixlIO(f"{engine_id}-{self.generation:x}", st.buffers, geometry=self.geometry, poll_interval_s=poll_interval_s)
        self.nixl.start_progress()
        self._metadata_b64 = base64.b64encode(self.nixl.metadata()).decode()
        self.store = LeaseStore(
            engine.pool,
            role=role,
            generation=self.generation,
            transfer_ttl_s=reuse.transfer_timeout_s,
            retention_ttl_s=reuse.retention_ttl_s,
            max_hold_s=max_hold_s,
        )
        # where kv_transfer_params may send this worker: its own URL and the deployment's
        # workers (``peers``; None: its own URL only)
        if engine.kv.controller is not None:
            # one cut per deployment: decode workers (the conversations' retained pages, generated
            # pages and age-down live there) hold the budget; prefill workers adopt their cut on pull
            engine.kv.controller.leader = role != "prefill"
        self.puller = Puller(
            engine,
            reuse,
            self.nixl,
            engine_id=engine_id,
            agent_url=agent_url,
            layout_hash=self.layout_hash,
            peers=peers if peers is not None else PeerSet(),
            run_on_engine=self._run,
            fetch_agent_info=fetch_agent_info or self._http.fetch_agent_info,
            hold_remote=hold_remote or self._http.hold,
            release_remote=release_remote or self._http.release,
            # a prefill worker's pages free only as decode workers pull its transfer holds, and its
            # pulls' waits are the turn's TTFT: it recomputes instead
            page_wait_share=0.0 if role == "prefill" else PAGE_WAIT_SHARE,
        )

    def _run_locked(self, fn: Callable[[], Any]) -> Any:
        with self._lock:
            return fn()

    def _on_engine(self, fn: Callable[[], T]) -> T:
        return cast(T, self._run(fn))

    def close(self) -> None:
        self.puller.close()
        self.nixl.close()
        self._http.close()

    def agent_info(self) -> dict[str, Any]:
        """Body of GET /internal/kv/agent."""
        layout = dict(self.layout)
        layout.update(buffer_addrs=list(self.nixl.addrs), mem_type=self.nixl.mem_type, device_id=self.nixl.device_id)
        return {
            "engine_id": self.engine_id,
            "agent_name": self.nixl.name,
            "metadata": self._metadata_b64,
            "generation": self.generation,
            "layout": layout,
            "layout_hash": self.layout_hash,
        }

    # ------------------------------------------------------------------ pulling
    def pull(
        self,
        input_ids: Sequence[int],
        tags: Sequence[int] | None,
        params: KVTransferParams | None,
        *,
        cache_salt: str | None = None,
        admit: Admit | None = None,
    ) -> PullResult:
        """``Puller.pull``: plan -> hold -> READ -> adopt, with the request's add (``admit``) in
        the adopt's engine-thread call."""
        return self.puller.pull(input_ids, tags, params, cache_salt=cache_salt, admit=admit)

    def drop_admission(self, result: PullResult) -> None:
        """Release a pull's admission pin when its request never reached the engine (``Puller.drop_admission``)."""
        self.puller.drop_admission(result)

    # ------------------------------------------------------------------ leases
    def retain_spec(self, *, conversation_key: str | None = None, input_ids: Sequence[int] = ()) -> RetainSpec:
        """A new lease for a request's pages when it finishes (kind and ttl by role). ``input_ids``:
        the request's prompt, which lets its lease replace the conversation's older one."""
        return self.store.retain_spec(conversation_key=conversation_key, input_ids=input_ids)

    def _unix(self, expires_mono: float) -> float:
        return time.time() + (expires_mono - time.monotonic())

    def params_for(self, kept: RetainedKV) -> KVTransferParams:
        """The wire params of a lease (expiry in unix seconds)."""
        control = self.engine.kv.controller  # the cut travels with the pages (read without the engine lock: one float)
        return KVTransferParams(
            self.engine_id,
            self.agent_url,
            kept.lease_id,
            kept.page_ids,
            kept.page_hashes,
            kept.num_tokens,
            self.page_size,
            self.dtype,
            self.layout_hash,
            self._unix(kept.expires_at),
            control.cut if control is not None else None,
            control.ranking if control is not None else None,
        )

    def leases(self, conversation_key: str | None = None) -> list[dict[str, Any]]:
        """Every lease held (GET /internal/kv/leases), optionally of one conversation."""

        def listing() -> list[dict[str, Any]]:
            return [
                {
                    "lease_id": le.lease_id,
                    "conversation_key": le.conversation_key,
                    "num_pages": len(le.page_ids),
                    "num_tokens": le.num_tokens,
                    "expires_at": self._unix(le.expires_at),
                    "kv_transfer_params": self.params_for(le).to_dict(),
                }
                for le in self.store.leases(conversation_key)
            ]

        return self._on_engine(listing)

    def renew(self, lease_id: str, ttl_s: float | None = None) -> float:
        """Extend a lease (``LeaseStore.renew``); the new expiry in unix seconds. KeyError when
        unknown or expired."""
        return self._unix(self._on_engine(lambda: self.store.renew(lease_id, ttl_s)))

    def hold(self, lease_id: str, *, digest: str, hold_s: float, consume: bool = False) -> dict[str, Any]:
        """Pin a lease's pages for one READ by a peer (``POST .../hold``, ``LeaseStore.hold``).
        KeyError when the lease is unknown, LeaseMismatchError when ``digest`` names other pages."""

        def go() -> dict[str, Any]:
            hold_id, expires = self.store.hold(lease_id, digest=digest, hold_s=hold_s, consume=consume)
            return {
                "lease_id": lease_id,
                "hold_id": hold_id,
                "expires_at": self._unix(expires),
                "engine_id": self.engine_id,
                "generation": self.generation,
            }

        return self._on_engine(go)

    def release(self, lease_id: str) -> None:
        """Drop a lease or a hold now (its pages go back to the prefix cache LRU). KeyError when unknown."""
        self._on_engine(lambda: self.store.release(lease_id))

    def stats(self) -> dict[str, Any]:
        """Reuse counters and lease totals (for /internal/kv/stats and metrics)."""

        def go() -> dict[str, Any]:
            leases, tokens = self.store.totals()
            life = self.store.transfer_lifetimes
            return {
                "leases": leases,
                "leased_tokens": tokens,
                # a prefill worker's transfer leases by how they ended, and the seconds they held pages
                "transfer_leases_ended": dict(life.ended),
                "transfer_lease_seconds": {end: round(s, 6) for end, s in life.seconds.items()},
                **self.puller.counters(),
            }

        return self._on_engine(go)
