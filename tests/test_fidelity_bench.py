"""bench/fidelity.py's helpers for comparing bits tables (--diagnose and the per-context pages):
the system-prompt swap holds the budget, tables are re-counted on another page mix, the
paired comparison against default@pages is the mean / standard error it says, --budgets
per context; and a smoke run writes each row as it completes and calibration files that reload."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import ModuleType

import pytest
from bench_module import load_bench

from kvserving.calibrate.data import TaggedSeq
from kvserving.calibration import Calibration, LayerScales
from kvserving.tags import NUM_TAGS, encode_tag

INST = encode_tag("current", "text", "inst")
USER = encode_tag("current", "text", "user")
OBS = encode_tag("turn_m1", "text", "obs")
DELIM = encode_tag("current", "text", "delim")


@pytest.fixture(scope="module")
def fidelity() -> ModuleType:
    return load_bench("fidelity")


def _calibration(gains: dict[int, float], pages: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]) -> Calibration:
    tokens = 32 * sum(n for n, _ in pages)
    counts = [0] * NUM_TAGS
    for n, mix in pages:
        for c, t in mix:
            counts[c] += n * t
    d2 = tuple(gains.get(c, 0.0) * counts[c] for c in range(NUM_TAGS))  # per-token gain = D(2) / N (D(4) = 0)
    scales = LayerScales((1.0,), (1.0,))
    return Calibration(
        num_layers=1,
        num_kv_heads=1,
        head_dim=64,
        tokens=tokens,
        frequency=tuple(n / tokens for n in counts),
        frequency_source="data",
        distortion={2: d2, 4: (0.0,) * NUM_TAGS},
        tables={},
        scales={"fp8_e4m3": scales, "nvfp4": scales},
        pages=pages,
        page_size=32,
        residual=0,
    )


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

    rows = {
        "triaxial 2.7 default@pages": row([4.0, 6.0, 8.0], 2.70),
        "triaxial 2.7 calibrated": row([3.0, 5.0, 6.0], 2.72),
        "triaxial 2.7 default": row([1.0, 1.0, 1.0], 3.2),
    }
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


def test_a_table_equal_to_default_at_pages_is_reported_as_the_same_table(fidelity: ModuleType) -> None:
    def row(kls: list[float], table: str) -> dict[str, object]:
        return {"kl_per_sequence": kls, "kl_vs_bf16": sum(kls) / len(kls), "stored_bits": 3.39, "table": table}

    rows = {
        "triaxial 3.5 default@pages": row([4.0, 6.0], "older obs at 2"),
        "triaxial 3.5 calibrated": row([4.0, 6.0], "older obs at 2"),
        "triaxial 3.5 calibrated@8192": row([3.0, 5.0], "recent classes at 2"),
    }
    comp = fidelity.comparisons(rows)["3.5"]
    assert comp["calibrated"] == {"same_table": True, "paired_mean_pct": 0.0, "paired_se_pct": None, "t": None}
    assert "same_table" not in comp["calibrated@8192"] and comp["calibrated@8192"]["lower_higher_equal"] == [2, 0, 0]


def test_the_page_mix_summary_names_the_classes_that_fill_pages_alone(fidelity: ModuleType) -> None:
    pages = ((6, ((OBS, 32),)), (2, ((INST, 32),)), (2, ((USER, 16), (DELIM, 16))))
    cal = Calibration(**{**{f: getattr(_calibration({}, pages), f) for f in Calibration.__dataclass_fields__}, "residual": 5})
    summary = fidelity.page_mix_summary(cal)
    assert summary["full_pages"] == 10 and summary["residual_tokens"] == 5 and summary["tokens"] == 325
    assert summary["single_class_pages"] == {"turn_m1/text/obs": 0.6, "current/text/inst": 0.2}
    assert summary["mixed_pages"] == pytest.approx(0.2)
    assert summary["counts"] == [[6, [[OBS, 32]]], [2, [[INST, 32]]], [2, [[USER, 16], [DELIM, 16]]]]


def test_extra_held_out_files_are_never_training_calibration_or_evaluation_files(fidelity: ModuleType) -> None:
    extra = set(fidelity.extra_held_out_files())
    for deep in (False, True):
        train, held = fidelity.stdlib_files(deep=deep)
        assert not extra & set(train) and not extra & set(held)
    assert not any(part in ("site-packages", "dist-packages") for p in extra for part in p.parts)


def test_evaluation_conversations_come_from_the_evaluation_files_first(
    fidelity: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvserving.gateway.prompt.chat_template import ChatTemplate
    from kvserving.gateway.prompt.tagger import ChatTagger
    from kvserving.gateway.prompt.tokenizer import TextTokenizer
    from kvserving.model_dir import tiny_model_dir

    tok_dir = tiny_model_dir()
    tagger = ChatTagger(TextTokenizer.from_dir(tok_dir), ChatTemplate.from_dir(tok_dir))
    text = Path(importlib.util.__file__).read_text()  # any standard-library source
    eval_path, extra_source = tmp_path / "evaluation.py", tmp_path / "other.py"
    eval_path.write_text(text[:6000])
    extra_source.write_text(text[6000:])
    monkeypatch.setattr(fidelity, "extra_held_out_files", lambda: [extra_source])
    few, info = fidelity.evaluation_conversations(eval_path, tmp_path / "extra.py", tagger, ctx=256, n=2)
    have = info["available_in_evaluation_files"]
    assert 2 <= have and len(few) == 2 and info["from_extra_files"] == 0 and not (tmp_path / "extra.py").exists()
    more, info = fidelity.evaluation_conversations(eval_path, tmp_path / "extra.py", tagger, ctx=256, n=have + 3)
    assert len(more) == have + 3 and info["from_evaluation_files"] == have and info["from_extra_files"] == 3
    assert [q.ids for q in more[:2]] == [q.ids for q in few]  # the same first conversations
    assert all(len(q.ids) >= 128 for q in more)


def test_contexts_must_be_the_configs(fidelity: ModuleType) -> None:
    assert fidelity.main(["--smoke", "--contexts", "999"]) == 2
    assert fidelity.main(["--smoke", "--contexts", "256", "256"]) == 2
    assert fidelity.main(["--smoke", "--contexts", "256", "--eval-seqs", "1", "2"]) == 2


def test_budgets_are_one_list_for_every_context_or_one_per_context(fidelity: ModuleType) -> None:
    assert fidelity.context_budgets(None, (2048, 8192)) == {2048: fidelity.BUDGETS, 8192: fidelity.BUDGETS}
    assert fidelity.context_budgets(["3,2.7"], (2048, 8192)) == {2048: (2.7, 3.0), 8192: (2.7, 3.0)}
    assert fidelity.context_budgets(["2.7", "3.5,2.5"], (2048, 8192)) == {2048: (2.7,), 8192: (2.5, 3.5)}
    for bad in (["2.7", "3", "3.5"], ["2.8"], ["2.7,"], ["x"]):
        assert isinstance(fidelity.context_budgets(bad, (2048, 8192)), str)
    assert fidelity.main(["--smoke", "--budgets", "2.6"]) == 2


@pytest.mark.slow
def test_a_smoke_run_writes_each_row_as_it_completes_and_reloadable_calibrations(
    fidelity: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "fidelity.json"
    seen: list[tuple[list[str], bool]] = []  # after each row: the rows on disk, the context marked partial
    run_context = fidelity.run_context

    def recording(*args: object, on_row: object = None, **kw: object) -> object:
        def on_disk(rows: dict[str, object]) -> None:
            assert callable(on_row)
            on_row(rows)
            block = json.loads(out.read_text())["sections"]["main"]["contexts"]["512"]
            seen.append((list(block["rows"]), bool(block.get("partial"))))

        return run_context(*args, on_row=on_disk, **kw)

    monkeypatch.setattr(fidelity, "run_context", recording)
    assert (
        fidelity.main(
            [
                "--smoke",
                "--threads",
                "2",
                "--triaxial-only",
                "--skip-default",
                "--contexts",
                "512",
                "--calibrate-at-context",
                "--budgets",
                "3.5",
                "--generate",
                "2",
                "--eval-seqs",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = [
        "bf16",
        "triaxial 3.5 default@pages",
        "triaxial 3.5 calibrated",
        "triaxial 3.5 calibrated@512",
        "triaxial 3.5 held",
        "triaxial 3.5 held calibrated",
    ]
    assert seen == [(rows[: i + 1], True) for i in range(len(rows))]
    result = json.loads(out.read_text())["sections"]["main"]
    block = result["contexts"]["512"]
    assert "partial" not in block and list(block["rows"]) == rows and block["budgets"] == [3.5]
    assert set(block["comparisons"]) == {"3.5"} and block["rows"]["bf16"]["generated"] == 2
    assert all(len(r["stored_bits_per_sequence"]) == 1 for r in block["rows"].values())
    # the files as measured: each accounts for its own tokens (the tables' pages at 512 are stored apart)
    main = Calibration.from_dict(result["calibration"]["file"])
    at_ctx = Calibration.from_dict(block["calibration_at_context"]["file"])
    assert at_ctx.tokens == block["calibration_at_context"]["tokens"] and main.tokens == result["calibration"]["tokens"]


@pytest.mark.slow
def test_generate_zero_scores_every_row_without_the_greedy_column(fidelity: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "fidelity.json"
    assert (
        fidelity.main(
            [
                "--smoke",
                "--threads",
                "2",
                "--triaxial-only",
                "--skip-default",
                "--contexts",
                "512",
                "--budgets",
                "2.7",
                "--generate",
                "0",
                "--eval-seqs",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["sections"]["main"]["contexts"]["512"]["rows"]
    assert list(rows) == [
        "bf16",
        "triaxial 2.7 default@pages",
        "triaxial 2.7 calibrated",
        "triaxial 2.7 held",
        "triaxial 2.7 held calibrated",
    ]
    for r in rows.values():
        assert r["generated"] == 0 and r["first_divergence"] == [] and r["mean_first_divergence"] is None
        assert len(r["kl_per_sequence"]) == 2 and len(r["stored_bits_per_sequence"]) == 2
    assert fidelity.agree(rows["bf16"]) == "-"
    assert fidelity.main(["--smoke", "--generate", "-1"]) == 2


@pytest.mark.slow
def test_select_is_applied_again_at_a_context_other_than_the_calibration_length(
    fidelity: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # with_pages drops the tables of the calibration length (256 in --smoke, not scored here: no selection is
    # made there); at 512 the selection runs over the tables counted on 512's pages, for the main calibration
    # and the one measured at 512
    picked: dict[str, dict[str, str]] = {}
    select_tables = fidelity.select_tables

    def recording(cal: Calibration, attn: object, model: object, seqs: list[TaggedSeq], **kw: object) -> Calibration:
        out = select_tables(cal, attn, model, seqs, **kw)
        if all(len(q.ids) > 256 for q in seqs):  # the calls on 512-token prompts
            picked[str(len(picked))] = {key: fidelity.format_bits_table(t) for key, t in out.tables.items()}
        return out

    monkeypatch.setattr(fidelity, "select_tables", recording)
    out = tmp_path / "fidelity.json"
    assert (
        fidelity.main(
            [
                "--smoke",
                "--threads",
                "2",
                "--triaxial-only",
                "--skip-default",
                "--contexts",
                "512",
                "--calibrate-at-context",
                "--select",
                "--budgets",
                "2.7",
                "--generate",
                "0",
                "--eval-seqs",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())["sections"]["main"]
    # 256 is not scored: no selection there (its tables would be discarded), only at 512
    assert result["calibration"]["selection"] == {}
    block = result["contexts"]["512"]
    assert set(block["selection"]) == {"calibrated", "calibrated@512"}
    for rec in block["selection"].values():
        assert set(rec) == {"2.7"} and rec["2.7"]["chosen"] in ("kl", "attn", "default")
        kls = {name: rec["2.7"][name] for name in ("kl", "attn", "default")}
        assert rec["2.7"]["chosen"] == min(kls, key=lambda n: (kls[n], ("kl", "attn", "default").index(n)))
    rows = block["rows"]
    # the rows score the tables the selection at 512 kept: one selection per calibration, in their order
    assert [p["2.7"] for p in picked.values()] == [rows["triaxial 2.7 calibrated"]["table"], rows["triaxial 2.7 calibrated@512"]["table"]]
    if block["selection"]["calibrated"]["2.7"]["chosen"] == "default":
        assert rows["triaxial 2.7 calibrated"]["table"] == rows["triaxial 2.7 default@pages"]["table"]


@pytest.mark.slow
def test_count_on_evaluation_holds_every_tables_budget_on_the_scored_conversations(fidelity: ModuleType, tmp_path: Path) -> None:
    # the budget is counted on the evaluation conversations' pages: what the engine stored on them (token-weighted
    # over the conversations) is what the table was counted to store there, within the budget, for every table
    out = tmp_path / "fidelity.json"
    assert (
        fidelity.main(
            [
                "--smoke",
                "--threads",
                "2",
                "--triaxial-only",
                "--skip-default",
                "--contexts",
                "512",
                "--count-on-evaluation",
                "--budgets",
                "2.7,3",
                "--generate",
                "0",
                "--eval-seqs",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    block = json.loads(out.read_text())["sections"]["main"]["contexts"]["512"]
    lengths = block["tokens_per_sequence"]
    assert block["calibration_pages"]["counted_on"] == "evaluation"
    assert block["calibration_pages"]["tokens"] == block["evaluation_pages"]["tokens"] == sum(lengths)
    assert block["calibration_pages"]["counts"] == block["evaluation_pages"]["counts"]
    # the counted tables (default and calibrated at each budget); the "held" rows store what the bit-budget
    # controller chooses, not a table's count
    triaxial = {name: r for name, r in block["rows"].items() if name.startswith("triaxial") and " held" not in name}
    assert len(triaxial) == 4
    assert {name for name in block["rows"] if " held" in name} == {
        f"triaxial {b} held{ranking}" for b in ("2.7", "3") for ranking in ("", " calibrated")
    }
    for name, r in triaxial.items():
        budget = float(name.split()[1])
        stored = sum(b * n for b, n in zip(r["stored_bits_per_sequence"], lengths)) / sum(lengths)
        assert math.isclose(stored, r["stored_bits_calibration_data"], abs_tol=1e-9), name
        assert stored <= budget + 1e-9, name


def test_a_held_row_is_warmed_on_the_scored_conversations_until_it_stores_its_budget(fidelity: ModuleType, tmp_path: Path) -> None:
    import torch

    from kvserving.gateway.prompt.chat_template import ChatTemplate
    from kvserving.gateway.prompt.tagger import ChatTagger
    from kvserving.gateway.prompt.tokenizer import TextTokenizer
    from kvserving.model_dir import tiny_model_dir

    tok_dir = tiny_model_dir()
    tagger = ChatTagger(TextTokenizer.from_dir(tok_dir), ChatTemplate.from_dir(tok_dir))
    eval_path = tmp_path / "evaluation.py"
    eval_path.write_text(fidelity.joined_text(fidelity.stdlib_files()[1][0::2], 10**9))
    seqs, _ = fidelity.evaluation_conversations(eval_path, tmp_path / "extra.py", tagger, ctx=2048, n=12)
    engine = fidelity.build_engine(tok_dir, "triaxial", device=torch.device("cpu"), ctx=2048, chunk=256, held=2.7)
    controller = engine.kv.controller
    # admitting a scored sequence counts its class mix, as the scheduler's admission does (no page matches)
    seq = fidelity.admit(engine, seqs[0].ids, seqs[0].tags)
    assert controller.window == len(seqs[0].ids) // 32 + 1 and seq.num_computed == 0  # full pages + the partial one
    engine.kv.free(seq)
    warm = fidelity.warm_up(engine, seqs, 2.7)
    assert warm["reached"] and abs(warm["passes"][-1] - 2.7) <= 0.05 and warm["cut"] == controller.cut
    # it moves from the first conversation on (WARM_PAGES); the last pass left the cut where it was
    assert warm["pass_count"] == len(warm["passes"]) >= 2 and warm["moves"] >= 1
    # the next pass stores what the last warm-up pass stored: inside the dead band the cut stays
    bits = []
    for q in seqs:
        seq = fidelity.admit(engine, q.ids, q.tags)
        bits.append(fidelity.stored_bits(engine, seq.page_ids, len(q.ids)))
        engine.kv.free(seq)
    assert sum(bits) / len(bits) == pytest.approx(warm["passes"][-1]) and controller.cut == warm["cut"]


def test_runs_are_named_sections_of_one_file_per_machine(fidelity: ModuleType, tmp_path: Path) -> None:
    out, device, committed = tmp_path / "fidelity_cpu.json", tmp_path / "device.json", tmp_path / "committed.json"
    fidelity.write_section(committed, "formats", {"section": "formats", "seed": 0}, what=fidelity.WHAT, name_of=fidelity.section_of)
    fidelity.write_section(committed, "held", {"section": "held", "seed": 0}, what=fidelity.WHAT, name_of=fidelity.section_of)
    device.write_text(json.dumps({"section": "seed1", "seed": 1}))  # one run, as a device machine's --out holds it
    assert fidelity.main(["--combine", str(committed), str(device), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["what"] == fidelity.WHAT and list(doc["sections"]) == ["formats", "held", "seed1"]
    assert doc["sections"]["seed1"] == {"section": "seed1", "seed": 1}
    assert fidelity.main(["--combine", str(tmp_path / "none.json"), "--out", str(out)]) == 2  # one line, nothing written
    assert json.loads(out.read_text()) == doc


def test_a_held_calibrated_row_walks_the_calibrations_ranking(fidelity: ModuleType) -> None:
    import torch

    from kvserving.model_dir import tiny_model_dir
    from kvserving.worker.kv.cache import budget_controller

    committed = json.loads((Path(fidelity.__file__).parent / "results" / "fidelity_cpu.json").read_text())
    cal = Calibration.from_dict(committed["sections"]["held"]["calibration"]["file"])
    specs = fidelity.variants({"calibrated": cal}, triaxial_only=True, budgets=(2.7,))
    assert specs["triaxial 2.7 held"] == ("triaxial", {"held": 2.7})
    assert specs["triaxial 2.7 held calibrated"] == ("triaxial", {"held": 2.7, "ranking": "calibrated"})
    engine = fidelity.build_engine(tiny_model_dir(), "triaxial", device=torch.device("cpu"), ctx=2048, chunk=256, held=2.7, calibration=cal)
    calibrated, default = budget_controller(2.7, cal, page_size=32), budget_controller(2.7, None, page_size=32)
    assert engine.kv.controller.order == calibrated.order != default.order
    assert engine.kv.controller.cut == calibrated.cut  # the cut that averages 2.7 on the calibration's pages
    assert engine.kv.controller.window == 0  # nothing counted yet: set before any page
