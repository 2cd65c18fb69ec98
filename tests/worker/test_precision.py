"""Page precision: INT2 only for full pages of all-2-bit tokens; decode order INT2 first."""

import pytest

from kvserving.kernels.page_ids import INT2_PAGE_FLAG as F
from kvserving.tags import NUM_TAGS, encode_tag
from kvserving.worker.precision import average_bits, order_pages_int2_first, page_bits

OLD_USER = encode_tag("older", "text", "user")
OLD_ASSISTANT = encode_tag("older", "text", "assistant")
OLD_OBS = encode_tag("older", "text", "obs")
CURRENT_USER = encode_tag("current", "text", "user")
# A fixed table for these tests: 2 bits for older text user, assistant and obs only.
TABLE = tuple(2 if t in (OLD_USER, OLD_ASSISTANT, OLD_OBS) else 4 for t in range(NUM_TAGS))


def test_only_two_bit_classes_give_int2_pages() -> None:
    table = TABLE
    two_bit = [t for t in range(NUM_TAGS) if page_bits([t] * 32, table) == [2]]
    assert two_bit == [OLD_USER, OLD_ASSISTANT, OLD_OBS]


def test_one_four_bit_token_keeps_the_page_four_bit() -> None:
    table = TABLE
    tags = [OLD_USER] * 96
    tags[40] = CURRENT_USER  # page 1
    assert page_bits(tags, table) == [2, 4, 2]
    tags[95] = encode_tag("older", "image", "user")  # page 2: image tokens are 4-bit in TABLE
    assert page_bits(tags, table) == [2, 4, 4]


def test_partial_last_page_is_four_bit() -> None:
    table = TABLE
    assert page_bits([OLD_OBS] * 70, table) == [2, 2, 4]
    assert page_bits([OLD_OBS] * 31, table) == [4]
    assert page_bits([], table) == []
    assert page_bits([OLD_OBS] * 8, table, page_size=4) == [2, 2]


def test_page_bits_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="56 entries"):
        page_bits([0], [2] * 10)
    with pytest.raises(ValueError, match="0..55"):
        page_bits([56], TABLE)
    with pytest.raises(ValueError, match="0..55"):
        page_bits([-1], TABLE)


def test_order_pages_int2_first_is_stable() -> None:
    ids = [3, F | 7, 1, F | 2, 5, F | 0]
    assert order_pages_int2_first(ids) == ([F | 7, F | 2, F | 0, 3, 1, 5], 3)
    assert order_pages_int2_first([4, 2]) == ([4, 2], 0)
    assert order_pages_int2_first([]) == ([], 0)


def test_average_bits_weights_the_partial_last_page() -> None:
    assert average_bits([2, 2], 32, 64) == 2.0
    assert average_bits([2, 4], 32, 64) == 3.0
    assert average_bits([2, 2, 4], 32, 72) == (64 * 2 + 8 * 4) / 72
    assert average_bits(page_bits([OLD_USER] * 70, TABLE), 32, 70) == (64 * 2 + 6 * 4) / 70
    with pytest.raises(ValueError, match="fill 2 pages"):
        average_bits([2], 32, 33)
    with pytest.raises(ValueError, match="num_tokens"):
        average_bits([], 32, 0)
    with pytest.raises(ValueError, match="2 or 4"):
        average_bits([3], 32, 32)
