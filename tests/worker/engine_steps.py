"""One engine step without a model, for scheduler tests: what ``LLMEngine._schedule`` and its postprocessing do."""

from __future__ import annotations

from kvserving.worker.kv.leases import release_admission
from kvserving.worker.scheduler import Scheduler
from kvserving.worker.sequence import SeqStatus


def step(sched: Scheduler) -> list[tuple[str, list[int]]]:
    """Admission pins go once their requests are admitted (``release_admission``: they hold their own refs then),
    chunks are computed and their full pages published, a token is sampled where a chunk reaches the end, sequences
    end at ``max_tokens``. Returns the requests the step admitted, each with its pages at admission."""
    page = sched.kv.pool.page_size
    waiting = list(sched.waiting)
    out = sched.schedule()
    admitted = [(seq.request_id, list(seq.page_ids)) for seq in waiting if seq.status is SeqStatus.RUNNING]
    for c in out.chunks:
        seq = c.seq
        if seq.admission_pin is not None:
            seq.num_pulled_prompt = page * release_admission(sched.kv.pool, seq.admission_pin, seq.page_ids[: seq.num_computed // page])
            seq.admission_pin = None
        seq.num_computed = c.start + c.num_tokens
        sched.kv.publish_full_pages(seq)
        if c.samples:
            seq.output_ids.append(1000 + len(seq.output_ids))
            if len(seq.output_ids) == seq.params.max_tokens:
                sched.finish(seq, "length")
    return admitted
