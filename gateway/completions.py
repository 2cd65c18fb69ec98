"""One OpenAI request end to end: prompt -> worker turn -> OpenAI response.

``Completions.chat`` / ``.text`` take a parsed request and return either the
whole response body (``stream`` false) or an ``EventStream`` of SSE frames.
A streaming response's first frame is produced only once the first token has
arrived, so every failure before it (no worker, a worker that refuses) is an
HTTP error status; a failure after it is an ``error`` event, then the stream
closes. Stop strings are matched on the detokenized text (text held back while
it could still be the start of a stop string); a match ends the response with
``finish_reason`` "stop" and closes the worker stream (an abort upstream).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from pathlib import Path
from typing import Any

from kvserving.config import ServingConfig

from . import openai_types as oa
from .detokenize import IncrementalDetokenizer
from .conversations import Conversation, Conversations
from .errors import GatewayError, context_length_exceeded, invalid_request, model_not_found, upstream_error
from .exact_history import ExactHistory, Sent
from .identity import Identities, explicit_identity
from .metrics import GatewayMetrics
from .output import OutputParser, StopMatcher
from .prompt.chat_template import ChatTemplate
from .prompt.tagger import ChatTagger, Draft, TaggedPrompt
from .prompt.token_prefixes import TokenPrefixes
from .prompt.tokenizer import TextTokenizer
from .prompt.turn_render import TurnRenders
from .tenants import Tenant, Tenants
from .turn import Turn, TurnRequest, Turns
from .workers import runs_json

@dataclass(slots=True, frozen=True)
class ModelInfo:
    """The served model as the gateway needs it."""

    name: str
    max_model_len: int
    tokenizer: TextTokenizer
    tagger: ChatTagger
    stop_token_ids: tuple[int, ...]
    defaults: Mapping[str, Any]  # generation_config.json sampling defaults
    created: int

    @classmethod
    def load(cls, model_dir: str | Path, *, served_name: str, max_kept_tokens: int | None = None,
             max_model_len: int | None = None) -> ModelInfo:
        """Tokenizer, chat template, context length and EOS ids of a model directory. What is
        kept between turns is bounded by the conversation store (``build_conversations``);
        ``max_kept_tokens`` is accepted for the callers that still pass it."""
        root = Path(model_dir)
        tokenizer = TextTokenizer.from_dir(root)
        config = _read_json(root / "config.json")
        generation = _read_json(root / "generation_config.json")
        context = max_model_len or config.get("max_position_embeddings") or tokenizer.config.get("model_max_length")
        if not isinstance(context, int) or context < 1:
            raise ValueError(f"model.max_model_len: cannot tell the context length of {root}; set it in the config")
        eos = generation.get("eos_token_id", config.get("eos_token_id"))
        stop_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stop_ids:
            stop_ids.append(tokenizer.eos_token_id)
        defaults = {k: generation[k] for k in ("temperature", "top_p", "top_k") if generation.get(k) is not None}
        tagger = ChatTagger(tokenizer, ChatTemplate.from_dir(root))
        return cls(name=served_name, max_model_len=context, tokenizer=tokenizer, tagger=tagger,
                   stop_token_ids=tuple(int(i) for i in stop_ids), defaults=defaults,
                   created=int(root.stat().st_mtime))


def build_conversations(config: ServingConfig, model: ModelInfo) -> Conversations:
    """The conversation store the gateway config bounds, with the model's tagger finding its
    kept prefixes and renders in it."""
    gw = config.gateway
    store = Conversations(max_conversations=gw.max_conversations, max_tokens=gw.max_kept_tokens)
    model.tagger.prefixes = TokenPrefixes(model.tokenizer, store)
    model.tagger.renders = TurnRenders(store)
    return store


@dataclass(slots=True, frozen=True)
class Kept:
    """What a turn of a conversation files on its record when it ends: the prompt's canonical
    ids (identity matches the next turn against them), the prompt as sent (exact history), and
    the ids' page chain when identity computed it."""

    conversation: Conversation
    canonical: list[int]
    sent: Sent | None = None
    chain: Sequence[int] | None = None


