"""A prefill and a decode worker in one process, wired to each other by direct calls
instead of HTTP (agent info, lease checks, renewals, releases); NIXL still moves the KV
between their own agents. For CPU benchmarks of the transfer path (bench/reuse_cpu.py,
bench/regions_cpu.py, bench/age_down_cpu.py)."""

from __future__ import annotations

from typing import Any

from kvserving.worker.engine import LLMEngine
from kvserving.worker.kv_transfer import KVTransfer


class LocalPair:
    """``p`` (role prefill) and ``d`` (role decode), each a ``KVTransfer`` over its own engine."""

    def __init__(self, prefill: LLMEngine, decode: LLMEngine, *, name: str) -> None:
        self.workers: dict[str, KVTransfer] = {}
        for role, eng in (("prefill", prefill), ("decode", decode)):
            url = f"local://{name}-{role}"
            self.workers[url] = KVTransfer(
                eng, eng.config.reuse, engine_id=f"{name}-{role}", agent_url=url, role=role,
                fetch_agent_info=lambda u: self.workers[u].agent_info(), fetch_lease=self._lease,
                renew_remote=self._renew, release_remote=lambda u, lid: self.workers[u].release(lid),
            )
        self.p, self.d = self.workers[f"local://{name}-prefill"], self.workers[f"local://{name}-decode"]

    def _lease(self, url: str, lease_id: str) -> dict[str, Any] | None:
        """What ``GET /internal/kv/leases`` would say of ``lease_id``: its params, or None."""
        return next((le["kv_transfer_params"] for le in self.workers[url].leases() if le["lease_id"] == lease_id), None)

    def _renew(self, url: str, lease_id: str) -> float | None:
        """The new expiry, or None where the HTTP API answers 404 (lease unknown)."""
        try:
            return self.workers[url].renew(lease_id)
        except KeyError:
            return None

    def close(self) -> None:
        for w in self.workers.values():
            w.close()


def flush_prefix_cache(kvt: KVTransfer) -> None:
    """Drop the worker's leases (a prefill worker's transfer holds: as if they had expired) and
    evict every cached page (allocating all free pages takes the LRU ones too), so the worker
    keeps nothing of earlier conversations."""
    for lease in kvt.leases():
        kvt.release(lease["lease_id"])
    pool = kvt.engine.pool
    pages = pool.allocate([4] * pool.num_free_pages(bits=4))
    if pages is None or pool.num_cached != 0:
        raise RuntimeError("flush_prefix_cache: the pool kept cached pages")
    pool.free(pages)
