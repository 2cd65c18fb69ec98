"""The tag-run helpers (prompt/tag_spans.py) and the request scan (openai_types._scan), which run
in C passes, equal plain per-step references on random inputs; exact values on small ones."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvserving.gateway.errors import GatewayError
from kvserving.gateway.openai_types import MAX_JSON_DEPTH, _scan
from kvserving.gateway.prompt.tag_spans import ALWAYS_CURRENT, expand_runs, final_runs, runs_before
from kvserving.tags import SEMANTIC


def _final_runs_ref(runs: list[tuple[int, int, int]], temporal_of: list[int]) -> tuple[tuple[int, int], ...]:
    width, out = 2 * len(SEMANTIC), []
    for hi, owner, base in runs:
        tag = (temporal_of[owner] if owner >= 0 else 0) * width + base
        if out and out[-1][1] == tag:
            out[-1] = (hi, tag)
        else:
            out.append((hi, tag))
    return tuple(out)


def _runs_before_ref(runs: list[tuple[int, int, int]], end: int) -> tuple[tuple[int, int, int], ...]:
    out: list[tuple[int, int, int]] = []
    if end <= 0:
        return ()
    for hi, owner, base in runs:
        out.append((min(hi, end), owner, base))
        if hi >= end:
            break
    return tuple(out)


def _expand_ref(runs: list[tuple[int, int]]) -> list[int]:
    out: list[int] = []
    lo = 0
    for hi, tag in runs:
        out += [tag] * (hi - lo)
        lo = hi
    return out


def _random_runs(rng: random.Random, owners: int) -> list[tuple[int, int, int]]:
    runs, end = [], 0
    for _ in range(rng.randint(0, 12)):
        end += rng.randint(1, 5)
        runs.append((end, rng.randint(ALWAYS_CURRENT, owners - 1), rng.randint(0, 13)))
    return runs


def test_final_runs_join_neighbours_of_one_tag_and_age_by_owner() -> None:
    width = 2 * len(SEMANTIC)
    # owner 0 is turn_m1 (temporal 1), owner 1 current; ALWAYS_CURRENT has offset 0
    runs = [(3, ALWAYS_CURRENT, 6), (5, 0, 1), (9, 0, 1), (10, 1, 1), (12, 1, 6)]
    assert final_runs(runs, [1, 0]) == ((3, 6), (9, width + 1), (10, 1), (12, 6))
    assert final_runs([], [0]) == ()


def test_tag_run_helpers_equal_their_per_step_references() -> None:
    rng = random.Random(0)
    for _ in range(1000):
        owners = rng.randint(1, 6)
        temporal_of = [rng.randint(0, 3) for _ in range(owners)]
        runs = _random_runs(rng, owners)
        assert final_runs(runs, temporal_of) == _final_runs_ref(runs, temporal_of)
        assert final_runs(tuple(runs), temporal_of) == _final_runs_ref(runs, temporal_of)
        for end in range(-1, (runs[-1][0] if runs else 0) + 3):
            assert runs_before(runs, end) == _runs_before_ref(runs, end)
        tag_runs = [(hi, owner + base) for hi, owner, base in runs]
        assert expand_runs(tag_runs) == _expand_ref(tag_runs)


def test_runs_before_cuts_the_run_that_reaches_the_end() -> None:
    runs = [(2, 0, 1), (5, 1, 2), (9, 2, 3)]
    assert runs_before(runs, 4) == ((2, 0, 1), (4, 1, 2))
    assert runs_before(runs, 5) == ((2, 0, 1), (5, 1, 2))
    assert runs_before(runs, 12) == tuple(runs)
    assert runs_before(runs, 0) == ()


def _scan_ref(root: Any) -> tuple[int, bool]:
    chars, odd, level, depth = 0, False, [root], 2
    while level:
        below: list[Any] = []
        for value in level:
            if type(value) is str:
                chars, odd = chars + len(value), odd or not value.isascii()
            elif type(value) is dict:
                for k in value:
                    chars, odd = chars + len(k), odd or not k.isascii()
                below.extend(value.values())
            elif type(value) is list:
                below.extend(value)
        if below and depth >= MAX_JSON_DEPTH and any(type(v) in (dict, list) for v in below):
            raise ValueError("too deep")
        level, depth = below, depth + 1
    return chars, odd


def test_request_scan_counts_characters_as_a_walk_of_every_value() -> None:
    assert _scan({"role": "user", "content": ["hé", {"x": 1}]}) == (4 + 4 + 7 + 2 + 1, True)
    assert _scan("abc") == (3, False)
    assert _scan(5) == (0, False)
    rng = random.Random(1)

    def value(depth: int) -> Any:
        r = rng.random()
        if depth > MAX_JSON_DEPTH + 5 or r < 0.3:
            return rng.choice(["", "abc", "héllo", 5, 1.5, None, True])
        if r < 0.65:
            return {rng.choice(["a", "é", "role"]) + str(i): value(depth + 1) for i in range(rng.randint(0, 3))}
        return [value(depth + 1) for _ in range(rng.randint(0, 3))]

    def nested(n: int) -> Any:
        v: Any = "x"
        for _ in range(n):
            v = [v] if rng.random() < 0.5 else {"k": v}
        return v

    for k in range(1000):
        v = value(0) if k % 3 else nested(rng.randint(MAX_JSON_DEPTH - 8, MAX_JSON_DEPTH + 4))
        try:
            expected: Any = _scan_ref(v)
        except ValueError:
            with pytest.raises(GatewayError):
                _scan(v)
            continue
        assert _scan(v) == expected
