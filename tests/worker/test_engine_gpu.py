"""On a GPU the engine runs the Triton kernels through the one dispatch point
and produces what the reference ops produce (device machine only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from logits_recorder import record_logits

from kvserving.config import KVCacheConfig, ModelConfig, SchedulerConfig, ServingConfig
from kvserving.worker.engine import LLMEngine
from kvserving.worker.sampling import SamplingParams

pytestmark = pytest.mark.gpu


def run(model_dir: Path, dtype: str, monkeypatch: pytest.MonkeyPatch, backend: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    monkeypatch.setenv("KVSERVING_PAGED_BACKEND", backend)
    engine = LLMEngine(
        ServingConfig(
            model=ModelConfig(path=str(model_dir)),
            kv_cache=KVCacheConfig(dtype=dtype, memory_bytes=64 << 20),
            scheduler=SchedulerConfig(chunk_size=64),
        ),
        device="cuda",
        async_decode=False,  # every step's logits read back before the next launches
    )
    seen = record_logits(engine)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, engine.vocab_size, (n,), generator=g).tolist() for n in (9, 70, 200, 33)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    # logits of the first decode step of each request (after the same first token)
    return outs, [seen[f"offline-{i}"][1] for i in range(len(prompts))]


@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3", "nvfp4", "triaxial"])
def test_engine_on_gpu_matches_reference_ops(tiny_model_dir: Path, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ref_out, ref_logits = run(tiny_model_dir, dtype, monkeypatch, "reference")
    tri_out, tri_logits = run(tiny_model_dir, dtype, monkeypatch, "triton")
    for a, b, ra, rb in zip(ref_out, tri_out, ref_logits, tri_logits):
        if a[0] == b[0]:
            # same history: one bf16 decode step may differ only by rounding
            # of the attention sums (bf16 model: logits carry ~1e-2 noise)
            assert (ra - rb).abs().max() < 0.1 * ra.abs().max()
    agree = sum(x == y for a, b in zip(ref_out, tri_out) for x, y in zip(a, b)) / sum(map(len, ref_out))
    assert agree >= 0.75


def test_engine_on_gpu_with_the_bf16_gemv_matches_cublas(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 GEMV (the default): the decode steps' projections run it (the down projection gated), every other row
    count cuBLAS; against KVSERVING_BF16_GEMV=0 (cuBLAS everywhere) the first decode logits agree within the bf16
    model's rounding noise and the tokens mostly."""
    from kvserving.kernels import triton_fp8_gemm
    from kvserving.worker import model

    monkeypatch.setenv("KVSERVING_BF16_GEMV", "0")
    model._gemv_kernels.cache_clear()
    cublas_out, cublas_logits = run(tiny_model_dir, "bf16", monkeypatch, "triton")
    calls = {"plain": 0, "gated": 0}
    gemv = triton_fp8_gemm.gemv

    def counted(*args: object, gated: bool = False, **kw: object) -> torch.Tensor:
        calls["gated" if gated else "plain"] += 1
        return gemv(*args, gated=gated, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_fp8_gemm, "gemv", counted)
    monkeypatch.setenv("KVSERVING_BF16_GEMV", "1")
    model._gemv_kernels.cache_clear()
    try:
        gemv_out, gemv_logits = run(tiny_model_dir, "bf16", monkeypatch, "triton")
    finally:
        model._gemv_kernels.cache_clear()
    assert calls["plain"] > 0 and calls["gated"] > 0, calls  # qkv, o, gate_up plain; down gated
    for a, b, ra, rb in zip(cublas_out, gemv_out, cublas_logits, gemv_logits):
        if a[0] == b[0]:
            assert (ra - rb).abs().max() < 0.1 * ra.abs().max()
    agree = sum(x == y for a, b in zip(cublas_out, gemv_out) for x, y in zip(a, b)) / sum(map(len, cublas_out))
    assert agree >= 0.75


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "nvfp4", "triaxial"])
def test_engine_on_gpu_generates_the_same_with_page_major_kv(tiny_model_dir: Path, dtype: str) -> None:
    """kv_cache.layout page_major: the same kernels address each layer's pages by stride in one buffer; the same prompts
    give the same tokens and bit-identical logits as a buffer per layer (greedy, CUDA graphs)."""
    runs = {}
    for layout in ("layer_major", "page_major"):
        engine = LLMEngine(
            ServingConfig(
                model=ModelConfig(path=str(tiny_model_dir)),
                kv_cache=KVCacheConfig(dtype=dtype, memory_bytes=64 << 20, layout=layout),
                scheduler=SchedulerConfig(chunk_size=64),
            ),
            device="cuda",
            async_decode=False,
        )
        assert engine.storage.page_major == (layout == "page_major")
        seen = record_logits(engine)
        g = torch.Generator().manual_seed(7)
        prompts = [torch.randint(10, engine.vocab_size, (n,), generator=g).tolist() for n in (9, 70, 200, 33)]
        outs = engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
        runs[layout] = (outs, [seen[f"offline-{i}"][1] for i in range(len(prompts))])
    (lm_out, lm_logits), (pm_out, pm_logits) = runs["layer_major"], runs["page_major"]
    assert pm_out == lm_out
    assert all(torch.equal(a, b) for a, b in zip(lm_logits, pm_logits))
