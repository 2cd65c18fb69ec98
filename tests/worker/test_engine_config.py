"""The config drives the engine: each sample KVServing, rendered by the
operator's pure render code, gives an engine-config JSON that builds an engine
honouring every field; the bit budget picks the bits table and the capacity;
an empty model.path means the built-in tiny model."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from kvserving.bits import bits_table_for_budget, format_bits_table
from kvserving.config import DEFAULT_PAGE_SIZE, KVCacheConfig, ModelConfig, ServingConfig
from kvserving.model_dir import CACHE_ENV
from kvserving.operator.render import CONFIG_FILE, Owner, render
from kvserving.worker.engine import LLMEngine
from kvserving.worker.kv.cache import DEFAULT_CPU_KV_BYTES, kv_budget_bytes
from kvserving.worker.kv_stats import collect
from kvserving.worker.sampling import SamplingParams

SAMPLES = sorted((Path(__file__).resolve().parents[2] / "manifests" / "samples").glob("*.yaml"))
CPU_KV_BYTES = 4 << 20


def rendered_config(sample: Path, **spec_changes: Any) -> tuple[dict[str, Any], ServingConfig]:
    """(the sample's spec, the engine config of its rendered ConfigMap)."""
    body = yaml.safe_load(sample.read_text())
    spec = body["spec"]
    for key, value in spec_changes.items():
        spec["kvCache"][key] = value
    name = body["metadata"]["name"]
    rendered = render(spec, owner=Owner(name=name, namespace="default", uid="uid-1"))
    (cm,) = [o for o in rendered.objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == f"{name}-config"]
    return spec, ServingConfig.from_json(cm["data"][CONFIG_FILE])


def cpu_engine(config: ServingConfig, model_dir: Path) -> LLMEngine:
    """Only what a CPU test machine needs is overridden: the model path (the sample's
    /models/... is a volume in the cluster) and the KV bytes (the sample sizes the pool as
    a fraction of GPU memory; a few MiB keep the test light)."""
    return LLMEngine(
        dataclasses.replace(
            config,
            model=dataclasses.replace(config.model, path=str(model_dir)),
            kv_cache=dataclasses.replace(config.kv_cache, memory_bytes=CPU_KV_BYTES),
        )
    )


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.stem)
def test_each_sample_builds_an_engine_that_honours_its_config(sample: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    spec, config = rendered_config(sample)
    kv_spec, reuse_spec = spec["kvCache"], spec.get("reuse", {})
    with caplog.at_level(logging.INFO, logger="kvserving.worker"):
        engine = cpu_engine(config, tiny_model_dir)
    # kv cache: dtype, page size, bits table from the budget, byte budget
    assert engine.storage.kv_dtype == config.kv_cache.dtype == kv_spec["dtype"]
    page = kv_spec.get("pageSize", DEFAULT_PAGE_SIZE[kv_spec["dtype"]])
    assert engine.storage.page_size == engine.kv_cache.page_size == engine.pool.page_size == page
    if kv_spec["dtype"] == "triaxial":
        assert engine.kv_cache.bits_table == bits_table_for_budget(float(kv_spec["bitBudget"]))
        assert engine.kv_cache.bit_budget == kv_spec["bitBudget"]
    else:
        assert engine.kv_cache.bits_table is None and engine.pool.precisions == (4,)
    assert engine.storage.buffers.numel() <= CPU_KV_BYTES
    # without memory_bytes, memory_fraction sizes the pool (of the CPU default here)
    assert kv_budget_bytes(config.kv_cache, device=torch.device("cpu")) == int(DEFAULT_CPU_KV_BYTES * kv_spec.get("memoryFraction", 0.9))
    calibrated = kv_spec.get("globalScale") == "calibrated"
    assert (engine.storage.k_scales != [1.0] * engine.args.num_layers) == calibrated
    # scheduler limits, context length, reuse settings, served name
    assert engine.scheduler.config == config.scheduler
    assert engine.max_model_len == (config.model.max_model_len or engine.args.max_position_embeddings)
    assert engine.config.reuse == config.reuse
    assert engine.config.reuse.retention_ttl_s == reuse_spec.get("retentionTTLSeconds", 480)
    assert engine.config.reuse.lease_ttl_s == reuse_spec.get("leaseTTLSeconds", 420)
    assert engine.config.model.served_name == spec["model"]["servedName"]
    # the one log line names the format and, for triaxial, the table it runs with
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv cache ")]
    assert line == engine.kv_cache.describe()
    if engine.kv_cache.bits_table is not None:
        assert line.endswith("bits table: " + format_bits_table(engine.kv_cache.bits_table))
    # and it serves
    out = engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [len(o) for o in out] == [3]
    # what /internal/kv/stats reports: capacity by precision, from the one KV-cache object
    stats = collect(engine)
    names = ["int4", "int2"] if kv_spec["dtype"] == "triaxial" else [kv_spec["dtype"]]
    assert list(stats.precisions) == names
    for name, bits in zip(names, (4, 2)):
        assert stats.precisions[name].capacity_pages == engine.kv_cache.num_pages[bits]
    assert stats.capacity_tokens == engine.capacity_tokens and stats.usage_ratio == 0.0


def test_scheduler_and_context_settings_reach_the_engine(tiny_model_dir: Path) -> None:
    # the CRD does not expose these yet; the engine config does
    _, config = rendered_config(SAMPLES[0])
    config = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, max_model_len=300),
        scheduler=dataclasses.replace(config.scheduler, max_num_seqs=2, max_num_batched_tokens=64, chunk_size=32),
    )
    engine = cpu_engine(config, tiny_model_dir)
    assert engine.max_model_len == 300
    g = torch.Generator().manual_seed(0)
    for n in range(3):
        engine.add_request(f"r{n}", torch.randint(10, 1000, (100,), generator=g).tolist(), SamplingParams(max_tokens=2))
    engine.step()
    # two sequences at most, 64 tokens at most, 32 per chunk
    assert [s.num_computed for s in engine.scheduler.running] == [32, 32]
    assert len(engine.scheduler.waiting) == 1
    with pytest.raises(ValueError, match="does not fit the context length 300"):
        engine.add_request("long", [5] * 300, SamplingParams(max_tokens=1))


