"""The simulated workers' engine steps (kvserving.sim.workers): pages as sequences grow, the
newest running sequence preempted when none are left (``worker/scheduler.py``), its cached
pages reused when it is readmitted, an admission placed with its whole cached prefix or not at all, a pull
waiting for pages (``worker/kv/puller.py``; a prefill worker's does not), pulled pages pinned until
admission (held against the queue head's admission while a sequence runs), and the benchmark's point window."""

from __future__ import annotations

import math

from kvserving.agents.load import LoadSpec
from kvserving.config import ReuseConfig, SchedulerConfig
from kvserving.sim.cluster import ClusterSpec, Simulator, run_bench_point
from kvserving.sim.workers import PullRules, Req, WLease, Worker
from kvserving.worker.kv.page_pool import PAGE_WAIT_SHARE

from sim_costs import tiny_costs

PAGE = 16
BIG = 1 << 40


def _sim(pages: int, sched: SchedulerConfig) -> Simulator:
    sim = Simulator(ClusterSpec("fp8_e4m3", 1, 1, tiny_costs(pages), scheduler=sched), LoadSpec())
    assert sim.cluster.pages_per_worker == pages
    return sim


def _req(i: int, prompt: int, output: int) -> Req:
    # a conversation of its own; every page of prompt and reply is one the next prompt repeats
    return Req(i, f"c{i}", [(i, BIG)], prompt, output, prompt // PAGE, (prompt + output) // PAGE, 0.0)


def test_a_decode_pool_that_runs_out_preempts_the_newest_which_waits_for_all_its_pages() -> None:
    sim = _sim(9, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, chunk_size=64))
    dec = sim.decode[0]
    done: list[int] = []
    dec.on_done = lambda req, now: done.append(req.turn_id)
    a, b = _req(1, 60, 20), _req(2, 60, 20)
    dec.arrive(a, 0.0)  # step 1: a computes 61 tokens (prompt + the prefill's token) in 4 pages
    dec.arrive(b, 0.0)  # waits for step 2: 4 pages more, 8 of 9; from then on a is one token ahead
    sim.run()
    # Step 5: a needs a fifth page for its 65th token and takes the last free one. Step 6: b
    # needs its fifth, finds none (nothing cached, nothing retained) and is preempted -- the
    # newest, itself; its 4 computed full pages stay cached, and the step admits nothing. It comes
    # back only with pages for every token it knows (Scheduler._admit: its prefix and 5 pages in
    # all), which a's growth leaves no room for until a ends after step 19 and frees its pages;
    # then its 4 cached pages are matched and nothing is recomputed. Admitted with its first
    # chunk's pages alone, b was placed from scratch and preempted again every other step (7
    # preemptions of 64 recomputed tokens each; 14 when the preempting step admitted too).
    assert (dec.stats.preemptions, sim.prefill[0].stats.preemptions) == (1, 0)
    assert (a.preemptions, b.preemptions) == (0, 1)
    assert dec.stats.recomputed_tokens == 0
    assert b.hit_pages == 0  # its first admission's count: a readmission is not a prefix hit
    assert done == [1, 2] and a.sampled == b.sampled == 20
    assert not dec.running and not dec.waiting and dec.cache.used <= 9


def test_a_pool_with_room_preempts_nothing() -> None:
    sim = _sim(10, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, chunk_size=64))
    dec = sim.decode[0]
    dec.on_done = lambda req, now: None
    a, b = _req(1, 60, 20), _req(2, 60, 20)
    dec.arrive(a, 0.0)
    dec.arrive(b, 0.0)
    sim.run()
    # 5 pages each at the end (79 tokens): 10 fit, so both grow without a preemption
    assert dec.stats.preemptions == 0 and dec.stats.recomputed_tokens == 0
    assert a.sampled == b.sampled == 20


def test_no_turn_starts_after_the_window() -> None:
    sim = Simulator(ClusterSpec("fp8_e4m3", 1, 1, tiny_costs(4096)), LoadSpec())
    whole = run_bench_point(Simulator(ClusterSpec("fp8_e4m3", 1, 1, tiny_costs(4096)), LoadSpec()), range(2))
    cut = run_bench_point(sim, range(2), window_s=2.0)
    assert 0 < cut["requests"] < whole["requests"]
    starts = [r.sent_at for r in sim.records]
    assert max(starts) <= 2.0
    assert cut["prefill_preemptions"] == cut["decode_preemptions"] == 0


def _two_pulled_prompts(*, waits: bool) -> tuple[Simulator, list[tuple[int, float]], list[bool]]:
    """A 7-page decode pool; prompts A (64 tokens, 40 reply) and B (64, 10) each offered by the
    prefill's transfer lease on 3 pages (a threshold of 2 pages makes them worth a READ); A's pull
    at 0 s, B's at 5 ms. Returns the simulator, (turn, end) per reply, and whether B's offer was
    still held at 30 ms."""
    reuse = ReuseConfig(recompute_threshold_tokens=32)
    sim = Simulator(ClusterSpec("fp8_e4m3", 1, 1, tiny_costs(7), reuse=reuse, rules=PullRules(pull_waits=waits)), LoadSpec())
    pre, dec = sim.prefill[0], sim.decode[0]
    done: list[tuple[int, float]] = []
    dec.on_done = lambda req, now: done.append((req.turn_id, now))
    a, b = _req(1, 64, 40), _req(2, 64, 10)
    for r in (a, b):
        hold = pre.cache.new_hold()
        assert pre.cache.allocate(hold, 3)
        pre.cache.publish(hold, r.segs, 0, 3)
        r.transfer_offer = pre.pin(hold, ttl_s=reuse.transfer_timeout_s, now=0.0, conv=None, pages=3, stable=3, prefix="xfer-")
        r.decode_url = dec.url
    b_offer = b.transfer_offer
    held: list[bool] = []
    sim.call_at(0.0, sim._at_decode, (a, dec))
    sim.call_at(5e-3, sim._at_decode, (b, dec))
    sim.at(30e-3, lambda now: held.append(not b_offer.gone))
    sim.run()
    return sim, done, held


