"""bench/agents.py's stack choice: the weight format reaches the workers' engine config."""

from __future__ import annotations

from pathlib import Path

from bench_module import load_bench


def test_stack_spec_carries_the_weight_format_to_the_model_config(tmp_path: Path) -> None:
    agents = load_bench("agents")
    gpu = agents.stack_spec("nvfp4", "lease", kv_bytes=1 << 30, ttl_s=3.0, run_dir=None, gpu_model=tmp_path, weights="fp8_block")
    assert (gpu.config.model.weight_format, gpu.config.model.load_format, gpu.gpus) == ("fp8_block", "dummy", ("0",))
    cpu = agents.stack_spec("fp8", "lease", kv_bytes=1 << 20, ttl_s=3.0, run_dir=None)
    assert (cpu.config.model.weight_format, cpu.config.model.load_format, cpu.gpus) == ("auto", "auto", ())
