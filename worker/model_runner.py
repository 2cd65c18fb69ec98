"""Turns a scheduler step into one batched forward pass and the logits to sample from."""

from __future__ import annotations

import torch

from kvserving.kernels.page_ids import is_int2
from kvserving.worker.attention import AttentionMetadata, PagedAttention, PrefillSpan
from kvserving.worker.model import DecoderModel
from kvserving.worker.precision import order_pages_int2_first
from kvserving.worker.sequence import ScheduledChunk


class ModelRunner:
    def __init__(self, model: DecoderModel, attention: PagedAttention, *, device: torch.device) -> None:
        self.model = model
        self.attention = attention
        self.page_size = attention.storage.page_size
        # Decode gets per-row INT2 page counts exactly when the storage has INT2 pages.
        self.has_int2 = attention.storage.triaxial
        self.device = device

    def _metadata(self, chunks: list[ScheduledChunk]) -> AttentionMetadata:
        p = self.page_size
        write_rows: list[int] = []
        write_pages: list[int] = []
        write_slots: list[int] = []
        int2_pages: list[tuple[int, int]] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        decode_int2: list[int] = []
        prefills: list[PrefillSpan] = []
        row = 0
        for c in chunks:
            pages = c.seq.page_ids
            pos = c.start
            while pos < c.start + c.num_tokens:
                page = pages[pos // p]
                if is_int2(page):
                    # chunks end on page boundaries, so an INT2 page is whole here
                    assert pos % p == 0 and pos + p <= c.start + c.num_tokens
                    int2_pages.append((row + pos - c.start, page))
                    pos += p
                    continue
                write_rows.append(row + pos - c.start)
                write_pages.append(page)
                write_slots.append(pos % p)
                pos += 1
            if c.num_tokens == 1 and c.start > 0:
                table, num_int2 = order_pages_int2_first(pages[: -(-(c.start + 1) // p)])
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lens.append(c.start + 1)
                decode_int2.append(num_int2)
            else:
                prefix = torch.tensor(pages[: c.start // p], dtype=torch.int32, device=self.device)
                prefills.append(PrefillSpan(row, c.start, c.num_tokens, prefix))
            row += c.num_tokens

        def t(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        meta = AttentionMetadata(
            write_rows=t(write_rows, torch.long),
            write_pages=t(write_pages, torch.int32),
            write_slots=t(write_slots, torch.int32),
            int2_pages=int2_pages,
            prefills=prefills,
        )
        if decode_rows:
            width = max(len(x) for x in decode_tables)
            meta.decode_rows = t(decode_rows, torch.long)
            padded = [x + [0] * (width - len(x)) for x in decode_tables]
            meta.page_table = torch.tensor(padded, dtype=torch.int32, device=self.device)
            meta.seq_lens = t(decode_lens, torch.int32)
            if self.has_int2:
                meta.num_int2_pages = t(decode_int2, torch.int32)
        return meta

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Run the step; returns fp32 logits [num sampling chunks, vocab], in chunk order."""
        ids: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []
        for c in chunks:
            ids.extend(c.seq.token_ids(c.start, c.start + c.num_tokens))
            positions.extend(range(c.start, c.start + c.num_tokens))
            if c.samples:
                last_rows.append(len(ids) - 1)
        self.attention.meta = self._metadata(chunks)
        try:
            hidden = self.model(
                torch.tensor(ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device),
                self.attention,
            )
        finally:
            self.attention.meta = None
        if not last_rows:
            return torch.empty(0, 0)
        return self.model.compute_logits(hidden[torch.tensor(last_rows, device=self.device)]).float()