def test_a_decode_pull_without_free_pages_waits_for_the_running_reply_instead_of_recomputing() -> None:
    """A pulls 3 pages (63 // 16 = 3 usable) and computes the rest of its prompt with the prefill's
    token: 16 + 1 = 17 tokens in 5 pages; it grows to 7 pages (103 tokens) by its last step, so the
    pool never has the 3 pages B's pull needs while A runs. A's reply ends 39.7 ms after its pull
    (a 7 us READ, one 17-token chunk at 0.1 ms a token, 38 decode steps of 1 ms); its pages are
    retained under a reclaimable lease.

    Skipping at once (the worker before the wait): B's pull finds no page at 5 ms, B queues and
    computes its whole prompt and token, 65 tokens, once A's lease is reclaimed: the decode computes
    17 + 65 = 82 prompt tokens and pulls 3 pages. Waiting: B's pull tries again where A's end frees
    pages (39.7 ms, 34.7 ms after it was sent; the prefill still holds B's pages at 30 ms), reclaims
    A's lease, pulls its 3 pages and computes 17 tokens: 34 computed, 6 pulled, B's reply 4.8 ms
    sooner (the 48 prompt tokens it no longer computes, less its 7 us READ)."""
    old, old_done, _ = _two_pulled_prompts(waits=False)
    new, new_done, held = _two_pulled_prompts(waits=True)
    d0, d1 = old.decode[0].stats, new.decode[0].stats
    assert (d0.pulled_pages, d0.computed_tokens) == (3, 82)
    assert (d0.skipped["no_free_pages"], d0.skipped_tokens["no_free_pages"], d0.page_waits) == (1, 64, 0)
    assert (d1.pulled_pages, d1.computed_tokens) == (6, 34)
    assert (d1.skipped["no_free_pages"], d1.page_waits) == (0, 1) and held == [True]
    assert math.isclose(d1.page_wait_s, 34.7e-3, abs_tol=0.05e-3)
    # the prefill's transfer leases (both made at 0 s) go when the decode's pull is over: A's at once, B's
    # at its skip (5 ms) or after its wait and READ (39.7 ms)
    p0, p1 = old.prefill[0].stats, new.prefill[0].stats
    assert p0.transfer_leases_ended == p1.transfer_leases_ended == {"released": 2, "expired": 0}
    assert math.isclose(p0.transfer_lease_seconds["released"], 5e-3, abs_tol=0.05e-3)
    assert math.isclose(p1.transfer_lease_seconds["released"], 39.7e-3, abs_tol=0.05e-3)
    assert d0.leases_reclaimed == d1.leases_reclaimed == 1 and d0.preemptions == d1.preemptions == 0
    assert [t for t, _ in old_done] == [t for t, _ in new_done] == [1, 2]
    assert math.isclose(old_done[0][1], new_done[0][1]) and math.isclose(old_done[1][1] - new_done[1][1], 4.8e-3, abs_tol=0.01e-3)
    assert not old.prefill[0].leases and not new.prefill[0].leases  # each hold went when its pull was over


def test_pulled_pages_waiting_for_admission_yield_to_an_allocation_after_retained_conversations() -> None:
    """``pin_for_admission``'s RECLAIM_LAST: a 6-page decode pool holds a retained conversation R
    (1 page, reclaimable), pulled pages P pinned for a queued request (3 pages) and 2 free pages.
    Allocating 3 pages releases R (3 free); 3 more release P, whose pages stay cached until evicted."""
    sim = Simulator(ClusterSpec("fp8_e4m3", 1, 1, tiny_costs(6), reuse=ReuseConfig(recompute_threshold_tokens=32)), LoadSpec())
    pre, dec = sim.prefill[0], sim.decode[0]
    cache = dec.cache
    r_hold = cache.new_hold()
    assert cache.allocate(r_hold, 1)
    retained = dec.pin(r_hold, ttl_s=100.0, now=0.0, conv="r", pages=1, stable=1, prefix="kv-", reclaimable=True)
    req = _req(1, 64, 4)
    hold = pre.cache.new_hold()
    assert pre.cache.allocate(hold, 3)
    pre.cache.publish(hold, req.segs, 0, 3)
    offer = pre.pin(hold, ttl_s=10.0, now=0.0, conv=None, pages=3, stable=3, prefix="xfer-")
    pulled: list[float] = []
    dec.pull(req, offer, 0.0, lambda r, out, now: pulled.append(out.seconds))
    assert len(pulled) == 1 and pulled[0] > 0 and req.pin is not None and cache.free == 2
    first, second = cache.new_hold(), cache.new_hold()
    assert dec.allocate(first, 3, 0.0)
    assert retained.gone and req.pin.alive(0.0) and dec.stats.leases_reclaimed == 1
    assert cache.present(1) == 3  # P's pages, pinned
    assert dec.allocate(second, 3, 0.0)
    assert not req.pin.alive(0.0) and dec.stats.leases_reclaimed == 2
    assert cache.present(1) == 0 and cache.evicted == 3


