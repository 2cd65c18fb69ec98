"""Stored bits vs the bit budget on CPU: three traffic mixes through a triaxial
worker's page policy, with the default table fixed and with the bit-budget
controller (``kv_cache.bit_budget_control: hold``), at budgets 2.5, 2.7 and 3.0.

    PYTHONSAFEPATH=1 .venv/bin/python bench/bit_budget_cpu.py [--turns 900] [--json OUT]

Traffic (rendered with the built-in tiny model's chat template, tokenized and
tagged by the gateway's tagger, the whole history resent each turn):
- ``agents``: ``kvserving.agent_pages``' production-shaped agents (a ~1.2K-token
  system prompt with tool schemas, tool results of ~500 tokens, replies with
  reasoning), capped at 12 turns each;
- ``qa``: long-document question answering (a ~4K-word document in the first
  user message, then short questions; ~80-word answers);
- ``chat``: short chat (a short system prompt, ~30-word messages, ~100-word replies).

Each request goes through what the worker runs for it: ``KVCacheManager``
(prefix match with age-down, precision per page from the table or the
controller, allocation of the prompt and the reply's INT4 pages, publishing)
over a ``TriaxialPagePool``. The model itself is not run: what a page stores
depends on its tags, the cut and the pool, not on the values. 16 conversations
are in flight, round robin; each keeps its last turn's pages until its next
turn (a retained lease), then they go to the prefix cache; a finished
conversation is replaced by a new one. The pool holds ``--pool-pages`` INT4
pages, so retained conversations and the cache compete as on a worker.

Reported per cell after a warm-up of a third of the turns: the average bits of
the pages owned (what the controller holds; mean, p5, p95) and of all held pages
(owned + cached: ``kvserving_worker_kv_stored_bits``), the prompt tokens reused
from the prefix cache (reuse must not suffer), the cut's moves.
Results: docs/performance-log/bit-budget.md.
"""

from __future__ import annotations

import argparse
import itertools
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvserving import jsonfmt
from kvserving.agents.load import WORDS, Conversation, agent
from kvserving.agents.pages import SPEC as AGENT_SPEC
from kvserving.bits import bits_table_for_budget
from kvserving.gateway.prompt.chat_template import ChatTemplate
from kvserving.gateway.prompt.tagger import ChatTagger
from kvserving.gateway.prompt.tokenizer import TextTokenizer
from kvserving.model_dir import tiny_model_dir
from kvserving.progress import add_quiet_argument, progress
from kvserving.worker.kv.cache import budget_controller
from kvserving.worker.kv.manager import KVCacheManager
from kvserving.worker.sampling import SamplingParams, make_generator
from kvserving.worker.sequence import Sequence
from kvserving.worker.triaxial_pool import TriaxialPagePool

P = 32
BUDGETS = (2.5, 2.7, 3.0)
MIXES = ("agents", "qa", "chat")
IN_FLIGHT = 16
# A turn: the messages to send, the tools, and the reply text that joins the history.
Turn = tuple[list[dict[str, Any]], list[dict[str, Any]], str]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n)))


def agent_turns(i: int) -> Iterator[Turn]:
    a = agent(AGENT_SPEC, 5000 + i)
    rng = random.Random(f"bit-budget-agents:{i}")
    conv = Conversation(a)
    for turn in a.turns[:12]:
        messages = conv.request(turn)
        reply = _words(rng, turn.output_tokens)
        yield messages, list(a.tools), reply
        conv.reply(turn, reply)


def qa_turns(i: int) -> Iterator[Turn]:
    rng = random.Random(f"bit-budget-qa:{i}")
    messages: list[dict[str, Any]] = [{"role": "system", "content": _words(rng, 40)}]
    doc = _words(rng, int(rng.lognormvariate(8.2, 0.3)))  # ~3.6K words
    for t in range(rng.randint(3, 8)):
        question = _words(rng, rng.randint(8, 30))
        messages.append({"role": "user", "content": f"{doc}\n\n{question}" if t == 0 else question})
        reply = _words(rng, rng.randint(40, 120))
        yield list(messages), [], reply
        messages.append({"role": "assistant", "content": reply})


def chat_turns(i: int) -> Iterator[Turn]:
    rng = random.Random(f"bit-budget-chat:{i}")
    messages: list[dict[str, Any]] = [{"role": "system", "content": _words(rng, 30)}]
    for _ in range(rng.randint(4, 16)):
        messages.append({"role": "user", "content": _words(rng, rng.randint(10, 50))})
        reply = _words(rng, rng.randint(50, 150))
        yield list(messages), [], reply
        messages.append({"role": "assistant", "content": reply})


TRAFFIC: dict[str, Callable[[int], Iterator[Turn]]] = {"agents": agent_turns, "qa": qa_turns, "chat": chat_turns}


