"""The GEMMs' launch plan: which kernel runs an [M, K] x [N, K]^T product and at what launch shape. Pure rules on
(M, N, K), no Triton, so they read and test apart from the kernels that take them (``triton_fp8_gemm``).

``Tiles`` is one launch shape of the block GEMM (FP8 weights with quantized or bf16 activations, or bf16 weights),
``Gemv`` one of the GEMV (M <= 4); ``tile_config``, ``bf16_tile_config`` / ``bf16_launch`` and ``gemv_config``
size them; ``launch_config`` is the FP8 weights' dispatch between them; inside ``tiles_override`` every GEMM
launches a given shape (benches time candidates through it), which the kernels' wrappers read by ``override``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
from collections.abc import Iterator

GROUP = 128  # the scale group along K and the weight tile edge
SMS = 132  # streaming multiprocessors of an H100 / H200: the unit the launch rules size their grids in


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True, slots=True)
class Tiles:
    """One launch shape of the block GEMM: BLOCK_M x BLOCK_N output tiles, warps, software-pipeline stages
    (K steps in flight per program), K splits (programs along K; > 1 adds the partials' sum), and the K of a step
    (128, one scale group, for FP8 weights; bf16 weights may take 64)."""

    block_m: int
    block_n: int
    warps: int
    stages: int
    split_k: int = 1
    block_k: int = GROUP
    a16: bool = False  # FP8 weights times the bf16 activations as they are (no activation quantization)

    def __post_init__(self) -> None:
        if self.block_m not in (16, 32, 64, 128):
            raise ValueError(f"Tiles.block_m must be 16, 32, 64 or 128, got {self.block_m}")
        if self.block_n not in (16, 32, 64, 128):
            raise ValueError(f"Tiles.block_n must be 16, 32, 64 or 128 (a divisor of the 128-row weight tile), got {self.block_n}")
        if self.warps not in (1, 2, 4, 8):
            raise ValueError(f"Tiles.warps must be 1, 2, 4 or 8, got {self.warps}")
        if not 1 <= self.stages <= 8:
            raise ValueError(f"Tiles.stages must be 1..8, got {self.stages}")
        if not 1 <= self.split_k <= 16:
            raise ValueError(f"Tiles.split_k must be 1..16, got {self.split_k}")
        if self.block_k not in (32, 64, 128):
            raise ValueError(f"Tiles.block_k must be 32, 64 or 128, got {self.block_k}")

    @property
    def label(self) -> str:
        """``16x32w4s3k1``: BLOCK_M x BLOCK_N, warps, stages, K splits, then ``b64`` where a step's K is not 128 and
        ``a16`` for bf16 activations (``parse`` reads it back)."""
        tail = ("" if self.block_k == GROUP else f"b{self.block_k}") + ("a16" if self.a16 else "")
        return f"{self.block_m}x{self.block_n}w{self.warps}s{self.stages}k{self.split_k}{tail}"

    @classmethod
    def parse(cls, text: str) -> Tiles:
        found = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)k(\d+)(?:b(\d+))?(a16)?", text.strip())
        if found is None:
            raise ValueError(f"tiles {text!r}: expected BMxBNwWARPSsSTAGESkSPLITS[bBLOCK_K][a16], e.g. 16x32w4s3k1")
        bm, bn, warps, stages, split, block_k, a16 = found.groups()
        return cls(int(bm), int(bn), int(warps), int(stages), int(split), int(block_k or GROUP), a16 is not None)


# Programs a decode-sized GEMM aims for: three per SM on a 132-SM H100/H200, so each SM keeps three programs' weight
# stream in flight (one 4-warp program an SM holds too few bytes in flight for the chip's read rate; on the H200 the
# Qwen3-8B shapes run fastest at 256-384 programs: docs/results.md, FP8 weights).
DECODE_PROGRAMS = 3 * SMS


def tile_config(m: int, n: int, k: int) -> Tiles:
    """The block GEMM's launch shape for an [M, K] x [N, K]^T product.

    - M <= 64 (decode batches): the weight stream binds. BLOCK_M 16 up to M = 16 (the dot's smallest), 64 above
      (one row tile: every further row tile would stream the whole weight again); BLOCK_N 64 (each program
      re-reads its BLOCK_M activation rows: 64 columns halve those bytes per weight byte, and at M = 1 the wider
      tile streams more weight per program); 4 stages; K split in powers of two while the grid stays within
      DECODE_PROGRAMS and each split keeps >= 8 K steps (qkv, o and down: 4 splits; gate_up's 384 column tiles
      fill the grid alone).
    - 64 < M <= 128: 64 x 64 tiles, no split (the row tiles fill the grid; a split re-reads the weight).
    - 128 < M <= 512 (large decode batches, short prompt chunks): 64 x 128 tiles, 4 warps, 4 stages, K split in two
      where the tiles are fewer than one an SM (o and down at 129-256 rows). 128 x 128 tiles left o and down 64
      programs at 256 rows: on an H100 one layer's four GEMMs with their quantizer ran 202.6 us there against
      163.3 (bf16 cuBLAS 176.0), and 305.5 against 279.1 at 512 rows.
    - M > 512 (prefill): 128 x 128 tiles, 8 warps (the tensor cores bind, not the weight stream)."""
    if m > 512:
        return Tiles(128, 128, 8, 3)
    if m > 128:
        tiles = _cdiv(m, 64) * _cdiv(n, 128)
        return Tiles(64, 128, 4, 4, 2 if tiles < SMS else 1)
    if m > 64:
        return Tiles(64, 64, 4, 4)
    block_m = 16 if m <= 16 else 64
    block_n = 64
    tiles = _cdiv(n, block_n)
    steps = _cdiv(k, GROUP)
    split = 1
    while tiles * split * 2 <= DECODE_PROGRAMS and steps // (split * 2) >= 8:
        split *= 2
    return Tiles(block_m, block_n, 4, 4, split)


# Programs the bf16 block GEMM aims for at decode sizes: one per SM of a 132-SM H100/H200, each with four 16 KiB
# weight tiles in flight (on an H100, o and down at M = 8-16 ran 13.8 / 36.8 us at 128 programs against 15.5 /
# 40.4 at 256: more programs each with a shorter K run pay the pipeline's fill and the partials' sum more often).
BF16_PROGRAMS = SMS


def row_tile(m: int) -> int:
    """BLOCK_M of a decode-sized bf16 block GEMM: 16 up to 16 rows, 64 up to 64, else 128. No 32-row tile: on an
    H100 at 24-32 tokens it read the Qwen3-8B projections slower than a 64-row tile (qkv 32.5 against 24.9 us,
    down 46.5 against 40.1 at 32) and slowed the engine's step by 4 % (nvfp4 24 x 4K 8.37 -> 9.07 ms)."""
    return next(b for b in (16, 64, 128) if m <= b or b == 128)


def bf16_tile_config(m: int, n: int, k: int) -> Tiles:
    """The bf16 block GEMM's launch shape for an [M, K] x [N, K]^T product at decode sizes: the weight stream
    binds, so one row tile (``row_tile``: every further row tile streams the whole weight again), 64 columns, 4
    warps, 4 stages of 128-wide K steps, and K split in powers of two while the grid stays within BF16_PROGRAMS and
    each split keeps >= 8 steps (Qwen3-8B: o and down 2 splits, qkv and gate_up none)."""
    block_m = row_tile(m)
    block_n = 64
    tiles = _cdiv(n, block_n) * _cdiv(m, block_m)
    steps = _cdiv(k, GROUP)
    split = 1
    while tiles * split * 2 <= BF16_PROGRAMS and steps // (split * 2) >= 8:
        split *= 2
    return Tiles(block_m, block_n, 4, 4, split)


def bf16_launch(m: int, n: int, k: int) -> Tiles | None:
    """``bf16_tile_config``'s launch where its grid keeps the SMs busy (at least 7/8 of BF16_PROGRAMS programs), else
    None: cuBLAS streams such a weight faster (Qwen3-8B qkv at 8-16 tokens: 96 programs of 64 columns, 23.3 us
    against cuBLAS's 20.5 on an H100; with 2 splits its 192 programs are 1.45 waves)."""
    t = bf16_tile_config(m, n, k)
    programs = _cdiv(m, t.block_m) * _cdiv(n, t.block_n) * t.split_k
    return t if programs * 8 >= BF16_PROGRAMS * 7 else None


@dataclasses.dataclass(frozen=True, slots=True)
class Gemv:
    """One launch shape of the GEMV (M <= 4): BLOCK_N weight rows x BLOCK_K columns a step, warps, pipeline stages
    (steps whose weight loads run ahead of their use; 1: none), and K splits (> 1 adds the partials' sum)."""

    block_n: int
    block_k: int
    warps: int
    stages: int = 1
    split_k: int = 1

    def __post_init__(self) -> None:
        if self.block_n not in (4, 8, 16, 32, 64, 128):
            raise ValueError(f"Gemv.block_n must be 4, 8, 16, 32, 64 or 128 (a divisor of the 128-row weight tile), got {self.block_n}")
        if self.block_k not in (128, 256, 512, 1024, 2048):
            raise ValueError(f"Gemv.block_k must be 128, 256, 512, 1024 or 2048, got {self.block_k}")
        if self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"Gemv.warps must be 1, 2, 4, 8 or 16, got {self.warps}")
        if not 1 <= self.stages <= 8:
            raise ValueError(f"Gemv.stages must be 1..8, got {self.stages}")
        if not 1 <= self.split_k <= 16:
            raise ValueError(f"Gemv.split_k must be 1..16, got {self.split_k}")

    @property
    def label(self) -> str:
        """``g32x512w4s1k2``: BLOCK_N x BLOCK_K, warps, stages, K splits (``parse`` reads it back)."""
        return f"g{self.block_n}x{self.block_k}w{self.warps}s{self.stages}k{self.split_k}"

    @classmethod
    def parse(cls, text: str) -> Gemv:
        found = re.fullmatch(r"g(\d+)x(\d+)w(\d+)s(\d+)k(\d+)", text.strip())
        if found is None:
            raise ValueError(f"gemv {text!r}: expected gBNxBKwWARPSsSTAGESkSPLITS, e.g. g32x512w4s1k2")
        return cls(*(int(v) for v in found.groups()))


GEMV_ROWS = 4  # the GEMV's largest M: one fp32 accumulator per activation row, each weight value used M times
GEMV_DISPATCH_ROWS = 2  # the largest M the dispatch gives the GEMV (at M = 4 the block GEMM was faster on every shape)
# Programs the GEMV's K split aims for: at least two per SM on a 132-SM H100/H200, so a power-of-two split lands at
# 2-4 an SM, each with a 16 KiB weight tile in flight (Little's law at the H200's ~4.5 TB/s and ~0.8 us loaded
# latency asks ~28 KiB an SM).
GEMV_PROGRAMS = 2 * SMS


def gemv_split(tiles: int, steps: int) -> int:
    """K splits for a GEMV grid of ``tiles`` column tiles and ``steps`` K steps: powers of two until the grid reaches
    ``GEMV_PROGRAMS``, while each split keeps >= 2 steps (a split's partials cost M x N x 4 bytes, its sum a launch),
    16 at most."""
    split = 1
    while split < 16 and tiles * split < GEMV_PROGRAMS and steps // (split * 2) >= 2:
        split *= 2
    return split


def gemv_config(m: int, n: int, k: int) -> Gemv:
    """The GEMV's launch shape for an [M, K] x [N, K]^T product, M <= 4.

    - BLOCK_N 8 at M <= 2 (8 KiB of weight a step at BLOCK_K 1024: the Qwen3-8B shapes' 512-3,072 column tiles
      fill the grid with no K split and no partials' sum), 32 at M 3-4 (each row's fp32 sums cost registers);
    - BLOCK_K 2048 at M = 1 on weights of at most 4,096 rows (o and down of the Qwen3-8B shape: 512 column tiles,
      so each program keeps 16 KiB in flight; o 7.0 -> 6.4 us, down 15.7 -> 14.4 on the H200, while qkv's 768
      tiles ran 8.5 -> 9.2), 1024 at M <= 2, 512 above, where it divides K (a warp's 32 lanes x 16-byte loads:
      whole 128-byte lines), else the largest of 512, 256, 128 that does;
    - 4 warps, 1 stage (plain loads into registers: on the H200 staging the next tile in shared memory by
      cp.async, 2 or 3 stages, was 25-35 % slower at M = 1 and 2);
    - K split by ``gemv_split`` where the column tiles alone leave the grid short (none at the Qwen3-8B shape at
      M <= 2)."""
    block_n = 8 if m <= 2 else 32
    widths = (2048, 1024, 512, 256) if m == 1 and n <= 4096 else (1024, 512, 256) if m <= 2 else (512, 256)
    block_k = next((b for b in widths if k % b == 0), GROUP)
    return Gemv(block_n, block_k, 4, 1, gemv_split(_cdiv(n, block_n), k // block_k))


A16_ROWS = 4  # the most tokens the dispatch gives the block GEMM on unquantized activations (``a16``)


def launch_config(m: int, n: int, k: int) -> Tiles | Gemv:
    """The dispatch: the GEMV at M = 1, and at M = 2 where the block GEMM would split K (qkv, o and down of the
    Qwen3-8B shape): no activation quantization, no padded MMA rows, no split sum of 16-row tiles; at M 3-4 where it
    splits K the block GEMM on the activations as they are (``a16``: no quantizer launch); else the block GEMM at
    ``tile_config``'s tiles on quantized activations. Measured on the H200 (us, block GEMM -> GEMV at
    ``gemv_config``): M = 1 qkv 12.0 -> 8.5, o 10.1 -> 6.4, gate_up 28.0 -> 25.5, down 19.8 -> 14.4 (one layer 70.0
    -> 54.8); M = 2 qkv 12.2 -> 10.2, o 10.3 -> 8.6, down 20.0 -> 19.8, while gate_up (384 column tiles of the block
    GEMM fill the grid) stays on the block GEMM, 28.3 against 31.7. On an H100 at M = 4 (quantizer + block GEMM ->
    ``a16``): qkv 14.5 -> 13.7, o 11.6 -> 10.1, down 24.5 -> 23.4, gate_up 38.0 -> 41.5 (kept); at M = 8 ``a16``
    is slower on every shape (the widening of each weight tile in registers costs more than the quantizer saves)."""
    tiles = tile_config(m, n, k)
    if m == 1 or (m <= GEMV_DISPATCH_ROWS and tiles.split_k > 1):
        return gemv_config(m, n, k)
    if m <= A16_ROWS and tiles.split_k > 1:
        return dataclasses.replace(tiles, a16=True)
    return tiles


_OVERRIDE: contextvars.ContextVar[Tiles | Gemv | None] = contextvars.ContextVar("fp8_block_gemm_tiles", default=None)


@contextlib.contextmanager
def tiles_override(launch: Tiles | Gemv) -> Iterator[None]:
    """Every GEMM launched inside the block uses ``launch`` instead of the dispatch's choice: ``linear`` runs that
    kernel (a ``Gemv`` needs M <= 4), ``block_gemm`` and ``gemv`` take it when it is theirs."""
    token = _OVERRIDE.set(launch)
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def override() -> Tiles | Gemv | None:
    """The launch ``tiles_override`` set around the caller, if any."""
    return _OVERRIDE.get()
