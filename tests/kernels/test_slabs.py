"""``page_ids.Slabs``: every slot of every slab lies inside its slab's bytes, at both precisions,
with the offsets of ``page_byte_offset`` (the formula the kernels, the storage and NIXL use)."""

from __future__ import annotations

import pytest

from kvserving.kernels.page_ids import INT2_PAGE_FLAG, Slabs, page_byte_offset, page_id_bits, slab_bytes

F = INT2_PAGE_FLAG


@pytest.mark.parametrize(
    "b4, b2, n",
    [(40960, 24576, 4), (5120, 3072, 7), (1024, 512, 5), (20, 10, 3), (10, 6, 4), (5, 3, 1), (7, 7, 2)],
)
def test_every_slot_of_every_slab_lies_inside_its_slab(b4: int, b2: int, n: int) -> None:
    slabs = Slabs(b4, b2, n)
    s = slabs.slab_bytes
    assert s % b4 == 0 and s % b2 == 0 and slabs.total_bytes == n * s
    seen: dict[int, set[int]] = {4: set(), 2: set()}
    for k in range(n):
        for bits, size in ((4, b4), (2, b2)):
            ids = slabs.page_ids(k, bits=bits)
            assert len(ids) == slabs.pages_per_slab(bits=bits) == s // size
            spans = sorted((page_byte_offset(pid, page_bytes=b4, int2_page_bytes=b2, total_bytes=slabs.total_bytes), pid) for pid in ids)
            # the slab's pages tile its bytes exactly
            assert [off for off, _ in spans] == list(range(k * s, (k + 1) * s, size))
            for slot, pid in enumerate(ids):
                assert page_id_bits(pid) == bits and slabs.locate(pid) == (k, slot)
                assert slabs.page_id(k, slot, bits=bits) == pid
            seen[bits] |= set(ids)
    # together the slabs hold every index of each precision once
    assert seen[4] == set(range(n * s // b4)) and seen[2] == {F | j for j in range(n * s // b2)}


def test_int4_counts_up_from_the_bottom_and_int2_down_from_the_top() -> None:
    slabs = Slabs(40960, 24576, 3)
    assert (slabs.slab_bytes, slabs.int4_per_slab, slabs.int2_per_slab) == (122880, 3, 5)
    assert slabs.page_ids(0, bits=4) == [0, 1, 2] and slabs.page_ids(2, bits=4) == [6, 7, 8]
    assert slabs.page_ids(2, bits=2) == [F | 0, F | 1, F | 2, F | 3, F | 4]  # the top slab
    assert slabs.page_ids(0, bits=2) == [F | 10, F | 11, F | 12, F | 13, F | 14]
    tiny = Slabs(1024, 512, 4)
    assert (tiny.int4_per_slab, tiny.int2_per_slab) == (1, 2)
    assert tiny.page_ids(3, bits=2) == [F | 0, F | 1] and tiny.page_ids(3, bits=4) == [3]


def test_slab_sizes_refused() -> None:
    assert slab_bytes(40960, 24576) == 122880
    with pytest.raises(ValueError, match="more than 64 pages"):
        slab_bytes(40961, 24576)
    with pytest.raises(ValueError, match="page bytes must be >= 1"):
        slab_bytes(0, 512)
    with pytest.raises(ValueError, match="num_slabs must be >= 1"):
        Slabs(1024, 512, 0)
    with pytest.raises(ValueError, match="slot in 0..2"):
        Slabs(40960, 24576, 3).page_id(0, 3, bits=4)
