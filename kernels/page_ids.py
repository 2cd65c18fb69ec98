"""Page ids and where their bytes live: the one definition the pools, the
storage, the NIXL descriptors and the kernels share (pure Python, no torch).

A page id is an index; INT2 pages (triaxial) carry ``INT2_PAGE_FLAG`` (bit 30,
so page tables stay non-negative int32). In a layer buffer of ``total_bytes``,
INT4 (or the format's only) page ``i`` starts at ``i * page_bytes`` and INT2
page ``j`` at ``total_bytes - (j+1) * int2_page_bytes``: INT4 indices count up
from the bottom, INT2 indices down from the top::

    byte 0                                                               total
    | page 0 | page 1 | ...                       ... | int2 page 1 | int2 page 0 |
    '--- i * page_bytes ---'                        '- total - (j+1) * int2_bytes

A buffer may hold every layer's pages *page-major* (``layers`` > 1): slot
``i`` is then one block of ``layers * page_bytes`` bytes, layer ``l``'s page
at ``l * page_bytes`` inside it, so a run of slots is one run of bytes for the
whole model (one NIXL region instead of one per layer)::

    byte 0                                                                   total
    | slot 0: layer 0 | layer 1 | ... | slot 1: layer 0 | ...   ... | int2 slot 0: layer 0 | layer 1 | ... |

The formulas above then hold with ``page_bytes`` and ``int2_page_bytes``
times ``layers`` (the page strides) plus ``l`` times the page's own bytes;
``layers`` = 1 is the layer-major buffer of one layer.

Which indices are in use is the pool's policy. The triaxial pool cuts the
buffer into slabs of ``lcm(page_bytes, int2_page_bytes)`` bytes (``Slabs``),
each holding whole pages of one precision; the formula above puts every slot
of a slab inside the slab's bytes at either precision.

Kernels written in Triton repeat the offset formula inside the kernel (they
cannot call Python); ``tests/kernels`` hold them to ``page_byte_offset``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from torch import Tensor

INT2_PAGE_FLAG = 1 << 30
_FLAG_BIT = 30
_INDEX_MASK = INT2_PAGE_FLAG - 1

# an int, or an int64 tensor of ids (torch): the offset formula below is elementwise
Ids = TypeVar("Ids", int, "Tensor")


def is_int2(page_id: int) -> bool:
    """True for an INT2 page id."""
    return bool(page_id & INT2_PAGE_FLAG)


def page_id_bits(page_id: int) -> int:
    """Stored precision of a page id: 2 for INT2, 4 for every other page."""
    return 2 if page_id & INT2_PAGE_FLAG else 4


def page_index(page_id: int) -> int:
    """The page's slot counted from its own end of the buffer."""
    return page_id & _INDEX_MASK


def make_page_id(index: int, *, bits: int) -> int:
    """The id of slot ``index`` at ``bits`` precision (2 sets the INT2 flag)."""
    if not 0 <= index < INT2_PAGE_FLAG:
        raise ValueError(f"page index must be in 0..{INT2_PAGE_FLAG - 1}, got {index}")
    if bits not in (2, 4):
        raise ValueError(f"bits must be 2 or 4, got {bits}")
    return index | INT2_PAGE_FLAG if bits == 2 else index


def page_byte_offset(
    page_id: int, *, page_bytes: int, int2_page_bytes: int = 0, total_bytes: int = 0, layers: int = 1, layer: int = 0
) -> int:
    """Byte offset of layer ``layer``'s page in a buffer of ``layers`` layers, page-major (1: a layer
    buffer); INT2 pages count down from the top."""
    if page_id & INT2_PAGE_FLAG and (int2_page_bytes <= 0 or total_bytes <= 0):
        raise ValueError(f"page id {page_id} is an INT2 page but the buffer has no INT2 layout")
    if not 0 <= layer < layers:
        raise ValueError(f"layer must be in 0..{layers - 1}, got {layer}")
    return page_byte_offsets(
        page_id, page_bytes=page_bytes, int2_page_bytes=int2_page_bytes, total_bytes=total_bytes, layers=layers, layer=layer
    )


def page_byte_offsets(
    page_ids: Ids, *, page_bytes: int, int2_page_bytes: int = 0, total_bytes: int = 0, layers: int = 1, layer: int = 0
) -> Ids:
    """``page_byte_offset`` of an id or, elementwise, of an int64 tensor of ids (no branch, so no check:
    callers of the tensor form have refused INT2 ids without an INT2 layout)."""
    int2 = (page_ids >> _FLAG_BIT) & 1  # 1 for INT2 ids
    index = page_ids & _INDEX_MASK
    # plain: (index * layers + layer) * page_bytes; INT2: total_bytes - (index * layers + layers - layer) * int2_page_bytes
    plain = (index * layers + layer) * page_bytes
    return plain + int2 * (total_bytes - (index * layers + layers - layer) * int2_page_bytes - plain)


