"""Streaming on top of the engine: every engine call runs on one engine thread
while each request's tokens flow to its own asyncio queue.

The engine is not thread-safe, so nothing touches it from the event loop:
``add``, ``abort``, ``step`` and any ``call(fn)`` (stats, lease operations,
KV export and import) are queued on one single-thread executor and run in
submission order. The event loop never waits on a lock held by a step.

Adding a request has two halves: ``adder(stream, ...)`` is the engine-thread
half (it can run inside another engine-thread call: a KV pull adds its request
in the same call that pins its pages), ``started(stream)`` the event-loop half
that lets the request step; ``start`` runs both.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence as Seq
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvserving.worker.engine import LLMEngine, RequestOutput
from kvserving.worker.kv.leases import RetainSpec
from kvserving.worker.sampling import SamplingParams

T = TypeVar("T")
log = logging.getLogger(__name__)

# While every free page is pinned a step schedules nothing; wait this
# long before trying again (pins expire, aborts free pages).
IDLE_STEP_S = 0.005
ENGINE_THREAD = "kvserving-engine"


class DuplicateRequestError(ValueError):
    """A request with this id is already in flight on this engine."""


class RequestStream:
    """One request's outputs, in order; iterate it, or ``abort()`` it.

    Leaving the iteration early (a client disconnect cancels the consumer)
    aborts the request on the engine thread, which frees its pages.
    """

    def __init__(self, owner: AsyncEngine, request_id: str, num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self._owner = owner
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self.aborted = False  # ``abort()`` called: the request is not to run, added or not
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                yield item
                if item.finished:
                    self.finished = True
                    return
        finally:
            self.close()

    def close(self) -> None:
        """Stop streaming (idempotent); a request that has not finished is aborted."""
        if not self._closed:
            self._closed = True
            self._owner._forget(self.request_id, abort=not self.finished)

    def abort(self) -> None:
        """End the stream with ``finish_reason == "abort"`` and free the request's pages."""
        if self.finished:
            return
        self.aborted = True
        self._owner._submit_abort(self.request_id)
        self.queue.put_nowait(RequestOutput(self.request_id, [], True, "abort", self.num_prompt_tokens, 0, 0))


