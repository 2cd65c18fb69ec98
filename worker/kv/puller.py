"""The puller: a prompt's pages from another worker's lease, in four steps (DESIGN.md,
Worker: kv_transfer_params; docs/worker-api.md)::

    plan    hash this prompt's full pages the way the prefix cache does (triaxial: at the
            sender's stored precision, from its page ids' INT2 flag); keep the leading
            remote pages whose hashes equal them; skip the ones the local prefix cache
            holds (pinned meanwhile); decide whether the rest is worth a READ; allocate
            (a full pool: wait for pages while the READ can still meet its deadline)
    hold    the sender compares a digest of the offered page ids, hashes and token count
            with its own record of the lease and pins those pages (``LeaseStore.hold``);
            sent before ``plan``, so the round trip overlaps it; its answer, which comes
            after the sender's engine step, is waited for ``hold_wait_s``
    READ    NIXL moves the pages, within ``transfer_timeout_s`` of the request for the
            hold, which lasts ``HOLD_MARGIN_S`` longer: the pages cannot change under it;
            and, once a prefill is measured, within the time recomputing the pages' tokens
            is predicted to take (``read_bound_s``): a slow transport costs a turn at most
            twice the recompute, not the whole timeout
    adopt   register the pages in the prefix cache and pin them, with the local prefix,
            under an admission pin until the engine admits the request; a pull that
            reads nothing (skipped, or a fallback) pins its local prefix the same way
            (taken from a waiting request, those pages are computed again just the same);
            given ``admit``, the request is added to the engine under that pin in the
            same engine-thread call (``PullResult.admitted``): its add waits for no
            engine step of its own

Worth a READ: at least ``reuse.recompute_threshold_tokens``, or for "auto", when the
measured transfer is predicted faster than the measured prefill. NIXL reads any page of a
registered region, so the hold is the check that made-up ids, or a stale gateway cache,
are never read. The hold is released after the READ, off the request's path. A sender's
TRANSFER lease (a prefill worker's) ends when the hold takes its pages (``consume``),
whether they are then read or not (held locally already, below the threshold, a
fallback): it is single use, and idle leases filling a small prefill pool stalled it.

Any failure gives ``PullResult.fallback`` one of ``FALLBACK_REASONS`` and the request
recomputes; a failed READ's pages are freed unregistered (never used). ``hash_mismatch``
with ``pulled_tokens > 0`` means the histories diverged and only the common prefix was
pulled. ``bits_cut_mismatch``: the params carry no bit-budget cut where this worker holds
one, or one it cannot honour (another ranking, or this worker stores a fixed table); a
follower (prefill) worker adopts a carried cut it can honour before it plans.
``kv_transfer_params.agent_url`` is contacted only when it is this worker's own
URL or one of the deployment's workers (``peers``); anything else is ``unknown_peer``.

Threads: ``pull`` runs on a server thread, never the engine thread: it hops onto the
engine thread through ``run_on_engine`` for ``plan`` and for ``adopt`` with the request's
add (``admit``), each hop a wait for the step in progress, and its peer calls (agent
fetch, hold, release) are injectable callables run on a pool of its own. A pull that
ends with no adopt hop (no params, a failure before planning, nothing pinned) does not
call ``admit``: its caller adds the request.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, cast

from kvserving.config import ReuseConfig
from kvserving.kernels.page_ids import page_id_bits
from kvserving.worker.engine import LLMEngine
from kvserving.worker.kv.leases import (
    HOLD_MARGIN_S,
    NO_ROOM_HOLDERS,
    PinKind,
    lease_digest,
    never_pin_kind,
    parse_lease_id,
    pin_for_admission,
    release_admission,
)
from kvserving.worker.kv.nixl_io import NixlIO, PageGeometry, ReadStats, RemoteBuffers, TransferError
from kvserving.worker.kv.page_pool import PAGE_WAIT_POLL_S, PAGE_WAIT_SHARE, RECLAIM_FIRST, RECLAIM_NEVER
from kvserving.worker.kv.protocol import KVTransferParams
from kvserving.worker.peers import PeerSet, url_key
from kvserving.worker.sampling import SamplingParams, make_generator
from kvserving.worker.sequence import Sequence as EngineSequence

log = logging.getLogger(__name__)

T = TypeVar("T")

FALLBACK_REASONS = (
    "remote_unreachable",
    "transfer_timeout",
    "transfer_failed",
    "lease_expired",
    "layout_mismatch",
    "hash_mismatch",
    "stale_agent",
    "unknown_peer",
    "bits_cut_mismatch",
)
# Why a pull brought nothing without a fault (``PullResult.skipped``): every matched page is held here
# already; too few pages to be worth a READ (``recompute_threshold_tokens``); no pages to READ into
# before the wait for them ended.
SKIP_REASONS = ("nothing_to_pull", "below_threshold", "no_free_pages")
DEFAULT_THRESHOLD_TOKENS = 64  # "auto" before both rates are measured
# a READ runs at most as long as recomputing its tokens is predicted to take, plus this (``Puller.read_bound_s``)
READ_BOUND_SLACK_S = 2.0  # room for a loaded host; still far under the 10 s default timeout
# ``PullResult.phases``, on the request's path in this order: wait for the engine thread (the step
# in flight and the calls queued before), hash and match the prompt and allocate (on it), wait for
# free pages (a full pool only), wait for the sender's hold (sent before planning), build the READ's
# descriptors, the READ itself, register and pin the pages and, given ``admit``, add the request (one
# hop: its wait for the engine thread too), wait for a hold that ended in no READ. ``contact_agent``
# / ``contact_hold``: the agent fetch (first pull from an incarnation only) and the hold's round
# trip, on a peer-call thread beside the planning.
PULL_PHASES = (
    "engine_wait",
    "plan",
    "page_wait",
    "lease_check",
    "descriptors",
    "read",
    "adopt",
    "release",
    "contact_agent",
    "contact_hold",
)

FetchAgent = Callable[[str], dict[str, Any]]  # agent_url -> GET /internal/kv/agent's body
Admit = Callable[[str], None]  # adds the request under this admission pin, on the engine thread
HoldRemote = Callable[[str, str, str, float, bool, float], dict[str, Any]]  # url, lease, digest, hold_s, consume, wait_s
ReleaseRemote = Callable[[str, str], None]  # url, lease or hold id


@dataclass(slots=True, frozen=True)
class PullResult:
    """What ``pull`` did for one request."""

    pulled_tokens: int = 0
    num_bytes: int = 0
    num_regions: int = 0
    seconds: float = 0.0
    fallback: str | None = None  # one of FALLBACK_REASONS, or None
    admission_pin: str | None = None  # pass to LLMEngine.add_request(admission_pin=...) unless ``admitted``
    admitted: bool = False  # ``admit`` added the request under ``admission_pin`` in the adopt hop
    matched_tokens: int = 0  # leading remote tokens whose hashes equal this prompt's
    local_tokens: int = 0  # of those, the leading ones already in the local prefix cache
    skipped: str | None = None  # why nothing was pulled without a fault (one of SKIP_REASONS)
    missed_tokens: int = 0  # tokens the plan wanted to pull and did not (skipped or failed): the engine computes them
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

    def ms(self) -> dict[str, float]:
        """The phases so far in milliseconds, rounded (for a log line)."""
        return {k: round(v * 1e3, 1) for k, v in self.seconds.items()}


@dataclass(slots=True)
class _Plan:
    matched: int = 0  # leading pages equal to the remote's
    usable: int = 0  # remote pages this prompt could use at most
    local_pids: list[int] = field(default_factory=list)  # the leading matched pages held here
    held_between: list[int] = field(default_factory=list)  # matched pages held here past the first one pulled
    want: list[int] = field(default_factory=list)  # page indices to pull
    hashes: list[int] = field(default_factory=list)
    local_pin: str | None = None  # admission pin of ``local_pids`` and ``held_between`` while the pull runs
    remote_pids: list[int] = field(default_factory=list)  # the sender's ids of ``want``
    skipped: str | None = None  # nothing to pull ("nothing_to_pull", "below_threshold")
    local: list[int] | None = None  # pages allocated to READ into (None: none free, or skipped)

    @property
    def kept(self) -> list[int]:
        """The matched pages held here, pinned with the pulled ones for the request: not pulled again,
        and evicted before admission one would end the request's match there (the pages after it wasted)."""
        return self.local_pids + self.held_between