def test_an_admission_pin_gives_a_running_sequence_only_the_pages_it_lacks_from_its_tail() -> None:
    """``PagePoolBase.allocate_reclaiming`` for RECLAIM_LAST: a 10-page decode pool, W's pull READs 8 pages
    (pinned for its admission), a running sequence holds the other 2. Its next page takes the pin's last
    page only: the pin keeps 7, a pull cannot take them, and W's admission matches 7 pages.
    ``pins_trim=False`` (the worker before): the whole pin goes, its pages cached for any allocation."""
    for trim in (True, False):
        reuse = ReuseConfig(recompute_threshold_tokens=32)
        sim = Simulator(ClusterSpec("fp8_e4m3", 1, 1, tiny_costs(10), reuse=reuse, rules=PullRules(pins_trim=trim)), LoadSpec())
        pre, dec = sim.prefill[0], sim.decode[0]
        cache = dec.cache
        w = _req(1, 160, 4)
        hold = pre.cache.new_hold()
        assert pre.cache.allocate(hold, 8)
        pre.cache.publish(hold, w.segs, 0, 8)
        offer = pre.pin(hold, ttl_s=10.0, now=0.0, conv=None, pages=8, stable=8, prefix="xfer-")
        dec.pull(w, offer, 0.0, lambda r, out, now: None)
        assert w.pin is not None and cache.owned(1) == 8 and cache.free == 2
        assert dec.allocate(cache.new_hold(), 2, 0.0) and cache.free == 0  # the running sequence
        assert dec.allocate(cache.new_hold(), 1, 0.0)  # its next page
        if trim:
            assert w.pin.alive(0.0) and cache.owned(1) == 7 and cache.evicted == 1
            assert (dec.stats.pages_trimmed, dec.stats.leases_reclaimed) == (1, 0)
            assert not dec._allocate_for_pull(cache.new_hold(), 1, 0.0) and cache.owned(1) == 7
            assert cache.match(w.segs, 9) == 7
        else:
            assert not w.pin.alive(0.0) and cache.owned(1) == 0 and dec.stats.leases_reclaimed == 1
            assert dec._allocate_for_pull(cache.new_hold(), 1, 0.0) and cache.match(w.segs, 9) == 6


def _offer(worker: Worker, req: Req, pages: int, *, retained: bool) -> WLease:
    """``req``'s first ``pages`` prompt pages held on ``worker`` under a lease a peer's pull reads:
    a decode worker's retained conversation or a prefill worker's transfer lease."""
    hold = worker.cache.new_hold()
    assert worker.cache.allocate(hold, pages)
    worker.cache.publish(hold, req.segs, 0, pages)
    prefix = "kv-" if retained else "xfer-"
    return worker.pin(hold, ttl_s=10.0, now=0.0, conv=req.conv, pages=pages, stable=pages, prefix=prefix, reclaimable=retained)


def _queue_behind_a_pulled_prompt(*, running: bool, pins_yield_always: bool) -> tuple[Simulator, Req, Req, list[int]]:
    """An 8-page decode pool. W's pull READs 3 pages ((64 - 1) // 16 usable), pinned until W is
    admitted; W queues behind H, whose 41 tokens need 3 pages where 2 are free. ``running``: A
    (60-token prompt, 20-token reply) runs in the other 3 pages and grows into 5; else a hold that
    no sequence owns keeps them. Returns the simulator, H, W and the replies' turns in
    the order they ended."""
    reuse = ReuseConfig(recompute_threshold_tokens=32)
    cluster = ClusterSpec("fp8_e4m3", 1, 1, tiny_costs(8), reuse=reuse, rules=PullRules(pins_yield_always=pins_yield_always))
    sim = Simulator(cluster, LoadSpec())
    pre, dec = sim.prefill[0], sim.decode[0]
    done: list[int] = []
    dec.on_done = lambda req, now: done.append(req.turn_id)
    if running:
        dec.arrive(_req(1, 44, 20), 0.0)  # 45 tokens: 3 pages, 4 at its 49th token, 5 at its 65th
    else:
        assert dec.cache.allocate(dec.cache.new_hold(), 3)
    w, h = _req(3, 64, 4), _req(2, 40, 4)
    pulled: list[float] = []
    dec.pull(w, _offer(pre, w, 3, retained=False), 0.0, lambda r, out, now: pulled.append(out.seconds))
    assert len(pulled) == 1 and pulled[0] > 0 and w.pin is not None and dec.cache.free == 2
    dec.arrive(h, 0.0)
    dec.arrive(w, 0.0)
    sim.run()
    return sim, h, w, done


