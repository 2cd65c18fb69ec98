"""kvserving.calibrate.kl: the KL metric of `kvserving calibrate` on the built-in tiny model --
the chunked quantized attention against a hand computation, the page rule of table_bits,
class_kl's values, the additive prediction, and (the point of it) table_kl equal to the KL
the engine's own triaxial KV path gives on the same prompt."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvserving import cli
from kvserving.calibrate.codecs import attend, qdq_groups, qdq_int2_keys
from kvserving.calibrate.kl import (
    EXACT,
    QuantizedKV,
    class_kl,
    kl_sum,
    log_probs,
    predicted,
    quantize_positions,
    table_bits,
    table_kl,
)
from kvserving.calibration import Calibration
from kvserving.config import KVCacheConfig, ModelConfig, SchedulerConfig, ServingConfig
from kvserving.model_dir import tiny_model_dir
from kvserving.tags import NUM_TAGS, encode_tag
from kvserving.worker.attention import causal_attention
from kvserving.worker.model import load_model

USER = encode_tag("current", "text", "user")
OBS = encode_tag("turn_m1", "text", "obs")
DELIM = encode_tag("current", "text", "delim")
CPU = torch.device("cpu")


def _qkv(t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, 4, 64, generator=g)
    k = torch.randn(t, 2, 64, generator=g) * 2 + torch.randn(1, 2, 64, generator=g) * 5  # channel offsets
    v = torch.randn(t, 2, 64, generator=g)
    return q, k, v


def test_quantized_attention_reads_exact_kv_in_its_own_chunk_and_stored_kv_before_it() -> None:
    t, chunk = 100, 40
    q, k, v = _qkv(t)
    bits = torch.tensor([2] * 64 + [4] * 20 + [EXACT] * 16)
    kq, vq = quantize_positions(k, v, (bits == 4).nonzero().squeeze(1), (bits == 2).nonzero().squeeze(1))
    # the stored K/V: INT2 keys per channel over runs of 32 two-bit tokens, INT4 per token, the rest exact
    assert torch.equal(kq[:32], qdq_int2_keys(k[:32])) and torch.equal(kq[32:64], qdq_int2_keys(k[32:64]))
    assert torch.equal(vq[:64], qdq_groups(v[:64], 2)) and torch.equal(kq[64:84], qdq_groups(k[64:84], 4))
    assert torch.equal(kq[84:], k[84:]) and not torch.equal(kq[:64], k[:64])
    out = QuantizedKV(bits, chunk)(0, q, k, v)
    scale = 1.0 / math.sqrt(64)
    for s in (0, 40, 80):  # chunk s: stored K/V before s, its own exact K/V from s
        e = min(t, s + chunk)
        want = causal_attention(q[s:e], torch.cat([kq[:s], k[s:e]]), torch.cat([vq[:s], v[s:e]]), q_offset=s, sm_scale=scale)
        assert torch.allclose(out[s:e], want, atol=1e-6)
    assert torch.equal(QuantizedKV(bits, 0)(0, q, k, v), attend(q, kq, vq))  # chunk 0: every query on stored K/V
    assert torch.equal(QuantizedKV(bits, t)(0, q, k, v), attend(q, k, v))  # one chunk: nothing stored is read
    with pytest.raises(ValueError, match="bits must be 16, 4 or 2"):
        QuantizedKV(torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="chunk must be >= 0"):
        QuantizedKV(bits, -1)


def test_table_bits_follows_the_page_rule() -> None:
    table = [4] * NUM_TAGS
    table[USER] = table[OBS] = 2
    # page 0 all user (2-bit classes) -> 2; page 1 user + one delimiter -> 4; page 2 obs -> 2; 5 residual -> 4
    tags = [USER] * 32 + [USER] * 31 + [DELIM] + [OBS] * 32 + [OBS] * 5
    bits = table_bits(torch.tensor(tags), table)
    assert bits.tolist() == [2] * 32 + [4] * 32 + [2] * 32 + [4] * 5
    assert table_bits(torch.tensor([USER] * 31), table).tolist() == [4] * 31  # no full page
    with pytest.raises(ValueError, match="56 entries"):
        table_bits(torch.tensor(tags), [2] * 8)


def test_predicted_sums_each_tokens_per_token_distortion() -> None:
    distortion = {2: [0.0] * NUM_TAGS, 4: [0.0] * NUM_TAGS}
    distortion[2][USER], distortion[4][USER] = 10.0, 1.0  # over 5 calibration tokens
    distortion[2][OBS], distortion[4][OBS] = 6.0, 3.0  # over 3
    counts = [0.0] * NUM_TAGS
    counts[USER], counts[OBS] = 5.0, 3.0
    tags = torch.tensor([USER, USER, OBS, OBS, DELIM])
    bits = torch.tensor([2, 4, 2, 4, 2])
    assert predicted(distortion, counts, tags, bits) == pytest.approx(10 / 5 + 1 / 5 + 6 / 3 + 3 / 3 + 0)


@pytest.fixture(scope="module")
def tiny() -> tuple[Path, object]:
    path = tiny_model_dir()
    _, model = load_model(path, dtype=torch.float32, device=CPU)
    return path, model


def _prompt(n: int = 160, seed: int = 1) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 400, (n,), generator=g).tolist()
    tags = [USER] * 64 + [OBS] * 64 + [DELIM] * (n - 128)
    return ids, tags


def test_class_kl_is_zero_for_absent_classes_and_larger_at_two_bits(tiny: tuple[Path, object]) -> None:
    _, model = tiny
    ids, tags = _prompt()
    t = torch.tensor(tags)
    d = class_kl(model, ids, t, device=CPU, chunk=48)  # type: ignore[arg-type]
    for c in range(NUM_TAGS):
        if c in (USER, OBS, DELIM):
            assert d[2][c] > d[4][c] > 0, c
        else:
            assert d[2][c] == d[4][c] == 0
    # the value is the summed KL of the forward with only that class quantized
    ref = log_probs(model, ids, None, device=CPU)  # type: ignore[arg-type]
    only_obs = torch.where(t == OBS, 2, EXACT)
    assert float(d[2][OBS]) == pytest.approx(kl_sum(ref, log_probs(model, ids, only_obs, device=CPU, chunk=48)), rel=1e-9)  # type: ignore[arg-type]
    # one chunk holding the whole prompt never reads stored K/V: nothing to measure
    whole = class_kl(model, ids, t, device=CPU, chunk=len(ids))  # type: ignore[arg-type]
    assert float(whole[2].abs().sum()) == 0.0


def test_table_kl_is_the_kl_of_the_engines_triaxial_path(tiny: tuple[Path, object]) -> None:
    """The calibration's measurement equals what the engine computes: chunked prefill through its
    pool (quantize-on-write, INT2 pages only when full and all-2-bit, the extend path)."""
    from kvserving.worker.engine import LLMEngine
    from kvserving.worker.sampling import SamplingParams, make_generator
    from kvserving.worker.sequence import ScheduledChunk, Sequence

    path, model = tiny
    ids, tags = _prompt(200)
    table = [4] * NUM_TAGS
    table[USER] = table[OBS] = 2
    chunk = 64
    cfg = ServingConfig(
        model=ModelConfig(path=str(path), max_model_len=256),
        kv_cache=KVCacheConfig(dtype="triaxial", memory_bytes=8 * 2**20),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=chunk, chunk_size=chunk),
    )
    engine = LLMEngine(cfg, device="cpu", bits_table=tuple(table))
    seq = Sequence("s", list(ids), SamplingParams(max_tokens=1), make_generator(0), tags=list(tags))
    assert engine.kv.allocate_until(seq, len(ids))
    parts = []
    with torch.inference_mode():
        for s in range(0, len(ids), chunk):
            n = min(chunk, len(ids) - s)
            engine.attention.meta = engine.runner._metadata([ScheduledChunk(seq, s, n)])
            hidden = engine.model(torch.tensor(ids[s : s + n]), torch.arange(s, s + n), engine.attention)
            seq.num_computed = s + n
            parts.append(torch.log_softmax(engine.model.compute_logits(hidden).float(), dim=-1))
    engine.attention.meta = None
    engine_logp = torch.cat(parts)
    ref = log_probs(model, ids, None, device=CPU)  # type: ignore[arg-type]
    engine_kl = kl_sum(ref, engine_logp)
    ours = table_kl(model, ids, torch.tensor(tags), table, device=CPU, chunk=chunk, ref=ref)  # type: ignore[arg-type]
    assert engine_kl > 1e-4
    assert ours == pytest.approx(engine_kl, rel=1e-4)  # 3.5e-6 apart when written
    # and it is not the decode view's (every query on stored K/V) nor the all-exact one
    assert table_kl(model, ids, torch.tensor(tags), table, device=CPU, chunk=0, ref=ref) > 1.5 * engine_kl  # type: ignore[arg-type]


def test_cli_metrics_and_served_page_lengths(tmp_path: Path) -> None:
    data = tmp_path / "notes.txt"
    data.write_text("def add(a, b):\n    return a + b  # adds two numbers\n" * 400)
    common = ["calibrate", "--data", str(data), "--bit-budget", "3", "--seq-len", "150", "--max-tokens", "300", "--device", "cpu"]
    kl, attn, paged = tmp_path / "kl.json", tmp_path / "attn.json", tmp_path / "paged.json"
    assert cli.main([*common, "--out", str(kl), "--chunk", "64"]) == 0
    assert cli.main([*common, "--out", str(attn), "--metric", "attn"]) == 0
    assert cli.main([*common, "--out", str(paged), "--chunk", "64", "--page-seq-len", "640"]) == 0
    a, b, c = Calibration.load(kl), Calibration.load(attn), Calibration.load(paged)
    seen = [k for k in range(NUM_TAGS) if a.frequency[k] > 0]
    assert a.frequency == b.frequency and a.pages == b.pages  # the same prompts
    assert any(a.distortion[2][k] != b.distortion[2][k] for k in seen)  # measured differently
    assert c.distortion == a.distortion and c.pages != a.pages  # pages from 640-token conversations
    assert c.residual + c.page_size * sum(n for n, _ in c.pages) == c.tokens  # as many tokens as measured
    assert (sum(n for n, _ in a.pages), a.residual) == (8, 44)  # two prompts of 150 tokens: 4 pages + 22 each
    assert (sum(n for n, _ in c.pages), c.residual) == (9, 12)  # 300 tokens of one 640-token conversation
    assert c.stored_bits(c.tables["3"]) <= 3.0 + 1e-9
    # a prompt no longer than one chunk has nothing to measure
    assert cli.main([*common, "--out", str(tmp_path / "x.json"), "--chunk", "4096"]) != 0


def test_select_keeps_the_candidate_with_the_least_whole_table_kl(tmp_path: Path, tiny: tuple[Path, object]) -> None:
    from kvserving.calibrate.data import load_data
    from kvserving.calibrate.measure import CANDIDATES, calibrate
    from kvserving.gateway.prompt.chat_template import ChatTemplate
    from kvserving.gateway.prompt.tagger import ChatTagger
    from kvserving.gateway.prompt.tokenizer import TextTokenizer

    path, model = tiny
    data = tmp_path / "notes.txt"
    data.write_text("def add(a, b):\n    return a + b  # adds two numbers\n" * 400)
    record: dict[str, dict[str, float | str]] = {}
    cal = calibrate(
        path, [data], (2.5, 3.0), seq_len=150, max_tokens=300, device="cpu", chunk=64, select=True, selection=record, show_progress=False
    )
    plain = calibrate(path, [data], (2.5, 3.0), seq_len=150, max_tokens=300, device="cpu", chunk=64, show_progress=False)
    assert cal.distortion == plain.distortion and sorted(record) == ["2.5", "3"]
    tagger = ChatTagger(TextTokenizer.from_dir(path), ChatTemplate.from_dir(path))
    seqs = load_data([data], tagger, seq_len=150, max_tokens=300)
    for key, rec in record.items():
        kls = {name: float(rec[name]) for name in CANDIDATES}
        assert rec["chosen"] == min(CANDIDATES, key=lambda n: (kls[n], CANDIDATES.index(n)))
        assert cal.stored_bits(cal.tables[key]) <= float(key) + 1e-9
        # the recorded KL is the chosen table's, measured whole on the calibration prompts
        measured = sum(
            table_kl(model, q.ids, torch.tensor(q.tags), cal.tables[key], device=CPU, chunk=64)  # type: ignore[arg-type,misc]
            for q in seqs
        )
        assert measured == pytest.approx(kls[str(rec["chosen"])], rel=1e-9)
        if rec["chosen"] == "kl":
            assert cal.tables[key] == plain.tables[key]
    assert plain.tables == {k: plain.derive_table(float(k)) for k in plain.tables}  # without --select: the KL search's
