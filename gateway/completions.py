"""One OpenAI request through the gateway's stages, each handing the next a typed value:

    parse     openai_types.py       the request, checked               -> ChatCompletionRequest
    prompt    prompt/, prepare.py   render, tokenize, tag              -> TaggedPrompt
    identify  identity.py           the conversation's record          -> Identified
              conversations.py      (exact_history.py splices the prompt onto the ids its workers hold)
    route     turn.Turns.start      the lease, decode and prefill workers -> Turn
    execute   turn.Turn.tokens      prefill, decode, pulls, retries    -> token batches
    relay     relay.py              detokenize, stop strings, body or SSE frames

``Completions.chat`` / ``.text`` take a parsed request and return the whole response
body (``stream`` false) or an ``EventStream`` of SSE frames (relay.py says when an
error is a status and when an event). When the turn ends, what the next turn starts
with is filed on the conversation's record (``_file``).

A prompt whose request holds more than ``OFF_LOOP_CHARS`` characters is prepared
(rendered, tokenized, tagged) on a worker thread, its reads of the conversation store made
on the event loop (prepare.py); shorter ones, most of them, are prepared on the event loop
(their prompt work is a fraction of a millisecond, the stall a thread would spare costs its
hand-off in CPU).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from kvserving.config import ServingConfig

from . import openai_types as oa
from . import relay
from .conversations import Conversation, Conversations
from .errors import context_length_exceeded, invalid_request, model_not_found
from .exact_history import ExactHistory, Sent
from .identity import Identities, explicit_identity
from .metrics import GatewayMetrics
from .model import ModelInfo as ModelInfo  # the routes' and the entry point's import
from .prepare import OFF_LOOP_CHARS as OFF_LOOP_CHARS  # the tests' import
from .prepare import prepare_chat, prepare_text
from .prompt.tagger import TaggedPrompt
from .prompt.token_prefixes import TokenPrefixes
from .prompt.turn_render import TurnRenders
from .relay import SSE_DONE as SSE_DONE  # the routes' import
from .relay import Ended, EventStream, Item, Relay, first_then_rest
from .tenants import Tenant, Tenants
from .turn import TurnRequest, Turns
from .workers import runs_json


def build_conversations(config: ServingConfig, model: ModelInfo) -> Conversations:
    """The conversation store the gateway config bounds, with the model's tagger finding its
    kept prefixes and renders in it."""
    gw = config.gateway
    store = Conversations(max_conversations=gw.max_conversations, max_tokens=gw.max_kept_tokens)
    model.tagger.prefixes = TokenPrefixes(model.tokenizer, store)
    model.tagger.renders = TurnRenders(store)
    return store


@dataclass(slots=True, frozen=True)
class Identified:
    """The identify stage's hand-off: the conversation's record, and what its turn files on it
    when it ends: the prompt's canonical ids (identity matches the next turn against them), the
    prompt as sent (exact history), and the ids' page chain when identity computed it."""

    conversation: Conversation
    canonical: list[int]
    sent: Sent | None = None
    chain: Sequence[int] | None = None


