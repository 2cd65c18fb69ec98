"""The deployment's worker set (worker/peers.py): which URLs a worker may contact."""

from __future__ import annotations

from kvserving.config import GatewayConfig
from kvserving.worker.peers import PeerSet, url_key


def test_urls_compare_by_scheme_host_and_port() -> None:
    assert url_key("http://10.0.0.1:8000/x") == ("http", "10.0.0.1", 8000)
    assert url_key("HTTP://Worker-0.Svc.:8000") == ("http", "worker-0.svc", 8000)
    assert url_key("http://[fd00:0::5]:8000") == ("http", "fd00::5", 8000)
    assert url_key("http://a") == ("http", "a", 80)
    for bad in ("", "10.0.0.1:8000", "http://:80", "http://a:99999", "http://[::1"):
        assert url_key(bad) is None, bad


def test_static_lists_name_the_peers_and_nothing_else() -> None:
    peers = PeerSet.from_config(GatewayConfig(prefill_urls=("http://10.0.0.1:8000",), decode_urls=("http://10.0.0.2:8000/",)))
    assert peers.allows("http://10.0.0.1:8000") and peers.allows("http://10.0.0.2:8000/internal/kv/agent")
    for other in (
        "http://10.0.0.1:8001",
        "http://10.0.0.3:8000",
        "https://10.0.0.1:8000",
        "http://169.254.169.254",
        "file:///etc/passwd",
        "not a url",
    ):
        assert not peers.allows(other), other
    assert not PeerSet().allows("http://127.0.0.1:8000")  # no config: nobody


def test_services_resolve_to_pod_addresses_on_the_worker_port_and_re_resolve_a_miss_at_most_every_refresh() -> None:
    answers = {"pre.svc": ["10.0.0.1"], "dec.svc": ["10.0.0.2", "fd00::7"]}
    lookups: list[tuple[str, int]] = []
    now = [0.0]

    def resolve(host: str, port: int) -> list[str]:
        lookups.append((host, port))
        if host not in answers:
            raise OSError("NXDOMAIN")
        return list(answers[host])

    cfg = GatewayConfig(prefill_service="pre.svc", decode_service="dec.svc", worker_port=8123)
    peers = PeerSet(services=["pre.svc", "dec.svc"], port=cfg.worker_port, refresh_s=5.0, resolve=resolve, clock=lambda: now[0])
    assert peers.allows("http://10.0.0.2:8123") and peers.allows("http://[fd00::7]:8123")
    assert lookups == [("pre.svc", 8123), ("dec.svc", 8123)]
    assert not peers.allows("http://10.0.0.2:8000")  # another port: not a worker
    assert not peers.allows("http://10.0.0.9:8123")  # unknown: no new lookup within refresh_s
    assert len(lookups) == 2
    answers["dec.svc"].append("10.0.0.9")  # a pod started
    now[0] = 5.0
    assert peers.allows("http://10.0.0.9:8123")  # a miss after refresh_s looks again
    assert len(lookups) == 4
    assert peers.allows("http://10.0.0.1:8123") and len(lookups) == 4  # known: no lookup
    del answers["pre.svc"]  # DNS down for one Service: what was known stays known
    now[0] = 11.0
    assert not peers.allows("http://10.0.0.50:8123")
    assert peers.allows("http://10.0.0.1:8123")


def test_from_config_adds_extra_urls() -> None:
    peers = PeerSet.from_config(GatewayConfig(prefill_urls=("http://p:8000",)), extra=["http://me:8000"])
    assert peers.allows("http://p:8000") and peers.allows("http://me:8000")
    assert not peers.allows("http://q:8000")
