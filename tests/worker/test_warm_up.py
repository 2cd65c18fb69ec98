"""The warm-up a worker runs before it says ready: the step shapes it reaches, and an engine left as it was."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from kvserving.config import KVCacheConfig, ModelConfig, SchedulerConfig, ServingConfig
from kvserving.worker import warm_up
from kvserving.worker.cuda_graphs import table_widths
from kvserving.worker.engine import LLMEngine
from kvserving.worker.sampling import SamplingParams
from kvserving.worker.sequence import ScheduledChunk


def test_row_counts_hold_a_one_a_multiple_of_16_and_neither_in_every_power_of_two_class() -> None:
    assert warm_up.row_counts(1) == [1]
    assert warm_up.row_counts(5) == [1, 2, 3, 4, 5]
    assert warm_up.row_counts(64) == [1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 24, 32, 33, 48, 64]
    assert warm_up.row_counts(100) == [1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 24, 32, 33, 48, 64, 65, 96, 100]
    counts = warm_up.row_counts(2048)
    for k in range(5, 12):  # classes (2^(k-1), 2^k]: a multiple of 16 and a count that is not
        cls = [n for n in counts if 2 ** (k - 1) < n <= 2**k]
        assert any(n % 16 == 0 for n in cls) and any(n % 16 for n in cls), (k, cls)
    with pytest.raises(ValueError, match="limit"):
        warm_up.row_counts(0)


def small_plan(*, decode: bool) -> warm_up.WarmUpPlan:
    return warm_up.plan_warm_up(max_num_batched_tokens=64, chunk_size=32, max_num_seqs=4, page_size=16, max_prompt=200, decode=decode)


def test_plan_fills_one_step_with_each_row_count_then_extends_a_cached_prefix() -> None:
    warm = small_plan(decode=False)
    fresh = [g for g in warm.groups if g.name.startswith("fresh")]
    assert [sum(t.prompt_len for t in g.turns) for g in fresh] == warm_up.row_counts(64)
    assert [t.prompt_len for t in fresh[-1].turns] == [32, 32]  # 64 rows: two full chunks
    assert all(t.prompt_len <= 32 and t.extends is None for g in fresh for t in g.turns)
    extend = [g for g in warm.groups if g.name.startswith("extend")]
    assert [g.name for g in extend] == [f"extend {n}" for n in warm_up.row_counts(64)]
    base = 64  # four pages: a prefix the chunks after it start at
    for g in extend:
        head, *rest = g.turns
        assert head == warm_up.Turn(base + 1)
        assert all(t.extends == 0 and t.waits and t.prompt_len - base <= 32 for t in rest)
        assert sum(t.prompt_len - base for t in rest) == int(g.name.split()[1])
    assert [g.name for g in warm.groups if g.name.startswith("long")] == ["long 200"]  # chunks at 0, 32, .., 192
    alone = warm_up.plan_warm_up(
        max_num_batched_tokens=64, chunk_size=32, max_num_seqs=4, page_size=16, max_prompt=200, decode=False, longest=1000
    )
    assert [g.name for g in alone.groups if g.name.startswith("long")] == ["long 1000"]
    assert not any(g.name.startswith("decode") for g in warm.groups)


def test_plan_for_a_decoding_worker_adds_decode_rows_beside_a_new_chunk() -> None:
    warm = small_plan(decode=True)
    decode = [g for g in warm.groups if g.name.startswith("decode")]
    # 17 pages + 1 = 273 tokens > 200 - 4 generated: both long contexts are the longest prompt
    short = [f"decode {b} short" for b in (1, 2, 3)]
    assert [g.name for g in decode] == [*short, "decode 1 x 196", "decode 2 x 196", "decode 3 x 196"]
    for g in decode:
        *rows, joiner = g.turns
        assert all(t.max_tokens == 4 and not t.waits for t in rows) and joiner.waits and joiner.max_tokens == 1


def test_plan_leaves_out_what_a_short_context_cannot_hold() -> None:
    # a prompt of at most 16 tokens (one page): no cached prefix with a chunk after it, no long contexts
    warm = warm_up.plan_warm_up(max_num_batched_tokens=64, chunk_size=32, max_num_seqs=4, page_size=16, max_prompt=16, decode=True)
    fresh = [f"fresh {n}" for n in warm_up.row_counts(64)]
    decode = [f"decode {b} short" for b in (1, 2, 3)]  # 16 - 4 generated: no context longer than a page
    assert [g.name for g in warm.groups] == fresh + decode
    assert all(t.prompt_len <= 16 for g in warm.groups for t in g.turns)
    with pytest.raises(ValueError, match=">= 1"):
        warm_up.plan_warm_up(max_num_batched_tokens=0, chunk_size=32, max_num_seqs=4, page_size=16, max_prompt=200, decode=True)


def test_a_waiting_turn_joins_once_the_turns_before_it_that_do_not_wait_started() -> None:
    group = warm_up.Group("g", (warm_up.Turn(3), warm_up.Turn(3), warm_up.Turn(20, waits=True), warm_up.Turn(21, waits=True)))
    assert warm_up.due(group, 0, [False] * 4) and warm_up.due(group, 1, [False] * 4)
    assert not warm_up.due(group, 2, [True, False, False, False])
    assert warm_up.due(group, 2, [True, True, False, False])
    assert warm_up.due(group, 3, [True, True, False, False])  # the waiting turn before it is not waited for
    assert not warm_up.due(group, 4, [True] * 4)  # every turn added


def test_prompts_are_seeded_and_an_extension_starts_with_the_prompt_it_extends() -> None:
    warm = small_plan(decode=True)
    a, b = warm_up.prompts_of(warm, vocab_size=300), warm_up.prompts_of(warm, vocab_size=300)
    assert a == b
    for group, ids in zip(warm.groups, a):
        assert [len(p) for p in ids] == [t.prompt_len for t in group.turns]
        assert all(warm_up.FIRST_TOKEN <= t < 300 for p in ids for t in p)
        for turn, p in zip(group.turns, ids):
            if turn.extends is not None:
                head = ids[turn.extends]
                assert p[: len(head)] == head[: len(p)]
    with pytest.raises(ValueError, match="vocab_size"):
        warm_up.prompts_of(warm, vocab_size=warm_up.FIRST_TOKEN)


def test_triaxial_prompts_are_two_bit_but_their_last_page() -> None:
    table = [4] * 56
    table[7] = 2
    assert warm_up.tags_of(40, page_size=32, bits_table=table) == [7] * 8 + [0] * 32
    assert warm_up.tags_of(20, page_size=32, bits_table=table) == [0] * 20
    assert warm_up.tags_of(40, page_size=32, bits_table=None) is None
    assert warm_up.tags_of(40, page_size=32, bits_table=[4] * 56) is None  # no 2-bit tag: untagged
    assert warm_up.tags_of(40, page_size=32, bits_table=table, four_bit=True) == [0] * 40


class StepLog:
    """The chunks of every step the engine ran: (start, tokens, prompt) per chunk."""

    def __init__(self, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps: list[list[tuple[int, int, bool]]] = []
        execute = engine.runner.execute

        def logged(chunks: list[ScheduledChunk], **kw: Any) -> Any:
            self.steps.append([(c.start, c.num_tokens, c.start < len(c.seq.prompt_ids)) for c in chunks])
            return execute(chunks, **kw)

        monkeypatch.setattr(engine.runner, "execute", logged)


def engine_for(model_dir: Path, dtype: str, **kv: Any) -> LLMEngine:
    # A 768-token context still gives page tables of several widths (16, 24, 32 and 48 pages of 16 tokens; 16 and 24
    # of 32), two long decode contexts and a long prompt of 12 chunks. Every claim below is made against the engine's
    # own plan and widths, so it holds at any context length; the warm-up's cost grows with the context.
    config = ServingConfig(
        model=ModelConfig(path=str(model_dir), max_model_len=768),
        kv_cache=KVCacheConfig(dtype=dtype, memory_bytes=4 << 20, **kv),
        scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=128, chunk_size=64),
    )
    return LLMEngine(config)


def pool_state(engine: LLMEngine) -> tuple[Any, ...]:
    pool = engine.pool
    return (pool.num_free, pool.num_owned, pool.num_cached, pool.live_page_ids(), pool.pin_ids(), pool.evicted_pages)


# prompts served after the warm-up (the last three share a prefix)
SERVED = [list(range(20, 20 + n)) for n in (5, 70, 70)] + [list(range(20, 90)) + [7, 8, 9]]


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "triaxial"])
def test_warm_up_runs_every_row_count_and_leaves_the_engine_as_it_was(
    tiny_model_dir: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engine_for(tiny_model_dir, dtype)
    fresh = engine_for(tiny_model_dir, dtype)
    before = pool_state(engine)
    log = StepLog(engine, monkeypatch)
    decoded: list[tuple[int, int]] = []
    decode = engine.storage.decode

    def logged_decode(layer: int, q: Any, table: Any, lens: Any, **kw: Any) -> Any:
        decoded.append(tuple(table.shape))
        return decode(layer, q, table, lens, **kw)

    monkeypatch.setattr(engine.storage, "decode", logged_decode)
    report = engine.warm_up(decode=True)

    # every (rows, page-table width) a step outside the graphs can decode with, rows 1 .. max_num_seqs
    widths = table_widths(engine.runner.max_pages)
    assert set(decoded) >= {(b, w) for b in range(1, 7) for w in widths}
    assert report.decode_shapes == 6 * len(widths)

    page = engine.storage.page_size
    budget = 128
    prompt_rows = {sum(n for start, n, prompt in step if prompt and start == 0) for step in log.steps}
    assert set(warm_up.row_counts(budget)) <= prompt_rows  # fresh prompts: every row count in one step
    extend_rows = {sum(n for start, n, prompt in step if prompt and start > 0) for step in log.steps}
    assert set(warm_up.row_counts(128)) <= extend_rows  # chunks after a cached prefix, one or several a step
    assert all(start % page == 0 for step in log.steps for start, _, prompt in step if prompt)
    # the long prompt ran chunk after chunk: prefixes of every length up to it
    groups = engine.warm_up_plan(decode=True).groups
    n = next(g.turns[0].prompt_len for g in groups if g.name.startswith("long"))
    starts = {start for step in log.steps for start, _, prompt in step if prompt}
    assert set(range(64, n, 64)) <= starts
    mixed = {sum(1 for _, _, prompt in step if not prompt) for step in log.steps if any(p for _, _, p in step)}
    assert set(warm_up.row_counts(5)) <= mixed  # decode rows beside a prompt chunk, every batch size below max_num_seqs
    assert report.steps == len(log.steps) and report.requests == engine.warm_up_plan(decode=True).num_turns

    # nothing of it is left: pool, prefix cache, counters, scheduler
    assert pool_state(engine) == before and engine.pool.num_cached == 0
    assert engine.stats.steps == 0 and engine.stats.prompt_tokens_computed == 0 and engine.stats.prefill_seconds == 0
    assert not engine.requests and not engine.scheduler.has_work()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert engine.generate(SERVED, params) == fresh.generate(SERVED, params)
    assert pool_state(engine) == pool_state(fresh)


@pytest.mark.parametrize("control", ["hold", "fixed"])
def test_triaxial_warm_up_writes_int2_pages(tiny_model_dir: Path, control: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_for(tiny_model_dir, "triaxial", bit_budget_control=control)
    assert (engine.kv.controller is not None) == (control == "hold")
    written: list[int] = []
    write = engine.storage.write_int2_pages

    def spy(layer: int, k: Any, v: Any, page_ids: Any) -> None:
        written.append(len(page_ids))
        write(layer, k, v, page_ids)

    monkeypatch.setattr(engine.storage, "write_int2_pages", spy)
    aged: list[int] = []
    requantize = engine.kv._requantize
    assert requantize is not None  # age-down is on by default

    def aging(src: list[int], dst: list[int]) -> None:
        aged.extend(src)
        requantize(src, dst)

    monkeypatch.setattr(engine.kv, "_requantize", aging)
    engine.warm_up(decode=False)
    assert sum(written) > 0
    assert len(aged) >= 4  # the "age down" group: a 4-page prefix stored at 4 bits, then wanted at 2
    assert engine.pool.num_owned == 0 and engine.pool.num_cached == 0 and engine.kv.aged_pages == 0


def test_state_kept_refuses_a_busy_engine(tiny_model_dir: Path) -> None:
    engine = engine_for(tiny_model_dir, "bf16")
    engine.add_request("r", [20, 21, 22], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="idle engine"):
        with engine.state_kept():
            pass


@pytest.mark.gpu
@pytest.mark.gpu_alone
@pytest.mark.parametrize("dtype,weights", [("fp8_e4m3", "fp8_block"), ("nvfp4", "auto"), ("triaxial", "auto")])
def test_gpu_turns_served_after_the_warm_up_compile_no_kernel(tmp_path: Path, dtype: str, weights: str) -> None:
    """The Qwen3-8B shape (two layers: no kernel specializes on the layer count; a 16K context), warmed up, then a
    random agent-like load: prompt lengths from 1 to 6K tokens, a third of them extending an earlier prompt,
    completions of 1 to 24 tokens, requests arriving between steps. Every kernel it launches must have compiled in
    the warm-up. The three cases cover the three Gluon decode formats and both weight formats' GEMMs (bf16 KV runs
    the `tl` kernels, through the same warm-up)."""
    import json
    import random

    from kvserving.tiny_model import build_tiny_model
    from kvserving.worker.compiles import CompileWatch

    model_dir = build_tiny_model(tmp_path / "m", shape="qwen3-8b")
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (model_dir / "config.json").write_text(json.dumps(cfg))
    config = ServingConfig(
        model=ModelConfig(path=str(model_dir), load_format="dummy", weight_format=weights, max_model_len=16384),
        kv_cache=KVCacheConfig(dtype=dtype, memory_bytes=2 << 30),
    )
    engine = LLMEngine(config, device="cuda")
    engine.warm_up(decode=True)
    compiled: list[Any] = []
    watch = CompileWatch(compiled.append)
    assert watch.install()
    watch.serving()
    rng = random.Random(7)
    prompts: list[list[int]] = []
    try:
        pending = 60
        n = 0
        while pending or engine.has_unfinished():
            for _ in range(min(pending, rng.randint(0, 6))):
                length = int(round(math.exp(rng.uniform(0.0, math.log(6000)))))  # a prompt stays within 6,001 tokens
                head = rng.choice(prompts)[: rng.randint(1, 6000)] if prompts and rng.random() < 0.33 else []
                prompt = head + [rng.randrange(10, engine.vocab_size) for _ in range(max(1, length - len(head)))]
                prompts.append(prompt)
                engine.add_request(f"r{n}", prompt, SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True))
                n += 1
                pending -= 1
            for _ in range(rng.randint(1, 12)):
                if engine.has_unfinished():
                    engine.step()
        engine.flush()
    finally:
        watch.uninstall()
    assert not compiled, [f"{e.kernel} ({e.seconds:.1f} s): {e.signature}" for e in compiled]
