"""Calibrated global KV scales: measured from the model's own K/V at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserving.config import KVCacheConfig, ModelConfig, ServingConfig
from kvserving.worker.engine import LLMEngine
from kvserving.worker.kv.scales import calibration_ids, measure_kv_amax, scales_from_amax
from kvserving.worker.sampling import SamplingParams


def engine(model_dir: Path, dtype: str, mode: str) -> LLMEngine:
    return LLMEngine(
        ServingConfig(
            model=ModelConfig(path=str(model_dir)),
            kv_cache=KVCacheConfig(dtype=dtype, memory_bytes=8 << 20, global_scale=mode),
        )
    )


@pytest.mark.parametrize(("dtype", "top"), [("nvfp4", 6 * 448), ("fp8_e4m3", 448)])
def test_calibrated_scales_map_measured_amax_to_the_format_top(tiny_model_dir: Path, dtype: str, top: int) -> None:
    e = engine(tiny_model_dir, dtype, "calibrated")
    k_amax, v_amax = measure_kv_amax(e.model, e.args.num_layers, calibration_ids(e.vocab_size), device=e.device)
    assert e.storage.k_scales == [a / top for a in k_amax]
    assert e.storage.v_scales == [a / top for a in v_amax]
    # the tiny model's K (q/k-normed) reach a few units, V below two: far below the top
    assert all(0 < s < 1 for s in e.storage.k_scales + e.storage.v_scales)
    static = engine(tiny_model_dir, dtype, "static")
    assert static.storage.k_scales == [1.0] * e.args.num_layers
    out = e.generate([list(range(40, 90))], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out[0]) == 8


def test_scales_cannot_change_under_written_pages(tiny_model_dir: Path) -> None:
    e = engine(tiny_model_dir, "nvfp4", "static")
    e.generate([list(range(40, 90))], SamplingParams(max_tokens=2, ignore_eos=True))
    with pytest.raises(ValueError, match="before any KV page is written"):
        e.calibrate_scales([1, 2, 3])


def test_scales_from_amax_edge_cases() -> None:
    assert scales_from_amax("nvfp4", [2688.0, 0.0]) == [1.0, 1.0]
    with pytest.raises(ValueError, match="no global scale"):
        scales_from_amax("triaxial", [1.0])
