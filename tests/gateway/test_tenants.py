"""Tenants (tenants.py): API key, else cache_salt, else the default tenant; ids are
keyed digests that never carry the key or the salt; conversation keys are scoped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvserving.config import SecurityConfig
from kvserving.gateway.tenants import DEFAULT_TENANT, Tenant, Tenants


def test_the_key_decides_when_keys_are_configured_and_a_salt_splits_a_key() -> None:
    tenants = Tenants(keyed=True, share=False)
    a = tenants.of(authorization="Bearer sk-alice", cache_salt=None)
    assert re.fullmatch(r"[0-9a-f]{32}", a.id) and a.cache_salt == a.id
    assert tenants.of(authorization="Bearer sk-alice", cache_salt=None) == a
    assert tenants.of(authorization="Bearer sk-bob", cache_salt=None) != a
    salted = tenants.of(authorization="Bearer sk-alice", cache_salt="s1")
    assert salted not in (a, tenants.of(authorization="Bearer sk-bob", cache_salt="s1"))
    # a salt alone (no key) is another tenant than a key with the same text
    assert Tenants(keyed=False, share=False).of(authorization=None, cache_salt="sk-alice") != a


def test_without_keys_the_salt_decides_else_the_default_tenant() -> None:
    tenants = Tenants(keyed=False, share=False)
    assert tenants.of(authorization=None, cache_salt=None) is DEFAULT_TENANT
    assert tenants.of(authorization="Bearer whatever", cache_salt=None) is DEFAULT_TENANT  # unchecked: no tenant
    assert DEFAULT_TENANT.cache_salt is None
    s1 = tenants.of(authorization=None, cache_salt="s1")
    assert s1 == tenants.of(authorization="Bearer x", cache_salt="s1") and s1 != tenants.of(authorization=None, cache_salt="s2")
    assert "s1" not in s1.id


def test_sharing_makes_every_request_the_default_tenant() -> None:
    tenants = Tenants(keyed=True, share=True)
    assert tenants.of(authorization="Bearer sk-alice", cache_salt="s1") is DEFAULT_TENANT


def test_ids_are_keyed_by_the_internal_credential(tmp_path: Path) -> None:
    # as build_state keys them: with the credential the workers check (SecurityConfig.read_internal_token)
    token = tmp_path / "token"
    token.write_text("deployment-secret\n")
    secret = SecurityConfig(internal_token_file=str(token)).read_internal_token()
    assert secret == "deployment-secret"
    keyed = Tenants(keyed=True, share=False, secret=secret.encode())
    plain = Tenants(keyed=True, share=False)
    same = Tenants(keyed=True, share=False, secret=b"deployment-secret")  # another replica of the deployment
    ask = {"authorization": "Bearer sk-alice", "cache_salt": None}
    assert keyed.of(**ask) == same.of(**ask) != plain.of(**ask)
    with pytest.raises(ValueError, match=f"^security.internal_token_file {tmp_path / 'missing'}: cannot read it "):
        SecurityConfig(internal_token_file=str(tmp_path / "missing")).read_internal_token()
    token.write_text("\n")
    with pytest.raises(ValueError, match="is empty$"):
        SecurityConfig(internal_token_file=str(token)).read_internal_token()


def test_scoped_keys_are_digests_of_tenant_and_key() -> None:
    a, b = Tenant("a" * 32), Tenant("b" * 32)
    assert a.scope("user:alice@example.com") == a.scope("user:alice@example.com")
    assert a.scope("user:alice@example.com") != b.scope("user:alice@example.com") != DEFAULT_TENANT.scope("user:alice@example.com")
    assert re.fullmatch(r"conv-[0-9a-f]{32}", a.scope("user:alice@example.com"))
