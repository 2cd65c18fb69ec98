"""bench/engine_gpu.py on CPU (toy shape, tiny pool): its triaxial capacity row runs at the
bit budget the controller holds and reports the stored bits beside the fixed table's."""

from __future__ import annotations

import argparse
from types import ModuleType

import pytest
from bench_module import load_bench

from kvserving.argtypes import decode_shapes


@pytest.fixture(scope="module")
def engine_gpu() -> ModuleType:
    module = load_bench("engine_gpu")
    module.DEVICE = "cpu"  # what --smoke sets
    return module


def test_triaxial_capacity_holds_the_bit_budget_and_reports_it(engine_gpu: ModuleType) -> None:
    margs = engine_gpu.qwen3_8b_shape(1024, smoke=True)
    model = (margs, engine_gpu.random_model(margs, seed=0))
    rows = {}
    for control in ("fixed", "hold"):
        bench = engine_gpu.Bench(model, quick=True, enforce_eager=True, breakdown=False, bit_budget=2.7, bit_budget_control=control)
        rows[control] = bench.capacity("triaxial", 0.03)
    hold, fixed = rows["hold"], rows["fixed"]
    for row in (hold, fixed):
        assert row["seqs"] >= 4 and row["bit_budget"] == 2.7
        n2, n = row["int2_pages_stored"], row["pages_stored"]
        assert row["stored_bits"] == (4 * (n - n2) + 2 * n2) / n
    assert (hold["bit_budget_control"], fixed["bit_budget_control"], fixed["bits_cut"]) == ("hold", "fixed", None)
    assert hold["bits_cut"] is not None and abs(hold["stored_bits"] - 2.7) <= 0.05
    # the bench's class mix is not the one the default table was walked on: the fixed table misses the budget
    assert abs(fixed["stored_bits"] - 2.7) > 0.05, fixed["stored_bits"]


def test_an_unknown_format_is_refused_in_one_line_before_any_work(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # "fp8" is the agent bench's name; the engine bench takes the engine config's (fp8_e4m3)
    module = load_bench("engine_gpu")
    monkeypatch.setattr("sys.argv", ["engine_gpu.py", "--smoke", "--formats", "nvfp4,fp8"])
    with pytest.raises(SystemExit) as exc:
        module.main()
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "engine_gpu.py: error: --formats: unknown fp8; expected some of bf16, fp8_e4m3, nvfp4, triaxial"


def test_the_decode_bench_refuses_an_unknown_format_the_same_way(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load_bench("decode_gpu")
    monkeypatch.setattr("sys.argv", ["decode_gpu.py", "--formats", "fp8"])
    with pytest.raises(SystemExit) as exc:
        module.main()
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "decode_gpu.py: error: --formats: unknown fp8; expected some of bf16, fp8_e4m3, nvfp4, triaxial"
    )


def test_a_page_major_run_fills_every_layer_and_names_its_section(engine_gpu: ModuleType) -> None:
    """--kv-layout page_major: the engines store KV page-major, the fill writes each layer (one buffer: nothing is copied
    between layer rows), and the run's section names a layout only when it is not the default."""
    margs = engine_gpu.qwen3_8b_shape(1024, smoke=True)
    model = (margs, engine_gpu.random_model(margs, seed=0))
    bench = engine_gpu.Bench(model, quick=True, enforce_eager=True, breakdown=False, kv_layout="page_major")
    engine = bench.engine("nvfp4", 0.01)
    st = engine.storage
    assert st.page_major and st.buffers.shape[0] == 1
    seqs = bench.place(engine, 2, 64, computed=64)
    bench.fill(engine, seqs)
    pid = seqs[0].page_ids[0]
    pb = st.layout.page_bytes
    pages = [st.layer(layer).buffer[(o := st.layer(layer).page_offset(pid)) : o + pb] for layer in range(margs.num_layers)]
    assert all(bool(page.any()) for page in pages)  # every layer's page was written, not only layer 0's
    # the roofline reads every page of every layer, whichever the layout
    n_pages = sum(len(s.page_ids) for s in seqs)
    assert engine_gpu.kv_bytes(engine, seqs) == n_pages * pb * margs.num_layers
    # page-major is the default layout: its run is the plain section; layer-major (or a run from before the layout
    # was recorded) names itself
    assert engine_gpu.section_name({"formats": {}, "kv_layout": "page_major", "quick": True}) == "default_quick"
    assert engine_gpu.section_name({"formats": {}, "kv_layout": "layer_major"}) == "default_layer_major"
    assert engine_gpu.section_name({"formats": {}, "weights": "fp8_block"}) == "weights_fp8_block_layer_major"


def test_the_plain_section_runs_triaxial_as_the_product_does(engine_gpu: ModuleType) -> None:
    """``default`` is every format as a deployment runs it: triaxial under the config's bit-budget control (hold) and
    budget; a triaxial run otherwise names its control and budget, and a run that recorded no control ran fixed. The
    control names nothing where triaxial did not run."""
    from kvserving.config import KVCacheConfig

    assert KVCacheConfig().bit_budget_control == "hold"

    def name(**run: object) -> str:
        return engine_gpu.section_name({"kv_layout": "page_major", **run})

    tri = {"triaxial": {}, "nvfp4": {}}
    assert name(formats=tri, bit_budget=None, bit_budget_control="hold") == "default"
    assert name(formats=tri, bit_budget=None, bit_budget_control="hold", weights="fp8_block") == "weights_fp8_block"
    assert name(formats=tri, bit_budget=None, bit_budget_control="fixed") == "fixed"
    assert name(formats=tri, bit_budget=2.7, bit_budget_control="hold", quick=True) == "hold_2.7_quick"
    assert name(formats=tri, bit_budget=2.7) == "fixed_2.7"  # recorded before the control was
    assert name(formats={"nvfp4": {}}, bit_budget=None, bit_budget_control="fixed") == "default"


def test_overlapping_kernels_are_charged_the_busy_time_once(engine_gpu: ModuleType) -> None:
    """With PDL a kernel starts while the one before it runs: each is charged from the end of what ran before it, so
    the charges add up to the busy time (here 0-10 and 12-15 us: 13 us), not to the summed durations (20 us)."""
    spans = [("b", 4.0, 9.0), ("a", 0.0, 5.0), ("c", 5.0, 10.0), ("inside", 6.0, 8.0), ("d", 12.0, 15.0)]
    assert engine_gpu.charged_us(spans) == [("a", 5.0), ("b", 4.0), ("c", 1.0), ("inside", 0.0), ("d", 3.0)]
    assert sum(us for _, us in engine_gpu.charged_us(spans)) == 13.0
    # without overlap each activity keeps its own duration
    assert engine_gpu.charged_us([("x", 0.0, 2.0), ("y", 3.0, 7.5)]) == [("x", 2.0), ("y", 4.5)]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "triaxial"])
