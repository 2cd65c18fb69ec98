"""bench/faults_cpu.py at its smallest (``--quick``: one two-turn conversation,
a credential-less attacker between the turns, one with a NIXL agent of its own,
and the lease holder frozen before the second), end to end with real gateway and worker processes: no request is
silently wrong, the counts add up, the attacker was refused on every call and
reached nothing, and the frozen holder's turn moved to the other decode worker
(counted once by the gateway as ``holder_unresponsive``); the prefill worker's
pull from the frozen holder gives up after ``reuse.peer_timeout_s``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "faults_cpu.py"
CLASSES = ("ok", "failed_clear", "failed_unclear", "silently_wrong")


def test_fault_matrix_quick(tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--json", str(out)], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["setup"]["turns"] == [2]
    faults = {r["fault"]: r for r in result["faults"]}
    assert set(faults) == {"attacker", "nixl_attacker", "holder_sigstop"}
    for r in faults.values():
        assert r["silently_wrong"] == 0 and r["violations"] == []
        assert r["sent"] == sum(r[k] for k in CLASSES) == 2
        assert r["ok"] == 2, r["notes"]  # both faults are absorbed: the replies equal the fault-free run
    probes = faults["attacker"]["probes"]
    assert probes["worker_calls_without_credential"] == 3 * 7 * 2  # 3 workers x 7 routes x (no token, a guessed one)
    assert probes["answered_not_401"] == 0 and probes["trap_connections"] == 0
    assert probes["credentialed_generates_naming_the_trap"] == ["unknown_peer"]  # recomputed, nothing contacted
    # with a NIXL agent of its own: no metadata (401), made-up metadata refused, no READ / WRITE set up
    assert faults["nixl_attacker"]["probes"] == {
        "agent_metadata_without_credential": 3,
        "made_up_metadata": 9,
        "made_up_metadata_refused": 9,
        "transfers_naming_the_victims_agent": 6,
        "transfers_refused": 6,
    }
    assert faults["holder_sigstop"]["gateway_counters"]["reuse_fallbacks{reason=holder_unresponsive}"] == 1
    # the prefill's part of a turn whose KV only the holder has: frozen, it gives up after reuse.peer_timeout_s
    # and recomputes the alive run's token
    pulls = faults["holder_sigstop"]["prefill_pull_from_holder"]
    peer_timeout_s = result["setup"]["reuse_peer_timeout_s"]
    assert [(p["frozen"], p["fallback"]) for p in pulls] == [(False, None), (True, "remote_unreachable")] * 2
    assert all(p["pulled_tokens"] > 0 for p in pulls if not p["frozen"])
    assert all(peer_timeout_s <= p["seconds"] < peer_timeout_s + 5 for p in pulls if p["frozen"])
    assert "silently_wrong" in proc.stdout.splitlines()[0]  # the printed table's header
