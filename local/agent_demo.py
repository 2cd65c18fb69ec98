"""A scripted agent conversation driven through the gateway with the official
``openai`` client: what ``make demo`` shows (reuse on vs off, per turn).

The agent is a replayed trace of a coding agent: a system prompt with tool
schemas, user turns, tool calls and tool results. The model's own reply to
each turn is appended to the history verbatim (as agents do), so the KV the
decode worker retained for it can flow back to the prefill worker on the next
turn. The tiny model's weights are random: its words are noise, the token
counts, transfers and timings are real.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

SYSTEM = (
    "You are a careful coding agent working in a Python repository. Think step by step inside "
    "<think> tags before you act. Use the tools to inspect files and run code; never guess a "
    "file's content. Keep answers short and cite the files you used. When a tool fails, read "
    "its error, fix the call and try again. Summarise what you changed at the end of each task."
)

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "list_files",
            "description": "List the files under a directory of the repository.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "directory"}}, "required": ["path"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file of the repository.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "max_lines": {"type": "integer"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_python",
            "description": "Run a Python snippet and return its stdout and stderr.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    },
]

# (what arrives this turn, the tool the agent calls after replying, that tool's result)
TRACE: list[tuple[str, tuple[str, dict[str, Any]] | None, str | None]] = [
    (
        "Find where the page pool evicts cached pages and tell me its policy.",
        ("list_files", {"path": "worker"}),
        "engine.py\nkv_cache.py\nkv_manager.py\npage_pool.py\nscheduler.py\nsequence.py\ntriaxial_pool.py",
    ),
    (
        "Good. Now read the eviction code.",
        ("read_file", {"path": "worker/page_pool.py", "max_lines": 40}),
        "def allocate(self, n):\n    # free pages first, then never-used space, then evict the least recently\n"
        "    # used cached page (its hash leaves the map)\n    ...\n    return ids",
    ),
    (
        "Write a snippet that checks the LRU order on three pages.",
        ("run_python", {"code": "pool = PagePool(3, page_size=16)\nprint(pool.allocate(3))"}),
        "[0, 1, 2]",
    ),
    ("The output looks right. Explain why the tail of a conversation is evicted first.", None, None),
    ("Last question: what happens to leased pages when the lease expires?", None, None),
]


@dataclass(slots=True)
class TurnResult:
    turn: int
    prompt_tokens: int
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens
    local_tokens: int | None  # from the gateway's kvserving usage extension, when present
    pulled_tokens: int | None
    computed_tokens: int | None
    kv_bytes_pulled: int | None
    reuse_fallback: str | None  # why KV offered by the decode worker was not used (None: used, or none offered)
    completion_tokens: int
    ttft_s: float
    reply: str


def _usage_extension(usage: Any) -> dict[str, Any]:
    extra = getattr(usage, "model_extra", None) or {}
    ext = extra.get("kvserving")
    return ext if isinstance(ext, dict) else {}


def run_conversation(base_url: str, model: str, *, max_tokens: int, session_id: str, timeout_s: float = 60.0) -> list[TurnResult]:
    """Play the trace against ``base_url``; one streamed chat completion per turn."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="unused-locally", timeout=timeout_s, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    results: list[TurnResult] = []
    for n, (text, tool, tool_result) in enumerate(TRACE, start=1):
        messages.append({"role": "user", "content": text})
        start = time.perf_counter()
        ttft: float | None = None
        parts: list[str] = []
        usage: Any = None
        # messages/tools are plain dicts in the wire shape (the SDK's TypedDicts are stricter)
        stream = client.chat.completions.create(  # type: ignore[call-overload]
            model=model,
            messages=messages,
            tools=TOOLS,
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=max_tokens,
            temperature=0.0,
            seed=n,
            extra_headers={"X-Session-ID": session_id},
        )
        for chunk in stream:
            if chunk.choices and ttft is None:
                ttft = time.perf_counter() - start
            for choice in chunk.choices:
                if choice.delta.content:
                    parts.append(choice.delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        if usage is None or ttft is None:
            raise RuntimeError(f"turn {n}: the stream ended without tokens or usage")
        reply = "".join(parts)
        ext = _usage_extension(usage)
        details = usage.prompt_tokens_details
        results.append(
            TurnResult(
                turn=n,
                prompt_tokens=usage.prompt_tokens,
                cached_tokens=int(details.cached_tokens or 0) if details is not None else 0,
                local_tokens=ext.get("local_cached_tokens"),
                pulled_tokens=ext.get("remote_pulled_tokens"),
                computed_tokens=ext.get("computed_prompt_tokens"),
                kv_bytes_pulled=ext.get("kv_bytes_moved"),
                reuse_fallback=ext.get("reuse_fallback"),
                completion_tokens=usage.completion_tokens,
                ttft_s=ttft,
                reply=reply,
            )
        )
        assistant: dict[str, Any] = {"role": "assistant", "content": reply}
        if tool is not None:
            name, arguments = tool
            call_id = f"call_{n}"
            assistant["tool_calls"] = [{"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]
            messages.append(assistant)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": tool_result or ""})
        else:
            messages.append(assistant)
    return results


def _cell(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def format_table(title: str, results: list[TurnResult]) -> str:
    head = f"{'turn':>4} {'prompt':>7} {'local':>7} {'pulled':>7} {'computed':>9} {'KV bytes':>10} {'cached':>7} {'TTFT ms':>8}"
    lines = [title, head]
    for r in results:
        lines.append(
            f"{r.turn:>4} {r.prompt_tokens:>7,} {_cell(r.local_tokens):>7} {_cell(r.pulled_tokens):>7} "
            f"{_cell(r.computed_tokens):>9} {_cell(r.kv_bytes_pulled):>10} {r.cached_tokens:>7,} {r.ttft_s * 1e3:>8.1f}"
        )
    prompt = sum(r.prompt_tokens for r in results[1:])
    cached = sum(r.cached_tokens for r in results[1:])
    if prompt:
        lines.append(f"reuse ratio, turns 2..{len(results)}: {cached / prompt:.0%} of prompt tokens not computed")
    return "\n".join(lines)


def plot_ttft(runs: dict[str, list[TurnResult]], path: str) -> str:
    """TTFT per turn and prompt tokens computed per turn, one series per run; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=120)
    width = 0.8 / max(len(runs), 1)
    for k, (label, results) in enumerate(runs.items()):
        turns = [r.turn for r in results]
        left.plot(turns, [r.ttft_s * 1e3 for r in results], marker="o", label=label)
        right.bar([t - 0.4 + width * (k + 0.5) for t in turns], [r.computed_tokens or 0 for r in results], width=width, label=label)
    for ax, ylabel in ((left, "time to first token (ms)"), (right, "prompt tokens computed")):
        ax.set_xlabel("turn of the agent conversation")
        ax.set_ylabel(ylabel)
        ax.set_xticks(sorted({r.turn for results in runs.values() for r in results}))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("kvserving: bidirectional KV reuse on vs off")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