def test_a_waiting_requests_pulled_pages_are_not_taken_by_the_queue_heads_admission_while_a_sequence_runs() -> None:
    """``Scheduler._admit``: pulled pages pinned for a waiting request yield to an admission only
    while nothing runs (``reclaim_one(RECLAIM_FIRST)`` else).

    A runs: H waits (2 free pages, W's 3 pinned) while A grows into them; when A ends its 4 full
    pages are retained, and H, with nothing running, takes that lease (not W's pin): W is admitted
    with its 3 pulled pages and computes 17 tokens. With pins that yield to every allocation (the
    worker before), H takes W's pin at once and evicts one of its pages: W, admitted with the 2
    left, computes 33. Nothing runs (and W is not queued yet: nothing can overtake H): H takes the
    page it lacks from W's pin at once either way, its last page (``PagePoolBase.trim_pin``: W's
    pin keeps the other 2 and W finds them pulled), or the whole pin before that rule."""
    sim, h, w, done = _queue_behind_a_pulled_prompt(running=True, pins_yield_always=False)
    dec = sim.decode[0]
    assert (w.remote_pages, w.hit_pages) == (3, 3)
    assert dec.stats.leases_reclaimed == 1  # A's retained conversation, not W's pin
    assert dec.stats.computed_tokens == 45 + 41 + 17 and dec.stats.preemptions == 0
    assert done == [1, 2, 3]  # A, then H before W: nothing overtakes the queue's head

    old, _, w0, _ = _queue_behind_a_pulled_prompt(running=True, pins_yield_always=True)
    assert (w0.remote_pages, w0.hit_pages, old.decode[0].stats.computed_tokens) == (0, 2, 45 + 41 + 33)

    for pins_yield_always in (False, True):
        idle, hi, wi, _ = _queue_behind_a_pulled_prompt(running=False, pins_yield_always=pins_yield_always)
        d = idle.decode[0]
        # W's pin's last page (or the whole pin, before) went to H, then H's retained conversation to W
        if pins_yield_always:
            assert (d.stats.leases_reclaimed, d.stats.pages_trimmed) == (2, 0) and (wi.remote_pages, wi.hit_pages) == (0, 2)
        else:
            assert (d.stats.leases_reclaimed, d.stats.pages_trimmed) == (1, 1) and (wi.remote_pages, wi.hit_pages) == (2, 2)
        assert hi.done_at < wi.done_at  # H ran at once, W after it
        assert d.stats.computed_tokens == 41 + 33


def test_an_idle_worker_runs_a_pulled_request_that_fits_before_the_queue_head_that_would_take_its_pin() -> None:
    """``Scheduler._overtake``: an 8-page decode pool, nothing running, a hold no sequence owns on 3
    pages; W's pull READs 3 pages, pinned, 2 free. H (41 tokens: 3 pages) and W (65: 5 pages, 2 new)
    queue before the next step. H fits only with W's pin, W without anyone's: W runs first with its 3
    pulled pages and computes 17 tokens; at its end H takes its retained conversation (a lease that
    yields first) and computes 41. ``idle_overtakes=False`` (the worker before): H takes W's pin
    and evicts one of its pages, W computes 33 and loses 16 pulled tokens."""
    for idle_overtakes in (True, False):
        reuse = ReuseConfig(recompute_threshold_tokens=32)
        sim = Simulator(
            ClusterSpec("fp8_e4m3", 1, 1, tiny_costs(8), reuse=reuse, rules=PullRules(idle_overtakes=idle_overtakes)), LoadSpec()
        )
        pre, dec = sim.prefill[0], sim.decode[0]
        done: list[int] = []
        dec.on_done = lambda req, now: done.append(req.turn_id)
        assert dec.cache.allocate(dec.cache.new_hold(), 3)
        w, h = _req(3, 64, 4), _req(2, 40, 4)
        dec.pull(w, _offer(pre, w, 3, retained=False), 0.0, lambda r, out, now: None)
        assert w.pin is not None and dec.cache.free == 2
        dec.busy = True  # a step in flight: both queue before the next one is planned
        dec.arrive(h, 0.0)
        dec.arrive(w, 0.0)
        dec.busy = False
        dec.on_freed(0.0)
        sim.run()
        st = dec.stats
        if idle_overtakes:
            assert done == [3, 2] and (w.remote_pages, w.hit_pages) == (3, 3)
            assert (st.leases_reclaimed, st.computed_tokens, st.lost_tokens) == (1, 17 + 41, 0)
        else:
            assert done == [2, 3] and (w.remote_pages, w.hit_pages) == (0, 2)
            assert (st.leases_reclaimed, st.computed_tokens, st.lost_tokens) == (2, 41 + 33, PAGE)


def test_a_pull_that_reads_nothing_keeps_the_local_prefix_it_matched_for_the_admission() -> None:
    """``Puller.pull``: a prefill worker (6 pages) holds A's 3 prompt pages cached; the decode worker
    offers the same 3 (nothing to pull). The pull pins the 3 for A's admission: an allocation of 4
    pages (3 free) evicts none of them and fails, and A's admission finds all 48 tokens.
    ``pull_pins_local=False`` (the worker before): the 3 stay ordinary LRU pages, the allocation
    evicts one, and A computes tokens it had in place (``lost_tokens``)."""
    for pins_local in (True, False):
        reuse = ReuseConfig(recompute_threshold_tokens=32)
        sim = Simulator(ClusterSpec("fp8_e4m3", 1, 1, tiny_costs(6), reuse=reuse, rules=PullRules(pull_pins_local=pins_local)), LoadSpec())
        pre, dec = sim.prefill[0], sim.decode[0]
        pre.on_done = lambda req, now: None
        a = _req(1, 64, 4)
        cached = pre.cache.new_hold()
        assert pre.cache.allocate(cached, 3)
        pre.cache.publish(cached, a.segs, 0, 3)
        pre.cache.release(cached)
        outcomes: list[str | None] = []
        pre.pull(a, _offer(dec, a, 3, retained=True), 0.0, lambda r, out, now: outcomes.append(out.fallback))
        assert outcomes == [None] and pre.stats.skipped["nothing_to_pull"] == 1 and a.in_place == 3
        assert (a.pin is not None) is pins_local
        other = pre.cache.new_hold()
        assert pre.allocate(other, 4, 0.0, pins=False) is not pins_local
        pre.cache.release(other)  # back free: an evicted page stays evicted
        pre.arrive(a, 0.0)
        sim.run()
        assert (a.hit_pages, pre.stats.lost_tokens) == ((3, 0) if pins_local else (2, PAGE))


