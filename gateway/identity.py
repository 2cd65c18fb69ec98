"""Conversation identity: which conversation a request continues.

The first source that applies decides (the `source` of the result, a metric
label):

1. a session header agent clients already send, in this order (names are
   case-insensitive): `X-Session-ID`, `X-Session-Affinity`,
   `X-Correlation-ID`, `X-Dynamo-Session-ID`, `x-claude-code-session-id`;
2. the body's `prompt_cache_key` (OpenAI's cache-routing field);
3. the body's `user`;
4. `prefix`: the request's prompt extends a token sequence this gateway saw
   before (an earlier prompt, or an earlier prompt plus its output) — clients
   resend the whole history each turn;
5. `new`: none of these; a fresh key. It is derived from the prompt's first
   user turn (the system block and the first user message: hashed token ids),
   so that another gateway replica that never saw the earlier turns mints the
   same key for a later turn of the same conversation and finds its lease on
   the decode workers. When that key is already taken here (a second session
   that opened with the identical first message), a random suffix keeps the
   two apart; prompts without user turns get a random key.

The prefix match is exact and conservative. A remembered sequence S of
conversation C matches a prompt P only when

- S is a proper prefix of P (P = S + more: a continuation, never a retry or a
  second session sending the identical first prompt);
- S holds more than the system block (at least one token that is not
  instruction or template text), so two agents sharing one system prompt and
  tool schemas are never merged;
- S covers everything in P before the current user turn except template
  delimiters: each earlier message of P must have been seen in S. A client
  that strips earlier reasoning changes its history, so the earlier prompt
  still prefixes the new one only up to the stripped message: such a client
  is recognised by its header, never merged by a short prefix with a
  different conversation that shares its first turn.

Everything is per tenant (tenants.py): keys come out as
`tenant.scope(key)` (a digest: workers never see a session id or user name,
and two tenants' equal ids are two conversations), and a prompt matches only
sequences its own tenant filed.

The longest matching S wins (the most specific conversation). Sequences are
indexed by a hash chained over their full pages of `page_size` tokens: the
chain of P is computed once and each remembered sequence is filed under the
chain value at its last full page (plus its few tail tokens), so a lookup is
one pass over P's pages plus dictionary hits — no per-token index. The
sequences are the conversation records' (conversations.py: at most
SEQUENCES_PER_CONVERSATION each, filed in the store's sequence index and
dropped with their record); a match makes its record the most recently used.
Pure (no I/O), not thread-safe (one event loop owns it).

Use: `identify(headers=..., body=..., prompt=tagged)` before routing;
`remember(key, prompt.input_ids)` when the request is sent; and when the turn
ends `remember(key, prompt.input_ids + tokenizer.encode_ids(output_text))` —
the output re-encoded from its text, as the next turn's template will render
it (sampled ids need not be the canonical tokenization); the stop token may
be left out, the delimiters after it are allowed to differ.
"""

from __future__ import annotations

import hashlib
import uuid
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Protocol

from kvserving.tags import SEMANTIC

from .conversations import Conversations, SequenceId
from .tenants import Tenant

SESSION_HEADERS = (
    "x-session-id",
    "x-session-affinity",
    "x-correlation-id",
    "x-dynamo-session-id",
    "x-claude-code-session-id",
)
SOURCES = (*SESSION_HEADERS, "prompt_cache_key", "user", "prefix", "new")
MAX_VALUE_CHARS = 256  # longer client ids are hashed into the key
_INST, _USER, _DELIM = SEMANTIC.index("inst"), SEMANTIC.index("user"), SEMANTIC.index("delim")
_ROOT = hash(("kvserving-identity-root",))


@dataclass(frozen=True, slots=True)
class Identity:
    """The conversation key, the source that decided it, and (prefix only)
    how many prompt tokens the matched sequence covers."""

    key: str
    source: str
    matched_tokens: int = 0
    # The prompt's page chain when the prefix match computed it (`remember` at the turn's
    # end reuses it for the prompt's pages instead of hashing them again).
    chain: Sequence[int] | None = field(default=None, compare=False, repr=False)


class PromptLike(Protocol):
    """What identity needs of a tagged prompt (`tagger.TaggedPrompt` fits)."""

    @property
    def input_ids(self) -> list[int]: ...

    @property
    def tags(self) -> list[int]: ...

    @property
    def turn_starts(self) -> tuple[int, ...]: ...

    @property
    def current_turn_start(self) -> int: ...


