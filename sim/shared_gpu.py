"""One GPU under a prefill and a decode worker (``kvserving simulate``): the one-GPU stack of
``bench/agents.py --gpu`` runs both workers as two processes on GPU 0, so their steps contend.

The model is processor sharing: the GPU time-slices between the two processes' contexts (no
MPS), so while both run a step each advances at its share of full speed
(``CostModel.shared_gpu_prefill_share`` / ``shared_gpu_decode_share``, measured by
bench/sim_shared_gpu.py: 0.50 / 0.45 on an H200, so the switches cost ~5 %); alone, at full
speed. A job's remaining GPU time is tracked and its end rescheduled whenever the other
worker's job starts or ends. Counters: seconds with only the prefill, only the decode, or
both busy.

A worker's process runs its GPU work one job at a time, in the order asked: its steps and the
copies of the READs into it (``copy``; ``Worker.read`` posts them one at a time). A READ's copy
waits for the step in progress, a step asked for meanwhile waits for the copy, and the copy
shares the device with the other role's step like a step, so a READ takes longer as the load
grows and the prompts of one prefill step reach the decode a step apart (READs 1-3 asked in step k)::

    decode process:  | step k | copy 1 | step k+1 | copy 2 | step k+2: request 1 | copy 3 | step k+3: request 2 |

A worker alone on the GPU may run identical decode steps as one event (``workers._Run``): the
GPU then only books their busy time, step by step as stepping would, when the run ends; when the
other role starts a job meanwhile, or a READ into the worker copies, the step in progress becomes
a GPU job (``resume``).

``step_counts`` / ``step_seconds`` count each role's steps by kind and their wall time, sharing
and the wait for its process's copies included (the worker's ``kvserving_worker_steps_total`` /
``kvserving_worker_step_seconds_total``: ``decode`` for a step of one-token decodes alone, ``mixed``
for one with prompt tokens), so the replay's step times can be held to the stack's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserving.sim.workers import DecodeWorker, PrefillWorker, Sim, Worker

STEP_KINDS = ("decode", "mixed")


def step_kind(plan: Any) -> str:
    """``mixed`` when a chunk of ``plan`` computes prompt tokens, else ``decode`` (``is_decode_step``)."""
    return "decode" if all(seq.decodes(n) for seq, n in plan) else "mixed"


@dataclass(slots=True, eq=False)
class _Job:
    """GPU work of one worker's process: a step (``plan``; it ends with ``worker._step_done``) or a READ's
    copy (``then(arg, t)``)."""

    seconds: float  # GPU seconds it still needs
    plan: Any
    began: float  # when the worker asked for it: a step's wall time counts from here, its wait included
    then: Callable[[Any, float], None] | None = None  # a READ's copy: called when it ends
    arg: Any = None


class SharedGpu:
    """Processor sharing of one GPU between ``prefill`` and ``decode`` (see the module docstring)."""

    def __init__(self, sim: Sim, prefill: PrefillWorker, decode: DecodeWorker) -> None:
        self.sim = sim
        self.prefill = prefill
        self.decode = decode
        prefill.gpu = self
        decode.gpu = self
        self._jobs: dict[Worker, _Job] = {}  # worker -> the job its process runs now
        self._queued: dict[Worker, deque[_Job]] = {prefill: deque(), decode: deque()}  # and the ones behind it, in order
        self._mark = 0.0
        self._version = 0
        costs = decode.costs
        self._share = {prefill: costs.shared_gpu_prefill_share, decode: costs.shared_gpu_decode_share}  # rates while both run
        self.busy_s = {"prefill_only": 0.0, "decode_only": 0.0, "both": 0.0}
        self._run: Worker | None = None  # a worker running merged steps alone
        # (role, kind) -> steps, their wall seconds
        keys = [(role, kind) for role in ("prefill", "decode") for kind in STEP_KINDS]
        self.step_counts = dict.fromkeys(keys, 0)
        self.step_seconds = dict.fromkeys(keys, 0.0)

    def _role(self, worker: Worker) -> str:
        return "prefill" if worker is self.prefill else "decode"

    def _count(self, worker: Worker, kind: str, steps: int, wall: float) -> None:
        key = (self._role(worker), kind)
        self.step_counts[key] += steps
        self.step_seconds[key] += wall

    def _progress(self, now: float) -> None:
        """Advance the running jobs to ``now`` and count the busy time."""
        dt = now - self._mark
        jobs = self._jobs
        if dt > 0 and jobs:
            if len(jobs) == 2:
                self.busy_s["both"] += dt
            elif self.prefill in jobs:
                self.busy_s["prefill_only"] += dt
            else:
                self.busy_s["decode_only"] += dt
            both = len(jobs) == 2
            for w, job in jobs.items():
                job.seconds -= dt * (self._share[w] if both else 1.0)
        self._mark = now

    def start(self, worker: Worker, now: float, seconds: float, plan: Any) -> None:
        """``worker`` starts a step of ``seconds`` alone on the GPU; it ends with ``worker._step_done(plan)``
        (after the READ copies its process runs or queued before it)."""
        self._add(worker, now, _Job(seconds, plan, now))

    def copy(self, worker: Worker, now: float, seconds: float, then: Callable[[Any, float], None], arg: Any) -> None:
        """A READ into ``worker`` copies for ``seconds`` alone on the GPU, then ``then(arg, t)``. The copy is
        work of the worker's process: it waits for the step in progress, and a step started meanwhile waits
        for it."""
        self._add(worker, now, _Job(seconds, None, now, then, arg))

    def _add(self, worker: Worker, now: float, job: _Job) -> None:
        if self._run is not None:
            self._run.hand_run_to_gpu(now)
        self._progress(now)
        if worker in self._jobs:
            self._queued[worker].append(job)
            return
        self._jobs[worker] = job
        self._schedule(now)

    def _schedule(self, now: float) -> None:
        self._version += 1
        jobs = self._jobs
        if jobs:
            both = len(jobs) == 2
            end = min(max(0.0, job.seconds) / (self._share[w] if both else 1.0) for w, job in jobs.items())
            self.sim.call_at(now + end, self._done, self._version)

    def _done(self, version: int, now: float) -> None:
        if version != self._version:
            return  # rescheduled
        self._progress(now)
        finished = [(w, job) for w, job in self._jobs.items() if job.seconds <= 1e-9]
        for w, job in finished:
            del self._jobs[w]
            if job.then is None:
                self._count(w, step_kind(job.plan), 1, now - job.began)
            queued = self._queued[w]
            if queued:
                self._jobs[w] = queued.popleft()
        self._schedule(now)
        for w, job in finished:
            if job.then is None:
                w._step_done(job.plan, now)
            else:
                job.then(job.arg, now)

    def alone(self, worker: Worker) -> bool:
        """Whether no job runs (a step or a copy, either role's): ``worker``'s next steps take their full time."""
        return not self._jobs

    def start_run(self, worker: Worker, now: float) -> None:
        """``worker`` runs merged steps from ``now``, alone until ``end_run`` or ``resume``."""
        self._progress(now)
        self._run = worker

    def end_run(self, worker: Worker, times: list[float]) -> None:
        """The run's steps ``[times[j], times[j + 1])`` are over: their busy time, step by step."""
        self._book(worker, times, len(times) - 1)
        self._count(worker, "decode", len(times) - 1, times[-1] - times[0])
        self._mark = times[-1]
        self._run = None
        self._version += 1

    def resume(self, worker: Worker, times: list[float], m: int, seconds: float, plan: Any) -> None:
        """Step ``m`` of the run, started at ``times[m]``, is a job of ``seconds`` from now on."""
        self._book(worker, times, m)
        self._count(worker, "decode", m, times[m] - times[0])
        self._mark = times[m]
        self._run = None
        self._jobs[worker] = _Job(seconds, plan, times[m])
        self._version += 1
        self.sim.call_at(times[m] + max(0.0, seconds), self._done, self._version)

    def _book(self, worker: Worker, times: list[float], steps: int) -> None:
        key = "prefill_only" if worker is self.prefill else "decode_only"
        busy = self.busy_s[key]
        for j in range(steps):
            busy += times[j + 1] - times[j]
        self.busy_s[key] = busy

    def counters(self, now: float) -> dict[str, float]:
        if self._run is not None:
            self._run.hand_run_to_gpu(now)
        self._progress(now)
        return dict(self.busy_s)
