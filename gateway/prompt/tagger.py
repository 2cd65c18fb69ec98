"""Tag every prompt token with one of the 56 classes of `kvserving.tags`,
from the structure of the model's own chat template.

How (for any template, without parsing its strings): every content string of
the request — message text, reasoning, tool-call names and arguments, tool
results, the system prompt, tool names and descriptions — is wrapped in
invisible private-use markers that carry a piece id, the template is rendered
once with markers and once without, and the marker positions become character
spans of the real text (the marked render minus its markers equals the real
render; when a template edits content so that they differ, the spans are
aligned by searching each marked chunk in the real text). Markers sit inside
a piece's leading/trailing whitespace, so templates that `strip()` content
still render the same text. Character spans become token spans through the
tokenizer's offsets; a token straddling a boundary takes the tag of its first
character.

Semantic role of each character:

- content pieces: system prompt and tool schemas -> inst; user text -> user;
  assistant text -> assistant; reasoning (`reasoning_content`, or
  `<think>...</think>` inside the content) -> reasoning; tool-call names and
  arguments (and `<tool_call>...</tool_call>` inside assistant content) ->
  tool_call; tool results -> obs;
- template text between two pieces of the same block (one system block of
  system prompt + tools, one message body, one tool call) -> that block's
  role (the "# Tools" prose between system prompt and schemas, the JSON glue
  between a tool's name and its arguments); the system block also owns the
  template's prose before its first piece (from the line after its header)
  and after its last piece (up to the special token that closes it): tool-use
  instructions and dates the template injects are instructions;
- other template text -> delim, except its part on the same line as a piece
  (no line break or control token in between: `{"name": "` before a tool
  name, `}` after the arguments), which joins that piece. So `<|im_start|>`,
  role names, `<|im_end|>`, `<think>` markers and the newlines the template
  adds are delim.

Modality: image placeholder tokens (added tokens named like image / vision /
video) -> image; each run of them is matched, in order, to the request's
image parts and takes that message's role and turn.

Temporal: user turns back from the current one. The last user message and
everything after it (the agent's tool calls and results in this turn) is
`current`, the turn before it `turn_m1`, then `turn_m2`, then `older`. In
template text the turn switches at the opener of the next message (a control
token that begins a line and names it, `<|im_start|>user`): `<|im_end|>`
closes the previous turn, the header opens the next, and the generation
prompt is `current`; `TaggedPrompt.turn_starts` are those headers. The
system prompt and tool schemas are always `current`: they govern every turn,
so their tag never ages (their pages keep one precision and one prefix-cache
identity across turns, and a bits table can keep instructions precise
without also keeping old chatter precise).

Fallbacks (`TaggedPrompt.method`): when a template edits content so that the
marked render minus markers differs from the real one, spans are re-anchored
by search ("aligned"); when it refuses marked content, or the request uses
every marker alphabet, control tokens are delim and the rest user
("coarse"). The token ids are always those of the real render.

Content is text: every string of the request (message content, reasoning,
tool names and arguments, tool results, tool schemas, template options)
passes `TextTokenizer.as_text` once normalized, so the special tokens of a
prompt are the template's own markup and none comes from content
(tokenizer.py says how).

Layout: `tag_markers` wraps and reads back the pieces, `tag_spans` turns
labelled characters into token tags, this module runs the two.
"""

from __future__ import annotations

import bisect
import operator
from array import array
from itertools import compress
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvserving.tags import TEMPORAL, encode_tag

from ..errors import GatewayError
from . import tag_markers, tag_spans, turn_render
from .chat_template import ChatTemplate, Message, normalize_messages, normalize_tools
from .tag_markers import Chunk, Piece
from .token_prefixes import PrefixEntry, Prefixed, TokenPrefixes, split_offsets
from .tokenizer import TextTokenizer
from .turn_render import KeptRender, TurnRenders


