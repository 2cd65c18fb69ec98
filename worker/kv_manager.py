"""Per-sequence KV page policy above the pool: prefix matching, page precision,
allocation for the next tokens, publishing full pages, freeing.

The pool (``page_pool``) knows page ids, ref counts, hashes and leases; the
storage (``kv_storage``) knows bytes. This layer knows sequences.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from kvserving.kernels.page_ids import page_id_bits
from kvserving.worker.page_pool import PagePoolBase
from kvserving.worker.precision import page_bits
from kvserving.worker.sequence import Sequence


class KVCacheManager:
    """Maps sequences to pages. ``bits_table`` (tag -> 2 or 4) is given exactly when the
    pool stores INT2 pages; without it every page is 4-bit (the format's one precision)."""

    def __init__(self, pool: PagePoolBase, *, page_size: int, bits_table: Seq[int] | None = None) -> None:
        if (bits_table is not None) != (2 in pool.precisions):
            raise ValueError(
                f"bits_table must be given exactly when the pool stores INT2 pages (pool precisions {pool.precisions})"
            )
        if page_size != pool.page_size:
            raise ValueError(f"page_size {page_size} differs from the pool's {pool.page_size}")
        self.pool = pool
        self.page_size = page_size
        self.bits_table = tuple(bits_table) if bits_table is not None else None

    @property
    def triaxial(self) -> bool:
        return self.bits_table is not None

    def _page_hashes(self, seq: Sequence, first: int, bits: Seq[int], parent: int | None) -> list[int]:
        """Chained hashes of pages [first, first + len(bits)) of ``seq`` stored at ``bits``.

        Triaxial: a page's identity is its tokens (chained over the prefix) and
        the precision it is stored at: the stored bytes depend on nothing else.
        Tags only choose the precision, so they stay out of the hash: the same
        reply tokens come back tagged reasoning / tool_call / delim in the next
        turn where the worker that generated them tagged them assistant, and
        the temporal part ages every turn; either would make retained pages miss.
        """
        p = self.page_size
        lo, hi = first * p, (first + len(bits)) * p
        tags = None
        if self.triaxial:
            tags = [bits[(j - lo) // p] for j in range(lo, min(hi, seq.num_tokens))]
        return self.pool.chain_hashes(seq.token_ids(lo, hi), p, tags, parent=parent)

    def page_hashes(self, seq: Sequence, bits: Seq[int]) -> list[int]:
        """Chained hashes of ``seq``'s leading ``len(bits)`` pages stored at ``bits``: the keys
        the prefix cache holds them under (KV transfer matches a sender's pages with these)."""
        return self._page_hashes(seq, 0, bits, None)

    def _extend_hashes(self, seq: Sequence, num_full_pages: int) -> None:
        """Hashes of the held pages up to ``num_full_pages``, at their stored precision."""
        have = len(seq.page_hashes)
        if num_full_pages <= have:
            return
        bits = [page_id_bits(pid) for pid in seq.page_ids[have:num_full_pages]]
        seq.page_hashes.extend(self._page_hashes(seq, have, bits, seq.page_hashes[-1] if have else None))

    def match_prefix(self, seq: Sequence) -> int:
        """Reuse cached pages for the longest known prefix; returns tokens reused.

        At least one token is always left to compute: its logits start decoding.
        A triaxial page matches if stored at the precision this request would
        give it, or at 4 bits (more precise is always acceptable; less never).
        """
        assert not seq.page_ids and seq.num_computed == 0
        max_pages = (seq.num_tokens - 1) // self.page_size
        wanted = self.page_bits_for(seq, 0, max_pages)
        matched: list[int] = []
        parent: int | None = None
        for i, want in enumerate(wanted):
            found = None
            for bits in (4, 2) if want == 2 else (4,):
                h = self._page_hashes(seq, i, [bits], parent)[0]
                pid = self.pool.lookup(h)
                if pid is not None:
                    found = h, pid
                    break
            if found is None:
                break
            parent = found[0]
            seq.page_hashes.append(found[0])
            matched.append(found[1])
        self.pool.incref(matched)
        seq.page_ids = matched
        seq.num_registered_pages = len(matched)
        seq.num_computed = len(matched) * self.page_size
        return seq.num_computed

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
        prompt_bits = page_bits(seq.tags[first_page * p : full_end * p], self.bits_table, p) if full_end > first_page else []
        return prompt_bits + [4] * (last_page - first_page - len(prompt_bits))

    def allocate_until(self, seq: Sequence, num_tokens: int) -> bool:
        """Make sure pages cover the first ``num_tokens`` tokens; all or nothing."""
        need = -(-num_tokens // self.page_size) - len(seq.page_ids)
        if need <= 0:
            return True
        first = len(seq.page_ids)
        # one all-or-nothing placement (across both ends of a triaxial buffer)
        bits = self.page_bits_for(seq, first, first + need)
        got = self.pool.allocate(bits)
        # retained conversations yield to live requests, least recently active first
        while got is None and self.pool.reclaim_one() is not None:
            got = self.pool.allocate(bits)
        if got is None:
            return False
        seq.page_ids.extend(got)
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
