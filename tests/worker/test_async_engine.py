"""AsyncEngine streams each request's tokens while others run beside it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvserving.config import KVCacheConfig, ModelConfig, ServingConfig
from kvserving.worker.async_engine import AsyncEngine
from kvserving.worker.engine import LLMEngine, RequestOutput
from kvserving.worker.sampling import SamplingParams


def test_concurrent_streams_equal_offline_outputs_and_errors_stay_local(tiny_model_dir: Path) -> None:
    config = ServingConfig(model=ModelConfig(path=str(tiny_model_dir)), kv_cache=KVCacheConfig(dtype="nvfp4", memory_bytes=16 << 20))
    prompts = [list(range(30, 30 + n)) for n in (5, 40, 17)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = LLMEngine(config).generate(prompts, params)

    async def collect(engine: AsyncEngine, rid: str, prompt: list[int]) -> list[RequestOutput]:
        return [o async for o in engine.generate(rid, prompt, params)]

    async def main() -> tuple[list[list[RequestOutput]], str]:
        engine = AsyncEngine(LLMEngine(config))
        try:
            tasks = [asyncio.create_task(collect(engine, f"r{i}", p)) for i, p in enumerate(prompts)]
            with pytest.raises(ValueError, match="prompt is empty") as err:
                await collect(engine, "bad", [])
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
            return results, str(err.value)
        finally:
            await engine.close()

    results, _ = asyncio.run(main())
    for outs, want in zip(results, expected):
        assert [t for o in outs for t in o.new_token_ids] == want
        assert [o.finished for o in outs] == [False] * 11 + [True]
        assert outs[-1].finish_reason == "length"
        assert outs[-1].num_output_tokens == 12


@pytest.mark.parametrize("end", ["close", "abort"])
def test_a_request_added_after_its_stream_ended_is_aborted_after_the_add(tiny_model_dir: Path, end: str) -> None:
    """The engine-thread half (``adder``, as a KV pull runs it) adds a request whose stream was closed or
    aborted meanwhile, after that abort ran: ``started`` aborts it again, so it does not run."""
    config = ServingConfig(model=ModelConfig(path=str(tiny_model_dir)), kv_cache=KVCacheConfig(memory_bytes=4 << 20))

    async def main() -> tuple[bool, bool, list[str | None]]:
        engine = AsyncEngine(LLMEngine(config))
        try:
            stream = engine.reserve("r", 5)
            add = engine.adder(stream, [30, 31, 32, 33, 34], SamplingParams(max_tokens=4, ignore_eos=True))
            getattr(stream, end)()  # while its add is on its way (the abort runs first, finding nothing)
            await engine.call(lambda _: add(None))
            added = await engine.call(lambda e: "r" in e.requests)
            engine.started(stream)
            running = await engine.call(lambda e: "r" in e.requests)
            reasons = [o.finish_reason async for o in stream] if end == "abort" else []
            return added, running, reasons
        finally:
            await engine.close()

    assert asyncio.run(main()) == (True, False, ["abort"] if end == "abort" else [])
