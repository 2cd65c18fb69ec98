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

Layout: `tag_markers` wraps and reads back the pieces, `tag_spans` turns
labelled characters into token tags, this module runs the two.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvserving.tags import TEMPORAL, encode_tag

from . import tag_markers, tag_spans
from .chat_template import ChatTemplate, Message, normalize_messages, normalize_tools
from .errors import GatewayError
from .token_prefixes import TokenPrefixes
from .tokenizer import TextTokenizer


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
    # directly); exact_history maps tokens to characters with it.
    char_starts: tuple[int, ...] = ()

    @property
    def current_turn_start(self) -> int:
        return self.turn_starts[-1] if self.turn_starts else 0


class ChatTagger:
    """Render, tokenize and tag chat requests for one model."""

    def __init__(self, tokenizer: TextTokenizer, template: ChatTemplate, *, prefixes: TokenPrefixes | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = template
        # Tokenized prefixes of recent prompts (token_prefixes.py): a turn tokenizes only its
        # new text; ids and offsets are those of a full tokenization either way.
        self.prefixes = prefixes
        self._control_ids = frozenset(tokenizer.added_tokens)

    def build(
        self,
        messages: object,
        *,
        tools: object = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> TaggedPrompt:
        """Check (400 `GatewayError` on bad input), render, tokenize and tag a chat request."""
        msgs = normalize_messages(messages)
        tool_list = normalize_tools(tools)
        text = self.template.render(msgs, tools=tool_list, add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs)
        enc = self.prefixes.encode(text) if self.prefixes is not None else self.tokenizer.encode(text)
        codec = tag_markers.pick_codec(text)
        if codec is None:  # the request itself uses every marker alphabet
            return self._coarse(text, enc.ids, enc.offsets)
        marks = tag_markers.Marks()
        temporals = message_temporals(msgs)
        marked_msgs = [tag_markers.mark_message(m, i, temporals[i], codec, marks) for i, m in enumerate(msgs)]
        # Tool schemas join the system message's block (its index, when there is one).
        owner = 0 if msgs[0]["role"] == "system" else -1
        marked_tools = None if tool_list is None else [tag_markers.mark_tool(t, codec, marks, message=owner) for t in tool_list]
        try:
            marked_text = self.template.render(
                marked_msgs, tools=marked_tools, add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs
            )
        except GatewayError:  # the template refused marked content it accepts plain
            return self._coarse(text, enc.ids, enc.offsets)
        plain, chunks = tag_markers.parse_marked(marked_text, codec)
        method = "markers"
        if plain != text:
            chunks, method = tag_markers.align(chunks, plain, text), "aligned"
        pieces = list(marks.pieces)
        runs = tag_spans.image_runs(enc.ids, self.tokenizer.image_token_ids)
        if runs and len(runs) == len(marks.images):
            chunks = tag_spans.insert_images(chunks, runs, marks.images, enc.offsets, pieces, msgs, temporals)
        spans, headers = tag_spans.label(chunks, pieces, text, self._controls(enc.ids, enc.offsets), temporals)
        char_starts = _char_starts(enc.offsets)
        tags = tag_spans.token_tags(spans, char_starts)
        tag_spans.tag_images(tags, runs)
        starts = tag_spans.turn_starts(msgs, headers, char_starts)
        return TaggedPrompt(text=text, input_ids=enc.ids, tags=tags, turn_starts=starts, method=method,
                            char_starts=char_starts)

    def _coarse(self, text: str, ids: list[int], offsets: list[tuple[int, int]]) -> TaggedPrompt:
        """Tags without the template's structure: control tokens are current
        delimiters, image tokens current user image, the rest current user text."""
        delim, image, user = (encode_tag("current", m, s) for m, s in (("text", "delim"), ("image", "user"), ("text", "user")))
        images, controls = self.tokenizer.image_token_ids, self._control_ids
        tags = [image if t in images else delim if t in controls else user for t in ids]
        return TaggedPrompt(text=text, input_ids=ids, tags=tags, method="coarse", char_starts=_char_starts(offsets))

    def _controls(self, ids: list[int], offsets: list[tuple[int, int]]) -> tag_spans.Controls:
        control, images, specials = self._control_ids, self.tokenizer.image_token_ids, self.tokenizer.special_ids
        found = [k for k, t in enumerate(ids) if t in control]
        spans = [offsets[k] for k in found if offsets[k][1] > offsets[k][0]]
        image = frozenset(offsets[k][0] for k in found if ids[k] in images)
        special = frozenset(offsets[k][0] for k in found if ids[k] in specials)
        return tag_spans.Controls(spans=spans, starts=[a for a, _ in spans], image=image, special=special)

    def tag_text(self, text: str) -> TaggedPrompt:
        """A raw completion prompt: no structure, so every token is current user text
        (image placeholder tokens are current user image)."""
        enc = self.tokenizer.encode(text)
        return TaggedPrompt(text=text, input_ids=enc.ids, tags=self.tag_ids(enc.ids), method="text",
                            char_starts=_char_starts(enc.offsets))

    def tag_ids(self, ids: Sequence[int]) -> list[int]:
        """Tags for a prompt given as token ids (`/v1/completions` with ids)."""
        user, image = encode_tag("current", "text", "user"), encode_tag("current", "image", "user")
        return [image if t in self.tokenizer.image_token_ids else user for t in ids]


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


def _char_starts(offsets: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    return tuple(map(_FIRST, offsets))  # C-speed: a generator spent ~40 us on a 600-token prompt