def explicit_identity(headers: Mapping[str, str], body: Mapping[str, Any], *, tenant: Tenant | None = None) -> Identity | None:
    """Sources 1-3 (session header, prompt_cache_key, user), or None; with ``tenant``,
    the key as that tenant's (``Tenant.scope``)."""
    lowered = {str(k).lower(): v for k, v in headers.items()}
    key, source = None, ""
    for name in SESSION_HEADERS:
        value = _clean(lowered.get(name))
        if value is not None:
            key, source = f"session:{value}", name
            break
    else:
        for field, prefix in (("prompt_cache_key", "cache"), ("user", "user")):
            value = _clean(body.get(field))
            if value is not None:
                key, source = f"{prefix}:{value}", field
                break
    if key is None:
        return None
    return Identity(key=tenant.scope(key) if tenant is not None else key, source=source)


def _clean(value: object) -> str | None:
    if not isinstance(value, str):
        return None
    value = value.strip()
    if not value:
        return None
    if len(value) > MAX_VALUE_CHARS:
        return "sha256-" + hashlib.sha256(value.encode()).hexdigest()
    return value


def first_turn_end(prompt: PromptLike) -> int:
    """End of the first user message's content (0 when the prompt has no user turn)."""
    tags, width = prompt.tags, len(SEMANTIC)
    if not prompt.turn_starts:
        return 0
    k = prompt.turn_starts[0]
    while k < len(tags) and tags[k] % width == _DELIM:
        k += 1
    while k < len(tags) and tags[k] % width == _USER:
        k += 1
    return k


def page_chain(ids: Sequence[int], page_size: int, *, known: Sequence[int] = ()) -> list[int]:
    """chain[k] = hash of ids[: k * page_size] (chain[0] is the root).

    Each full page is hashed as a tuple (`zip` over one iterator cuts the pages) and the
    chain folds the page hashes in order: ~1.3 ms at 45K tokens (a loop building a
    17-tuple per page: ~1.5 ms). `remember` files a prompt and prompt + output from one
    chain. ``known``: the chain of a sequence that ``ids`` starts with (the caller's
    word), whose full pages are not hashed again."""
    k = max(len(known) - 1, 0)
    tail = ids[k * page_size :] if k else ids
    pages = map(hash, zip(*[iter(tail)] * page_size, strict=False))  # full pages only
    if not k:
        return list(accumulate(pages, _fold, initial=_ROOT))
    return [*known[:k], *accumulate(pages, _fold, initial=known[k])]


def _fold(h: int, page: int) -> int:
    return hash((h, page))


def _filed_under(tenant: Tenant, chain_value: int) -> int:
    """Where a tenant's sequence that ends at ``chain_value`` is filed. The page chain is the
    same for every tenant (kept tokenizations carry it); the filing is per tenant."""
    return hash((tenant.id, chain_value)) if tenant.id else chain_value


