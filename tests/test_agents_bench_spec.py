"""bench/agents.py's stack choice: the weight format and the KV layout reach the workers' engine config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_module import load_bench


def test_stack_spec_carries_the_weight_format_to_the_model_config(tmp_path: Path) -> None:
    agents = load_bench("agents")
    gpu = agents.stack_spec("nvfp4", "lease", kv_bytes=1 << 30, ttl_s=3.0, run_dir=None, gpu_model=tmp_path, weights="fp8_block")
    assert (gpu.config.model.weight_format, gpu.config.model.load_format, gpu.gpus) == ("fp8_block", "dummy", ("0",))
    cpu = agents.stack_spec("fp8", "lease", kv_bytes=1 << 20, ttl_s=3.0, run_dir=None)
    assert (cpu.config.model.weight_format, cpu.config.model.load_format, cpu.gpus) == ("auto", "auto", ())


def test_stack_spec_carries_the_kv_layout_and_combine_keeps_layouts_apart(tmp_path: Path) -> None:
    agents = load_bench("agents")
    lm = agents.stack_spec("triaxial", "lease", kv_bytes=1 << 20, ttl_s=3.0, run_dir=None, kv_layout="layer_major")
    assert lm.config.kv_cache.layout == "layer_major"
    assert agents.stack_spec("fp8", "lease", kv_bytes=1 << 20, ttl_s=3.0, run_dir=None).config.kv_cache.layout == "page_major"
    base = {"what": "bench/agents.py: agent traffic on the local stack (x)", "kv_per_worker": "1 GiB", "think_s": 1.0, "seed": 0,
            "device": "GPU", "load": {}, "stacks": [], "total_s": 1.0,
            "points": [{"format": "fp8", "mode": "lease", "concurrency": 1, "output_tok_per_s": 1.0, "hit_rate": 0.5}]}  # fmt: skip
    old, new = tmp_path / "old.json", tmp_path / "new.json"  # a part from before the layout was recorded is layer-major
    old.write_text(json.dumps(base))
    new.write_text(json.dumps({**base, "kv_layout": "page_major"}))
    with pytest.raises(ValueError, match="differ in 'kv_layout'"):
        agents.combine([old, new], tmp_path / "all.json", tmp_path / "all.png")
