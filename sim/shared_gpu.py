"""One GPU under a prefill and a decode worker (``kvserving simulate``): the one-GPU stack of
``bench/agents.py --gpu`` runs both workers as two processes on GPU 0, so their steps contend.

The model is processor sharing: the GPU time-slices between the two processes' contexts (no
MPS), so while both run a step each advances at its share of full speed
(``CostModel.shared_gpu_prefill_share`` / ``shared_gpu_decode_share``, measured by
bench/sim_shared_gpu.py: 0.50 / 0.45 on an H200, so the switches cost ~5 %); alone, at full
speed. A step's remaining GPU time is tracked and its end rescheduled whenever the other
worker's step starts or ends. Counters: seconds with only the prefill, only the decode, or
both busy.

A worker alone on the GPU may run identical decode steps as one event (``workers._Run``): the
GPU then only books their busy time, step by step as stepping would, when the run ends; when the
other role starts a step meanwhile, the step in progress becomes a GPU job (``resume``).

``step_counts`` / ``step_seconds`` count each role's steps by kind and their wall time, sharing
included (the worker's ``kvserving_worker_steps_total`` / ``kvserving_worker_step_seconds_total``: ``decode`` for a step of one-token decodes alone,
``mixed`` for one with prompt tokens), so the replay's step times can be held to the stack's.
"""

from __future__ import annotations

from typing import Any

from kvserving.sim.workers import DecodeWorker, PrefillWorker, Sim, Worker

STEP_KINDS = ("decode", "mixed")


def step_kind(plan: Any) -> str:
    """``mixed`` when a chunk of ``plan`` computes prompt tokens, else ``decode`` (``is_decode_step``)."""
    return "decode" if all(seq.decodes(n) for seq, n in plan) else "mixed"


class SharedGpu:
    """Processor sharing of one GPU between ``prefill`` and ``decode`` (see the module docstring)."""

    def __init__(self, sim: Sim, prefill: PrefillWorker, decode: DecodeWorker) -> None:
        self.sim = sim
        self.prefill = prefill
        self.decode = decode
        prefill.gpu = self
        decode.gpu = self
        self._jobs: dict[Worker, list[Any]] = {}  # worker -> [GPU seconds its step still needs, the step's plan]
        self._mark = 0.0
        self._version = 0
        costs = decode.costs
        self._share = {prefill: costs.shared_gpu_prefill_share, decode: costs.shared_gpu_decode_share}  # rates while both run
        self.busy_s = {"prefill_only": 0.0, "decode_only": 0.0, "both": 0.0}
        self._run: Worker | None = None  # a worker running merged steps alone
        # (role, kind) -> steps, their wall seconds; each running step's (start, kind)
        keys = [(role, kind) for role in ("prefill", "decode") for kind in STEP_KINDS]
        self.step_counts = dict.fromkeys(keys, 0)
        self.step_seconds = dict.fromkeys(keys, 0.0)
        self._began: dict[Worker, tuple[float, str]] = {}

    def _role(self, worker: Worker) -> str:
        return "prefill" if worker is self.prefill else "decode"

    def _count(self, worker: Worker, kind: str, steps: int, wall: float) -> None:
        key = (self._role(worker), kind)
        self.step_counts[key] += steps
        self.step_seconds[key] += wall

    def _progress(self, now: float) -> None:
        """Advance the running steps to ``now`` and count the busy time."""
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
                job[0] -= dt * (self._share[w] if both else 1.0)
        self._mark = now

    def start(self, worker: Worker, now: float, seconds: float, plan: Any) -> None:
        """``worker`` starts a step of ``seconds`` alone on the GPU; it ends with ``worker._step_done(plan)``."""
        if self._run is not None:
            self._run.hand_run_to_gpu(now)
        self._progress(now)
        self._jobs[worker] = [seconds, plan]
        self._began[worker] = (now, step_kind(plan))
        self._schedule(now)

    def _schedule(self, now: float) -> None:
        self._version += 1
        jobs = self._jobs
        if jobs:
            both = len(jobs) == 2
            end = min(max(0.0, job[0]) / (self._share[w] if both else 1.0) for w, job in jobs.items())
            self.sim.call_at(now + end, self._done, self._version)

    def _done(self, version: int, now: float) -> None:
        if version != self._version:
            return  # rescheduled
        self._progress(now)
        finished = [(w, job[1]) for w, job in self._jobs.items() if job[0] <= 1e-9]
        for w, _ in finished:
            del self._jobs[w]
            began, kind = self._began.pop(w)
            self._count(w, kind, 1, now - began)
        self._schedule(now)
        for w, plan in finished:
            w._step_done(plan, now)

    def alone(self, worker: Worker) -> bool:
        """Whether no other step runs: ``worker``'s next steps take their full time."""
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
        self._jobs[worker] = [seconds, plan]
        self._began[worker] = (times[m], "decode")
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
