"""Turns a scheduler step into one batched forward pass and the logits to sample from.

Decode steps replay CUDA graphs when the runner has them (``cuda_graphs.py``:
on CUDA unless the engine enforces eager mode); prefill and mixed steps, and
every step on CPU, run eagerly.
"""

from __future__ import annotations

import torch

from kvserving.kernels.page_ids import is_int2
from kvserving.worker.attention import AttentionMetadata, PagedAttention, PrefillSpan
from kvserving.worker.cuda_graphs import DecodeGraphs, pad_pages_needed, table_width
from kvserving.worker.model import DecoderModel
from kvserving.worker.kv.page_pool import PagePoolBase
from kvserving.worker.precision import order_pages_int2_first
from kvserving.worker.sequence import ScheduledChunk


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        attention: PagedAttention,
        *,
        device: torch.device,
        use_graphs: bool = False,
        max_batch: int = 256,
        max_model_len: int | None = None,
        pool: PagePoolBase | None = None,
    ) -> None:
        """``use_graphs`` (CUDA only) needs ``pool``: a few of its pages are kept for the padding rows of graphs."""
        self.model = model
        self.attention = attention
        self.page_size = attention.storage.page_size
        # Decode gets per-row INT2 page counts exactly when the storage has INT2 pages.
        self.has_int2 = attention.storage.triaxial
        self.device = device
        max_len = max_model_len or model.args.max_position_embeddings
        self.max_pages = -(-max_len // self.page_size)
        self.graphs: DecodeGraphs | None = None
        if use_graphs:
            if device.type != "cuda":
                raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
            if pool is None:
                raise ValueError("CUDA graphs need the page pool (a page for padding rows)")
            pad = pool.allocate([4] * pad_pages_needed(max_batch, self.page_size))
            if pad is None:
                raise ValueError("the KV pool has no pages to spare for CUDA-graph padding rows")
            self.graphs = DecodeGraphs(model, attention, device=device, max_batch=max_batch, max_pages=self.max_pages, pad_pages=pad)

    def _metadata(self, chunks: list[ScheduledChunk]) -> AttentionMetadata:
        p = self.page_size
        write_rows: list[int] = []
        write_pages: list[int] = []
        write_slots: list[int] = []
        int2_rows: list[int] = []
        int2_ids: list[int] = []
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
                    int2_rows.extend(range(row + pos - c.start, row + pos - c.start + p))
                    int2_ids.append(page)
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
            prefills=prefills,
        )
        if int2_ids:
            meta.int2_rows = t(int2_rows, torch.long)
            meta.int2_page_ids = t(int2_ids, torch.int32)
        if decode_rows:
            # the width CUDA graphs use for these rows: eager and graph steps plan the same decode splits
            width = table_width(max(len(x) for x in decode_tables), self.max_pages)
            meta.decode_rows = t(decode_rows, torch.long)
            padded = [x + [0] * (width - len(x)) for x in decode_tables]
            meta.page_table = torch.tensor(padded, dtype=torch.int32, device=self.device)
            meta.seq_lens = t(decode_lens, torch.int32)
            if self.has_int2:
                meta.num_int2_pages = t(decode_int2, torch.int32)
        return meta

    def graphs_fit(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether ``execute`` runs this step on the decode graphs (``prev`` needs that)."""
        return self.graphs is not None and self.graphs.fits(chunks)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], *, prev: tuple[torch.Tensor, list[int]] | None = None) -> torch.Tensor:
        """Run the step; returns fp32 logits [num sampling chunks, vocab] on the device, in chunk order.

        ``prev = (tokens, sources)`` (a decode step on the graphs only, ``graphs_fit``): row i's input id is
        the device tensor ``tokens[sources[i]]`` instead of the sequence's last token on the host."""
        if self.graphs is not None:
            logits = self.graphs.run(chunks, prev)
            if logits is not None:
                return logits
        if prev is not None:
            raise RuntimeError("input ids from the device need a decode step that fits the graphs")
        ids: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []
        for c in chunks:
            ids.extend(c.seq.token_ids(c.start, c.start + c.num_tokens))
            positions.extend(range(c.start, c.start + c.num_tokens))
            if c.samples:
                last_rows.append(len(ids) - 1)
        self.attention.meta = self._metadata(chunks)
        # every index tensor is on the device before the forward starts (no copy waits for it)
        last = torch.tensor(last_rows, dtype=torch.long, device=self.device)
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
        return self.model.compute_logits(hidden[last]).float()
