"""The budget counted in stored pages (a page is INT2 only when full and all of its
tokens are 2-bit), the calibration file's page record, and plain text wrapped as
agent_load-shaped conversations for calibration."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from kvserving.bits import greedy_bits_table
from kvserving.calibrate.data import agent_wrap, load_data
from kvserving.calibrate.measure import Measurement, build_calibration
from kvserving.calibration import Calibration, page_greedy_table, pages_stored_bits
from kvserving.gateway.prompt.chat_template import ChatTemplate
from kvserving.gateway.prompt.tagger import ChatTagger
from kvserving.gateway.prompt.tokenizer import TextTokenizer
from kvserving.model_dir import tiny_model_dir
from kvserving.tags import NUM_TAGS, TEMPORAL, decode_tag, encode_tag
from kvserving.worker.model import ModelArgs

USER = encode_tag("current", "text", "user")
OBS = encode_tag("older", "text", "obs")
DELIM = encode_tag("current", "text", "delim")


def test_a_class_on_every_page_is_not_bought_for_its_token_share() -> None:
    # 10 pages of 32: five of 31 obs + 1 delim, five of 31 user + 1 delim
    pages = ((5, ((OBS, 31), (DELIM, 1))), (5, ((USER, 31), (DELIM, 1))))
    per_token = [0.0] * NUM_TAGS
    per_token[DELIM], per_token[USER], per_token[OBS] = 100.0, 2.0, 1.0
    table = page_greedy_table(3.0, per_token, pages, page_size=32, residual=0)
    # user's five pages (gain 5 * (31 * 2 + 100) per bit) beat obs's; delim would make every page INT4
    assert (table[USER], table[OBS], table[DELIM]) == (4, 2, 2)
    assert pages_stored_bits(table, pages, page_size=32, residual=0) == 3.0
    assert all(table[c] == 4 for c in range(NUM_TAGS) if c not in (USER, OBS, DELIM))  # absent: free on this data
    # the token-share rule buys delim first (1/32 of the tokens) and stores every page at 4 bits
    freq = [1e-9] * NUM_TAGS
    freq[DELIM], freq[USER], freq[OBS] = 10 / 320, 155 / 320, 155 / 320
    tokens = greedy_bits_table(3.0, gain=[p * f for p, f in zip(per_token, freq)], frequency=freq)
    assert tokens[DELIM] == 4 and pages_stored_bits(tokens, pages, page_size=32, residual=0) == 4.0


def test_pure_pages_reduce_to_the_token_rule_and_budgets_hold() -> None:
    rng = random.Random(3)
    for _ in range(20):
        classes = rng.sample(range(NUM_TAGS), 12)
        pages = tuple((rng.randint(1, 9), ((c, 32),)) for c in classes)
        per_token = [rng.random() for _ in range(NUM_TAGS)]
        total = 32 * sum(n for n, _ in pages)
        freq = [1e-12] * NUM_TAGS
        for n, ((c, _),) in pages:
            freq[c] = 32 * n / total
        for budget in (2.3, 2.7, 3.0, 3.6):
            # the walk alone is DESIGN.md's rule (the swap pass after it may do better)
            table = page_greedy_table(budget, per_token, pages, page_size=32, residual=0, improve=False)
            assert pages_stored_bits(table, pages, page_size=32, residual=0) <= budget + 1e-9
            expected = greedy_bits_table(budget, gain=[p * f for p, f in zip(per_token, freq)], frequency=freq)
            assert [table[c] for c in classes] == [expected[c] for c in classes]
    # residual tokens are INT4 whatever the table says
    assert pages_stored_bits((2,) * NUM_TAGS, ((1, ((OBS, 32),)),), page_size=32, residual=32) == 3.0


def _measured(tag_seqs: list[list[int]]) -> Measurement:
    args = ModelArgs(
        model_type="qwen3", vocab_size=16, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64
    )
    m = Measurement.empty(args)
    for tags in tag_seqs:
        for c, n in Counter(tags).items():
            m.counts[c] += n
        m.add_pages(tags)
    for c in range(NUM_TAGS):
        m.d2[c], m.d4[c] = 2.0 * m.counts[c] * (1 + c % 5), 0.1 * m.counts[c]
    return m


def test_the_calibration_records_pages_and_meets_budgets_in_stored_bits() -> None:
    seq = [USER] * 40 + [DELIM] + [OBS] * 60 + [DELIM] + [USER] * 3  # 105 tokens: 3 full pages + 9
    m = _measured([seq, seq[:64]])
    assert m.residual == 9 + 0 and sum(m.pages.values()) == 5
    assert m.pages[((USER, 32),)] == 2 and m.pages[((USER, 8), (DELIM, 1), (OBS, 23))] == 2 and m.pages[((OBS, 32),)] == 1
    cal = build_calibration(m, [2.5, 3.0, 3.5], search=False)
    assert cal.page_rule() and cal.residual == 9 and cal.page_size == 32
    for key, table in cal.tables.items():
        assert cal.stored_bits(table) <= float(key) + 1e-9
    again = Calibration.from_dict(json.loads(cal.to_json()))
    assert again == cal and again.derive_table(2.7) == cal.derive_table(2.7)
    data = json.loads(cal.to_json())
    for edit, message in [
        (lambda d: d["pages"].update(residual=3), "account for every calibration token"),
        (lambda d: d["pages"]["counts"][0][1].append([USER, 1]), "sum to the page size"),
        (lambda d: d["pages"]["counts"][0][1][0].__setitem__(0, 99), "tag 0..55"),
        (lambda d: d["pages"].update(counts={}), "must be a list"),
    ]:
        bad = json.loads(json.dumps(data))
        edit(bad)
        with pytest.raises(ValueError, match=message):
            Calibration.from_dict(bad)
    # agent shares: the budget counts token shares, pages or not
    agent = Calibration(**{**{f: getattr(cal, f) for f in Calibration.__slots__}, "frequency_source": "agent"})
    assert not agent.page_rule()


@pytest.fixture(scope="module")
def tagger() -> ChatTagger:
    d = tiny_model_dir()
    return ChatTagger(TextTokenizer.from_dir(d), ChatTemplate.from_dir(d))


def test_plain_text_becomes_agent_load_shaped_conversations(tagger: ChatTagger) -> None:
    text = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}  # line {i}\n" for i in range(1500))
    reqs = agent_wrap(text, name="m.py", chars_per_token=2.0, context_tokens=2048)
    assert len(reqs) >= 3
    used = []
    for req in reqs:
        assert req.messages[0]["role"] == "system" and req.tools
        used.append(req.messages[0]["content"])
        last = ""
        for msg in req.messages[1:]:
            if msg["role"] in ("user", "tool"):
                last = msg["content"]
                used.append(last)
            else:  # the reply quotes what the agent just read, and calls a tool with the file's name
                assert msg["role"] == "assistant" and msg["content"] and msg["content"] in last
                for call in msg.get("tool_calls", []):
                    assert json.loads(call["function"]["arguments"])["arg"].startswith("m.py:")
    assert text.startswith("".join(used))  # the text is used once, in order
    tags: Counter[int] = Counter()
    for req in reqs:
        p = tagger.build(req.messages, tools=req.tools, add_generation_prompt=False)
        assert len(p.input_ids) <= 2048
        tags.update(p.tags)
    semantic = {decode_tag(t)[2] for t in tags}
    assert semantic >= {"inst", "user", "assistant", "tool_call", "obs", "delim"}
    assert {decode_tag(t)[0] for t in tags} == set(TEMPORAL)
    shares: Counter[str] = Counter()
    for t, n in tags.items():
        shares[decode_tag(t)[2]] += n
    assert shares.most_common(1)[0][0] == "obs" and shares["obs"] > 0.3 * sum(tags.values())  # tool results dominate, as in agent_load


def test_load_data_wraps_agent_shaped_and_falls_back_to_pieces_on_short_contexts(tmp_path: Path, tagger: ChatTagger) -> None:
    f = tmp_path / "src.py"
    f.write_text("import os\n\ndef main():\n    print(os.getcwd())\n" * 400)
    seqs = load_data([f], tagger, seq_len=1024, max_tokens=4096)
    assert seqs and all(len(s.ids) <= 1024 for s in seqs)
    assert any(decode_tag(t)[2] == "tool_call" for t in seqs[0].tags)
    short = load_data([f], tagger, seq_len=128, max_tokens=512)
    assert short and all(len(s.ids) <= 128 for s in short)
    with pytest.raises(ValueError, match="wrap must be one of"):
        load_data([f], tagger, seq_len=128, max_tokens=512, wrap="nope")