def test_a_prefill_workers_pull_without_free_pages_skips_at_once_where_a_decode_workers_waits() -> None:
    """``KVTransfer``: a prefill worker's pull does not wait for pages (``page_wait_share=0``), a
    decode worker's waits ``PAGE_WAIT_SHARE`` of ``transfer_timeout_s`` (2 s here) for them, then
    skips. Both pools are full of pages no allocation may take (the decode's retained conversation,
    offered to the prefill's pull, is released before the decode's pull)."""
    reuse = ReuseConfig(recompute_threshold_tokens=32, transfer_timeout_s=2.0)
    sim = Simulator(ClusterSpec("fp8_e4m3", 1, 1, tiny_costs(6), reuse=reuse), LoadSpec())
    pre, dec = sim.prefill[0], sim.decode[0]
    a, b = _req(1, 64, 4), _req(2, 64, 4)
    d_to_p = _offer(dec, a, 3, retained=True)  # A's previous turn, retained on the decode worker
    p_to_d = _offer(pre, b, 3, retained=False)  # B's prompt, computed on the prefill worker
    assert pre.cache.allocate(pre.cache.new_hold(), 3) and pre.cache.free == 0
    outcomes: list[tuple[str, float]] = []
    pre.pull(a, d_to_p, 0.0, lambda r, out, now: outcomes.append(("prefill", now)))
    assert outcomes == [("prefill", 0.0)]
    assert (pre.stats.skipped["no_free_pages"], pre.stats.skipped_tokens["no_free_pages"], pre.stats.page_waits) == (1, 64, 0)
    # what held the prefill's pool then (PagePoolBase.page_holders): B's transfer lease; the other 3 pages'
    # holder is neither a running request nor a pin, so no class counts them
    held = {"requests": 0, "pins_transfer": 3, "pins_pulling": 0, "pins_retained": 0, "pins_pulled": 0}
    assert (pre.stats.no_room, pre.stats.no_room_held) == (1, held)
    assert dec.release(d_to_p.lease_id, 0.0) and dec.cache.allocate(dec.cache.new_hold(), 6) and dec.cache.free == 0
    dec.pull(b, p_to_d, 0.0, lambda r, out, now: outcomes.append(("decode", now)))
    assert len(outcomes) == 1 and dec.stats.page_waits == 1
    sim.run()
    assert outcomes[1][0] == "decode" and math.isclose(outcomes[1][1], PAGE_WAIT_SHARE * 2.0)
    assert (dec.stats.skipped["no_free_pages"], dec.stats.pulls) == (1, 0)
    assert dec.stats.no_room == 1  # counted once, at its first try, as the worker's puller does


def test_a_pull_of_a_lease_its_holder_released_plans_and_allocates_before_it_fails() -> None:
    """``Puller.pull`` on params the gateway still lists (a retained conversation the decode worker
    has reclaimed since): the receiver matches the params' pages, allocates the ones it lacks
    (evicting cached pages if it must), and only then hears from the holder that the lease is
    unknown: fallback ``lease_expired``, the pages it would have pulled counted as missed, the
    allocated pages back on the free list and the pages they evicted gone."""
    from kvserving.sim.cluster import _expired_offer, _params

    sim = Simulator(ClusterSpec("fp8_e4m3", 1, 1, tiny_costs(6), reuse=ReuseConfig(recompute_threshold_tokens=32)), LoadSpec())
    pre, dec = sim.prefill[0], sim.decode[0]
    a, c = _req(1, 80, 4), _req(3, 48, 4)
    listed = _params(_offer(dec, a, 4, retained=True))  # A's previous turn, as the gateway keeps its params
    cached = pre.cache.new_hold()  # C's 3 pages, cached on the prefill worker: 3 pages free
    assert pre.cache.allocate(cached, 3)
    pre.cache.publish(cached, c.segs, 0, 3)
    pre.cache.release(cached)
    assert dec.release(listed["lease_id"], 0.0)  # reclaimed: the holder no longer knows it
    offer = _expired_offer(dec, listed)
    assert offer is not None and (offer.pages, offer.stable, offer.alive(0.0)) == (4, 4, False)
    outcomes: list[str | None] = []
    pre.pull(a, offer, 0.0, lambda r, out, now: outcomes.append(out.fallback))
    assert outcomes == ["lease_expired"]
    assert pre.stats.missed_tokens == {"lease_expired": 4 * PAGE} and pre.stats.pulls == 0
    assert pre.cache.match(c.segs, 3) == 2 and pre.cache.free == 6  # one of C's pages evicted for the 4 allocated
    assert pre.cache.evicted == 1


