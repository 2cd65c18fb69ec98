"""The conversations the gateway serves: one record each, in one store with one
memory budget and one eviction policy.

A ``Conversation`` holds everything the gateway keeps between a
conversation's turns:

    held       the ids the workers hold: the last prompt as sent + the sampled ids
               (exact_history.py)
    render     the last marked render, so the next turn renders only what it
               appends (prompt/turn_render.py)
    prefixes   the last prompt's tokenized prefix, so the next turn tokenizes only
               its new text (prompt/token_prefixes.py); and the shared prefix of its
               first message when this conversation filed it
    sequences  the token sequences identity matches a continuing prompt against
               (identity.py: at most SEQUENCES_PER_CONVERSATION)
    lease      which decode worker holds its KV, and that worker's last
               ``kv_transfer_params`` (leases.py)
    active     its turns in flight

Budget: at most ``max_conversations`` records and ``max_tokens`` kept tokens
in all. A record's charge is the longest of its token forms (held ids, the
prefix's ids, the marked render's characters / 4): each form holds a bounded
number of bytes per token (4-byte ids, starts and ends; the JSON text; the
marked text), so the charge bounds the record's memory. Eviction: least
recently used first; a record with a turn in flight is never evicted. An
evicted record's lease is handed to the lease keeper (``take_evicted_leases``),
which releases it on its worker.

Found three ways, each an index of this store (dropped with the record):
by key (an explicit id, or a minted one), by token sequence (identity's
page-chain filing), and by content (a kept prefix by its text, a kept render
by its messages): the prompt stage looks up the last two before the
conversation is known, and files what it produced once identity names it
(``keep_prompt``).

Scoped: each record belongs to one tenant (``scope``, tenants.py); every
content index is keyed with it, so a tenant finds only its own records.

Pure (no I/O); one event loop owns it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .exact_history import Held
    from .prompt.token_prefixes import PrefixEntry
    from .prompt.turn_render import KeptRender, RenderKey

SEQUENCES_PER_CONVERSATION = 4
# A kept render's bucket (conversations whose requests share a message-count and fingerprint key):
# its most recent BUCKET renders are compared, older ones leave the index.
RENDER_BUCKET = 8

# A filed token sequence: (where it is filed: its tenant and chain value at its last full page, length, tail ids).
SequenceId = tuple[int, int, tuple[int, ...]]


@dataclass(slots=True)
class Lease:
    """One conversation's retained KV on one decode worker."""

    conversation_key: str
    worker_url: str
    params: dict[str, Any]  # the decode's last kv_transfer_params
    last_active: float
    last_renewed: float
    # read from params once (every heartbeat sweep and route reads them; the simulator, per turn):
    # params is a private copy, and only ``LeaseTable.renewed`` changes it, through ``set_expiry``
    lease_id: str = field(init=False)
    expires_at: float = field(init=False)

    def __post_init__(self) -> None:
        self.lease_id = str(self.params.get("lease_id", ""))
        self.expires_at = float(self.params.get("expires_at") or 0.0)

    def set_expiry(self, expires_at: float) -> None:
        self.params["expires_at"] = expires_at
        self.expires_at = float(expires_at or 0.0)


@dataclass(slots=True, eq=False)
class Conversation:
    """One conversation: everything kept between its turns (module docstring)."""

    key: str
    scope: str  # its tenant's id
    active: int = 0  # turns in flight
    lease: Lease | None = None
    held: Held | None = None
    render: KeptRender | None = None
    prefixes: list[PrefixEntry] = field(default_factory=list)
    sequences: list[SequenceId] = field(default_factory=list)
    charge: int = 0  # tokens charged to the store's budget


