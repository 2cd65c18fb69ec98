"""A conversation's last marked render, kept so that its next turn renders only
the turn it appends to, not the whole history again.

Agents resend the whole history every turn, and the marked render (normalize,
mark, render every message) grows with it: ~2.7 of the ~6.8 ms a turn's tagging
took at turns 30-40 of a 30K-token agent session, in-process
(docs/performance-log/gateway.md). When a request's messages start with
the messages of a kept render ``P`` (equal raw messages, the same tools and
template options), the new request ``N = P + new`` is rendered as

    kept marked render of P, up to the header of P's last user message ``u``
      + the marked render of  N[:h] + N[u:]  after the render of  N[:h]  alone

where ``h`` (1 or 2) keeps every message's index parity (templates that check
alternating roles by ``loop.index0``). Restarting at the current user turn keeps
what templates decide per turn (Qwen3 shows the reasoning of assistant messages
after the last user message only) the same in both renders: messages before
``u`` come before the last user message either way, messages from ``u`` on are
rendered in the short list with that same last user message. Only the new
messages are normalized (checked) and marked; the earlier ones are the kept
ones, with the same piece ids.

Checked before the result is used (else: None, and the caller renders the
whole conversation): the short render starts with the head's render; its text
before message ``u``'s first marker equals the kept render's text there; and it
reproduces the kept render from there through P's last content piece (the
messages both renders share). Requests with image parts are never appended
(templates number images across the conversation). The tagger uses the result
only when it equals the real render with markers (tagger.py ``ChatTagger.build``),
so a template that renders the appended messages differently in the short list
costs a whole marked render, never a wrong tag; ``TurnRenders`` stops appending
when such mismatches exceed 8 and a tenth of its checks.

Scoped: a request finds only the renders kept for its own ``scope`` (its
tenant's id, tenants.py).

Kept where the conversation is: a conversation's last render is its record's
``render`` (conversations.py), found here through the store's render index;
the store's one budget and LRU bound them (a kept render charges its marked
characters / 4). Pure (no I/O); one event loop owns it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .chat_template import Message
from .tag_markers import MarkerCodec, Marks, Piece

# How many new messages a turn may append and still find its kept render (an
# assistant reply and a user message; a tool call and its results). Renders that share a key
# (the same first user message and the same message at the same place): the store keeps the
# most recent few of them in its index (conversations.RENDER_BUCKET), so a lookup compares a
# bounded number of message lists, each failing at its first differing message.
MAX_APPENDED = 16
RenderKey = tuple[str, int, tuple[object, ...], tuple[object, ...] | None]


@dataclass(slots=True, eq=False)
class KeptRender:
    """What one request rendered: its raw messages (compared with the next request's),
    their normalized and marked forms, the pieces and the marked render."""

    raw: list[Any]  # the request's messages as parsed from JSON (held, compared by ==)
    tools: object  # the request's raw tools
    options: tuple[bool, Mapping[str, Any] | None]  # add_generation_prompt, template_kwargs
    norm: list[Message]
    marked_msgs: list[Message]
    tool_list: list[dict[str, Any]] | None  # the normalized tools
    marked_tools: list[dict[str, Any]] | None
    pieces: list[Piece]
    marked: str  # the marked render
    last_user: int  # index of the last user message (-1: none)
    heads: dict[int, str] = field(default_factory=dict)  # h -> the marked render of the first h messages, no generation prompt
    scope: str = ""  # the tenant whose request it was: found only by that tenant's requests
    # (scope, message count, fingerprint of the last message, of the second one when it is not the
    # last): its place in the store's index, computed once (the store files and drops it by it)
    key: RenderKey = field(init=False)

    def __post_init__(self) -> None:
        raw = self.raw
        self.key = self.scope, len(raw), _fingerprint(raw[-1]), _fingerprint(raw[1]) if len(raw) > 1 else None


@dataclass(frozen=True, slots=True)
class Appended:
    """The marked render of a request that appends to a kept one."""

    msgs: list[Message]
    marked_msgs: list[Message]
    marked_tools: list[dict[str, Any]] | None
    marks: Marks
    marked: str


def _fingerprint(message: object) -> tuple[object, ...]:
    """A cheap key of a raw message (equality is checked after the lookup)."""
    if not isinstance(message, dict):
        return (type(message).__name__,)
    content = message.get("content")
    return (message.get("role"), content if isinstance(content, str) else type(content).__name__, len(message))


class KeptRenders(Protocol):
    """The index kept renders are found in (conversations.Conversations)."""

    def renders(self, key: RenderKey) -> list[KeptRender]: ...


class TurnRenders:
    """Finds a request's kept render by (message count, fingerprints of the last and the second
    message); the conversations that share such a key share a bucket, and the comparison of
    the messages picks the one a request extends. Counts what it finds, and stops appending
    when appended renders' mismatches with the real render exceed 8 and a tenth of them."""

    def __init__(self, kept: KeptRenders) -> None:
        self.kept = kept
        self.on = True
        self.hits = 0  # requests rendered by appending
        self.misses = 0  # requests rendered whole (no kept render, or a check failed)
        self.checks = 0  # appended renders compared with the real render
        self.mismatches = 0

    def find(
        self, raw: Sequence[Any], tools: object, options: tuple[bool, Mapping[str, Any] | None], *, scope: str = ""
    ) -> KeptRender | None:
        """The render kept for ``scope`` whose messages ``raw`` starts with (and has more of), same tools and options."""
        if not self.on:
            return None
        n = len(raw)
        first = _fingerprint(raw[1]) if n > 2 else None
        for j in range(n - 1, max(0, n - 1 - MAX_APPENDED), -1):
            for kept in self.kept.renders((scope, j, _fingerprint(raw[j - 1]), first if j > 1 else None)):
                if kept.options == options and kept.tools == tools and raw[:j] == kept.raw:
                    return kept
        return None

    def count(self, *, appended: bool) -> None:
        if appended:
            self.hits += 1
        else:
            self.misses += 1

    def checked(self, ok: bool) -> None:
        """An appended render was compared with the real render (``ok``: it is that render with markers)."""
        self.checks += 1
        if not ok:
            self.mismatches += 1
            if self.mismatches > 8 and self.mismatches * 10 > self.checks:
                self.on = False


