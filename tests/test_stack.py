"""The local stack's supervision: readiness, a dying child, port clashes, no orphans.

The children here are tiny HTTP servers (real processes) so the rules are tested
without loading a model; e2e/ starts the real gateway and workers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from kvs_poll import wait_until

import pytest

from kvserving.config import ServingConfig
from kvserving.local.stack import Child, LocalStack, StackError, StackSpec, free_ports, group_alive, group_members, scrape_config

# A server that answers 200 on /ready after `delay` seconds and starts a
# grandchild (sleep) in its own process group, to prove groups are stopped.
READY_SERVER = r"""
import http.server, subprocess, sys, time
port, delay = int(sys.argv[1]), float(sys.argv[2])
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
start = time.monotonic()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path == "/ready" and time.monotonic() - start >= delay
        self.send_response(200 if ok else 503); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


class FakeStack(LocalStack):
    def __init__(self, spec: StackSpec, script: Path, delays: dict[str, float]) -> None:
        super().__init__(spec)
        self.script, self.delays = script, delays

    def _plan(self) -> list[Child]:
        ports = {"prefill": self.spec.prefill_port, "decode": self.spec.decode_port, "gateway": self.spec.gateway_port}
        return [
            Child(
                name,
                [sys.executable, str(self.script), str(port), str(self.delays.get(name, 0.0))],
                f"http://127.0.0.1:{port}/ready",
                self.run_dir / f"{name}.log",
            )
            for name, port in ports.items()
        ]


def _spec(tmp_path: Path) -> StackSpec:
    g, p, d = free_ports(3)
    return StackSpec(config=ServingConfig(), gateway_port=g, prefill_port=p, decode_port=d, run_dir=tmp_path / "run")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_stack_waits_for_every_ready_and_stops_whole_process_groups(tmp_path: Path) -> None:
    script = tmp_path / "ready.py"
    script.write_text(READY_SERVER)
    stack = FakeStack(_spec(tmp_path), script, {"decode": 1.0})
    try:
        stack.start()
        t0 = time.monotonic()
        stack.wait_ready(timeout_s=30)
        assert time.monotonic() - t0 >= 1.0  # decode answered 503 for its first second
        assert stack.check() is None
        pgids = [c.proc.pid for c in stack.children if c.proc is not None]
        wait_until(lambda: all(len(group_members(g)) == 2 for g in pgids), what="each server's grandchild in its group")
    finally:
        stack.close()
    assert all(group_members(g) == [] for g in pgids)


def test_a_child_that_dies_is_reported_with_its_log(tmp_path: Path) -> None:
    script = tmp_path / "ready.py"
    script.write_text(READY_SERVER)
    stack = FakeStack(_spec(tmp_path), script, {})
    with stack:
        stack.start()
        stack.wait_ready(timeout_s=30)
        victim = stack.children[1]
        assert victim.proc is not None
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(timeout=10)
        dead = stack.check()
        assert dead is victim
        assert stack.describe_death(dead).startswith("decode exited with code -9")
    assert stack.children == []


def test_a_child_that_exits_during_start_fails_the_start(tmp_path: Path) -> None:
    script = tmp_path / "crash.py"
    script.write_text("import sys\nprint('model directory /nope does not exist')\nsys.exit(3)\n")
    stack = FakeStack(_spec(tmp_path), script, {})
    with stack, pytest.raises(StackError, match=r"exited with code 3 \(log: \S+\.log\)\nits last lines:\n[\s\S]*model directory /nope"):
        stack.start()
        stack.wait_ready(timeout_s=30)


