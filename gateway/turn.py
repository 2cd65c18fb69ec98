"""One turn of a conversation against the workers: route, prefill, decode, lease.

    both worker:     POST /internal/generate (retain, conversation_key)      -> tokens
    prefill/decode:  prefill  (max_tokens 1, tags, kv_transfer_params = the
                               conversation's lease params, if any)          -> first token
                     decode   (kv_transfer_params = the prefill's params,
                               output_ids = [first token],
                               conversation_key, retain)                     -> the rest
    then:            the lease table records the decode's final params

The prefill's first token reaches the client before the decode request starts,
so time to first token is the prefill's alone. A seeded request that samples
(temperature > 0) is the exception: its decode worker samples the whole reply,
so the seed gives one token stream whatever the topology.

A worker that fails the turn before anything of its stream was relayed
(unreachable, no answer within ``gateway.first_byte_timeout_s``, late headers
or a late keep-alive and an unanswered ``/health`` probe while another worker
could take its part (frozen: workers.py), silent for
``gateway.event_timeout_s``, a broken stream, 503 not ready or draining) leaves
the rotation until ``/ready`` answers again, and that part of the turn is
routed once more: the whole turn, or only the decode once the prefill's first
token was streamed. A lease holder found frozen or gone, by the gateway or by
the prefill's pull from it (``usage.reuse_fallback`` ``remote_unreachable`` /
``transfer_timeout``), moves the decode to another worker before the first
token is relayed; the prompt is recomputed and the turn counted in
``kvserving_gateway_reuse_fallbacks_total{reason="holder_unresponsive"}``.
The gateway's own test is the holder check (workers.py), started when the turn
is routed while another worker could take the holder's part: it runs beside
the prefill, and its verdict of frozen or gone ends a prefill still pulling
from the holder (sent again without the lease: the recompute starts at the
verdict, not at the worker's peer deadline) and is awaited before the decode
would be sent to the holder, which it then never is. A prefill that pulled
from the holder proves it alive, whatever the check says.
Codes of the errors that remain: docs/gateway-errors.md.

``Turns.start`` routes and returns a ``Turn`` or raises ``GatewayError`` (503
with Retry-After when no healthy worker can take it). ``Turn.tokens()`` yields
batches of token-id lists (one list per worker event; a batch is every event
that had arrived when the gateway read the socket) as the decode streams them;
afterwards ``Turn.result`` holds the finish reason and usage. Closing ``tokens()`` early (client gone, stop string
matched) closes the worker connection, which aborts the request upstream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from .errors import GATEWAY_DRAINING, WORKER_UNAVAILABLE, GatewayError, service_unavailable, upstream_error
from .conversations import Lease
from .leases import LeaseKeeper
from .metrics import GatewayMetrics
from .router import WorkerView, choose_decode, choose_prefill, prefix_key
from .workers import RawJson, UpstreamError, WorkerClient, WorkerPool, WorkerState

log = logging.getLogger(__name__)

RETRY_AFTER_S = 2
# Failures of a worker rather than of the request: retried on another worker while nothing of
# that worker's stream has reached the client (and a 503: not ready, or draining).
WORKER_LOST = frozenset({"connect", "first_byte_timeout", "unresponsive", "event_timeout", "stream"})
# A prefill's pull from the lease holder that found it unreachable or frozen (usage.reuse_fallback).
HOLDER_LOST = frozenset({"remote_unreachable", "transfer_timeout"})
HOLDER_UNRESPONSIVE = "holder_unresponsive"  # kvserving_gateway_reuse_fallbacks_total{reason}


@dataclass(slots=True, frozen=True)
class TurnRequest:
    """What the gateway asks the workers for (already tokenized and tagged)."""

    request_id: str
    input_ids: list[int]
    sampling: dict[str, Any]
    tags: list[int] | None = None
    conversation_key: str | None = None
    # False for a conversation's first turn (no assistant message yet): no
    # worker can hold its KV, so a lease-table miss need not ask them.
    has_history: bool = True
    # `input_ids` and `tags` as JSON arrays when the caller has them (exact_history.Sent.ids_json:
    # built from the previous turn's text; workers.runs_json: from the tagger's runs), encoded
    # once for every body of the turn rather than one int at a time per body
    ids_json: str | None = None
    tags_json: str | None = None
    cache_salt: str | None = None  # the tenant's (tenants.py): its pages match only its own requests'

    @property
    def max_tokens(self) -> int:
        return int(self.sampling.get("max_tokens", 1))

    def body_ids(self) -> list[int] | RawJson:
        return RawJson(self.ids_json) if self.ids_json is not None else self.input_ids

    def body_tags(self) -> list[int] | RawJson | None:
        return RawJson(self.tags_json) if self.tags_json is not None else self.tags


@dataclass(slots=True)
class TurnResult:
    """The decode's final event, in the gateway's terms."""

    finish_reason: str  # the worker's: "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens not computed this turn
    local_cached_tokens: int
    remote_pulled_tokens: int
    decode_url: str
    prefill_url: str | None
    reuse_fallback: str | None = None
    computed_prompt_tokens: int = 0
    kv_bytes_moved: int = 0  # NIXL bytes this turn: decode -> prefill pull plus prefill -> decode pull


@dataclass(slots=True)
class Turn:
    """The execute stage: a routed turn runs its prefill, its decode and the pulls between
    them, and retries on another worker (``router``) what a lost worker failed; iterate
    ``tokens()`` once."""

    router: Turns
    request: TurnRequest
    decode: WorkerState
    prefill: WorkerState | None
    lease: Lease | None
    result: TurnResult | None = None
    _prefill_usage: dict[str, Any] = field(default_factory=dict)
    # Set once the prefill answered: its kv_transfer_params and the reply tokens it
    # sampled (already streamed), so a retried decode does not run the prefill again.
    _prefilled: tuple[dict[str, Any] | None, list[int]] | None = None
    _decode_relayed: bool = False  # a token of the decode's own stream was yielded
    _holder_lost: bool = False  # the lease holder was found frozen or gone (counted once)
    _holder_check: asyncio.Task[bool | None] | None = None  # WorkerClient.frozen on the lease holder

    def ended_early(self) -> TurnResult:
        """The result of a turn the gateway stopped (a stop string) before the worker's final
        event: what the prefill computed is known (split turns), a both worker's is not."""
        prompt_tokens = len(self.request.input_ids)
        computed = int(self._prefill_usage.get("computed_prompt_tokens", prompt_tokens))
        streamed = len(self._prefilled[1]) if self._prefilled is not None else 0
        return TurnResult(
            finish_reason="stop",
            prompt_tokens=prompt_tokens,
            completion_tokens=streamed,
            cached_tokens=max(0, prompt_tokens - computed),
            local_cached_tokens=int(self._prefill_usage.get("local_cached_tokens", 0)),
            remote_pulled_tokens=int(self._prefill_usage.get("remote_pulled_tokens", 0)),
            decode_url=self.decode.url,
            prefill_url=self.prefill.url if self.prefill is not None else None,
        )

    async def tokens(self) -> AsyncGenerator[list[list[int]], None]:
        """The reply's tokens, in batches (iterate once). A worker lost before anything of its
        stream was relayed is taken out of the rotation and the turn is routed once more
        (module docstring)."""
        key = self.request.conversation_key
        final: dict[str, Any] = {}
        # The decode worker's load counts from the routing decision (no await since it) to the
        # turn's end, prefill included: counted only while its own request ran, a burst of new
        # conversations all saw every decode worker idle and all went to the first.
        self.decode.inflight += 1
        self._start_holder_check()
        try:
            for attempt in range(2):
                try:
                    async with aclosing(self._attempt(final)) as tokens:
                        async for batch in tokens:
                            yield batch
                    break
                except UpstreamError as exc:
                    error = self._upstream(exc)
                    at_decode = exc.url == self.decode.url
                    relayed = self._decode_relayed if at_decode else self._prefilled is not None
                    if attempt == 1 or relayed or not _worker_lost(exc):
                        raise error from exc
                    if self.lease is not None and exc.url == self.lease.worker_url:
                        self._holder_unresponsive()
                    # once, on another worker: the one that just failed (kept in the rotation when
                    # it is the last of its role) would only make the client wait twice
                    if self._prefilled is not None:  # the prefill's first token is out: the decode only
                        decode = self.router.choose_decode(self.lease, self.request)
                        if decode is None or decode.url == exc.url:
                            raise error from exc
                        self._switch_decode(decode)
                    else:
                        decode, prefill = self.router.route(self.request, self.lease)
                        if exc.url in (decode.url, prefill.url if prefill is not None else None):
                            raise error from exc
                        self.prefill = prefill
                        self._switch_decode(decode)
                    self.router.metrics.route("retry", exc.kind)
        finally:
            if self._holder_check is not None:
                self._holder_check.cancel()
            self.decode.inflight -= 1
            if key is not None:
                await self.router.keeper.record(key, worker_url=self.decode.url, params=final.get("kv_transfer_params"))

    def _switch_decode(self, decode: WorkerState) -> None:
        self.decode.inflight -= 1
        decode.inflight += 1
        self.decode = decode

    def _start_holder_check(self) -> None:
        """The holder check (module docstring): the lease holder's /health against a peer's
        (``WorkerClient.frozen``), from the routing decision on, beside the prefill. Only with a
        peer to turn to: a lone holder is waited for (its turns are bounded by the deadlines)."""
        lease = self.lease
        holder = self.router.pool.get(lease.worker_url) if lease is not None else None
        peer = self.router.pool.peer(holder) if holder is not None else None
        if holder is None or peer is None:
            return
        self._holder_check = asyncio.get_running_loop().create_task(self.router.client.frozen(holder.url, peer=peer.url))

    def _holder_frozen(self) -> bool:
        """Whether the holder check has found the holder frozen or gone (it has ended)."""
        check = self._holder_check
        return check is not None and check.done() and not check.cancelled() and check.exception() is None and check.result() is True

    def _leave_holder(self) -> None:
        """The holder check found the lease holder frozen or gone: counted, out of the rotation, and
        the decode moved to another worker (if there is one) before it was sent."""
        assert self.lease is not None
        log.warning("lease holder %s frozen or gone (the holder check): recomputing elsewhere", self.lease.worker_url)
        self._holder_unresponsive()
        if self.decode.url == self.lease.worker_url:
            decode = self.router.choose_decode(None, self.request)
            if decode is not None and decode.url != self.lease.worker_url:
                self._switch_decode(decode)

    async def _await_holder_check(self) -> None:
        """Before the decode is sent to the lease holder: the holder check's verdict (the wait is
        bounded by ``PROBE_TIMEOUT_S``; a live holder's usually came during the prefill)."""
        check = self._holder_check
        if check is None or self._holder_lost or self.lease is None or self.decode.url != self.lease.worker_url:
            return
        await asyncio.wait((check,))
        if self._holder_frozen():
            self._leave_holder()

    async def _prefill_beside_check(self, pull_params: dict[str, Any] | None) -> dict[str, Any]:
        """The prefill. One that pulls from the lease holder runs beside the holder check: a verdict
        of frozen or gone while it runs ends it (the worker drops the pull) and sends it again
        without the holder's params, so the recompute starts at the verdict, not at the worker's
        peer deadline (``reuse.peer_timeout_s``)."""
        check = self._holder_check
        if pull_params is None or check is None or check.done():
            return await self._prefill(pull_params)
        prefill = asyncio.ensure_future(self._prefill(pull_params))
        try:
            await asyncio.wait((prefill, check), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            prefill.cancel()
            raise
        if prefill.done() or not self._holder_frozen():
            return await prefill
        prefill.cancel()
        await asyncio.wait((prefill,))  # the connection closed: the worker aborts the request and drops its pull
        if not prefill.cancelled():
            prefill.exception()  # (an error that came first is moot: the prefill is sent again)
        self._leave_holder()
        return await self._prefill(None, attempt="-recompute")  # a new id: the first may still be in flight there

    def _holder_unresponsive(self) -> None:
        """The lease holder is frozen or gone: out of the rotation, the turn counted once. A
        holder that is the last healthy decode worker stays in: a pull that timed out on a busy
        worker says little, and without it every turn would be refused (503) until /ready answers
        again; its decode is bounded by the deadlines instead."""
        assert self.lease is not None
        self.router.pool.take_out(self.lease.worker_url, refused=False)
        if not self._holder_lost:
            self._holder_lost = True
            self.router.metrics.reuse_fallback(HOLDER_UNRESPONSIVE)

    def _check_holder(self, prefill_final: dict[str, Any]) -> None:
        """After a prefill that pulled from the lease holder: a pull that found the holder
        unreachable or frozen moves the decode to another worker (if there is one) before
        the prefill's token is relayed; the prefill recomputed what the holder kept."""
        usage = prefill_final.get("usage") or {}
        fallback = usage.get("reuse_fallback")
        lease = self.lease
        if fallback is None and int(usage.get("remote_pulled_tokens") or 0) > 0 and self._holder_check is not None:
            self._holder_check.cancel()  # the holder served the pull: alive, whatever its /health probe says
            self._holder_check = None
        if fallback not in HOLDER_LOST or lease is None:
            return
        log.warning("lease holder %s unresponsive to the prefill's pull (%s): decoding elsewhere", lease.worker_url, fallback)
        if fallback == "remote_unreachable":
            self._holder_unresponsive()
        # A READ past its deadline may be a slow transfer, not a frozen holder: this turn
        # decodes elsewhere, but only the health poll takes the holder out of the rotation
        # (marking it here takes every decode worker out under a burst of slow pulls).
        if self.decode.url == lease.worker_url:
            decode = self.router.choose_decode(None, self.request)
            if decode is not None:
                self._switch_decode(decode)

    @staticmethod
    def _first_token_from_prefill(sampling: dict[str, Any]) -> bool:
        """Whether the prefill's sampled token opens the reply (see the module docstring)."""
        return sampling.get("seed") is None or float(sampling.get("temperature", 1.0)) == 0.0

    async def _attempt(self, final: dict[str, Any]) -> AsyncGenerator[list[list[int]], None]:
        request = self.request
        if self._holder_frozen() and not self._holder_lost:
            self._leave_holder()
        lease = self.lease if not self._holder_lost else None  # a frozen holder's KV is not offered
        pull_params = lease.params if lease is not None and self.router.bidirectional else None
        first: list[int] = []
        if self.prefill is not None:
            if self._prefilled is None:
                prefill_final = await self._prefill_beside_check(pull_params)
                if pull_params is not None and not self._holder_lost:
                    self._check_holder(prefill_final)
                params = prefill_final.get("kv_transfer_params")
                sampled = list(prefill_final.get("output_ids") or [])
                if not self._first_token_from_prefill(request.sampling):
                    sampled = []
                self._prefilled = (params, sampled)
                if sampled:
                    yield [sampled]
                    if prefill_final.get("finish_reason") != "length" or request.max_tokens <= 1:
                        # The reply ended with its first token (an end-of-sequence or stop
                        # token, or max_tokens 1): no decode request. The prefill's pages
                        # are under a short transfer hold, not a conversation lease.
                        final.update(prefill_final, kv_transfer_params=None)
                        self.result = self._result(prefill_final, prefill_only=True)
                        return
            pull_params, first = self._prefilled
            await self._await_holder_check()
        else:
            await self._await_holder_check()
            if self._holder_lost or (self.lease is not None and self.lease.worker_url == self.decode.url):
                pull_params = None  # a both worker finds its own retained KV in its prefix cache
        body: dict[str, Any] = {
            "request_id": request.request_id,
            "input_ids": request.body_ids(),
            "sampling": request.sampling,
            "kv_transfer_params": pull_params,
            "conversation_key": request.conversation_key,
            "retain": request.conversation_key is not None and self.router.bidirectional,
        }
        if request.cache_salt is not None:
            body["cache_salt"] = request.cache_salt
        if first:
            body["output_ids"] = first
        if request.tags is not None:
            body["tags"] = request.body_tags()
        # (the decode worker's load is counted by tokens() for the whole turn)
        probe = self.router.has_other(self.decode, ("decode", "both"))
        async with aclosing(self.router.client.generate(self.decode.url, body, probe=probe)) as batches:
            async for events in batches:
                tokens: list[list[int]] = []
                end = None
                for event in events:
                    if "finish_reason" in event:
                        end = event
                    elif event.get("token_ids"):
                        tokens.append(list(event["token_ids"]))
                if tokens:
                    self._decode_relayed = True
                    yield tokens  # a consumer that stops here (a stop string) never sees the end
                if end is not None:
                    final.update(end)
                    self.result = self._result(end)
        if self.result is None:
            raise UpstreamError("stream", "worker ended the stream without a final event", url=self.decode.url)

    async def _prefill(self, lease_params: dict[str, Any] | None, *, attempt: str = "") -> dict[str, Any]:
        """The prefill's final event, with the token ids it streamed under ``output_ids``."""
        assert self.prefill is not None
        request = self.request
        sampling = dict(request.sampling, max_tokens=1)
        body: dict[str, Any] = {
            "request_id": f"{request.request_id}-prefill{attempt}",
            "input_ids": request.body_ids(),
            "sampling": sampling,
            "kv_transfer_params": lease_params,
            "conversation_key": request.conversation_key,
            "retain": False,
        }
        if request.cache_salt is not None:
            body["cache_salt"] = request.cache_salt
        if request.tags is not None:
            body["tags"] = request.body_tags()
        sampled: list[int] = []
        final: dict[str, Any] = {}
        async with aclosing(self._stream(self.prefill, body)) as batches:
            async for events in batches:
                for event in events:
                    if "finish_reason" in event:
                        self._prefill_usage = dict(event.get("usage") or {})
                        final = dict(event)
                    elif event.get("token_ids"):
                        sampled += event["token_ids"]
        if not final:
            raise UpstreamError("stream", "prefill worker ended the stream without a final event", url=self.prefill.url)
        final["output_ids"] = sampled
        return final

    async def _stream(self, worker: WorkerState, body: dict[str, Any]) -> AsyncGenerator[list[dict[str, Any]], None]:
        worker.inflight += 1
        try:
            probe = self.router.has_other(worker, ("prefill", "both"))
            async with aclosing(self.router.client.generate(worker.url, body, probe=probe)) as batches:
                async for events in batches:
                    yield events
        finally:
            worker.inflight -= 1

    def _upstream(self, exc: UpstreamError) -> GatewayError:
        """Count the failure, take a lost worker out of the rotation (until /ready answers again;
        a silent one only while another can do its part: ``WorkerPool.take_out``), and the
        client's error (codes: docs/gateway-errors.md)."""
        self.router.metrics.upstream_error(exc.kind)
        if _worker_lost(exc):
            self.router.pool.take_out(exc.url, refused=_worker_refused(exc))
        if exc.kind == "draining":
            return service_unavailable(
                "The gateway is shutting down; send the request again.", retry_after_s=RETRY_AFTER_S, code=GATEWAY_DRAINING
            )
        if exc.kind == "status" and exc.status == 503:
            return service_unavailable(f"Worker not ready: {exc.message}", retry_after_s=RETRY_AFTER_S)
        if exc.kind == "status" and exc.status == 400 and exc.code == "context_length_exceeded":
            # the prompt (and max_tokens) need more than the worker's context or KV pool: the client's to shorten
            worker_said = exc.message.removeprefix("worker error (400): ")
            return GatewayError(
                400,
                f"{worker_said}. Please reduce the length of the messages or completion.",
                param="messages",
                code="context_length_exceeded",
            )
        if exc.kind == "timeout":
            return upstream_error(exc.message, status=504, code="upstream_timeout")
        if exc.kind in WORKER_LOST:
            return upstream_error(exc.message, code=WORKER_UNAVAILABLE)
        return upstream_error(exc.message)

    def _result(self, final: dict[str, Any], *, prefill_only: bool = False) -> TurnResult:
        decode_usage = final.get("usage") or {}
        source = self._prefill_usage if self.prefill is not None and not prefill_only else decode_usage
        prompt_tokens = int(decode_usage.get("prompt_tokens", len(self.request.input_ids)))
        computed = int(source.get("computed_prompt_tokens", prompt_tokens))
        local = int(source.get("local_cached_tokens", 0))
        remote = int(source.get("remote_pulled_tokens", 0))
        if local:
            self.router.metrics.reused_tokens.labels("local").inc(local)
        if remote:
            self.router.metrics.reused_tokens.labels("remote").inc(remote)
        return TurnResult(
            finish_reason=str(final.get("finish_reason")),
            prompt_tokens=prompt_tokens,
            completion_tokens=int(decode_usage.get("completion_tokens", 0)),
            cached_tokens=max(0, prompt_tokens - computed),
            local_cached_tokens=local,
            remote_pulled_tokens=remote,
            decode_url=self.decode.url,
            prefill_url=self.prefill.url if self.prefill is not None else None,
            reuse_fallback=source.get("reuse_fallback"),
            computed_prompt_tokens=computed,
            kv_bytes_moved=int(decode_usage.get("kv_bytes_pulled", 0))
            + (int(source.get("kv_bytes_pulled", 0)) if source is not decode_usage else 0),
        )


class Turns:
    """The route stage: finds a turn's lease and picks its decode and prefill workers
    (router.py's policies); owns nothing but references to the pool, client, lease keeper
    and metrics, which the turns it starts use."""

    def __init__(
        self,
        *,
        pool: WorkerPool,
        client: WorkerClient,
        keeper: LeaseKeeper,
        metrics: GatewayMetrics,
        max_inflight_per_worker: int,
        bidirectional: bool = True,
    ) -> None:
        self.pool = pool
        self.client = client
        self.keeper = keeper
        self.metrics = metrics
        self.max_inflight = max_inflight_per_worker
        # reuse.bidirectional off: the decode worker keeps no lease and nothing it holds
        # is offered to the next turn's prefill (the prefill worker's own cache still serves)
        self.bidirectional = bidirectional

    async def start(self, request: TurnRequest) -> Turn:
        """Route the turn (no worker request yet); 503 when no worker can take it."""
        lease = None
        if request.conversation_key is not None:
            ask = [w.url for w in self._decoders() if w.healthy] if request.has_history else []
            lease = await self.keeper.lookup(request.conversation_key, decode_urls=ask)
        decode, prefill = self.route(request, lease)
        return Turn(self, request, decode, prefill, lease)

    def has_other(self, worker: WorkerState, roles: tuple[str, ...]) -> bool:
        """Whether a healthy worker of ``roles`` other than ``worker`` could take its part of a
        turn: only then is a worker whose headers are late probed and, unresponsive, left
        (alone, it is waited for: a briefly frozen worker may come back)."""
        return self.pool.has_other(worker, roles)

    def _decoders(self) -> list[WorkerState]:
        return [w for w in self.pool.workers.values() if w.role in ("decode", "both")]

    def choose_decode(self, lease: Lease | None, request: TurnRequest) -> WorkerState | None:
        """The decode worker among those the request fits (their KV pool and context), or None."""
        held = self.keeper.table.per_worker
        prompt = len(request.input_ids)
        views = [
            WorkerView(w.url, w.healthy, w.inflight, held.get(w.url, 0)) for w in self._decoders() if w.fits(prompt, request.max_tokens)
        ]
        decision = choose_decode(views, lease_url=lease.worker_url if lease else None, max_inflight=self.max_inflight)
        if decision is None:
            fallback = None if any(w.healthy for w in self._decoders()) else self.pool.fallback(("decode", "both"))
            if fallback is None or not fallback.fits(prompt, request.max_tokens):
                return None
            self.metrics.route("decode", "last_answered")  # every decode worker is out: WorkerPool.fallback
            return fallback
        self.metrics.route("decode", decision.reason)
        return self.pool.workers[decision.url]

    def route(self, request: TurnRequest, lease: Lease | None) -> tuple[WorkerState, WorkerState | None]:
        """The decode worker and (split roles) the prefill worker; 503 when none can take it."""
        decode = self.choose_decode(lease, request)
        if decode is None:
            self._refuse_if_too_large(request)
            raise service_unavailable("No healthy decode worker is available; retry shortly.", retry_after_s=RETRY_AFTER_S)
        if decode.role == "both":
            return decode, None
        prefillers = [w.view() for w in self.pool.workers.values() if w.role in ("prefill", "both")]
        choice = choose_prefill(prefillers, key=prefix_key(request.input_ids))
        if choice is None and (fallback := self.pool.fallback(("prefill", "both"))) is not None:
            self.metrics.route("prefill", "last_answered")
            return decode, fallback
        if choice is None:
            raise service_unavailable("No healthy prefill worker is available; retry shortly.", retry_after_s=RETRY_AFTER_S)
        self.metrics.route("prefill", choice.reason)
        return decode, self.pool.workers[choice.url]

    def _refuse_if_too_large(self, request: TurnRequest) -> None:
        """400 ``context_length_exceeded`` (before any byte of a stream) when no healthy decode
        worker's KV pool can hold the request, as their /ready answers say."""
        healthy = [w for w in self._decoders() if w.healthy and w.capacity is not None]
        prompt, max_tokens = len(request.input_ids), request.max_tokens
        if not healthy or any(w.fits(prompt, max_tokens) for w in healthy):
            return
        largest = max(healthy, key=lambda w: w.capacity[1] if w.capacity else 0)
        assert largest.capacity is not None
        max_model_len, kv_tokens = largest.capacity
        total = min(prompt + max_tokens, max_model_len)
        raise GatewayError(
            400,
            f"request needs {total} tokens of KV cache ({prompt} of prompt, {total - prompt} of completion) but "
            f"the largest decode worker's KV pool holds {kv_tokens} tokens. Please reduce the length of the messages "
            "or completion.",
            param="messages",
            code="context_length_exceeded",
        )


def _worker_refused(exc: UpstreamError) -> bool:
    """The worker said it cannot serve (connection refused, not ready, draining), as opposed to
    staying silent past a deadline (busy or frozen: ``WorkerPool.take_out``)."""
    return exc.kind == "connect" or (exc.kind == "status" and exc.status == 503)


def _worker_lost(exc: UpstreamError) -> bool:
    """A failure of the worker (gone, frozen, broken, not ready or draining), not of the request."""
    return exc.kind in WORKER_LOST or (exc.kind == "status" and exc.status == 503)
