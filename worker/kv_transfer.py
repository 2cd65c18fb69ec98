"""Engine-level KV reuse across workers: pull a prompt's pages from another
worker over NIXL, retain a finished request's pages under a lease, and the
lease table (DESIGN.md, Worker: kv_transfer_params; docs/worker-api.md). The wire form of
``kv_transfer_params``, lease digests, the layout identity and the peer HTTP client are ``kv_wire``'s.

API the worker server uses (one ``KVTransfer`` per worker process)::

    kvt = KVTransfer(engine, config.reuse, engine_id="worker-...",  # lease ids also carry a per-process generation
                     agent_url="http://host:port", role="decode",
                     run_on_engine=async_engine.run_sync)   # runs fn() on the engine thread, waits
    kvt.agent_info()                       # body of GET /internal/kv/agent
    # POST /internal/generate, before the request reaches the engine (blocking: run it in a thread,
    # never on the engine thread itself):
    params = KVTransferParams.from_dict(body["kv_transfer_params"]) if body.get(...) else None  # ValueError -> 400
    res = kvt.pull(input_ids, tags, params, cache_salt=salt)  # -> PullResult; never raises for transfer faults
    spec = kvt.retain_spec(conversation_key=key, input_ids=input_ids) if retain else None   # prefill role: always
    engine.add_request(rid, input_ids, sampling, tags=tags, retain=spec, pin_lease=res.pin_lease, cache_salt=salt)
    #   (if add_request raises: kvt.drop_pin(res))
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
    kvt.stats() -> dict; kvt.fallbacks (Counter by reason); kvt.prefill_tokens_per_s,
    kvt.transfer_bytes_per_s (the two "auto" measurements); kvt.close() at shutdown.

Threads: every method that touches engine state hops onto the engine thread
through ``run_on_engine(fn)`` (default: call ``fn`` under a private lock, for
a synchronous engine loop in tests). Call them from any thread EXCEPT the
engine thread (they would wait on themselves), e.g. ``asyncio.to_thread``.
``RetainSpec.on_retained`` runs on the engine thread inside ``step``.

``pull`` (P->D and D->P alike): hash this prompt's full pages the way the
prefix cache does (triaxial: at the sender's stored precision, from its page
ids' INT2 flag); keep the leading remote pages whose hashes equal them; skip
pages the local prefix cache holds; READ the rest when that adds at least
``reuse.recompute_threshold_tokens`` (or, for "auto", when the measured
transfer is predicted faster than the measured prefill), the lease is alive
and ``layout_hash`` matches. Before the READ the sender must *hold* the lease
(POST .../hold, one round trip, sent before this worker hashes its prompt so
the two overlap): it compares a digest of the offered page ids, hashes and
token count with its own record of the lease (NIXL would read any page of a
registered region: made-up ids, or a stale gateway cache, must never be read)
and pins those pages for ``transfer_timeout_s + HOLD_MARGIN_S``, never
reclaimed; the READ must end within ``transfer_timeout_s`` of the request
for the hold, so the pages cannot change under it (no second check after
it). The hold is released after the READ, off the request's path. Peer
calls: GET /internal/kv/agent (once per sender incarnation: cached by engine
id and the lease id's generation), POST .../hold, DELETE (the hold; a
prefill's ``xfer-`` lease when nobody held it); each is an injectable
callable. ``PullResult.phases`` times each step. Pulled pages are registered in the
prefix cache and pinned under ``PullResult.pin_lease`` (local prefix pages
under ``pin_lease + ".local"``) until the engine admits the request. Any failure gives ``fallback`` one of
``FALLBACK_REASONS`` and the request recomputes; a failed READ's pages are
freed unregistered (never used). ``hash_mismatch`` with ``pulled_tokens > 0``
means the histories diverged and only the common prefix was pulled. A
sender lease whose id starts with ``xfer-`` (a prefill worker's hold) ends
on the sender when the puller's hold takes its pages (``consume``), whether
it then reads them or not (held locally already, below the threshold, a
fallback): it is single-use, and idle holds filling a small prefill pool
stalled it until their timeout.

Retaining: a request added with ``retain=kvt.retain_spec(...)`` keeps its
full pages (prompt + generated) pinned when it finishes, for
``reuse.transfer_timeout_s`` on a prefill worker and ``reuse.retention_ttl_s``
otherwise; a newer lease of a conversation key releases the older one when its
prompt continues the older one's (``_on_retained``).

Peers: ``kv_transfer_params.agent_url`` is contacted only when it is this worker's
own URL or one of the deployment's workers (``peers``, from the engine config's
worker list); anything else is the fallback ``unknown_peer`` (the request
recomputes, nothing is contacted). Every peer call carries the internal
credential and a deadline (``kv_wire.PeerHttp``); a hold pins pages for at most
``max_hold_s`` (``security.max_hold_s``).
Released or expired leases' pages go back to the prefix cache's LRU.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import math
import threading
import time
import uuid
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from kvserving.config import ROLES, ReuseConfig
from kvserving.kernels.page_ids import page_id_bits
from kvserving.worker.engine import LLMEngine
from kvserving.worker.kv_wire import HTTP_TIMEOUT_S, KVTransferParams, PeerHttp, layout_hash, layout_info, lease_digest
from kvserving.worker.leases import RetainedKV, RetainSpec, release_pin
from kvserving.worker.page_pool import RECLAIM_FIRST, RECLAIM_LAST
from kvserving.worker.peers import PeerSet, url_key
from kvserving.worker.nixl_io import NixlIO, PageGeometry, ReadStats, RemoteBuffers, TransferError
from kvserving.worker.sampling import SamplingParams, make_generator
from kvserving.worker.sequence import Sequence as EngineSequence

T = TypeVar("T")

FALLBACK_REASONS = (
    "remote_unreachable", "transfer_timeout", "transfer_failed", "lease_expired",
    "layout_mismatch", "hash_mismatch", "stale_agent", "unknown_peer",
)
TRANSFER_LEASE_PREFIX = "xfer-"  # a prefill worker's single-use hold of a prompt's pages
RETAIN_LEASE_PREFIX = "kv-"
PIN_LEASE_PREFIX = "pull-"
HOLD_LEASE_PREFIX = "hold-"  # a puller's pin of a lease's pages for the length of one READ (sender side)
HOLD_MARGIN_S = 2.0  # a hold outlives the puller's READ deadline by this much
DEFAULT_THRESHOLD_TOKENS = 64  # "auto" before both rates are measured
# ``PullResult.phases``, on the request's path in this order: hash and match the prompt and
# allocate (one engine-thread hop), wait for the sender's hold (sent before planning), build the
# READ's descriptors, the READ itself, register and pin the pages (one hop), wait for a hold that
# ended in no READ. ``contact_agent`` / ``contact_hold``: the agent fetch (first pull from an
# incarnation only) and the hold's round trip, on a peer-call thread beside the planning.
PULL_PHASES = ("plan", "lease_check", "descriptors", "read", "adopt", "release", "contact_agent", "contact_hold")


def _lease_generation(lease_id: str) -> int | None:
    """The sender generation a ``kv-<gen>-<uuid>`` / ``xfer-<gen>-<uuid>`` lease id names (None: other ids)."""
    parts = lease_id.split("-")
    if len(parts) == 3 and parts[0] + "-" in (RETAIN_LEASE_PREFIX, TRANSFER_LEASE_PREFIX):
        try:
            return int(parts[1], 16)
        except ValueError:
            return None
    return None


# --------------------------------------------------------------------------- results
@dataclass(slots=True, frozen=True)
class PullResult:
    """What ``pull`` did for one request."""

    pulled_tokens: int = 0
    num_bytes: int = 0
    num_regions: int = 0
    seconds: float = 0.0
    fallback: str | None = None  # one of FALLBACK_REASONS, or None
    pin_lease: str | None = None  # pass to LLMEngine.add_request(pin_lease=...)
    matched_tokens: int = 0  # leading remote tokens whose hashes equal this prompt's
    local_tokens: int = 0  # of those, already in the local prefix cache
    skipped: str | None = None  # why nothing was pulled without a fault ("below_threshold", "no_free_pages", ...)
    phases: dict[str, float] = field(default_factory=dict)  # wall seconds per phase (``PULL_PHASES``)


class _Phases:
    """Wall seconds of one pull, phase by phase (``PullResult.phases``): ``mark(name)`` charges
    the time since the previous mark to ``name``."""

    __slots__ = ("seconds", "_t")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._t = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._t
        self._t = now

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds


@dataclass(slots=True)
class _Plan:
    matched: int = 0  # leading pages equal to the remote's
    usable: int = 0  # remote pages this prompt could use at most
    local_pids: list[int] = field(default_factory=list)
    want: list[int] = field(default_factory=list)  # page indices to pull
    hashes: list[int] = field(default_factory=list)
    local_pin: str | None = None
    remote_pids: list[int] = field(default_factory=list)  # the sender's ids of ``want``
    skipped: str | None = None  # nothing to pull ("nothing_to_pull", "below_threshold")
    local: list[int] | None = None  # pages allocated to READ into (None: none free, or skipped)


@dataclass(slots=True)
class _LeaseRecord:
    kept: RetainedKV
    ttl_s: float
    digest: str | None = None  # ``lease_digest`` of its pages, computed at the first hold
    prompt: tuple[int, str] | None = None  # (length, ``prompt_digest``) of the prompt that made it


def prompt_digest(token_ids: Sequence[int]) -> str:
    """blake2b-128 of a prompt's token ids (what proves a later prompt starts with it)."""
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16, person=b"kvserving.prompt").hexdigest()