def test_a_busy_port_is_refused_in_one_line(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", spec.decode_port))
        busy.listen()
        stack = LocalStack(spec)
        with stack, pytest.raises(StackError) as info:
            stack.start()
    assert str(info.value) == f"already in use on 127.0.0.1: decode port {spec.decode_port} (choose other ports with --port)"
    assert stack.children == []


def test_engine_config_points_the_gateway_at_the_local_workers(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    cfg = LocalStack(spec).engine_config()
    assert cfg.gateway.prefill_urls == (f"http://127.0.0.1:{spec.prefill_port}",)
    assert cfg.gateway.decode_urls == (f"http://127.0.0.1:{spec.decode_port}",)
    single = StackSpec(config=ServingConfig(), gateway_port=spec.gateway_port, prefill_port=spec.prefill_port, single=True)
    cfg1 = LocalStack(single).engine_config()
    assert cfg1.gateway.prefill_urls == cfg1.gateway.decode_urls == (f"http://127.0.0.1:{spec.prefill_port}",)
    assert ServingConfig.from_json(cfg.to_json()) == cfg  # what the children read


def test_every_stack_writes_its_own_private_internal_token_and_every_part_is_given_it(tmp_path: Path) -> None:
    script = tmp_path / "ready.py"
    script.write_text(READY_SERVER)
    tokens = []
    for n in range(2):
        stack = FakeStack(replace(_spec(tmp_path), run_dir=tmp_path / f"run{n}"), script, {})
        try:
            stack.start()
            written = ServingConfig.load(stack.config_path)
            assert written.security.internal_token_file == str(stack.token_path)
            assert stack.token_path.stat().st_mode & 0o777 == 0o600
            assert written.security.read_internal_token() == stack.internal_token
            assert stack.internal_headers == {"Authorization": f"Bearer {stack.internal_token}"}
            assert len(stack.internal_token) >= 40  # 32 random bytes, urlsafe base64
            tokens.append(stack.internal_token)
        finally:
            stack.close()
    assert tokens[0] != tokens[1]


def test_spec_refuses_clashing_ports() -> None:
    with pytest.raises(ValueError, match="ports must be distinct"):
        StackSpec(config=ServingConfig(), gateway_port=8000, prefill_port=8000)


def test_scrape_config_labels_targets_like_the_pod_monitor() -> None:
    import json

    cfg = json.loads(scrape_config({"gateway": "127.0.0.1:8000"}))
    (job,) = cfg["scrape_configs"]
    assert job["static_configs"] == [
        {"targets": ["127.0.0.1:8000"], "labels": {"namespace": "local", "kvserving": "local", "pod": "gateway"}}
    ]


def _up(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvserving.cli", "up", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONSAFEPATH="1"),
    )


def test_up_refuses_a_missing_model_in_one_line() -> None:
    result = _up("--model", "/nonexistent-model")
    assert result.returncode == 1
    assert result.stderr.strip() == "kvserving up: error: --model /nonexistent-model: the directory does not exist"


def test_up_refuses_a_busy_port_in_one_line(tmp_path: Path) -> None:
    (model := tmp_path / "model").mkdir()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _up("--model", str(model), "--port", str(port), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    # the workers' ports (the next ones up) may be taken by another process on a busy machine: they are named too
    assert line.startswith(f"kvserving up: error: already in use on 127.0.0.1: gateway port {port}"), line
    assert line.endswith(" (choose other ports with --port)"), line


def test_gpus_map_one_per_worker_and_reach_the_child(tmp_path: Path) -> None:
    g, p, d = free_ports(3)
    spec = StackSpec(config=ServingConfig(), gateway_port=g, prefill_port=p, decode_port=d, run_dir=tmp_path / "run", gpus=("0", "1"))
    plan = {c.name: c.env for c in LocalStack(spec)._plan()}
    assert plan == {"prefill": {"CUDA_VISIBLE_DEVICES": "0"}, "decode": {"CUDA_VISIBLE_DEVICES": "1"}, "gateway": None}
    one = StackSpec(config=ServingConfig(), gateway_port=g, prefill_port=p, decode_port=d, gpus=("2",))
    assert {c.name: c.env for c in LocalStack(one)._plan()}["decode"] == {"CUDA_VISIBLE_DEVICES": "2"}
    with pytest.raises(ValueError, match="gpus must be GPU indices"):
        StackSpec(config=ServingConfig(), gpus=("gpu0",))

    class EnvStack(LocalStack):
        def _plan(self) -> list[Child]:
            script = "import os, sys; open(sys.argv[1], 'w').write(os.environ.get('CUDA_VISIBLE_DEVICES', '-'))"
            return [
                Child(
                    "w",
                    [sys.executable, "-c", script, str(tmp_path / "seen")],
                    None,
                    self.run_dir / "w.log",
                    env={"CUDA_VISIBLE_DEVICES": "1"},
                )
            ]

    with EnvStack(spec) as stack:
        stack.start()
        assert stack.children[0].proc is not None and stack.children[0].proc.wait(timeout=30) == 0
    assert (tmp_path / "seen").read_text() == "1"


def test_group_alive_sees_live_members_not_zombies() -> None:
    # a group whose leader starts a child, then the leader is killed alone: its child lives on in the group
    leader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\ntime.sleep(600)",
        ],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while len(group_members(leader.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(group_members(leader.pid)) == 2 and group_alive(leader.pid)
        os.kill(leader.pid, signal.SIGKILL)
        leader.wait(timeout=10)  # reaped: only the grandchild is left in the group
        assert group_alive(leader.pid) and len(group_members(leader.pid)) == 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(leader.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while group_alive(leader.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not group_alive(leader.pid) and group_members(leader.pid) == []


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    """Outgoing connections take source ports from the ephemeral range: a port picked there could be
    taken before its server binds it (a worker of the e2e tests once exited 'already in use')."""
    from kvserving.local.stack import PICK_LOW, _ephemeral_low

    ports = free_ports(16)
    assert len(set(ports)) == 16
    assert all(PICK_LOW <= p < _ephemeral_low() for p in ports)
    held = []
    try:
        for p in ports:  # each is free: a server can bind it now
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", p))
            held.append(sock)
    finally:
        for sock in held:
            sock.close()
