"""`kvserving worker` starts from what the operator renders: each sample's
worker Deployment args parse with the subcommand's own parser, its ConfigMap
JSON loads, and a worker of that role serves a request with that config.
Plus the command's one-line start-up errors."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from live_worker import start_live, stop_live
from kvserving.config import ServingConfig
from kvserving.operator.render import CONFIG_FILE, Owner, render
from kvserving.worker.main import add_arguments, advertise_url, resolve_model

SAMPLES = sorted((Path(__file__).resolve().parents[2] / "manifests" / "samples").glob("*.yaml"))


def rendered(sample: Path) -> tuple[dict[str, list[str]], str]:
    """(role -> the worker container's args, the ConfigMap's engine config JSON)."""
    body = yaml.safe_load(sample.read_text())
    name = body["metadata"]["name"]
    objects = render(body["spec"], owner=Owner(name=name, namespace="default", uid="uid-1")).objects
    (cm,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == f"{name}-config"]
    args = {}
    for o in objects:
        if o["kind"] == "Deployment":
            (container,) = o["spec"]["template"]["spec"]["containers"]
            if container["args"][0] == "worker":
                args[o["metadata"]["name"].rsplit("-", 1)[1]] = container["args"]
    return args, cm["data"][CONFIG_FILE]


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.stem)
def test_each_sample_renders_worker_args_that_start_a_worker(
    sample: Path, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args, config_json = rendered(sample)
    assert sorted(args) == ["decode", "prefill"]
    cfg_path = tmp_path / "engine.json"
    cfg_path.write_text(config_json)
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    for role, argv in args.items():
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        ns = parser.parse_args(argv[1:])
        assert (ns.role, ns.host, ns.port) == (role, "0.0.0.0", 8000)
        assert advertise_url(ns.host, ns.port, ns.advertise_url) == "http://10.1.2.3:8000"
        # the sample's model lives on a volume in the cluster; here the tiny model stands in
        config = resolve_model(ServingConfig.load(cfg_path), tiny_model_dir)
        config = dataclasses.replace(config, kv_cache=dataclasses.replace(config.kv_cache, memory_bytes=4 << 20))
        if role == "decode":
            continue  # the decode role serves from the same config in tests/worker/test_server.py and e2e/
        live = start_live(config, role=role)
        try:
            prompt = list(range(100, 100 + 2 * config.kv_cache.effective_page_size + 3))
            body = {"request_id": "r", "input_ids": prompt, "sampling": {"max_tokens": 1}}
            r = httpx.post(live.url + "/internal/generate", json=body, headers=live.headers, timeout=60)
            assert r.status_code == 200
            final = [line for line in r.text.splitlines() if "finish_reason" in line]
            params = httpx.Response(200, content=final[0].removeprefix("data: ")).json()["kv_transfer_params"]
            # a prefill worker holds the prompt's full pages for the decode worker
            assert params["lease_id"].startswith("xfer-")
            assert params["num_tokens"] == 2 * config.kv_cache.effective_page_size
            assert params["dtype"] == config.kv_cache.dtype
        finally:
            stop_live(live)


def run_worker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvserving.cli", "worker", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin"},
    )


def test_startup_errors_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"kv_cache": {"dtype": "int3"}}')
    r = run_worker("--role", "decode", "--config", str(bad))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "kvserving worker: error: kv_cache.dtype must be one of ('bf16', 'fp8_e4m3', 'nvfp4', 'triaxial'), got 'int3'"
    ]
    r = run_worker("--role", "decode")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "kvserving worker: error: security.internal_token_file is not set: a worker serves /internal/* only to "
        "callers with the deployment's credential (kvserving up and the operator provide one)"
    ]
    for token, says in (("", "the file is empty"), (None, "cannot read it (No such file or directory)")):
        token_file = tmp_path / f"token-{says[:5]}"
        if token is not None:
            token_file.write_text(token + "\n")
        cfg = tmp_path / f"cfg-{says[:5]}.json"
        cfg.write_text(json.dumps({"security": {"internal_token_file": str(token_file)}}))
        r = run_worker("--role", "decode", "--config", str(cfg))
        assert r.returncode == 1 and r.stderr.strip().splitlines() == [
            f"kvserving worker: error: security.internal_token_file {token_file}: {says}"
        ], r.stderr
    (tmp_path / "token").write_text("s3cret\n")
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"security": {"internal_token_file": str(tmp_path / "token")}}))
    r = run_worker("--role", "decode", "--config", str(cfg), "--model", str(tmp_path / "nope"))
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    assert "does not exist" in r.stderr
    r = run_worker("--role", "router")
    assert r.returncode == 2 and "invalid choice: 'router'" in r.stderr