_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class TaggedPrompt:
    """The prompt as the worker receives it: text, token ids, one tag per token.

    `turn_starts` holds the token index where each user turn begins (the
    template header of its user message), oldest first; the last one starts
    the current turn.
    """

    text: str
    input_ids: list[int]
    tags: list[int]
    turn_starts: tuple[int, ...] = ()
    # How the tags were found (a metric label): "markers" (exact spans),
    # "aligned" (the template edited content; spans re-anchored by search),
    # "coarse" (no structure: control tokens delim, the rest user), "text"
    # (a raw completion prompt).
    method: str = "markers"
    # First character of each token in `text` (empty when unknown, e.g. ids given
    # directly); exact_history maps tokens to characters with it. An `array("i")` from
    # the tagger: exact history keeps it per conversation, and a tuple of ints is a
    # container the cyclic GC traverses (docs/performance-log/gateway.md).
    char_starts: Sequence[int] = ()
    # The tags as runs, (end token, tag), when the tagger had them (empty otherwise):
    # what maps other ids onto these tags without a step per token (exact_history).
    tag_runs: tuple[tuple[int, int], ...] = ()
    # `input_ids` as JSON array elements ("1,2,3") when the tagger had them from the kept
    # prefix (token_prefixes.py); "" otherwise. Whoever changes the ids clears it.
    ids_json: str = field(default="", compare=False)
    # The kept prefix (token_prefixes entry) these ids start with, and the entries to keep for
    # this prompt's own prefixes (Conversations.keep_prefixes files them): identity keeps its
    # page chain of an entry's ids on it.
    reused_prefix: object = field(default=None, compare=False, repr=False)
    kept_prefixes: tuple[PrefixEntry, ...] = field(default=(), compare=False, repr=False)
    # The marked render to keep for the conversation's next turn (Conversations.keep_render;
    # turn_render.py), when the tagger keeps renders and this one was exact.
    kept_render: KeptRender | None = field(default=None, compare=False, repr=False)

    @property
    def current_turn_start(self) -> int:
        return self.turn_starts[-1] if self.turn_starts else 0


