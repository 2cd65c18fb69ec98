"""Tokenized prefixes of recent prompts: a conversation's next turn tokenizes
only the text its previous turn did not have.

A turn's rendered prompt usually extends the previous turn's (the template
re-renders the same history, then the reply and the new messages), and
tokenizing the whole prompt with offsets is the largest single cost of a chat
request (0.55 ms at 600 tokens on the tiny model's tokenizer, linear in the
prompt). Each prompt's ids and character offsets are kept up to a *cut*: the
start of a special added token (`<|im_start|>`) near its end. A later prompt
that starts with the same text through the cut token and `reach` characters
beyond the cut is tokenized as

    kept ids before the cut  +  encode(text[cut:])   (its offsets shifted by cut)

which equals `encode(text)`: `tokenizers` finds the added tokens first
(leftmost-longest, on the raw text for non-normalized ones) and normalizes,
pre-tokenizes and models each stretch between two of them on its own, so no
stretch sees across an added token. Equal text through the cut plus the
longest added token (`reach`) means equal added-token matches up to and
including the one at the cut; the stretch after it starts fresh either way.
Tokens that would break that are never cut at: `lstrip` (its match reaches
left of its content), `single_word` (looks at the character before),
`normalized` (matched after normalization), a content starting with
whitespace; a tokenizer that truncates, pads or uses BPE dropout gets no
cache at all.

Lookup: every cut token's position in the new text is a candidate, the last
first; entries are filed under (cut position, hash of the whole text before
the cut), and a candidate entry is used only if the new text starts with its
whole text. Hashing the whole prefix (~1 us per KB) rather than a short tail:
agents share system prompts and tool boilerplate, so the characters just
before a cut are often the same in every session (`... what failed.<|im_end|>\n`)
and a tail key let 200 interleaved sessions overwrite each other's entries
(docs/performance-log/gateway.md: 10 hits in 300 turns). A later entry filed under the
same key replaces the earlier one (a miss costs a full tokenization, never a
wrong one).

Shared prefixes: each prompt also files, once, the prefix before its first cut
token after the start (in ChatML-style templates the `<|im_end|>` that closes
the first message: the system prompt and tool schemas). A new conversation
that starts with the same first message tokenizes only the rest of its first
prompt; with agents' system prompts of thousands of tokens, most of it. Such
an entry is marked shared: a hit keeps it (and refreshes it), where a
conversation's own entry is replaced by the prompt that extended it.

Scoped: entries are kept and found per ``scope`` (the request's tenant id,
tenants.py), so a tenant's kept prompts, its first message's included, never
make another tenant's tokenization faster (which would time-confirm a guessed
system prompt).

Kept where the conversation is: the entries are found through the
conversation store's prefix index (conversations.py, ``KeptPrefixes`` here),
and a prompt's new entries are filed there once identity names its
conversation (``Conversations.keep_prefixes``): a conversation holds one entry
(its latest turn's), plus the shared first message it filed; the store's one
budget and LRU bound them. This module only reads the index. Pure (no I/O).

Each entry can also carry what its owner derived from the same prefix (the
tagger keeps the prefix's labels there: `Prefixed.reused.labels`), so a turn's
work on the history it shares with the previous turn is a few array copies,
not a pass over every token: `encode_prefixed` returns ids and offsets as
arrays, never a Python tuple per token.
"""

from __future__ import annotations

import bisect
import re
from array import array
from dataclasses import dataclass
from typing import Protocol

import orjson

from .tokenizer import Encoded, TextTokenizer


@dataclass(slots=True, eq=False)
class PrefixEntry:
    key: tuple[int, int]  # where it is filed: (cut, hash of the scope and the text before the cut)
    text: str  # the prompt through its cut + reach
    ids: array[int]  # tokens before the cut
    starts: array[int]
    ends: array[int]
    cut: int  # characters before the cut token: the text these ids cover
    ids_json: str  # the ids as JSON array elements ("1,2,3"), so a prompt's JSON is this plus its new ids'
    shared: bool = False  # the first message's prefix, kept for every conversation that starts with it
    labels: object = None  # what the owner derived from this prefix (opaque here)
    page_chain: object = None  # identity's page chain of these ids (opaque here; identity.py)


