"""CUDA graphs of decode steps: skipped cleanly on CPU; on a GPU, graphs on and off give the same tokens for
every KV format (greedy and seeded sampling), and decode steps really replay graphs."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from kvserving.config import KVCacheConfig, ModelConfig, SchedulerConfig, ServingConfig
from kvserving.worker.cuda_graphs import (
    BATCH_BUCKETS,
    DecodeGraphs,
    batch_bucket,
    gc_paused,
    graph_shapes,
    pad_pages_needed,
    table_width,
)
from kvserving.worker.engine import LLMEngine
from kvserving.worker.model_runner import ModelRunner
from kvserving.worker.sampling import SamplingParams


def config(model_dir: Path, dtype: str) -> ServingConfig:
    return ServingConfig(
        model=ModelConfig(path=str(model_dir)),
        kv_cache=KVCacheConfig(dtype=dtype, memory_bytes=64 << 20),
        scheduler=SchedulerConfig(chunk_size=64),
    )


def static_graphs(engine: LLMEngine) -> DecodeGraphs:
    """Decode graphs for batches up to 8 on a CPU engine, run without capture (the graphs' metadata path)."""
    pad = engine.pool.allocate([4] * pad_pages_needed(8, engine.storage.page_size))
    assert pad is not None
    return DecodeGraphs(
        engine.model, engine.attention, device=torch.device("cpu"), max_batch=8,
        max_pages=engine.runner.max_pages, pad_pages=pad, capture=False,
    )  # fmt: skip


class _Cycle:
    """An object only a reference cycle keeps (as a gone engine's CUDA graphs can be): the collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_garbage_is_collected_before_a_capture_and_not_during_it() -> None:
    # a collection inside a capture would destroy such a graph there, and its destructor invalidates the capture
    was = gc.isenabled()
    gc.enable()
    try:
        gc.disable()  # keep the cycle alive until gc_paused collects it
        dead = weakref.ref(_Cycle())
        assert dead() is not None
        gc.enable()
        with gc_paused():
            assert dead() is None and not gc.isenabled()
            later = weakref.ref(_Cycle())
            with gc_paused():  # nested: neither collects nor turns collection back on
                assert not gc.isenabled()
            assert later() is not None and not gc.isenabled()
        assert gc.isenabled()
        with pytest.raises(RuntimeError), gc_paused():  # restored when the capture fails too
            raise RuntimeError("capture failed")
        assert gc.isenabled()
        gc.disable()
        with gc_paused():  # disabled by the caller: left as it is
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable() if was else gc.disable()


def test_buckets() -> None:
    assert [batch_bucket(n, 256) for n in (1, 2, 3, 5, 64, 65, 256)] == [1, 2, 4, 8, 64, 128, 256]
    assert batch_bucket(257, 256) is None and batch_bucket(9, 8) is None
    assert BATCH_BUCKETS[-1] == 256
    assert [table_width(n, 4096) for n in (1, 16, 17, 25, 33, 100, 257, 4096)] == [16, 16, 24, 32, 48, 128, 384, 4096]
    assert table_width(3, 8) == 8 and table_width(300, 300) == 300 and table_width(33, 40) == 40


def test_graph_shapes_are_every_bucket_pair_a_step_can_take() -> None:
    widths = [16, 24, 32, 48, 64, 96, 100]
    assert graph_shapes(4, 100) == [(b, w) for b in (1, 2, 4) for w in widths]
    assert graph_shapes(1, 10) == [(1, 10)]
    # every width a step of 1..max_pages pages is given is in the list
    assert {table_width(n, 100) for n in range(1, 101)} == set(widths)


def test_cpu_engine_has_no_graphs_and_still_decodes(tiny_model_dir: Path) -> None:
    engine = LLMEngine(config(tiny_model_dir, "bf16"), device="cpu")
    assert engine.runner.graphs is None
    free = engine.pool.num_free  # no page is kept for padding rows on CPU
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0]) == 4 and engine.pool.num_free == free


@pytest.mark.parametrize("dtype", ["bf16", "triaxial"])
def test_static_buffer_decode_equals_eager_on_cpu(tiny_model_dir: Path, dtype: str) -> None:
    """The graphs' metadata path (static buffers, padded batch and width), run without capture on CPU."""

    def tokens(static: bool) -> tuple[list[list[int]], LLMEngine]:
        engine = LLMEngine(config(tiny_model_dir, dtype), device="cpu")
        if static:
            engine.runner.graphs = static_graphs(engine)
            # every shape run once before serving, as the CUDA engine captures them: only padding pages are written
            assert engine.runner.graphs.warm_up() == len(graph_shapes(8, engine.runner.max_pages))
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(10, engine.vocab_size, (n,), generator=g).tolist() for n in (40, 70, 9)]
        return engine.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True)), engine

    eager, _ = tokens(False)
    static, engine = tokens(True)
    assert engine.runner.graphs is not None and engine.runner.graphs.replays > 20
    assert static == eager


def test_graphs_refused_off_cuda(tiny_model_dir: Path) -> None:
    engine = LLMEngine(config(tiny_model_dir, "bf16"), device="cpu", enforce_eager=True)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        ModelRunner(engine.model, engine.attention, device=torch.device("cpu"), use_graphs=True, pool=engine.pool)