class ChatTagger:
    """Render, tokenize and tag chat requests for one model."""

    def __init__(
        self, tokenizer: TextTokenizer, template: ChatTemplate, *, prefixes: TokenPrefixes | None = None, renders: TurnRenders | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        # Tokenized prefixes of recent prompts (token_prefixes.py): a turn tokenizes only its
        # new text; ids and offsets are those of a full tokenization either way.
        self.prefixes = prefixes
        # Kept marked renders (turn_render.py): a turn renders with markers only the messages it appends.
        self.renders = renders
        self._control_ids = frozenset(tokenizer.added_tokens)
        self.builds = 0  # chat prompts tagged
        self.label_hits = 0  # prompts that reused a kept prefix's labels
        self.parse_hits = 0  # prompts whose marked render was parsed from a kept prefix's state on

    def build(
        self,
        messages: object,
        *,
        tools: object = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        scope: str = "",
    ) -> TaggedPrompt:
        """Check (400 `GatewayError` on bad input), render, tokenize and tag a chat request.
        ``scope``: the tenant (tenants.py) whose kept prefixes and renders it may reuse and keeps its own under.

        The token ids are always those of the real render. The marked render that tags them
        comes, with ``renders``, from the render kept for the request's previous turn when
        the request appends messages to it (turn_render.py: only the current turn is rendered
        with markers); it is used when it is the real render with markers (else the whole
        request is rendered with markers, and the mismatch counted). ``TaggedPrompt.kept_render``
        is the render to keep for the next turn.

        With `prefixes`, a turn that extends a kept prompt reuses that prompt's token
        labels up to its last piece before the kept cut (`_Labels`: valid when the
        marked render has the same chunks and pieces up to there), so its work on the
        shared history is array copies and one template render pair, not a pass over
        every token; the result equals a tagging from scratch (tests hold it so)."""
        template_kwargs = self._as_text(template_kwargs)
        options = (add_generation_prompt, template_kwargs)
        renders = self.renders
        raw = messages if isinstance(messages, list) and messages else None
        kept = renders.find(raw, tools, options, scope=scope) if renders is not None and raw is not None else None
        first = tag_markers.first_codec()
        got = self._append(kept, raw, first, add_generation_prompt, template_kwargs) if kept is not None and raw is not None else None
        if got is not None and kept is not None:
            msgs, tool_list = got.msgs, kept.tool_list
        else:
            msgs = self._normalize(messages)
            tool_list = self._as_text(normalize_tools(tools))
        text = self.template.render(msgs, tools=tool_list, add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs)
        self.builds += 1
        codec: tag_markers.MarkerCodec | None = first
        marked: tuple[tag_markers.Marks, str, list[Message], list[dict[str, Any]] | None] | None = None
        if got is not None and renders is not None:
            ok = first.strip(got.marked) == text  # a template that inspects content renders the short list otherwise
            renders.checked(ok)
            if ok:
                marked = got.marks, got.marked, got.marked_msgs, got.marked_tools
        if renders is not None:
            renders.count(appended=marked is not None)
        if marked is None:
            codec = tag_markers.pick_codec(text)
            marked = None if codec is None else self._marked(msgs, tool_list, codec, add_generation_prompt, template_kwargs)
        if codec is None or marked is None:  # the request uses every marker alphabet, or the template refused markers
            tokens = self._tokens(text, scope)
            return self._coarse(text, tokens.ids, tokens.offsets())
        marks, marked_text, marked_msgs, marked_tools = marked
        prompt = self._tag(msgs, text, codec, marks, marked_text, scope)
        if renders is None or raw is None or marks.images or codec is not first or prompt.method != "markers":
            return prompt
        to_keep = KeptRender(
            raw=raw,
            tools=tools,
            options=options,
            norm=msgs,
            tool_list=tool_list,
            marked_msgs=marked_msgs,
            marked_tools=marked_tools,
            pieces=marks.pieces,
            marked=marked_text,
            last_user=_last_user(msgs),
            heads=kept.heads if kept is not None else {},
            scope=scope,
        )
        return _with_render(prompt, to_keep)

    def _append(
        self,
        kept: KeptRender,
        messages: list[Any],
        codec: tag_markers.MarkerCodec,
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None,
    ) -> turn_render.Appended | None:
        """The marked render of ``messages`` from the kept render they extend (None: render them whole)."""

        def render(msgs: list[Message], tools: list[dict[str, Any]] | None, generation: bool) -> str:
            return self.template.render(msgs, tools=tools, add_generation_prompt=generation, template_kwargs=template_kwargs)

        try:
            return turn_render.append(
                kept,
                messages,
                normalize=self._normalize,
                render=render,
                codec=codec,
                mark=lambda m, i, marks: tag_markers.mark_message(m, i, codec, marks),
                add_generation_prompt=add_generation_prompt,
            )
        except GatewayError as exc:
            if exc.param == "messages":  # the template refused the short list: the whole one decides
                return None
            raise  # a bad new message: the same 400 the whole path gives

    def _normalize(self, messages: object, start: int = 0) -> list[Message]:
        """``normalize_messages``, every string in them as text (``TextTokenizer.as_text``)."""
        return [self._as_text(m) for m in normalize_messages(messages, start)]

    def _as_text(self, value: _T) -> _T:
        """``value`` with every string in it (keys too) as content text: the same object when
        no string holds a special token's text or the start of one, the usual case."""
        mark = self.tokenizer.content_text.mark
        kind = type(value)
        if kind is str:
            return mark(value)  # type: ignore[arg-type, return-value]
        if kind is list:
            values: list[Any] = value  # type: ignore[assignment]
            out: list[Any] | None = None
            for i, v in enumerate(values):
                w = self._as_text(v)
                if w is not v:
                    if out is None:
                        out = list(values)
                    out[i] = w
            return value if out is None else out  # type: ignore[return-value]
        if kind is dict:
            items = value.items()  # type: ignore[attr-defined]
            if all(mark(k) is k and self._as_text(v) is v for k, v in items):
                return value
            return {mark(k): self._as_text(v) for k, v in items}  # type: ignore[return-value]
        return value

    def _marked(
        self,
        msgs: list[Message],
        tool_list: list[dict[str, Any]] | None,
        codec: tag_markers.MarkerCodec,
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None,
    ) -> tuple[tag_markers.Marks, str, list[Message], list[dict[str, Any]] | None] | None:
        """The marks, the marked render, the marked messages and tools (None: the template
        refused marked content)."""
        marks = tag_markers.Marks()
        # Tool schemas join the system message's block (its index, when there is one). They
        # are marked first so that every piece keeps its id when later turns add messages.
        owner = 0 if msgs[0]["role"] == "system" else -1
        marked_tools = None if tool_list is None else [tag_markers.mark_tool(t, codec, marks, message=owner) for t in tool_list]
        marked_msgs = [tag_markers.mark_message(m, i, codec, marks) for i, m in enumerate(msgs)]
        try:
            marked = self.template.render(
                marked_msgs, tools=marked_tools, add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs
            )
        except GatewayError:  # the template refused marked content it accepts plain
            return None
        return marks, marked, marked_msgs, marked_tools

    def _tag(
        self, msgs: list[Message], text: str, codec: tag_markers.MarkerCodec, marks: tag_markers.Marks, marked_text: str, scope: str
    ) -> TaggedPrompt:
        """Tokenize ``text`` (the real render) and tag it from the marked render."""
        got = self._tokens(text, scope)
        temporals = message_temporals(msgs)
        pieces = list(marks.pieces)
        # Labels are kept and reused on the exact path only (markers, no image runs): a kept
        # prefix with labels holds no image token, so only the ids after it are searched
        # (a scan of every id was ~0.3 ms of a 30K-token turn).
        kept = _labels_of(got.reused)
        scan_from = len(got.reused.ids) if kept is not None and got.reused is not None else 0
        images = tag_spans.image_runs(got.ids, self.tokenizer.image_token_ids, start=scan_from)
        if images:
            kept = None
        chunked = _chunk(text, marked_text, codec, kept)
        method, chunks = chunked.method, chunked.chunks
        self.parse_hits += chunked.resumed
        if images and len(images) == len(marks.images):
            chunks = tag_spans.insert_images(chunks, images, marks.images, got.offsets(), pieces, msgs)
        merged, rendered = _merge(chunks, pieces, kept if chunked.resumed else None)
        exact = method == "markers" and not images
        prior = _reusable(kept, merged, pieces, rendered, same_chunks=chunked.resumed) if exact else None
        first = prior.tokens if prior is not None else 0
        self.label_hits += prior is not None
        resume = prior.resume(pieces) if prior is not None else tag_spans.Resume()
        spans, headers = tag_spans.label(merged, pieces, text, self._controls(got, first), len(msgs), resume=resume, rendered=rendered)
        runs = [*prior.runs, *tag_spans.token_runs(spans, got.starts, first)] if prior else tag_spans.token_runs(spans, got.starts)
        temporal_of = [TEMPORAL.index(t) for t in temporals]
        tag_runs = tag_spans.final_runs(runs, temporal_of)
        tags = tag_spans.expand_runs(tag_runs)
        if images:
            tag_spans.tag_images(tags, images)
            tag_runs = ()  # the image tokens changed modality inside the runs
        if prior is not None:
            headers.update(prior.headers)  # the prefix's headers came first
        char_starts = got.starts
        starts = tag_spans.turn_starts(msgs, headers, char_starts)
        if exact:
            for entry in got.filed:
                if entry.shared and isinstance(entry.labels, _Labels):
                    continue  # a first message's labels hold for every conversation that starts with it
                entry.labels = _keep(entry.cut, merged, pieces, rendered, runs, headers, got.starts, marked_text, chunked)
        return TaggedPrompt(
            text=text,
            input_ids=got.ids,
            tags=tags,
            turn_starts=starts,
            method=method,
            char_starts=char_starts,
            tag_runs=tag_runs,
            ids_json=got.ids_json,
            reused_prefix=got.reused,
            kept_prefixes=got.filed,
        )

    def reuse_counts(self) -> tuple[dict[str, tuple[int, int]], int]:
        """(hits, misses) of the kept prefixes per part, and the tokens they hold (for metrics)."""
        p, r = self.prefixes, self.renders
        tokens = (p.hits, p.misses) if p is not None else (0, self.builds)
        return (
            {
                "tokens": tokens,
                "labels": (self.label_hits, self.builds - self.label_hits),
                "parse": (self.parse_hits, self.builds - self.parse_hits),
                "render": (r.hits, r.misses) if r is not None else (0, self.builds),
            },
            p.tokens if p is not None else 0,
        )

    def _tokens(self, text: str, scope: str) -> Prefixed:
        if self.prefixes is not None:
            return self.prefixes.encode_prefixed(text, scope=scope)
        enc = self.tokenizer.encode(text)
        starts, ends = split_offsets(enc.offsets, 0)
        return Prefixed(enc.ids, starts, ends, None, ())

    def _coarse(self, text: str, ids: list[int], offsets: list[tuple[int, int]]) -> TaggedPrompt:
        """Tags without the template's structure: control tokens are current
        delimiters, image tokens current user image, the rest current user text."""
        delim, image, user = (encode_tag("current", m, s) for m, s in (("text", "delim"), ("image", "user"), ("text", "user")))
        images, controls = self.tokenizer.image_token_ids, self._control_ids
        tags = [image if t in images else delim if t in controls else user for t in ids]
        return TaggedPrompt(text=text, input_ids=ids, tags=tags, method="coarse", char_starts=_char_starts(offsets))

    def _controls(self, got: Prefixed, first: int) -> tag_spans.Controls:
        """The control tokens from token ``first`` on (labelling starts there)."""
        control, images, specials = self._control_ids, self.tokenizer.image_token_ids, self.tokenizer.special_ids
        ids, starts, ends = got.ids, got.starts, got.ends
        found = list(compress(range(first, len(ids)), map(control.__contains__, ids[first:])))  # C-speed over the new tokens
        spans = [(starts[k], ends[k]) for k in found if ends[k] > starts[k]]
        image = frozenset(starts[k] for k in found if ids[k] in images)
        special = frozenset(starts[k] for k in found if ids[k] in specials)
        return tag_spans.Controls(spans=spans, starts=[a for a, _ in spans], image=image, special=special)

    def tag_text(self, text: str) -> TaggedPrompt:
        """A raw completion prompt: no structure, so every token is current user text
        (image placeholder tokens are current user image). Its client writes the whole
        prompt, markup included: special tokens' text in it is markup (no ``as_text``)."""
        enc = self.tokenizer.encode(text)
        return TaggedPrompt(text=text, input_ids=enc.ids, tags=self.tag_ids(enc.ids), method="text", char_starts=_char_starts(enc.offsets))

    def tag_ids(self, ids: Sequence[int]) -> list[int]:
        """Tags for a prompt given as token ids (`/v1/completions` with ids)."""
        user, image = encode_tag("current", "text", "user"), encode_tag("current", "image", "user")
        return [image if t in self.tokenizer.image_token_ids else user for t in ids]


def _with_render(prompt: TaggedPrompt, render: KeptRender) -> TaggedPrompt:
    """``prompt`` with ``kept_render`` set: the constructor called directly (``dataclasses.replace``
    walks the fields' metadata on every call, ~10x the work)."""
    return TaggedPrompt(
        text=prompt.text,
        input_ids=prompt.input_ids,
        tags=prompt.tags,
        turn_starts=prompt.turn_starts,
        method=prompt.method,
        char_starts=prompt.char_starts,
        tag_runs=prompt.tag_runs,
        ids_json=prompt.ids_json,
        reused_prefix=prompt.reused_prefix,
        kept_prefixes=prompt.kept_prefixes,
        kept_render=render,
    )


def _last_user(messages: Sequence[Message]) -> int:
    return next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "user"), -1)


