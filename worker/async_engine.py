"""Streaming on top of the engine: its steps run on one worker thread while
each request's tokens flow to its own asyncio queue."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence as Seq
from concurrent.futures import ThreadPoolExecutor

from kvserving.worker.engine import LLMEngine, RequestOutput
from kvserving.worker.sampling import SamplingParams


class AsyncEngine:
    """Streams tokens per request; the engine's steps run on one worker thread."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserving-engine")
        self._lock = threading.Lock()
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def _add(self, request_id: str, prompt_ids: Seq[int], params: SamplingParams, tags: Seq[int] | None) -> None:
        with self._lock:
            self.engine.add_request(request_id, prompt_ids, params, tags=tags)

    def _step(self) -> list[RequestOutput]:
        with self._lock:
            return self.engine.step()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, self._step)
            except Exception as exc:  # a failed step fails every request in flight, not the server
                for q in self._queues.values():
                    q.put_nowait(exc)
                with self._lock:
                    for rid in list(self.engine.requests):
                        self.engine.abort(rid)
                continue
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            if not outputs:
                await asyncio.sleep(0.005)  # pool full of leased pages: wait for expiry

    async def generate(
        self,
        request_id: str,
        prompt_ids: Seq[int],
        params: SamplingParams,
        *,
        tags: Seq[int] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield one RequestOutput per generated token; the last has ``finished``."""
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            self._add(request_id, prompt_ids, params, tags)  # ValueError reaches the caller
            self._wake.set()
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if request_id in self.engine.requests:
                with self._lock:
                    self.engine.abort(request_id)

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._executor.shutdown(wait=False)
