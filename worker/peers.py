"""The deployment's own workers: the only places a worker connects to (DESIGN.md,
Security). A URL a request carries (``kv_transfer_params.agent_url``) is
contacted only when it names one of them; nothing in a request body chooses
where a worker connects.

The set comes from the engine config's worker list, the one the gateway routes
by: ``gateway.prefill_urls`` / ``decode_urls`` (local mode) and the headless
Services ``gateway.prefill_service`` / ``decode_service`` resolved to pod
addresses on ``gateway.worker_port`` (cluster mode). A URL that is not known is
looked up again by re-resolving the Services, at most once every
``refresh_s`` (a pod that started since the last lookup), never more often, so
a stream of unknown URLs costs a DNS lookup every few seconds, not one each.

URLs are compared by (scheme, host, port): host names lower-cased, IP
addresses in their canonical form, the port defaulting to the scheme's.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from kvserving.config import GatewayConfig

REFRESH_S = 5.0
Key = tuple[str, str, int]


def url_key(url: str) -> Key | None:
    """(scheme, host, port) of ``url``; None when it has no host or a bad port."""
    try:
        parts = urlsplit(url.strip())
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if not host or not parts.scheme:
        return None
    try:
        host = ipaddress.ip_address(host).compressed
    except ValueError:
        host = host.lower().rstrip(".")
    return parts.scheme.lower(), host, port if port is not None else (443 if parts.scheme == "https" else 80)


def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address of ``host`` (a headless Service: one per ready pod)."""
    return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)})


class PeerSet:
    """Which URLs are this deployment's workers (see the module docstring). Thread-safe."""

    def __init__(
        self,
        urls: Iterable[str] = (),
        *,
        services: Iterable[str] = (),
        port: int = 8000,
        refresh_s: float = REFRESH_S,
        resolve: Callable[[str, int], list[str]] = resolve_addresses,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._static = {k for k in map(url_key, urls) if k is not None}
        self._services = tuple(s for s in services if s)
        self._port = port
        self._refresh_s = refresh_s
        self._resolve = resolve
        self._clock = clock
        self._resolved: set[Key] = set()
        self._resolved_at = float("-inf")
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, gateway: GatewayConfig, *, extra: Iterable[str] = ()) -> PeerSet:
        """The workers the engine config names (``extra``: more URLs, e.g. this worker's own)."""
        return cls(
            [*gateway.prefill_urls, *gateway.decode_urls, *extra],
            services=[s for s in (gateway.prefill_service, gateway.decode_service) if s],
            port=gateway.worker_port,
        )

    def allows(self, url: str) -> bool:
        """Whether ``url`` is one of the deployment's workers (a miss may re-resolve the Services)."""
        key = url_key(url)
        if key is None:
            return False
        if key in self._static or key in self._resolved:
            return True
        if not self._services:
            return False
        with self._lock:
            now = self._clock()
            if key not in self._resolved and now - self._resolved_at >= self._refresh_s:
                self._resolved_at = now
                self._resolved = self._lookup()
            return key in self._resolved

    def _lookup(self) -> set[Key]:
        found: set[Key] = set()
        for host in self._services:
            try:
                addresses = self._resolve(host, self._port)
            except OSError:  # no ready pod yet (NXDOMAIN), or DNS down: keep what was known
                found |= self._resolved
                continue
            found |= {k for a in addresses if (k := url_key(_url(a, self._port))) is not None}
        return found


def _url(address: str, port: int) -> str:
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"