@dataclass
class Cell:
    mix: str
    budget: float
    control: str  # "fixed" or "hold"
    owned_mean: float
    owned_p5: float
    owned_p95: float
    held_mean: float  # owned + cached pages
    reused_share: float  # prompt tokens matched in the prefix cache / prompt tokens
    aged_pages: int
    cut_moves: int
    final_cut: float | None
    requests: int
    seconds: float


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_cell(tagger: ChatTagger, mix: str, budget: float, control: str, *, turns: int, pool_pages: int) -> Cell:
    t0 = time.perf_counter()
    pool = TriaxialPagePool(pool_pages * 1024, int4_page_bytes=1024, int2_page_bytes=512, page_size=P)
    kv = KVCacheManager(
        pool, page_size=P, bits_table=bits_table_for_budget(budget), requantize=lambda src, dst: None
    )  # age-down on: values are not modelled
    if control == "hold":
        kv.controller = budget_controller(budget, None, page_size=P)
    convs: list[Iterator[Turn]] = [TRAFFIC[mix](c) for c in range(IN_FLIGHT)]
    started = IN_FLIGHT
    held: dict[int, Sequence] = {}
    owned: list[float] = []
    every: list[float] = []
    prompt = reused = 0
    warm = turns // 3
    for i in range(turns):
        c = i % IN_FLIGHT
        step = next(convs[c], None)
        if step is None:  # finished: its lease ends, a new conversation takes the slot
            if c in held:
                kv.free(held.pop(c))
            convs[c] = TRAFFIC[mix](started)
            started += 1
            step = next(convs[c])
        messages, tools, reply = step
        built = tagger.build(messages, tools=tools or None, add_generation_prompt=True)
        reply_tokens = len(reply.split()) + 2
        s = Sequence(f"r{i}", built.input_ids, SamplingParams(), make_generator(0), tags=built.tags)
        if c in held:  # the conversation's own lease is released as its next turn is admitted
            kv.free(held.pop(c))
        matched = kv.match_prefix(s)
        while not kv.allocate_until(s, s.num_tokens + reply_tokens):
            if not held:
                raise RuntimeError(f"pool of {pool_pages} pages cannot hold one request of {s.num_tokens} tokens")
            kv.free(held.pop(next(iter(held))))  # the least recently active retained conversation yields
        s.num_computed = s.num_tokens
        kv.publish_full_pages(s)
        held[c] = s
        if i >= warm:
            prompt += s.num_tokens
            reused += matched
            o, h = kv.held_bits(cached=False), kv.held_bits()
            assert o is not None and h is not None
            owned.append(o)
            every.append(h)
    ctl = kv.controller
    return Cell(
        mix=mix,
        budget=budget,
        control=control,
        owned_mean=round(sum(owned) / len(owned), 4),
        owned_p5=round(_percentile(owned, 0.05), 3),
        owned_p95=round(_percentile(owned, 0.95), 3),
        held_mean=round(sum(every) / len(every), 4),
        reused_share=round(reused / prompt, 4),
        aged_pages=kv.aged_pages,
        cut_moves=ctl.moves if ctl else 0,
        final_cut=round(ctl.cut, 3) if ctl else None,
        requests=turns,
        seconds=round(time.perf_counter() - t0, 1),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, default=900)
    ap.add_argument("--pool-pages", type=int, default=12000)
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--json", type=Path)
    add_quiet_argument(ap)
    args = ap.parse_args()
    root = tiny_model_dir()
    tagger = ChatTagger(TextTokenizer.from_dir(root), ChatTemplate.from_dir(root))
    cells = []
    print(f"{'mix':7} {'budget':>6} {'control':7} {'owned':>6} {'p5':>6} {'p95':>6} {'held':>6} {'reused':>7} {'aged':>6} {'moves':>5}")
    grid = list(itertools.product(args.mixes.split(","), (float(b) for b in args.budgets.split(",")), ("fixed", "hold")))
    for mix, budget, control in progress(grid, desc="cells", quiet=args.quiet):
        cell = run_cell(tagger, mix, budget, control, turns=args.turns, pool_pages=args.pool_pages)
        cells.append(cell)
        print(
            f"{mix:7} {budget:6.2f} {control:7} {cell.owned_mean:6.3f} {cell.owned_p5:6.2f} "
            f"{cell.owned_p95:6.2f} {cell.held_mean:6.3f} {cell.reused_share:7.3f} {cell.aged_pages:6d} "
            f"{cell.cut_moves:5d}",
            flush=True,
        )
    if args.json:
        args.json.write_text(
            jsonfmt.dumps({"turns": args.turns, "pool_pages": args.pool_pages, "in_flight": IN_FLIGHT, "cells": [asdict(c) for c in cells]})
        )


if __name__ == "__main__":
    main()
