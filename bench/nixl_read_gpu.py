"""READ rate between two worker processes through ``NixlIO``, beside the device's own copy rate.

Two processes share one device (two workers on one GPU, as ``bench/agents.py --gpu`` runs them):
the sender registers KV-shaped layer buffers and serves them; the reader READs pages of them the way
a pull does (contiguous runs and every other page), while the sender idles and while it computes
(matrix products on the device and a Python loop holding the interpreter, as a worker's steps do).
Beside each READ: the same bytes copied inside the reader's device by torch (the limit a transfer
on one device can approach), and the transport UCX chose for the READ (its protocol table:
``zero-copy cuda_ipc/cuda`` on a GPU, ``software emulation tcp/...`` when GET over CUDA IPC is off).
``--kv-layout page_major`` registers the same bytes as one region whose pages hold all 36 layers
(``kv_cache.layout``): a run of pages is then one region instead of 36.

    python3 bench/nixl_read_gpu.py --out bench/results/nixl_read_gpu_h100.json   # device machine
    python3 bench/nixl_read_gpu.py --device cpu --pages 256 --out /tmp/nixl_read_cpu.json

Needs NIXL (and on the device machine the repository importable as ``kvserving``: bench/gpu_run.sh).
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from kvserving.config import KV_LAYOUTS, KVCacheConfig
from kvserving.jsonfmt import dumps
from kvserving.worker.kv.nixl_io import NixlIO, PageGeometry, TransferError

LAYERS = 36  # Qwen3-8B
PAGE_BYTES = 32768  # fp8, 16 tokens, 8 KV heads x 128 x K and V


def rows_of(layout: str) -> int:
    """Layers one registered region (one row of the buffers) holds: all of them page-major."""
    return LAYERS if layout == "page_major" else 1


def geometry(pages: int, layout: str = "layer_major") -> PageGeometry:
    k = rows_of(layout)
    return PageGeometry(page_bytes=k * PAGE_BYTES, int2_page_bytes=k * PAGE_BYTES // 2, total_bytes=k * PAGE_BYTES * pages)


def sender_buffers(device: str, pages: int, layout: str = "layer_major") -> torch.Tensor:
    """The sender's buffers, one row per registered region: seeded, so the reader can check every byte it READ."""
    gen = torch.Generator(device=device).manual_seed(0)
    k = rows_of(layout)
    return torch.randint(0, 256, (LAYERS // k, k * PAGE_BYTES * pages), dtype=torch.uint8, device=device, generator=gen)


def serve(device: str, pages: int, meta_path: Path, layout: str = "layer_major") -> None:
    """The sender process: its agent's metadata to ``meta_path``, then commands on stdin, one a line:
    busy (compute), idle, quit."""
    buf = sender_buffers(device, pages, layout)
    io = NixlIO("bench-sender", buf, geometry=geometry(pages, layout))
    io.start_progress()
    meta_path.write_bytes(pickle.dumps((io.metadata(), io.addrs, io.device_id)))
    print("ready", flush=True)
    stop = threading.Event()

    def compute() -> None:  # a worker's steps: device work and Python holding the interpreter
        n = 4096 if device == "cuda" else 256
        x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        while not stop.is_set():
            for _ in range(8):
                x = (x @ x).clamp_(-1, 1)
            s = 0
            for i in range(100_000):
                s += i
            if device == "cuda":
                torch.cuda.synchronize()

    worker: threading.Thread | None = None
    for line in sys.stdin:
        c = line.strip()
        if c == "busy" and worker is None:
            worker = threading.Thread(target=compute, daemon=True)
            worker.start()
        elif c == "idle" and worker is not None:
            stop.set()
            worker.join()
            stop.clear()
            worker = None
        elif c == "quit":
            break
        print(c, flush=True)
    stop.set()
    io.close()


class _Sender:
    """``serve`` in a child process (this script run with --serve), driven over its stdin."""

    def __init__(self, device: str, pages: int, work: Path, layout: str = "layer_major") -> None:
        self.meta_path = work / "sender.meta"
        cmd = [sys.executable, __file__, "--serve", "--device", device, "--pages", str(pages), "--meta", str(self.meta_path)]
        cmd += ["--kv-layout", layout]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._expect("ready", 300.0)

    def _expect(self, word: str, timeout_s: float) -> None:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the sender process exited (code {self.proc.poll()}) before saying {word!r}")
            if line.strip() == word:
                return
        raise RuntimeError(f"the sender did not say {word!r} within {timeout_s:g} s")

    def metadata(self) -> tuple[bytes, tuple[int, ...], int]:
        meta: tuple[bytes, tuple[int, ...], int] = pickle.loads(self.meta_path.read_bytes())
        return meta

    def tell(self, word: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()
        self._expect(word, 60.0)

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class _Stdout:
    """The process's own file descriptor 1 (where UCX prints) captured into a string."""

    def __enter__(self) -> _Stdout:
        sys.stdout.flush()
        self._tmp = tempfile.TemporaryFile(mode="w+b")
        self._saved = os.dup(1)
        os.dup2(self._tmp.fileno(), 1)
        self.text = ""
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stdout.flush()
        os.dup2(self._saved, 1)
        os.close(self._saved)
        self._tmp.seek(0)
        self.text = self._tmp.read().decode(errors="replace")
        self._tmp.close()


def read_transport(proto_info: str) -> str:
    """The transports in UCX's protocol table for a remote read (``UCX_PROTO_INFO=y``), '?' if none."""
    found: list[str] = []
    lines = proto_info.splitlines()
    for i, line in enumerate(lines):
        if "remote memory read" not in line:
            continue
        for row in lines[i + 1 : i + 12]:
            cells = [c.strip() for c in row.split("|")[1:-1]]
            if len(cells) == 3 and re.match(r"^\d", cells[0]):
                found.append(f"{cells[1]} {cells[2]}".strip())
        if found:
            break
    return ", ".join(dict.fromkeys(found)) or "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--pages", type=int, default=2048, help="pages per layer buffer (36 layers of 32 KiB pages)")
    ap.add_argument("--read-pages", type=int, default=700, help="pages one READ moves (a ~11K-token pull)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=20.0, help="one READ's deadline")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--kv-layout", choices=KV_LAYOUTS, default=KVCacheConfig().layout, help="a region per layer, or one")
    ap.add_argument(
        "--require-transport", default=None, help="exit 1 (after writing --out) unless UCX's READ transport names this, e.g. cuda_ipc"
    )
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the sender process
    ap.add_argument("--meta", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no GPU visible to torch")
    if args.serve:
        serve(args.device, args.pages, args.meta, args.kv_layout)
        return 0
    if args.read_pages * 2 > args.pages:
        ap.error(f"--read-pages {args.read_pages} needs --pages >= {2 * args.read_pages} (every other page is read too)")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as work:
        sender = _Sender(args.device, args.pages, Path(work), args.kv_layout)  # started before UCX_PROTO_INFO is set here
        had_proto_info = "UCX_PROTO_INFO" in os.environ
        os.environ.setdefault("UCX_PROTO_INFO", "y")  # the reader's protocol table
        try:
            transport = _measure(args, sender, rows)
        finally:
            sender.close()
            if not had_proto_info:
                del os.environ["UCX_PROTO_INFO"]
    doc = {
        "what": "bench/nixl_read_gpu.py: NixlIO READ between two processes on one device vs torch's copy of the same bytes",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "transport": transport,
        "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        "layers": LAYERS,
        "kv_layout": args.kv_layout,
        "page_bytes": PAGE_BYTES,
        "read_pages": args.read_pages,
        "rows": rows,
    }
    print(f"transport UCX chose for the READ: {transport}")
    if args.out is not None:
        args.out.write_text(dumps(doc))
        print(f"wrote {args.out}")
    if args.require_transport and args.require_transport not in transport:
        print(f"nixl_read_gpu.py: error: the READ ran over {transport!r}, not {args.require_transport}", file=sys.stderr)
        return 1
    return 0


def _measure(args: argparse.Namespace, sender: _Sender, rows: list[dict[str, Any]]) -> str:
    """Every case's row into ``rows``; the transport UCX chose for the first READ."""
    metadata, addrs, device_id = sender.metadata()
    expected = sender_buffers(args.device, args.pages, args.kv_layout)
    dst = torch.zeros_like(expected)
    geo = geometry(args.pages, args.kv_layout)
    with _Stdout():  # UCX's tables for the agent's own endpoint and the connection: not printed
        io = NixlIO("bench-reader", dst, geometry=geo)
    try:
        with _Stdout():
            peer = io.add_remote("sender", 1, metadata, addrs=addrs, device_id=device_id, geometry=geo)
        n = args.read_pages
        cases = {"contiguous": (list(range(n)), list(range(n))), "every other page": (list(range(n)), list(range(1, 2 * n, 2)))}
        transport = "?"
        for state in ("idle", "busy"):
            sender.tell(state)
            for name, (local, remote) in cases.items():
                secs: list[float] = []
                failed = ""
                regions = 0
                for _ in range(args.reps):
                    try:
                        with _Stdout() as out:
                            stats = io.read(peer, local, remote, timeout_s=args.timeout_s)
                        if transport == "?":
                            transport = read_transport(out.text)
                        secs.append(stats.seconds)
                        regions = stats.num_regions
                    except TransferError as exc:
                        failed = f"{exc.reason}: {exc}"
                        break
                if secs and not _equal(dst, expected, local, remote, geo.page_bytes):
                    failed = "the pages READ differ from the sender's"
                dst.zero_()
                nbytes = LAYERS * n * PAGE_BYTES
                row: dict[str, Any] = {"case": name, "sender": state, "mb": round(nbytes / 1e6, 1)}
                if secs:
                    med = statistics.median(secs)
                    copy_gbs = _copy_rate(dst, nbytes)
                    row |= {"regions": regions, "read_ms": round(med * 1e3, 2), "read_gbs": round(nbytes / med / 1e9, 2)}
                    row |= {"copy_gbs": round(copy_gbs, 1), "read_over_copy": round(nbytes / med / 1e9 / copy_gbs, 3)}
                if failed:
                    row["failed"] = failed[:200]
                rows.append(row)
                _print_row(row)
        return transport
    finally:
        io.close()


def _equal(dst: torch.Tensor, src: torch.Tensor, local: list[int], remote: list[int], page_bytes: int) -> bool:
    """Every row's ``local`` pages of ``dst`` (``page_bytes`` each: one layer's, or all layers') equal the ``remote``
    pages of ``src``."""
    lo = torch.tensor(local, device=dst.device)
    ro = torch.tensor(remote, device=dst.device)
    rows = dst.shape[0]
    return torch.equal(dst.view(rows, -1, page_bytes)[:, lo], src.view(rows, -1, page_bytes)[:, ro])


def _copy_rate(dst: torch.Tensor, nbytes: int) -> float:
    """GB/s of torch copying ``nbytes`` inside ``dst``'s device (read + write counted once, as a READ's bytes are)."""
    flat = dst.view(-1)
    half = min(nbytes, flat.numel() // 2)
    a, b = flat[:half], flat[half : 2 * half]
    best = float("inf")
    for _ in range(3):
        if dst.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        if dst.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return half / best / 1e9


def _print_row(row: dict[str, Any]) -> None:
    if "read_gbs" in row:
        print(
            f"{row['case']:>17} sender {row['sender']:>4}: {row['mb']:8.1f} MB in {row['regions']:6d} regions "
            f"{row['read_ms']:9.2f} ms  {row['read_gbs']:8.2f} GB/s  copy {row['copy_gbs']:8.1f} GB/s  "
            f"READ / copy {row['read_over_copy']:.3f}",
            flush=True,
        )
    else:
        print(f"{row['case']:>17} sender {row['sender']:>4}: {row.get('failed', '')}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
