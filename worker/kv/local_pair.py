"""A prefill and a decode worker in one process, wired to each other by direct calls
instead of HTTP (agent info, holds, releases); NIXL still moves the KV
between their own agents. For CPU benchmarks of the transfer path (bench/reuse_cpu.py,
bench/regions_cpu.py, bench/age_down_cpu.py)."""

from __future__ import annotations

from typing import Any

from kvserving.worker.engine import LLMEngine
from kvserving.worker.kv.leases import LeaseMismatchError
from kvserving.worker.kv.transfer import KVTransfer
from kvserving.worker.peers import PeerSet


class LocalPair:
    """``p`` (role prefill) and ``d`` (role decode), each a ``KVTransfer`` over its own engine."""

    def __init__(self, prefill: LLMEngine, decode: LLMEngine, *, name: str) -> None:
        self.workers: dict[str, KVTransfer] = {}
        urls = {role: f"local://{name}-{role}" for role in ("prefill", "decode")}
        for role, eng in (("prefill", prefill), ("decode", decode)):
            url = urls[role]
            self.workers[url] = KVTransfer(
                eng,
                eng.config.reuse,
                engine_id=f"{name}-{role}",
                agent_url=url,
                role=role,
                fetch_agent_info=lambda u: self.workers[u].agent_info(),
                hold_remote=self._hold,
                release_remote=self._release,
                peers=PeerSet(urls.values()),
            )
        self.p, self.d = self.workers[f"local://{name}-prefill"], self.workers[f"local://{name}-decode"]

    def _hold(self, url: str, lease_id: str, digest: str, hold_s: float, consume: bool, wait_s: float) -> dict[str, Any]:
        """What ``POST .../hold`` answers (``PeerHttp.hold``): the hold, or why it was refused (in process: no wait)."""
        try:
            return self.workers[url].hold(lease_id, digest=digest, hold_s=hold_s, consume=consume)
        except KeyError:
            return {"refused": "unknown_lease"}
        except LeaseMismatchError:
            return {"refused": "lease_mismatch"}

    def _release(self, url: str, lease_id: str) -> None:
        """``DELETE .../leases/{id}``; an unknown one is the HTTP API's 404, not an error here."""
        try:
            self.workers[url].release(lease_id)
        except KeyError:
            pass

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