def test_pulled_pages_evicted_before_admission_count_as_lost() -> None:
    """``lost_before_admission``: W's pull put 3 pages in place; where the queue head took W's pin and
    evicted one of them (pins that yield to every allocation), W's admission found 2: 16 tokens lost.
    Held pins lose none."""
    old, _, w_old, _ = _queue_behind_a_pulled_prompt(running=True, pins_yield_always=True)
    assert (w_old.in_place, w_old.hit_pages, old.decode[0].stats.lost_tokens) == (3, 2, PAGE)
    new, _, w_new, _ = _queue_behind_a_pulled_prompt(running=True, pins_yield_always=False)
    assert (w_new.hit_pages, new.decode[0].stats.lost_tokens) == (3, 0)
    counters = new.pull_counters()
    assert (counters["decode"]["lost_tokens"], counters["prefill"]["lost_tokens"]) == (0, 0)


def test_an_engine_call_runs_at_once_on_an_idle_worker_and_after_the_step_in_progress_on_a_busy_one() -> None:
    # A transfer lease's hold is such a call (KVTransfer.hold runs on the prefill's engine
    # thread): a busy prefill answers it only once its step of prompt chunks is over.
    sim = _sim(16, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, chunk_size=64))
    pre = sim.prefill[0]
    pre.on_done = lambda req, now: None
    calls: list[tuple[str, float]] = []
    pre.engine_call(lambda arg, t: calls.append((arg, t)), "idle", 0.0)
    pre.arrive(_req(1, 60, 20), 0.0)  # one step computes the whole prompt
    assert pre.busy
    pre.engine_call(lambda arg, t: calls.append((arg, t)), "busy", 0.0)
    assert calls == [("idle", 0.0)]
    sim.run()
    assert pre.stats.prompt_steps == 1 and pre.stats.prompt_step_s > 0
    assert calls == [("idle", 0.0), ("busy", pre.stats.prompt_step_s)]


def test_an_engine_call_during_a_run_of_decode_steps_runs_when_the_step_in_progress_ends() -> None:
    sim = _sim(16, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, chunk_size=64))
    dec = sim.decode[0]
    dec.on_done = lambda req, now: None
    calls: list[float] = []
    times: list[float] = []

    def in_run(_: object, now: float) -> None:  # the reply's decode steps advance as one run
        assert dec._run is not None and dec.busy
        times.extend(dec._run.times)
        dec.sim.call_at((times[4] + times[5]) / 2, lambda _, t: dec.engine_call(lambda a, t2: calls.append(t2), None, t), None)

    def after_prompt(_: object, now: float) -> None:  # step 0 (the prompt) is over; the run starts at once
        dec.sim.call_at(now + 1e-9, in_run, None)

    dec.arrive(_req(1, 60, 20), 0.0)  # step 0 computes the prompt, then one token a step
    dec.engine_call(after_prompt, None, 0.0)
    sim.run()
    assert len(times) > 6 and calls == [times[5]]


def test_an_admission_that_does_not_fit_with_its_pulled_prefix_waits_with_it_and_is_not_placed_from_scratch() -> None:
    """``Scheduler._admit`` in one pool of pages: an 8-page decode pool, nothing running, a hold no
    sequence owns on 4 pages; W's pull READs 3 pages ((64 - 1) // 16 usable), pinned, 1 free. W (65
    tokens: 5 pages, 2 new) is the idle queue's head, so its own pin may yield to it, yet its
    placement fails: the pin's pages are its prefix. From scratch it would need 5 pages where its
    pin's 3 and the free one make 4 -- in one pool a placement with fewer matched pages never fits
    where the whole prefix did not. W waits with its pin whole and nothing evicted; when the hold
    lets go (10 ms) it is placed with all 3 pulled pages and computes 17 tokens."""
    reuse = ReuseConfig(recompute_threshold_tokens=32)
    sim = Simulator(ClusterSpec("fp8_e4m3", 1, 1, tiny_costs(8), reuse=reuse), LoadSpec())
    pre, dec = sim.prefill[0], sim.decode[0]
    done: list[int] = []
    dec.on_done = lambda req, now: done.append(req.turn_id)
    blocking = dec.cache.new_hold()
    assert dec.cache.allocate(blocking, 4)
    w = _req(3, 64, 4)
    dec.pull(w, _offer(pre, w, 3, retained=False), 0.0, lambda r, out, now: None)
    assert w.pin is not None and dec.cache.free == 1
    dec.arrive(w, 0.0)
    pin = w.pin
    assert not dec.running and list(dec.waiting) == [w] and dec.stats.computed_tokens == 0
    assert pin.alive(0.0) and dec.cache.owned(3) == 3 and dec.cache.evicted == 0 and dec.stats.pages_trimmed == 0

    def let_go(now: float) -> None:
        dec.cache.release(blocking)
        dec.on_freed(now)

    sim.at(10e-3, let_go)
    sim.run()
    assert done == [3] and (w.in_place, w.hit_pages, w.remote_pages) == (3, 3, 3)
    assert (dec.stats.computed_tokens, dec.stats.lost_tokens, dec.stats.leases_reclaimed, dec.cache.evicted) == (17, 0, 0, 0)