class Identities:
    """Sources 1-5 against the conversation store's records."""

    def __init__(self, store: Conversations, *, page_size: int = 16, new_suffix: Callable[[], str] | None = None) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.store = store
        self.page_size = page_size
        self._new_suffix = new_suffix or (lambda: uuid.uuid4().hex[:16])

    def identify(self, *, headers: Mapping[str, str], body: Mapping[str, Any], prompt: PromptLike, tenant: Tenant) -> Identity:
        """Sources 1-5 in order (see the module doc), as ``tenant``'s; looks only, remembers nothing."""
        explicit = explicit_identity(headers, body, tenant=tenant)
        if explicit is not None:
            # the prompt's page chain, continued from its kept prefix's: `remember` files the turn with it
            return Identity(key=explicit.key, source=explicit.source, chain=self._chain(prompt))
        match, chain = self._match(prompt, tenant)
        if match is not None:
            return match
        return Identity(key=self.mint(prompt, tenant=tenant), source="new", chain=chain)

    def mint(self, prompt: PromptLike, *, tenant: Tenant) -> str:
        """A key for a new conversation of ``tenant`` (source 5 in the module doc)."""
        end = first_turn_end(prompt)
        if end == 0:
            return tenant.scope(f"conv:{self._new_suffix()}")
        digest = hashlib.blake2b(array("q", prompt.input_ids[:end]).tobytes(), digest_size=12).hexdigest()
        key = tenant.scope(f"conv:{digest}")
        taken = self.store.get(key)
        return key if taken is None or not taken.sequences else f"{key}-{self._new_suffix()}"

    def match(self, prompt: PromptLike, *, tenant: Tenant) -> Identity | None:
        """Source 4: the longest sequence ``tenant`` filed that the prompt continues, or None."""
        return self._match(prompt, tenant)[0]

    def _match(self, prompt: PromptLike, tenant: Tenant) -> tuple[Identity | None, list[int] | None]:
        """``match``, and the prompt's page chain when it was computed."""
        ids = prompt.input_ids
        n = len(ids)
        if not self.store.has_sequences() or n == 0:
            return None, None
        floor = self._coverage_floor(prompt)
        chain = self._chain(prompt)
        for k in range(len(chain) - 1, -1, -1):
            if (k + 1) * self.page_size - 1 <= floor:
                break  # every sequence filed here or lower is too short
            bucket = self.store.sequences_at(_filed_under(tenant, chain[k]))
            if not bucket:
                continue
            best: SequenceId | None = None
            for rid in reversed(bucket):  # most recent first: ties go to it
                _, length, tail = rid
                if floor < length < n and (best is None or length > best[1]) and tuple(ids[length - len(tail) : length]) == tail:
                    best = rid
            if best is not None:
                key = self.store.sequence_owner(best)
                assert key is not None
                self.store.touch(key)
                return Identity(key=key, source="prefix", matched_tokens=best[1], chain=chain), chain
        return None, chain

    def _chain(self, prompt: PromptLike) -> list[int]:
        """The prompt's page chain, continuing the chain kept on the tokenized prefix its ids
        start with (`TaggedPrompt.reused_prefix`), and kept on the prefixes filed for it: a
        turn hashes the pages of its new tokens, not its whole history (~0.9 ms at 30K tokens)."""
        size = self.page_size
        reused = getattr(prompt, "reused_prefix", None)
        kept = getattr(reused, "page_chain", None)
        known = kept[1] if isinstance(kept, tuple) and kept[0] == size else ()
        chain = page_chain(prompt.input_ids, size, known=known)
        for entry in getattr(prompt, "kept_prefixes", ()):
            if getattr(entry, "page_chain", 0) is None:  # a token_prefixes entry with no chain yet
                entry.page_chain = (size, array("q", chain[: len(entry.ids) // size + 1]))
        return chain

    def _coverage_floor(self, prompt: PromptLike) -> int:
        """A matching sequence must be longer than this many tokens: past the
        system block, and past every non-delimiter token before the current
        user turn."""
        tags, width = prompt.tags, len(SEMANTIC)
        first_content = next((i for i, t in enumerate(tags) if t % width not in (_INST, _DELIM)), len(tags))
        last_before_turn = -1
        for i in range(min(prompt.current_turn_start, len(tags)) - 1, -1, -1):
            if tags[i] % width != _DELIM:
                last_before_turn = i
                break
        return max(first_content, last_before_turn)

    def remember(
        self, key: str, ids: Sequence[int], *, tenant: Tenant, prefix: int | None = None, prefix_chain: Sequence[int] | None = None
    ) -> None:
        """File a sequence of ``tenant``'s conversation `key` (a prompt, or prompt + output) on its record, and
        its first ``prefix`` tokens too when given (one chain serves both).
        ``prefix_chain``: the page chain of those first ``prefix`` tokens
        (`Identity.chain`), reused; ignored unless it has their length."""
        if not ids:
            return
        known: Sequence[int] = ()
        if prefix is not None and prefix_chain is not None and len(prefix_chain) == prefix // self.page_size + 1:
            known = prefix_chain
        chain = page_chain(ids, self.page_size, known=known)
        if prefix is not None and 0 < prefix < len(ids):
            self._file(key, ids[:prefix], chain[: prefix // self.page_size + 1], tenant)
        self._file(key, ids, chain, tenant)

    def _file(self, key: str, ids: Sequence[int], chain: list[int], tenant: Tenant) -> None:
        full = (len(chain) - 1) * self.page_size
        rid: SequenceId = (_filed_under(tenant, chain[-1]), len(ids), tuple(ids[full:]))
        self.store.file_sequence(self.store.open(key, scope=tenant.id), rid)
