"""Per-sequence KV page policy above the pool: prefix matching, page precision,
allocation for the next tokens, publishing full pages, freeing.

The pool (``page_pool``) knows page ids, ref counts, hashes and pins; the
storage (``storage``) knows bytes. This layer knows sequences.

Age-down (triaxial): a page is stored at the precision its tokens' tags asked
for when it was computed, and in an agent conversation every token is computed
in the *current* turn (4 bits). When a later request's tags say a matched full
4-bit page should now be 2 bits, ``match_prefix`` re-stores it as a new INT2
page (``requantize``: INT4 -> fp32 -> INT2), switches this sequence to it and
drops its ref on the old page, which goes back to the free list once nobody
else holds it (``TriaxialPagePool.retire``). Pages are never changed in place,
so a lease or another running sequence reading the old page sees the same
bytes. Without INT2 room the page stays 4-bit (no eviction of retained
conversations for it). ``age_cached`` does the same before a KV pull, for
pages the sender offers at 2 bits that this worker holds at 4.

The scheduler ages a request's pages only once its admission is placed
(``match_unaged``, ``allocate_until``, then ``age_matched``): the
copies take room beside originals that an admission pin keeps until the
request runs, so made first they can make the placement fail; and an attempt
that failed would leave them cached, unpinned, beside pinned originals that no
longer match: evicted before the next attempt, the request's match would end
there and its pulled tokens be computed again. Under the bit-budget
controller a request's prompt pages are counted then too (``age_matched``):
a request that waits in the queue is matched again at every attempt, and
counted at each one it would weigh the class mix by its time in the queue.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import replace

from kvserving.kernels.page_ids import page_id_bits
from kvserving.worker.bit_budget import BitBudgetController
from kvserving.worker.kv.leases import AdmissionRecord
from kvserving.worker.kv.page_pool import RECLAIM_LAST, PagePoolBase
from kvserving.worker.precision import page_bits, stored_bits
from kvserving.worker.sequence import Sequence
from kvserving.worker.triaxial_pool import TriaxialPagePool

# Triaxial page hash = token chain hash XOR the mark of the stored precision (``_page_hashes``):
# fixed 63-bit constants (blake2b of "int4" / "int2"), so every worker computes the same keys.
_PRECISION_MARK = {
    b: int.from_bytes(hashlib.blake2b(f"int{b}".encode(), digest_size=8).digest(), "little") & ((1 << 63) - 1) for b in (2, 4)
}


class KVCacheManager:
    """Maps sequences to pages. ``bits_table`` (tag -> 2 or 4) is given exactly when the
    pool stores INT2 pages; without it every page is 4-bit (the format's one precision).
    ``requantize(src_ids, dst_ids)`` (``KVStorage.requantize_to_int2``) turns age-down on."""

    def __init__(
        self,
        pool: PagePoolBase,
        *,
        page_size: int,
        bits_table: Seq[int] | None = None,
        requantize: Callable[[list[int], list[int]], None] | None = None,
    ) -> None:
        if (bits_table is not None) != (2 in pool.precisions):
            raise ValueError(f"bits_table must be given exactly when the pool stores INT2 pages (pool precisions {pool.precisions})")
        if page_size != pool.page_size:
            raise ValueError(f"page_size {page_size} differs from the pool's {pool.page_size}")
        self.pool = pool
        self.page_size = page_size
        if requantize is not None and not isinstance(pool, TriaxialPagePool):
            raise ValueError("requantize (age-down) needs a triaxial pool")
        self.bits_table = tuple(bits_table) if bits_table is not None else None
        self._requantize = requantize
        self.aged_pages = 0  # 4-bit pages re-stored at 2 bits for a request that wanted 2, ever (a counter)
        # matched 4-bit pages a request wanted at 2 bits and kept at 4 for want of INT2 room, ever (a counter)
        self.age_down_skipped_pages = 0
        # Triaxial with bit_budget_control "hold": sets page precision in place of bits_table.
        self.controller: BitBudgetController | None = None

    @property
    def _four_bit_matches(self) -> tuple[int, ...]:
        """Stored precisions a page this request wants at 4 bits may match, in order of preference."""
        return (4, 2) if self.controller is not None else (4,)

    @property
    def triaxial(self) -> bool:
        return self.bits_table is not None

    @property
    def age_down(self) -> bool:
        return self._requantize is not None

    def _page_hashes(self, seq: Sequence, first: int, bits: Seq[int]) -> list[int]:
        """Hashes of pages [first, first + len(bits)) of ``seq`` stored at ``bits`` (from the
        request's token chain, ``_token_chain_upto``).

        A page's identity is its tokens (chained over the whole prefix) and the
        precision it is stored at: ``token chain hash XOR mark(bits)``, the mark
        a fixed 63-bit constant per precision (triaxial only; plain formats use
        the token chain). The precision of *earlier* pages stays out: the
        stored bytes do not depend on it (a prefill attends to fresh K/V), and
        age-down re-stores an old page at 2 bits without changing the hashes
        of the pages after it. Tags only choose the precision, so they stay
        out too: the same reply tokens come back tagged reasoning / tool_call /
        delim in the next turn where the worker that generated them tagged
        them assistant, and the temporal part ages every turn; either would
        make retained pages miss.
        """
        end = first + len(bits)
        chain = self._token_chain_upto(seq, end)[first:end]
        if not self.triaxial:
            return chain
        return [h ^ _PRECISION_MARK[b] for h, b in zip(chain, bits)]

    def _token_chain_upto(self, seq: Sequence, num_pages: int) -> list[int]:
        """``seq.token_chain`` grown to at least ``num_pages`` full pages (a page's tokens never change:
        the chain is hashed once per request, not at every admission attempt of a waiting one)."""
        have = len(seq.token_chain)
        if have < num_pages:
            p = self.page_size
            parent = seq.token_chain[-1] if have else None
            seq.token_chain.extend(
                self.pool.chain_hashes(seq.token_ids(have * p, num_pages * p), p, None, parent=parent, salt=seq.cache_salt)
            )
        return seq.token_chain

    def held_page(self, page_hash: int) -> int | None:
        """The page cached under a triaxial ``page_hash`` or under its twin at the other precision
        (same tokens, same prefix), else None: what a request takes as stored under the controller."""
        pid = self.pool.lookup(page_hash)
        if pid is None and self.triaxial:
            pid = self.pool.lookup(page_hash ^ _PRECISION_MARK[2] ^ _PRECISION_MARK[4])
        return pid

    def page_hashes(self, seq: Sequence, bits: Seq[int]) -> list[int]:
        """Chained hashes of ``seq``'s leading ``len(bits)`` pages stored at ``bits``: the keys
        the prefix cache holds them under (KV transfer matches a sender's pages with these)."""
        return self._page_hashes(seq, 0, bits)

    def _extend_hashes(self, seq: Sequence, num_full_pages: int) -> None:
        """Hashes of the held pages up to ``num_full_pages``, at their stored precision."""
        have = len(seq.page_hashes)
        if num_full_pages <= have:
            return
        bits = [page_id_bits(pid) for pid in seq.page_ids[have:num_full_pages]]
        seq.page_hashes.extend(self._page_hashes(seq, have, bits))

    def match_prefix(self, seq: Sequence) -> int:
        """Reuse cached pages for the longest known prefix; returns tokens reused.

        At least one token is always left to compute: its logits start decoding.
        A triaxial page matches if stored at the precision this request would
        give it, or at 4 bits (more precise is always acceptable; less never).
        Under the bit-budget controller a page is taken at whatever precision it
        was stored: the cut that chose it moves, and the worker that stored it
        may hold another cut (docs/kv-cache.md, Holding the bit budget).
        With age-down a 2-bit copy is preferred, and matched 4-bit pages this
        request wants at 2 bits are re-stored at 2 (``_age_down``), except on a
        follower of the controller (a prefill worker): its pool is a cache of the
        pages its decode workers store, and a copy it makes there takes a page of
        a full pool without changing what the decode worker keeps (a pull takes
        the twin held there, ``held_page``). The scheduler matches with
        ``match_unaged`` and ages with ``age_matched`` once the request's pages
        are placed (module docstring).
        """
        self.age_matched(seq, self.match_unaged(seq))
        return seq.num_computed

    def match_unaged(self, seq: Sequence) -> list[int]:
        """``match_prefix`` without the age-down: returns the precision the request wants for each
        matched page, as the match saw it (``age_matched`` takes it; under the controller the cut
        may move when ``age_matched`` counts the request's pages, and the pages follow the cut the
        match saw)."""
        assert not seq.page_ids and seq.num_computed == 0
        max_pages = (seq.num_tokens - 1) // self.page_size
        wanted = self.page_bits_for(seq, 0, max_pages)
        matched: list[int] = []
        chains = seq.token_chain
        for i, want in enumerate(wanted):
            if i == len(chains):  # hashed as far as the match goes, in growing runs
                chains = self._token_chain_upto(seq, min(max_pages, 2 * i + 8))
            chain = chains[i]
            found = None
            for bits in ((2, 4) if self.age_down else (4, 2)) if want == 2 else self._four_bit_matches:
                h = chain ^ _PRECISION_MARK[bits] if self.triaxial else chain
                pid = self.pool.lookup(h)
                if pid is not None:
                    found = h, pid
                    break
            if found is None:
                break
            seq.page_hashes.append(found[0])
            matched.append(found[1])
        self.pool.incref(matched)
        seq.page_ids = matched
        seq.num_registered_pages = len(matched)
        seq.num_computed = len(matched) * self.page_size
        return wanted[: len(matched)]

    def age_matched(self, seq: Sequence, wanted: Seq[int]) -> int:
        """Count ``seq``'s prompt pages for the controller (``_observe_prompt``, once a request), then
        age down its matched pages that ``wanted`` (``match_unaged``'s) puts at 2 bits (``_age_down``)
        where this worker ages pages; returns how many were aged. The scheduler calls it once the
        request is placed, so the copies take only the room its placement left."""
        if self.controller is not None:
            self._observe_prompt(seq, seq.page_ids[: seq.num_computed // self.page_size])
        if not self.age_down or (self.controller is not None and not self.controller.leader):
            return 0
        return self._age_down(seq, wanted)

    def held_prefix(self, seq: Sequence, *, reclaim_up_to: int) -> int:
        """How many of ``seq``'s leading matched pages stay held whatever its placement does: besides
        its own ref, a running sequence or a pin that ``allocate_until(reclaim_up_to=...)`` does not
        make yield keeps them (its own admission pin among them, below ``RECLAIM_LAST``). Giving
        them up makes no room; it only computes their tokens again."""
        pool = self.pool
        n = 0
        for pid in seq.page_ids[: seq.num_computed // self.page_size]:
            if pool.firm_refs(pid, reclaim_up_to) < 2:  # its own ref only
                break
            n += 1
        return n

    def keep_matched(self, seq: Sequence, num_pages: int) -> None:
        """Give back ``seq``'s matched pages past its first ``num_pages`` (it holds no other page yet):
        they go back to the prefix cache, tail first, and their tokens are computed."""
        p = self.page_size
        assert len(seq.page_ids) * p == seq.num_computed and 0 <= num_pages <= len(seq.page_ids)
        self.pool.free(seq.page_ids[num_pages:])
        del seq.page_ids[num_pages:]
        del seq.page_hashes[num_pages:]
        seq.num_registered_pages = num_pages
        seq.num_computed = num_pages * p

    def _count_aged_as_pulled(self, seq: Sequence, copies: dict[int, int]) -> None:
        """A pulled page aged at admission is still the pulled content: its copy joins the admission
        pin's pulled pages, so ``release_admission`` counts the request's pulled tokens whichever
        precision now holds them. ``copies``: old page -> the page that replaced it."""
        pin = self.pool.get_pin(seq.admission_pin) if seq.admission_pin is not None else None
        if pin is None or not isinstance(pin.record, AdmissionRecord):
            return
        took = {new for old, new in copies.items() if old in pin.record.pulled}
        if took:
            pin.record = replace(pin.record, pulled=pin.record.pulled | took)

    def _admission_pages(self, seq: Sequence) -> Counter[int]:
        """The refs ``seq``'s own admission pin (pages pulled for it) holds, by page: no other holder's."""
        pin = seq.admission_pin
        return Counter(self.pool.pin_pages(pin)) if pin is not None and self.pool.get_pin(pin) else Counter()

    def _age_down(self, seq: Sequence, wanted: Seq[int]) -> int:
        """Re-store ``seq``'s matched 4-bit pages that ``wanted`` puts at 2 bits as INT2 pages,
        in prefix order while INT2 pages can be had; returns how many were aged.

        An aged page is registered under its 2-bit hash, or the copy already
        cached there (aged for another request) is taken instead; the pages
        after it keep their hashes (``_page_hashes``).
        """
        assert isinstance(self.pool, TriaxialPagePool) and self._requantize is not None
        pool = self.pool
        matched = seq.page_ids[: seq.num_computed // self.page_size]  # not the pages placed after them
        cands = [i for i, pid in enumerate(matched) if wanted[i] == 2 and page_id_bits(pid) == 4]
        if self.controller is not None:
            # under the controller only pages no other holder keeps: a copy beside a page a lease or a
            # transfer hold keeps takes a second page until that holder lets go. The request's own admission
            # pin (pages pulled for it) is no other holder: it goes as the request is admitted, the old page with it
            own = self._admission_pages(seq)
            cands = [i for i in cands if pool.ref_count(seq.page_ids[i]) - own[seq.page_ids[i]] == 1]
        fresh: list[int] = []
        for _ in cands:  # one at a time: as many as fit, no lease reclaimed for this
            got = pool.allocate([2])
            if got is None:
                break
            fresh += got
        self.age_down_skipped_pages += len(cands) - len(fresh)
        if not fresh:
            return 0
        aged = cands[: len(fresh)]
        old = [seq.page_ids[i] for i in aged]
        src: list[int] = []
        dst: list[int] = []
        unused: list[int] = []
        written: list[int] = []  # page indices that get a new INT2 page
        for i, new in zip(aged, fresh):
            h = seq.page_hashes[i] ^ _PRECISION_MARK[4] ^ _PRECISION_MARK[2]
            seq.page_hashes[i] = h
            cached = pool.lookup(h)
            if cached is not None:  # aged before: share that copy
                pool.incref([cached])
                unused.append(new)
                seq.page_ids[i] = cached
            else:
                src.append(seq.page_ids[i])
                dst.append(new)
                written.append(i)
                seq.page_ids[i] = new
        if unused:
            pool.free(unused)  # never registered: straight back to the free list
        self._count_aged_as_pulled(seq, dict(zip(old, (seq.page_ids[i] for i in aged))))
        self._requantize(src, dst)
        for i in written:
            pool.register(seq.page_ids[i], seq.page_hashes[i])
        pool.free(old)
        for pid in old:
            if pool.page(pid) is not None:
                pool.retire(pid)
        self.aged_pages += len(aged)
        return len(aged)

    def age_cached(self, int2_hashes: Seq[int]) -> int:
        """Age-down before a pull: for each 2-bit page hash not cached here whose 4-bit twin
        (same tokens, same prefix) is, store an INT2 copy under it, so the pull finds it
        locally instead of moving its bytes; returns how many were aged. The caller
        guarantees the request wants those pages at 2 bits. Same rules as ``_age_down``:
        new pages only, the 4-bit page retired, skipped without INT2 room."""
        if not self.age_down:
            return 0
        assert isinstance(self.pool, TriaxialPagePool) and self._requantize is not None
        pool = self.pool
        src: list[int] = []
        dst: list[int] = []
        hashes: list[int] = []
        for h in int2_hashes:
            old = pool.lookup(h ^ _PRECISION_MARK[2] ^ _PRECISION_MARK[4])
            if pool.lookup(h) is not None or old is None or page_id_bits(old) != 4 or h in hashes:
                continue
            pool.incref([old])  # held while copied: an INT2 allocation may evict cached INT4 pages
            got = pool.allocate([2])
            if got is None:
                pool.free([old])
                break
            src.append(old)
            dst += got
            hashes.append(h)
        if not dst:
            return 0
        self._requantize(src, dst)
        for new, h in zip(dst, hashes):
            pool.register(new, h)
        pool.free(dst)  # cached under their 2-bit hashes, for the request about to match them
        pool.free(src)
        for pid in src:
            if pool.page(pid) is not None:
                pool.retire(pid)
        self.aged_pages += len(dst)
        return len(dst)

    def page_bits_for(self, seq: Sequence, first_page: int, last_page: int) -> list[int]:
        """Precision of pages [first_page, last_page) of ``seq`` (4 outside triaxial)."""
        if self.bits_table is None:
            return [4] * (last_page - first_page)
        # Only full pages of the original prompt can be INT2; pages holding
        # generated tokens (and the partial last prompt page) are INT4. Only
        # the asked-for pages' tags are read: a decode step that opens a page
        # past the prompt reads none.
        p = self.page_size
        full_end = min(last_page, len(seq.prompt_ids) // p)
        tags = seq.tags[first_page * p : full_end * p] if full_end > first_page else []
        if self.controller is not None:
            prompt_bits = self.controller.page_bits(tags, seq.token_ids(first_page * p, full_end * p), first_page)
        else:
            prompt_bits = page_bits(tags, self.bits_table, p) if tags else []
        return prompt_bits + [4] * (last_page - first_page - len(prompt_bits))

    def held_bits(self, *, cached: bool = True) -> float | None:
        """Average nominal bits per value over the pages the pool holds: owned, and cached unless
        ``cached`` is False (None: none held)."""
        pool = self.pool
        if not isinstance(pool, TriaxialPagePool):
            return 4.0 if pool.live_page_ids() else None
        return stored_bits({b: pool.held_pages(bits=b, cached=cached) for b in (2, 4)}, {2: 2.0, 4: 4.0})

    def _observe_prompt(self, seq: Sequence, matched: Seq[int]) -> None:
        """Every prompt page a request will hold: pages it reuses stay as stored where nothing
        re-stores them (2-bit pages; 4-bit pages another holder keeps, or that this worker
        never ages: age-down off, a follower), INT4 or INT2 whatever the cut; the others
        follow it (computed at it, or held at 4 bits and aged down when it says 2); the
        partial last page is INT4. Called once the request is placed, its refs on ``matched``
        taken."""
        p = self.page_size
        pool = self.pool
        full = len(seq.prompt_ids) // p
        ages = self.age_down and self.controller is not None and self.controller.leader
        own = self._admission_pages(seq)
        two = four = 0
        follow: list[int] = []
        for i in range(full):
            if i < len(matched):
                pid = matched[i]
                if page_id_bits(pid) == 2:
                    two += 1
                    continue
                if not ages or pool.ref_count(pid) - own[pid] > 1:  # as ``_age_down``: held elsewhere, kept at 4
                    four += 1
                    continue
            follow += seq.tags[i * p : (i + 1) * p]
        self._observe(follow, forced=four + int(len(seq.prompt_ids) % p > 0), fixed2=two)

    def _observe(self, tags: Seq[int], forced: int, fixed2: int = 0) -> None:
        """Tell the controller about pages a sequence holds; let it look at the pool when due."""
        assert self.controller is not None
        if self.controller.observe(tags, forced=forced, fixed2=fixed2):
            pages = sum(self.pool.held_pages(bits=b, cached=False) for b in (2, 4)) if isinstance(self.pool, TriaxialPagePool) else 0
            self.controller.update(self.held_bits(cached=False), pages=pages)

    def allocate_until(self, seq: Sequence, num_tokens: int, *, reclaim_up_to: int = RECLAIM_LAST) -> bool:
        """Make sure pages cover the first ``num_tokens`` tokens; all or nothing. Reclaimable pins
        of a class up to ``reclaim_up_to`` yield first, when that can help (``PagePoolBase.allocate_reclaiming``)."""
        need = -(-num_tokens // self.page_size) - len(seq.page_ids)
        if need <= 0:
            return True
        first = len(seq.page_ids)
        # one all-or-nothing placement (across both ends of a triaxial buffer)
        bits = self.page_bits_for(seq, first, first + need)
        # placement hints: extend the sequence's last page in place, room for all its known tokens
        after = seq.page_ids[-1] if seq.page_ids else None
        expect = -(-seq.num_tokens // self.page_size) - first
        # retained conversations yield to live requests, least recently active first
        got = self.pool.allocate_reclaiming(bits, up_to=reclaim_up_to, after=after, expect=expect)
        if got is None:
            return False
        seq.page_ids.extend(got)
        if self.controller is not None:  # pages past the prompt (generated tokens): INT4 at any cut
            prompt_pages = -(-len(seq.prompt_ids) // self.page_size)
            self._observe([], forced=max(0, first + need - max(first, prompt_pages)))
        return True

    def publish_full_pages(self, seq: Sequence) -> None:
        """Register every fully computed page with the prefix cache (once)."""
        full = seq.num_computed // self.page_size
        if full <= seq.num_registered_pages:
            return
        self._extend_hashes(seq, full)
        for i in range(seq.num_registered_pages, full):
            self.pool.register(seq.page_ids[i], seq.page_hashes[i])
        seq.num_registered_pages = full

    def free(self, seq: Sequence) -> None:
        if seq.page_ids:
            self.pool.free(seq.page_ids)
        seq.page_ids = []
        seq.page_hashes = []
        seq.num_registered_pages = 0
        seq.num_computed = 0
