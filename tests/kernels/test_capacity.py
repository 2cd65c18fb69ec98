"""Capacity table: bytes per token from the formats, cross-checked against the page layouts."""

import sys

import pytest

from kvserving.cli import main
from kvserving.kernels.capacity import bytes_per_token, capacity_rows, format_table
from kvserving.kernels.layout import PageLayout

SHAPES = [(36, 8, 128), (2, 1, 64), (4, 3, 96)]  # (layers, kv_heads, head_dim)

DEFAULT_TABLE = """\
format             bits/value  bytes/token     tokens  vs bf16  vs fp8
-----------------  ----------  -----------  ---------  -------  ------
bf16                   16.000     147456.0    582,542      1.0     2.0
fp8_e4m3                8.000      73728.0  1,165,084      0.5     1.0
nvfp4                   4.500      41472.0  2,071,261  0.28125  0.5625
triaxial 2.7b           3.700      34099.2  2,519,101  0.23125  0.4625
triaxial all-int4       5.000      46080.0  1,864,135   0.3125   0.625
triaxial all-int2       3.000      27648.0  3,106,891   0.1875   0.375"""


@pytest.mark.parametrize(("layers", "kv_heads", "head_dim"), SHAPES)
def test_nvfp4_is_nine_sixteenths_of_fp8(layers: int, kv_heads: int, head_dim: int) -> None:
    shape = {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim}
    assert bytes_per_token("nvfp4", **shape) / bytes_per_token("fp8_e4m3", **shape) == 0.5625


@pytest.mark.parametrize(("layers", "kv_heads", "head_dim"), SHAPES)
def test_bytes_per_token_matches_page_layouts(layers: int, kv_heads: int, head_dim: int) -> None:
    shape = {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim}

    def from_layout(fmt: str, page_size: int) -> float:
        layout = PageLayout.build(fmt, page_size=page_size, kv_heads=kv_heads, head_dim=head_dim)
        return layout.page_bytes / page_size * layers

    assert bytes_per_token("bf16", **shape) == from_layout("bf16", 16)
    assert bytes_per_token("fp8_e4m3", **shape) == from_layout("fp8_e4m3", 16)
    assert bytes_per_token("nvfp4", **shape) == from_layout("nvfp4", 16)
    assert bytes_per_token("triaxial", **shape) == from_layout("int4", 32)
    assert bytes_per_token("triaxial", frac_int2=1.0, **shape) == from_layout("int2", 32)
    mix = 0.25 * from_layout("int2", 32) + 0.75 * from_layout("int4", 32)
    assert bytes_per_token("triaxial", frac_int2=0.25, **shape) == mix


def test_default_shape_bytes_by_hand() -> None:
    shape = {"layers": 36, "kv_heads": 8, "head_dim": 128}  # 2 * 36 * 8 * 128 = 73728 values
    assert bytes_per_token("bf16", **shape) == 73728 * 2
    assert bytes_per_token("fp8_e4m3", **shape) == 73728
    assert bytes_per_token("nvfp4", **shape) == 73728 * 9 / 16  # 41472
    assert bytes_per_token("triaxial", **shape) == 73728 * 5 / 8  # 46080
    assert bytes_per_token("triaxial", frac_int2=1.0, **shape) == 73728 * 3 / 8  # 27648


def test_capacity_rows_default() -> None:
    rows = {r["format"]: r for r in capacity_rows()}
    assert list(rows) == ["bf16", "fp8_e4m3", "nvfp4", "triaxial 2.7b", "triaxial all-int4", "triaxial all-int2"]
    assert rows["nvfp4"]["vs_fp8"] == 0.5625 and rows["fp8_e4m3"]["vs_bf16"] == 0.5
    assert rows["bf16"]["tokens"] == 80 * 2**30 // 147456  # 582542
    assert rows["nvfp4"]["tokens"] == 80 * 2**30 // 41472  # 2071261
    mixed = rows["triaxial 2.7b"]
    # B = 2.7 = 2 f + 4 (1 - f) -> f = 0.65; bits 0.65 * 3 + 0.35 * 5 = 3.7
    assert mixed["frac_int2"] == pytest.approx(0.65, abs=1e-12)
    assert mixed["bits_per_value"] == pytest.approx(3.7, abs=1e-12)
    assert rows["triaxial all-int4"]["vs_fp8"] == 0.625 and rows["triaxial all-int2"]["vs_fp8"] == 0.375


def test_format_table_exact() -> None:
    assert format_table(capacity_rows()) == DEFAULT_TABLE


def test_cli_capacity(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["kvserving"])  # main() rewrites sys.argv
    assert main(["capacity"]) == 0
    out = capsys.readouterr().out
    assert out.endswith(DEFAULT_TABLE + "\n") and "36 layers x 8 KV heads x head_dim 128" in out
    assert main(["capacity", "--gpu-gib", "1", "--layers", "2", "--kv-heads", "1", "--head-dim", "64"]) == 0
    nvfp4_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("nvfp4"))
    assert nvfp4_line.split() == ["nvfp4", "4.500", "144.0", "7,456,540", "0.28125", "0.5625"]  # 2^30 // 144
    assert main(["capacity", "--bit-budget", "5"]) == 2
    assert "bit_budget must be in [2, 4]" in capsys.readouterr().err


def test_bad_input_is_refused() -> None:
    shape = {"layers": 36, "kv_heads": 8, "head_dim": 128}
    with pytest.raises(ValueError, match="dtype must be one of"):
        bytes_per_token("int3", **shape)
    with pytest.raises(ValueError, match="frac_int2 must be in"):
        bytes_per_token("triaxial", frac_int2=1.5, **shape)
    with pytest.raises(ValueError, match="frac_int2 applies only to triaxial"):
        bytes_per_token("nvfp4", frac_int2=0.5, **shape)
    with pytest.raises(ValueError, match="multiple of 16 for nvfp4"):
        bytes_per_token("nvfp4", layers=1, kv_heads=1, head_dim=72)
    with pytest.raises(ValueError, match="multiple of 32 for triaxial"):
        bytes_per_token("triaxial", layers=1, kv_heads=1, head_dim=48)
    with pytest.raises(ValueError, match="layers must be an integer >= 1"):
        bytes_per_token("bf16", layers=0, kv_heads=1, head_dim=64)
    with pytest.raises(ValueError, match="bit_budget must be in"):
        capacity_rows(bit_budget=1.5)
    with pytest.raises(ValueError, match="gpu_bytes"):
        capacity_rows(gpu_bytes=0)