class Conversations:
    """conversation key -> Conversation, least recently used first, with the indexes that find them."""

    def __init__(self, *, max_conversations: int = 10_000, max_tokens: int = 4_000_000) -> None:
        for name, value in (("max_conversations", max_conversations), ("max_tokens", max_tokens)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.max_conversations = max_conversations
        self.max_tokens = max_tokens
        self._records: OrderedDict[str, Conversation] = OrderedDict()
        self._tokens = 0
        self._evicted_leases: list[Lease] = []
        # identity: filed sequences, by where they are filed, and their owner
        self._sequences: dict[int, dict[SequenceId, None]] = {}
        self._sequence_owner: dict[SequenceId, str] = {}
        # tokenized prefixes by (cut, hash of the scope and the text before the cut); entries per cut position
        self._prefixes: dict[tuple[int, int], PrefixEntry] = {}
        self._prefix_owner: dict[int, Conversation] = {}  # id(entry) -> the record that filed it
        self._cuts: Counter[int] = Counter()
        # kept renders by (scope, message count, fingerprints), most recent first
        self._renders: dict[RenderKey, list[KeptRender]] = {}
        # leases, least recently active first; held leases per worker URL
        self._leased: OrderedDict[str, None] = OrderedDict()
        self.per_worker: Counter[str] = Counter()

    # ----------------------------------------------------------- records
    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[Conversation]:
        return iter(list(self._records.values()))

    @property
    def tokens(self) -> int:
        """Tokens charged in all."""
        return self._tokens

    def get(self, key: str) -> Conversation | None:
        return self._records.get(key)

    def open(self, key: str, *, scope: str) -> Conversation:
        """The record of ``key`` (created when absent), now the most recently used."""
        conv = self._records.get(key)
        if conv is None:
            conv = self._records[key] = Conversation(key, scope)
            self._evict(keep=conv)
        else:
            self._records.move_to_end(key)
        return conv

    def touch(self, key: str) -> None:
        if key in self._records:
            self._records.move_to_end(key)

    def forget(self, key: str) -> None:
        """Drop a record and everything it holds (its lease is handed to the keeper to release)."""
        conv = self._records.pop(key, None)
        if conv is None:
            return
        self._tokens -= conv.charge
        for rid in conv.sequences:
            self._drop_sequence(rid, key)
        for entry in list(conv.prefixes):
            self._drop_prefix(entry)
        if conv.render is not None:
            self._drop_render(conv.render)
        if conv.lease is not None:
            self._evicted_leases.append(conv.lease)
            self.set_lease(conv, None)

    def charge(self, conv: Conversation) -> None:
        """Recount ``conv``'s kept tokens (after a field changed) and evict over the budget."""
        held = len(conv.held.ids) if conv.held is not None else 0
        prefix = max((len(e.ids) for e in conv.prefixes), default=0)
        render = len(conv.render.marked) // 4 if conv.render is not None else 0
        charge = max(held, prefix, render)
        self._tokens += charge - conv.charge
        conv.charge = charge
        self._evict(keep=conv)

    def _evict(self, *, keep: Conversation) -> None:
        """Least recently used first, never ``keep`` nor a record with a turn in flight."""
        while len(self._records) > self.max_conversations or self._tokens > self.max_tokens:
            # the first idle record from the least recently used end (usually the very first)
            victim = next((c for c in self._records.values() if c is not keep and c.active == 0), None)
            if victim is None:
                return
            self.forget(victim.key)

    def take_evicted_leases(self) -> list[Lease]:
        """Leases of records evicted since the last call (the keeper releases them)."""
        out, self._evicted_leases = self._evicted_leases, []
        return out

    # ------------------------------------------------------------- turns
    def begin_turn(self, conv: Conversation, *, now: float) -> None:
        """A turn of this conversation starts: it is active (its lease is never released mid-turn)."""
        conv.active += 1
        self._records.move_to_end(conv.key)
        self._lease_active(conv, now)

    def end_turn(self, conv: Conversation, *, now: float) -> None:
        conv.active = max(0, conv.active - 1)
        self._lease_active(conv, now)

    def _lease_active(self, conv: Conversation, now: float) -> None:
        if conv.lease is not None:
            conv.lease.last_active = now
            self._leased.move_to_end(conv.key)

    # ---------------------------------------------------- identity index
    def sequences_at(self, filed: int) -> dict[SequenceId, None] | None:
        """The sequences filed under ``filed`` (oldest first)."""
        return self._sequences.get(filed)

    def sequence_owner(self, rid: SequenceId) -> str | None:
        return self._sequence_owner.get(rid)

    def has_sequences(self) -> bool:
        return bool(self._sequence_owner)

    def file_sequence(self, conv: Conversation, rid: SequenceId) -> None:
        """File a sequence of ``conv`` (it keeps its SEQUENCES_PER_CONVERSATION latest)."""
        previous = self._sequence_owner.get(rid)
        if previous is not None and previous != conv.key:
            other = self._records.get(previous)
            if other is not None and rid in other.sequences:
                other.sequences.remove(rid)
        self._sequence_owner[rid] = conv.key
        bucket = self._sequences.setdefault(rid[0], {})
        bucket.pop(rid, None)
        bucket[rid] = None  # most recent last
        if rid in conv.sequences:
            conv.sequences.remove(rid)
        conv.sequences.append(rid)
        while len(conv.sequences) > SEQUENCES_PER_CONVERSATION:
            self._drop_sequence(conv.sequences.pop(0), conv.key)

    def _drop_sequence(self, rid: SequenceId, key: str) -> None:
        if self._sequence_owner.get(rid) != key:
            return
        del self._sequence_owner[rid]
        bucket = self._sequences.get(rid[0])
        if bucket is not None:
            bucket.pop(rid, None)
            if not bucket:
                del self._sequences[rid[0]]

    # ----------------------------------------------------- prefix index
    def prefix(self, key: tuple[int, int]) -> PrefixEntry | None:
        return self._prefixes.get(key)

    def has_cut(self, cut: int) -> bool:
        return cut in self._cuts

    def keep_prefixes(self, conv: Conversation, entries: tuple[PrefixEntry, ...]) -> None:
        """File the prefixes a prompt of ``conv`` kept: its own replaces the one it had; a
        shared one (a first message's) is filed once, owned by the first conversation to keep it."""
        if not entries:
            return
        for old in [e for e in conv.prefixes if not e.shared]:
            self._drop_prefix(old)
        for entry in entries:
            kept = self._prefixes.get(entry.key)
            if kept is entry or (entry.shared and kept is not None):
                continue  # filed already, or another text under the same key keeps its place
            if kept is not None:
                self._drop_prefix(kept)  # the later prompt's prefix replaces it (a miss costs a tokenization)
            self._prefixes[entry.key] = entry
            self._prefix_owner[id(entry)] = conv
            self._cuts[entry.cut] += 1
            conv.prefixes.append(entry)
        self.charge(conv)

    def _drop_prefix(self, entry: PrefixEntry) -> None:
        owner = self._prefix_owner.pop(id(entry), None)
        if owner is not None and entry in owner.prefixes:
            owner.prefixes.remove(entry)
        if self._prefixes.get(entry.key) is not entry:
            return
        del self._prefixes[entry.key]
        self._cuts[entry.cut] -= 1
        if not self._cuts[entry.cut]:
            del self._cuts[entry.cut]

    @property
    def prefix_tokens(self) -> int:
        """Tokens the kept prefixes hold (a gauge)."""
        return sum(len(e.ids) for e in self._prefixes.values())

    # ----------------------------------------------------- render index
    def renders(self, key: RenderKey) -> list[KeptRender]:
        """The renders kept under ``key``, most recent first."""
        return self._renders.get(key, [])

    def keep_render(self, conv: Conversation, kept: KeptRender) -> None:
        """``kept`` is ``conv``'s render now (the one it had leaves the index)."""
        if conv.render is not None:
            self._drop_render(conv.render)
        conv.render = kept
        bucket = self._renders.setdefault(kept.key, [])
        bucket.insert(0, kept)
        if len(bucket) > RENDER_BUCKET:
            self._drop_render(bucket[-1])
        self.charge(conv)

    def _drop_render(self, kept: KeptRender) -> None:
        bucket = self._renders.get(kept.key)
        if bucket is None or kept not in bucket:
            return
        bucket.remove(kept)
        if not bucket:
            del self._renders[kept.key]

    # ------------------------------------------------------- exact history
    def hold(self, conv: Conversation, held: Held) -> None:
        conv.held = held
        self.charge(conv)

    # -------------------------------------------------------------- leases
    def set_lease(self, conv: Conversation, lease: Lease | None) -> None:
        """Set (or clear) ``conv``'s lease; it becomes the most recently active one."""
        old = conv.lease
        if old is not None:
            self._leased.pop(conv.key, None)
            self.per_worker[old.worker_url] -= 1
            if self.per_worker[old.worker_url] <= 0:
                del self.per_worker[old.worker_url]
        conv.lease = lease
        if lease is not None:
            self._leased[conv.key] = None
            self.per_worker[lease.worker_url] += 1

    def leased(self) -> list[Conversation]:
        """The records that hold a lease, least recently active first."""
        return [self._records[k] for k in self._leased]

    @property
    def lease_count(self) -> int:
        return len(self._leased)