def message_temporals(messages: Sequence[Message]) -> list[str]:
    """Each message's turn: user turns back from the last user message (system: current)."""
    out = ["current"] * len(messages)
    users_after = 0
    for i in range(len(messages) - 1, -1, -1):
        role = messages[i].get("role")
        if role == "system":
            out[i] = "current"
        else:
            out[i] = TEMPORAL[min(users_after, len(TEMPORAL) - 1)]
        if role == "user":
            users_after += 1
    return out


_FIRST = operator.itemgetter(0)


def _char_starts(offsets: Sequence[tuple[int, int]]) -> array[int]:
    return array("i", map(_FIRST, offsets))  # C-speed: a generator spent ~40 us on a 600-token prompt


# -- labels kept for the next turn ---------------------------------------------


@dataclass(frozen=True, slots=True)
class _Labels:
    """A prompt prefix's token labels, kept with its tokens (a `TokenPrefixes`
    entry) for the next turn of the conversation (or another one that starts
    with the same first message).

    They cover the text up to the end of the last piece before the entry's cut:
    `tag_spans.label` decides a chunk from the chunks up to the next piece and
    from which messages render a piece at all, so a longer prompt whose marked
    render has the same merged chunks and pieces up to there, and the same
    rendered messages among those, labels that text the same way. Labels name
    owner messages, not turns, so they age with the request's temporals.

    The marked render up to that piece's close marker is kept too: a marked render
    that starts with it has those very chunks (parsing reads each marker on its own),
    so only the rest is parsed."""

    chunks: tuple[Chunk, ...]  # merged chunks, the last one a piece
    pieces: tuple[tuple[str, tuple[object, ...], int], ...]  # (semantic, region, message) of the pieces up to them
    rendered: frozenset[int]  # messages up to `last_message` that render a piece (anywhere in the prompt)
    prefix_rendered: frozenset[int]  # messages with a piece among `chunks`
    last_message: int
    runs: tuple[tag_spans.Run, ...]  # the labels of the tokens before `tokens`
    tokens: int  # tokens whose first character is before the last chunk's end
    headers: dict[int, int]  # message headers found before that end
    marked: str | None  # the marked render through the last chunk's closing marker (None: not kept)
    state: tag_markers.ParseState  # the parse state there

    def resume(self, pieces: list[Piece]) -> tag_spans.Resume:
        """Labelling's state after the kept chunks (their last one is a piece)."""
        _, end, pid = self.chunks[-1]
        return tag_spans.Resume(len(self.chunks), pieces[pid], end)