@dataclass(slots=True)
class _Contact:
    """What the puller learned from the sender before its READ (``Puller._contact``)."""

    peer: RemoteBuffers | None = None
    hold_id: str | None = None
    fallback: str | None = None
    agent_s: float = 0.0
    hold_s: float = 0.0


class Puller:
    """Pulls of one engine from its peers (see the module docstring), with their counters and
    the two "auto" measurements."""

    def __init__(
        self,
        engine: LLMEngine,
        reuse: ReuseConfig,
        nixl: NixlIO,
        *,
        engine_id: str,
        agent_url: str,
        layout_hash: str,
        peers: PeerSet,
        run_on_engine: Callable[[Callable[[], Any]], Any],
        fetch_agent_info: FetchAgent,
        hold_remote: HoldRemote,
        release_remote: ReleaseRemote,
        page_wait_share: float = PAGE_WAIT_SHARE,
    ) -> None:
        """``page_wait_share``: of ``reuse.transfer_timeout_s``, how long a pull waits for free pages
        to READ into (0: it skips at once)."""
        self.engine = engine
        self.reuse = reuse
        self.nixl = nixl
        self.engine_id = engine_id
        self.layout_hash = layout_hash
        self.peers = peers
        self._own = url_key(agent_url)
        self._run = run_on_engine
        self._fetch = fetch_agent_info
        self._hold_remote = hold_remote
        self._release_remote = release_remote
        st = engine.storage
        self.page_size = st.page_size
        self.dtype = st.kv_dtype
        self.geometry = nixl.geometry
        # the sender calls of a pull run here: the hold overlaps the pull's own planning, and
        # releases after the READ leave the request's path
        self._calls = ThreadPoolExecutor(max_workers=32, thread_name_prefix="kvserving-kv-peer")
        self._counts_lock = threading.Lock()  # pulls run on several server threads at once
        self.page_wait_share = page_wait_share
        self.fallbacks: Counter[str] = Counter()
        self.skips: Counter[str] = Counter()
        self.missed_tokens: Counter[str] = Counter()  # by skip or fallback reason
        self.page_waits = 0  # pulls that found no free pages at once and waited
        self.no_room = 0  # pulls whose first allocation found no room (they waited or skipped)
        self.no_room_held = dict.fromkeys(NO_ROOM_HOLDERS, 0)  # summed over those: what held the pool's pages then
        self.page_wait_seconds_total = 0.0
        self.pulls = 0
        self.pulled_tokens_total = 0
        self.pulled_bytes_total = 0
        self.pulled_regions_total = 0
        self.transfer_seconds_total = 0.0
        self.descriptor_seconds_total = 0.0  # of transfer_seconds_total: building the descriptor lists in Python
        self.post_seconds_total = 0.0  # of transfer_seconds_total: NIXL taking the lists and posting the READ
        self.transfer_bytes_per_s: float | None = None  # NIXL READ rate achieved (EWMA)
        self.pull_overhead_s: float | None = None  # per pull: agent fetch + hold (EWMA)

    def _on_engine(self, fn: Callable[[], T]) -> T:
        return cast(T, self._run(fn))

    def close(self) -> None:
        self._calls.shutdown(wait=True)

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
        recompute, bw, overhead = self.recompute_s(num_tokens), self.transfer_bytes_per_s, self.pull_overhead_s
        if recompute is None or bw is None or overhead is None:
            return num_tokens >= DEFAULT_THRESHOLD_TOKENS
        return overhead + num_bytes / bw < recompute

    def recompute_s(self, num_tokens: int) -> float | None:
        """The measured prefill's time for ``num_tokens`` (None before a prefill is measured)."""
        tps = self.prefill_tokens_per_s
        return None if tps is None else num_tokens / tps

    def read_bound_s(self, num_tokens: int) -> float | None:
        """How long a READ of ``num_tokens`` may run before it is abandoned for recomputing them: the
        measured prefill's time for those tokens plus ``READ_BOUND_SLACK_S`` (waiting longer than the
        alternative costs bounds a pull at twice it, whatever the transport does); None before a
        prefill is measured (``transfer_timeout_s`` alone bounds the READ)."""
        recompute = self.recompute_s(num_tokens)
        return None if recompute is None else recompute + READ_BOUND_SLACK_S

    def hold_wait_s(self, num_tokens: int) -> float:
        """How long a pull waits for the sender's answer to its hold: ``reuse.peer_timeout_s``, or, once a
        prefill is measured, as long as recomputing the offered ``num_tokens`` is predicted to take if that
        is longer. A busy sender answers after its engine step (long prompt chunks take seconds on a loaded
        GPU), and giving up earlier than the recompute it leads to costs more than it saves; a frozen
        sender costs a pull at most that long."""
        return max(self.reuse.peer_timeout_s, self.recompute_s(num_tokens) or 0.0)

    def measure(self, read_bytes: int, read_s: float, overhead_s: float | None) -> None:
        """Fold one READ's rate and one pull's overhead into the "auto" measurements (a READ that
        timed out folds in its bytes over the time it had, a rate it did not reach, and no overhead)."""
        a = 0.3
        if read_s > 0 and read_bytes > 0:
            rate = read_bytes / read_s
            self.transfer_bytes_per_s = rate if self.transfer_bytes_per_s is None else (1 - a) * self.transfer_bytes_per_s + a * rate
        if overhead_s is not None:
            self.pull_overhead_s = overhead_s if self.pull_overhead_s is None else (1 - a) * self.pull_overhead_s + a * overhead_s

    def counters(self) -> dict[str, Any]:
        with self._counts_lock:
            return {
                "pulls": self.pulls,
                "pulled_tokens": self.pulled_tokens_total,
                "pulled_bytes": self.pulled_bytes_total,
                "pulled_regions": self.pulled_regions_total,
                "transfer_seconds": self.transfer_seconds_total,
                "descriptor_seconds": self.descriptor_seconds_total,
                "post_seconds": self.post_seconds_total,
                "fallbacks": {r: self.fallbacks.get(r, 0) for r in FALLBACK_REASONS},
                "skips": {r: self.skips.get(r, 0) for r in SKIP_REASONS},
                "missed_tokens": {r: self.missed_tokens.get(r, 0) for r in (*SKIP_REASONS, *FALLBACK_REASONS)},
                "page_waits": self.page_waits,
                "page_wait_seconds": self.page_wait_seconds_total,
                "no_room": self.no_room,
                "no_room_held_pages": dict(self.no_room_held),
                "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "transfer_bytes_per_s": self.transfer_bytes_per_s,
                "stuck_transfers": self.nixl.num_stuck,
            }

    # ------------------------------------------------------------------ pull
    def pull(
        self,
        input_ids: Sequence[int],
        tags: Sequence[int] | None,
        params: KVTransferParams | None,
        *,
        cache_salt: str | None = None,
        admit: Admit | None = None,
    ) -> PullResult:
        """Pull what ``params`` offers of this prompt's KV: plan -> hold -> READ -> adopt. Never
        raises for a transfer fault: the result's ``fallback`` says why nothing (or less) was
        pulled. ValueError only for the caller's own mistake (tags not one per input token).
        ``cache_salt``: the request's, in the hashes its pages are matched by (a sender's pages
        of another salt never match). ``admit``: called on the engine thread with the admission
        pin, in the adopt hop right after the pin is taken (the result's ``admitted``); what it
        raises (the engine's ValueError) releases that pin in the same call and leaves ``pull``.
        Never called by a pull without an adopt hop: its caller adds the request."""
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
        if not self._cut_agrees(params):
            return self._fail("bits_cut_mismatch")
        named = parse_lease_id(params.lease_id)
        single_use = named is not None and named[0] is PinKind.TRANSFER
        # The sender's hold runs while this worker plans (``_contact``); the READ's deadline
        # counts from here, inside the hold (``HOLD_MARGIN_S``).
        t_send = time.monotonic()
        contact = self._calls.submit(self._contact, params) if params.engine_id != self.engine_id else None
        plan: _Plan | None = None
        result = PullResult()
        read = False  # pages READ and adopted under an admission pin

        def plan_on_engine() -> _Plan:
            ph.mark("engine_wait")  # the step in flight and the calls queued before (this thread waits meanwhile)
            return self._plan(ids, tag_list, params, cache_salt)

        try:
            plan = self._on_engine(plan_on_engine)
            ph.mark("plan")
            result = self._hold_read_adopt(plan, params, contact, t_send, ph, admit)
            read = result.admission_pin is not None
            if not read and plan.local_pin is not None:
                # nothing read: the local prefix it matched waits for the request as pulled pages do
                pin = self._adopt_on_engine(plan, [], [], list(plan.local_pids), admit)
                result = replace(result, admission_pin=pin, admitted=admit is not None)
                ph.mark("adopt")
        finally:
            if plan is not None and plan.local_pin is not None:  # no adopt took the plan's pin
                pin = plan.local_pin
                self._on_engine(lambda: release_admission(self.engine.pool, pin, ()))
                ph.mark("adopt")
            if contact is not None:
                if not read and single_use:
                    # nothing read: wait for the hold (it consumes a prefill's single-use lease), so
                    # that pull returns with the sender's transfer lease already gone
                    wait([contact], timeout=self.reuse.peer_timeout_s + 1.0)
                    ph.mark("release")
                # the hold is over once the READ is: let the sender free it, off the request's path
                contact.add_done_callback(lambda f: self._later(self._release_contact, params, f))
            elif not read and single_use:
                # nothing read and nobody asked (our own id): a prefill worker's single-use lease
                # is no use to anyone now; free its pages at once rather than at its timeout
                self._release_quietly(params.agent_url, params.lease_id)
        result.phases.update(ph.seconds)
        return result

    def drop_admission(self, result: PullResult) -> None:
        """Release a pull's admission pin when its request never reached the engine (an admitted
        request holds it: the engine releases it at the request's admission or abort)."""
        if result.admission_pin is not None and not result.admitted:
            pin = result.admission_pin
            self._on_engine(lambda: release_admission(self.engine.pool, pin, ()))

    def reap(self) -> int:
        """Free the pages of timed-out READs that NIXL has since let go (``pull`` does this
        first thing); how many pages were freed."""
        done = self.nixl.reap()
        if done:
            self._on_engine(lambda: self.engine.pool.free(done))
        return len(done)

    def _cut_agrees(self, params: KVTransferParams) -> bool:
        """Whether the params' bit-budget cut is one this worker can honour; a follower adopts it.
        A cut is carried exactly when its sender holds the budget (``bit_budget_control: hold``)."""
        control = self.engine.kv.controller
        if params.bits_cut is None or params.bits_ranking is None:
            return control is None
        if control is None:
            return False
        cut, ranking = params.bits_cut, params.bits_ranking
        try:
            self._on_engine(lambda: control.adopt(cut, ranking))
        except ValueError:
            return False
        return True

    # -- plan
    def _plan(self, ids: list[int], tags: list[int], params: KVTransferParams, cache_salt: str | None = None) -> _Plan:
        """On the engine thread: match the remote hashes against this prompt's, find what the
        local prefix cache holds (pinned while the pull runs), pick the pages to pull, decide
        whether they are worth it and allocate them (one hop onto the engine thread)."""
        kv, pool, p = self.engine.kv, self.engine.pool, self.page_size
        seq = EngineSequence(
            "kv-pull", ids, SamplingParams(), make_generator(0), tags=tags, cache_salt=cache_salt.encode() if cache_salt else None
        )
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
            # pages the sender aged and this worker holds at 4 bits: age them here, pull nothing (manager)
            kv.age_cached([h for h, b in zip(plan.hashes, bits) if b == 2])
        else:  # pages are taken as stored: a page held here at the other precision is not pulled again
            held = kv.held_page
        i = 0
        while i < plan.matched and (pid := held(plan.hashes[i])) is not None:
            plan.local_pids.append(pid)
            i += 1
        for j in range(i, plan.matched):
            if (pid := held(plan.hashes[j])) is None:
                plan.want.append(j)
            else:
                plan.held_between.append(pid)
        plan.remote_pids = [params.page_ids[j] for j in plan.want]
        if not plan.want:
            plan.skipped = "nothing_to_pull"
        elif not self.worth_pulling(len(plan.want) * p, self.page_nbytes(plan.remote_pids)):
            plan.skipped = "below_threshold"
        if plan.local_pids or plan.held_between:
            # never reclaimed while the pull runs: ``_adopt`` re-pins these pages for the admission (the prefix
            # alone when nothing was read: the request's match ends at the first page not pulled)
            plan.local_pin = pin_for_admission(pool, plan.kept, pulled=(), ttl_s=self._pin_ttl(), reclaim=RECLAIM_NEVER)
        if plan.skipped is None and params.engine_id != self.engine_id:
            plan.local = self.allocate_for_pull([page_id_bits(pid) for pid in plan.remote_pids])
            if plan.local is None:
                holders = pool.page_holders(kind_of=never_pin_kind)
                with self._counts_lock:
                    self.no_room += 1
                    for key, n in holders.items():
                        self.no_room_held[key] += n
        return plan

    def allocate_for_pull(self, bits: list[int]) -> list[int] | None:
        """Pages to READ into (one per entry of ``bits``), or None. Engine thread only.

        A pull serves a live request, so retained conversations yield to it as they do
        to a request's own allocation (least recently active first): a pool full of
        retained KV would otherwise refuse the pull and make the request recompute.
        Pages pulled for requests waiting to be admitted do not (their requests would
        compute them again); the pull waits for pages instead (``wait_for_pages``).
        Placed as one new sequence (a run where one is free), so the READ stays few regions.
        """
        return self.engine.pool.allocate_reclaiming(bits, up_to=RECLAIM_FIRST)

    def wait_for_pages(self, bits: list[int], *, until: float) -> list[int] | None:
        """``allocate_for_pull`` again at most every ``PAGE_WAIT_POLL_S`` (one hop onto the engine thread: once
        per engine step at most) until it gives pages or ``until`` (monotonic) passes. A full pool frees pages
        as its running requests end; recomputing instead would need as many pages and the prompt's compute
        too (on a busy GPU, steps of hundreds of ms for each long prompt)."""
        while time.monotonic() + PAGE_WAIT_POLL_S < until:
            time.sleep(PAGE_WAIT_POLL_S)
            got = self._on_engine(lambda: self.allocate_for_pull(bits))
            if got is not None:
                return got
        return None

    def _pin_ttl(self) -> float:
        return max(60.0, 2 * self.reuse.transfer_timeout_s)

    # -- hold, READ, adopt
    def _hold_read_adopt(
        self,
        plan: _Plan,
        params: KVTransferParams,
        contact: Future[_Contact] | None,
        t_send: float,
        ph: _Phases,
        admit: Admit | None,
    ) -> PullResult:
        """Wait for the sender's hold, READ, adopt; every early return is a skip or a fallback."""
        p = self.page_size
        diverged = plan.matched < plan.usable
        base: dict[str, Any] = {"matched_tokens": plan.matched * p, "local_tokens": len(plan.local_pids) * p}
        missed = len(plan.want) * p
        if plan.skipped is None and contact is None:
            # our own lease would have kept these pages in the local cache: it is gone
            return self._fail("lease_expired", missed=missed, **base)
        if plan.skipped is not None:
            if diverged:
                return self._fail("hash_mismatch", missed=missed, **base)
            return self._skip(plan.skipped, missed, **base)
        local = plan.local
        if local is None and self.page_wait_share > 0:
            t_wait = time.monotonic()
            bits = [page_id_bits(pid) for pid in plan.remote_pids]
            local = self.wait_for_pages(bits, until=t_send + self.page_wait_share * self.reuse.transfer_timeout_s)
            ph.mark("page_wait")
            with self._counts_lock:
                self.page_waits += 1
                self.page_wait_seconds_total += time.monotonic() - t_wait
        if local is None:
            return self._skip("no_free_pages", missed, **base)
        assert contact is not None
        try:
            c = contact.result()  # the sender's hold, asked for before ``_plan``
        except Exception:  # noqa: BLE001 - a bug in the contact must not leak the pages
            log.exception("contact for lease %s at %s failed", params.lease_id, params.agent_url)
            c = _Contact(fallback="transfer_failed")
        ph.mark("lease_check")
        ph.add("contact_agent", c.agent_s)
        ph.add("contact_hold", c.hold_s)
        if c.fallback is not None or c.peer is None:
            self._discard(local, safe=True)
            return self._fail(c.fallback or "transfer_failed", missed=missed, **base)
        reason, stats = self._read(c.peer, params, local, plan.remote_pids, t_send, ph)
        if stats is None:
            return self._fail(reason or "transfer_failed", missed=missed, **base)
        overhead = max(0.0, time.monotonic() - t_send - stats.seconds)  # hold, allocation, planning
        self._count(stats, len(local) * p, overhead)  # the READ happened, whatever its request's add does
        pin = self._adopt_on_engine(plan, local, [plan.hashes[i] for i in plan.want], plan.kept, admit)
        ph.mark("adopt")
        fallback = None
        if diverged:
            fallback = "hash_mismatch"
            with self._counts_lock:
                self.fallbacks[fallback] += 1
        return PullResult(
            pulled_tokens=len(local) * p,
            num_bytes=stats.num_bytes,
            num_regions=stats.num_regions,
            seconds=time.monotonic() - t_send,
            fallback=fallback,
            admission_pin=pin,
            admitted=admit is not None,
            **base,
        )

    def _contact(self, params: KVTransferParams) -> _Contact:
        """On a peer-call thread: the sender's NIXL agent (cached by engine id and the lease id's
        generation: no agent fetch once met) and a hold of the lease's pages for one READ. One
        round trip replaces a lease listing before the READ and a renewal after it."""
        c = _Contact()
        t0 = time.perf_counter()
        named = parse_lease_id(params.lease_id)
        peer = self.nixl.remote(params.engine_id, named[1]) if named is not None else None
        if peer is None:
            got = self._connect(params)
            c.agent_s = time.perf_counter() - t0
            if isinstance(got, str):
                c.fallback = got
                return c
            peer = got
        t1 = time.perf_counter()
        digest = lease_digest(params.page_ids, params.page_hashes, params.num_tokens)
        consume = named is not None and named[0] is PinKind.TRANSFER  # a prefill's lease is single use
        try:
            hold_s, wait_s = self.reuse.transfer_timeout_s + HOLD_MARGIN_S, self.hold_wait_s(params.num_tokens)
            reply = self._hold_remote(params.agent_url, params.lease_id, digest, hold_s, consume, wait_s)
            c.hold_s = time.perf_counter() - t1
            refused = reply.get("refused")
            if refused is not None:
                c.fallback = "lease_expired" if refused == "unknown_lease" else "hash_mismatch"
                return c
            c.hold_id = str(reply["hold_id"])
            engine_id, generation = str(reply["engine_id"]), int(reply["generation"])
        except Exception as exc:  # noqa: BLE001 - connection refused, timeout, bad JSON: all unreachable
            log.warning("hold of lease %s at %s failed: %s: %s", params.lease_id, params.agent_url, type(exc).__name__, exc)
            self.nixl.forget_remote(params.engine_id, unless_reading=True)
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
        except Exception as exc:  # noqa: BLE001 - connection refused, timeout, bad JSON: all unreachable
            log.warning("agent info of %s failed: %s: %s", params.agent_url, type(exc).__name__, exc)
            self.nixl.forget_remote(params.engine_id, unless_reading=True)
            return "remote_unreachable"
        named = parse_lease_id(params.lease_id)
        if engine_id != params.engine_id or (named is not None and named[1] != generation):
            self.nixl.forget_remote(params.engine_id)  # restarted: the pages named by params are gone
            return "stale_agent"
        if info.get("layout_hash") != self.layout_hash:
            return "layout_mismatch"
        try:
            geometry = PageGeometry(*(int(x) for x in lay["region_geometry"]))
            peer = self.nixl.remote(engine_id, generation)
            if peer is None:
                peer = self.nixl.add_remote(
                    engine_id,
                    generation,
                    base64.b64decode(info["metadata"]),
                    addrs=[int(a) for a in lay["buffer_addrs"]],
                    device_id=int(lay.get("device_id", 0)),
                    geometry=geometry,
                )
        except Exception:  # noqa: BLE001 - metadata NIXL cannot load
            self.nixl.forget_remote(engine_id)
            return "stale_agent"
        return peer

    def _read(
        self,
        peer: RemoteBuffers,
        params: KVTransferParams,
        local: list[int],
        remote_pids: list[int],
        t_send: float,
        ph: _Phases,
    ) -> tuple[str | None, ReadStats | None]:
        """READ while the sender's hold pins the pages: it lasts ``transfer_timeout_s +
        HOLD_MARGIN_S`` from before the sender took it, and the READ must end within
        ``transfer_timeout_s`` of the same instant, so the pages cannot change under it. On any
        failure the local pages are discarded unregistered and the reason returned."""
        left = self.reuse.transfer_timeout_s - (time.monotonic() - t_send)
        bound = self.read_bound_s(len(local) * self.page_size)
        if bound is not None and bound < left:
            left = bound
        if left <= 0:
            log.warning(
                "pull of lease %s from %s: no time left for the READ (ms spent: %s)",
                params.lease_id,
                params.agent_url,
                ph.ms(),
            )
            self._discard(local, safe=True)
            return "transfer_timeout", None
        try:
            stats = self.nixl.read(peer, local, remote_pids, timeout_s=left)
        except TransferError as exc:
            log.warning(
                "READ of %d pages of lease %s from %s failed: %s (ms before it: %s)",
                len(local),
                params.lease_id,
                params.agent_url,
                exc,
                ph.ms(),
            )
            if exc.reason == "transfer_timeout":
                with self._counts_lock:  # "auto" learns the transport is slower than this
                    self.measure(self.page_nbytes(remote_pids), left, None)
            else:
                # a slow peer keeps its agent; a failed one is loaded fresh next time, unless
                # other pulls are reading from it (dropping the agent would fail their READs too)
                self.nixl.forget_remote(params.engine_id, unless_reading=True)
            self._discard(local, safe=exc.pages_safe)
            return exc.reason, None
        except ValueError:  # page ids outside the sender's buffers, or sizes that differ: not its layout
            self._discard(local, safe=True)
            return "layout_mismatch", None
        ph.mark("read")
        ph.add("read", -stats.descriptor_seconds)
        ph.add("descriptors", stats.descriptor_seconds)
        return None, stats

    def _adopt_on_engine(self, plan: _Plan, pages: list[int], hashes: list[int], kept: list[int], admit: Admit | None) -> str:
        """One hop onto the engine thread: ``_adopt`` (which takes over the plan's own pin), then
        ``admit(pin)`` given one, so the request's add waits for no engine step of its own. What
        ``admit`` raises releases the admission pin in the same call and leaves here."""
        local_pin = plan.local_pin

        def adopt() -> str:
            pin = self._adopt(pages, hashes, kept, local_pin)
            plan.local_pin = None  # released by ``_adopt``: ``pull``'s cleanup leaves it alone
            if admit is not None:
                try:
                    admit(pin)
                except BaseException:
                    release_admission(self.engine.pool, pin, ())
                    raise
            return pin

        return self._on_engine(adopt)

    def _adopt(self, pages: list[int], hashes: list[int], local_pids: list[int], local_pin: str | None) -> str:
        """On the engine thread: register pulled pages and pin them with the local prefix under
        one admission pin (both survive until admission), drop our own refs and the pull's own
        pin on the local prefix; the admission pin's id."""
        pool = self.engine.pool
        for pid, h in zip(pages, hashes):
            pool.register(pid, h)
        # pulled pages wait for their request's admission; under pressure they yield (and stay
        # in the prefix cache), else pins of requests that cannot be admitted fill the pool
        pin = pin_for_admission(pool, local_pids + pages, pulled=pages, ttl_s=self._pin_ttl())
        pool.free(pages)
        if local_pin is not None:
            release_admission(pool, local_pin, ())
        return pin

    def _discard(self, pages: list[int], *, safe: bool) -> None:
        """Free pages of a failed READ unregistered; unsafe ones wait until NIXL lets go (``reap``)."""
        if safe:
            self._on_engine(lambda: self.engine.pool.free(pages))

    # -- after the READ
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
        if c.hold_id is not None:
            self._release_quietly(params.agent_url, c.hold_id)

    def _release_quietly(self, agent_url: str, pin_id: str) -> None:
        try:
            self._release_remote(agent_url, pin_id)
        except Exception:  # noqa: BLE001 - the sender's own expiry frees it anyway
            pass

    # -- counters
    def _count(self, stats: ReadStats, tokens: int, overhead_s: float) -> None:
        with self._counts_lock:
            self.measure(stats.num_bytes, stats.seconds, overhead_s)
            self.pulls += 1
            self.pulled_tokens_total += tokens
            self.pulled_bytes_total += stats.num_bytes
            self.pulled_regions_total += stats.num_regions
            self.transfer_seconds_total += stats.seconds
            self.descriptor_seconds_total += stats.descriptor_seconds
            self.post_seconds_total += stats.post_seconds

    def _fail(self, reason: str, *, missed: int = 0, **kw: Any) -> PullResult:
        """A fallback; ``missed``: the tokens the plan wanted (none when it failed before planning)."""
        assert reason in FALLBACK_REASONS, reason
        with self._counts_lock:
            self.fallbacks[reason] += 1
            self.missed_tokens[reason] += missed
        return PullResult(fallback=reason, missed_tokens=missed, **kw)

    def _skip(self, reason: str, missed: int, **kw: Any) -> PullResult:
        assert reason in SKIP_REASONS, reason
        with self._counts_lock:
            self.skips[reason] += 1
            self.missed_tokens[reason] += missed
        return PullResult(skipped=reason, missed_tokens=missed, **kw)
