"""``kvserving config``: the engine-config file with every field and its default, the
file ``kvserving worker``, ``gateway`` and ``up`` take with ``--config``.

    kvserving config --set security.internal_token_file=/tmp/kv-token --out engine.json

``--set SECTION.KEY=VALUE`` changes one field: VALUE is read as JSON (``64``,
``true``, ``null``, ``["a"]``) and as a string when it is not JSON. The result
is checked as every reader checks it (``ServingConfig.from_dict``) before it is
written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvserving.argtypes import check_output_file
from kvserving.config import ServingConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        dest="sets",
        help="change one field (VALUE as JSON, else as a string); repeatable",
    )
    parser.add_argument("--out", type=Path, default=None, help="file to write (default: standard output)")


def with_sets(sets: list[str]) -> ServingConfig:
    """The default engine config with each ``SECTION.KEY=VALUE`` applied (ValueError naming a bad one)."""
    data: dict[str, Any] = ServingConfig().to_dict()
    for item in sets:
        name, eq, text = item.partition("=")
        section, dot, key = name.partition(".")
        if not eq or not dot:
            raise ValueError(f"--set {item!r}: expected SECTION.KEY=VALUE, e.g. scheduler.max_num_seqs=32")
        if section not in data:
            raise ValueError(f"--set {item!r}: unknown section {section!r} (one of {', '.join(sorted(data))})")
        if key not in data[section]:
            raise ValueError(f"--set {item!r}: section {section!r} has no key {key!r} (one of {', '.join(sorted(data[section]))})")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        data[section][key] = value
    return ServingConfig.from_dict(data)


def run(args: argparse.Namespace) -> int:
    if args.out is not None:
        check_output_file(args.out, "--out")
    text = with_sets(args.sets).to_json() + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0
