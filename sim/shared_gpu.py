"""One GPU under a prefill and a decode worker (``kvserving simulate``): the one-GPU stack of
``bench/agents.py --gpu`` runs both workers as two processes on GPU 0, so their steps contend.

The model is processor sharing with equal shares: the GPU time-slices between the two
processes' contexts (no MPS), so while both have work each advances at half speed; alone,
each at full speed. A prefill step's remaining GPU time is tracked and its end rescheduled
whenever the decode batch starts or stops; the decode's fluid step rate halves while a prefill
step runs (``DecodeWorker.gpu_share``). The decode worker's compute of a prompt's uncached
tail is part of its steps, so it shares the same way. Counters: seconds with only the
prefill, only the decode, or both busy.
"""

from __future__ import annotations

from typing import Any

from kvserving.sim.workers import DecodeWorker, PrefillWorker, Sim


class SharedGpu:
    """Processor sharing of one GPU between ``prefill`` and ``decode`` (see the module docstring)."""

    def __init__(self, sim: Sim, prefill: PrefillWorker, decode: DecodeWorker) -> None:
        self.sim = sim
        self.prefill = prefill
        self.decode = decode
        prefill.gpu = self
        decode.gpu = self
        self.prefill_busy = False
        self.decode_busy_now = bool(decode.batch)
        self._left = 0.0  # GPU seconds the running prefill step still needs
        self._since = 0.0
        self._version = 0
        self._steps: Any = None
        self._mark = 0.0
        self.busy_s = {"prefill_only": 0.0, "decode_only": 0.0, "both": 0.0}

    def _account(self, now: float) -> None:
        dt = now - self._mark
        if dt > 0:
            if self.prefill_busy and self.decode_busy_now:
                self.busy_s["both"] += dt
            elif self.prefill_busy:
                self.busy_s["prefill_only"] += dt
            elif self.decode_busy_now:
                self.busy_s["decode_only"] += dt
        self._mark = now

    def _rate(self) -> float:
        return 0.5 if self.decode_busy_now else 1.0

    def start_prefill(self, now: float, seconds: float, steps: Any) -> None:
        """The prefill worker starts a step of ``seconds`` alone on the GPU."""
        self._account(now)
        self.prefill_busy = True
        self._left = seconds
        self._since = now
        self._steps = steps
        self._schedule(now)
        self._set_decode_share(now)

    def _schedule(self, now: float) -> None:
        self._version += 1
        self.sim.call_at(now + max(0.0, self._left) / self._rate(), self._prefill_done, self._version)

    def _prefill_done(self, version: int, now: float) -> None:
        if version != self._version:
            return  # rescheduled
        self._account(now)
        self.prefill_busy = False
        steps, self._steps = self._steps, None
        self._set_decode_share(now)
        self.prefill._step_done(steps, now)

    def decode_busy(self, now: float, busy: bool) -> None:
        """The decode batch became non-empty (``busy``) or empty."""
        if busy == self.decode_busy_now:
            return
        self._account(now)
        if self.prefill_busy:
            self._left -= (now - self._since) * self._rate()
            self._since = now
        self.decode_busy_now = busy
        if self.prefill_busy:
            self._schedule(now)

    def _set_decode_share(self, now: float) -> None:
        share = 2.0 if self.prefill_busy else 1.0
        d = self.decode
        if d.gpu_share != share:
            d._advance(now)
            d.gpu_share = share
            d._reschedule(now)

    def counters(self, now: float) -> dict[str, float]:
        self._account(now)
        return dict(self.busy_s)