def test_enforce_eager_flag_parses() -> None:
    import argparse

    from kvserving.worker import generate, main

    for module in (generate, main):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        base = ["--model", "m", "--prompt", "x"] if module is generate else ["--role", "both"]
        assert parser.parse_args(base).enforce_eager is False
        assert parser.parse_args([*base, "--enforce-eager"]).enforce_eager is True


def run(model_dir: Path, dtype: str, *, eager: bool) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine(config(model_dir, dtype), device="cuda", enforce_eager=eager)
    g = torch.Generator().manual_seed(5)
    # 4 prompts: decode steps of 4 rows, then 3, 2, 1 as they finish (3 pads to the bucket of 4)
    prompts = [torch.randint(10, engine.vocab_size, (n,), generator=g).tolist() for n in (9, 70, 200, 33)]
    greedy = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    sampled = engine.generate(prompts[:3], SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=40, seed=7, ignore_eos=True))
    return greedy + sampled, engine


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3", "nvfp4", "triaxial"])
def test_graphs_on_and_off_give_the_same_tokens(tiny_model_dir: Path, dtype: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    eager, eager_engine = run(tiny_model_dir, dtype, eager=True)
    graphed, engine = run(tiny_model_dir, dtype, eager=False)
    assert eager_engine.runner.graphs is None
    assert engine.runner.graphs is not None and engine.runner.graphs.replays > 20
    # every shape was captured before serving; the steps added none
    assert set(engine.runner.graphs.graphs) == set(graph_shapes(engine.runner.graphs.max_batch, engine.runner.max_pages))
    assert graphed == eager


def stream(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], abort_at: int) -> list[tuple]:
    """Every output in order; r1 is aborted once it has ``abort_at`` tokens."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    out: list[tuple] = []
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            out.append((o.request_id, o.new_token_ids[0], o.finished, o.finish_reason, o.num_output_tokens))
            if o.request_id == "r1" and o.num_output_tokens == abort_at:
                engine.abort("r1")
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "nvfp4", "triaxial"])
def test_async_decode_gives_the_same_streams(tiny_model_dir: Path, dtype: str) -> None:
    """Graphs with asynchronous decode (default) against graphs that wait for every step's ids: the same
    streams through stop ids mid-batch, seeded sampling, max_tokens and an abort."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(9)
    ref_engine = LLMEngine(config(tiny_model_dir, dtype), device="cuda", async_decode=False)
    prompts = [torch.randint(10, ref_engine.vocab_size, (n,), generator=g).tolist() for n in (9, 70, 200, 33, 17)]
    base = [SamplingParams(max_tokens=40, ignore_eos=True), SamplingParams(max_tokens=40, ignore_eos=True),
            SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, top_k=40, seed=7, ignore_eos=True),
            SamplingParams(max_tokens=25, ignore_eos=True), SamplingParams(max_tokens=37, ignore_eos=True)]  # fmt: skip
    ref = stream(ref_engine, prompts, base, abort_at=1000)
    stops = {}
    for i in (0, 4):  # a token first produced at output 12+: the row stops mid-batch
        toks = [r[1] for r in ref if r[0] == f"r{i}"]
        stops[i] = next(t for k, t in enumerate(toks) if k >= 12 and t not in toks[:k])
    params = [SamplingParams(max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                             seed=sp.seed, ignore_eos=True, stop_token_ids=(stops[i],) if i in stops else ())
              for i, sp in enumerate(base)]  # fmt: skip
    runs = {}
    for async_decode in (False, True):
        engine = LLMEngine(config(tiny_model_dir, dtype), device="cuda", async_decode=async_decode)
        runs[async_decode] = stream(engine, prompts, params, abort_at=15)
        assert engine.runner.graphs is not None and not engine.step_in_flight
        assert (engine.stats.overlapped_steps > 10) == async_decode
    assert runs[True] == runs[False]
    assert {r[0]: r[3] for r in runs[True] if r[2]} == {"r0": "stop", "r2": "length", "r3": "length", "r4": "stop"}


def test_only_the_graph_decode_runs_its_forward_in_a_graph_pass(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode graphs' forward (the eager run before a capture, the capture; on CPU the run without capture) is a
    ``graph_pass``, where ``product`` may take kernels whose launches pay off only when replayed; prefill and mixed
    steps, run eagerly, are not."""
    from kvserving.worker import model

    seen: list[tuple[int, bool]] = []
    product = model.product

    def recorded(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        seen.append((x.shape[0], model._GRAPH_PASS.get()))
        return product(x, weight, bias)

    engine = LLMEngine(config(tiny_model_dir, "bf16"), device="cpu")
    engine.runner.graphs = static_graphs(engine)
    monkeypatch.setattr(model, "product", recorded)
    engine.generate([[5, 6, 7, 8, 9, 10, 11]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert engine.runner.graphs.replays == 2  # the two decode steps after the prompt's
    # the prompt's 7 tokens eagerly, then each decode step padded to a batch bucket of one, in the pass
    assert {t for t, in_pass in seen if not in_pass} == {7} and {t for t, in_pass in seen if in_pass} == {1}
