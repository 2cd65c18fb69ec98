"""The triaxial bits table from a bit budget: DESIGN.md's greedy rule, over
default class sensitivities and frequencies until calibration measures them.

The rule (DESIGN.md, Token tags): start every class k at 2 bits and upgrade
classes to 4 bits in order of ``(D_k(2) - D_k(4)) / (2 N_k)`` -- fidelity
gained per extra bit spent -- until the average bits per token, weighted by the
class frequencies ``N_k``, reaches the budget B. B is a ceiling: a class whose
upgrade would pass it stays at 2 bits and the walk goes on to the next ones
(rarer classes may still fit), so the average ends as close below B as the
class sizes allow.

Until calibration measures ``D_k`` for a model, the gain of a class is modelled
as ``D_k(2) - D_k(4) = s_k * N_k``: every token of class k costs ``s_k`` when
stored at 2 bits, so the order is by per-token sensitivity ``s_k`` and the
frequencies only decide how much of the budget each upgrade spends. ``s_k`` is
the product of one weight per tag axis:

- temporal: current 8, turn_m1 4, turn_m2 2, older 1. An agent acts on the
  latest request and the latest tool result; attention to a turn fades with
  its age, so halve the cost per turn back.
- semantic: inst 8 and delim 8 (the system prompt and tool schemas steer every
  turn; template delimiters are attention sinks, so an error there shifts the
  whole softmax -- both are few tokens), user 4 and tool_call 4 (the request,
  and call arguments the model copies later), assistant 2, reasoning 1 and
  obs 1 (finished thoughts are rarely re-read; tool observations -- files,
  logs, search results -- are long, redundant and looked up sparsely).
- modal: text 1, image 0.5 (image placeholder tokens are many and redundant).

Default frequencies (share of an agent context's tokens, the product of one
share per axis): temporal current 0.10, turn_m1 0.15, turn_m2 0.15, older 0.60
(long sessions: most of the context is old turns); semantic inst 0.10, user
0.05, assistant 0.10, reasoning 0.10, tool_call 0.05, obs 0.55, delim 0.05
(tool output dominates agent contexts); modal text 0.95, image 0.05.

Pure Python; imports no component.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserving.tags import MODAL, NUM_TAGS, SEMANTIC, TEMPORAL, decode_tag, validate_bits_table

TEMPORAL_SENSITIVITY = {"current": 8.0, "turn_m1": 4.0, "turn_m2": 2.0, "older": 1.0}
SEMANTIC_SENSITIVITY = {
    "inst": 8.0, "user": 4.0, "assistant": 2.0, "reasoning": 1.0, "tool_call": 4.0, "obs": 1.0, "delim": 8.0,
}
MODAL_SENSITIVITY = {"text": 1.0, "image": 0.5}

TEMPORAL_SHARE = {"current": 0.10, "turn_m1": 0.15, "turn_m2": 0.15, "older": 0.60}
SEMANTIC_SHARE = {
    "inst": 0.10, "user": 0.05, "assistant": 0.10, "reasoning": 0.10, "tool_call": 0.05, "obs": 0.55, "delim": 0.05,
}
MODAL_SHARE = {"text": 0.95, "image": 0.05}

# One letter per semantic class, in SEMANTIC order, for the one-line table.
_LETTERS = "IUARCOD"
_EPS = 1e-9  # budgets are decimals like 2.7: compare averages with a little slack


def default_sensitivity() -> tuple[float, ...]:
    """``s_k`` of each of the 56 classes (module docstring)."""
    return tuple(
        TEMPORAL_SENSITIVITY[t] * MODAL_SENSITIVITY[m] * SEMANTIC_SENSITIVITY[s]
        for t, m, s in (decode_tag(k) for k in range(NUM_TAGS))
    )


def default_frequency() -> tuple[float, ...]:
    """``N_k`` of each class as a share of the tokens (sums to 1)."""
    return tuple(
        TEMPORAL_SHARE[t] * MODAL_SHARE[m] * SEMANTIC_SHARE[s]
        for t, m, s in (decode_tag(k) for k in range(NUM_TAGS))
    )


def greedy_bits_table(budget: float, *, gain: Sequence[float], frequency: Sequence[float]) -> tuple[int, ...]:
    """DESIGN.md's greedy rule: ``gain[k] = D_k(2) - D_k(4)``, ``frequency[k] = N_k`` (> 0).

    Ties in ``gain / (2 N)`` go to the lower tag id, so the table is deterministic."""
    if not 2.0 <= budget <= 4.0:
        raise ValueError(f"bit_budget must be in [2, 4], got {budget}")
    if len(gain) != NUM_TAGS or len(frequency) != NUM_TAGS:
        raise ValueError(f"gain and frequency must have {NUM_TAGS} entries, got {len(gain)} and {len(frequency)}")
    if any(not n > 0 for n in frequency):
        raise ValueError("frequency entries must be > 0 (a class that never occurs has no priority)")
    total = sum(frequency)
    order = sorted(range(NUM_TAGS), key=lambda k: (-gain[k] / (2 * frequency[k]), k))
    table = [2] * NUM_TAGS
    average = 2.0
    for k in order:
        upgraded = average + 2 * frequency[k] / total
        if upgraded <= budget + _EPS:
            table[k] = 4
            average = upgraded
    return tuple(table)


def bits_table_for_budget(budget: float) -> tuple[int, ...]:
    """The bits table for ``budget`` under the default sensitivities and frequencies."""
    frequency = default_frequency()
    gain = tuple(s * n for s, n in zip(default_sensitivity(), frequency))
    return greedy_bits_table(budget, gain=gain, frequency=frequency)


def average_bits(table: Sequence[int], frequency: Sequence[float] | None = None) -> float:
    """Average bits per token of ``table`` when classes occur at ``frequency`` (default shares)."""
    table = validate_bits_table(list(table))
    freq = default_frequency() if frequency is None else tuple(frequency)
    return sum(b * n for b, n in zip(table, freq)) / sum(freq)


def int2_share(table: Sequence[int], frequency: Sequence[float] | None = None) -> float:
    """Share of tokens stored at 2 bits under ``table`` at ``frequency`` (default shares)."""
    return (4.0 - average_bits(table, frequency)) / 2.0


def format_bits_table(table: Sequence[int]) -> str:
    """One line: per turn age and modality, the semantic classes at 4 bits as letters
    (I inst, U user, A assistant, R reasoning, C tool_call, O obs, D delim; '.' is 2 bits)."""
    table = validate_bits_table(list(table))
    parts = []
    for t, temporal in enumerate(TEMPORAL):
        cells = []
        for m, modal in enumerate(MODAL):
            first = (t * len(MODAL) + m) * len(SEMANTIC)
            cells.append(modal + " " + "".join(
                _LETTERS[s] if table[first + s] == 4 else "." for s in range(len(SEMANTIC))
            ))
        parts.append(f"{temporal} " + " ".join(cells))
    return "; ".join(parts)
