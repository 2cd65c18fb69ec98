"""The bits table from a budget: DESIGN.md's greedy rule, exact on small inputs,
and the documented defaults' tables at 2.5 and 3.5 bits."""

from __future__ import annotations

import pytest

from kvserving.bits import (
    average_bits,
    bits_table_for_budget,
    default_frequency,
    default_sensitivity,
    format_bits_table,
    greedy_bits_table,
    int2_share,
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
    assert format_bits_table(low) == (
        "current text IUARCOD image IUARCOD; turn_m1 text IUA.C.D image IUA.C.D; "
        "turn_m2 text IU..C.D image IU..C.D; older text I...... image I......"
    )
    assert format_bits_table(high) == (
        "current text IUARCOD image IUARCOD; turn_m1 text IUARCOD image IUARCOD; "
        "turn_m2 text IUARCOD image IUARCOD; older text IUARC.D image IUARCOD"
    )
    assert average_bits(low) == pytest.approx(2.5, abs=1e-9)
    # 3.5 cannot be reached without older text obs (31% of the tokens: +0.63 bits)
    assert average_bits(high) == pytest.approx(3.373, abs=1e-9)
    assert int2_share(low) == pytest.approx((4 - average_bits(low)) / 2)
    # a larger budget only adds 4-bit classes
    assert all(h == 4 for lo, h in zip(low, high) if lo == 4)
    # the most sensitive class is 4-bit at every budget above 2 that can afford it
    assert low[encode_tag("current", "text", "inst")] == 4


def test_bad_inputs_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"bit_budget must be in \[2, 4\], got 1.5"):
        bits_table_for_budget(1.5)
    with pytest.raises(ValueError, match="frequency entries must be > 0"):
        greedy_bits_table(3.0, gain=UNIFORM, frequency=[0.0] + UNIFORM[1:])
    with pytest.raises(ValueError, match="56 entries"):
        greedy_bits_table(3.0, gain=[1.0], frequency=UNIFORM)
    with pytest.raises(ValueError, match="2 or 4"):
        format_bits_table([3] * NUM_TAGS)
