"""What a worker does for each API call, without HTTP: admit or refuse a
generate request, turn engine outputs into stream events with ``usage``, read
KV stats, drain on shutdown.

States: ``starting`` (model loading; /ready 503) -> ``ready`` -> ``draining``
(SIGTERM: no new requests, in-flight ones finish or are aborted at the grace
deadline) -> ``stopped``. ``server.py`` maps the errors raised here to HTTP
statuses: ``NotReadyError`` 503, ``DuplicateRequestError`` 409, ``ValueError``
400, ``LeaseNotFoundError`` 404.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

from kvserving.config import ServingConfig
from kvserving.worker.async_engine import AsyncEngine, RequestStream
from kvserving.worker.engine import LLMEngine, RequestOutput
from kvserving.worker.kv_stats import KVStats, collect
from kvserving.worker.kv.leases import LeaseMismatchError
from kvserving.worker.kv.puller import Admit, PullResult
from kvserving.worker.kv.transfer import KVTransfer
from kvserving.worker.kv.protocol import KVTransferParams
from kvserving.worker.metrics import WorkerMetrics
from kvserving.worker.peers import PeerSet
from kvserving.worker.sampling import SamplingParams
from kvserving.worker.api_bodies import GenerateBody

log = logging.getLogger(__name__)

STARTING, READY, DRAINING, STOPPED = "starting", "ready", "draining", "stopped"


def lost_before_admission(pull: PullResult, cached_tokens: int) -> int:
    """Prompt tokens ``pull`` had in place that its request, admitted with ``cached_tokens`` from the
    prefix cache, no longer found: the admission pin yielded under pressure and the pages were
    evicted before the request ran. In place: every matched page it did not miss when it READ
    pages; the leading pages held here when it read none (the match ends at the first page missing)."""
    in_place = pull.matched_tokens - pull.missed_tokens if pull.pulled_tokens else pull.local_tokens
    return max(0, in_place - cached_tokens)


class NotReadyError(RuntimeError):
    """The worker does not admit requests now (loading or draining)."""


class LeaseNotFoundError(LookupError):
    """No lease with this id on this worker."""


__all__ = ["Admitted", "LeaseMismatchError", "LeaseNotFoundError", "NotReadyError", "WorkerService"]


@dataclass(slots=True)
class Admitted:
    """A generate request the engine accepted, and what the final event reports about its prompt."""

    body: GenerateBody
    stream: RequestStream
    params: SamplingParams
    remote: KVTransferParams | None  # what the request may pull (``kv_transfer_params``)
    pull: PullResult = field(default_factory=PullResult)
    # perf_counter marks: admit entered, the pull over, the request queued on the engine (``timings``)
    t_admit: float = 0.0
    t_pulled: float = 0.0
    t_queued: float = 0.0


class WorkerService:
    def __init__(
        self,
        config: ServingConfig,
        *,
        role: str,
        metrics: WorkerMetrics,
        engine_id: str,
        advertise_url: str,
        internal_token: str | None = None,
    ) -> None:
        self.config = config
        self.internal_token = internal_token  # sent to peer workers (their /internal/* routes need it)
        self.role = role
        self.advertise_url = advertise_url
        self.metrics = metrics
        self.engine_id = engine_id
        self.state = STARTING
        self.engine: AsyncEngine | None = None
        self.transfer: KVTransfer | None = None
        self.started_at = time.time()

    # ------------------------------------------------------------------ life
    async def start(self, engine: LLMEngine, *, transfer: bool = True) -> None:
        """Serve ``engine`` (built off the event loop by the caller) and bring up its NIXL
        agent (``transfer``); /ready turns 200 when both are up."""
        async_engine = AsyncEngine(engine)
        self.engine = async_engine
        if transfer:
            self.transfer = await asyncio.to_thread(
                KVTransfer,
                engine,
                self.config.reuse,
                engine_id=self.engine_id,
                agent_url=self.advertise_url,
                role=self.role,
                run_on_engine=async_engine.run_sync,
                internal_token=self.internal_token,
                peers=PeerSet.from_config(self.config.gateway),
                max_hold_s=self.config.security.max_hold_s,
            )
        if self.state != STARTING:  # a signal came while loading
            return
        self.state = READY
        self.metrics.ready.set(1)
        log.info(
            "worker %s ready: role %s, kv %s, pool %d tokens", self.engine_id, self.role, engine.storage.kv_dtype, engine.capacity_tokens
        )

    @property
    def ready(self) -> bool:
        return self.state == READY

    def capacity(self) -> dict[str, int]:
        """What a request may need (``LLMEngine.add_request``'s check), for /ready: the gateway
        sends a decode only to a worker it fits, else answers 400 before streaming."""
        assert self.engine is not None
        engine = self.engine.engine
        # worst case every page is 4-bit, as the admission check counts
        return {"max_model_len": engine.max_model_len, "kv_capacity_tokens": engine.kv_cache.capacity_tokens_at(0.0)}

    async def drain(self, *, grace_s: float) -> int:
        """Stop admitting; wait up to ``grace_s`` for in-flight requests, then abort the rest.

        Returns how many were aborted."""
        if self.state in (DRAINING, STOPPED):
            return 0
        self.state = DRAINING
        self.metrics.ready.set(0)
        if self.engine is None:
            return 0
        deadline = time.monotonic() + grace_s
        while self.engine.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        aborted = [rid for rid in self.engine.in_flight if self.engine.abort(rid)]
        if aborted:
            log.warning("grace period over: aborted %d request(s)", len(aborted))
            # let the aborted streams send their final event before the server closes connections
            wait_until = time.monotonic() + 2.0
            while self.engine.in_flight and time.monotonic() < wait_until:
                await asyncio.sleep(0.02)
        return len(aborted)

    async def close(self) -> None:
        """Abort what still runs, release the NIXL agent, stop the engine thread."""
        self.state = STOPPED
        self.metrics.ready.set(0)
        if self.engine is not None:
            for rid in self.engine.in_flight:
                self.engine.abort(rid)
        if self.transfer is not None:
            await asyncio.to_thread(self.transfer.close)
        if self.engine is not None:
            await self.engine.close()

    def _engine(self) -> AsyncEngine:
        if self.state != READY or self.engine is None:
            raise NotReadyError(f"worker is {self.state}")
        return self.engine

    # -------------------------------------------------------------- generate
    def admit(self, body: GenerateBody) -> Admitted:
        """Claim ``body``'s request id and check that the engine can run it: the errors a client
        gets before any response (503 not ready, 409 duplicate id, 400 bad request). The pull and
        the queueing (``queue``) run once the response is open, so its headers and keep-alive
        comments flow while they take: a busy worker is told from a frozen one."""
        t_admit = time.perf_counter()
        engine = self._engine()
        s = body.sampling
        params = SamplingParams(
            max_tokens=s.max_tokens,
            temperature=float(s.temperature),
            top_p=float(s.top_p),
            top_k=s.top_k,
            seed=s.seed,
            stop_token_ids=tuple(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
        )
        remote = None
        if body.kv_transfer_params is not None:
            remote = KVTransferParams.from_dict(body.kv_transfer_params.model_dump())
        engine.check(body.input_ids, params, tags=body.tags, output_ids=body.output_ids)
        stream = engine.reserve(body.request_id, len(body.input_ids))
        return Admitted(body, stream, params, remote, t_admit=t_admit)

    async def queue(self, req: Admitted) -> None:
        """Pull what ``kv_transfer_params`` offers, then queue the request on the engine; a pull
        that fails is not an error (the request recomputes; ``usage.reuse_fallback``). A pull
        that pins pages adds the request in the same engine-thread call (``PullResult.admitted``),
        so the add waits for no engine step of its own. A client that leaves meanwhile leaves
        nothing behind: a pull in flight drops its pin, or aborts the request it added, when it
        ends; a request being queued is aborted after it (or its pin dropped if it never was)."""
        body, stream = req.body, req.stream
        engine = self.engine  # admitted: it runs to the end, through a drain too
        assert engine is not None
        kvt = self.transfer
        pull = PullResult()
        try:
            retain = None
            if kvt is not None and (self.role == "prefill" or body.retain):
                retain = kvt.retain_spec(conversation_key=body.conversation_key, input_ids=body.input_ids)
            add = engine.adder(
                stream, body.input_ids, req.params, tags=body.tags, retain=retain, output_ids=body.output_ids, cache_salt=body.cache_salt
            )
            if kvt is not None and req.remote is not None:
                pull = await self._pull(kvt, body, req.remote, add)
                self._count_pull(pull)
            req.pull, req.t_pulled = pull, time.perf_counter()
            if pull.admitted:
                engine.started(stream)
            else:
                await engine.start(stream, add, admission_pin=pull.admission_pin)
            req.t_queued = time.perf_counter()
        except BaseException:
            stream.finished = True
            stream.close()
            if kvt is not None and pull.admission_pin is not None:
                # on the engine thread, after the add if it was queued (the pull's, or a cancelled
                # call that still runs it): abort the request, whose abort drops the pin, or drop the pin
                rid, held = body.request_id, pull
                engine.submit(lambda e: e.abort(rid) if rid in e.requests else kvt.drop_admission(held))
            raise

    async def _pull(self, kvt: KVTransfer, body: GenerateBody, remote: KVTransferParams, admit: Admit) -> PullResult:
        """``kvt.pull`` on a thread, adding the request (``admit``) in its adopt hop; cancelled while
        it runs, the pull finishes there, then the request it added is aborted, or its pin dropped."""
        task = asyncio.ensure_future(
            asyncio.to_thread(kvt.pull, body.input_ids, body.tags, remote, cache_salt=body.cache_salt, admit=admit)
        )
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            engine, rid = self.engine, body.request_id
            assert engine is not None

            def settle(done: asyncio.Future[PullResult]) -> None:
                if done.cancelled() or done.exception() is not None:
                    return  # nothing pinned: a pull that raises has released its pins
                held = done.result()
                if held.admitted:
                    # on the engine thread, after the add: its stream is gone, so nothing would read it
                    engine.submit(lambda e: e.abort(rid))
                elif held.admission_pin is not None:
                    # the executor holds the call: nothing here needs to keep the future
                    asyncio.get_running_loop().run_in_executor(None, kvt.drop_admission, held)

            task.add_done_callback(settle)
            raise

    def close_stream(self, req: Admitted) -> None:
        """The response is over (sent, or the client went away): abort the request unless it finished."""
        if not req.stream.finished:
            self.metrics.requests.labels(finish_reason="abort").inc()
        req.stream.close()

    def _count_pull(self, pull: PullResult) -> None:
        if pull.num_bytes:
            direction = "prefill_to_decode" if self.role == "decode" else "decode_to_prefill"
            self.metrics.transfer_done(direction=direction, num_bytes=pull.num_bytes, seconds=pull.seconds, regions=pull.num_regions)

    async def events(self, req: Admitted) -> AsyncIterator[dict[str, Any]]:
        """One event per generated token, then the final event (or an error event)."""
        rid = req.body.request_id
        timings: dict[str, float] | None = None
        try:
            await self.queue(req)
            async for out in req.stream:
                if timings is None and (out.new_token_ids or out.finished):
                    timings = self._timings(req, out)
                    self.metrics.first_token(timings)
                    if req.pull.phases:
                        log.debug("request %s: pull and first step, ms: %s", rid, timings)
                if out.new_token_ids:
                    self.metrics.generation_tokens.inc(len(out.new_token_ids))
                    yield {"request_id": rid, "token_ids": out.new_token_ids}
                if out.finished:
                    reason = out.finish_reason or "stop"
                    usage = self._usage(req, out)
                    self.metrics.request_finished(
                        finish_reason=reason,
                        local_cached=usage["local_cached_tokens"],
                        remote_pulled=usage["remote_pulled_tokens"],
                        computed=usage["computed_prompt_tokens"],
                        lost=lost_before_admission(req.pull, out.num_cached_tokens),
                    )
                    yield {
                        "request_id": rid,
                        "token_ids": [],
                        "finish_reason": reason,
                        "usage": usage,
                        "kv_transfer_params": self._params_of(out),
                        "timings": timings,
                    }
        except Exception as exc:  # an engine failure ends this stream, never the worker
            self.metrics.requests.labels(finish_reason="error").inc()
            log.exception("request %s failed", rid)
            yield {"error": {"message": f"engine error: {exc}".splitlines()[0], "type": "engine_error", "code": None}}

    @staticmethod
    def _timings(req: Admitted, out: RequestOutput) -> dict[str, float]:
        """Milliseconds from admission to the first token, by phase: ``pull_*`` the KV pull's
        phases (``PULL_PHASES``), ``queue`` adding the request to the engine, ``wait_step`` until
        the engine step that first ran it, ``first_step`` from that step to this event. A request its
        pull added (``PullResult.admitted``) was added in ``pull_adopt``: its ``queue`` is ~0."""
        now = time.perf_counter()
        ms = {"admit_to_first_token": (now - req.t_admit) * 1e3}
        if req.pull.phases:
            # contact_* ran beside the pull's planning (on another thread): not on its path
            ms["pull"] = sum(v for k, v in req.pull.phases.items() if not k.startswith("contact_")) * 1e3
            ms |= {f"pull_{k}": v * 1e3 for k, v in req.pull.phases.items()}
        step_at = out.first_step_at if out.first_step_at is not None else now
        ms |= {
            "queue": (req.t_queued - req.t_pulled) * 1e3,
            "wait_step": (step_at - req.t_queued) * 1e3,
            "first_step": (now - step_at) * 1e3,
        }
        return {k: round(v, 3) for k, v in ms.items()}

    def _usage(self, req: Admitted, out: RequestOutput) -> dict[str, Any]:
        prompt = len(req.body.input_ids)
        remote = out.num_pulled_tokens
        local = out.num_cached_tokens - remote
        return {
            "prompt_tokens": prompt,
            "completion_tokens": out.num_output_tokens,
            "local_cached_tokens": local,
            "remote_pulled_tokens": remote,
            "computed_prompt_tokens": prompt - out.num_cached_tokens,
            "kv_bytes_pulled": req.pull.num_bytes,
            "kv_regions_pulled": req.pull.num_regions,
            "reuse_fallback": req.pull.fallback,
        }

    def _params_of(self, out: RequestOutput) -> dict[str, Any] | None:
        if out.retained is None or self.transfer is None:
            return None
        return self.transfer.params_for(out.retained).to_dict()

    # ----------------------------------------------------------------- state
    async def snapshot(self) -> tuple[KVStats, dict[str, Any] | None]:
        """The engine's KV snapshot and the transfer's counters, read on the engine thread."""
        engine = self.engine
        if engine is None or self.state == STOPPED:
            raise NotReadyError(f"worker is {self.state}")
        kvt = self.transfer
        return await engine.call(lambda e: (collect(e), kvt.stats() if kvt is not None else None))

    async def kv_stats_body(self) -> dict[str, Any]:
        """``GET /internal/kv/stats`` (docs/worker-api.md): counters are cumulative since start."""
        st, xfer = await self.snapshot()
        owned = sum(p.owned_pages for p in st.precisions.values())
        cached = sum(p.cached_pages for p in st.precisions.values())
        full = st.precisions.get("int4") or next(iter(st.precisions.values()))
        totals = self.metrics.prompt_token_totals
        return {
            "engine_id": self.engine_id,
            "role": self.role,
            "dtype": st.dtype,
            "page_size": st.page_size,
            "capacity_tokens": st.capacity_tokens,
            "used_ratio": round(st.usage_ratio, 6),
            "pages": {"total": full.capacity_pages, "free": max(0, st.free_pages - cached), "cached": cached, "owned": owned},
            "pages_by_bits": {
                "4": full.capacity_pages,
                "2": st.precisions["int2"].capacity_pages if "int2" in st.precisions else 0,
            },
            "precisions": {name: asdict(p) for name, p in st.precisions.items()},
            # leases only: retained conversations and prefill transfers (holds and admission pins are not)
            "leases": xfer["leases"] if xfer is not None else 0,
            "leased_tokens": xfer["leased_tokens"] if xfer is not None else 0,
            "prompt_tokens": {
                "local": totals["local_cache"],
                "remote": totals["remote_pull"],
                "computed": totals["computed"],
                "lost_before_admission": self.metrics.lost_before_admission_total,
            },
            # the reasons pulls fell back for so far (those that never happened left out)
            "fallbacks": {r: n for r, n in sorted(xfer["fallbacks"].items()) if n} if xfer is not None else {},
            "transfer": xfer,
            "running": st.running,
            "waiting": st.waiting,
            "preemptions": st.preemptions,
            "admission_pins_gone": st.admission_pins_gone,
            "admission_pages_trimmed": st.admission_pages_trimmed,
            "admissions_from_scratch": st.admissions_from_scratch,
            "admission_dropped_tokens": st.admission_dropped_tokens,
            "steps": {kind: {"count": st.step_counts[kind], "seconds": round(st.step_seconds[kind], 6)} for kind in st.step_counts},
            # where the time to the first token went, summed over the requests that reached it (FIRST_TOKEN_PHASES)
            "first_token": {
                "requests": self.metrics.first_token_count,
                "seconds": {phase: round(v, 6) for phase, v in self.metrics.first_token_totals.items()},
            },
            "aged_pages": st.aged_pages,  # triaxial age-down: 4-bit pages re-stored at 2 bits
            "age_down_skipped_pages": st.age_down_skipped_pages,  # ... and those kept at 4 for want of INT2 room
            # bits per value over the pages held (None: none held); the budget they are held to
            "stored_bits": {
                "excluded": st.stored_bits,
                "included": st.stored_bits_with_metadata,
                "owned": st.owned_stored_bits,
                "budget": st.bit_budget,
                "cut": st.bits_cut,
            },
            "in_flight": len(self.engine.in_flight) if self.engine is not None else 0,
        }

    async def refresh_metrics(self) -> None:
        """Copy engine state into the gauges (before a scrape); nothing to copy while loading."""
        if self.engine is None or self.state == STOPPED:
            return
        st, xfer = await self.snapshot()
        self.metrics.observe(st)
        if xfer is not None:
            self.metrics.observe_transfer(xfer)

    # ---------------------------------------------------------------- leases
    def _transfer(self) -> KVTransfer:
        if self.transfer is None or self.state in (STARTING, STOPPED):
            raise NotReadyError(f"worker is {self.state}" if self.state != READY else "this worker has no NIXL agent")
        return self.transfer

    async def agent(self) -> dict[str, Any]:
        """``GET /internal/kv/agent``: this worker's NIXL agent and pool layout."""
        return self._transfer().agent_info()

    async def leases(self, *, conversation_key: str | None = None) -> list[dict[str, Any]]:
        """Every lease this worker holds (optionally of one conversation)."""
        kvt = self._transfer()
        return await asyncio.to_thread(kvt.leases, conversation_key)

    async def renew(self, lease_id: str, *, ttl_s: float | None) -> dict[str, Any]:
        """Extend a lease (capped at the retention TTL): its new unix expiry and its pages,
        so a puller can check the page ids it was given belong to this lease."""
        kvt = self._transfer()

        def renew_and_read() -> dict[str, Any]:
            expires_at = kvt.renew(lease_id, ttl_s)
            (lease,) = [le for le in kvt.leases() if le["lease_id"] == lease_id]
            params = lease["kv_transfer_params"]
            return {
                "lease_id": lease_id,
                "expires_at": expires_at,
                "page_ids": params["page_ids"],
                "page_hashes": params["page_hashes"],
                "num_tokens": params["num_tokens"],
            }

        try:
            return await asyncio.to_thread(renew_and_read)
        except KeyError:
            raise LeaseNotFoundError(f"unknown lease {lease_id!r} (expired, released, or never held here)") from None

    async def hold(self, lease_id: str, *, digest: str, hold_s: float, consume: bool) -> dict[str, Any]:
        """Pin a lease's pages for a peer's READ when ``digest`` names exactly its pages
        (``KVTransfer.hold``); LeaseMismatchError otherwise (409)."""
        kvt = self._transfer()
        engine = self.engine
        if engine is None:
            raise NotReadyError(f"worker is {self.state}")
        try:
            # straight onto the engine thread (``hold`` hops there itself; from there it runs
            # inline): one thread hand-off on the puller's path instead of two
            return await engine.call(lambda _: kvt.hold(lease_id, digest=digest, hold_s=hold_s, consume=consume))
        except KeyError:
            raise LeaseNotFoundError(f"unknown lease {lease_id!r} (expired, released, or never held here)") from None

    async def release(self, lease_id: str) -> None:
        """Drop a lease; its pages go back to the prefix cache's LRU."""
        kvt = self._transfer()
        try:
            await asyncio.to_thread(kvt.release, lease_id)
        except KeyError:
            raise LeaseNotFoundError(f"unknown lease {lease_id!r} (expired, released, or never held here)") from None
