"""``WorkerService.queue`` with a KV pull, without HTTP: a pull that pins pages adds its request
in its adopt hop (the request is never added again), and a client that leaves while the pull runs
leaves no request running in the engine and no admission pin. The pulls here are of the worker's
own retained conversation (its pages held here: nothing READ, the local prefix pinned)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvserving.config import KVCacheConfig, ModelConfig, ServingConfig
from kvserving.worker.api_bodies import GenerateBody
from kvserving.worker.engine import LLMEngine
from kvserving.worker.kv.leases import AdmissionRecord
from kvserving.worker.metrics import WorkerMetrics
from kvserving.worker.service import WorkerService

PROMPT = list(range(300, 400))  # 100 tokens: 6 full pages of 16 retained with the 8-token reply


def _config(model: Path) -> ServingConfig:
    return ServingConfig(model=ModelConfig(path=str(model), max_model_len=512), kv_cache=KVCacheConfig(dtype="bf16", memory_bytes=4 << 20))


def _body(rid: str, ids: list[int], **extra: Any) -> GenerateBody:
    return GenerateBody.model_validate({"request_id": rid, "input_ids": ids, "sampling": {"max_tokens": 8, "ignore_eos": True}, **extra})


async def _serve(config: ServingConfig) -> WorkerService:
    svc = WorkerService(
        config,
        role="both",
        metrics=WorkerMetrics(CollectorRegistry(), role="both"),
        engine_id="svc-both",
        advertise_url="http://127.0.0.1:9",
    )
    await svc.start(LLMEngine(config))
    return svc


async def _first_turn(svc: WorkerService) -> tuple[list[int], dict[str, Any]]:
    """Turn 1, retained: its reply and its final event (its lease's ``kv_transfer_params``, its ``timings``)."""
    reply: list[int] = []
    final: dict[str, Any] | None = None
    async for event in svc.events(svc.admit(_body("t1", PROMPT, retain=True, conversation_key="c1"))):
        reply.extend(event["token_ids"])
        if "finish_reason" in event:
            final = event
    assert final is not None and final["kv_transfer_params"]["num_tokens"] == 96
    return reply, final


def _record_adds(svc: WorkerService, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str | None, str]]:
    """Every ``LLMEngine.add_request`` from now on: request id, admission pin, thread name."""
    assert svc.engine is not None
    engine = svc.engine.engine
    add, adds = engine.add_request, []

    def recording(request_id: str, *args: Any, **kwargs: Any) -> None:
        adds.append((request_id, kwargs.get("admission_pin"), threading.current_thread().name))
        add(request_id, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", recording)
    return adds


def test_a_request_whose_pull_pins_pages_is_added_once_in_the_adopt_hop(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        svc = await _serve(_config(tiny_model_dir))
        try:
            reply, first = await _first_turn(svc)
            adds = _record_adds(svc, monkeypatch)
            req = svc.admit(_body("t2", PROMPT + reply + list(range(500, 520)), kv_transfer_params=first["kv_transfer_params"]))
            final = [e async for e in svc.events(req) if "finish_reason" in e][-1]
            assert (req.pull.skipped, req.pull.admitted) == ("nothing_to_pull", True)
            assert [(rid, pin) for rid, pin, _ in adds] == [("t2", req.pull.admission_pin)]
            assert adds[0][2].startswith("kvserving-engine")  # inside the pull's call on the engine thread
            u = final["usage"]
            assert (u["local_cached_tokens"], u["remote_pulled_tokens"], u["computed_prompt_tokens"]) == (96, 0, 32)
        finally:
            await svc.close()

    asyncio.run(main())


def test_a_client_that_leaves_while_its_pull_runs_leaves_no_request_running(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pull goes on on its thread after the client left, adds the request in its adopt hop, and
    that request is aborted on the engine thread: nothing runs it, nothing pins its pages."""

    async def main() -> None:
        svc = await _serve(_config(tiny_model_dir))
        engine = svc.engine
        assert engine is not None
        try:
            reply, first = await _first_turn(svc)
            adds = _record_adds(svc, monkeypatch)
            req = svc.admit(_body("t2", PROMPT + reply + list(range(500, 520)), kv_transfer_params=first["kv_transfer_params"]))
            gate = threading.Event()
            engine.submit(lambda _: gate.wait(30.0))  # a long engine step: the pull's hops queue behind it
            task = asyncio.create_task(svc.queue(req))
            await asyncio.sleep(0.1)  # the queue awaits its pull
            task.cancel()  # the client left
            with pytest.raises(asyncio.CancelledError):
                await task
            assert engine.in_flight == []
            gate.set()
            deadline = time.monotonic() + 30.0
            while not adds or await engine.call(lambda e: "t2" in e.requests):
                assert time.monotonic() < deadline, f"request still in the engine: {adds}"
                await asyncio.sleep(0.02)
            assert [(rid, pin is not None) for rid, pin, _ in adds] == [("t2", True)]
            pins = await engine.call(lambda e: [p.pin_id for p in e.pool.pins() if isinstance(p.record, AdmissionRecord)])
            assert pins == []
            assert svc.transfer is not None and svc.transfer.puller.skips["nothing_to_pull"] == 1
        finally:
            await svc.close()

    asyncio.run(main())


def test_the_first_token_phase_counters_sum_each_requests_timings(tiny_model_dir: Path) -> None:
    """``/internal/kv/stats``' ``first_token``: one request counted per first token, each phase's seconds the sum
    of the requests' ``timings`` for it (the pulled turn's pull phases among them)."""
    from kvserving.worker.metrics import FIRST_TOKEN_PHASES

    async def main() -> None:
        svc = await _serve(_config(tiny_model_dir))
        try:
            before = (await svc.kv_stats_body())["first_token"]
            assert before == {"requests": 0, "seconds": dict.fromkeys(FIRST_TOKEN_PHASES, 0.0)}
            reply, first = await _first_turn(svc)
            req = svc.admit(_body("t2", PROMPT + reply + list(range(500, 520)), kv_transfer_params=first["kv_transfer_params"]))
            finals = [first, *[e async for e in svc.events(req) if "finish_reason" in e]]
            assert req.pull.admitted
            after = (await svc.kv_stats_body())["first_token"]
            assert after["requests"] == 2
            timings = [f["timings"] for f in finals]
            assert "pull_adopt" not in timings[0] and timings[1]["pull_adopt"] > 0
            for phase in FIRST_TOKEN_PHASES:
                expect = sum(t.get(phase, 0.0) for t in timings) / 1e3
                assert abs(after["seconds"][phase] - expect) <= 2e-6, phase  # the timings are rounded to 1 us
        finally:
            await svc.close()

    asyncio.run(main())
