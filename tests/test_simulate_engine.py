"""The simulated workers' engine steps (kvserving.sim.workers): pages as sequences grow, the
newest running sequence preempted when none are left (``worker/scheduler.py``), its cached
pages reused when it is readmitted, a prefix dropped when only a fresh placement fits, and the
benchmark's point window."""

from __future__ import annotations

from kvserving.agents.load import LoadSpec
from kvserving.config import SchedulerConfig
from kvserving.sim.cluster import ClusterSpec, Simulator, run_bench_point
from kvserving.sim.workers import Req

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
