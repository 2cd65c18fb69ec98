"""NIXL transport of KV pages: the only module that imports NIXL.

One agent per worker process, UCX backend, progress thread off (the default
thread costs ~2/3 of a core when idle; ``NixlIO`` polls instead, on a light
thread of its own while the worker serves, and inside every wait). Each layer
buffer of the KV storage (``KVStorage.buffers[layer]``, uint8) is one
registered region: DRAM on a CPU tensor, VRAM on a CUDA tensor.

A READ moves pages of a remote worker into pages of this one: one descriptor
per page per layer (byte offsets from ``kvserving.kernels.page_ids``), adjacent
descriptors merged here so a run of contiguous pages is one region; the
number of regions is returned with every READ (transfer cost is set by it).

Failures (``TransferError.reason``): ``remote_unreachable`` (NIXL reports the
peer disconnected or it cannot be reached), ``transfer_timeout`` (our own
deadline fired: a frozen peer over TCP reports nothing), ``transfer_failed``
(any other NIXL error). After ANY failure every destination page may be
partly written: the caller must treat them all as invalid. When a timed-out
transfer cannot be cancelled, ``TransferError.pages_safe`` is False and the
destination pages must not be reused until ``reap`` says the transfer is over.

Remote agents are cached by engine id and metadata generation: new metadata
for a known engine id (a restarted peer) removes the old agent first. Removing
an agent fails every READ in flight from it (NIXL: "invalidated or
re-registered during transfer"), so a caller that drops a peer after a failed
READ asks for ``forget_remote(..., unless_reading=True)``: other pulls' READs
from the same peer must not fail with it.

GPU buffers: UCX's ``cuda_ipc`` transport turns GET off ("auto") on GPUs
without NVLink, and a READ is a GET: between two processes on one GPU, or
GPUs linked only over PCIe, every READ then runs as TCP software emulation
through host memory (0.5 GB/s on one H100, stalling while the sender
computes). A worker with VRAM buffers sets ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on``
before its agent starts, unless the environment sets it (``ucx_defaults``).

Thread-safety: every call into the NIXL agent holds ``NixlIO``'s own lock
(the agent runs with NIXL's thread sync off).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from kvserving.kernels.page_ids import page_byte_offset

log = logging.getLogger(__name__)

REASONS = ("remote_unreachable", "transfer_timeout", "transfer_failed")
# UCX settings a worker with GPU buffers needs (module docstring); the environment's own value wins
UCX_GPU_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}
# a READ's wait: busy polls first (most READs end within them), then sleeps growing to the longest
# (twelve READs waiting on a slow peer polled with 0.14 of a host core, 0.03 with the growing sleeps)
POLL_SPINS = 200
POLL_SLEEP_FIRST_S, POLL_SLEEP_MAX_S = 0.0002, 0.002


def ucx_defaults(mem_type: str, environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set in ``environ`` the UCX settings an agent over ``mem_type`` buffers needs and the
    environment does not set; what was set."""
    if mem_type != "VRAM":
        return {}
    applied = {k: v for k, v in UCX_GPU_DEFAULTS.items() if k not in environ}
    environ.update(applied)
    return applied


def import_nixl() -> ModuleType:
    """The NIXL Python API: ``nixl_cu12._api`` (the wheel here), ``nixl_cu13._api`` (CUDA 13 GPU
    machines), else ``nixl._api``."""
    errors = []
    for name in ("nixl_cu12._api", "nixl_cu13._api", "nixl._api"):
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError("NIXL is not installed (" + "; ".join(errors) + ")")


class TransferError(Exception):
    """A failed READ; ``reason`` is one of ``REASONS``."""

    def __init__(self, reason: str, message: str, *, pages_safe: bool = True) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.pages_safe = pages_safe


@dataclass(slots=True, frozen=True)
class PageGeometry:
    """Where pages live in one worker's layer buffers (same offsets in every layer)."""

    page_bytes: int
    int2_page_bytes: int
    total_bytes: int

    def span(self, page_id: int) -> tuple[int, int]:
        """(byte offset, length) of ``page_id`` in a layer buffer."""
        off = page_byte_offset(page_id, page_bytes=self.page_bytes, int2_page_bytes=self.int2_page_bytes, total_bytes=self.total_bytes)
        length = self.int2_page_bytes if page_id & (1 << 30) else self.page_bytes
        if off < 0 or off + length > self.total_bytes:
            raise ValueError(f"page id {page_id} lies outside a layer buffer of {self.total_bytes} bytes")
        return off, length


