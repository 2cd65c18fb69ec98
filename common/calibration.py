"""The calibration file: what ``kvserving calibrate`` measured on a model, and
what the engine takes from it (the triaxial bits table for its budget, the
fp8/nvfp4 per-layer global scales). Pure Python; imports no component.

The file is JSON (``kvserving calibrate --out FILE``; the operator mounts it
from a ConfigMap and the engine config names it in ``kv_cache.calibration``)::

    {
      "version": 1,
      "model": {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64},
      "tokens": 8192,                      # calibration tokens measured
      "frequency": [56 token shares],      # N_k / N: each tag class's share of the tokens
      "frequency_source": "data",          # shares the budget is met under: "data" or "agent"
      "distortion": {"2": [56], "4": [56]},  # D_k(b), DESIGN.md (0 for a class absent from the data)
      "tables": {"2.7": [56 bits], ...},   # the greedy rule's table per requested budget
      "pages": {"size": 32, "residual": 17,  # optional: the calibration prompts' full pages by
                "counts": [[n, [[tag, tokens], ...]], ...]},  # class mix (n pages each), residual tokens
      "scales": {"fp8_e4m3": {"k": [L], "v": [L], "method": "amax"},
                 "nvfp4":    {"k": [L], "v": [L], "method": "search"}}
    }

A budget the file has no table for is derived from its measurements with the
same greedy rule (``table_for_budget``), so one file serves every budget.

With ``pages`` (and data shares) the budget counts bits the way the engine
stores them (DESIGN.md): a page is INT2 only when it is full and all of its
tokens are 2-bit, so a class spread thinly over many pages (delimiters) costs
far more than its token share. The greedy rule then upgrades, step by step,
the class whose upgrade buys the most fidelity per stored bit: the pages it
turns INT4, each worth the summed per-token gains ``(D_c(2) - D_c(4)) / N_c``
of all its tokens, over the bits those pages add. With pages that each hold
one class this is DESIGN.md's order ``(D_k(2) - D_k(4)) / (2 N_k)``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserving.bits import (
    average_bits,
    default_frequency,
    default_sensitivity,
    greedy_bits_table,
    page_greedy_table,
    pages_stored_bits,
)
from kvserving.tags import NUM_TAGS, validate_bits_table

VERSION = 1
SCALED_DTYPES = ("fp8_e4m3", "nvfp4")
FREQUENCY_SOURCES = ("data", "agent")
# A class seen on fewer tokens than this has no measured priority of its own (see ``priorities``).
MIN_CLASS_TOKENS = 1


def budget_key(budget: float) -> str:
    """The key of a budget in ``tables``: ``2.7``, ``3`` (Python's ``%g``)."""
    return f"{float(budget):g}"


@dataclass(slots=True, frozen=True)
class LayerScales:
    """Per-layer global K and V scales of one format, and how they were chosen."""

    k: tuple[float, ...]
    v: tuple[float, ...]
    method: str = "amax"


@dataclass(slots=True, frozen=True)
class Calibration:
    """A parsed, checked calibration file (``load`` / ``from_dict``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens: int
    frequency: tuple[float, ...]
    frequency_source: str
    distortion: dict[int, tuple[float, ...]]  # bits -> D_k(bits) for the 56 classes
    tables: dict[str, tuple[int, ...]]  # budget_key -> bits table
    scales: dict[str, LayerScales]  # kv dtype -> scales
    # The calibration prompts' full pages: (number of pages, ((tag, tokens), ...)); residual
    # tokens of partial last pages (stored INT4). Empty: the budget counts token shares.
    pages: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] = ()
    page_size: int = 32
    residual: int = 0

    def priorities(self) -> tuple[float, ...]:
        """Fidelity gained per token when a class goes from 2 to 4 bits: ``(D_k(2) - D_k(4)) / N_k``.

        A class absent from the calibration data has no measurement; it gets the
        default model's per-token sensitivity (``kvserving.bits``) rescaled to the
        measured classes (by the ratio of their means), so the file still orders it.
        """
        d2, d4 = self.distortion[2], self.distortion[4]
        seen = [k for k in range(NUM_TAGS) if self.frequency[k] * self.tokens >= MIN_CLASS_TOKENS]
        prior = default_sensitivity()
        measured = {k: max(0.0, d2[k] - d4[k]) / self.frequency[k] for k in seen}
        if not measured:
            return prior
        ratio = sum(measured.values()) / sum(prior[k] for k in seen)
        return tuple(measured.get(k, prior[k] * ratio) for k in range(NUM_TAGS))

    def budget_frequency(self) -> tuple[float, ...]:
        """The class shares the budget is met under: the data's (absent classes a
        negligible share) or the default agent-context shares of ``kvserving.bits``."""
        if self.frequency_source == "agent":
            return default_frequency()
        return tuple(max(f, 1e-9) for f in self.frequency)

    def page_rule(self) -> bool:
        """Whether budgets count stored pages (``pages`` present and data shares)."""
        return bool(self.pages) and self.frequency_source == "data"

    def derive_table(self, budget: float, per_token: Sequence[float] | None = None) -> tuple[int, ...]:
        """DESIGN.md's greedy rule at ``budget`` over the measured priorities (or the
        per-token gains ``per_token``, e.g. the default sensitivities, on the same data)."""
        prio = self.priorities() if per_token is None else tuple(per_token)
        if self.page_rule():
            return page_greedy_table(budget, prio, self.pages, page_size=self.page_size, residual=self.residual)
        freq = self.budget_frequency()
        gain = tuple(p * n for p, n in zip(prio, freq))
        return greedy_bits_table(budget, gain=gain, frequency=freq)

    def stored_bits(self, table: Sequence[int]) -> float:
        """Average bits per token ``table`` stores on the calibration data: by pages when
        the file has them (partial pages INT4), else by the budget's class shares."""
        if not self.pages:
            return average_bits(table, self.budget_frequency())
        return pages_stored_bits(table, self.pages, page_size=self.page_size, residual=self.residual)

    def table_for_budget(self, budget: float) -> tuple[tuple[int, ...], str]:
        """(bits table, "stored" or "derived") for ``budget``."""
        stored = self.tables.get(budget_key(budget))
        if stored is not None:
            return stored, "stored"
        return self.derive_table(budget), "derived"

    def scales_for(self, kv_dtype: str, num_layers: int) -> LayerScales | None:
        """The scales for ``kv_dtype`` (None if the file has none); ValueError on a layer-count mismatch."""
        scales = self.scales.get(kv_dtype)
        if scales is None:
            return None
        if len(scales.k) != num_layers:
            raise ValueError(f"calibration has {len(scales.k)} {kv_dtype} layer scales, the model has {num_layers} layers")
        return scales

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "model": {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim},
            "tokens": self.tokens,
            "frequency": list(self.frequency),
            "frequency_source": self.frequency_source,
            "distortion": {str(b): list(d) for b, d in sorted(self.distortion.items())},
            "tables": {key: list(t) for key, t in self.tables.items()},
            "scales": {name: {"k": list(s.k), "v": list(s.v), "method": s.method} for name, s in sorted(self.scales.items())},
            **(
                {
                    "pages": {
                        "size": self.page_size,
                        "residual": self.residual,
                        "counts": [[n, [list(tc) for tc in mix]] for n, mix in self.pages],
                    }
                }
                if self.pages
                else {}
            ),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: object) -> Calibration:
        """Check and parse; ValueError names the field that is wrong."""
        if not isinstance(data, Mapping):
            raise ValueError("calibration must be a JSON object")
        if data.get("version") != VERSION:
            raise ValueError(f"calibration version must be {VERSION}, got {data.get('version')!r}")
        model = data.get("model")
        if not isinstance(model, Mapping):
            raise ValueError("calibration.model must be an object")
        dims = {name: _positive_int(model.get(name), f"calibration.model.{name}") for name in ("num_layers", "num_kv_heads", "head_dim")}
        tokens = _positive_int(data.get("tokens"), "calibration.tokens")
        frequency = _floats(data.get("frequency"), "calibration.frequency", NUM_TAGS)
        if any(f < 0 for f in frequency) or not 0.999 <= sum(frequency) <= 1.001:
            raise ValueError("calibration.frequency must be 56 shares >= 0 that sum to 1")
        source = data.get("frequency_source", "data")
        if source not in FREQUENCY_SOURCES:
            raise ValueError(f"calibration.frequency_source must be one of {FREQUENCY_SOURCES}, got {source!r}")
        raw_d = data.get("distortion")
        if not isinstance(raw_d, Mapping) or set(raw_d) != {"2", "4"}:
            raise ValueError('calibration.distortion must map "2" and "4" to 56 values each')
        distortion = {int(b): _floats(raw_d[b], f"calibration.distortion.{b}", NUM_TAGS) for b in ("2", "4")}
        raw_t = data.get("tables", {})
        if not isinstance(raw_t, Mapping):
            raise ValueError("calibration.tables must be an object")
        tables: dict[str, tuple[int, ...]] = {}
        for key, table in raw_t.items():
            try:
                budget = float(key)
            except ValueError:
                raise ValueError(f"calibration.tables key {key!r} is not a bit budget") from None
            if not 2.0 <= budget <= 4.0:
                raise ValueError(f"calibration.tables key {key!r} must be a budget in [2, 4]")
            if not isinstance(table, list):
                raise ValueError(f"calibration.tables.{key} must be a list of 56 bits")
            try:
                tables[budget_key(budget)] = validate_bits_table(table)
            except ValueError as exc:
                raise ValueError(f"calibration.tables.{key}: {exc}") from None
        raw_s = data.get("scales", {})
        if not isinstance(raw_s, Mapping):
            raise ValueError("calibration.scales must be an object")
        scales: dict[str, LayerScales] = {}
        for name, entry in raw_s.items():
            if name not in SCALED_DTYPES:
                raise ValueError(f"calibration.scales key {name!r} must be one of {SCALED_DTYPES}")
            if not isinstance(entry, Mapping):
                raise ValueError(f"calibration.scales.{name} must be an object")
            k = _floats(entry.get("k"), f"calibration.scales.{name}.k", dims["num_layers"])
            v = _floats(entry.get("v"), f"calibration.scales.{name}.v", dims["num_layers"])
            if any(not s > 0 for s in k + v):
                raise ValueError(f"calibration.scales.{name} must be > 0")
            scales[name] = LayerScales(k, v, str(entry.get("method", "amax")))
        pages, page_size, residual = _pages(data.get("pages"), tokens)
        return cls(
            num_layers=dims["num_layers"],
            num_kv_heads=dims["num_kv_heads"],
            head_dim=dims["head_dim"],
            tokens=tokens,
            frequency=frequency,
            frequency_source=source,
            distortion=distortion,
            tables=tables,
            scales=scales,
            pages=pages,
            page_size=page_size,
            residual=residual,
        )

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """Read and check a calibration file; ValueError (naming the file) on bad content."""
        text = Path(path).read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"calibration file {path} is not valid JSON: {exc}") from None
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"calibration file {path}: {exc}") from None


