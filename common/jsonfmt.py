"""JSON written for people: indented, with lists of scalars, table rows and short values on one line each.

Result files (``bench/results/``, ``kvserving simulate --json``) hold per-layer and per-sequence
lists of numbers and tables of runs; ``json.dumps(indent=...)`` puts each number on a line of its
own, which makes a file of a few hundred rows tens of thousands of lines long. ``dumps`` keeps a
row a line::

    {
     "contexts": [2048, 8192],
     "rows": [
      {"format": "nvfp4", "ctx": 2048, "kl": 0.0123, "top1": 0.991},
      {"format": "fp8_e4m3", "ctx": 2048, "kl": 0.0004, "top1": 0.998}
     ],
     "model": {"layers": 8, "hidden": 768}
    }

so a file reads row by row and a diff names the rows that changed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

# Any value goes on one line when that line (indent and key included) stays this short. A list of
# scalars (a per-layer or per-sequence list) and a row of a table (a list of dicts of scalars) go
# on one line however long.
ROW_WIDTH = 120


def dumps(doc: Any, *, sort_keys: bool = False, allow_nan: bool = True, default: Callable[[Any], Any] | None = None) -> str:
    """``doc`` as JSON, one space of indent per level, ending in a newline; ``json.loads`` of it equals
    ``json.loads(json.dumps(doc))``. The options are ``json.dumps``'s."""
    plain = json.loads(json.dumps(doc, allow_nan=allow_nan, default=default))  # tuples, non-str keys, ``default`` resolved
    return _Writer(sort_keys=sort_keys, allow_nan=allow_nan).value(plain, "", 0) + "\n"


def _scalars(values: Iterable[Any]) -> bool:
    return not any(isinstance(v, (dict, list)) for v in values)


class _Writer:
    def __init__(self, *, sort_keys: bool, allow_nan: bool) -> None:
        self.sort_keys = sort_keys
        self.allow_nan = allow_nan

    def flat(self, value: Any) -> str:
        return json.dumps(value, allow_nan=self.allow_nan, sort_keys=self.sort_keys, separators=(", ", ": "))

    def value(self, value: Any, indent: str, lead: int) -> str:
        """``value`` at ``indent``, after ``lead`` characters of its line (indent and key)."""
        if not isinstance(value, (dict, list)) or not value:
            return json.dumps(value, allow_nan=self.allow_nan)
        flat = self.flat(value)
        if lead + len(flat) <= ROW_WIDTH or (isinstance(value, list) and _scalars(value)):
            return flat
        inner = indent + " "
        if isinstance(value, dict):
            items = sorted(value.items()) if self.sort_keys else value.items()
            parts = []
            for key, item in items:
                head = f"{inner}{json.dumps(key)}: "
                parts.append(head + self.value(item, inner, len(head)))
            return "{\n" + ",\n".join(parts) + "\n" + indent + "}"
        if all(isinstance(v, dict) and _scalars(v.values()) for v in value):  # a table: a row a line
            parts = [inner + self.flat(v) for v in value]
        else:
            parts = [inner + self.value(v, inner, len(inner)) for v in value]
        return "[\n" + ",\n".join(parts) + "\n" + indent + "]"
