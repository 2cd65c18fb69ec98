"""kvserving.jsonfmt: the layout of result files (short values, lists of scalars and table rows on one line)."""

import json
import math

import pytest

from kvserving.jsonfmt import ROW_WIDTH, dumps


def test_lists_of_scalars_and_table_rows_stay_on_one_line_and_the_rest_is_indented() -> None:
    doc = {
        "what": "x",
        "empty": {"list": [], "dict": {}},
        "kl_per_sequence": [0.5] * 40,  # longer than a line: still one
        "rows": [{"format": "nvfp4", "kl": 0.0123, "note": "n" * ROW_WIDTH}, {"format": "bf16", "kl": 0.0, "note": None}],
        "pages": [[526, [[0, 32]]], [44, [[0, 27], [6, 5]]]],
        "config": {f"key_{i}": i for i in range(12)},  # longer than a line: a key a line
    }
    assert dumps(doc) == "\n".join(
        [
            "{",
            ' "what": "x",',
            ' "empty": {"list": [], "dict": {}},',
            ' "kl_per_sequence": [' + ", ".join(["0.5"] * 40) + "],",
            ' "rows": [',
            '  {"format": "nvfp4", "kl": 0.0123, "note": "' + "n" * ROW_WIDTH + '"},',
            '  {"format": "bf16", "kl": 0.0, "note": null}',
            " ],",
            ' "pages": [[526, [[0, 32]]], [44, [[0, 27], [6, 5]]]],',
            ' "config": {',
            *[f'  "key_{i}": {i}' + ("," if i < 11 else "") for i in range(12)],
            " }",
            "}",
            "",
        ]
    )


def test_what_it_writes_loads_back_as_json_dumps_would() -> None:
    doc = {"b": (1, 2), 3: {"nested": [{"a": [1.5, None, True]}] * 30}, "s": 'é\n"q"'}
    text = dumps(doc)
    assert json.loads(text) == json.loads(json.dumps(doc))
    assert dumps(json.loads(text)) == text  # stable: a rewritten file is unchanged
    assert list(json.loads(dumps(doc, sort_keys=True))) == ["3", "b", "s"]


def test_json_dumps_options_hold() -> None:
    assert dumps({"x": math.nan}) == '{"x": NaN}\n'
    with pytest.raises(ValueError, match="Out of range float"):
        dumps({"x": math.nan}, allow_nan=False)
    assert dumps({"p": object}, default=lambda o: "obj") == '{"p": "obj"}\n'