def _pages(raw: object, tokens: int) -> tuple[tuple[tuple[int, tuple[tuple[int, int], ...]], ...], int, int]:
    """The optional ``pages`` field: (pages, size, residual); ValueError names what is wrong."""
    if raw is None:
        return (), 32, 0
    if not isinstance(raw, Mapping):
        raise ValueError("calibration.pages must be an object")
    size = _positive_int(raw.get("size"), "calibration.pages.size")
    residual = raw.get("residual", 0)
    if not isinstance(residual, int) or isinstance(residual, bool) or residual < 0:
        raise ValueError(f"calibration.pages.residual must be an integer >= 0, got {residual!r}")
    counts = raw.get("counts")
    if not isinstance(counts, list):
        raise ValueError("calibration.pages.counts must be a list of [pages, [[tag, tokens], ...]]")
    pages = []
    for i, entry in enumerate(counts):
        where = f"calibration.pages.counts[{i}]"
        if not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[1], list):
            raise ValueError(f"{where} must be [pages, [[tag, tokens], ...]]")
        n = _positive_int(entry[0], f"{where}[0]")
        mix = []
        for pair in entry[1]:
            if (
                not isinstance(pair, list)
                or len(pair) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair)
                or not 0 <= pair[0] < NUM_TAGS
                or pair[1] < 1
            ):
                raise ValueError(f"{where}: each class entry must be [tag 0..{NUM_TAGS - 1}, tokens >= 1]")
            mix.append((pair[0], pair[1]))
        if sum(t for _, t in mix) != size:
            raise ValueError(f"{where}: a page's class tokens must sum to the page size {size}")
        pages.append((n, tuple(mix)))
    if residual + size * sum(n for n, _ in pages) != tokens:
        raise ValueError("calibration.pages must account for every calibration token (pages x size + residual = tokens)")
    return tuple(pages), size, residual


def _positive_int(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _floats(value: object, name: str, n: int) -> tuple[float, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != n:
        raise ValueError(f"{name} must be a list of {n} numbers")
    if any(not isinstance(x, int | float) or isinstance(x, bool) for x in value):
        raise ValueError(f"{name} must hold numbers only")
    return tuple(float(x) for x in value)