# The largest slab a triaxial buffer accepts, in pages of the larger size: real page shapes give 3 or 5.
MAX_SLAB_PAGES = 64


def slab_bytes(page_bytes: int, int2_page_bytes: int) -> int:
    """Bytes of one slab: the least common multiple of the two page sizes, so that whole pages of
    either precision tile it (at the Qwen3-8B shape 122,880 B: 3 INT4 pages of 40,960 B or 5 INT2
    pages of 24,576 B)."""
    if page_bytes < 1 or int2_page_bytes < 1:
        raise ValueError(f"page bytes must be >= 1, got int4 {page_bytes}, int2 {int2_page_bytes}")
    size = math.lcm(page_bytes, int2_page_bytes)
    if size > MAX_SLAB_PAGES * max(page_bytes, int2_page_bytes):
        raise ValueError(
            f"page sizes {page_bytes} and {int2_page_bytes} make a slab of {size} bytes, more than "
            f"{MAX_SLAB_PAGES} pages of the larger size"
        )
    return size


@dataclass(frozen=True, slots=True)
class Slabs:
    """A triaxial layer buffer of ``num_slabs`` slabs (``total_bytes = num_slabs * slab_bytes``).

    Slab ``k`` spans bytes ``[k*S, (k+1)*S)``. As an INT4 slab it holds INT4 indices
    ``a4*k .. a4*k+a4-1``, bottom up; as an INT2 slab, INT2 indices ``a2*(N-1-k) .. +a2-1``, top
    down (INT2 index 0 is the buffer's top page). ``slot`` is a page's place in its slab: its index
    minus the slab's first index (so slot 0 is the slab's lowest index)::

        N = 3, a4 = 3, a2 = 5
        byte 0         S              2S             3S = total
        |  0 |  1 |  2 |  3 |  4 |  5 |  6 |  7 |  8 |   indices as INT4 slabs
        |14|13|12|11|10| 9| 8| 7| 6| 5| 4| 3| 2| 1| 0|   indices as INT2 slabs
        '--- slab 0 --''--- slab 1 --''--- slab 2 --'
    """

    page_bytes: int
    int2_page_bytes: int
    num_slabs: int
    slab_bytes: int = field(init=False)  # S
    int4_per_slab: int = field(init=False)  # a4
    int2_per_slab: int = field(init=False)  # a2

    def __post_init__(self) -> None:
        size = slab_bytes(self.page_bytes, self.int2_page_bytes)  # ValueError naming the sizes
        if self.num_slabs < 1:
            raise ValueError(f"num_slabs must be >= 1, got {self.num_slabs}")
        object.__setattr__(self, "slab_bytes", size)
        object.__setattr__(self, "int4_per_slab", size // self.page_bytes)
        object.__setattr__(self, "int2_per_slab", size // self.int2_page_bytes)

    @property
    def total_bytes(self) -> int:
        return self.num_slabs * self.slab_bytes

    def pages_per_slab(self, *, bits: int) -> int:
        """``a4`` (bits 4) or ``a2`` (bits 2): pages of that precision one slab holds."""
        if bits not in (2, 4):
            raise ValueError(f"bits must be 2 or 4, got {bits}")
        return self.int2_per_slab if bits == 2 else self.int4_per_slab

    def locate(self, page_id: int) -> tuple[int, int]:
        """``(slab, slot)`` of a page id."""
        index = page_id & _INDEX_MASK
        if page_id & INT2_PAGE_FLAG:
            return self.num_slabs - 1 - index // self.int2_per_slab, index % self.int2_per_slab
        return index // self.int4_per_slab, index % self.int4_per_slab

    def page_id(self, slab: int, slot: int, *, bits: int) -> int:
        """The id of ``slot`` of ``slab`` holding pages of ``bits``."""
        per = self.pages_per_slab(bits=bits)
        if not 0 <= slab < self.num_slabs or not 0 <= slot < per:
            raise ValueError(f"slab must be in 0..{self.num_slabs - 1} and slot in 0..{per - 1}, got {slab}, {slot}")
        if bits == 2:
            return INT2_PAGE_FLAG | (per * (self.num_slabs - 1 - slab) + slot)
        return per * slab + slot

    def page_ids(self, slab: int, *, bits: int) -> list[int]:
        """Every id of ``slab`` at ``bits``, slot 0 first (a slab's ids are consecutive at either precision)."""
        first = self.page_id(slab, 0, bits=bits)
        return list(range(first, first + self.pages_per_slab(bits=bits)))
