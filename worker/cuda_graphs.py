"""CUDA graphs of decode steps: one graph per (batch bucket, page-table width bucket), captured on first use.

A decode step (every sequence adds one token after its cached prefix) is the
same few hundred kernel launches every time; replaying them from a graph takes
the Python and launch cost off the step. What changes from step to step lives
in static buffers the graphs read, sized at construction:

    one int32 device buffer (and its pinned host mirror), filled per step by ONE copy:
    | ids [Bmax] | positions [Bmax] | seq lens [Bmax] | INT2 pages [Bmax] | write page [Bmax] | write slot [Bmax] |
    | page table [B x W] (row-major, only the bucket's B x W prefix is used) |

A batch of b sequences runs the graph of the smallest bucket B >= b; rows b..B
are padding: token 0 at position 0, length 0 (their attention reads nothing)
and their K/V written to a page the runner keeps for them. The page table is
padded to the width bucket W (16, 24, 32, 48, ... pages, capped at the model's
context), and the eager path pads to the same W, so both run the same split
plan and give the same tokens. The decode kernels plan their splits from W and
B on the host, at capture; the sequences' lengths and INT2 counts are read on
the device, so one graph serves every length up to W pages.

Logits land in one static fp32 buffer shared by all graphs (a graph keeps no
output of its own, so all of them share one memory pool). Prefill and mixed
steps stay eager. CUDA only: the runner builds this only on a CUDA device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserving.kernels.page_ids import INT2_PAGE_FLAG
from kvserving.worker.attention import AttentionMetadata, PagedAttention
from kvserving.worker.model import DecoderModel
from kvserving.worker.precision import order_pages_int2_first
from kvserving.worker.sequence import ScheduledChunk

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_WIDTH = 16  # pages: the narrowest page table a graph is captured for
_FIELDS = 6  # ids, positions, seq lens, INT2 pages, write page, write slot


def batch_bucket(n: int, max_batch: int) -> int | None:
    """The smallest bucket holding ``n`` rows, None when ``n`` exceeds the largest one in use."""
    for b in BATCH_BUCKETS:
        if n <= b <= max_batch:
            return b
    return None


def table_width(num_pages: int, max_pages: int) -> int:
    """Page-table width for rows of at most ``num_pages`` pages: MIN_WIDTH x 2^k or x 1.5 x 2^k (at most 50% wider
    than needed, so the decode splits planned for it stay mostly busy), capped at ``max_pages``."""
    w = MIN_WIDTH
    while w < num_pages:
        w = w * 3 // 2 if w & (w - 1) == 0 else w * 4 // 3  # 16, 24, 32, 48, 64, 96, ...
    return max(num_pages, min(w, max_pages))


def is_decode_step(chunks: list[ScheduledChunk]) -> bool:
    return bool(chunks) and all(c.num_tokens == 1 and c.start > 0 for c in chunks)


@dataclass(slots=True)
class _Row:
    """A sequence's decode page-table row (INT2 pages first), kept between steps and grown in place."""

    pages: list[int]  # the sequence's page_ids list it was built from (a new list: rebuild)
    n: int  # pages covered
    table: np.ndarray  # int32 [capacity], the first n used
    n2: int  # INT2 pages leading the row


