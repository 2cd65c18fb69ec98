"""One result file per bench and machine: each configuration a bench runs is a named section of that file.

    {"what": "bench/engine_gpu.py: ...", "sections": {"default": {...one run...}, "iso": {...}}}

A run writes (or rewrites) its own section and keeps the others; ``combine`` joins result files of
one bench and machine (runs made elsewhere, e.g. on the device machine, or files written before
the sections) into one. A file without ``sections`` is one run: its section is named by the
bench's ``name_of``.

Every result file is written by ``kvserving.jsonfmt.dumps``: a row of scalars and a list of numbers
stay on one line each, so a file reads row by row and a diff names the rows that changed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvserving.jsonfmt import dumps


def sections(doc: dict[str, Any], name_of: Callable[[dict[str, Any]], str]) -> dict[str, dict[str, Any]]:
    """The named runs a result holds (one unnamed run: named by ``name_of``)."""
    if "sections" in doc:
        found: dict[str, dict[str, Any]] = doc["sections"]
        return found
    return {name_of(doc): doc}


def read_section(path: Path, name: str) -> dict[str, Any]:
    """One section of a result file; a clear error naming the sections there are."""
    doc = json.loads(path.read_text())
    held = doc.get("sections", {})
    if name not in held:
        raise KeyError(f"{path.name} has no section {name!r} (it has: {', '.join(held) or 'none'})")
    section: dict[str, Any] = held[name]
    return section


def write_section(path: Path, name: str, run: dict[str, Any], *, what: str, name_of: Callable[[dict[str, Any]], str]) -> None:
    """Write ``run`` as section ``name`` of ``path``, keeping the file's other sections."""
    held = sections(json.loads(path.read_text()), name_of) if path.is_file() else {}
    held[name] = run
    _write(path, what, held)


def combine(files: list[Path], out: Path, *, what: str, name_of: Callable[[dict[str, Any]], str]) -> dict[str, Any]:
    """Join the sections of ``files`` into ``out`` (a later file's section replaces an earlier one of the same name)."""
    held: dict[str, dict[str, Any]] = {}
    for path in files:
        held.update(sections(json.loads(path.read_text()), name_of))
    return _write(out, what, held)


def _write(path: Path, what: str, held: dict[str, dict[str, Any]]) -> dict[str, Any]:
    doc = {"what": what, "sections": held}
    path.write_text(dumps(doc))
    return doc
