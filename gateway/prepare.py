"""Where a prompt is prepared (rendered, tokenized, tagged): on the event loop, or, for a
request of more than ``OFF_LOOP_CHARS`` characters, on a worker thread, so that one huge
prompt does not hold every other stream's frames back for the time it takes.

A prompt prepared on a thread does only the pure work there (render, tokenize, tag); the
conversation store stays the event loop's alone, as if the prompt had been prepared on it:

    thread                                 event loop (owns the store and the counters)
    ChatTagger.build, a private copy:
      TurnRenders.find  ─────────────────>  finds the kept render; hands back a copy
      render, marked render
      TokenPrefixes._lookup  ────────────>  finds the kept prefix; hands back a copy
      tokenize the rest, tag
      (a shared prefix already kept) ────>  hands back a copy
    returns the prompt  ─────────────────>  adds the copy's counts to the tagger's;
                                            identity files what the prompt kept

Each arrow is one call the thread waits for (``LoopStore.run``): three per prompt, not one
per candidate cut or render bucket. Why not one lock around the store instead: the loop
would then wait for the thread (a lock held while the thread prepares 100K characters is a
stall for every stream), or every store call on both sides would take it, in modules that
are pure today. This way the store is read and written by one thread only, as its modules
say (conversations.py, prompt/token_prefixes.py, prompt/turn_render.py): an eviction runs
between two of the thread's calls, and what the thread holds are copies, whose arrays and
messages nobody changes. The tagger's reuse counters are the copy's own, added on the loop
(``+=`` from two threads may lose an increment). What the thread writes on what it found
(a kept render's head renders, a kept prefix's labels: memos) goes to the copies.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from .prompt.tagger import ChatTagger, TaggedPrompt
from .prompt.token_prefixes import PrefixEntry, TokenPrefixes
from .prompt.turn_render import KeptRender, RenderKey, TurnRenders

# Characters of a chat request's messages and tools (or of a text prompt) above which its
# prompt is prepared on a worker thread: ~100K characters (~25K tokens) take ~10 ms of prompt
# work here, a stall every other stream would see; below it the hand-off costs more than it spares.
OFF_LOOP_CHARS = 100_000
_T = TypeVar("_T")


class LoopStore:
    """The conversation store's prompt indexes (``KeptPrefixes``, ``KeptRenders``) for a prompt
    prepared on a worker thread: every call runs on the event loop (the thread waits for it),
    and what it finds comes back as a copy. Made on the loop."""

    def __init__(self, store: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.store = store
        self.loop = loop
        self._loop_thread = threading.get_ident()

    def run(self, work: Callable[..., _T], *args: Any) -> _T:
        """``work(*args)`` on the event loop: at once when called there, else handed to it."""
        if threading.get_ident() == self._loop_thread:
            return work(*args)
        done: concurrent.futures.Future[_T] = concurrent.futures.Future()

        def call() -> None:
            try:
                done.set_result(work(*args))
            except BaseException as exc:  # the thread raises it
                done.set_exception(exc)

        self.loop.call_soon_threadsafe(call)
        return done.result()

    def prefix(self, key: tuple[int, int]) -> PrefixEntry | None:
        return self.run(self._prefix, key)

    def _prefix(self, key: tuple[int, int]) -> PrefixEntry | None:
        entry = self.store.prefix(key)
        return dataclasses.replace(entry) if entry is not None else None

    def has_cut(self, cut: int) -> bool:
        return bool(self.run(self.store.has_cut, cut))

    @property
    def prefix_tokens(self) -> int:
        return int(self.run(lambda: self.store.prefix_tokens))

    def renders(self, key: RenderKey) -> list[KeptRender]:
        return self.run(lambda: [dataclasses.replace(k, heads=dict(k.heads)) for k in self.store.renders(key)])


class _Prefixes(TokenPrefixes):
    """``TokenPrefixes`` whose lookup (a scan of the text's cut tokens and one index probe per
    candidate) runs whole on the loop, in one call."""

    kept: LoopStore

    def _lookup(self, text: str, scope: str) -> PrefixEntry | None:
        return self.kept.run(super()._lookup, text, scope)


class _Renders(TurnRenders):
    """``TurnRenders`` whose find runs whole on the loop, and whose counts are replayed on the
    tagger's own (``checked`` turns appending off by the same rule)."""

    kept: LoopStore

    def __init__(self, kept: LoopStore, *, on: bool) -> None:
        super().__init__(kept)
        self.on = on
        self.calls: list[tuple[str, bool]] = []

    def find(
        self, raw: Sequence[Any], tools: object, options: tuple[bool, Mapping[str, Any] | None], *, scope: str = ""
    ) -> KeptRender | None:
        return self.kept.run(lambda: TurnRenders.find(self, raw, tools, options, scope=scope))

    def count(self, *, appended: bool) -> None:
        self.calls.append(("count", appended))

    def checked(self, ok: bool) -> None:
        self.calls.append(("checked", ok))


def _off_loop_tagger(tagger: ChatTagger, loop: asyncio.AbstractEventLoop) -> ChatTagger:
    """A copy of ``tagger`` for one prompt on a worker thread: the same tokenizer and template,
    its own counts, the store read through ``LoopStore``."""
    off = copy.copy(tagger)
    off.builds = off.label_hits = off.parse_hits = 0
    if tagger.prefixes is not None:
        off.prefixes = _Prefixes(tagger.tokenizer, LoopStore(tagger.prefixes.kept, loop))
    if tagger.renders is not None:
        off.renders = _Renders(LoopStore(tagger.renders.kept, loop), on=tagger.renders.on)
    return off


def _add_counts(tagger: ChatTagger, off: ChatTagger) -> None:
    """The counts ``off`` made, added to ``tagger``'s (on the loop)."""
    tagger.builds += off.builds
    tagger.label_hits += off.label_hits
    tagger.parse_hits += off.parse_hits
    if isinstance(off.prefixes, _Prefixes) and tagger.prefixes is not None:
        tagger.prefixes.hits += off.prefixes.hits
        tagger.prefixes.misses += off.prefixes.misses
    if isinstance(off.renders, _Renders) and tagger.renders is not None:
        for name, value in off.renders.calls:
            if name == "count":
                tagger.renders.count(appended=value)
            else:
                tagger.renders.checked(value)


async def prepare_chat(
    tagger: ChatTagger,
    messages: object,
    *,
    tools: object,
    template_kwargs: Mapping[str, Any] | None,
    scope: str,
    chars: int,
) -> TaggedPrompt:
    """``tagger.build(...)``: on the event loop, or above ``OFF_LOOP_CHARS`` characters on a
    worker thread (module docstring)."""
    if chars <= OFF_LOOP_CHARS:
        return tagger.build(messages, tools=tools, template_kwargs=template_kwargs, scope=scope)
    loop = asyncio.get_running_loop()
    off = _off_loop_tagger(tagger, loop)
    build = functools.partial(off.build, messages, tools=tools, template_kwargs=template_kwargs, scope=scope)
    done = loop.run_in_executor(None, build)
    # the counts once the thread is done, also when the request went away before
    done.add_done_callback(lambda _: _add_counts(tagger, off))
    return await asyncio.shield(done)


async def prepare_text(tagger: ChatTagger, text: str) -> TaggedPrompt:
    """``tagger.tag_text(text)`` (pure: no store), on a worker thread above ``OFF_LOOP_CHARS``."""
    return await asyncio.to_thread(tagger.tag_text, text) if len(text) > OFF_LOOP_CHARS else tagger.tag_text(text)