class Completions:
    """Chat and text completions over ``Turns``."""

    def __init__(self, *, model: ModelInfo, turns: Turns, metrics: GatewayMetrics, conversations: Conversations,
                 tenants: Tenants, page_size: int, clock: Callable[[], float] = time.time) -> None:
        self.model = model
        self.tenants = tenants  # whose reuse each request may share (tenants.py)
        self.turns = turns
        self.metrics = metrics
        self.store = conversations  # one record per conversation (conversations.py), bounded by the gateway config
        # conversation identity (identity.py): explicit ids, prefix match, minted keys
        self.identities = Identities(conversations, page_size=page_size)
        self.history = ExactHistory(model.tokenizer)  # splices a prompt onto the ids the workers hold
        self.clock = clock
        self.drafting = Drafting()

    # ----------------------------------------------------------------- chat
    async def chat(
        self, request: oa.ChatCompletionRequest, *, headers: Mapping[str, str], started: float
    ) -> dict[str, Any] | EventStream:
        """A chat turn. Its prompt goes out as a draft when it can (`ChatTagger.draft`: the
        marked render without markers, one template render fewer before the worker request);
        the real render confirms it while the worker computes, before the first token is
        relayed. A mismatch (a template that inspects content) aborts that worker request
        and the turn starts again from the real render (`_Unconfirmed`); so does an error
        before the first token that an unconfirmed draft may have caused."""
        self._check_model(request.model)
        tenant = self.tenants.of(authorization=headers.get("authorization"), cache_salt=request.cache_salt)
        tagger, drafts = self.model.tagger, self.metrics.prompt_drafts
        kwargs: dict[str, Any] = {"tools": request.tools, "template_kwargs": request.chat_template_kwargs,
                                  "scope": tenant.id}
        draft = tagger.draft(request.messages, **kwargs) if self.drafting.on else None
        if draft is not None:
            self.drafting.drafts += 1
            try:
                return await self._chat(request, draft.prompt, draft, tenant, headers=headers, started=started)
            except _Unconfirmed:
                pass
            except GatewayError:
                if draft.confirmed():
                    drafts.labels("confirmed").inc()
                    raise
            drafts.labels("mismatch").inc()
            if not draft.appended:  # an appended draft's mismatches are counted by the tagger's TurnRenders
                self.drafting.mismatch()
        else:
            drafts.labels("off" if not self.drafting.on else "none").inc()
        prompt = tagger.build(request.messages, **kwargs)
        return await self._chat(request, prompt, None, tenant, headers=headers, started=started)

    async def _chat(
        self, request: oa.ChatCompletionRequest, prompt: TaggedPrompt, draft: Draft | None, tenant: Tenant, *,
        headers: Mapping[str, str], started: float,
    ) -> dict[str, Any] | EventStream:
        identity = self.identities.identify(headers=headers, body=_id_fields(request), prompt=prompt, tenant=tenant)
        self.metrics.identities.labels(identity.source).inc()
        key = identity.key
        taken = self.store.get(key)
        if identity.source == "new" and taken is not None and taken.active:
            # the same first turn is in flight in another session (identity files it only after)
            key = f"{key}-{uuid.uuid4().hex[:16]}"
        conv = self.store.open(key, scope=tenant.id)
        self.store.keep_prefixes(conv, prompt.kept_prefixes)
        if draft is not None and draft.kept_render is not None:
            self.store.keep_render(conv, draft.kept_render)
        history = any(isinstance(m, dict) and m.get("role") in ("assistant", "tool") for m in request.messages)
        sent = self.history.splice(conv.held, prompt)  # starts with the previous turn's held ids when the text extends them
        self.metrics.exact_history.labels("spliced" if sent.spliced else "as_rendered").inc()
        kept = Kept(conv, prompt.input_ids, sent, identity.chain)
        prompt = sent.prompt
        turn_request = self._turn_request("chatcmpl", prompt.input_ids, prompt.tags, request, request.limit, key, tenant,
                                          has_history=history, tag_runs=prompt.tag_runs, ids_json=sent.ids_json)
        if request.stream:
            return await self._first_then_rest(self._chat_stream(turn_request, request, started, draft, kept))
        return await self._chat_whole(turn_request, request, started, draft, kept)

    async def _chat_whole(
        self, turn_request: TurnRequest, request: oa.ChatCompletionRequest, started: float, draft: Draft | None,
        kept: Kept,
    ) -> dict[str, Any]:
        parser = OutputParser(tools=request.parses_tool_calls, max_calls=request.max_tool_calls)
        pieces, finish, result = [], "stop", None
        async for kind, value in self._generate(turn_request, request.stop_strings(), started, route="chat", draft=draft,
                                                kept=kept):
            if kind == "text":
                pieces += value
            else:
                finish, result = value
        parsed = parser.parse("".join(pieces))
        if parsed.tool_calls and finish == "stop":
            finish = "tool_calls"
        assert result is not None
        message = oa.chat_message(content=parsed.content, reasoning=parsed.reasoning, tool_calls=parsed.tool_calls)
        return oa.chat_completion(id=turn_request.request_id, created=int(time.time()), model=self.model.name,
                                  message=message, finish_reason=finish, usage=self._usage(result))

    async def _chat_stream(
        self, turn_request: TurnRequest, request: oa.ChatCompletionRequest, started: float, draft: Draft | None,
        kept: Kept,
    ) -> AsyncGenerator[bytes, None]:
        """SSE frames; the frames of one batch of tokens go out as one write (the role frame
        with the first text; the last text with the finish and usage frames and ``[DONE]``,
        written once the turn's metrics are recorded)."""
        frames = ChatFrames(id=turn_request.request_id, created=int(time.time()), model=self.model.name,
                            include_usage=request.include_usage)
        parser = OutputParser(tools=request.parses_tool_calls, max_calls=request.max_tool_calls)
        first = True
        tail = b""
        try:
            async for kind, value in self._generate(turn_request, request.stop_strings(), started, route="chat",
                                                    draft=draft, kept=kept):
                out: list[bytes] = []
                if first:
                    first = False
                    out.append(frames.chunk({"role": "assistant", "content": ""}))
                if kind == "text":
                    for text in value:
                        out += [frames.chunk(delta) for delta in parser.feed(text)]
                else:
                    finish, result = value
                    out += [frames.chunk(delta) for delta in parser.finish()]
                    if parser.saw_tool_calls and finish == "stop":
                        finish = "tool_calls"
                    out.append(frames.chunk({}, finish))
                    if request.include_usage:
                        out.append(frames.usage(self._usage(result)))
                    tail = b"".join(out)
                    continue
                if out:
                    yield b"".join(out)
            yield tail + SSE_DONE
        except GatewayError as exc:
            if first:
                raise
            yield _sse(exc.to_body())

    # ----------------------------------------------------------------- text
    async def text(
        self, request: oa.CompletionRequest, *, headers: Mapping[str, str], started: float
    ) -> dict[str, Any] | EventStream:
        self._check_model(request.model)
        tenant = self.tenants.of(authorization=headers.get("authorization"), cache_salt=request.cache_salt)
        prompt = request.single_prompt()
        if isinstance(prompt, str):
            tagged = self.model.tagger.tag_text(prompt)
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
        kept = None
        if identity is not None:
            self.metrics.identities.labels(identity.source).inc()
            kept = Kept(self.store.open(identity.key, scope=tenant.id), input_ids)
        turn_request = self._turn_request("cmpl", input_ids, tags, request, request.limit,
                                          identity.key if identity is not None else None, tenant)
        if request.stream:
            return await self._first_then_rest(self._text_stream(turn_request, request, started, kept))
        pieces, finish, result = [], "stop", None
        async for kind, value in self._generate(turn_request, request.stop_strings(), started, route="completions",
                                                kept=kept):
            if kind == "text":
                pieces += value
            else:
                finish, result = value
        assert result is not None
        return oa.completion(id=turn_request.request_id, created=int(time.time()), model=self.model.name,
                             text="".join(pieces), finish_reason=finish, usage=self._usage(result))

    async def _text_stream(
        self, turn_request: TurnRequest, request: oa.CompletionRequest, started: float, kept: Kept | None
    ) -> AsyncGenerator[bytes, None]:
        rid, created, name, usage_on = turn_request.request_id, int(time.time()), self.model.name, request.include_usage

        def chunk(text: str | None, finish: str | None = None, usage: dict[str, Any] | None = None) -> bytes:
            return _sse(oa.completion_chunk(id=rid, created=created, model=name, text=text, finish_reason=finish,
                                            usage=usage, include_usage=usage_on))

        first = True
        tail = b""
        try:
            async for kind, value in self._generate(turn_request, request.stop_strings(), started, route="completions",
                                                    kept=kept):
                first = False
                if kind == "text":
                    yield b"".join(chunk(text) for text in value)
                    continue
                finish, result = value
                tail = chunk("", finish) + (chunk(None, usage=self._usage(result)) if usage_on else b"")
            yield tail + SSE_DONE
        except GatewayError as exc:
            if first:
                raise
            yield _sse(exc.to_body())

    # --------------------------------------------------------------- shared
    def _check_model(self, model: str) -> None:
        if model != self.model.name:
            raise model_not_found(model)

    def _turn_request(
        self, prefix: str, input_ids: list[int], tags: list[int], request: oa._SamplingFields, limit: int | None,
        key: str | None, tenant: Tenant, *, has_history: bool = True, tag_runs: tuple[tuple[int, int], ...] = (),
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
        return TurnRequest(request_id=f"{prefix}-{uuid.uuid4().hex}", input_ids=input_ids, tags=tags, sampling=sampling,
                           conversation_key=key, has_history=has_history, ids_json=ids_json, tags_json=tags_json,
                           cache_salt=tenant.cache_salt)

    async def _generate(
        self, turn_request: TurnRequest, stops: list[str], started: float, *, route: str, draft: Draft | None = None,
        kept: Kept | None = None,
    ) -> AsyncGenerator[tuple[str, Any], None]:
        """("text", str) pieces, then ("end", (finish_reason, TurnResult))."""
        conv = kept.conversation if kept is not None else None
        if conv is not None:
            self.store.begin_turn(conv, now=self.clock())
        # TTFT is observed once the turn says whether its prompt reused KV (label `reuse`);
        # a turn that fails after its first token is observed as reuse="unknown".
        ttft: float | None = None
        reuse = "unknown"
        try:
            turn = await self.turns.start(turn_request)
            if draft is not None:
                # Confirmed on the loop's next pass: once this task waits for the worker,
                # which has the request by then (or is being connected to).
                asyncio.get_running_loop().call_soon(draft.confirmed)
            detok = IncrementalDetokenizer(self.model.tokenizer, skip_ids=self.model.stop_token_ids)
            matcher = StopMatcher(stops)
            async with aclosing(self._relay_turn(turn, turn_request, detok, matcher, started, draft, kept)) as items:
                async for item in items:
                    if item[0] == "first":
                        ttft = item[1]
                        continue
                    if item[0] == "end":
                        reuse = "yes" if item[1][1].cached_tokens > 0 else "no"
                    yield item
        finally:
            if ttft is not None:
                self.metrics.ttft.labels(route, reuse).observe(ttft)
            if conv is not None:
                self.store.end_turn(conv, now=self.clock())

    async def _relay_turn(
        self, turn: Turn, turn_request: TurnRequest, detok: IncrementalDetokenizer, matcher: StopMatcher, started: float,
        draft: Draft | None, kept: Kept | None,
    ) -> AsyncGenerator[tuple[str, Any], None]:
        """("first", seconds to the first token), ("text", [str, ...]) the pieces of each batch of
        tokens that arrived together, then ("end", (finish, TurnResult)). A draft prompt is
        confirmed before anything is relayed (`_Unconfirmed` closes the worker stream)."""
        last = None
        finish: str | None = None
        itl = self.metrics.itl
        async with aclosing(turn.tokens()) as batches:
            async for batch in batches:
                if draft is not None:
                    self._confirm(draft)
                    draft = None
                now = time.perf_counter()
                if last is None:
                    yield "first", now - started
                else:
                    itl.observe(now - last)
                for _ in range(len(batch) - 1):
                    itl.observe(0.0)  # the events of one batch arrived together
                last = now
                if not matcher.stops:
                    # No stop string can cut the batch: its ids are detokenized in one step
                    # (a batch is what queued while the gateway was busy: the cost per batch,
                    # not per token, is what keeps it from falling further behind).
                    text = detok.add([t for token_ids in batch for t in token_ids])
                    if text:
                        yield "text", [text]
                    continue
                pieces: list[str] = []
                for token_ids in batch:
                    emit, stopped = matcher.feed(detok.add(token_ids))
                    if emit:
                        pieces.append(emit)
                    if stopped:
                        finish = "stop"
                        break
                if pieces:
                    yield "text", pieces
                if finish is not None:
                    break  # leaving the `async with` closes the worker stream: abort upstream
        if draft is not None:  # the turn ended without a token
            self._confirm(draft)
        if finish is None:
            rest = matcher.flush(detok.flush())
            if rest:
                yield "text", [rest]
            result = turn.result
            if result is None or result.finish_reason not in ("stop", "length"):
                raise upstream_error(f"worker ended the request with finish_reason={getattr(result, 'finish_reason', None)!r}")
            finish = result.finish_reason
            completion_tokens = result.completion_tokens
        else:
            completion_tokens = detok.count
        if kept is not None:  # what the next turn will start with
            # The prompt, and the prompt + the output re-encoded from its text, as the next
            # turn's template renders it: sampled ids need not be the canonical tokenization
            # (GWTEMPLATE).
            output_ids = self.model.tokenizer.encode_ids(detok.text)
            tenant = Tenant(turn_request.cache_salt or "")  # a tenant is its id, which the salt is
            canonical = kept.canonical
            self.identities.remember(kept.conversation.key, canonical + output_ids, tenant=tenant,
                                     prefix=len(canonical), prefix_chain=kept.chain)
            if kept.sent is not None:  # what the workers hold: the prompt as sent and the ids actually sampled
                self.store.hold(kept.conversation, self.history.held_after(kept.sent, detok.ids, detok.text))
        result_final = turn.result or turn.ended_early()
        result_final.completion_tokens = completion_tokens
        self.metrics.prompt_tokens.inc(result_final.prompt_tokens)
        self.metrics.completion_tokens.inc(completion_tokens)
        yield "end", (finish, result_final)

    def _confirm(self, draft: Draft) -> None:
        if not draft.confirmed():
            raise _Unconfirmed
        self.metrics.prompt_drafts.labels("confirmed").inc()

    def _usage(self, result: Any) -> dict[str, Any]:
        body = oa.usage(prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
                        cached_tokens=result.cached_tokens)
        # kvserving's own breakdown (clients ignore unknown usage fields; the demo prints it)
        body["kvserving"] = {
            "local_cached_tokens": int(getattr(result, "local_cached_tokens", 0)),
            "remote_pulled_tokens": int(getattr(result, "remote_pulled_tokens", 0)),
            "computed_prompt_tokens": int(getattr(result, "computed_prompt_tokens", 0)),
            "kv_bytes_moved": int(getattr(result, "kv_bytes_moved", 0)),
            "reuse_fallback": getattr(result, "reuse_fallback", None),
        }
        return body

    async def _first_then_rest(self, frames: AsyncGenerator[bytes, None]) -> EventStream:
        """Pull the first frame now (errors before it stay HTTP errors); the rest is pulled as it is sent."""
        return EventStream(first=await anext(frames), rest=frames)


SSE_DONE = b"data: [DONE]\n\n"


class _Unconfirmed(Exception):
    """A draft prompt's real render differs: the turn starts again from the real render."""


class Drafting:
    """Whether chat prompts go out as drafts: on until mismatches pass 8 and a tenth of the
    drafts (a template that inspects content in most requests would pay a second worker
    request for each; a few odd requests cost one each and leave it on)."""

    __slots__ = ("on", "drafts", "mismatches")

    def __init__(self) -> None:
        self.on = True
        self.drafts = 0
        self.mismatches = 0

    def mismatch(self) -> None:
        self.mismatches += 1
        if self.mismatches > 8 and self.mismatches * 10 > self.drafts:
            self.on = False


@dataclass(slots=True)
class EventStream:
    """A streamed response: its first SSE frame, already produced, and the generator of the rest
    (the sender iterates it and closes it, which closes the worker request). A frame that ends
    with ``SSE_DONE`` is the last."""

    first: bytes
    rest: AsyncGenerator[bytes, None]


class ChatFrames:
    """``_sse(oa.chat_chunk(...))`` of one response, byte for byte: the fields every
    chunk repeats are encoded once, each chunk encodes only its delta and finish reason."""

    _DELTA, _FINISH = {"\x00delta": 0}, "\x00finish"

    def __init__(self, *, id: str, created: int, model: str, include_usage: bool) -> None:  # noqa: A002
        self.id, self.created, self.model, self.include_usage = id, created, model, include_usage
        template = _sse(oa.chat_chunk(id=id, created=created, model=model, delta=self._DELTA,
                                      finish_reason=self._FINISH, include_usage=include_usage))
        head, rest = template.split(_json(self._DELTA), 1)
        middle, tail = rest.split(_json(self._FINISH), 1)
        self._head, self._middle, self._tail = head, middle, tail

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        return self._head + _delta_json(delta) + self._middle + (b"null" if finish is None else _json(finish)) + self._tail

    def usage(self, usage: dict[str, Any]) -> bytes:
        """The usage-only chunk (no choices)."""
        return _sse(oa.chat_chunk(id=self.id, created=self.created, model=self.model, delta=None, usage=usage,
                                  include_usage=self.include_usage))


def _id_fields(request: oa.ChatCompletionRequest | oa.CompletionRequest) -> dict[str, Any]:
    return {"prompt_cache_key": request.prompt_cache_key, "user": request.user}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


# json.dumps(obj, separators=(",", ":")), without building an encoder per call (json.dumps
# does for any non-default argument: ~3 of its ~7 us, paid for every streamed chunk)
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


def _json(obj: object) -> bytes:
    return _ENCODE(obj).encode()


def _delta_json(delta: dict[str, Any]) -> bytes:
    """``_json(delta)``; a delta of one string field (the streamed text: content or reasoning) without the
    encoder's call, the same bytes (~0.3 of ~4.6 us a streamed token spent encoding its delta and finish)."""
    if len(delta) == 1:
        ((key, value),) = delta.items()
        if type(key) is str and type(value) is str:
            return b"{" + encode_basestring_ascii(key).encode() + b":" + encode_basestring_ascii(value).encode() + b"}"
    return _json(delta)


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _json(obj) + b"\n\n"
