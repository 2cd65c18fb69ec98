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

``--pd``: P/D reuse at the capacity cliff instead, deterministic (``run_pd``): the
agent bench's CPU traffic (``bench/agents.py``'s ``cpu_load``, 6 turns) through a
prefill and a decode worker's page policy, each over the pool the tiny model gets
in ``--kv-kib`` (the agent bench's 2.5 MiB: 128 INT4 pages), with the bench's
reuse steps: the prefill pulls what the decode worker's lease offers (D->P,
adopting its carried cut), matches its prefix cache and computes the rest; the
decode worker pulls the prompt pages (P->D), is admitted (``match_prefix`` while
the admission pin holds the pulled pages), allocates the reply, and retains the
conversation in place of its previous lease (the least recently active lease
yields when pages run out). Every agent's turns run round robin in a seeded
order; ``--warm-points`` earlier points of other agents warm the pools and the
controller first. Reported per control: the hit rate (prompt tokens the prefill
did not compute, from each agent's second turn), the decode worker's owned bits (mean over the
point's turns), evictions, age-down copies and leases reclaimed per worker,
mean over ``--seeds`` traffic seeds.

``--pd --layout``: the same replay twice per seed, on the product's slab pool
(``TriaxialPagePool``) and on ``NoLayoutPool`` (any page fits while the bytes do,
the oldest cached page of either precision goes first: the bound a layout can
reach), with each worker's stored bits over every page it holds. With ``--load
gpu --int4-pages 5824 --agents 24 --controls fixed`` it is the GPU agent sweep's
load and pool (the tiny model's pages, as many INT4 pages as a GPU worker's 8 GiB holds at the
Qwen3-8B shape: 40,960 bytes per page per layer; whole slabs of 3 INT4 pages, so 5,823).
Results: docs/performance-log/bit-budget.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Sequence_
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
from kvserving.kernels.page_ids import page_id_bits, slab_bytes
from kvserving.worker.kv.cache import budget_controller
from kvserving.worker.kv.leases import pin_for_admission, release_admission
from kvserving.worker.kv.manager import KVCacheManager
from kvserving.worker.sampling import SamplingParams, make_generator
from kvserving.worker.sequence import Sequence
from kvserving.worker.triaxial_pool import TriaxialPagePool

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/agents.py (--pd) beside this file

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


# ---------------------------------------------------------------------- P/D at the cliff (--pd)
# The tiny model's triaxial pages (4 layers x 2 KV heads x 64): INT4 5120 B, INT2 3072 B per page per layer.
TINY_LAYERS, TINY_INT4, TINY_INT2 = 4, 5120, 3072
THRESHOLD_TOKENS = 64  # reuse.recompute_threshold_tokens: a pull of fewer tokens is not made


class NoLayoutPool(TriaxialPagePool):
    """The bound for the slab layout (``--layout``): an allocation succeeds while the owned pages'
    bytes leave room for it, and evicts the oldest cached page of either precision first. Its
    pages sit in a buffer of one slab per page ``total_bytes_per_layer`` can hold (plus one), so
    they never compete for slabs: only the page policy is replayed, not the bytes."""

    def __init__(self, total_bytes_per_layer: int, *, int4_page_bytes: int, int2_page_bytes: int, **kw: Any) -> None:
        slab = slab_bytes(int4_page_bytes, int2_page_bytes)
        most = total_bytes_per_layer // min(int4_page_bytes, int2_page_bytes)
        super().__init__((most + 1) * slab, int4_page_bytes=int4_page_bytes, int2_page_bytes=int2_page_bytes, **kw)
        self.budget_bytes = total_bytes_per_layer

    def _room_total(self) -> int:
        return self.budget_bytes

    def num_free_pages(self, *, bits: int) -> int:
        return (self.budget_bytes - self._room_referenced()) // self._bytes[bits]

    def allocate(self, page_bits: Sequence_[int]) -> list[int] | None:
        need = sum(self.page_bytes(bits=b) for b in page_bits)
        if self._room_referenced() + need > self.budget_bytes:
            return None
        held = sum(self.held_pages(bits=b) * self._bytes[b] for b in (2, 4))  # owned and cached
        while held + need > self.budget_bytes:  # evict the older of the two LRU heads, its slot free
            heads = [(self._pages[next(iter(r.lru))].last_used, b) for b, r in self._r.items() if r.lru]
            bits = min(heads)[1]
            pid = next(iter(self._r[bits].lru))
            self._evict(pid)
            self._open_slot(*self.slabs.locate(pid), bits)
            held -= self._bytes[bits]
        return super().allocate(page_bits)  # a free slab is always left: no eviction there


class PDWorker:
    """One worker's page policy: pool, manager (age-down on), controller, retained leases (LRU first)."""

    def __init__(self, control: str, budget: float, kv_kib: int, *, leader: bool, no_layout: bool = False) -> None:
        pool_cls = NoLayoutPool if no_layout else TriaxialPagePool
        slab = slab_bytes(TINY_INT4, TINY_INT2)
        per_layer = kv_kib * 1024 // TINY_LAYERS // slab * slab  # whole slabs, as the storage rounds (both pools)
        self.pool = pool_cls(per_layer, int4_page_bytes=TINY_INT4, int2_page_bytes=TINY_INT2, page_size=P)
        self.kv = KVCacheManager(self.pool, page_size=P, bits_table=bits_table_for_budget(budget), requantize=lambda src, dst: None)
        if control == "hold":
            self.kv.controller = budget_controller(budget, None, page_size=P)
            self.kv.controller.leader = leader
        self.leases: dict[int, tuple[Sequence, float | None]] = {}  # conversation -> (its pages, the cut carried)
        self.reclaimed = 0
        self.pulled_pages = 0

    def _yield_lease(self) -> bool:
        if not self.leases:
            return False
        self.kv.free(self.leases.pop(next(iter(self.leases)))[0])
        self.reclaimed += 1
        return True

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        while not self.kv.allocate_until(seq, num_tokens):
            if not self._yield_lease():
                return False
        return True

    def pull(self, seq: Sequence, offered: Sequence, cut: float | None) -> str | None:
        """The puller's plan and adopt for ``seq`` from ``offered``'s full pages (a peer's lease):
        the leading pages whose hashes equal this prompt's at the sender's precision; those held
        here (under the controller: at either precision) are pinned, the rest copied in; every
        page under one admission pin (its id; None: nothing pulled)."""
        kv, pool = self.kv, self.pool
        if kv.controller is not None and cut is not None:
            kv.controller.adopt(cut, kv.controller.ranking)
        n = offered.num_registered_pages
        usable = min(n, (seq.num_tokens - 1) // P)
        bits = [page_id_bits(pid) for pid in offered.page_ids[:usable]]
        if kv.controller is None:  # a 2-bit page never serves a request that wants 4 (a fixed table)
            wanted = kv.page_bits_for(seq, 0, usable)
            usable = next((i for i, (b, w) in enumerate(zip(bits, wanted)) if b == 2 and w == 4), usable)
            bits = bits[:usable]
        mine = kv.page_hashes(seq, bits) if usable else []
        matched = 0
        while matched < usable and mine[matched] == offered.page_hashes[matched]:
            matched += 1
        held = kv.held_page if kv.controller is not None else pool.lookup
        if kv.controller is None:
            kv.age_cached([h for h, b in zip(mine[:matched], bits) if b == 2])
        local = [pid for h in mine[:matched] if (pid := held(h)) is not None]
        want = [j for j in range(matched) if held(mine[j]) is None]
        if not want or len(want) * P < THRESHOLD_TOKENS:
            return None
        pool.incref(local)  # held while the pull runs: an allocation may evict cached pages
        got = pool.allocate([bits[j] for j in want])
        while got is None and self._yield_lease():
            got = pool.allocate([bits[j] for j in want])
        if got is None:
            pool.free(local)
            return None
        for pid, j in zip(got, want):
            pool.register(pid, mine[j])
        pin = pin_for_admission(pool, local + got, pulled=got, ttl_s=60.0)
        pool.free(local + got)  # the pin holds them now
        self.pulled_pages += len(got)
        return pin

    def admit(self, seq: Sequence, pin: str | None) -> int:
        """``match_prefix`` with the admission pin still held (as the engine's scheduler), then the pin goes."""
        seq.admission_pin = pin
        hit = self.kv.match_prefix(seq)
        if pin is not None:
            release_admission(self.pool, pin, seq.page_ids)
            seq.admission_pin = None
        return hit


@dataclass
class PDRun:
    control: str
    seed: int
    warm_points: int
    hit_rate: float  # prompt tokens not computed by the prefill / prompt tokens, turns 1+
    decode_owned_bits: float  # the decode worker's owned pages, mean over the point's turns
    stored_bits: tuple[float, float]  # prefill, decode: every page held (owned and cached), mean over the point's turns
    evicted: tuple[int, int]  # prefill, decode
    aged: tuple[int, int]
    reclaimed: int  # decode leases that yielded their pages
    pulled_pages: tuple[int, int]  # D->P (into the prefill), P->D
    preempted: int  # requests that found no pages with their matched prefix held (recomputed from nothing)
    cut: float | None
    cut_moves: int
    no_layout: bool = False  # both workers on NoLayoutPool


def run_pd(
    tagger: ChatTagger,
    control: str,
    seed: int,
    *,
    agents: int,
    kv_kib: int,
    warm_points: int,
    budget: float = 2.7,
    load: str = "cpu",
    no_layout: bool = False,
) -> PDRun:
    """``load``: the agent bench's CPU traffic (6 turns) or its GPU traffic (``gpu_load``, whole
    conversations); ``no_layout``: both workers on ``NoLayoutPool``."""
    from agents import cpu_load, gpu_load, point_agents  # bench/agents.py: the agent bench's traffic and agents

    pre = PDWorker(control, budget, kv_kib, leader=False, no_layout=no_layout)
    dec = PDWorker(control, budget, kv_kib, leader=True, no_layout=no_layout)
    spec = cpu_load(seed, think_s=0.05, turns=6) if load == "cpu" else gpu_load(seed, think_s=1.0)
    rng = random.Random(f"pd:{seed}")
    owned: list[float] = []
    stored: tuple[list[float], list[float]] = ([], [])
    prompt = cached = preempted = 0
    base: tuple[int, ...] = ()
    for point in range(warm_points + 1):
        measured = point == warm_points
        for seq, _ in dec.leases.values():  # a point starts with every lease released (bench/agents.py)
            dec.kv.free(seq)
        dec.leases.clear()
        if measured:
            base = (pre.pool.evicted_pages, dec.pool.evicted_pages, pre.kv.aged_pages, dec.kv.aged_pages, dec.reclaimed)
            base += (pre.pulled_pages, dec.pulled_pages)
        ids_range = point_agents(agents) if measured else range(100_000 * (point + 1), 100_000 * (point + 1) + agents)
        convs = {i: (a, Conversation(a)) for i in ids_range for a in [agent(spec, i)]}
        for t in range(max(len(a.turns) for a, _ in convs.values())):
            order = [c for c in convs if t < len(convs[c][0].turns)]
            rng.shuffle(order)
            for c in order:
                a, conv = convs[c]
                turn = a.turns[t]
                built = tagger.build(conv.request(turn), tools=list(conv.tools) or None, add_generation_prompt=True)
                ids, tags = built.input_ids, built.tags
                # prefill: pull what the decode worker retains, match, compute the rest
                s = Sequence(f"p{c}.{t}", ids, SamplingParams(), make_generator(0), tags=tags)
                lease = dec.leases.get(c)
                hit = pre.admit(s, pre.pull(s, lease[0], lease[1]) if lease is not None else None)
                if not pre.allocate(s, len(ids)):  # its held prefix strands the pool: recompute from nothing
                    pre.kv.free(s)
                    preempted += 1
                    hit = 0
                    if not pre.allocate(s, len(ids)):
                        raise RuntimeError(f"a prefill pool of {kv_kib} KiB cannot hold one prompt of {len(ids)} tokens")
                s.num_computed = len(ids)
                pre.kv.publish_full_pages(s)
                # decode: pull the prompt's pages, admit, reply, retain in place of the last lease
                d = Sequence(f"d{c}.{t}", ids, SamplingParams(), make_generator(0), tags=tags)
                dec.admit(d, dec.pull(d, s, pre.kv.controller.cut if pre.kv.controller is not None else None))
                pre.kv.free(s)  # the prefill's transfer lease is single use
                if c in dec.leases:
                    dec.kv.free(dec.leases.pop(c)[0])
                if not dec.allocate(d, len(ids) + turn.output_tokens):  # as the prefill's above
                    dec.kv.free(d)
                    preempted += 1
                    if not dec.allocate(d, len(ids) + turn.output_tokens):
                        raise RuntimeError(f"a decode pool of {kv_kib} KiB cannot hold one conversation of {len(ids)} tokens")
                d.num_computed = len(ids)
                dec.kv.publish_full_pages(d)
                dec.leases[c] = (d, dec.kv.controller.cut if dec.kv.controller is not None else None)
                conv.reply(turn, _words(rng, turn.output_tokens // 2))
                if measured:
                    if t > 0:
                        prompt += len(ids)
                        cached += hit
                    bits = dec.kv.held_bits(cached=False)
                    if bits is not None:
                        owned.append(bits)
                    for into, w in zip(stored, (pre, dec)):
                        if (bits := w.kv.held_bits()) is not None:
                            into.append(bits)
    ctl = dec.kv.controller
    return PDRun(
        control=control,
        seed=seed,
        warm_points=warm_points,
        hit_rate=cached / prompt,
        decode_owned_bits=sum(owned) / len(owned),
        stored_bits=(sum(stored[0]) / len(stored[0]), sum(stored[1]) / len(stored[1])),
        evicted=(pre.pool.evicted_pages - base[0], dec.pool.evicted_pages - base[1]),
        aged=(pre.kv.aged_pages - base[2], dec.kv.aged_pages - base[3]),
        reclaimed=dec.reclaimed - base[4],
        pulled_pages=(pre.pulled_pages - base[5], dec.pulled_pages - base[6]),
        preempted=preempted,
        cut=round(ctl.cut, 3) if ctl else None,
        cut_moves=ctl.moves if ctl else 0,
        no_layout=no_layout,
    )


def main_pd(args: argparse.Namespace, tagger: ChatTagger) -> dict[str, Any]:
    runs: list[PDRun] = []
    layouts = (False, True) if args.layout else (False,)
    cells = list(itertools.product(args.warm_points, args.controls, layouts))
    grid = [(*cell, seed) for cell in cells for seed in range(args.seeds)]
    for warm, control, no_layout, seed in progress(grid, desc="runs", quiet=args.quiet):
        runs.append(
            run_pd(tagger, control, seed, agents=args.agents, kv_kib=args.kv_kib, warm_points=warm, load=args.load, no_layout=no_layout)
        )
    summary = []
    print(
        f"{'warm':>4} {'control':7} {'pool':9} {'hit':>6} {'(min-max)':>11} {'owned D':>7} {'stored P/D':>10} {'evict P/D':>11} "
        f"{'aged P/D':>9} {'reclaim':>7} {'pulled D->P / P->D':>18}"
    )

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    for warm, control, no_layout in cells:
        rs = [r for r in runs if (r.warm_points, r.control, r.no_layout) == (warm, control, no_layout)]
        hits = [r.hit_rate for r in rs]
        row = {
            "warm_points": warm,
            "control": control,
            "pool": "no_layout" if no_layout else "slab",
            "hit_rate": round(mean(hits), 4),
            "hit_rate_min": round(min(hits), 4),
            "hit_rate_max": round(max(hits), 4),
            "decode_owned_bits": round(mean([r.decode_owned_bits for r in rs]), 3),
            "stored_bits": [round(mean([r.stored_bits[i] for r in rs]), 3) for i in (0, 1)],
            "evicted": [round(mean([r.evicted[i] for r in rs]), 1) for i in (0, 1)],
            "aged": [round(mean([r.aged[i] for r in rs]), 1) for i in (0, 1)],
            "reclaimed": round(mean([r.reclaimed for r in rs]), 1),
            "pulled_pages": [round(mean([r.pulled_pages[i] for r in rs]), 1) for i in (0, 1)],
        }
        summary.append(row)
        print(
            f"{warm:>4} {control:7} {row['pool']:9} {row['hit_rate']:6.3f} ({row['hit_rate_min']:.2f}-{row['hit_rate_max']:.2f}) "
            f"{row['decode_owned_bits']:7.2f} {row['stored_bits'][0]:>4.2f}/{row['stored_bits'][1]:<5.2f} "
            f"{row['evicted'][0]:>5.0f}/{row['evicted'][1]:<5.0f} {row['aged'][0]:>4.0f}/{row['aged'][1]:<4.0f} "
            f"{row['reclaimed']:7.1f} {row['pulled_pages'][0]:>8.0f} / {row['pulled_pages'][1]:<8.0f}",
            flush=True,
        )
    return {
        "agents": args.agents,
        "kv_kib": args.kv_kib,
        "load": args.load,
        "seeds": args.seeds,
        "budget": 2.7,
        "summary": summary,
        "runs": [asdict(r) for r in runs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pd", action="store_true", help="P/D reuse at the capacity cliff, fixed table vs hold at 2.7 (run_pd)")
    ap.add_argument("--agents", type=int, default=10, help="--pd: concurrent agents")
    ap.add_argument("--kv-kib", type=int, default=2560, help="--pd: KV pool per worker, KiB (the tiny model's pages)")
    ap.add_argument("--int4-pages", type=int, default=None, help="--pd: KV pool per worker in INT4 pages (instead of --kv-kib)")
    ap.add_argument("--load", choices=("cpu", "gpu"), default="cpu", help="--pd: the agent bench's CPU or GPU traffic")
    ap.add_argument("--controls", type=lambda v: v.split(","), default=["fixed", "hold"], help="--pd: fixed and / or hold")
    ap.add_argument("--layout", action="store_true", help="--pd: each run also on NoLayoutPool (the layout's bound)")
    ap.add_argument("--seeds", type=int, default=8, help="--pd: traffic seeds per control")
    ap.add_argument(
        "--warm-points", type=lambda v: [int(x) for x in v.split(",")], default=[0, 2], help="--pd: points before the measured one"
    )
    ap.add_argument("--turns", type=int, default=900)
    ap.add_argument("--pool-pages", type=int, default=12000)
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--json", type=Path)
    add_quiet_argument(ap)
    args = ap.parse_args()
    root = tiny_model_dir()
    tagger = ChatTagger(TextTokenizer.from_dir(root), ChatTemplate.from_dir(root))
    if args.pd:
        if args.int4_pages is not None:
            args.kv_kib = args.int4_pages * TINY_INT4 * TINY_LAYERS // 1024
        if any(c not in ("fixed", "hold") for c in args.controls):
            ap.error(f"--controls: fixed and / or hold, got {','.join(args.controls)}")
        pd = main_pd(args, tagger)
        if args.json:  # its own key of the result file, beside the cells
            doc = json.loads(args.json.read_text()) if args.json.is_file() else {}
            doc["pd"] = pd
            args.json.write_text(jsonfmt.dumps(doc))
        return
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
        doc = json.loads(args.json.read_text()) if args.json.is_file() else {}
        doc.update({"turns": args.turns, "pool_pages": args.pool_pages, "in_flight": IN_FLIGHT, "cells": [asdict(c) for c in cells]})
        args.json.write_text(jsonfmt.dumps(doc))


if __name__ == "__main__":
    main()