class Completions:
    """Chat and text completions: the stages in order (module docstring)."""

    def __init__(
        self,
        *,
        model: ModelInfo,
        turns: Turns,
        metrics: GatewayMetrics,
        conversations: Conversations,
        tenants: Tenants,
        page_size: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.model = model
        self.tenants = tenants  # whose reuse each request may share (tenants.py)
        self.turns = turns
        self.metrics = metrics
        self.store = conversations  # one record per conversation (conversations.py), bounded by the gateway config
        # conversation identity (identity.py): explicit ids, prefix match, minted keys
        self.identities = Identities(conversations, page_size=page_size)
        self.history = ExactHistory(model.tokenizer)  # splices a prompt onto the ids the workers hold
        self.relay = Relay(model.tokenizer, stop_token_ids=model.stop_token_ids, metrics=metrics)
        self.clock = clock

    # ----------------------------------------------------------------- chat
    async def chat(self, request: oa.ChatCompletionRequest, *, headers: Mapping[str, str], started: float) -> dict[str, Any] | EventStream:
        """A chat turn (module docstring)."""
        self._check_model(request.model)
        tenant = self.tenants.of(authorization=headers.get("authorization"), cache_salt=request.cache_salt)
        prompt = await prepare_chat(
            self.model.tagger,
            request.messages,
            tools=request.tools,
            template_kwargs=request.chat_template_kwargs,
            scope=tenant.id,
            chars=request.prompt_chars,
        )
        identified = self._identify_chat(request, prompt, tenant, headers=headers)
        assert identified.sent is not None
        sent = identified.sent.prompt
        history = any(isinstance(m, dict) and m.get("role") in ("assistant", "tool") for m in request.messages)
        turn_request = self._turn_request(
            "chatcmpl",
            sent.input_ids,
            sent.tags,
            request,
            request.limit,
            identified.conversation.key,
            tenant,
            has_history=history,
            tag_runs=sent.tag_runs,
            ids_json=identified.sent.ids_json,
        )
        items = self._run(turn_request, request.stop_strings(), started, route="chat", identified=identified)
        rid, name = turn_request.request_id, self.model.name
        if request.stream:
            return await first_then_rest(relay.chat_stream(items, id=rid, model=name, request=request))
        return await relay.chat_whole(items, id=rid, model=name, request=request)

    def _identify_chat(
        self, request: oa.ChatCompletionRequest, prompt: TaggedPrompt, tenant: Tenant, *, headers: Mapping[str, str]
    ) -> Identified:
        """The conversation's record, with what the prompt stage kept filed on it, and the prompt
        to send: the previous turn's held ids + the rest when the text extends them."""
        identity = self.identities.identify(headers=headers, body=_id_fields(request), prompt=prompt, tenant=tenant)
        self.metrics.identities.labels(identity.source).inc()
        key = identity.key
        taken = self.store.get(key)
        if identity.source == "new" and taken is not None and taken.active:
            # the same first turn is in flight in another session (identity files it only after)
            key = f"{key}-{uuid.uuid4().hex[:16]}"
        conv = self.store.open(key, scope=tenant.id)
        self.store.keep_prefixes(conv, prompt.kept_prefixes)
        if prompt.kept_render is not None:
            self.store.keep_render(conv, prompt.kept_render)
        sent = self.history.splice(conv.held, prompt)
        self.metrics.exact_history.labels("spliced" if sent.spliced else "as_rendered").inc()
        return Identified(conv, prompt.input_ids, sent, identity.chain)

    # ----------------------------------------------------------------- text
    async def text(self, request: oa.CompletionRequest, *, headers: Mapping[str, str], started: float) -> dict[str, Any] | EventStream:
        self._check_model(request.model)
        tenant = self.tenants.of(authorization=headers.get("authorization"), cache_salt=request.cache_salt)
        prompt = request.single_prompt()
        if isinstance(prompt, str):
            tagged = await prepare_text(self.model.tagger, prompt)
            input_ids, tags = tagged.input_ids, tagged.tags
        else:
            vocab = self.model.tokenizer.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise invalid_request(f"prompt token ids must be in [0, {vocab}), got {bad[0]}", param="prompt")
            input_ids, tags = list(prompt), self.model.tagger.tag_ids(prompt)
        # A raw prompt has no user turns to mint a stable key from: without an explicit id or a
        # prefix match it is no conversation (nothing retained for it).
        explicit = explicit_identity(headers, _id_fields(request), tenant=tenant)
        identity = explicit or self.identities.match(TaggedPrompt(text="", input_ids=input_ids, tags=tags), tenant=tenant)
        identified = None
        if identity is not None:
            self.metrics.identities.labels(identity.source).inc()
            identified = Identified(self.store.open(identity.key, scope=tenant.id), input_ids)
        turn_request = self._turn_request(
            "cmpl", input_ids, tags, request, request.limit, identity.key if identity is not None else None, tenant
        )
        items = self._run(turn_request, request.stop_strings(), started, route="completions", identified=identified)
        rid, name = turn_request.request_id, self.model.name
        if request.stream:
            return await first_then_rest(relay.text_stream(items, id=rid, model=name, request=request))
        return await relay.text_whole(items, id=rid, model=name)

    # --------------------------------------------------------------- shared
    def _check_model(self, model: str) -> None:
        if model != self.model.name:
            raise model_not_found(model)

    def _turn_request(
        self,
        prefix: str,
        input_ids: list[int],
        tags: list[int],
        request: oa._SamplingFields,
        limit: int | None,
        key: str | None,
        tenant: Tenant,
        *,
        has_history: bool = True,
        tag_runs: tuple[tuple[int, int], ...] = (),
        ids_json: str | None = None,
    ) -> TurnRequest:
        n, context = len(input_ids), self.model.max_model_len
        if limit is None:
            limit = context - n
        if n + max(limit, 1) > context or limit < 1:
            raise context_length_exceeded(prompt_tokens=n, max_tokens=max(limit, 1), context_length=context)
        defaults = self.model.defaults
        sampling = {
            "max_tokens": limit,
            "temperature": request.temperature if request.temperature is not None else defaults.get("temperature", 1.0),
            "top_p": request.top_p if request.top_p is not None else defaults.get("top_p", 1.0),
            "top_k": request.top_k if request.top_k is not None else defaults.get("top_k", 0),
            "seed": request.seed,
            "stop_token_ids": list(self.model.stop_token_ids),
            "ignore_eos": request.ignore_eos,
        }
        # runs that are not those of these tags leave the list to go out as it is
        tags_json = runs_json(tag_runs) if tag_runs and tag_runs[-1][0] == len(tags) else None
        return TurnRequest(
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            input_ids=input_ids,
            tags=tags,
            sampling=sampling,
            conversation_key=key,
            has_history=has_history,
            ids_json=ids_json,
            tags_json=tags_json,
            cache_salt=tenant.cache_salt,
        )

    async def _run(
        self,
        turn_request: TurnRequest,
        stops: list[str],
        started: float,
        *,
        route: str,
        identified: Identified | None = None,
    ) -> AsyncGenerator[Item, None]:
        """Route, execute and relay the turn: the relay's items; the conversation's record is
        active meanwhile and gets what the next turn starts with before the end item."""
        conv = identified.conversation if identified is not None else None
        if conv is not None:
            self.store.begin_turn(conv, now=self.clock())
        # TTFT is observed once the turn says whether its prompt reused KV (label `reuse`);
        # a turn that fails after its first token is observed as reuse="unknown".
        ttft: float | None = None
        reuse = "unknown"
        try:
            turn = await self.turns.start(turn_request)
            async with aclosing(self.relay.items(turn, stops, started)) as items:
                async for item in items:
                    if item[0] == "first":
                        ttft = item[1]
                        continue
                    if item[0] == "end":
                        reuse = "yes" if item[1].result.cached_tokens > 0 else "no"
                        if identified is not None:
                            self._file(identified, item[1], cache_salt=turn_request.cache_salt)
                    yield item
        finally:
            if ttft is not None:
                self.metrics.ttft.labels(route, reuse).observe(ttft)
            if conv is not None:
                self.store.end_turn(conv, now=self.clock())

    def _file(self, identified: Identified, ended: Ended, *, cache_salt: str | None) -> None:
        """What the next turn starts with, on the conversation's record: identity's sequences (the
        prompt, and the prompt + the output re-encoded from its text, as the next turn's template
        renders it: sampled ids need not be the canonical tokenization), and the ids the workers
        hold (the prompt as sent and the ids actually sampled)."""
        output_ids = self.model.tokenizer.encode_ids(ended.text)
        tenant = Tenant(cache_salt or "")  # a tenant is its id, which the salt is
        canonical = identified.canonical
        self.identities.remember(
            identified.conversation.key, canonical + output_ids, tenant=tenant, prefix=len(canonical), prefix_chain=identified.chain
        )
        if identified.sent is not None:
            self.store.hold(identified.conversation, self.history.held_after(identified.sent, ended.ids, ended.text))


def _id_fields(request: oa.ChatCompletionRequest | oa.CompletionRequest) -> dict[str, Any]:
    return {"prompt_cache_key": request.prompt_cache_key, "user": request.user}
