"""Disaggregated serving with bidirectional KV reuse, as real processes on
loopback: one prefill and one decode `kvserving worker` (NIXL READs over UCX
on CPU memory), a 4-turn conversation driven turn by turn exactly as the
gateway drives it:

    prefill  <- input_ids, max_tokens 1, the decode's last kv_transfer_params  (D->P pull)
    decode   <- input_ids, the prefill's kv_transfer_params, conversation_key,
                retain                                                    (P->D pull)
    next turn's prompt = this prompt + the decode's reply + new user tokens

Asserted per turn, from ``usage``: which prompt tokens came from the local
prefix cache, which were pulled, and that turn n > 1 computes only the new
tokens (exactly, up to the partial last page); and that the tokens equal a
reference engine of the same format that never reuses KV.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvs_workers import WorkerFactory, WorkerProc, stream_generate
from kvserving.config import ServingConfig
from kvserving.tags import TEMPORAL, encode_tag
from kvserving.worker.engine import LLMEngine
from kvserving.worker.sampling import SamplingParams

TURNS = 4
FIRST_TURN_TOKENS = 157
NEW_TOKENS_PER_TURN = 72
REPLY_TOKENS = 8
CONVERSATION = "conv-e2e"


def worker_config(dtype: str) -> dict[str, Any]:
    """``triaxial``: the bits table fixed; ``triaxial-hold``: the bit-budget controller
    (kv_cache.bit_budget_control, the default)."""
    kv: dict[str, Any] = {"dtype": dtype, "memory_bytes": 16 << 20}
    if dtype == "triaxial":
        kv["bit_budget_control"] = "fixed"
    if dtype == "triaxial-hold":
        kv.update(dtype="triaxial", bit_budget_control="hold")
    return {
        "model": {"max_model_len": 1024},
        "kv_cache": kv,
        # pull whatever is there, however small: the usage numbers below are exact
        "reuse": {"recompute_threshold_tokens": 0},
    }


def reference_engine(dtype: str, model_dir: Path) -> LLMEngine:
    """The same engine a `both` worker runs, with the prefix cache's matching off: every
    prompt is computed in full (no reuse of any kind)."""
    cfg = worker_config(dtype)
    cfg["model"]["path"] = str(model_dir)
    engine = LLMEngine(ServingConfig.from_dict(cfg))
    engine.kv.match_prefix = lambda seq: 0  # type: ignore[method-assign]
    return engine


def tag_history(segments: list[tuple[int, str, list[int]]], turn: int) -> list[int]:
    """Tags as the gateway gives them: user or assistant text, temporal position counted in
    user turns back from ``turn``. ``segments``: (user turn, semantic, token ids)."""
    tags: list[int] = []
    for seg_turn, semantic, ids in segments:
        temporal = TEMPORAL[min(turn - seg_turn, len(TEMPORAL) - 1)]
        tags += [encode_tag(temporal, "text", semantic)] * len(ids)
    return tags


def leases(worker: WorkerProc) -> list[dict[str, Any]]:
    r = httpx.get(worker.url + "/internal/kv/leases", headers=worker.headers, timeout=10)
    assert r.status_code == 200, r.text
    found: list[dict[str, Any]] = r.json()["leases"]
    return found


def metric(text: str, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise AssertionError(f"no sample {name}{labels}")


@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3", "nvfp4", "triaxial", "triaxial-hold"])
def test_four_turn_conversation_pulls_both_ways_and_computes_only_new_tokens(
    workers: WorkerFactory, tiny_model_dir: Path, dtype: str
) -> None:
    cfg = worker_config(dtype)
    prefill = workers.start("prefill", cfg, wait=False)
    decode = workers.start("decode", cfg, wait=False)
    try:
        reference = reference_engine(dtype, tiny_model_dir)
        page = reference.storage.page_size
        prefill.wait_ready()
        decode.wait_ready()
        rng = random.Random(dtype)
        segments = [(1, "user", [rng.randrange(300, 4000) for _ in range(FIRST_TURN_TOKENS)])]
        decode_params: dict[str, Any] | None = None
        prev_len = 0
        reply: list[int] = []
        prefill_pulls = 0
        for turn in range(1, TURNS + 1):
            if turn > 1:
                segments += [(turn - 1, "assistant", reply), (turn, "user", [rng.randrange(300, 4000) for _ in range(NEW_TOKENS_PER_TURN)])]
            history = [t for _, _, ids in segments for t in ids]
            tags = tag_history(segments, turn)
            n = len(history)
            full = (n - 1) // page  # pages a prompt can reuse (its last token is always computed)
            want = reference.generate([history], SamplingParams(max_tokens=REPLY_TOKENS, ignore_eos=True), tags=[tags])[0]

            # prefill: its own cached pages of the last turn, the decode's retained pages pulled (D->P)
            p_tokens, p_final = stream_generate(
                prefill,
                {
                    "request_id": f"{dtype}-prefill-{turn}",
                    "input_ids": history,
                    "tags": tags,
                    "sampling": {"max_tokens": 1, "ignore_eos": True},
                    "kv_transfer_params": decode_params,
                    "conversation_key": CONVERSATION,
                },
            )
            pu = p_final["usage"]
            assert p_tokens == want[:1], f"turn {turn}: prefill token"
            if turn == 1:
                local, covered = 0, 0
            else:
                assert decode_params is not None
                retained = decode_params["num_tokens"] // page
                assert retained == (prev_len + REPLY_TOKENS - 1) // page  # prompt + reply, full pages
                local = min(prev_len // page, full) * page
                covered = min(retained, full) * page
            assert (pu["local_cached_tokens"], pu["remote_pulled_tokens"], pu["computed_prompt_tokens"]) == (
                local,
                covered - local,
                n - covered,
            ), f"turn {turn}: prefill usage {pu}"
            assert pu["reuse_fallback"] is None
            if turn > 1:
                # only the new user tokens and the reply's partial last page are computed
                assert pu["computed_prompt_tokens"] <= NEW_TOKENS_PER_TURN + page
                # the decode's pages past the prefill's own: the reply's pages (0 when the reply stayed in
                # the last partial page)
                assert (pu["kv_bytes_pulled"] > 0, pu["kv_regions_pulled"] >= 1) == (covered > local,) * 2
                prefill_pulls += covered > local
            p_params = p_final["kv_transfer_params"]
            assert p_params["lease_id"].startswith("xfer-")
            assert p_params["num_tokens"] == (n // page) * page and p_params["dtype"] == cfg["kv_cache"]["dtype"]

            # decode: its own retained pages locally, only the delta pulled from the prefill (P->D)
            d_tokens, d_final = stream_generate(
                decode,
                {
                    "request_id": f"{dtype}-decode-{turn}",
                    "input_ids": history,
                    "tags": tags,
                    "sampling": {"max_tokens": REPLY_TOKENS, "ignore_eos": True},
                    "kv_transfer_params": p_params,
                    "conversation_key": CONVERSATION,
                    "retain": True,
                },
            )
            du = d_final["usage"]
            assert d_tokens == want, f"turn {turn}: decode tokens differ from the no-reuse reference"
            own = 0 if decode_params is None else min(decode_params["num_tokens"] // page, full) * page
            assert (du["local_cached_tokens"], du["remote_pulled_tokens"], du["computed_prompt_tokens"]) == (
                own,
                full * page - own,
                n - full * page,
            ), f"turn {turn}: decode usage {du}"
            assert du["reuse_fallback"] is None and du["kv_bytes_pulled"] > 0
            decode_params = d_final["kv_transfer_params"]
            assert decode_params is not None and decode_params["lease_id"].startswith("kv-")
            # the decode holds one lease for the conversation (the newest); the prefill's hold was released
            held = leases(decode)
            assert [(le["conversation_key"], le["lease_id"]) for le in held] == [(CONVERSATION, decode_params["lease_id"])]
            assert held[0]["num_tokens"] == decode_params["num_tokens"]
            assert p_params["lease_id"] not in {le["lease_id"] for le in leases(prefill)}
            prev_len, reply = n, d_tokens

        d_metrics = httpx.get(decode.url + "/metrics", timeout=10).text
        p_metrics = httpx.get(prefill.url + "/metrics", timeout=10).text
        assert metric(d_metrics, "kvserving_worker_kv_transfer_bytes_total", direction="prefill_to_decode") > 0
        assert metric(d_metrics, "kvserving_worker_kv_transfer_seconds_count", direction="prefill_to_decode") == TURNS
        assert metric(d_metrics, "kvserving_worker_kv_transfer_regions_count", direction="prefill_to_decode") == TURNS
        assert prefill_pulls >= 1
        assert metric(p_metrics, "kvserving_worker_kv_transfer_bytes_total", direction="decode_to_prefill") > 0
        assert metric(p_metrics, "kvserving_worker_kv_transfer_seconds_count", direction="decode_to_prefill") == prefill_pulls
        assert metric(d_metrics, "kvserving_worker_prompt_tokens_by_source_total", source="remote_pull") > 0
        # every pull's pages were there at admission, and none was skipped for want of pages
        for m in (d_metrics, p_metrics):
            assert metric(m, "kvserving_worker_kv_pulled_tokens_lost_total") == 0
            assert metric(m, "kvserving_worker_kv_pull_skips_total", reason="no_free_pages") == 0
            assert metric(m, "kvserving_worker_kv_pull_missed_tokens_total", reason="no_free_pages") == 0
        assert metric(d_metrics, "kvserving_worker_prompt_tokens_by_source_total", source="local_cache") > 0
        assert metric(d_metrics, "kvserving_worker_kv_leases") == 1
        assert metric(d_metrics, "kvserving_worker_kv_leased_tokens") == decode_params["num_tokens"]
        assert metric(d_metrics, "kvserving_worker_generation_tokens_total") == TURNS * REPLY_TOKENS
        assert metric(p_metrics, "kvserving_worker_prompt_tokens_total") > 0
        if dtype == "triaxial-hold":
            # both controllers active; what each pool stores, and the cut it holds, in its stats
            cuts = {}
            for worker in (prefill, decode):
                st = httpx.get(worker.url + "/internal/kv/stats", headers=worker.headers, timeout=10).json()["stored_bits"]
                assert st["budget"] == 2.7 and 0.0 <= st["cut"] <= 56.0
                assert 2.0 <= st["excluded"] <= 4.0 and st["included"] == pytest.approx(st["excluded"] + 1.0)
                cuts[worker.url] = st["cut"]
            # one cut per deployment: the decode worker leads (its first look at its first request may move it) and the
            # cut travels with the pages both ways, on the ranking both workers hold; the prefill follows the cut the
            # last turn carried to it
            control = reference.kv.controller
            assert control is not None
            assert decode_params["bits_cut"] == cuts[decode.url] and p_params["bits_cut"] == cuts[prefill.url]
            assert cuts[prefill.url] == cuts[decode.url]  # the decode's cut reached the prefill (no move on the last turn)
            for params in (p_params, decode_params):
                assert params["bits_ranking"] == control.ranking
            # a cut this worker cannot honour (another ranking), or none where it holds one: recomputed, counted
            history = history + reply
            tags = tag_history(segments + [(TURNS, "assistant", reply)], TURNS + 1)
            want = reference.generate([history], SamplingParams(max_tokens=1, ignore_eos=True), tags=[tags])[0]
            stripped = {k: v for k, v in decode_params.items() if k not in ("bits_cut", "bits_ranking")}
            for i, bad in enumerate((dict(decode_params, bits_ranking="0" * 16), stripped)):
                b_tokens, b_final = stream_generate(
                    prefill,
                    {
                        "request_id": f"{dtype}-cut-{i}",
                        "input_ids": history,
                        "tags": tags,
                        "sampling": {"max_tokens": 1, "ignore_eos": True},
                        "kv_transfer_params": bad,
                    },
                )
                assert b_tokens == want and b_final["usage"]["reuse_fallback"] == "bits_cut_mismatch"
                assert b_final["usage"]["remote_pulled_tokens"] == 0
            p_metrics = httpx.get(prefill.url + "/metrics", timeout=10).text
            assert metric(p_metrics, "kvserving_worker_kv_reuse_fallbacks_total", reason="bits_cut_mismatch") == 2
            # the decode worker leads: a cut it carries on the same ranking becomes the prefill worker's cut
            moved = control.cut + 1.5
            m_tokens, m_final = stream_generate(
                prefill,
                {
                    "request_id": f"{dtype}-cut-moved",
                    "input_ids": history,
                    "tags": tags,
                    "sampling": {"max_tokens": 1, "ignore_eos": True},
                    "kv_transfer_params": dict(decode_params, bits_cut=moved),
                },
            )
            assert m_tokens == want and m_final["usage"]["reuse_fallback"] is None
            assert m_final["kv_transfer_params"]["bits_cut"] == moved
            st = httpx.get(prefill.url + "/internal/kv/stats", headers=prefill.headers, timeout=10).json()["stored_bits"]
            assert st["cut"] == moved
        assert metric(d_metrics, "kvserving_worker_kv_transfer_bytes_per_second") > 0
        assert metric(d_metrics, "kvserving_worker_kv_cache_usage_ratio") > 0  # the retained lease's pages
    finally:
        prefill.kill()
        decode.kill()
