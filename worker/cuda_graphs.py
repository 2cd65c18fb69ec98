"""CUDA graphs of decode steps: one graph per (batch bucket, page-table width bucket), captured before serving.

A decode step (every sequence adds one token after its cached prefix) is the
same few hundred kernel launches every time; replaying them from a graph takes
the Python and launch cost off the step. What changes from step to step lives
in static buffers the graphs read, sized at construction:

    one int32 device buffer (and two pinned host mirrors, used in turn), filled per step by ONE copy:
    | ids [Bmax] | positions [Bmax] | seq lens [Bmax] | INT2 pages [Bmax] | write page [Bmax] | write slot [Bmax] |
    | source rows [Bmax] | page table [B x W] (row-major, only the bucket's B x W prefix is used) |

A batch of b sequences runs the graph of the smallest bucket B >= b; rows b..B
are padding: token 0 at position 0, length 0 (their attention reads nothing)
and their K/V written to pages the runner keeps for them (one slot per row).

Asynchronous decode (``LLMEngine``): a step may take its input ids from the
previous step's sampled ids on the device (``run(prev=...)``): after the
metadata copy, ids[i] = prev_tokens[source row i], so the host launches the
next step without waiting for the sampled ids to come back. The page table is
padded to the width bucket W (16, 24, 32, 48, ... pages, capped at the model's
context), and the eager path pads to the same W, so both run the same split
plan and give the same tokens. The decode kernels plan their splits from W and
B on the host, at capture; the sequences' lengths and INT2 counts are read on
the device, so one graph serves every length up to W pages.

Logits land in one static fp32 buffer shared by all graphs (a graph keeps no
output of its own, so all of them share one memory pool). Prefill and mixed
steps stay eager. CUDA only: the runner builds this only on a CUDA device.

``warm_up`` captures every shape a decode step can take (``graph_shapes``),
widest first so the smaller graphs reuse the pool's memory, before the worker
serves: a shape met for the first time would otherwise cost its Triton
compiles and its capture (up to seconds) inside a running decode batch.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from kvserving.kernels.page_ids import INT2_PAGE_FLAG
from kvserving.worker.attention import AttentionMetadata, PagedAttention
from kvserving.worker.model import DecoderModel, graph_pass
from kvserving.worker.precision import order_pages_int2_first
from kvserving.worker.sequence import ScheduledChunk

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_WIDTH = 16  # pages: the narrowest page table a graph is captured for
_FIELDS = 7  # ids, positions, seq lens, INT2 pages, write page, write slot, source row of the ids


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


def table_widths(max_pages: int) -> list[int]:
    """Every page-table width ``table_width`` gives for rows of at most ``max_pages`` pages, narrowest first."""
    widths = [table_width(1, max_pages)]
    while widths[-1] < max_pages:
        widths.append(table_width(widths[-1] + 1, max_pages))
    return widths


def graph_shapes(max_batch: int, max_pages: int) -> list[tuple[int, int]]:
    """Every (batch bucket, width bucket) a decode step of at most ``max_batch`` rows and ``max_pages`` pages
    runs in, narrowest first."""
    widths = table_widths(max_pages)
    return [(b, w) for b in BATCH_BUCKETS if b <= max_batch for w in widths]


def pad_pages_needed(max_batch: int, page_size: int) -> int:
    """Pages the padding rows of a batch bucket up to ``max_batch`` write to, one slot each: a bucket B
    pads at most B/2 - 1 rows (B/2 + 1 sequences run in it)."""
    b = batch_bucket(min(max_batch, BATCH_BUCKETS[-1]), BATCH_BUCKETS[-1]) or BATCH_BUCKETS[-1]
    return max(1, -(-(b // 2 - 1) // page_size))


def is_decode_step(chunks: list[ScheduledChunk]) -> bool:
    return bool(chunks) and all(c.num_tokens == 1 and c.start > 0 for c in chunks)


@dataclass(slots=True)
class _Row:
    """A sequence's decode page-table row (INT2 pages first), kept between steps and grown in place."""

    pages: list[int]  # the sequence's page_ids list it was built from (a new list: rebuild)
    n: int  # pages covered
    table: np.ndarray  # int32 [capacity], the first n used
    n2: int  # INT2 pages leading the row


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Garbage collected on entry, and no automatic collection inside (the state before restored on exit; a nested
    use neither collects nor re-enables). A CUDA graph or a compiled Triton kernel left in a reference cycle (an
    engine that is gone) is destroyed whenever the collector runs: during a capture its destructor's calls are ones
    a capturing stream forbids, and the capture fails ("operation failed due to a previous error during capture").
    ``torch.cuda.graph`` itself does not collect before capturing."""
    if not gc.isenabled():
        yield
        return
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


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
        pad_pages: Seq[int],
        capture: bool = True,
    ) -> None:
        """``capture=False`` (tests on CPU): the same static buffers and forward, run eagerly instead of replayed.
        ``pad_pages``: pages kept for the padding rows' K/V, ``pad_pages_needed(max_batch, page size)`` of them."""
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
        need = pad_pages_needed(self.max_batch, self.page_size)
        if len(pad_pages) < need:
            raise ValueError(f"{len(pad_pages)} padding pages given, {need} needed for batch {self.max_batch}")
        # padding row j writes slot j % P of page j // P: no two rows write the same slot
        pad = np.arange(self.max_batch, dtype=np.int64)
        self.pad_write_pages = np.asarray(list(pad_pages), dtype=np.int32)[pad // self.page_size % len(pad_pages)]
        self.pad_write_slots = (pad % self.page_size).astype(np.int32)
        bmax = self.max_batch
        self.table_offset = _FIELDS * bmax
        size = self.table_offset + bmax * max_pages
        pin = device.type == "cuda"
        # two host mirrors used in turn: one is filled while the other's copy may still be in flight
        self.hosts = [torch.zeros(size, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.host_nps = [h.numpy() for h in self.hosts]
        self.copied = [torch.cuda.Event() for _ in range(2)] if device.type == "cuda" else None
        self.mirror = 0
        self.dev = torch.zeros(size, dtype=torch.int32, device=device)
        vocab = model.args.vocab_size
        self.logits = torch.empty(bmax, vocab, dtype=torch.float32, device=device)
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
            if row.n < n:
                new = seq.page_ids[row.n : n]
                if any(pid & INT2_PAGE_FLAG for pid in new):  # never in decode; rebuild to keep INT2 first
                    row = None
                else:
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

    def _fill(self, chunks: list[ScheduledChunk], b: int, sources: list[int] | None) -> int | None:
        """Write the step's metadata into the next host mirror; returns the width bucket (None: too wide).
        ``sources``: the ids come from the previous step's sampled ids (rows ``sources``), not the host."""
        rows = [self._row(c) for c in chunks]
        width = table_width(max(r.n for r in rows), self.max_pages)
        if width > self.max_pages:
            return None
        self.mirror ^= 1
        if self.copied is not None:
            self.copied[self.mirror].synchronize()  # this mirror's last copy (two steps ago) has read it
        h = self.host_nps[self.mirror]
        n = len(chunks)
        p = self.page_size
        starts = [c.start for c in chunks]
        # one list per field, assigned in one go (per-element numpy writes cost ~100 ns each)
        if sources is None:
            h[self._field(0, n)] = [c.seq.token_ids(s, s + 1)[0] for c, s in zip(chunks, starts)]
        else:
            h[self._field(6, n)] = sources
        h[self._field(1, n)] = starts
        h[self._field(2, n)] = [s + 1 for s in starts]
        h[self._field(3, n)] = [r.n2 for r in rows]
        h[self._field(4, n)] = [c.seq.page_ids[s // p] for c, s in zip(chunks, starts)]
        h[self._field(5, n)] = [s % p for s in starts]
        if b > n:  # padding rows
            for i in (0, 1, 2, 3, 6):
                h[i * self.max_batch + n : i * self.max_batch + b] = 0
            h[4 * self.max_batch + n : 4 * self.max_batch + b] = self.pad_write_pages[: b - n]
            h[5 * self.max_batch + n : 5 * self.max_batch + b] = self.pad_write_slots[: b - n]
        table = h[self.table_offset : self.table_offset + b * width].reshape(b, width)
        for i, r in enumerate(rows):
            table[i, : r.n] = r.table[: r.n]
        if len(self.rows) > 2 * self.max_batch + 64:  # forget sequences that left the batch
            live = {c.seq.request_id for c in chunks}
            self.rows = {k: v for k, v in self.rows.items() if k in live}
        return width

    def _fill_padding(self, b: int, width: int) -> None:
        """Metadata of a step whose ``b`` rows are all padding rows (length 0, writes to the padding pages), copied
        to the device: what ``warm_up`` captures with. A graph reads lengths and the table on the device, so the
        capture serves every later step of its shape."""
        self.mirror ^= 1
        if self.copied is not None:
            self.copied[self.mirror].synchronize()
        h = self.host_nps[self.mirror]
        for i in (0, 1, 2, 3, 6):
            h[self._field(i, b)] = 0
        h[self._field(4, b)] = self.pad_write_pages[:b]
        h[self._field(5, b)] = self.pad_write_slots[:b]
        used = self.table_offset + b * width
        h[self.table_offset : used] = 0
        self.dev[:used].copy_(self.hosts[self.mirror][:used], non_blocking=True)
        if self.copied is not None:
            self.copied[self.mirror].record()

    def warm_up(self) -> int:
        """Capture the graph of every shape in ``graph_shapes`` not captured yet (without capture, on CPU in
        tests: run each once), widest first; returns how many. Only padding pages are written."""
        shapes = [s for s in reversed(graph_shapes(self.max_batch, self.max_pages)) if s not in self.graphs]
        with gc_paused():  # one collection for all the captures
            for b, width in shapes:
                self._fill_padding(b, width)
                if self.capture:
                    self._capture(b, width)
                else:
                    self._forward(b, width)
        return len(shapes)

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
            with graph_pass():  # the kernels whose launches pay off only when replayed (model.product)
                hidden = self.model(self.dev[self._field(0, b)], self.dev[self._field(1, b)], self.attention)
                self.model.compute_logits(hidden, out=self.logits[:b])
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
        with gc_paused(), torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self._forward(b, width)
        self.graphs[(b, width)] = graph
        return graph

    def fits(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether ``run`` takes this step (a decode step of at most the largest batch bucket)."""
        return batch_bucket(len(chunks), self.max_batch) is not None and is_decode_step(chunks)

    def run(self, chunks: list[ScheduledChunk], prev: tuple[torch.Tensor, list[int]] | None = None) -> torch.Tensor | None:
        """Logits [len(chunks), vocab] of a decode step (a view of the static buffer: read it before the next
        step), or None when the step does not fit a graph (run it eagerly).

        ``prev = (tokens, sources)``: row i's input id is ``tokens[sources[i]]`` (the previous step's sampled
        ids, on the device; the host's copy of that token is not read)."""
        b = batch_bucket(len(chunks), self.max_batch)
        if b is None or not is_decode_step(chunks):
            return None
        n = len(chunks)
        width = self._fill(chunks, b, prev[1] if prev is not None else None)
        if width is None:
            return None
        used = self.table_offset + b * width
        self.dev[:used].copy_(self.hosts[self.mirror][:used], non_blocking=True)
        if self.copied is not None:
            self.copied[self.mirror].record()
        if prev is not None:
            tokens, sources = prev
            ids = self.dev[self._field(0, n)]
            if len(sources) == tokens.shape[0] and sources == list(range(n)):
                ids.copy_(tokens)
            else:
                ids.copy_(tokens.index_select(0, self.dev[self._field(6, n)]))
        self.replays += 1
        if not self.capture:
            self._forward(b, width)
            return self.logits[:n]
        graph = self.graphs.get((b, width)) or self._capture(b, width)
        if self.replay_events is None:
            graph.replay()
        else:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            self.replay_events.append((start, end))
        return self.logits[:n]
