"""bench/sim_agents_per_gpu.py: a best split at the edge of the shares searched extends the search."""

from __future__ import annotations

from bench_module import load_bench

bench = load_bench("sim_agents_per_gpu")


def _rows(fmt: str, agents_by_share: dict[float, int]) -> list[dict]:
    return [{"format": fmt, "prefill_share": s, "agents": a} for s, a in agents_by_share.items()]


def test_a_best_split_at_the_top_edge_searches_the_next_share_up() -> None:
    rows = _rows("fp8", {0.25: 600, 0.375: 1000, 0.5: 2000}) + _rows("nvfp4", {0.25: 900, 0.375: 1800, 0.5: 1700})
    assert bench.edge_shares(rows, ["fp8", "nvfp4"], step=0.125, gpus=64) == [("fp8", 0.625)]


def test_a_best_split_at_the_bottom_edge_searches_the_next_share_down() -> None:
    rows = _rows("triaxial", {0.25: 900, 0.375: 800})
    assert bench.edge_shares(rows, ["triaxial"], step=0.125, gpus=64) == [("triaxial", 0.125)]


def test_no_share_past_the_last_split_that_leaves_a_worker_of_each_role() -> None:
    # 4 GPUs: shares 0.75 and 0.875 both split 3 / 1, and 1.0 leaves no decode worker
    assert bench.edge_shares(_rows("fp8", {0.5: 10, 0.75: 20}), ["fp8"], step=0.125, gpus=4) == []
    assert bench.edge_shares(_rows("fp8", {0.625: 10, 0.75: 20}), ["fp8"], step=0.25, gpus=4) == []


def test_nothing_more_once_the_best_split_is_inside_or_nothing_meets_the_target() -> None:
    assert bench.edge_shares(_rows("fp8", {0.25: 1, 0.375: 3, 0.5: 2}), ["fp8"], step=0.125, gpus=64) == []
    assert bench.edge_shares(_rows("fp8", {0.25: 0, 0.375: 0}), ["fp8"], step=0.125, gpus=64) == []
