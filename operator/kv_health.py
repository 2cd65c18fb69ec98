"""KV health of one KVServing, from its workers' ``GET /internal/kv/stats``
(pure: samples in, the ``status.kv`` object and a verdict out).

    status.kv = {
      "prefill": {"pods": 2, "reporting": 2, "capacityTokens": …, "usedRatio": 0.31},
      "decode":  {…},
      "activeLeases": 12, "leasedTokens": 40960,
      "reuseRatio": 0.83,          # prompt tokens reused / prompt tokens, over the window
      "fallbacks": {"lease_expired": 3, …},   # cumulative, summed over pods
      "window": {"reused": …, "prompt": …, "fallbacks": …},  # the totals the next window starts from
      "storedBits": 2.68, "bitBudget": 2.7,  # triaxial: bits per value over the pages held, all pods
      "bits": "2.68/2.70",                   # stored / budget: the BITS column of kubectl get kvs
    }

``storedBits`` weighs each pod's average (``stored_bits.excluded``) by the pages it
holds (owned + cached); it is absent until some pod holds a page.

The reuse ratio is taken over the window between two samples (the operator
samples every ``INTERVAL_S``), so it shows the last minutes, not the history
since the pods started; a pod restart (totals going down) restarts the window.

Verdicts (``kv_degraded``), first that applies:
- ``KVPoolFull``: a role's used ratio >= ``FULL_RATIO``: new requests queue or
  preempt, and retained conversations are evicted early;
- ``ReuseFallbacksDominate``: at least ``MIN_FALLBACKS`` fallbacks in the
  window and fewer prompt tokens reused than ``MIN_REUSE_RATIO`` of the prompt
  tokens: the transfers the gateway routes for keep failing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

INTERVAL_S = 30.0
FULL_RATIO = 0.98
MIN_FALLBACKS = 3
MIN_REUSE_RATIO = 0.10
WORKER_ROLES = ("prefill", "decode")

Stats = Mapping[str, Any]


def _int(stats: Stats, *path: str) -> int:
    value: Any = stats
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else None
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def _role_summary(samples: list[Stats | None]) -> dict[str, Any]:
    reporting = [s for s in samples if s is not None]
    ratios = [float(s["used_ratio"]) for s in reporting if isinstance(s.get("used_ratio"), int | float)]
    return {
        "pods": len(samples),
        "reporting": len(reporting),
        "capacityTokens": sum(_int(s, "capacity_tokens") for s in reporting),
        "usedRatio": round(max(ratios), 4) if ratios else 0.0,
    }


def summarize(samples: Mapping[str, list[Stats | None]], *, previous: Mapping[str, Any] | None) -> dict[str, Any]:
    """``samples``: role -> one stats object per pod (None: the pod did not answer).
    ``previous``: the last ``status.kv`` (for the window), or None."""
    every = [s for role in WORKER_ROLES for s in samples.get(role, []) if s is not None]
    reused = sum(_int(s, "prompt_tokens", "local") + _int(s, "prompt_tokens", "remote") for s in every)
    prompt = reused + sum(_int(s, "prompt_tokens", "computed") for s in every)
    fallbacks: dict[str, int] = {}
    for s in every:
        for reason, count in (s.get("fallbacks") or {}).items():
            fallbacks[str(reason)] = fallbacks.get(str(reason), 0) + int(count)
    total_fallbacks = sum(fallbacks.values())
    window = {"reused": reused, "prompt": prompt, "fallbacks": total_fallbacks}

    before = (previous or {}).get("window") or {}
    d_reused, d_prompt, d_fallbacks = (window[k] - int(before.get(k, 0)) for k in ("reused", "prompt", "fallbacks"))
    if min(d_reused, d_prompt, d_fallbacks) < 0 or not before:  # a pod restarted, or the first sample
        d_reused, d_prompt, d_fallbacks = reused, prompt, total_fallbacks
    kv: dict[str, Any] = {role: _role_summary(samples.get(role, [])) for role in WORKER_ROLES}
    kv.update(
        activeLeases=sum(_int(s, "leases") for s in every),
        leasedTokens=sum(_int(s, "leased_tokens") for s in every),
        reuseRatio=round(d_reused / d_prompt, 4) if d_prompt else 0.0,
        fallbacks=dict(sorted(fallbacks.items())),
        window=window,
        windowFallbacks=d_fallbacks,
    )
    kv.update(stored_bits(every))
    return kv


def stored_bits(every: list[Stats]) -> dict[str, Any]:
    """``storedBits`` / ``bitBudget`` / ``bits`` over the reporting pods (empty when no pod holds a page)."""
    pages = bits = 0.0
    budget = None
    for s in every:
        block = s.get("stored_bits")
        if not isinstance(block, Mapping):
            continue
        if isinstance(block.get("budget"), int | float):
            budget = float(block["budget"])
        held = _int(s, "pages", "owned") + _int(s, "pages", "cached")
        if isinstance(block.get("excluded"), int | float) and held:
            pages += held
            bits += held * float(block["excluded"])
    if not pages:
        return {}
    out: dict[str, Any] = {"storedBits": round(bits / pages, 3)}
    if budget is not None:
        out["bitBudget"] = budget
    out["bits"] = f"{bits / pages:.2f}/{budget:.2f}" if budget is not None else f"{bits / pages:.2f}"
    return out


def kv_degraded(kv: Mapping[str, Any]) -> tuple[str, str] | None:
    """(reason, message) when the KV side is unhealthy, else None."""
    for role in WORKER_ROLES:
        used = float((kv.get(role) or {}).get("usedRatio", 0.0))
        if used >= FULL_RATIO:
            return "KVPoolFull", f"{role} KV pool {used:.0%} full (>= {FULL_RATIO:.0%}): requests queue and retained KV is evicted"
    fell = int(kv.get("windowFallbacks", 0))
    if fell >= MIN_FALLBACKS and float(kv.get("reuseRatio", 0.0)) < MIN_REUSE_RATIO:
        return (
            "ReuseFallbacksDominate",
            f"{fell} KV reuse fallbacks in the last window and {float(kv.get('reuseRatio', 0.0)):.0%} of prompt tokens "
            f"reused (< {MIN_REUSE_RATIO:.0%}): transfers keep failing, turns recompute",
        )
    return None