def test_bit_budgets_give_different_tables_and_capacities(tiny_model_dir: Path) -> None:
    (triaxial,) = [p for p in SAMPLES if p.stem == "triaxial"]
    engines = {b: cpu_engine(rendered_config(triaxial, bitBudget=b)[1], tiny_model_dir) for b in (2.5, 3.5)}
    low, high = engines[2.5].kv_cache, engines[3.5].kv_cache
    assert low.bits_table == bits_table_for_budget(2.5) != high.bits_table == bits_table_for_budget(3.5)
    assert engines[2.5].capacity_tokens == low.capacity_tokens > engines[3.5].capacity_tokens == high.capacity_tokens
    # same bytes: the difference is the expected INT2 share alone
    assert low.capacity_tokens_at(0.0) == high.capacity_tokens_at(0.0)
    assert low.capacity_tokens == low.capacity_tokens_at(low.int2_share)


def test_an_explicit_bits_table_overrides_the_budget(tiny_model_dir: Path) -> None:
    _, config = rendered_config(SAMPLES[-1])
    assert config.kv_cache.dtype == "triaxial"
    engine = LLMEngine(
        dataclasses.replace(
            config,
            model=ModelConfig(path=str(tiny_model_dir)),
            kv_cache=dataclasses.replace(config.kv_cache, memory_bytes=CPU_KV_BYTES),
        ),
        bits_table=[4] * 56,
    )
    assert engine.kv_cache.bits_table == (4,) * 56 and engine.kv_cache.bit_budget is None


def test_empty_model_path_runs_the_built_in_tiny_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    engine = LLMEngine(ServingConfig(kv_cache=KVCacheConfig(memory_bytes=CPU_KV_BYTES)))
    (built,) = tmp_path.iterdir()
    assert built.name.startswith("tiny-model-") and (built / "model.safetensors").is_file()
    assert engine.args.num_layers == 4 and engine.args.head_dim == 64
    assert len(engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))[0]) == 2
    with pytest.raises(ValueError, match="model.path '/nonexistent' does not exist"):
        LLMEngine(ServingConfig(model=ModelConfig(path="/nonexistent")))