class DecodeGraphs:
    """Captures and replays decode steps of one model runner (see the module docstring)."""

    def __init__(
        self,
        model: DecoderModel,
        attention: PagedAttention,
        *,
        device: torch.device,
        max_batch: int,
        max_pages: int,
        pad_page: int,
        capture: bool = True,
    ) -> None:
        """``capture=False`` (tests on CPU): the same static buffers and forward, run eagerly instead of replayed."""
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.capture = capture
        self.model = model
        self.attention = attention
        self.device = device
        self.page_size = attention.storage.page_size
        self.triaxial = attention.storage.triaxial
        self.max_batch = batch_bucket(min(max_batch, BATCH_BUCKETS[-1]), BATCH_BUCKETS[-1]) or BATCH_BUCKETS[-1]
        self.max_pages = max_pages
        self.pad_page = pad_page
        bmax = self.max_batch
        self.table_offset = _FIELDS * bmax
        size = self.table_offset + bmax * max_pages
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.host_np = self.host.numpy()
        self.dev = torch.zeros(size, dtype=torch.int32, device=device)
        vocab = model.args.vocab_size
        self.logits = torch.empty(bmax, vocab, dtype=torch.float32, device=device)
        # the last host -> device copy: the host mirror is reused after it
        self.copied = torch.cuda.Event() if device.type == "cuda" else None
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.rows: dict[str, _Row] = {}
        self.replays = 0
        # benchmarks: set to a list to get (start, end) CUDA events around each replay (graph time on the GPU)
        self.replay_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None

    # ------------------------------------------------------------------ host side
    def _field(self, i: int, b: int) -> slice:
        return slice(i * self.max_batch, i * self.max_batch + b)

    def _row(self, chunk: ScheduledChunk) -> _Row:
        seq = chunk.seq
        n = chunk.start // self.page_size + 1  # pages covering positions [0, start]
        row = self.rows.get(seq.request_id)
        if row is not None and row.pages is seq.page_ids and row.n <= n:
            new = seq.page_ids[row.n : n]
            if any(pid & INT2_PAGE_FLAG for pid in new):  # never in decode; rebuild to keep INT2 first
                row = None
            elif new:
                if n > row.table.shape[0]:
                    grown = np.empty(max(n, 2 * row.table.shape[0]), dtype=np.int32)
                    grown[: row.n] = row.table[: row.n]
                    row.table = grown
                row.table[row.n : n] = new
                row.n = n
        else:
            row = None
        if row is None:
            ordered, n2 = order_pages_int2_first(seq.page_ids[:n])
            table = np.empty(max(n + 64, 2 * n), dtype=np.int32)
            table[:n] = ordered
            row = _Row(seq.page_ids, n, table, n2)
            self.rows[seq.request_id] = row
        return row

    def _fill(self, chunks: list[ScheduledChunk], b: int) -> int | None:
        """Write the step's metadata into the host mirror; returns the width bucket (None: too wide)."""
        rows = [self._row(c) for c in chunks]
        width = table_width(max(r.n for r in rows), self.max_pages)
        if width > self.max_pages:
            return None
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has read the mirror
        h = self.host_np
        n = len(chunks)
        ids, pos, lens, n2, wpage, wslot = (h[self._field(i, b)] for i in range(_FIELDS))
        p = self.page_size
        for i, (c, r) in enumerate(zip(chunks, rows)):
            ids[i] = c.seq.token_ids(c.start, c.start + 1)[0]
            pos[i] = c.start
            lens[i] = c.start + 1
            n2[i] = r.n2
            wpage[i] = c.seq.page_ids[c.start // p]
            wslot[i] = c.start % p
        ids[n:], pos[n:], lens[n:], n2[n:], wpage[n:], wslot[n:] = 0, 0, 0, 0, self.pad_page, 0
        table = h[self.table_offset : self.table_offset + b * width].reshape(b, width)
        for i, r in enumerate(rows):
            table[i, : r.n] = r.table[: r.n]
        if len(self.rows) > 2 * self.max_batch + 64:  # forget sequences that left the batch
            live = {c.seq.request_id for c in chunks}
            self.rows = {k: v for k, v in self.rows.items() if k in live}
        return width

    def _meta(self, b: int, width: int) -> AttentionMetadata:
        """Metadata of views into the static device buffer for bucket (b, width)."""
        d = self.dev
        empty = d[:0]
        return AttentionMetadata(
            write_rows=empty.long(),
            write_pages=d[self._field(4, b)],
            write_slots=d[self._field(5, b)],
            page_table=d[self.table_offset : self.table_offset + b * width].view(b, width),
            seq_lens=d[self._field(2, b)],
            num_int2_pages=d[self._field(3, b)] if self.triaxial else None,
            all_decode=True,
        )

    # ------------------------------------------------------------------ device side
    def _forward(self, b: int, width: int) -> None:
        self.attention.meta = self._meta(b, width)
        try:
            hidden = self.model(self.dev[self._field(0, b)], self.dev[self._field(1, b)], self.attention)
            self.logits[:b].copy_(self.model.compute_logits(hidden))
        finally:
            self.attention.meta = None

    def _capture(self, b: int, width: int) -> torch.cuda.CUDAGraph:
        # One eager run first, on a side stream: Triton compiles and cuBLAS picks its kernels outside the capture.
        # It is this step's real work (the metadata is in place), so replaying after it only writes the same KV again.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(b, width)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self._forward(b, width)
        self.graphs[(b, width)] = graph
        return graph

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """Logits [len(chunks), vocab] of a decode step (a view of the static buffer: read it before the next
        step), or None when the step does not fit a graph (run it eagerly)."""
        b = batch_bucket(len(chunks), self.max_batch)
        if b is None or not is_decode_step(chunks):
            return None
        width = self._fill(chunks, b)
        if width is None:
            return None
        used = self.table_offset + b * width
        self.dev[:used].copy_(self.host[:used], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        self.replays += 1
        if not self.capture:
            self._forward(b, width)
            return self.logits[: len(chunks)]
        graph = self.graphs.get((b, width)) or self._capture(b, width)
        if self.replay_events is None:
            graph.replay()
        else:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            self.replay_events.append((start, end))
        return self.logits[: len(chunks)]