@dataclass(frozen=True, slots=True)
class Prefixed:
    """A text's tokens (equal to a full tokenization), with where they came from."""

    ids: list[int]
    starts: array[int]  # first character of each token
    ends: array[int]  # one past its last character
    reused: PrefixEntry | None  # the kept prefix this text extends, if any
    filed: tuple[PrefixEntry, ...]  # the entries kept for this text's prefixes (its own; its shared first message)
    # `ids` as JSON array elements ("1,2,3"): the kept prefix's text plus the new ids', so a
    # 30K-token prompt's worker body does not encode every id again (~1.4 ms; docs/performance-log/gateway.md)
    ids_json: str = ""

    def offsets(self) -> list[tuple[int, int]]:
        return list(zip(self.starts, self.ends, strict=True))


class KeptPrefixes(Protocol):
    """The index the kept prefixes are found in (conversations.Conversations)."""

    def prefix(self, key: tuple[int, int]) -> PrefixEntry | None: ...

    def has_cut(self, cut: int) -> bool: ...

    @property
    def prefix_tokens(self) -> int: ...


class TokenPrefixes:
    """``encode(text)``: ids and offsets equal to ``tokenizer.encode(text)``, from
    a prefix kept in ``kept`` plus the new text when one matches."""

    def __init__(self, tokenizer: TextTokenizer, kept: KeptPrefixes) -> None:
        self.tokenizer = tokenizer
        self.kept = kept
        backend = tokenizer.backend
        added = backend.get_added_tokens_decoder()
        cuts = {
            i: t.content
            for i, t in added.items()
            if t.special and not (t.lstrip or t.single_word or t.normalized) and t.content[:1].strip()
        }
        self.reach = max((len(t.content) for t in added.values()), default=0)
        self._cut_ids = frozenset(cuts)
        contents = sorted(set(cuts.values()), key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(c) for c in contents)) if contents else None
        self.enabled = (
            self._pattern is not None
            and backend.truncation is None
            and backend.padding is None
            and not getattr(backend.model, "dropout", None)
        )
        self.hits = 0
        self.misses = 0

    @property
    def tokens(self) -> int:
        """Tokens kept in all entries."""
        return self.kept.prefix_tokens

    def encode(self, text: str, *, scope: str = "") -> Encoded:
        """``tokenizer.encode(text)``, reusing a kept prefix of ``scope``."""
        if not self.enabled:
            return self.tokenizer.encode(text)
        got = self.encode_prefixed(text, scope=scope)
        return Encoded(ids=got.ids, offsets=got.offsets())

    def encode_prefixed(self, text: str, *, scope: str = "") -> Prefixed:
        """``encode`` as arrays, with the kept prefix it reused and the entries to keep for this
        text (``Prefixed.filed``: filed by the caller, ``Conversations.keep_prefixes``)."""
        if not self.enabled:
            enc = self.tokenizer.encode(text)
            starts, ends = split_offsets(enc.offsets, 0)
            return Prefixed(enc.ids, starts, ends, None, ())
        found = self._lookup(text, scope)
        entry: PrefixEntry | None = None
        if found is None:
            self.misses += 1
            enc = self.tokenizer.encode(text)
            ids = enc.ids
            id_array = array("i", ids)
            starts, ends = split_offsets(enc.offsets, 0)
            ids_json = json_elements(ids)
        else:
            self.hits += 1
            entry = found
            cut = entry.cut
            rest = self.tokenizer.encode(text[cut:])
            # array copies, not a Python int per kept token (the entry filed below slices them)
            id_array = entry.ids + array("i", rest.ids)
            ids = id_array.tolist()
            rest_starts, rest_ends = split_offsets(rest.offsets, cut)
            starts, ends = entry.starts + rest_starts, entry.ends + rest_ends
            ids_json = joined_elements(entry.ids_json, json_elements(rest.ids))
        filed = self._keep(text, id_array, starts, ends, ids_json, scope)
        return Prefixed(ids, starts, ends, entry, filed, ids_json)

    def _lookup(self, text: str, scope: str) -> PrefixEntry | None:
        assert self._pattern is not None
        cuts = [m.start() for m in self._pattern.finditer(text)]
        for cut in reversed(cuts):
            if not self.kept.has_cut(cut):
                continue  # hashing the text before each candidate cut (~15 us per 100K characters) only where an entry could be
            entry = self.kept.prefix((cut, _prefix_hash(scope, text[:cut])))
            if entry is not None and text.startswith(entry.text):
                return entry
        return None

    def _keep(self, text: str, ids: array[int], starts: array[int], ends: array[int], ids_json: str, scope: str) -> tuple[PrefixEntry, ...]:
        """The entries for ``text``'s tokens before its last cut token that ends ``reach`` before the
        text does, and before its first message's closing token (shared)."""
        k = len(ids) - 1
        while k >= 0 and not (ids[k] in self._cut_ids and starts[k] + self.reach <= len(text)):
            k -= 1
        if k <= 0:
            return ()
        # the JSON of the ids before the cut: the prompt's minus its last len(ids) - k elements
        # (a few: the cut is near the end), split off from the right
        filed = [self._file(text, ids, starts, ends, k, shared=False, ids_json=ids_json.rsplit(",", len(ids) - k)[0], scope=scope)]
        # The first message's prefix, for new conversations that share it (module docstring).
        assert self._pattern is not None
        match = self._pattern.search(text, 1)
        if match is not None:
            first = bisect.bisect_left(starts, match.start())
            if 0 < first < k and starts[first] == match.start() and ids[first] in self._cut_ids:
                filed.append(self._file(text, ids, starts, ends, first, shared=True, ids_json=None, scope=scope))
        return tuple(e for e in filed if e is not None)

    def _file(
        self, text: str, ids: array[int], starts: array[int], ends: array[int], k: int, *, shared: bool, ids_json: str | None, scope: str
    ) -> PrefixEntry | None:
        """The entry of the tokens before token ``k`` (a cut token ending ``reach`` before the text
        does); ``ids_json``: their JSON elements (None: encoded here). A shared one already kept
        with the same text is that one."""
        cut = starts[k]
        if text[cut : ends[k]] != self.tokenizer.added_tokens.get(ids[k]):
            return None  # the token's span is not its content (cannot happen for a cut token; stay safe)
        key = (cut, _prefix_hash(scope, text[:cut]))
        if shared:
            kept = self.kept.prefix(key)
            if kept is not None and kept.text == text[: cut + self.reach]:
                return kept  # filed already (by this conversation's first turn or another's)
            if kept is not None:
                return None  # another text under the same key: the first one keeps its place
        kept_ids = ids[:k]
        return PrefixEntry(
            key=key,
            text=text[: cut + self.reach],
            ids=kept_ids,
            starts=starts[:k],
            ends=ends[:k],
            cut=cut,
            ids_json=ids_json if ids_json is not None else json_elements(kept_ids.tolist()),
            shared=shared,
        )


def _prefix_hash(scope: str, prefix: str) -> int:
    """The key of a kept prefix in ``scope`` (the default scope's as it always was)."""
    return hash((scope, prefix)) if scope else hash(prefix)


def split_offsets(offsets: list[tuple[int, int]], shift: int) -> tuple[array[int], array[int]]:
    """Character offsets as arrays of first and one-past-last characters, shifted by ``shift``."""
    if not offsets:
        return array("i"), array("i")
    starts, ends = zip(*offsets, strict=True)
    if shift:
        return array("i", [a + shift for a in starts]), array("i", [b + shift for b in ends])
    return array("i", starts), array("i", ends)


def json_elements(ids: list[int]) -> str:
    """``ids`` as the elements of a JSON array, no brackets ("1,2,3"); orjson: ~18x the standard
    encoder on a list of ints (docs/performance-log/gateway.md)."""
    return orjson.dumps(ids)[1:-1].decode()


def joined_elements(*parts: str) -> str:
    """JSON array elements of consecutive lists, joined (empty parts skipped)."""
    return ",".join(p for p in parts if p)
