"""`kvserving gateway` as a process: it starts from the ConfigMap the operator
renders, and its command-line overrides."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from fake_worker import free_port

from kvserving.gateway.main import add_arguments, load_config

REPO = Path(__file__).resolve().parents[2]


def rendered_config(tmp_path: Path) -> Path:
    out = subprocess.run(
        [sys.executable, "-m", "kvserving.cli", "operator", "--render", str(REPO / "manifests/samples/nvfp4.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONSAFEPATH="1"),
        check=True,
    ).stdout
    (cm,) = [o for o in yaml.safe_load_all(out) if o and o["kind"] == "ConfigMap" and "config.json" in o.get("data", {})]
    data = json.loads(cm["data"]["config.json"])
    # The pod reads the credential from the operator's Secret mount; here a file stands in for it.
    assert data["security"]["internal_token_file"] == "/var/run/kvserving/internal/token"
    token = tmp_path / "internal-token"
    token.write_text("rendered-config-test-token\n")
    data["security"]["internal_token_file"] = str(token)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


def test_gateway_starts_from_the_operators_configmap(tmp_path: Path, tiny_model_dir: Path) -> None:
    cfg = rendered_config(tmp_path)
    data = json.loads(cfg.read_text())
    assert data["gateway"]["decode_service"].endswith(".svc")
    port = free_port()
    log = tmp_path / "gateway.log"
    # --model: the sample's /models path exists only in the pod (the operator mounts the model PVC there)
    argv = [
        sys.executable,
        "-m",
        "kvserving.cli",
        "gateway",
        "--config",
        str(cfg),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        str(tiny_model_dir),
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONSAFEPATH="1"), start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                health = httpx.get(url + "/health", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        assert health.status_code == 200
        # the headless Services do not resolve here: alive, not ready, refusing with 503
        assert httpx.get(url + "/ready", timeout=5).status_code == 503
        assert httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"] == data["model"]["served_name"]
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"model": data["model"]["served_name"], "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
    # one startup line: the model, the workers, the config source
    (start,) = [line for line in log.read_text().splitlines() if "kvserving.gateway.main: kvserving gateway on" in line]
    assert (
        f"http://127.0.0.1:{port}: model {data['model']['served_name']} ({tiny_model_dir}, context " in start
        and f"workers: prefill service {data['gateway']['prefill_service']}:" in start
        and f"decode service {data['gateway']['decode_service']}:" in start
        and f"config {cfg};" in start
    ), start
    # one access-log line per API request, none for the probes at info
    access = [
        line.split("kvserving.gateway.access: ", 1)[1] for line in log.read_text().splitlines() if "kvserving.gateway.access: " in line
    ]
    assert [a.rsplit(" ms=", 1)[0] for a in access] == [
        "GET /v1/models 200 conv=- prompt=- cached=- computed=- ttft_ms=-",
        "POST /v1/chat/completions 503 conv=- prompt=- cached=- computed=- ttft_ms=-",
    ], access


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_static_urls_replace_the_services_and_model_replaces_the_path(tmp_path: Path) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(
        json.dumps({"gateway": {"prefill_service": "p.svc", "decode_service": "d.svc", "api_keys": ["k"]}, "model": {"path": "/models/x"}})
    )
    config = load_config(parse("--config", str(cfg), "--prefill", "http://a:1", "--decode", "http://b:2", "http://c:3", "--model", "/m"))
    gw = config.gateway
    assert (gw.prefill_urls, gw.decode_urls, gw.prefill_service, gw.decode_service) == (
        ("http://a:1",),
        ("http://b:2", "http://c:3"),
        None,
        None,
    )
    assert gw.api_keys == ("k",) and config.model.path == "/m"
    kept = load_config(parse("--config", str(cfg)))
    assert (kept.gateway.decode_service, kept.model.path) == ("d.svc", "/models/x")


def test_no_worker_at_all_is_a_one_line_error(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvserving.cli", "gateway", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONSAFEPATH="1"),
    )
    assert (out.returncode, out.stderr) == (
        1,
        "kvserving gateway: error: no workers: give --decode URL (and --prefill URL) or gateway.decode_service\n",
    )


@pytest.mark.parametrize("bad", [{"gateway": {"max_body_bytes": 0}}, {"gateway": {"health_interval_s": -1}}])
def test_bad_gateway_settings_are_refused_naming_the_field(tmp_path: Path, bad: dict) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(bad))
    field = next(iter(bad["gateway"]))
    with pytest.raises(ValueError, match=f"gateway.{field}"):
        load_config(parse("--config", str(cfg)))


def test_api_keys_from_the_environment_replace_the_configs(tmp_path: Path) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"gateway": {"api_keys": ["in-configmap"]}}))
    env = {"KVSERVING_GATEWAY_API_KEYS": "sk-a, sk-b,"}
    assert load_config(parse("--config", str(cfg)), environ=env).gateway.api_keys == ("sk-a", "sk-b")
    assert load_config(parse("--config", str(cfg)), environ={}).gateway.api_keys == ("in-configmap",)


def test_api_keys_file_adds_its_keys_and_an_unreadable_or_empty_one_is_a_one_line_error(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-file-1\n\n  sk-file-2  \n")
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"gateway": {"api_keys": ["in-configmap"]}, "security": {"api_keys_file": str(keys)}}))
    assert load_config(parse("--config", str(cfg)), environ={}).gateway.api_keys == ("in-configmap", "sk-file-1", "sk-file-2")
    env = {"KVSERVING_GATEWAY_API_KEYS": "sk-env"}
    assert load_config(parse("--config", str(cfg)), environ=env).gateway.api_keys == ("sk-env", "sk-file-1", "sk-file-2")
    keys.write_text("\n \n")
    with pytest.raises(ValueError, match=f"^security.api_keys_file {keys} holds no keys$"):
        load_config(parse("--config", str(cfg)), environ={})
    keys.unlink()
    out = subprocess.run(
        [sys.executable, "-m", "kvserving.cli", "gateway", "--config", str(cfg), "--decode", "http://a:1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONSAFEPATH="1"),
    )
    assert out.returncode == 1
    assert out.stderr.strip() == f"kvserving gateway: error: security.api_keys_file {keys}: cannot read: No such file or directory"


def gateway_cli(*argv: str, config: Path | None = None) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "kvserving.cli", "gateway", *(("--config", str(config)) if config else ()), *argv]
    return subprocess.run(args, capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONSAFEPATH="1"))


def test_port_and_worker_urls_are_checked_with_one_line(tmp_path: Path) -> None:
    out = gateway_cli("--port", "70000", "--decode", "http://a:1")
    assert (out.returncode, out.stderr.strip()) == (
        2,
        "kvserving gateway: error: argument --port: must be an integer in 0..65535, got 70000 (see kvserving gateway --help)",
    )
    out = gateway_cli("--prefill", "notaurl", "--decode", "http://a:1")
    assert (out.returncode, out.stderr.strip()) == (
        1,
        "kvserving gateway: error: --prefill: 'notaurl' is not a worker URL; give http://HOST:PORT",
    )
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"gateway": {"decode_urls": ["http://d:8000", "https://d:99999/x"]}}))
    out = gateway_cli(config=cfg)
    assert (out.returncode, out.stderr.strip()) == (
        1,
        "kvserving gateway: error: gateway.decode_urls: 'https://d:99999/x' is not a worker URL; give http://HOST:PORT",
    )
    for good in ("http://10.0.0.1:8000", "http://[::1]:8000/", "http://decode-0.svc"):
        load_config(parse("--decode", good))


def test_without_the_workers_credential_the_gateway_refuses_to_start(tmp_path: Path) -> None:
    out = gateway_cli("--decode", "http://127.0.0.1:1")
    assert (out.returncode, out.stderr.strip()) == (
        1,
        "kvserving gateway: error: security.internal_token_file is not set: workers serve /internal/* only to callers "
        "with the deployment's credential (kvserving up and the operator provide one)",
    )
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"security": {"internal_token_file": str(tmp_path / "missing")}}))
    out = gateway_cli("--decode", "http://127.0.0.1:1", config=cfg)
    assert (out.returncode, out.stderr.strip()) == (
        1,
        f"kvserving gateway: error: security.internal_token_file {tmp_path / 'missing'}: cannot read it (No such file or directory)",
    )
