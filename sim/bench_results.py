"""What ``bench/agents.py`` wrote, read back for the simulator: its format names and its load."""

from __future__ import annotations

import math
from typing import Any

from kvserving.agents.load import Dist, LoadSpec

# bench/agents.py's names -> KV dtypes; the simulator stores triaxial at its budget's page mix, which is what
# tri-hold (the controller holding the budget) stores
BENCH_FORMATS = {"bf16": "bf16", "fp8": "fp8_e4m3", "nvfp4": "nvfp4", "triaxial": "triaxial", "tri-hold": "triaxial"}


def bench_dtype(name: str) -> str:
    """The KV dtype the simulator runs for one of bench/agents.py's format names."""
    if name not in BENCH_FORMATS:
        raise ValueError(f"bench format {name!r} is not one the simulator models ({', '.join(BENCH_FORMATS)})")
    return BENCH_FORMATS[name]


def load_spec_from_dict(data: dict[str, Any]) -> LoadSpec:
    """The ``LoadSpec`` bench/agents.py wrote with ``dataclasses.asdict``; it writes an unbounded
    ``Dist.high`` (inf) as null (strict JSON)."""
    if not isinstance(data, dict):
        raise ValueError("the benchmark JSON has no 'load' object")
    fields: dict[str, Any] = {
        k: Dist(**(dict(v, high=math.inf) if v.get("high", 0) is None else v)) if isinstance(v, dict) else v for k, v in data.items()
    }
    try:
        return LoadSpec(**fields)
    except TypeError as exc:
        raise ValueError(f"bad 'load' in the benchmark JSON: {exc}") from exc


def kv_bytes_per_worker(measured: dict[str, Any]) -> int:
    """The KV bytes per worker of a bench/agents.py result: ``kv_per_worker`` ("3072 KiB", "8 GiB"),
    or ``kv_kib_per_worker`` in results written before it."""
    if "kv_kib_per_worker" in measured:
        return int(measured["kv_kib_per_worker"]) * 1024
    number, unit = str(measured["kv_per_worker"]).split()
    scale = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    if unit not in scale:
        raise ValueError(f"kv_per_worker {measured['kv_per_worker']!r}: the unit must be one of {sorted(scale)}")
    return int(float(number) * scale[unit])


def page_major(measured: dict[str, Any]) -> bool:
    """Whether the workers of a bench/agents.py result kept page-major KV (``kv_layout``; a result written before
    it was recorded ran layer-major)."""
    return measured.get("kv_layout", "layer_major") == "page_major"