def test_the_decode_lets_go_of_a_transfer_hold_through_an_engine_call_on_the_prefill() -> None:
    # KVTransfer.release runs on the prefill's engine thread: once the decode's pull is over, an idle
    # prefill frees the prompt's pages at once, a busy one only when its step in progress ends.
    sim = _sim(16, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, chunk_size=64))
    pre = sim.prefill[0]
    pre.on_done = lambda req, now: None
    idle, busy = _offer(pre, _req(2, 40, 4), 2, retained=False), _offer(pre, _req(3, 40, 4), 2, retained=False)
    sim._let_go_offer(idle, 0.25)
    assert idle.lease_id not in pre.leases and busy.lease_id in pre.leases
    pre.arrive(_req(1, 60, 20), 0.25)  # one step computes the whole prompt
    assert pre.busy
    sim._let_go_offer(busy, 0.25)
    assert busy.lease_id in pre.leases and pre.cache.used == 4 + 4
    sim.run()
    step = pre.stats.prompt_step_s
    assert pre.stats.prompt_steps == 1 and step > 0 and busy.lease_id not in pre.leases
    assert pre.stats.transfer_leases_ended == {"released": 2, "expired": 0}
    assert pre.stats.transfer_lease_seconds == {"released": 0.25 + (0.25 + step), "expired": 0.0}


def _at_prefill(sim: Simulator, req: Req, offer: WLease | None, now: float) -> None:
    """``req`` reaches the prefill's server with ``offer`` (the gateway's lease table's params, if any)."""
    pre, dec = sim.prefill[0], sim.decode[0]
    req.prefill_url, req.decode_url, req.lease_offer = pre.url, dec.url, offer
    sim._at_prefill((None, req, pre, dec), now)  # type: ignore[arg-type]


def test_a_prefill_pull_plans_when_the_step_in_progress_ends_after_the_releases_queued_during_it() -> None:
    # Puller._plan runs on the engine thread: a pull sent while a step runs plans when it ends, after a
    # transfer hold's release queued before it. A 12-page prefill pool: X's 6-page transfer hold and A's
    # 60-token prompt (4 pages) leave 2 free; W (80 tokens) is offered 4 pages by the decode's retained
    # lease. Planned at once (0 s), its pull would find no room and W would compute all 80 tokens; at
    # the step's end X's 6 pages are cached and A's partial last page is free: the pull takes the 3 free
    # pages and evicts 1 of X's, and W's own fifth page another.
    reuse = ReuseConfig(recompute_threshold_tokens=32)
    sim = Simulator(ClusterSpec("fp8_e4m3", 1, 1, tiny_costs(12), reuse=reuse), LoadSpec())
    pre, dec = sim.prefill[0], sim.decode[0]
    pre.on_done = lambda req, now: None
    x = _offer(pre, _req(2, 100, 4), 6, retained=False)
    pre.arrive(_req(1, 60, 20), 0.0)
    assert pre.busy and pre.cache.free == 2
    w = _req(3, 80, 4)
    sim._let_go_offer(x, 0.0)
    _at_prefill(sim, w, _offer(dec, w, 4, retained=True), 0.0)
    assert pre.stats.no_room == 0 and pre.stats.pulls == 0 and x.lease_id in pre.leases  # nothing planned yet
    sim.run()
    step = 60 * 1e-4
    assert pre.stats.prompt_steps == 2 and pre.stats.prompt_step_s == step + 16 * 1e-4  # A, then W's last page
    assert (pre.stats.no_room, pre.stats.pulls, pre.stats.pulled_pages, pre.stats.skipped["no_free_pages"]) == (0, 1, 4, 0)
    assert (pre.cache.evicted, w.hit_pages, w.remote_pages) == (2, 4, 4)


def test_a_prefill_queues_a_planned_request_in_the_engine_call_after_the_plan_a_step_later() -> None:
    # After the plan, the pull's thread asks for the next engine call once the plan returned, by when
    # the busy engine has queued its next step: the adopt, which pins the local prefix and adds the
    # request, or the add alone when there is nothing to adopt. B's 256-token prompt runs in four
    # 64-token steps; W1 and W2 are sent during the first and offered pages below the READ threshold.
    # W1, with nothing local, and W2, whose first 2 pages are cached here (pinned by its adopt), are
    # both added after the second step. C, with no offer, plans nothing and joins the queue at once.
    # ``adopt_adds=False`` (the worker before): the add is a call of its own after the adopt's, so W2
    # is added after the third step.
    for adopt_adds, w2_at in ((True, 2.0), (False, 3.0)):
        reuse = ReuseConfig(recompute_threshold_tokens=32)
        sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, chunk_size=64)
        cluster = ClusterSpec("fp8_e4m3", 1, 1, tiny_costs(64), reuse=reuse, scheduler=sched, rules=PullRules(adopt_adds=adopt_adds))
        sim = Simulator(cluster, LoadSpec())
        pre, dec = sim.prefill[0], sim.decode[0]
        pre.on_done = lambda req, now: None
        w1, w2, c = _req(3, 80, 4), _req(4, 80, 4), _req(5, 80, 4)
        cached = pre.cache.new_hold()
        assert pre.cache.allocate(cached, 2)
        pre.cache.publish(cached, w2.segs, 0, 2)
        pre.cache.release(cached)
        queued = _record_arrivals(pre)
        pre.arrive(_req(1, 256, 4), 0.0)
        queued.clear()
        _at_prefill(sim, w1, _offer(dec, w1, 1, retained=True), 1e-3)
        _at_prefill(sim, w2, _offer(dec, w2, 3, retained=True), 1e-3)
        _at_prefill(sim, c, None, 1e-3)
        sim.run()
        step = 64 * 1e-4
        assert pre.stats.skipped["below_threshold"] == 2 and pre.stats.pulls == 0
        assert [(i, round(t / step, 9)) for i, t in queued] == [(5, 1e-3 / step), (3, 2.0), (4, w2_at)]
        assert (w1.hit_pages, w2.hit_pages, w2.in_place) == (0, 2, 2)


