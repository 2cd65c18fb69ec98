"""Tag encoding follows DESIGN.md's formula and round-trips."""

import pytest

from kvserving.tags import NUM_TAGS, decode_tag, encode_tag, validate_bits_table


def test_formula_and_round_trip() -> None:
    assert NUM_TAGS == 56
    assert encode_tag("current", "text", "inst") == 0
    assert encode_tag("turn_m1", "image", "obs") == (1 * 2 + 1) * 7 + 5 == 26
    assert encode_tag("older", "image", "delim") == 55
    assert [encode_tag(*decode_tag(t)) for t in range(NUM_TAGS)] == list(range(NUM_TAGS))


def test_bad_tags_and_tables_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown tag part"):
        encode_tag("now", "text", "user")
    with pytest.raises(ValueError, match="0..55"):
        decode_tag(56)
    with pytest.raises(ValueError, match="56 entries"):
        validate_bits_table([4] * 10)
    with pytest.raises(ValueError, match="2 or 4"):
        validate_bits_table([3] * 56)
