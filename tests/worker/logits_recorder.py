"""The logits an engine samples from, recorded per request id for tests that compare them.

The engine has no hook for this: ``record_logits`` wraps the engine's runner, whose
``execute`` returns one row of logits per sampling chunk, in chunk order.
"""

from __future__ import annotations

from typing import Any

import torch

from kvserving.worker.engine import LLMEngine
from kvserving.worker.sequence import ScheduledChunk


def record_logits(engine: LLMEngine) -> dict[str, list[torch.Tensor]]:
    """From now on, keep a copy of every sampled position's logits of ``engine``: request id ->
    logits in sampling order (the dict fills as the engine steps)."""
    seen: dict[str, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def recording(chunks: list[ScheduledChunk], **kw: Any) -> torch.Tensor:
        logits = execute(chunks, **kw)
        for row, c in enumerate([c for c in chunks if c.samples]):
            seen.setdefault(c.seq.request_id, []).append(logits[row].clone())
        return logits

    engine.runner.execute = recording  # type: ignore[method-assign]
    return seen
