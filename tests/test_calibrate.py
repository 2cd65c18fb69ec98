"""`kvserving calibrate` and the calibration file: D_k on constructed cases, the greedy
tables against their budgets, the file and the engine config round-trip, the engine
using a calibrated table and calibrated scales, one-line CLI errors, and a whole run
on the tiny model."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import pytest
import torch

from kvserving import cli
from kvserving.bits import average_bits, bits_table_for_budget, default_stored_bits
from kvserving.calibrate.codecs import attend, head_mse, qdq_groups, qdq_int2_keys
from kvserving.calibrate.measure import Measurement, build_calibration, class_distortion
from kvserving.calibrate.data import read_requests, wrap_text
from kvserving.calibration import Calibration, LayerScales
from kvserving.config import KVCacheConfig, ModelConfig, ServingConfig
from kvserving.kernels.page_ids import page_id_bits
from kvserving.tags import NUM_TAGS, encode_tag
from kvserving.worker.kv.cache import build_kv_cache
from kvserving.worker.kv.storage import KVShape
from kvserving.worker.model import ModelArgs
from kvserving.worker.sampling import SamplingParams

USER = encode_tag("current", "text", "user")
OBS = encode_tag("older", "text", "obs")
TINY_SHAPE = (4, 2, 64)  # layers, KV heads, head_dim of the built-in tiny model


def _qkv(seed: int = 0, t: int = 96) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, 2, 32, generator=g), torch.randn(t, 1, 32, generator=g), torch.randn(t, 1, 32, generator=g))


def test_distortion_is_larger_for_the_wide_class_and_at_two_bits() -> None:
    q, k, v = _qkv()
    tags = torch.tensor([USER if i % 2 else OBS for i in range(96)])
    wide = tags == USER
    k[wide] *= 4.0  # the user tokens' K and V span a wider range: a quantization step costs more
    v[wide] *= 4.0
    d = class_distortion(q, k, v, tags)
    assert d[2][USER] > d[2][OBS] > 0 and d[4][USER] > d[4][OBS] > 0
    for c in (USER, OBS):
        assert d[4][c] < d[2][c] / 5  # 15 levels instead of 3
    assert sum(float(x) for i, x in enumerate(d[2]) if i not in (USER, OBS)) == 0.0  # absent classes cost nothing


def test_distortion_of_a_class_is_the_codec_error_of_its_tokens_only() -> None:
    q, k, v = _qkv(1, 64)
    tags = torch.tensor([USER] * 32 + [OBS] * 32)
    d = class_distortion(q, k, v, tags)
    ref = attend(q, k, v)
    # reference: class OBS (tokens 32..63, one page) through the triaxial codec by hand
    k2, v2 = k.clone(), v.clone()
    k2[32:] = qdq_int2_keys(k[32:])
    v2[32:] = qdq_groups(v[32:], 2)
    assert float(d[2][OBS]) == pytest.approx(float(head_mse(attend(q, k2, v2), ref).max()), rel=1e-6)
    k4, v4 = k.clone(), v.clone()
    k4[:32], v4[:32] = qdq_groups(k[:32], 4), qdq_groups(v[:32], 4)
    assert float(d[4][USER]) == pytest.approx(float(head_mse(attend(q, k4, v4), ref).max()), rel=1e-6)


def _measurement(gains: dict[int, float], counts: dict[int, int]) -> Measurement:
    args = ModelArgs(
        model_type="qwen3", vocab_size=16, hidden_size=64, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64
    )
    m = Measurement.empty(args)
    for c, n in counts.items():
        m.counts[c] = n
        m.d4[c] = 0.01 * n
        m.d2[c] = m.d4[c] + gains.get(c, 0.0)
    m.k_amax = [448.0, 224.0, 0.0, 1.0]
    m.v_amax = [6 * 448.0, 1.0, 2.0, 3.0]
    return m


def test_tables_meet_their_budgets_and_upgrade_the_most_sensitive_class_first() -> None:
    counts = {c: 10 + 7 * c for c in range(0, NUM_TAGS, 3)}
    gains = {c: float((c * 37) % 11) * counts[c] for c in counts}  # per-token gain (c * 37) % 11
    cal = build_calibration(_measurement(gains, counts), [2.3, 2.7, 3.0, 3.5], search=False)
    freq = cal.budget_frequency()
    for key, table in cal.tables.items():
        avg = average_bits(table, freq)
        assert float(key) - 0.2 < avg <= float(key) + 1e-9, key
    best = max(counts, key=lambda c: gains[c] / counts[c])
    assert cal.tables["2.3"][best] == 4
    assert all(cal.tables["3.5"][c] >= cal.tables["2.3"][c] for c in range(NUM_TAGS))  # more budget, never fewer bits
    # absent classes cost no budget: always 4 bits
    assert all(cal.tables["2.3"][c] == 4 for c in range(NUM_TAGS) if c not in counts)
    # scales: amax / 448 (fp8) and amax / (6 * 448) (nvfp4); an all-zero layer keeps 1.0
    assert cal.scales["fp8_e4m3"].k == (1.0, 0.5, 1.0, 1.0 / 448)
    assert cal.scales["nvfp4"].v == (1.0, 1.0 / 2688, 2.0 / 2688, 3.0 / 2688)


def _calibration_file(tmp_path: Path, table: tuple[int, ...], *, scales: bool = True) -> Path:
    counts = {c: 100 for c in range(NUM_TAGS)}
    cal = build_calibration(_measurement({c: 1.0 for c in counts}, counts), [], search=False)
    cal.tables["2.7"] = table
    if scales:
        cal.scales["fp8_e4m3"] = LayerScales((0.5, 0.25, 2.0, 1.0), (1.5, 1.0, 1.0, 0.125), "search")
    cal = Calibration(
        **{
            **{f: getattr(cal, f) for f in Calibration.__slots__},
            "num_layers": TINY_SHAPE[0],
            "num_kv_heads": TINY_SHAPE[1],
            "head_dim": TINY_SHAPE[2],
        }
    )
    path = tmp_path / "calibration.json"
    path.write_text(cal.to_json())
    return path


def test_the_calibration_file_round_trips_and_refuses_bad_content(tmp_path: Path) -> None:
    path = _calibration_file(tmp_path, (2,) * NUM_TAGS)
    cal = Calibration.load(path)
    assert Calibration.from_dict(json.loads(cal.to_json())) == cal
    data = json.loads(path.read_text())
    for edit, message in [
        (lambda d: d["tables"].update({"5": [2] * NUM_TAGS}), "budget in \\[2, 4\\]"),
        (lambda d: d["tables"].update({"2.5": [3] * NUM_TAGS}), "entries must be 2 or 4"),
        (lambda d: d["distortion"].pop("4"), "distortion"),
        (lambda d: d["scales"]["fp8_e4m3"].update(k=[1.0]), "scales.fp8_e4m3.k must be a list of 4"),
        (lambda d: d.update(version=7), "version"),
    ]:
        bad = json.loads(json.dumps(data))
        edit(bad)
        with pytest.raises(ValueError, match=message):
            Calibration.from_dict(bad)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="broken.json is not valid JSON"):
        Calibration.load(tmp_path / "broken.json")


def test_engine_config_round_trips_with_a_calibration() -> None:
    cfg = ServingConfig(kv_cache=KVCacheConfig(dtype="triaxial", bit_budget=2.5, calibration="/etc/kvserving/calibration/c.json"))
    assert ServingConfig.from_json(cfg.to_json()) == cfg
    assert ServingConfig.from_json(ServingConfig().to_json()).kv_cache.calibration is None
    with pytest.raises(ValueError, match="kv_cache.calibration must be a non-empty file path"):
        KVCacheConfig(dtype="triaxial", calibration="")


def test_the_engine_uses_the_calibrated_table(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from kvserving.worker.engine import LLMEngine

    default = bits_table_for_budget(2.7)
    assert default[USER] == 4 and default[OBS] == 2
    table = tuple(2 if c == USER else 4 for c in range(NUM_TAGS))  # user text at 2 bits, everything else 4
    path = _calibration_file(tmp_path, table)
    cfg = ServingConfig(
        model=ModelConfig(max_model_len=256),
        # the fixed table: the file's table as it is (the held control moves the cut from the traffic)
        kv_cache=KVCacheConfig(dtype="triaxial", bit_budget=2.7, memory_bytes=8 * 2**20, calibration=str(path), bit_budget_control="fixed"),
    )
    with caplog.at_level(logging.INFO, logger="kvserving.worker"):
        engine = LLMEngine(cfg, device="cpu")
    assert engine.kv_cache.bits_table == table
    assert engine.kv_cache.table_source == f"calibrated (stored, {path})"
    assert any("calibrated (stored" in r.getMessage() for r in caplog.records)
    # a full page of user text is now stored INT2 (the default table keeps user text at 4 bits)
    engine.add_request("r", list(range(40)), SamplingParams(max_tokens=4), tags=[USER] * 40)
    engine.step()
    seq = engine.requests["r"]
    assert [page_id_bits(p) for p in seq.page_ids] == [2, 4]
    assert engine.kv.page_bits_for(seq, 0, 2) == [2, 4]
    # a budget the file has no table for is derived from its measurements
    derived = build_kv_cache(
        KVCacheConfig(dtype="triaxial", bit_budget=3.0, memory_bytes=2**20, calibration=str(path)),
        KVShape(*TINY_SHAPE),
        budget_bytes=2**20,
        device="cpu",
        model_dtype=torch.float32,
    )
    assert derived.table_source.startswith("calibrated (derived")
    assert derived.bits_table == Calibration.load(path).derive_table(3.0)


def test_calibrated_global_scales_reach_the_storage(tmp_path: Path) -> None:
    path = _calibration_file(tmp_path, (4,) * NUM_TAGS)

    def cache(scale: str, dtype: str = "fp8_e4m3") -> tuple[list[float], list[float], str]:
        kv = build_kv_cache(
            KVCacheConfig(dtype=dtype, memory_bytes=2**20, global_scale=scale, calibration=str(path)),
            KVShape(*TINY_SHAPE),
            budget_bytes=2**20,
            device="cpu",
            model_dtype=torch.float32,
        )
        return kv.storage.k_scales, kv.storage.v_scales, kv.scales_source

    k, v, source = cache("calibrated")
    assert (k, v) == ([0.5, 0.25, 2.0, 1.0], [1.5, 1.0, 1.0, 0.125])
    assert source.startswith("calibration") and "search" in source
    assert cache("static")[:2] == ([1.0] * 4, [1.0] * 4)
    # the file's nvfp4 scales are its amax ones
    assert cache("calibrated", "nvfp4")[0] == list(Calibration.load(path).scales["nvfp4"].k)


def test_a_calibration_for_another_model_shape_is_refused(tmp_path: Path) -> None:
    path = _calibration_file(tmp_path, (4,) * NUM_TAGS)
    with pytest.raises(ValueError, match="is for 4 layers x 2 KV heads x 64, the model has 2 x 2 x 64"):
        build_kv_cache(
            KVCacheConfig(dtype="triaxial", memory_bytes=2**20, calibration=str(path)),
            KVShape(2, 2, 64),
            budget_bytes=2**20,
            device="cpu",
            model_dtype=torch.float32,
        )


def test_plain_text_becomes_agent_conversations_and_jsonl_is_read_as_requests(tmp_path: Path) -> None:
    reqs = wrap_text("abcdefghij" * 20, name="f.txt", piece_chars=10)
    assert len(reqs) == 2  # 20 pieces: 17 + 3
    roles = [m["role"] for m in reqs[0].messages]
    assert roles == ["system"] + ["user", "assistant", "tool", "assistant"] * 4
    assert reqs[0].messages[2]["tool_calls"][0]["function"]["name"] == "read_file"
    (tmp_path / "c.jsonl").write_text(
        json.dumps([{"role": "user", "content": "hi"}])
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": None})
        + "\n"
    )
    assert [r.messages[0]["content"] for r in read_requests(tmp_path / "c.jsonl", piece_chars=10)] == ["hi", "x"]
    (tmp_path / "bad.jsonl").write_text("{\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: not valid JSON"):
        read_requests(tmp_path / "bad.jsonl", piece_chars=10)


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["--data", "missing.txt"], 1, "kvserving calibrate: error: data file missing.txt does not exist"),
        (["--data", "x.txt", "--bit-budget", "5"], 2, "argument --bit-budget: must be a number in [2, 4], got 5"),
        (["--data", "x.txt", "--bit-budget", "lots"], 2, "argument --bit-budget: must be a number in [2, 4], got 'lots'"),
        (["--data", "empty.txt"], 1, "kvserving calibrate: error: data file"),
    ],
)
def test_cli_errors_are_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], code: int, message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text("  \n")
    try:
        rc = cli.main(["calibrate", *argv, "--out", "c.json"])
    except SystemExit as exc:
        rc = int(exc.code or 0)
    err = capsys.readouterr().err
    assert rc == code
    assert len(err.splitlines()) == 1 and message in err, err


def test_the_engine_sizes_its_capacity_from_the_calibration_pages(tmp_path: Path) -> None:
    # three full pages of user text and one of tool results: with user text at 2 bits the
    # calibration data stores (3 x 2 + 4) / 4 = 2.5 bits, the agent pages of the default far more
    m = _measurement({USER: 1.0, OBS: 5.0}, {USER: 96, OBS: 32})
    m.add_pages([USER] * 96 + [OBS] * 32)
    cal = build_calibration(m, [], search=False)
    table = tuple(2 if c == USER else 4 for c in range(NUM_TAGS))
    cal.tables["2.7"] = table
    cal = Calibration(
        **{
            **{f: getattr(cal, f) for f in Calibration.__slots__},
            "num_layers": TINY_SHAPE[0],
            "num_kv_heads": TINY_SHAPE[1],
            "head_dim": TINY_SHAPE[2],
        }
    )
    assert cal.stored_bits(table) == 2.5
    path = tmp_path / "calibration.json"
    path.write_text(cal.to_json())
    kv = build_kv_cache(
        KVCacheConfig(dtype="triaxial", bit_budget=2.7, memory_bytes=2**20, calibration=str(path), bit_budget_control="fixed"),
        KVShape(*TINY_SHAPE),
        budget_bytes=2**20,
        device="cpu",
        model_dtype=torch.float32,
    )
    assert kv.bits_table == table and kv.stored_bits == 2.5 and kv.int2_share == 0.75
    assert default_stored_bits(table) > 3.5  # user text shares most agent pages with other classes
    assert kv.capacity_tokens == kv.capacity_tokens_at(0.75) > kv.capacity_tokens_at(0.0)
    assert "-> 2.50 stored bits" in kv.describe()


def test_calibrate_on_the_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "notes.txt"
    data.write_text("def add(a, b):\n    return a + b  # adds two numbers\n" * 60)
    out = tmp_path / "cal.json"
    rc = cli.main(
        [
            "calibrate",
            "--data",
            str(data),
            "--bit-budget",
            "2.5",
            "3",
            "--seq-len",
            "160",
            "--max-tokens",
            "160",
            "--out",
            str(out),
            "--device",
            "cpu",
            "--chunk",
            "0",
        ]
    )
    assert rc == 0
    cal = Calibration.load(out)
    assert (cal.num_layers, cal.num_kv_heads, cal.head_dim) == TINY_SHAPE
    assert 100 <= cal.tokens <= 160
    assert sorted(cal.tables) == ["2.5", "3"]
    assert cal.page_rule() and cal.residual + cal.page_size * sum(n for n, _ in cal.pages) == cal.tokens
    for key, table in cal.tables.items():
        assert cal.stored_bits(table) <= float(key) + 1e-9  # counted as the engine stores pages
    seen = [c for c in range(NUM_TAGS) if cal.frequency[c] > 0]
    assert encode_tag("current", "text", "delim") in seen and len(seen) >= 8  # the template's roles are tagged
    assert all(cal.distortion[2][c] > cal.distortion[4][c] > 0 for c in seen)
    assert set(cal.scales) == {"fp8_e4m3", "nvfp4"} and all(s.method == "amax" for s in cal.scales.values())
    assert "budget 2.5" in capsys.readouterr().out


def test_page_data_counts_the_budget_on_the_pages_of_other_data(tmp_path: Path) -> None:
    # D_k measured on code; the budget counted on the first as-many-tokens of a sample of traffic (long tool
    # results): the file's pages are that sample's, and every table is within its budget on them
    from kvserving.bits import count_page_mixes, page_records, pages_stored_bits
    from kvserving.calibrate.data import load_data
    from kvserving.gateway.prompt.chat_template import ChatTemplate
    from kvserving.gateway.prompt.tagger import ChatTagger
    from kvserving.gateway.prompt.tokenizer import TextTokenizer
    from kvserving.model_dir import tiny_model_dir

    data = tmp_path / "notes.txt"
    data.write_text("def add(a, b):\n    return a + b  # adds two numbers\n" * 60)
    traffic = tmp_path / "traffic.jsonl"
    call = {"type": "function", "function": {"name": "read_file", "arguments": {"path": "x.py"}}}
    messages = [
        {"role": "system", "content": "You read files."},
        {"role": "user", "content": "What does x.py do?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "import os\nprint(os.getcwd())\n" * 12},
    ]
    traffic.write_text(json.dumps({"messages": messages}) + "\n")
    out = tmp_path / "cal.json"
    assert (
        cli.main(
            [
                "calibrate",
                "--data",
                str(data),
                "--page-data",
                str(traffic),
                "--bit-budget",
                "2.5",
                "3",
                "--seq-len",
                "160",
                "--max-tokens",
                "160",
                "--out",
                str(out),
                "--device",
                "cpu",
                "--chunk",
                "0",
            ]
        )
        == 0
    )
    cal = Calibration.load(out)
    d = tiny_model_dir()
    tagger = ChatTagger(TextTokenizer.from_dir(d), ChatTemplate.from_dir(d))
    sample = load_data([traffic], tagger, seq_len=160, max_tokens=160)
    measured = load_data([data], tagger, seq_len=160, max_tokens=160)
    assert len(sample[0].tags) >= cal.tokens  # one conversation holds as many tokens as were measured
    pages: Counter[tuple[tuple[int, int], ...]] = Counter()
    residual = count_page_mixes(pages, sample[0].tags[: cal.tokens], cal.page_size)
    assert cal.pages == page_records(pages) and cal.residual == residual
    own: Counter[tuple[tuple[int, int], ...]] = Counter()
    count_page_mixes(own, measured[0].tags, cal.page_size)
    assert page_records(own) != cal.pages  # not the calibration data's pages
    assert sorted(cal.tables) == ["2.5", "3"]
    for key, table in cal.tables.items():
        stored = pages_stored_bits(table, page_records(pages), page_size=cal.page_size, residual=residual)
        assert stored == cal.stored_bits(table) <= float(key) + 1e-9


def test_the_engine_keeps_the_calibration_files_scales(tmp_path: Path) -> None:
    from kvserving.worker.engine import LLMEngine

    path = _calibration_file(tmp_path, (4,) * NUM_TAGS)
    cfg = ServingConfig(
        model=ModelConfig(max_model_len=256),
        kv_cache=KVCacheConfig(dtype="fp8_e4m3", global_scale="calibrated", memory_bytes=8 * 2**20, calibration=str(path)),
    )
    engine = LLMEngine(cfg, device="cpu")
    assert engine.storage.k_scales == [0.5, 0.25, 2.0, 1.0]