def test_a_pulled_request_on_a_busy_prefill_runs_a_step_sooner_when_its_adopt_adds_it() -> None:
    # B's 256-token prompt runs in 64-token chunks on a prefill whose steps take 128 tokens, so a
    # request queued meanwhile runs beside B's next chunk. W (80 tokens) is sent during B's first step
    # and READs 3 pages of the decode's lease: planned when that step ends (6.4 ms), its READ over
    # within the second, its adopt runs when the second ends (12.8 ms) and adds W, which computes its
    # last 32 tokens beside B's third chunk (96 tokens: 9.6 ms) and gives its first token at 22.4 ms.
    # ``adopt_adds=False`` (the worker before): the add is asked after the adopt returned, so it waits
    # for the third step (B alone, 6.4 ms) and W runs beside B's last chunk, done at 28.8 ms.
    for adopt_adds, w_done in ((True, 22.4e-3), (False, 28.8e-3)):
        reuse = ReuseConfig(recompute_threshold_tokens=32)
        sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, chunk_size=64)
        cluster = ClusterSpec("fp8_e4m3", 1, 1, tiny_costs(64), reuse=reuse, scheduler=sched, rules=PullRules(adopt_adds=adopt_adds))
        sim = Simulator(cluster, LoadSpec())
        pre, dec = sim.prefill[0], sim.decode[0]
        done: dict[int, float] = {}
        pre.on_done = lambda req, now: done.setdefault(req.turn_id, now)
        queued = _record_arrivals(pre)
        pre.arrive(_req(1, 256, 4), 0.0)
        w = _req(3, 80, 4)
        _at_prefill(sim, w, _offer(dec, w, 3, retained=True), 1e-3)
        sim.run()
        assert (pre.stats.pulls, pre.stats.pulled_pages, w.hit_pages, w.remote_pages) == (1, 3, 3, 3)
        assert [(i, round(t, 9)) for i, t in queued] == [(1, 0.0), (3, 12.8e-3 if adopt_adds else 19.2e-3)]
        assert round(done[3], 9) == w_done and round(done[1], 9) == 28.8e-3
        assert pre.stats.computed_tokens == 256 + 32


def _record_arrivals(pre: Worker) -> list[tuple[int, float]]:
    """Each request ``pre`` queues, with when (``Worker.arrive``, however it is reached)."""
    queued: list[tuple[int, float]] = []
    arrive = pre.arrive

    def record(req: Req, now: float) -> None:
        queued.append((req.turn_id, now))
        arrive(req, now)

    pre.arrive = record  # type: ignore[method-assign]
    return queued


def test_the_engine_calls_queued_during_a_step_all_run_before_the_next_step_is_planned() -> None:
    # The engine thread is one single-thread executor: the next step is submitted after the calls
    # queued during the step in progress, so it plans with all of them done. A 22-page prefill pool:
    # B's 256-token prompt (16 pages) runs in 64-token chunks in steps of 128 tokens, a transfer
    # hold keeps 4 pages, 2 are free. During B's first step X and Y (32 tokens, 2 pages each) are
    # added and the hold is released, each an engine call. When the step ends (6.4 ms) X takes the
    # free pages and Y the released hold's, and both run beside B's second chunk (128 tokens:
    # 12.8 ms), done at 19.2 ms. Were the first add to start the step, Y would miss it.
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, chunk_size=64)
    sim = Simulator(ClusterSpec("fp8_e4m3", 1, 1, tiny_costs(22), scheduler=sched), LoadSpec())
    pre = sim.prefill[0]
    done: dict[int, float] = {}
    pre.on_done = lambda req, now: done.setdefault(req.turn_id, now)
    hold = _offer(pre, _req(2, 64, 4), 4, retained=False)
    queued = _record_arrivals(pre)
    pre.arrive(_req(1, 256, 4), 0.0)
    assert pre.busy and pre.cache.free == 2
    x, y = _req(3, 32, 4), _req(4, 32, 4)
    pre.engine_call(pre.arrive, x, 1e-3)
    pre.engine_call(pre.arrive, y, 1e-3)
    sim._let_go_offer(hold, 1e-3)
    assert hold.lease_id in pre.leases and list(pre.waiting) == []  # nothing runs until the step ends
    sim.run()
    assert [(i, round(t, 9)) for i, t in queued] == [(1, 0.0), (3, 6.4e-3), (4, 6.4e-3)]
    assert pre.stats.transfer_leases_ended == {"released": 1, "expired": 0}
    assert {i: round(t, 9) for i, t in done.items()} == {3: 19.2e-3, 4: 19.2e-3, 1: 32.0e-3}
    assert pre.stats.prompt_steps == 4 and round(pre.stats.prompt_step_s, 9) == 32.0e-3