@dataclass(slots=True, frozen=True)
class RemoteBuffers:
    """A peer's registered layer buffers, from its agent info."""

    agent_name: str
    addrs: tuple[int, ...]  # base address of each layer buffer
    device_id: int
    geometry: PageGeometry


@dataclass(slots=True, frozen=True)
class ReadStats:
    num_bytes: int
    num_regions: int
    seconds: float  # the whole READ: descriptors, NIXL prep, transfer, polling
    descriptor_seconds: float = 0.0  # of ``seconds``: building the (merged) descriptor lists in Python
    post_seconds: float = 0.0  # of ``seconds``: NIXL taking the lists and posting the READ (under the agent's lock)


def merge_spans(pairs: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge (local offset, remote offset, length) copies that are adjacent on BOTH sides.

    Sorted by local offset first (a READ's descriptor order does not matter),
    so INT2 pages, which grow downwards, merge too.
    """
    merged: list[tuple[int, int, int]] = []
    for lo, ro, n in sorted(pairs):
        if merged:
            plo, pro, pn = merged[-1]
            if plo + pn == lo and pro + pn == ro:
                merged[-1] = (plo, pro, pn + n)
                continue
        merged.append((lo, ro, n))
    return merged


def page_runs(
    local: PageGeometry, remote: PageGeometry, local_pages: Sequence[int], remote_pages: Sequence[int]
) -> list[tuple[int, int, int]]:
    """(local offset, remote offset, length) per run of pages whose ids follow each other on
    both sides (id + 1, same precision): one span per run instead of per page (a 24K-token
    pull is ~1500 pages and, placed in runs, a handful of spans). Consecutive ids are
    adjacent bytes (INT4 pages upwards, INT2 downwards: the run starts at its last page).
    Each run's first and last page are checked against both buffers, so every page is."""
    out: list[tuple[int, int, int]] = []
    n = len(local_pages)
    i = 0
    while i < n:
        lp, rp = local_pages[i], remote_pages[i]
        j = i + 1
        while j < n and local_pages[j] == local_pages[j - 1] + 1 and remote_pages[j] == remote_pages[j - 1] + 1:
            j += 1
        lo, ln = local.span(lp)
        ro, rn = remote.span(rp)
        if ln != rn:
            raise ValueError(f"local page {lp} has {ln} bytes, remote page {rp} {rn}")
        k = j - i
        if k > 1:
            lo2, ln2 = local.span(local_pages[j - 1])
            ro2, rn2 = remote.span(remote_pages[j - 1])
            if (ln2, rn2) != (ln, ln):
                raise ValueError(f"pages {lp}..{local_pages[j - 1]} / {rp}..{remote_pages[j - 1]} change precision")
            lo, ro = min(lo, lo2), min(ro, ro2)
        out.append((lo, ro, k * ln))
        i = j
    return out


class NixlIO:
    """One NIXL agent over the layer buffers ``buffers`` ([num_layers, total_bytes] uint8)."""

    def __init__(
        self,
        name: str,
        buffers: torch.Tensor,
        *,
        geometry: PageGeometry,
        poll_interval_s: float = 0.002,
    ) -> None:
        if buffers.dtype != torch.uint8 or buffers.dim() != 2 or not buffers.is_contiguous():
            raise ValueError(f"buffers must be a contiguous uint8 [layers, bytes] tensor, got {buffers.dtype} {list(buffers.shape)}")
        api = import_nixl()
        self._api = api
        nixl_log = getattr(api, "logger", None)
        if isinstance(nixl_log, logging.Logger) and "NIXL_LOG_LEVEL" not in os.environ:
            nixl_log.setLevel(logging.WARNING)  # its INFO lines go to stdout; NIXL_LOG_LEVEL overrides
        self.name = name
        self.buffers = buffers
        self.geometry = geometry
        self.mem_type = "VRAM" if buffers.is_cuda else "DRAM"
        self.device_id = buffers.get_device() if buffers.is_cuda else 0
        self.addrs = tuple(int(buffers[layer].data_ptr()) for layer in range(buffers.shape[0]))
        self._lock = threading.RLock()
        applied = ucx_defaults(self.mem_type)  # UCX reads its environment when the agent starts
        if applied:
            log.info("UCX settings for GPU buffers: %s", " ".join(f"{k}={v}" for k, v in applied.items()))
        config = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"])
        self._agent: Any = api.nixl_agent(name, config)
        if "UCX" not in self._agent.backends:
            raise RuntimeError("NIXL has no UCX backend plugin")
        regions = [(addr, int(buffers.shape[1]), self.device_id, "") for addr in self.addrs]
        self._reg = self._agent.register_memory(regions, self.mem_type)
        self._remotes: dict[str, tuple[int, RemoteBuffers]] = {}  # engine id -> (generation, buffers)
        self._stuck: list[tuple[Any, tuple[int, ...]]] = []  # un-cancellable transfers, their local pages
        self._reading: Counter[str] = Counter()  # agent name -> READs from it in flight
        self._poll_interval_s = poll_interval_s
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    # -- metadata ---------------------------------------------------------------------------
    def metadata(self) -> bytes:
        with self._lock:
            return bytes(self._agent.get_agent_metadata())

    def remote(self, engine_id: str, generation: int) -> RemoteBuffers | None:
        """The cached peer for ``engine_id`` at ``generation``, if loaded."""
        cached = self._remotes.get(engine_id)
        return cached[1] if cached is not None and cached[0] == generation else None

    def add_remote(
        self, engine_id: str, generation: int, metadata: bytes, *, addrs: Sequence[int], device_id: int, geometry: PageGeometry
    ) -> RemoteBuffers:
        """Load a peer's metadata (once per engine id and generation)."""
        with self._lock:  # one loader at a time: two pulls may meet a new peer at once
            hit = self.remote(engine_id, generation)
            if hit is not None:
                return hit
            self.forget_remote(engine_id)
            name = self._agent.add_remote_agent(metadata)
            agent_name = name.decode() if isinstance(name, bytes) else str(name)
            peer = RemoteBuffers(agent_name, tuple(int(a) for a in addrs), device_id, geometry)
            self._remotes[engine_id] = (generation, peer)
            return peer

    def forget_remote(self, engine_id: str, *, unless_reading: bool = False) -> bool:
        """Drop a peer's cached metadata (next use loads it fresh); False, and nothing dropped,
        when ``unless_reading`` and a READ from that peer is in flight (dropping would fail it)."""
        with self._lock:
            cached = self._remotes.get(engine_id)
            if cached is None:
                return True
            if unless_reading and self._reading[cached[1].agent_name]:
                return False
            del self._remotes[engine_id]
            try:
                self._agent.remove_remote_agent(cached[1].agent_name)
            except Exception:  # noqa: BLE001 - a dead peer may already be gone from NIXL's view
                pass
            return True

    # -- transfers --------------------------------------------------------------------------
    def descriptors(
        self, peer: RemoteBuffers, local_pages: Sequence[int], remote_pages: Sequence[int]
    ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        """Local and remote (addr, len, dev) lists: one per page per layer, adjacent ones merged."""
        if len(local_pages) != len(remote_pages):
            raise ValueError(f"{len(local_pages)} local pages for {len(remote_pages)} remote pages")
        if len(peer.addrs) != len(self.addrs):
            raise ValueError(f"peer has {len(peer.addrs)} layer buffers, this worker {len(self.addrs)}")
        merged = merge_spans(page_runs(self.geometry, peer.geometry, local_pages, remote_pages))
        local = [(base + lo, n, self.device_id) for base in self.addrs for lo, _, n in merged]
        remote = [(base + ro, n, peer.device_id) for base in peer.addrs for _, ro, n in merged]
        return local, remote

    def read(self, peer: RemoteBuffers, local_pages: Sequence[int], remote_pages: Sequence[int], *, timeout_s: float) -> ReadStats:
        """READ ``remote_pages`` of ``peer`` into ``local_pages`` (all layers); bounded by ``timeout_s``.

        Raises TransferError; then every page in ``local_pages`` is invalid.
        """
        t0 = time.perf_counter()
        local, remote = self.descriptors(peer, local_pages, remote_pages)
        t_desc = time.perf_counter() - t0
        if not local:
            return ReadStats(0, 0, 0.0)
        nbytes = sum(n for _, n, _ in local)
        deadline = time.monotonic() + timeout_s
        handle = None
        with self._lock:
            self._reading[peer.agent_name] += 1
        try:
            t1 = time.perf_counter()
            # building the descriptor lists touches no agent state (thousands of regions take milliseconds):
            # outside the lock, so the progress poller and other READs go on meanwhile
            ldesc = self._agent.get_xfer_descs(local, self.mem_type)
            rdesc = self._agent.get_xfer_descs(remote, self.mem_type)
            with self._lock:
                handle = self._agent.initialize_xfer("READ", ldesc, rdesc, peer.agent_name)
                state = self._agent.transfer(handle)
            t_post = time.perf_counter() - t1
            polls, nap = 0, POLL_SLEEP_FIRST_S
            while state == "PROC":
                if time.monotonic() >= deadline:
                    released = self._abandon(handle, local_pages)
                    handle = None
                    raise TransferError("transfer_timeout", f"READ of {nbytes} bytes not done after {timeout_s:g} s", pages_safe=released)
                polls += 1
                if polls > POLL_SPINS:
                    time.sleep(min(nap, max(0.0, deadline - time.monotonic())))
                    nap = min(2 * nap, POLL_SLEEP_MAX_S)
                with self._lock:
                    state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError("transfer_failed", f"NIXL transfer state {state}")
        except TransferError as exc:
            if handle is not None and not self._abandon(handle, local_pages):
                exc.pages_safe = False
            raise
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own binding errors
            safe = handle is None or self._abandon(handle, local_pages)
            reason = "remote_unreachable" if "DISCONNECT" in str(exc).upper() or "Disconnect" in type(exc).__name__ else "transfer_failed"
            raise TransferError(reason, f"{type(exc).__name__}: {exc}", pages_safe=safe) from exc
        finally:
            with self._lock:
                self._reading[peer.agent_name] -= 1
        with self._lock:
            handle.release()
        return ReadStats(nbytes, len(local), time.perf_counter() - t0, t_desc, t_post)

    def _abandon(self, handle: Any, local_pages: Sequence[int]) -> bool:
        """Release a transfer that did not finish (True); one NIXL cannot cancel is parked in
        ``_stuck`` with its pages (False)."""
        with self._lock:
            try:
                handle.release()
                return True
            except Exception:  # noqa: BLE001 - still in flight: keep its pages out of use
                self._stuck.append((handle, tuple(local_pages)))
                return False

    def reap(self) -> list[int]:
        """Pages of parked transfers that have since ended (the caller may free them now)."""
        freed: list[int] = []
        with self._lock:
            keep = []
            for handle, pages in self._stuck:
                try:
                    state = self._agent.check_xfer_state(handle)
                except Exception:  # noqa: BLE001 - an error ends it too
                    state = "ERR"
                if state == "PROC":
                    keep.append((handle, pages))
                    continue
                try:
                    handle.release()
                except Exception:  # noqa: BLE001
                    keep.append((handle, pages))
                    continue
                freed.extend(pages)
            self._stuck = keep
        return freed

    @property
    def num_stuck(self) -> int:
        return len(self._stuck)

    def reads_in_flight(self, engine_id: str) -> int:
        """READs from the cached peer ``engine_id`` not yet ended (0 for a peer not cached)."""
        with self._lock:
            cached = self._remotes.get(engine_id)
            return self._reading[cached[1].agent_name] if cached is not None else 0

    # -- progress ---------------------------------------------------------------------------
    def progress(self) -> None:
        """Drive the UCX worker once (peers READing from us need it over TCP)."""
        with self._lock:
            self._agent.get_new_notifs()

    def start_progress(self) -> None:
        """Poll every ``poll_interval_s`` on a daemon thread (instead of NIXL's busy progress thread)."""
        if self._poller is not None:
            return
        self._stop.clear()
        self._poller = threading.Thread(target=self._poll_loop, name="kvserving-nixl-progress", daemon=True)
        self._poller.start()

    def _poll_loop(self) -> None:
        while not self._stop.wait(self._poll_interval_s):
            try:
                self.progress()
            except Exception:  # noqa: BLE001 - a dead peer's error must not kill the poller
                pass

    def close(self) -> None:
        """Stop polling, drop peers, deregister the buffers."""
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=2.0)
            self._poller = None
        for engine_id in list(self._remotes):
            self.forget_remote(engine_id)
        with self._lock:
            try:
                self._agent.deregister_memory(self._reg)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
