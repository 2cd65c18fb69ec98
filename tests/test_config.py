"""The engine-config schema checks itself and round-trips through JSON."""

import json

import pytest

from kvserving.config import GatewayConfig, KVCacheConfig, ReuseConfig, SchedulerConfig, ServingConfig


def test_round_trip_is_exact() -> None:
    cfg = ServingConfig(kv_cache=KVCacheConfig(dtype="triaxial", bit_budget=2.7))
    again = ServingConfig.from_json(cfg.to_json())
    assert again == cfg
    assert again.kv_cache.effective_page_size == 32
    assert json.loads(cfg.to_json())["reuse"]["retention_ttl_s"] == 480.0


def test_defaults_follow_design() -> None:
    cfg = ServingConfig()
    assert cfg.reuse.retention_ttl_s == 480.0
    assert cfg.reuse.recompute_threshold_tokens == 64
    assert cfg.reuse.lease_ttl_s < cfg.reuse.retention_ttl_s
    assert KVCacheConfig(dtype="nvfp4").effective_page_size == 16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "int3"}, "kv_cache.dtype"),
        ({"dtype": "nvfp4", "bit_budget": 3.0}, "bit_budget is only valid"),
        ({"dtype": "triaxial", "bit_budget": 4.5}, r"bit_budget must be in \[2, 4\]"),
        ({"dtype": "triaxial", "page_size": 16}, "must be 32 for triaxial"),
        ({"page_size": 24}, "power of two"),
        ({"memory_fraction": 0.0}, "memory_fraction"),
        ({"dtype": "triaxial", "global_scale": "calibrated"}, "needs dtype fp8_e4m3 or nvfp4"),
    ],
)
def test_bad_kv_cache_is_refused_by_name(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVCacheConfig(**kwargs)


def test_bad_reuse_and_scheduler_are_refused() -> None:
    with pytest.raises(ValueError, match="lease_ttl_s"):
        ReuseConfig(retention_ttl_s=100, lease_ttl_s=100)
    with pytest.raises(ValueError, match="retention_ttl_s"):
        ReuseConfig(retention_ttl_s=0)
    with pytest.raises(ValueError, match="scheduler.chunk_size"):
        SchedulerConfig(chunk_size=0)


@pytest.mark.parametrize("name", ["max_conversations", "max_kept_tokens", "max_leases"])
def test_gateway_memory_bounds_are_positive(name: str) -> None:
    with pytest.raises(ValueError, match=f"gateway.{name} must be >= 1, got 0"):
        GatewayConfig(**{name: 0})


def test_unknown_keys_are_errors() -> None:
    with pytest.raises(ValueError, match="unknown sections"):
        ServingConfig.from_dict({"kvcache": {}})
    with pytest.raises(ValueError, match="unknown keys"):
        ServingConfig.from_dict({"kv_cache": {"dtyp": "bf16"}})
    with pytest.raises(ValueError, match="not valid JSON"):
        ServingConfig.from_json("{")


def test_security_section_round_trips_and_names_bad_fields() -> None:
    from kvserving.config import SecurityConfig

    cfg = ServingConfig.from_dict({"security": {"internal_token_file": "/var/run/kvserving/internal/token", "max_hold_s": 30}})
    assert cfg.security == SecurityConfig(internal_token_file="/var/run/kvserving/internal/token", max_hold_s=30)
    assert ServingConfig.from_json(cfg.to_json()) == cfg
    assert ServingConfig().security.internal_token_file is None
    for bad, field_name in (
        ({"internal_token_file": ""}, "internal_token_file"),
        ({"api_keys_file": 3}, "api_keys_file"),
        ({"tenants_share_cache": "yes"}, "tenants_share_cache"),
        ({"max_hold_s": 0}, "max_hold_s"),
    ):
        with pytest.raises(ValueError, match=f"security.{field_name}"):
            ServingConfig.from_dict({"security": bad})


def test_gateway_deadlines_are_refused_by_name() -> None:
    from kvserving.config import STREAM_KEEPALIVE_S

    with pytest.raises(ValueError, match="gateway.first_byte_timeout_s must be > 0, got 0"):
        GatewayConfig(first_byte_timeout_s=0)
    with pytest.raises(ValueError, match=r"gateway.event_timeout_s must be >= 2 \(workers send a keep-alive every 1 s\), got 1.5"):
        GatewayConfig(event_timeout_s=1.5)
    assert GatewayConfig(event_timeout_s=2 * STREAM_KEEPALIVE_S).event_timeout_s == 2.0
    with pytest.raises(ValueError, match="gateway.drain_grace_s must be >= 0, got -1"):
        GatewayConfig(drain_grace_s=-1)
    assert GatewayConfig(drain_grace_s=0).drain_grace_s == 0
    # a worker opens a generate's response before its KV pull: the header deadline does not
    # depend on the pull's (reuse.transfer_timeout_s)
    ok = ServingConfig(reuse=ReuseConfig(transfer_timeout_s=30.0), gateway=GatewayConfig(first_byte_timeout_s=3.0))
    assert ServingConfig.from_json(ok.to_json()) == ok


def test_peer_timeout_is_a_reuse_field_refused_by_name() -> None:
    assert ReuseConfig().peer_timeout_s == 1.0
    cfg = ServingConfig.from_dict({"reuse": {"peer_timeout_s": 0.25}})
    assert cfg.reuse.peer_timeout_s == 0.25 and ServingConfig.from_json(cfg.to_json()) == cfg
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match=f"reuse.peer_timeout_s must be > 0, got {bad}"):
            ReuseConfig(peer_timeout_s=bad)