@dataclass(frozen=True, slots=True)
class _Chunked:
    """The marked render's chunks: all of them (``resumed`` False, unmerged), or those
    after a kept prefix's (``resumed``), as the parse gave them."""

    parsed: tag_markers.Parsed
    chunks: list[Chunk]
    method: str
    resumed: bool


def _chunk(text: str, marked: str, codec: tag_markers.MarkerCodec, kept: _Labels | None) -> _Chunked:
    """Parse the marked render: from the kept prefix's parse state when it starts with
    that prefix's marked text, else whole (and aligned to the real render when the
    template edited content)."""
    if kept is not None and kept.marked is not None and marked.startswith(kept.marked):
        parsed = tag_markers.parse_marked_from(marked, codec, kept.state)
        if parsed.plain == text[kept.state.plain :]:
            return _Chunked(parsed, parsed.chunks, "markers", resumed=True)
    parsed = tag_markers.parse_marked_from(marked, codec, tag_markers.ParseState())
    if parsed.plain != text:
        return _Chunked(parsed, tag_markers.align(parsed.chunks, parsed.plain, text), "aligned", resumed=False)
    return _Chunked(parsed, parsed.chunks, "markers", resumed=False)


def _merge(chunks: list[Chunk], pieces: list[Piece], kept: _Labels | None) -> tuple[list[Chunk], AbstractSet[int]]:
    """Merged chunks and the messages that render a piece; with ``kept``, ``chunks`` are
    those after its chunks (a resumed parse) and its chunks come first."""
    if kept is None:
        merged = tag_spans.merge_chunks(chunks)
        return merged, tag_spans.rendered_messages(merged, pieces)
    rest = tag_spans.merge_chunks(chunks)  # the kept chunks end with a piece: nothing merges across
    return [*kept.chunks, *rest], kept.prefix_rendered | tag_spans.rendered_messages(rest, pieces)