def test_the_next_turn_computes_only_its_new_tokens_over_the_cached_prefix(engine_gpu: ModuleType, fmt: str) -> None:
    """--extend: the second request of a conversation finds the first one's pages (triaxial: though the earlier
    tokens are tagged a turn older) and computes the new tokens alone."""
    margs = engine_gpu.qwen3_8b_shape(1024, smoke=True)
    bench = engine_gpu.Bench((margs, engine_gpu.random_model(margs, seed=0)), quick=True, enforce_eager=True, breakdown=False)
    row = bench.extend(bench.engine(fmt, 0.05), 256, 64)
    assert (row["prefix"], row["new"], row["computed"]) == (256, 64, 64)
    assert row["seconds"] > 0 and row["ms_per_1k_new"] == pytest.approx(1e3 * row["seconds"] * 16)
    tags = engine_gpu
    assert [tags.decode_tag(tags.older_tag(tags.encode_tag(t, "text", "obs")))[0] for t in tags.TEMPORAL] == [
        "turn_m1", "turn_m2", "older", "older"
    ]  # fmt: skip


def test_kernels_are_summed_by_class_per_step_with_the_wall_time_they_leave(engine_gpu: ModuleType) -> None:
    """Profiled (name, us) events of two steps -> ms per step by name, then by class; host_gap is the wall time left."""
    events = [("cublas_gemm", 600.0), ("decode_attention", 300.0), ("cublas_gemm", 600.0), ("mystery", 100.0),
              ("_merge_kernel", 40.0), ("_gemv_kernel", 80.0), ("_quantize_kernel", 20.0)]  # fmt: skip
    table = engine_gpu.ms_by_name(events, steps=2)
    assert table == {"cublas_gemm": 0.6, "decode_attention": 0.15, "mystery": 0.05, "_merge_kernel": 0.02, "_gemv_kernel": 0.04,
                     "_quantize_kernel": 0.01}  # fmt: skip
    out = engine_gpu.class_breakdown(table, wall_ms=1.0)
    assert (out["gemm"], out["attention"], out["other"], out["kv_write"], out["act_quant"]) == pytest.approx((0.64, 0.17, 0.05, 0.0, 0.01))
    assert out["kernels"] == pytest.approx(0.87) and out["host_gap"] == pytest.approx(0.13)
    assert out["top_other"] == [["mystery", 0.05]]
    # each named class's kernels by name, most expensive first; classes with no kernel are left out
    assert out["by_kernel"] == {"gemm": [["cublas_gemm", 0.6], ["_gemv_kernel", 0.04]], "act_quant": [["_quantize_kernel", 0.01]],
                                "attention": [["decode_attention", 0.15], ["_merge_kernel", 0.02]]}  # fmt: skip


def test_shapes_parse_as_batch_x_context_and_refuse_anything_else() -> None:
    assert decode_shapes("8x4096, 24x32768") == [(8, 4096), (24, 32768)]
    for bad in ("8x", "0x4096", "8x4096,x", "8*4096"):
        with pytest.raises(argparse.ArgumentTypeError, match="BATCHxCONTEXT"):
            decode_shapes(bad)
