"""The bits table from a budget: DESIGN.md's greedy rule, exact on small inputs,
and the default tables at 2.5 and 3.5 bits, counted in stored pages on the
agent pages (``kvserving.agents.pages``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserving.bits import (
    average_bits,
    bits_table_for_budget,
    default_frequency,
    default_sensitivity,
    default_stored_bits,
    format_bits_table,
    greedy_bits_table,
    int2_share,
    page_greedy_table,
    pages_stored_bits,
)
from kvserving.tags import NUM_TAGS, encode_tag

UNIFORM = [1.0] * NUM_TAGS


def test_greedy_upgrades_in_order_of_gain_per_bit_until_the_budget() -> None:
    # equal frequencies: gain k = 56 - k, so classes 0, 1, ... go first
    gain = [float(NUM_TAGS - k) for k in range(NUM_TAGS)]
    table = greedy_bits_table(2.5, gain=gain, frequency=UNIFORM)
    assert table == tuple([4] * 14 + [2] * 42)  # 2 + 2 * 14/56 = 2.5 exactly
    assert average_bits(table, UNIFORM) == 2.5
    assert greedy_bits_table(2.0, gain=gain, frequency=UNIFORM) == (2,) * NUM_TAGS
    assert greedy_bits_table(4.0, gain=gain, frequency=UNIFORM) == (4,) * NUM_TAGS


def test_priority_is_gain_per_token_and_a_class_that_overshoots_is_skipped() -> None:
    # class 0: huge gain but half of the 112 tokens -> gain/(2N) = 100/(2*56) = 0.89
    # class 1: gain 10 at 1 token -> 5.0; classes 2..55: gain 1.2 at 1 token -> 0.6
    freq = [56.0] + [1.0] * (NUM_TAGS - 1)
    gain = [100.0, 10.0] + [1.2] * (NUM_TAGS - 2)
    total = sum(freq)  # 111
    table = greedy_bits_table(2.2, gain=gain, frequency=freq)
    # order: 1, 0, 2, 3, ...; 1 fits (2 + 2/111); 0 would add 112/111 > 0.2 and is skipped;
    # then classes 2.. fit one by one while 2 + 2n/111 <= 2.2, i.e. n <= 11 in all
    assert [k for k, b in enumerate(table) if b == 4] == [1, *range(2, 12)]
    assert average_bits(table, freq) == pytest.approx(2 + 22 / total)


def test_ties_go_to_the_lower_tag() -> None:
    table = greedy_bits_table(2.0 + 2 * 3 / NUM_TAGS, gain=UNIFORM, frequency=UNIFORM)
    assert [k for k, b in enumerate(table) if b == 4] == [0, 1, 2]


def test_defaults_are_documented_shares_and_weights() -> None:
    freq = default_frequency()
    assert abs(sum(freq) - 1.0) < 1e-12
    s = default_sensitivity()
    assert s[encode_tag("current", "text", "inst")] == 64.0
    assert s[encode_tag("older", "text", "obs")] == 1.0
    assert s[encode_tag("older", "image", "obs")] == 0.5
    assert freq[encode_tag("older", "text", "obs")] == pytest.approx(0.60 * 0.95 * 0.55)


def test_budgets_2_5_and_3_5_give_the_documented_tables() -> None:
    low, high = bits_table_for_budget(2.5), bits_table_for_budget(3.5)
    # 2.5: the system prompt and tool schemas (current inst, 18% of the agent tokens, on
    # pages of their own), the current and previous requests and tool calls; every tool result
    # at 2 bits, and the delimiters too (on most pages, where they would cost whole pages)
    assert format_bits_table(low) == (
        "current text IU..C.. image .......; turn_m1 text .U..C.. image .......; "
        "turn_m2 text ....... image .......; older text ....... image ......."
    )
    assert format_bits_table(high) == (
        "current text IUARCOD image IUARCOD; turn_m1 text IUARCOD image IUA.C.D; "
        "turn_m2 text IUA.C.D image IU..C.D; older text IUA.C.D image I.....D"
    )
    # counted as the pool stores pages, on the agent pages the table was walked on
    assert default_stored_bits(low) == pytest.approx(2.496, abs=5e-4)
    assert default_stored_bits(high) == pytest.approx(3.462, abs=5e-4)
    # the token-share count says far less for the same tables: delimiters and tool-call JSON
    # are a few % of the tokens but sit on many pages, which they keep at 4 bits
    assert average_bits(low) < 2.3 and int2_share(low) > 0.85
    assert low[encode_tag("current", "text", "inst")] == 4


def test_default_budgets_hold_in_stored_bits_and_grow_with_the_budget() -> None:
    previous = 0.0
    # from 2.05: partial last pages are stored INT4, so no table stores exactly 2.0
    for i in range(1, 41):
        budget = 2.0 + i * 0.05
        stored = default_stored_bits(bits_table_for_budget(budget))
        assert previous <= stored <= budget + 1e-9, budget
        previous = stored
    # where classes are small next to the budget's step the budget is met within 0.02 bits
    for budget in (2.3, 2.5, 2.7, 2.9, 3.4):
        assert default_stored_bits(bits_table_for_budget(budget)) >= budget - 0.02, budget


def test_absent_classes_are_placed_by_sensitivity_not_given_free() -> None:
    user = encode_tag("current", "text", "user")
    obs = encode_tag("current", "text", "obs")
    image_user = encode_tag("current", "image", "user")  # absent from the pages below
    image_obs = encode_tag("current", "image", "obs")  # absent too
    pages = ((5, ((user, 32),)), (5, ((obs, 32),)))
    per_token = [0.0] * NUM_TAGS
    per_token[user], per_token[obs], per_token[image_user], per_token[image_obs] = 4.0, 1.0, 2.0, 0.5
    free = page_greedy_table(3.0, per_token, pages, page_size=32, residual=0)
    ranked = page_greedy_table(3.0, per_token, pages, page_size=32, residual=0, absent="rank")
    assert (free[user], free[obs], free[image_user], free[image_obs]) == (4, 2, 4, 4)
    # obs (1.0) stays 2-bit, so only absent classes above 1.0 get 4 bits
    assert (ranked[user], ranked[obs], ranked[image_user], ranked[image_obs]) == (4, 2, 4, 2)
    with pytest.raises(ValueError, match="absent must be 'free' or 'rank'"):
        page_greedy_table(3.0, per_token, pages, page_size=32, residual=0, absent="maybe")


def _int4_gain(table: tuple[int, ...], pages: tuple[tuple[int, tuple[tuple[int, int], ...]], ...], per_token: list[float]) -> float:
    """Summed per-token gain of the pages ``table`` stores INT4 (any 4-bit class on them)."""
    return sum(n * sum(per_token[k] * t for k, t in mix) for n, mix in pages if any(table[k] == 4 for k, _ in mix))


def test_the_swap_pass_spends_what_the_walk_leaves() -> None:
    # a: 1 page, per-token gain 10 (best ratio); b: 4 pages, gain 3 each token. Budget 2 + 2 * 4/5:
    # the walk buys a (0.4 bits) and then b (1.6) no longer fits; swapping a for b fits and gains more
    a, b, c = (encode_tag("current", "text", s) for s in ("user", "obs", "assistant"))
    pages = ((1, ((a, 32),)), (4, ((b, 32),)))
    per_token = [0.0] * NUM_TAGS
    per_token[a], per_token[b], per_token[c] = 10.0, 3.0, 50.0  # c is absent from the pages
    kwargs = dict(page_size=32, residual=0)
    walk = page_greedy_table(2.0 + 2 * 4 / 5, per_token, pages, improve=False, **kwargs)
    swapped = page_greedy_table(2.0 + 2 * 4 / 5, per_token, pages, **kwargs)
    assert (walk[a], walk[b]) == (4, 2) and pages_stored_bits(walk, pages, **kwargs) == pytest.approx(2.4)
    assert (swapped[a], swapped[b]) == (2, 4) and pages_stored_bits(swapped, pages, **kwargs) == pytest.approx(3.6)
    assert walk[c] == swapped[c] == 4  # absent and free either way
    assert _int4_gain(swapped, pages, per_token) == 4 * 32 * 3.0 > _int4_gain(walk, pages, per_token) == 32 * 10.0


def test_the_swap_pass_never_loses_gain_nor_breaks_the_budget() -> None:
    import random

    rng = random.Random(5)
    kwargs = dict(page_size=32, residual=7)
    for _ in range(30):
        classes = rng.sample(range(NUM_TAGS), 10)
        pages = tuple(
            (
                rng.randint(1, 30),
                tuple(sorted(zip(sorted(rng.sample(classes, 2)), (16, 16)))) if rng.random() < 0.3 else ((rng.choice(classes), 32),),
            )
            for _ in range(12)
        )
        per_token = [rng.random() * 10 for _ in range(NUM_TAGS)]
        for budget in (2.3, 2.7, 3.1, 3.6):
            walk = page_greedy_table(budget, per_token, pages, improve=False, **kwargs)
            best = page_greedy_table(budget, per_token, pages, **kwargs)
            assert pages_stored_bits(best, pages, **kwargs) <= budget + 1e-9
            assert _int4_gain(best, pages, per_token) >= _int4_gain(walk, pages, per_token) - 1e-9


def test_the_agent_pages_are_what_the_generator_measures() -> None:
    from kvserving import agent_pages_data
    from kvserving.agents import pages as agent_pages

    pages, residual, tokens = agent_pages.measure()
    text = agent_pages.render_module(pages, residual, tokens)
    assert text == Path(agent_pages_data.__file__).read_text()
    assert residual + agent_pages_data.PAGE_SIZE * sum(n for n, _ in pages) == tokens
    assert all(sum(t for _, t in mix) == 32 for _, mix in pages)


def test_bad_inputs_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"bit_budget must be in \[2, 4\], got 1.5"):
        bits_table_for_budget(1.5)
    with pytest.raises(ValueError, match="frequency entries must be > 0"):
        greedy_bits_table(3.0, gain=UNIFORM, frequency=[0.0] + UNIFORM[1:])
    with pytest.raises(ValueError, match="56 entries"):
        greedy_bits_table(3.0, gain=[1.0], frequency=UNIFORM)
    with pytest.raises(ValueError, match="2 or 4"):
        format_bits_table([3] * NUM_TAGS)