class AsyncEngine:
    """Streams tokens per request; the engine's steps run on one worker thread."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=ENGINE_THREAD)
        self._streams: dict[str, RequestStream] = {}
        self._started: set[str] = set()  # streams whose request reached the engine (``start``)
        self._loop_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._closed = False

    # ------------------------------------------------------------ engine thread
    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread, after every call queued before it."""
        if self._closed:
            raise RuntimeError("engine is closed")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, self.engine)

    def check(self, prompt_ids: Seq[int], params: SamplingParams, *, tags: Seq[int] | None = None, output_ids: Seq[int] = ()) -> None:
        """Raise the engine's ``ValueError`` for a request it could not run (``LLMEngine.check_request``:
        it reads only what does not change while the engine runs, so it runs here, not on its thread)."""
        self.engine.check_request(prompt_ids, params, tags=tags, output_ids=output_ids)

    def submit(self, fn: Callable[[LLMEngine], object]) -> None:
        """Run ``fn(engine)`` on the engine thread after every call queued before it, without waiting."""
        if not self._closed:
            self._executor.submit(fn, self.engine)

    def _submit_abort(self, request_id: str) -> None:
        if not self._closed:
            self._executor.submit(self.engine.abort, request_id)

    def _step(self, engine: LLMEngine) -> tuple[list[RequestOutput], bool]:
        outputs = engine.step()
        # progress: work remains and this step produced outputs or launched one on the device (asynchronous
        # decode returns a launched step's tokens from the next call)
        return outputs, engine.has_unfinished() and (bool(outputs) or engine.step_in_flight)

    async def _run(self) -> None:
        while True:
            # nothing started streams (a reserved request may still be pulling its KV): sleep
            # until the next start instead of stepping an empty engine every IDLE_STEP_S
            if not self._started:
                self._wake.clear()
                await self._wake.wait()
                continue
            self._wake.clear()  # a start from here on wakes the idle wait below at once
            try:
                outputs, progress = await self.call(self._step)
            except Exception as exc:  # a failed step fails every request in flight, not the server
                log.exception("engine step failed; aborting %d request(s)", len(self._streams))
                for stream in list(self._streams.values()):
                    stream.queue.put_nowait(exc)
                    self._submit_abort(stream.request_id)
                await asyncio.sleep(IDLE_STEP_S)
                continue
            for out in outputs:
                target = self._streams.get(out.request_id)
                if target is not None:
                    target.queue.put_nowait(out)
            if not progress:
                # pinned pages fill the pool, or streams wait to be read: let others run, but
                # a request started meanwhile runs in the next step, not IDLE_STEP_S later
                try:
                    await asyncio.wait_for(self._wake.wait(), IDLE_STEP_S)
                except TimeoutError:
                    pass

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    # ---------------------------------------------------------------- requests
    @property
    def in_flight(self) -> list[str]:
        """Ids of the requests streaming now, oldest first."""
        return list(self._streams)

    def reserve(self, request_id: str, num_prompt_tokens: int) -> RequestStream:
        """Claim ``request_id`` for a request about to be added (``start``).

        Raises ``DuplicateRequestError`` while a request with this id streams.
        ``close()`` the stream if the request never starts.
        """
        if request_id in self._streams:
            raise DuplicateRequestError(f"request_id {request_id!r} is already in flight")
        stream = RequestStream(self, request_id, num_prompt_tokens)
        self._streams[request_id] = stream
        return stream

    def adder(
        self,
        stream: RequestStream,
        prompt_ids: Seq[int],
        params: SamplingParams,
        *,
        tags: Seq[int] | None = None,
        retain: RetainSpec | None = None,
        output_ids: Seq[int] = (),
        cache_salt: str | None = None,
    ) -> Callable[[str | None], None]:
        """The engine-thread half of ``start``: a function that queues the reserved request on the
        engine under an admission pin (or none). Run it on the engine thread only (e.g. as a pull's
        ``admit``), then call ``started(stream)``; its ``ValueError`` means nothing was queued."""
        engine, rid = self.engine, stream.request_id

        def add(admission_pin: str | None) -> None:
            engine.add_request(
                rid,
                prompt_ids,
                params,
                tags=tags,
                retain=retain,
                admission_pin=admission_pin,
                output_ids=output_ids,
                cache_salt=cache_salt,
            )

        return add

    def started(self, stream: RequestStream) -> None:
        """The event-loop half of ``start``, once the request is queued on the engine: it steps with
        the others, unless its stream was closed or aborted meanwhile; then an abort follows the add
        (an abort queued before the add found nothing to abort)."""
        rid = stream.request_id
        if self._streams.get(rid) is stream and not stream.aborted:
            self._started.add(rid)
        else:
            self._submit_abort(rid)
        self._ensure_loop()
        self._wake.set()

    async def start(self, stream: RequestStream, add: Callable[[str | None], None], *, admission_pin: str | None = None) -> None:
        """Queue a reserved request on the engine: ``add`` (its ``adder``) on the engine thread, then
        ``started``; the engine's ``ValueError`` (nothing queued) reaches the caller and releases the id."""
        try:
            await self.call(lambda _: add(admission_pin))
        except BaseException:
            stream.finished = True  # never added: nothing to abort
            stream.close()
            raise
        self.started(stream)

    async def add(
        self,
        request_id: str,
        prompt_ids: Seq[int],
        params: SamplingParams,
        *,
        tags: Seq[int] | None = None,
    ) -> RequestStream:
        """``reserve`` + ``start``: queue a request, get the stream of its outputs."""
        stream = self.reserve(request_id, len(prompt_ids))
        await self.start(stream, self.adder(stream, prompt_ids, params, tags=tags))
        return stream

    def run_sync(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on the engine thread and wait for it (from a thread other than the
        event loop's; on the engine thread itself it runs at once instead of deadlocking)."""
        if threading.current_thread().name.startswith(ENGINE_THREAD):
            return fn()
        if self._closed:
            raise RuntimeError("engine is closed")
        return self._executor.submit(fn).result()

    def _forget(self, request_id: str, *, abort: bool) -> None:
        self._streams.pop(request_id, None)
        self._started.discard(request_id)
        if abort:
            self._submit_abort(request_id)

    def abort(self, request_id: str) -> bool:
        """Abort a streaming request (its stream ends with "abort"); False if unknown."""
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        stream.abort()
        return True

    async def generate(
        self,
        request_id: str,
        prompt_ids: Seq[int],
        params: SamplingParams,
        *,
        tags: Seq[int] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield one RequestOutput per generated token; the last has ``finished``."""
        stream = await self.add(request_id, prompt_ids, params, tags=tags)
        async for out in stream:
            yield out

    async def close(self) -> None:
        """Abort what still streams, stop the step loop and the engine thread."""
        for stream in list(self._streams.values()):
            stream.abort()
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
        self._closed = True
        self._executor.shutdown(wait=True)
