"""NIXL page transport (two agents in one process over UCX), descriptor merging,
the wire params' validation, layout identity and the "auto" recompute threshold."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from bench_module import load_bench

from kvserving.config import KVCacheConfig, ModelConfig, ReuseConfig, ServingConfig
from kvserving.kernels.page_ids import INT2_PAGE_FLAG
from kvserving.worker.engine import LLMEngine
from kvserving.worker.kv.transfer import KVTransfer
from kvserving.worker.kv.protocol import KVTransferParams, layout_hash, weights_identity
from kvserving.worker.kv.nixl_io import NixlIO, PageGeometry, TransferError, merge_spans, page_runs, ucx_defaults
from kvserving.worker.sampling import SamplingParams

GEO = PageGeometry(page_bytes=256, int2_page_bytes=128, total_bytes=4096)


def test_page_spans_and_merging() -> None:
    assert GEO.span(3) == (768, 256)
    assert GEO.span(INT2_PAGE_FLAG | 0) == (4096 - 128, 128)
    assert GEO.span(INT2_PAGE_FLAG | 2) == (4096 - 384, 128)
    with pytest.raises(ValueError, match="outside"):
        GEO.span(16)
    # adjacent on both sides -> one copy; adjacent only locally -> two
    assert merge_spans([(0, 512, 256), (256, 768, 256)]) == [(0, 512, 512)]
    assert merge_spans([(0, 512, 256), (256, 1024, 256)]) == [(0, 512, 256), (256, 1024, 256)]
    # INT2 pages grow downwards: consecutive indices are adjacent in reverse; sorting merges them
    int2 = [(GEO.span(INT2_PAGE_FLAG | i)[0], GEO.span(INT2_PAGE_FLAG | i)[0], 128) for i in range(3)]
    assert merge_spans(int2) == [(4096 - 384, 4096 - 384, 384)]


def test_page_runs_equal_per_page_spans_merged() -> None:
    """One span per run of consecutive ids gives exactly the merged per-page copies: runs,
    scattered pages, INT2 runs (downwards), runs broken on one side only, mixed precisions."""
    import random

    other = PageGeometry(page_bytes=256, int2_page_bytes=128, total_bytes=8192)
    rng = random.Random(3)
    f = INT2_PAGE_FLAG
    cases = [
        ([0, 1, 2, 3], [5, 6, 7, 8]),
        ([4, 5, 9, 10], [20, 21, 22, 23]),
        ([f | 0, f | 1, f | 2, 3, 4], [f | 7, f | 8, f | 9, 10, 11]),
        ([2, 1, 0], [2, 1, 0]),
    ] + [(rng.sample(range(12), 6), rng.sample(range(28), 6)) for _ in range(20)]
    for local, remote in cases:
        per_page = [(GEO.span(lp)[0], other.span(rp)[0], GEO.span(lp)[1]) for lp, rp in zip(local, remote)]
        assert merge_spans(page_runs(GEO, other, local, remote)) == merge_spans(per_page), (local, remote)
    assert page_runs(GEO, other, [0, 1, 2], [5, 6, 7]) == [(0, 1280, 768)]
    with pytest.raises(ValueError, match="outside"):  # the run's last page lies past the buffer
        page_runs(GEO, other, [14, 15, 16], [0, 1, 2])
    with pytest.raises(ValueError, match="bytes"):
        page_runs(GEO, other, [f | 0], [1])


@pytest.fixture()
def agents() -> Any:
    src = torch.randint(0, 256, (2, 4096), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    dst = torch.zeros(2, 4096, dtype=torch.uint8)
    a, b = NixlIO("test-dst", dst, geometry=GEO), NixlIO("test-src", src, geometry=GEO)
    b.start_progress()  # the side being read must progress (UCX over TCP)
    yield a, b, src, dst
    a.close()
    b.close()


def test_read_pages_between_two_agents(agents: Any) -> None:
    a, b, src, dst = agents
    peer = a.add_remote("src", 1, b.metadata(), addrs=b.addrs, device_id=0, geometry=GEO)
    assert a.add_remote("src", 1, b"ignored: cached", addrs=b.addrs, device_id=0, geometry=GEO) is peer
    local, remote = [0, 1, 2, 7, INT2_PAGE_FLAG | 1], [3, 4, 5, 9, INT2_PAGE_FLAG | 4]
    stats = a.read(peer, local, remote, timeout_s=10.0)
    # per layer: pages 0-2 <- 3-5 is one run, 7 <- 9 another, the INT2 page a third
    assert (stats.num_regions, stats.num_bytes) == (6, 2 * (4 * 256 + 128))
    for lp, rp in zip(local, remote):
        lo, n = GEO.span(lp)
        ro, _ = GEO.span(rp)
        assert torch.equal(dst[:, lo : lo + n], src[:, ro : ro + n])
    untouched = GEO.span(3)[0]
    assert int(dst[:, untouched : untouched + 256].sum()) == 0
    with pytest.raises(ValueError, match="bytes"):
        a.read(peer, [0], [INT2_PAGE_FLAG | 0], timeout_s=1.0)  # an INT4 page cannot take an INT2 one


def test_descriptor_lists_are_built_without_the_agents_lock(agents: Any) -> None:
    """Building a READ's descriptor lists (thousands of regions from a scattered pull) leaves the lock free:
    the progress poller and other READs go on; posting the transfer takes it."""
    a, b, src, dst = agents
    peer = a.add_remote("src", 1, b.metadata(), addrs=b.addrs, device_id=0, geometry=GEO)
    agent, seen = a._agent, []

    def free_elsewhere() -> bool:  # the lock is re-entrant: only another thread can tell whether it is held
        got: list[bool] = []

        def probe() -> None:
            got.append(a._lock.acquire(timeout=1.0))
            if got[0]:
                a._lock.release()

        thread = threading.Thread(target=probe)
        thread.start()
        thread.join()
        return got[0]

    class Watch:
        def __getattr__(self, name: str) -> Any:
            return getattr(agent, name)

        def get_xfer_descs(self, descs: Any, mem_type: str) -> Any:
            seen.append(("descs", free_elsewhere()))
            return agent.get_xfer_descs(descs, mem_type)

        def initialize_xfer(self, *args: Any) -> Any:
            seen.append(("post", free_elsewhere()))
            return agent.initialize_xfer(*args)

    a._agent = Watch()
    try:
        assert a.read(peer, [0, 1], [3, 4], timeout_s=10.0).num_regions == 2
    finally:
        a._agent = agent
    assert seen == [("descs", True), ("descs", True), ("post", False)]
    assert torch.equal(dst[:, :512], src[:, 768:1280])


def test_read_from_a_forgotten_agent_fails(agents: Any) -> None:
    a, b, _, dst = agents
    peer = a.add_remote("src", 1, b.metadata(), addrs=b.addrs, device_id=0, geometry=GEO)
    a.forget_remote("src")
    with pytest.raises(TransferError) as err:
        a.read(peer, [0], [1], timeout_s=1.0)
    assert err.value.reason == "transfer_failed" and err.value.pages_safe
    # a new generation of the same engine id loads fresh metadata and works again
    peer2 = a.add_remote("src", 2, b.metadata(), addrs=b.addrs, device_id=0, geometry=GEO)
    assert a.read(peer2, [0], [1], timeout_s=10.0).num_regions == 2


def test_a_peer_is_not_forgotten_while_another_read_from_it_is_in_flight(agents: Any) -> None:
    """Removing an agent fails every READ in flight from it: a pull that drops a failed peer
    asks ``unless_reading`` and leaves it to the READs still running."""
    a, b, src, dst = agents
    b.close()  # the side being read stops progressing: a READ over TCP stays in flight
    b2 = NixlIO("test-src2", src, geometry=GEO)
    try:
        peer = a.add_remote("src2", 1, b2.metadata(), addrs=b2.addrs, device_id=0, geometry=GEO)
        done: dict[str, Any] = {}
        reader = threading.Thread(target=lambda: done.update(stats=a.read(peer, [0, 1], [3, 4], timeout_s=30.0)))
        reader.start()
        deadline = time.monotonic() + 10.0
        while a.reads_in_flight("src2") == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert a.reads_in_flight("src2") == 1
        assert a.forget_remote("src2", unless_reading=True) is False and a.remote("src2", 1) is peer
        b2.start_progress()
        reader.join(timeout=30.0)
        assert done["stats"].num_regions == 2 and torch.equal(dst[:, :512], src[:, 768:1280])
        assert a.reads_in_flight("src2") == 0
        assert a.forget_remote("src2", unless_reading=True) is True and a.remote("src2", 1) is None
    finally:
        b2.close()


# ----------------------------------------------------------------------------- wire params
def _params(**kw: Any) -> dict[str, Any]:
    d = {
        "engine_id": "w-1",
        "agent_url": "http://127.0.0.1:1",
        "lease_id": "kv-1",
        "page_ids": [4, 5],
        "page_hashes": [11, 12],
        "num_tokens": 32,
        "page_size": 16,
        "dtype": "bf16",
        "layout_hash": "ab",
        "expires_at": 1.5,
    }
    d.update(kw)
    return d


def test_gpu_buffers_get_ucx_reads_over_cuda_ipc_unless_the_environment_says_otherwise() -> None:
    env: dict[str, str] = {}
    assert ucx_defaults("VRAM", env) == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"} == env
    env = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "off"}  # a user's own setting stays
    assert ucx_defaults("VRAM", env) == {} and env == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "off"}
    env = {}
    assert ucx_defaults("DRAM", env) == {} and env == {}


def test_params_round_trip_and_refusals() -> None:
    p = KVTransferParams.from_dict(_params())
    assert p.page_ids == (4, 5) and KVTransferParams.from_dict(p.to_dict()) == p
    cases = {
        "page_ids": _params(page_ids=[4, "5"]),
        "page_hashes": _params(page_hashes=[11]),
        "num_tokens": _params(num_tokens=True),
        "expires_at": _params(expires_at=float("nan")),
        "engine_id": _params(engine_id=""),
        "page_size": _params(page_size=0),
        "unknown": {**_params(), "extra": 1},
        "missing": {k: v for k, v in _params().items() if k != "dtype"},
    }
    for name, bad in cases.items():
        with pytest.raises(ValueError, match=name if name not in ("unknown", "missing") else "fields"):
            KVTransferParams.from_dict(bad)
    with pytest.raises(ValueError, match="num_tokens"):
        KVTransferParams.from_dict(_params(num_tokens=33))
    with pytest.raises(ValueError, match="page_hashes"):
        KVTransferParams.from_dict(_params(page_hashes=[11, 1 << 63]))
    with pytest.raises(ValueError, match="must be an object"):
        KVTransferParams.from_dict([1])


def test_params_carry_the_bit_budget_cut_together_with_its_ranking() -> None:
    from kvserving.worker.api_bodies import KVTransferParamsBody

    plain = KVTransferParams.from_dict(_params())
    assert (plain.bits_cut, plain.bits_ranking) == (None, None) and "bits_cut" not in plain.to_dict()
    held = KVTransferParams.from_dict(_params(bits_cut=7.25, bits_ranking="ab12"))
    assert (held.bits_cut, held.bits_ranking) == (7.25, "ab12")
    assert KVTransferParams.from_dict(held.to_dict()) == held
    body = KVTransferParamsBody.model_validate(_params(bits_cut=7, bits_ranking="ab12"))
    assert KVTransferParams.from_dict(body.model_dump()) == KVTransferParams.from_dict(_params(bits_cut=7.0, bits_ranking="ab12"))
    assert KVTransferParams.from_dict(KVTransferParamsBody.model_validate(_params()).model_dump()) == plain
    for bad in (
        {"bits_cut": 7.0},
        {"bits_ranking": "ab12"},
        {"bits_cut": 57.0, "bits_ranking": "ab12"},
        {"bits_cut": float("nan"), "bits_ranking": "ab12"},
        {"bits_cut": True, "bits_ranking": "ab12"},
        {"bits_cut": 7.0, "bits_ranking": ""},
    ):
        with pytest.raises(ValueError, match="bits_"):
            KVTransferParams.from_dict(_params(**bad))
        with pytest.raises(ValueError, match="bits_"):
            KVTransferParamsBody.model_validate(_params(**bad))


def test_recompute_threshold_accepts_auto() -> None:
    assert ReuseConfig(recompute_threshold_tokens="auto").recompute_threshold_tokens == "auto"
    for bad in (-1, "fast", True, 1.5):
        with pytest.raises(ValueError, match="recompute_threshold_tokens"):
            ReuseConfig(recompute_threshold_tokens=bad)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- layout identity
def _engine(model: Path, dtype: str = "bf16", **reuse: Any) -> LLMEngine:
    return LLMEngine(
        ServingConfig(
            model=ModelConfig(path=str(model)), kv_cache=KVCacheConfig(dtype=dtype, memory_bytes=1 << 20), reuse=ReuseConfig(**reuse)
        )
    )


def test_layout_hash_covers_format_scales_and_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    assert weights_identity(copy) == weights_identity(tiny_model_dir)
    weights = next(copy.glob("*.safetensors"))
    raw = bytearray(weights.read_bytes())
    header = int.from_bytes(raw[:8], "little")
    raw[8 + header + 5] ^= 0x40  # one byte of the first tensor
    weights.write_bytes(bytes(raw))
    assert weights_identity(copy) != weights_identity(tiny_model_dir)

    bf16 = _engine(tiny_model_dir)
    base = layout_hash(bf16, weights_id="w")
    assert layout_hash(_engine(tiny_model_dir), weights_id="w") == base  # pool size is not part of it
    assert layout_hash(_engine(tiny_model_dir, "fp8_e4m3"), weights_id="w") != base
    assert layout_hash(bf16, weights_id="other") != base
    fp8 = _engine(tiny_model_dir, "fp8_e4m3")
    before = layout_hash(fp8, weights_id="w")
    fp8.storage.k_scales = [0.5] + fp8.storage.k_scales[1:]  # pages under another global scale decode differently
    assert layout_hash(fp8, weights_id="w") != before


def test_auto_threshold_pulls_only_when_predicted_faster(tiny_model_dir: Path) -> None:
    eng = _engine(tiny_model_dir, recompute_threshold_tokens="auto")
    kvt = KVTransfer(eng, eng.config.reuse, engine_id="auto-1", agent_url="http://127.0.0.1:1")
    try:
        assert kvt.puller.prefill_tokens_per_s is None and kvt.puller.transfer_bytes_per_s is None
        # unmeasured: the seed threshold of 64 tokens
        assert not kvt.puller.worth_pulling(48, 10**6) and kvt.puller.worth_pulling(64, 10**6)
        eng.generate([list(range(10, 200))], SamplingParams(max_tokens=1))
        tps = kvt.puller.prefill_tokens_per_s
        assert tps is not None and tps > 0
        kvt.puller.measure(10**6, 1e-3, 1e-3)  # 1 GB/s, 1 ms overhead per pull
        assert kvt.puller.transfer_bytes_per_s == pytest.approx(1e9)
        # pull 16 tokens when the recompute takes longer than 1 ms + bytes / 1 GB/s
        assert kvt.puller.worth_pulling(16, 1000) == (16 / tps > 1e-3 + 1e-6)
        assert not kvt.puller.worth_pulling(16, 10**12)  # 1000 s of transfer never pays
        # a READ that timed out after 10 s with 1 MB: its rate (100 KB/s) folds in, the overhead stays
        kvt.puller.measure(10**6, 10.0, None)
        assert kvt.puller.transfer_bytes_per_s == pytest.approx(0.7e9 + 0.3e5)
        assert kvt.puller.pull_overhead_s == pytest.approx(1e-3)
    finally:
        kvt.close()


def test_read_bench_moves_the_senders_bytes_between_two_processes(tmp_path: Path) -> None:
    """bench/nixl_read_gpu.py on host memory: every READ's pages equal the sender's, idle or busy,
    and the transport UCX chose is named from its protocol table."""
    bench = load_bench("nixl_read_gpu")
    out = tmp_path / "read.json"
    args = ["--device", "cpu", "--pages", "64", "--read-pages", "32", "--reps", "1", "--kv-layout", "layer_major"]
    assert bench.main([*args, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["transport"] != "?" and "UCX_PROTO_INFO" not in os.environ  # the bench's own setting is gone again
    assert [(r["case"], r["sender"]) for r in doc["rows"]] == [
        ("contiguous", "idle"),
        ("every other page", "idle"),
        ("contiguous", "busy"),
        ("every other page", "busy"),
    ]
    for row in doc["rows"]:
        assert "failed" not in row and row["mb"] == round(36 * 32 * 32768 / 1e6, 1), row
    assert [r["regions"] for r in doc["rows"]] == [36, 36 * 32, 36, 36 * 32]
    # the same bytes registered page-major (the default: one region, pages of all 36 layers): a run is one region
    pm = tmp_path / "read_pm.json"
    assert bench.main(["--device", "cpu", "--pages", "64", "--read-pages", "32", "--reps", "1", "--out", str(pm)]) == 0
    doc = json.loads(pm.read_text())
    assert doc["kv_layout"] == "page_major" and all("failed" not in r and r["mb"] == round(36 * 32 * 32768 / 1e6, 1) for r in doc["rows"])
    assert [r["regions"] for r in doc["rows"]] == [1, 32, 1, 32]
    # host memory never goes over CUDA IPC: asked for it, the bench fails (gpu_run.sh then skips the agent points)
    args = ["--device", "cpu", "--pages", "64", "--read-pages", "32", "--reps", "1", "--require-transport", "cuda_ipc"]
    assert bench.main(args) == 1


@pytest.mark.gpu
@pytest.mark.gpu_alone
def test_two_workers_on_one_gpu_read_over_cuda_ipc(tmp_path: Path) -> None:
    """Two processes on one GPU (two workers sharing it): UCX reads over CUDA IPC, not TCP. With GET
    over CUDA IPC off (UCX's default without NVLink) the READ ran as TCP emulation through host
    memory at 0.5 GB/s on an H100; a device-to-device copy moves over 1,000 GB/s."""
    bench = load_bench("nixl_read_gpu")
    out = tmp_path / "read.json"
    assert bench.main(["--device", "cuda", "--pages", "512", "--read-pages", "256", "--reps", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert "cuda_ipc" in doc["transport"] and "emulation" not in doc["transport"], doc["transport"]
    rows = {(r["case"], r["sender"]): r for r in doc["rows"]}
    assert all("failed" not in r for r in rows.values()), rows
    assert rows["contiguous", "idle"]["read_gbs"] > 20, rows
    assert rows["contiguous", "busy"]["read_gbs"] > 20, rows


@pytest.mark.gpu
@pytest.mark.gpu_alone
def test_page_major_reads_between_two_gpu_processes_move_a_run_in_one_region(tmp_path: Path) -> None:
    """The same pages of all 36 layers registered page-major (kv_cache.layout page_major): READ over CUDA IPC, every
    byte checked by the bench, a run of pages one region and every other page one region each."""
    bench = load_bench("nixl_read_gpu")
    out = tmp_path / "read_pm.json"
    args = ["--device", "cuda", "--pages", "512", "--read-pages", "256", "--reps", "2", "--kv-layout", "page_major", "--out", str(out)]
    assert bench.main(args) == 0
    doc = json.loads(out.read_text())
    assert "cuda_ipc" in doc["transport"] and doc["kv_layout"] == "page_major", doc["transport"]
    assert all("failed" not in r for r in doc["rows"]), doc["rows"]
    assert [r["regions"] for r in doc["rows"]] == [1, 256, 1, 256]