def _piece_key(pieces: list[Piece]) -> tuple[tuple[str, tuple[object, ...], int], ...]:
    return tuple(map(_PIECE_FIELDS, pieces))  # one C pass: (semantic, region, message) of each


_PIECE_FIELDS = operator.attrgetter("semantic", "region", "message")
_MESSAGE = operator.attrgetter("message")


def _keep(
    cut: int,
    merged: list[Chunk],
    pieces: list[Piece],
    rendered: AbstractSet[int],
    runs: list[tag_spans.Run],
    headers: dict[int, int],
    starts: array[int],
    marked: str,
    chunked: _Chunked,
) -> _Labels | None:
    """The labels of this prompt up to its last piece that ends by ``cut``."""
    j = len(merged) - 1
    while j >= 0 and (merged[j][2] < 0 or merged[j][1] > cut):
        j -= 1
    if j < 0:
        return None
    chunks = tuple(merged[: j + 1])
    used = [pid for _, _, pid in chunks if pid >= 0]
    messages = frozenset(map(_MESSAGE, map(pieces.__getitem__, used)))
    last_message = max(messages)
    end = chunks[-1][1]
    tokens = bisect.bisect_left(starts, end)
    # The parse state after that piece's raw chunk (parsed this time: found among the raw chunks).
    raw = chunked.parsed.chunks
    k = len(raw) - 1
    while k >= 0 and raw[k] != chunks[-1]:
        k -= 1
    state = chunked.parsed.after[k] if k >= 0 else tag_markers.ParseState()
    return _Labels(
        chunks=chunks,
        pieces=_piece_key(pieces[: max(used) + 1]),
        rendered=frozenset(m for m in rendered if m <= last_message),
        prefix_rendered=messages,
        last_message=last_message,
        runs=tag_spans.runs_before(runs, tokens),
        tokens=tokens,
        headers={m: c for m, c in headers.items() if c < end},
        marked=marked[: state.marked] if k >= 0 else None,
        state=state,
    )


def _labels_of(entry: object) -> _Labels | None:
    labels = getattr(entry, "labels", None)
    return labels if isinstance(labels, _Labels) else None


def _reusable(
    labels: _Labels | None, merged: list[Chunk], pieces: list[Piece], rendered: AbstractSet[int], *, same_chunks: bool
) -> _Labels | None:
    """The kept labels, when they hold for this prompt (`_Labels`); ``same_chunks``: its
    chunks were taken from them (its marked render starts with theirs)."""
    if labels is None:
        return None
    n, k = len(labels.chunks), len(labels.pieces)
    if not same_chunks and (len(merged) < n or tuple(merged[:n]) != labels.chunks):
        return None
    if len(pieces) < k or _piece_key(pieces[:k]) != labels.pieces:
        return None
    if frozenset(m for m in rendered if m <= labels.last_message) != labels.rendered:
        return None
    return labels