class LeaseMismatchError(ValueError):
    """A hold named a lease whose pages are not the ones the puller was offered (HTTP 409)."""


@dataclass(slots=True)
class _Contact:
    """What the puller learned from the sender before its READ (``KVTransfer._contact``)."""

    peer: RemoteBuffers | None = None
    hold_id: str | None = None
    fallback: str | None = None
    agent_s: float = 0.0
    hold_s: float = 0.0


# --------------------------------------------------------------------------- the class
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
        fetch_agent_info: Callable[[str], dict[str, Any]] | None = None,
        hold_remote: Callable[[str, str, str, float, bool], dict[str, Any]] | None = None,
        release_remote: Callable[[str, str], None] | None = None,
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
        # where kv_transfer_params may send this worker: its own URL and the deployment's
        # workers (``peers``; None: its own URL only)
        self.peers = peers if peers is not None else PeerSet()
        self._own = url_key(agent_url)
        self.max_hold_s = max_hold_s  # the longest pin a peer's hold gets (security.max_hold_s)
        self.generation = uuid.uuid4().int >> 80  # this process's metadata generation (48 bits)
        self._lock = threading.Lock()
        self._counts_lock = threading.Lock()  # pulls run on several server threads at once
        self._run = run_on_engine or self._run_locked
        self._http = PeerHttp(token=internal_token)
        self._fetch = fetch_agent_info or self._http.fetch_agent_info
        self._hold_remote = hold_remote or self._http.hold
        self._release_remote = release_remote or self._http.release
        # the sender calls of a pull run here: the hold overlaps the pull's own planning, and
        # releases after the READ leave the request's path
        self._calls = ThreadPoolExecutor(max_workers=32, thread_name_prefix="kvserving-kv-peer")
        st = engine.storage
        self.page_size = st.page_size
        self.dtype = st.kv_dtype
        self.layout = layout_info(engine)
        self.layout_hash = layout_hash(engine, weights_id=weights_id)
        self.geometry = PageGeometry(
            st.layout.page_bytes, st.int2_layout.page_bytes if st.int2_layout is not None else 0, st.total_bytes
        )
        self.nixl = NixlIO(f"{engine_id}-{self.generation:x}", st.buffers, geometry=self.geometry, poll_interval_s=poll_interval_s)
        self.nixl.start_progress()
        self._metadata_b64 = base64.b64encode(self.nixl.metadata()).decode()
        self._leases: dict[str, _LeaseRecord] = {}  # engine thread only
        # counters and the two "auto" measurements (read by metrics)
        self.fallbacks: Counter[str] = Counter()
        self.pulls = 0
        self.pulled_tokens_total = 0
        self.pulled_bytes_total = 0
        self.pulled_regions_total = 0
        self.transfer_seconds_total = 0.0
        self.transfer_bytes_per_s: float | None = None  # NIXL READ rate achieved (EWMA)
        self.pull_overhead_s: float | None = None  # per pull: agent fetch + lease checks (EWMA)

    def _run_locked(self, fn: Callable[[], Any]) -> Any:
        with self._lock:
            return fn()

    def _on_engine(self, fn: Callable[[], T]) -> T:
        return cast(T, self._run(fn))

    def close(self) -> None:
        self._calls.shutdown(wait=True)
        self.nixl.close()
        self._http.close()

    # ------------------------------------------------------------------ agent
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

    # ------------------------------------------------------------------ measurements
    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Prompt tokens this engine computes per second of model time (None before any)."""
        s = self.engine.stats
        if s.prefill_seconds <= 0 or s.prompt_tokens_computed < self.page_size:
            return None
        return s.prompt_tokens_computed / s.prefill_seconds

    def page_nbytes(self, page_ids: Sequence[int]) -> int:
        """Bytes a READ of these pages moves (all layers)."""
        n2 = sum(1 for p in page_ids if page_id_bits(p) == 2)
        geo = self.geometry
        return self.engine.storage.shape.num_layers * ((len(page_ids) - n2) * geo.page_bytes + n2 * geo.int2_page_bytes)

    def worth_pulling(self, num_tokens: int, num_bytes: int) -> bool:
        """The recompute threshold: a token count, or "auto" (predicted pull faster than prefill)."""
        threshold = self.reuse.recompute_threshold_tokens
        if threshold != "auto":
            return num_tokens >= int(threshold)
        tps, bw, overhead = self.prefill_tokens_per_s, self.transfer_bytes_per_s, self.pull_overhead_s
        if tps is None or bw is None or overhead is None:
            return num_tokens >= DEFAULT_THRESHOLD_TOKENS
        return overhead + num_bytes / bw < num_tokens / tps

    def _measure(self, read_bytes: int, read_s: float, overhead_s: float) -> None:
        a = 0.3
        if read_s > 0 and read_bytes > 0:
            rate = read_bytes / read_s
            self.transfer_bytes_per_s = rate if self.transfer_bytes_per_s is None else (1 - a) * self.transfer_bytes_per_s + a * rate
        self.pull_overhead_s = overhead_s if self.pull_overhead_s is None else (1 - a) * self.pull_overhead_s + a * overhead_s

    # ------------------------------------------------------------------ pull
    def pull(
        self, input_ids: Sequence[int], tags: Sequence[int] | None, params: KVTransferParams | None, *,
        cache_salt: str | None = None,
    ) -> PullResult:
        """Pull what ``params`` offers of this prompt's KV (see the module docstring). Never raises
        for a transfer fault: the result's ``fallback`` says why nothing (or less) was pulled.
        ValueError only for the caller's own mistake (tags not one per input token). ``cache_salt``:
        the request's, in the hashes its pages are matched by (a sender's pages of another salt never match)."""
        ph = _Phases()
        self.reap()
        if params is None:
            return PullResult()
        if url_key(params.agent_url) != self._own and not self.peers.allows(params.agent_url):
            return self._fail("unknown_peer")  # never contacted: not one of this deployment's workers
        ids = [int(t) for t in input_ids]
        tag_list = [int(t) for t in tags] if tags is not None else [0] * len(ids)
        if len(tag_list) != len(ids):
            raise ValueError(f"tags has {len(tag_list)} entries for {len(ids)} input tokens")
        if params.page_size != self.page_size or params.dtype != self.dtype or params.layout_hash != self.layout_hash:
            return self._fail("layout_mismatch")
        if params.expires_at <= time.time():
            return self._fail("lease_expired")
        # The sender's hold runs while this worker hashes its prompt and allocates (``_contact``);
        # the READ's deadline counts from here, inside the hold (``HOLD_MARGIN_S``).
        t_send = time.monotonic()
        contact = self._calls.submit(self._contact, params) if params.engine_id != self.engine_id else None
        plan: _Plan | None = None
        result = PullResult()
        try:
            plan = self._on_engine(lambda: self._plan(ids, tag_list, params, cache_salt))
            ph.mark("plan")
            result = self._pull_planned(plan, params, contact, t_send, ph)
        finally:
            if plan is not None and plan.local_pin is not None and result.pin_lease is None:
                pin = plan.local_pin
                self._on_engine(lambda: self._drop_lease(pin))
                ph.mark("adopt")
            if contact is not None:
                if result.pin_lease is None and params.lease_id.startswith(TRANSFER_LEASE_PREFIX):
                    # nothing read: wait for the hold (it consumes a prefill's single-use lease), so
                    # that pull returns with the sender's transfer lease already gone
                    wait([contact], timeout=HTTP_TIMEOUT_S + 1.0)
                    ph.mark("release")
                # the hold is over once the READ is: let the sender free it, off the request's path
                contact.add_done_callback(lambda f: self._later(self._release_contact, params, f))
            elif result.pin_lease is None:
                # nothing read and nobody asked (our own id): a prefill worker's single-use hold is
                # no use to anyone now; free its pages at once rather than at its timeout
                self._release_hold(params)
        result.phases.update(ph.seconds)
        return result

    def _later(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the peer-call threads (nothing if this worker is closing)."""
        try:
            self._calls.submit(fn, *args)
        except RuntimeError:  # shut down: the sender's own timeouts free what it holds
            pass

    def _release_contact(self, params: KVTransferParams, done: Future[_Contact]) -> None:
        """Release the READ hold a pull took, once it is answered (a hold that failed holds nothing;
        one whose answer never came expires on the sender)."""
        try:
            c = done.result()
        except Exception:  # noqa: BLE001 - no answer: nothing held
            return
        try:
            if c.hold_id is not None:
                self._release_remote(params.agent_url, c.hold_id)
        except Exception:  # noqa: BLE001 - the hold's own expiry frees it anyway
            pass

    def _release_hold(self, params: KVTransferParams) -> None:
        if params.lease_id.startswith(TRANSFER_LEASE_PREFIX):
            try:
                self._release_remote(params.agent_url, params.lease_id)
            except Exception:  # noqa: BLE001 - the sender's own timeout frees it anyway
                pass

    def _pull_planned(
        self, plan: _Plan, params: KVTransferParams, contact: Future[_Contact] | None, t_send: float, ph: _Phases
    ) -> PullResult:
        """Decide, wait for the sender's hold, READ, adopt; every early return is a skip or a fallback."""
        p = self.page_size
        diverged = plan.matched < plan.usable
        base: dict[str, Any] = {"matched_tokens": plan.matched * p, "local_tokens": len(plan.local_pids) * p}
        if plan.skipped is None and contact is None:
            # our own lease would have kept these pages in the local cache: it is gone
            return self._fail("lease_expired", **base)
        if plan.skipped is not None:
            return self._fail("hash_mismatch", **base) if diverged else PullResult(skipped=plan.skipped, **base)
        local = plan.local
        if local is None:
            return PullResult(skipped="no_free_pages", **base)
        assert contact is not None
        try:
            c = contact.result()  # the sender's hold, asked for before ``_plan``
        except Exception:  # noqa: BLE001 - a bug in the contact must not leak the pages
            c = _Contact(fallback="transfer_failed")
        ph.mark("lease_check")
        ph.add("contact_agent", c.agent_s)
        ph.add("contact_hold", c.hold_s)
        if c.fallback is not None or c.peer is None:
            self._discard(local, safe=True)
            return self._fail(c.fallback or "transfer_failed", **base)
        reason, stats = self._read_held(c.peer, params, local, plan.remote_pids, t_send, ph)
        if stats is None:
            return self._fail(reason or "transfer_failed", **base)
        overhead = max(0.0, time.monotonic() - t_send - stats.seconds)  # hold, allocation, planning
        pin = f"{PIN_LEASE_PREFIX}{uuid.uuid4().hex}"
        hashes = [plan.hashes[i] for i in plan.want]
        local_pids, local_pin = list(plan.local_pids), plan.local_pin
        self._on_engine(lambda: self._adopt(pin, local, hashes, local_pids, local_pin))
        ph.mark("adopt")
        self._count(stats, len(local) * p, overhead)
        fallback = None
        if diverged:
            fallback = "hash_mismatch"
            with self._counts_lock:
                self.fallbacks[fallback] += 1
        return PullResult(
            pulled_tokens=len(local) * p, num_bytes=stats.num_bytes, num_regions=stats.num_regions,
            seconds=time.monotonic() - t_send, fallback=fallback, pin_lease=pin, **base,
        )

    def allocate_for_pull(self, bits: list[int]) -> list[int] | None:
        """Pages to READ into (one per entry of ``bits``), or None. Engine thread only.

        A pull serves a live request, so retained conversations yield to it as they do
        to a request's own allocation (least recently active first): a pool full of
        retained KV would otherwise refuse the pull and make the request recompute.
        Placed as one new sequence (a run where one is free), so the READ stays few regions.
        """
        pool = self.engine.pool
        got = pool.allocate(bits)
        while got is None and pool.reclaim_one() is not None:
            got = pool.allocate(bits)
        return got

    def _read_held(
        self, peer: RemoteBuffers, params: KVTransferParams, local: list[int], remote_pids: list[int], t_send: float,
        ph: _Phases,
    ) -> tuple[str | None, ReadStats | None]:
        """READ while the sender's hold pins the pages: it lasts ``transfer_timeout_s +
        HOLD_MARGIN_S`` from before the sender took it, and the READ must end within
        ``transfer_timeout_s`` of the same instant, so the pages cannot change under it. On any
        failure the local pages are discarded unregistered and the reason returned."""
        left = self.reuse.transfer_timeout_s - (time.monotonic() - t_send)
        if left <= 0:
            self._discard(local, safe=True)
            return "transfer_timeout", None
        try:
            stats = self.nixl.read(peer, local, remote_pids, timeout_s=left)
        except TransferError as exc:
            self.nixl.forget_remote(params.engine_id)
            self._discard(local, safe=exc.pages_safe)
            return exc.reason, None
        except ValueError:  # page ids outside the sender's buffers, or sizes that differ: not its layout
            self._discard(local, safe=True)
            return "layout_mismatch", None
        ph.mark("read")
        ph.add("read", -stats.descriptor_seconds)
        ph.add("descriptors", stats.descriptor_seconds)
        return None, stats

    def _count(self, stats: ReadStats, tokens: int, overhead_s: float) -> None:
        with self._counts_lock:
            self._count_locked(stats, tokens, overhead_s)

    def _count_locked(self, stats: ReadStats, tokens: int, overhead_s: float) -> None:
        self._measure(stats.num_bytes, stats.seconds, overhead_s)
        self.pulls += 1
        self.pulled_tokens_total += tokens
        self.pulled_bytes_total += stats.num_bytes
        self.pulled_regions_total += stats.num_regions
        self.transfer_seconds_total += stats.seconds

    def _fail(self, reason: str, **kw: Any) -> PullResult:
        assert reason in FALLBACK_REASONS, reason
        with self._counts_lock:
            self.fallbacks[reason] += 1
        return PullResult(fallback=reason, **kw)

    def _plan(self, ids: list[int], tags: list[int], params: KVTransferParams, cache_salt: str | None = None) -> _Plan:
        """On the engine thread: match the remote hashes against this prompt's, find what the
        local prefix cache holds (pinned under a ``.local`` lease), pick the pages to pull,
        decide whether they are worth it and allocate them (one hop onto the engine thread)."""
        kv, pool, p = self.engine.kv, self.engine.pool, self.page_size
        seq = EngineSequence("kv-pull", ids, SamplingParams(), make_generator(0), tags=tags,
                             cache_salt=cache_salt.encode() if cache_salt else None)
        usable = max(0, min(len(params.page_ids), params.num_tokens // p, (len(ids) - 1) // p))
        bits = [page_id_bits(pid) for pid in params.page_ids[:usable]]
        if kv.bits_table is not None and kv.controller is None:
            # a page stored at 2 bits never serves a request that wants 4 (match_prefix's rule;
            # under the bit-budget controller pages are taken as stored)
            wanted = kv.page_bits_for(seq, 0, usable)
            ok = next((i for i, (b, w) in enumerate(zip(bits, wanted)) if b == 2 and w == 4), usable)
            usable, bits = ok, bits[:ok]
        mine = kv.page_hashes(seq, bits) if usable else []
        plan = _Plan(usable=usable)
        while plan.matched < usable and mine[plan.matched] == params.page_hashes[plan.matched]:
            plan.matched += 1
        plan.hashes = mine[: plan.matched]
        held = pool.lookup
        if kv.controller is None:
            # pages the sender aged and this worker holds at 4 bits: age them here, pull nothing (kv_manager)
            kv.age_cached([h for h, b in zip(plan.hashes, bits) if b == 2])
        else:  # pages are taken as stored: a page held here at the other precision is not pulled again
            held = kv.held_page
        i = 0
        while i < plan.matched and (pid := held(plan.hashes[i])) is not None:
            plan.local_pids.append(pid)
            i += 1
        plan.want = [j for j in range(i, plan.matched) if held(plan.hashes[j]) is None]
        plan.remote_pids = [params.page_ids[j] for j in plan.want]
        if not plan.want:
            plan.skipped = "nothing_to_pull"
        elif not self.worth_pulling(len(plan.want) * p, self.page_nbytes(plan.remote_pids)):
            plan.skipped = "below_threshold"
        if plan.local_pids:
            plan.local_pin = f"{PIN_LEASE_PREFIX}{uuid.uuid4().hex}.local"
            # held only while the pull runs, and never reclaimed: ``_adopt`` re-pins these pages
            pool.pin(plan.local_pin, plan.local_pids, ttl_s=self._pin_ttl())
        if plan.skipped is None and params.engine_id != self.engine_id:
            plan.local = self.allocate_for_pull([page_id_bits(pid) for pid in plan.remote_pids])
        return plan

    def _pin_ttl(self) -> float:
        return max(60.0, 2 * self.reuse.transfer_timeout_s)

    def _contact(self, params: KVTransferParams) -> _Contact:
        """On a peer-call thread: the sender's NIXL agent (cached by engine id and the lease id's
        generation: no agent fetch once met) and a hold of the lease's pages for one READ.

        The hold is the check NIXL needs (it reads any page of a registered region, so page ids
        a client made up, or a stale gateway cache, would read someone else's KV): the sender
        compares ``lease_digest`` of the offered pages with its own record of the lease, then
        pins them (never reclaimed, released by the puller or at expiry). One round trip
        replaces the lease listing before the READ and the renewal after it."""
        c = _Contact()
        t0 = time.perf_counter()
        gen = _lease_generation(params.lease_id)
        peer = self.nixl.remote(params.engine_id, gen) if gen is not None else None
        if peer is None:
            got = self._connect(params)
            c.agent_s = time.perf_counter() - t0
            if isinstance(got, str):
                c.fallback = got
                return c
            peer = got
        t1 = time.perf_counter()
        digest = lease_digest(params.page_ids, params.page_hashes, params.num_tokens)
        consume = params.lease_id.startswith(TRANSFER_LEASE_PREFIX)  # a prefill's hold is single-use
        try:
            reply = self._hold_remote(params.agent_url, params.lease_id, digest,
                                      self.reuse.transfer_timeout_s + HOLD_MARGIN_S, consume)
            c.hold_s = time.perf_counter() - t1
            refused = reply.get("refused")
            if refused is not None:
                c.fallback = "lease_expired" if refused == "unknown_lease" else "hash_mismatch"
                return c
            c.hold_id = str(reply["hold_id"])
            engine_id, generation = str(reply["engine_id"]), int(reply["generation"])
        except Exception:  # noqa: BLE001 - connection refused, timeout, bad JSON: all unreachable
            self.nixl.forget_remote(params.engine_id)
            c.fallback = "remote_unreachable"
            return c
        if engine_id != params.engine_id:
            c.fallback = "stale_agent"
            return c
        if self.nixl.remote(engine_id, generation) is None:
            # the agent we know is another incarnation than the process that holds the lease
            self.nixl.forget_remote(engine_id)
            got = self._connect(params)
            if isinstance(got, str) or self.nixl.remote(engine_id, generation) is None:
                c.fallback = got if isinstance(got, str) else "stale_agent"
                return c
            peer = got
        c.peer = peer
        return c

    def _connect(self, params: KVTransferParams) -> RemoteBuffers | str:
        """The sender's NIXL agent (cached by engine id + generation) or a fallback reason."""
        try:
            info = self._fetch(params.agent_url)
            engine_id, generation = str(info["engine_id"]), int(info["generation"])
            lay = info["layout"]
        except Exception:  # noqa: BLE001 - connection refused, timeout, bad JSON: all unreachable
            self.nixl.forget_remote(params.engine_id)
            return "remote_unreachable"
        if engine_id != params.engine_id or _lease_generation(params.lease_id) not in (None, generation):
            self.nixl.forget_remote(params.engine_id)  # restarted: the pages named by params are gone
            return "stale_agent"
        if info.get("layout_hash") != self.layout_hash:
            return "layout_mismatch"
        try:
            geometry = PageGeometry(int(lay["page_bytes"]), int(lay["int2_page_bytes"]), int(lay["total_bytes"]))
            peer = self.nixl.remote(engine_id, generation)
            if peer is None:
                peer = self.nixl.add_remote(
                    engine_id, generation, base64.b64decode(info["metadata"]),
                    addrs=[int(a) for a in lay["buffer_addrs"]], device_id=int(lay.get("device_id", 0)), geometry=geometry,
                )
        except Exception:  # noqa: BLE001 - metadata NIXL cannot load
            self.nixl.forget_remote(engine_id)
            return "stale_agent"
        return peer

    def _discard(self, pages: list[int], *, safe: bool) -> None:
        """Free pages of a failed READ unregistered; unsafe ones wait until NIXL lets go (``_reap``)."""
        if safe:
            self._on_engine(lambda: self.engine.pool.free(pages))

    def reap(self) -> int:
        """Free the pages of timed-out READs that NIXL has since let go (``pull`` does this
        first thing); how many pages were freed."""
        done = self.nixl.reap()
        if done:
            self._on_engine(lambda: self.engine.pool.free(done))
        return len(done)

    def _adopt(self, pin: str, pages: list[int], hashes: list[int], local_pids: list[int], local_pin: str | None) -> None:
        """On the engine thread: register pulled pages, pin them under ``pin`` (and the local
        prefix under ``pin.local``, so both survive until admission), drop our own refs and
        the pull's own pin on the local prefix."""
        pool = self.engine.pool
        for pid, h in zip(pages, hashes):
            pool.register(pid, h)
        # pulled pages wait for their request's admission; under pressure they yield (and stay
        # in the prefix cache), else pins of requests that cannot be admitted fill the pool
        pool.pin(pin, pages, ttl_s=self._pin_ttl(), reclaim=RECLAIM_LAST)
        pool.free(pages)
        if local_pids:
            pool.pin(pin + ".local", local_pids, ttl_s=self._pin_ttl(), reclaim=RECLAIM_LAST)
        if local_pin is not None:
            self._drop_lease(local_pin)

    def drop_pin(self, result: PullResult) -> None:
        """Release a pull's pins when its request never reached the engine."""
        if result.pin_lease is not None:
            lease = result.pin_lease
            self._on_engine(lambda: release_pin(self.engine.pool, lease, []))

    def _drop_lease(self, lease_id: str) -> None:
        if lease_id in self.engine.pool.lease_ids():
            self.engine.pool.release(lease_id)

    # ------------------------------------------------------------------ retain and leases
    def retain_spec(self, *, conversation_key: str | None = None, input_ids: Sequence[int] = ()) -> RetainSpec:
        """A new lease for a request's pages when it finishes (ttl by role). ``input_ids``: the
        request's prompt, which lets its lease replace the conversation's older one (``_on_retained``)."""
        # the id names this process's generation: a peer that restarted since is told apart
        # even when its engine id is stable (``_connect``)
        tail = f"{self.generation:x}-{uuid.uuid4().hex}"
        on_retained = functools.partial(self._on_retained, prompt=input_ids)
        if self.role == "prefill":
            return RetainSpec(f"{TRANSFER_LEASE_PREFIX}{tail}", self.reuse.transfer_timeout_s, conversation_key, on_retained)
        # a retained conversation yields its pages to live requests when the pool runs out
        return RetainSpec(f"{RETAIN_LEASE_PREFIX}{tail}", self.reuse.retention_ttl_s, conversation_key, on_retained,
                          reclaim=RECLAIM_FIRST)

    def _on_retained(self, kept: RetainedKV, *, prompt: Sequence[int] = ()) -> None:
        """Engine thread, inside step: record the lease; it replaces an older lease of the same
        conversation key only when its prompt continues the older one's.

        A conversation key is a name any caller can put in a request, so naming one proves
        nothing: the older lease goes only when this request's prompt starts with the whole
        prompt that made it (equal ``prompt_digest`` over that many tokens), i.e. the caller
        already had that conversation's history, as the conversation's own next turn does.
        Token ids, not page hashes: a triaxial page's hash also covers its precision, which
        a later turn's tags may change. A request that names another conversation's key
        leaves that lease alone and keeps its own beside it. Cost: one digest of the older
        prompt's length, only when a lease of the same key exists."""
        self._purge()
        if kept.conversation_key is not None and prompt:
            for lid, rec in list(self._leases.items()):
                if rec.kept.conversation_key != kept.conversation_key or rec.prompt is None:
                    continue
                n, digest = rec.prompt
                if n <= len(prompt) and prompt_digest(prompt[:n]) == digest:
                    self._drop_lease(lid)
                    del self._leases[lid]
        ttl = self.reuse.transfer_timeout_s if kept.lease_id.startswith(TRANSFER_LEASE_PREFIX) else self.reuse.retention_ttl_s
        record = _LeaseRecord(kept, ttl)
        if kept.conversation_key is not None and prompt:
            record.prompt = (len(prompt), prompt_digest(prompt))
        self._leases[kept.lease_id] = record

    def _purge(self) -> None:
        """Forget leases the pool expired or released."""
        self.engine.pool.expire_leases()
        live = set(self.engine.pool.lease_ids())
        for lid in [lid for lid in self._leases if lid not in live]:
            del self._leases[lid]

    def _unix(self, expires_mono: float) -> float:
        return time.time() + (expires_mono - time.monotonic())

    def params_for(self, kept: RetainedKV) -> KVTransferParams:
        """The wire params of a retained lease (expiry in unix seconds)."""
        return KVTransferParams(
            self.engine_id, self.agent_url, kept.lease_id, kept.page_ids, kept.page_hashes, kept.num_tokens,
            self.page_size, self.dtype, self.layout_hash, self._unix(kept.expires_at),
        )

    def leases(self, conversation_key: str | None = None) -> list[dict[str, Any]]:
        """Every lease held (GET /internal/kv/leases), optionally of one conversation."""

        def listing() -> list[dict[str, Any]]:
            self._purge()
            out = []
            for lid, rec in self._leases.items():
                if conversation_key is not None and rec.kept.conversation_key != conversation_key:
                    continue
                exp = self.engine.pool.lease_expires_at(lid)
                kept = RetainedKV(lid, rec.kept.page_ids, rec.kept.page_hashes, rec.kept.num_tokens, exp,
                                  rec.kept.conversation_key)
                out.append({
                    "lease_id": lid, "conversation_key": rec.kept.conversation_key,
                    "num_pages": len(rec.kept.page_ids), "num_tokens": rec.kept.num_tokens,
                    "expires_at": self._unix(exp), "kv_transfer_params": self.params_for(kept).to_dict(),
                })
            return out

        return self._on_engine(listing)

    def renew(self, lease_id: str, ttl_s: float | None = None) -> float:
        """Extend a lease to ``ttl_s`` from now (default: its own TTL; at most retention_ttl_s);
        the new expiry in unix seconds. KeyError when unknown or expired."""
        if ttl_s is not None and (not isinstance(ttl_s, (int, float)) or not math.isfinite(ttl_s) or ttl_s <= 0):
            raise ValueError(f"ttl_s must be a finite number > 0, got {ttl_s!r}")

        def go() -> float:
            self._purge()
            rec = self._leases.get(lease_id)
            if rec is None:
                raise KeyError(lease_id)
            ttl = min(ttl_s if ttl_s is not None else rec.ttl_s, self.reuse.retention_ttl_s)
            return self._unix(self.engine.pool.renew(lease_id, ttl_s=ttl))

        return self._on_engine(go)

    def hold(self, lease_id: str, *, digest: str, hold_s: float, consume: bool = False) -> dict[str, Any]:
        """Pin lease ``lease_id``'s pages for one READ by a peer (``POST .../hold``): for
        ``hold_s`` (at most ``max_hold_s``), never reclaimed, whatever happens to the lease
        meanwhile; released by ``release(hold_id)`` or at expiry. ``digest`` must equal
        ``lease_digest`` of the lease's pages, hashes and tokens (LeaseMismatchError: the
        puller was offered other pages). ``consume``: a transfer lease (``xfer-``) ends now,
        its pages held only by the hold (single use). KeyError when the lease is unknown."""
        if isinstance(hold_s, bool) or not isinstance(hold_s, (int, float)) or not math.isfinite(hold_s) or hold_s <= 0:
            raise ValueError(f"hold_s must be a finite number > 0, got {hold_s!r}")

        def go() -> dict[str, Any]:
            self._purge()
            rec = self._leases.get(lease_id)
            if rec is None:
                raise KeyError(lease_id)
            kept = rec.kept
            if rec.digest is None:
                rec.digest = lease_digest(kept.page_ids, kept.page_hashes, kept.num_tokens)
            if digest != rec.digest:
                raise LeaseMismatchError(f"lease {lease_id!r} holds other pages than the ones offered")
            hold_id = f"{HOLD_LEASE_PREFIX}{uuid.uuid4().hex}"
            expires = self.engine.pool.pin(hold_id, kept.page_ids, ttl_s=min(float(hold_s), self.max_hold_s))
            if consume and lease_id.startswith(TRANSFER_LEASE_PREFIX):
                del self._leases[lease_id]
                self._drop_lease(lease_id)
            return {"lease_id": lease_id, "hold_id": hold_id, "expires_at": self._unix(expires),
                    "engine_id": self.engine_id, "generation": self.generation}

        return self._on_engine(go)

    def release(self, lease_id: str) -> None:
        """Drop a lease or a hold now (its pages go back to the prefix cache LRU). KeyError when unknown."""

        def go() -> None:
            self._purge()
            if lease_id.startswith(HOLD_LEASE_PREFIX) and lease_id in self.engine.pool.lease_ids():
                self.engine.pool.release(lease_id)
                return
            if lease_id not in self._leases:
                raise KeyError(lease_id)
            del self._leases[lease_id]
            self._drop_lease(lease_id)

        self._on_engine(go)

    def stats(self) -> dict[str, Any]:
        """Reuse counters and lease totals (for /internal/kv/stats and metrics)."""

        def go() -> dict[str, Any]:
            self._purge()
            return {
                "leases": len(self._leases),
                "leased_tokens": sum(r.kept.num_tokens for r in self._leases.values()),
                "pulls": self.pulls,
                "pulled_tokens": self.pulled_tokens_total,
                "pulled_bytes": self.pulled_bytes_total,
                "pulled_regions": self.pulled_regions_total,
                "transfer_seconds": self.transfer_seconds_total,
                "fallbacks": {r: self.fallbacks.get(r, 0) for r in FALLBACK_REASONS},
                "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "transfer_bytes_per_s": self.transfer_bytes_per_s,
                "stuck_transfers": self.nixl.num_stuck,
            }

        return self._on_engine(go)
