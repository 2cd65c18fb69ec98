"""bench/fidelity.py's helpers for comparing bits tables (--diagnose and the per-context pages):
the system-prompt swap holds the budget, tables are re-counted on another page mix, and the
paired comparison against default@pages is the mean / standard error it says."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvserving.calibrate import TaggedSeq
from kvserving.calibration import Calibration, LayerScales
from kvserving.tags import NUM_TAGS, encode_tag

INST = encode_tag("current", "text", "inst")
USER = encode_tag("current", "text", "user")
OBS = encode_tag("turn_m1", "text", "obs")
DELIM = encode_tag("current", "text", "delim")


@pytest.fixture(scope="module")
def fidelity() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "bench" / "fidelity.py"
    spec = importlib.util.spec_from_file_location("fidelity_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fidelity_bench"] = module
    spec.loader.exec_module(module)
    return module


def _calibration(gains: dict[int, float], pages: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]) -> Calibration:
    tokens = 32 * sum(n for n, _ in pages)
    counts = [0] * NUM_TAGS
    for n, mix in pages:
        for c, t in mix:
            counts[c] += n * t
    d2 = tuple(gains.get(c, 0.0) * counts[c] for c in range(NUM_TAGS))  # per-token gain = D(2) / N (D(4) = 0)
    scales = LayerScales((1.0,), (1.0,))
    return Calibration(num_layers=1, num_kv_heads=1, head_dim=64, tokens=tokens,
                       frequency=tuple(n / tokens for n in counts), frequency_source="data",
                       distortion={2: d2, 4: (0.0,) * NUM_TAGS}, tables={},
                       scales={"fp8_e4m3": scales, "nvfp4": scales}, pages=pages, page_size=32, residual=0)


def test_the_system_prompt_swap_keeps_inst_at_four_bits_within_the_budget(fidelity: ModuleType) -> None:
    # 40 pages: 10 system prompt, 10 user, 20 tool results; the measured gains rank inst last
    pages = ((10, ((INST, 32),)), (10, ((USER, 32),)), (20, ((OBS, 32),)))
    cal = _calibration({INST: 1.0, USER: 5.0, OBS: 2.0}, pages)
    table = cal.derive_table(2.5)
    assert (table[INST], table[USER], table[OBS]) == (2, 4, 2)  # 2.5 bits buy the user pages only
    swapped = fidelity.system_prompt_swap(cal, table, 2.5)
    assert (swapped[INST], swapped[USER], swapped[OBS]) == (4, 2, 2)  # user dropped to make room
    assert cal.stored_bits(swapped) <= 2.5
    # with room for both, nothing is dropped
    both = fidelity.system_prompt_swap(cal, cal.derive_table(3.0), 3.0)
    assert (both[INST], both[USER]) == (4, 4) and cal.stored_bits(both) == 3.0


def test_tables_are_recounted_on_the_pages_of_other_prompts(fidelity: ModuleType) -> None:
    pages = ((10, ((INST, 32),)), (10, ((USER, 32),)), (20, ((OBS, 32),)))
    cal = _calibration({INST: 1.0, USER: 5.0, OBS: 2.0}, pages)
    cal = Calibration(**{**{f: getattr(cal, f) for f in cal.__dataclass_fields__}, "tables": {"2.5": cal.derive_table(2.5)}})
    # longer prompts: the system prompt is a smaller share, tool results a larger one; 7 residual tokens
    long = [TaggedSeq(list(range(32 * 14 + 7)), [INST] * 64 + [USER] * 64 + [OBS] * (32 * 10 + 7))]
    other = fidelity.with_pages(cal, long)
    assert other.tables == {} and other.residual == 7
    assert sorted(other.pages) == sorted(((2, ((INST, 32),)), (2, ((USER, 32),)), (10, ((OBS, 32),))))
    assert other.distortion == cal.distortion
    assert other.stored_bits(other.derive_table(2.5)) <= 2.5


def test_paired_comparison_against_default_at_pages(fidelity: ModuleType) -> None:
    def row(kls: list[float], bits: float) -> dict[str, object]:
        return {"kl_per_sequence": kls, "kl_vs_bf16": sum(kls) / len(kls), "stored_bits": bits}

    rows = {"triaxial 2.7 default@pages": row([4.0, 6.0, 8.0], 2.70), "triaxial 2.7 calibrated": row([3.0, 5.0, 6.0], 2.72),
            "triaxial 2.7 default": row([1.0, 1.0, 1.0], 3.2)}
    comp = fidelity.comparisons(rows)
    assert set(comp) == {"2.7"} and set(comp["2.7"]) == {"calibrated"}  # the engine default is not compared
    c = comp["2.7"]["calibrated"]
    d = [-1.0, -1.0, -2.0]
    mean, sd = sum(d) / 3, math.sqrt(sum((x + 4 / 3) ** 2 for x in d) / 2)
    assert c["paired_mean_pct"] == pytest.approx(100 * mean / 6.0)
    assert c["paired_se_pct"] == pytest.approx(100 * sd / math.sqrt(3) / 6.0)
    assert c["t"] == pytest.approx(mean / (sd / math.sqrt(3)))
    assert c["kl_change_pct"] == pytest.approx(100 * (14 / 18 - 1))
    assert c["lower_higher_equal"] == [3, 0, 0]
    assert c["stored_bits_minus_default_pages"] == pytest.approx(0.02)