Render = Callable[[list[Message], list[dict[str, Any]] | None, bool], str]


def append(
    kept: KeptRender,
    raw: Sequence[Any],
    *,
    normalize: Callable[[Sequence[Any], int], list[Message]],
    mark: Callable[[Message, int, Marks], Message],
    render: Render,
    codec: MarkerCodec,
    add_generation_prompt: bool,
) -> Appended | None:
    """The marked render of ``raw`` (which starts with ``kept.raw``) from the kept one
    (module docstring), or None when a check fails. ``normalize(raw, start)`` checks and
    normalizes ``raw[start:]`` (400 on bad input, as for a whole request);
    ``render(messages, tools, add_generation_prompt)`` is the template."""
    n_prev, u = len(kept.raw), kept.last_user
    if u < 2:
        return None  # the short list would be the whole list
    new_norm = normalize(raw, n_prev)
    marks = Marks(pieces=list(kept.pieces))
    new_marked = [mark(m, i, marks) for i, m in enumerate(new_norm, n_prev)]
    if marks.images:
        return None
    msgs = kept.norm + new_norm
    marked_msgs = kept.marked_msgs + new_marked
    h = 1 if (u - 1) % 2 == 0 else 2  # N[:h] + N[u:] shifts message u by u - h: an even number
    head = kept.heads.get(h)
    if head is None:
        head = kept.heads[h] = render(marked_msgs[:h], kept.marked_tools, False)
    short = render(marked_msgs[:h] + marked_msgs[u:], kept.marked_tools, add_generation_prompt)
    if not short.startswith(head):
        return None
    tail = short[len(head) :]
    first = next((k for k, p in enumerate(kept.pieces) if p.message == u), None)
    if first is None:
        return None  # message u renders no content piece: nothing to align on
    opener = codec.open(first)
    k = tail.find(opener)
    at = kept.marked.find(opener)
    start = at - k
    if k < 0 or at < 0 or start < 0 or kept.marked[start:at] != tail[:k]:
        return None
    shared_end = kept.marked.rfind(codec.close) + len(codec.close)
    if shared_end <= start or not tail.startswith(kept.marked[start:shared_end]):
        return None
    return Appended(msgs=msgs, marked_msgs=marked_msgs, marked_tools=kept.marked_tools, marks=marks, marked=kept.marked[:start] + tail)
