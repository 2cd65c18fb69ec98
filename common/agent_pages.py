"""The class mix of agent contexts' KV pages: the data the default bits table is
budgeted against (``kvserving.bits``), and the generator that measures it.

A triaxial page is INT2 only when it is full and every one of its 32 tokens is
2-bit (DESIGN.md), so what a bits table stores depends on how the 56 tag
classes share pages, not on their token shares alone: delimiters, tool-call
JSON and short user messages sit on almost every page of an agent's context.
Without calibration data the engine needs that mix from somewhere; this module
measures it on agent conversations the way ``kvserving calibrate`` measures a
model's data (``Measurement.add_pages``): each agent's last prompt, rendered
with the built-in tiny model's chat template, tokenized and tagged by the
gateway's tagger, cut into pages of 32 tokens from position 0.

The agents are ``kvserving.agent_load``'s generator at production-shaped
lengths (``SPEC``: a system prompt of ~1.2K tokens with 4-12 tool schemas, user
messages of ~80 tokens, tool results of ~500 (log-normal, up to 8K), replies
of ~60 tokens with ~150 tokens of reasoning kept from the last user message on
(as Qwen3-style templates do), histories up to 32K tokens). Their text is
English words, one token each in the tiny tokenizer; a real model's tokenizer
spends about as many tokens on it, and the class mix per page is what counts.

``python -m kvserving.agent_pages OUT`` rewrites the data module
(``common/agent_pages_data.py``); a test regenerates it and compares.
"""

from __future__ import annotations

import argparse
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from kvserving.agent_load import WORDS, Conversation, Dist, LoadSpec, agent

PAGE_SIZE = 32
AGENTS = 24
SPEC = LoadSpec(
    seed=7,
    system_tokens=Dist("uniform", 1200, 600, 1),
    num_tools=Dist("uniform", 8, 4, 1, 12),
    tool_description_tokens=Dist("uniform", 40, 20, 1),
    turns=Dist("uniform", 24, 16, 1),
    user_tokens=Dist("lognormal", 80, 0.8, 4, 2000),
    output_tokens=Dist("uniform", 60, 40, 1),
    tool_call_prob=0.8,
    tool_args_tokens=Dist("uniform", 20, 10, 1),
    tool_result_tokens=Dist("lognormal", 500, 1.0, 8, 8000),
    max_context_tokens=32768,
)
REASONING_TOKENS = Dist("uniform", 150, 100, 1)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(n, 1)))

# A page's class mix: ((tag, tokens), ...) sorted by tag; the pages: (count, mix) entries.
Mix = tuple[tuple[int, int], ...]
Pages = tuple[tuple[int, Mix], ...]


def agent_messages(spec: LoadSpec, i: int) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """Agent ``i``'s last request (messages, tools), every earlier turn answered.

    Each reply gets reasoning words; a template that keeps reasoning only after the
    last user message (Qwen3-style) is mimicked by keeping it only there."""
    a = agent(spec, i)
    rng = random.Random(f"kvserving-agent-pages:{spec.seed}:{i}")
    conv = Conversation(a)
    for turn in a.turns[:-1]:
        conv.request(turn)
        conv.reply(turn, _words(rng, turn.output_tokens))
        conv.messages[-1]["reasoning_content"] = _words(rng, REASONING_TOKENS.sample_int(rng))
    messages = conv.request(a.turns[-1]) if a.turns else list(conv.messages)
    last_user = max((k for k, m in enumerate(messages) if m["role"] == "user"), default=0)
    for m in messages[:last_user]:
        m.pop("reasoning_content", None)
    return messages, list(a.tools)


def page_mix(tag_lists: Sequence[Sequence[int]], *, page_size: int = PAGE_SIZE) -> tuple[Pages, int]:
    """(pages, residual): the class mix of every full page of each prompt (from position 0),
    counted, most common first; tokens of partial last pages."""
    counts: Counter[Mix] = Counter()
    residual = 0
    for tags in tag_lists:
        full = len(tags) - len(tags) % page_size
        for s in range(0, full, page_size):
            counts[tuple(sorted(Counter(tags[s : s + page_size]).items()))] += 1
        residual += len(tags) - full
    return tuple(sorted(((n, mix) for mix, n in counts.items()), key=lambda e: (-e[0], e[1]))), residual


def measure(*, agents: int = AGENTS, spec: LoadSpec = SPEC) -> tuple[Pages, int, int]:
    """(pages, residual, tokens) of ``agents`` agents' last prompts on the built-in tiny model."""
    from kvserving.gateway.chat_template import ChatTemplate
    from kvserving.gateway.tagger import ChatTagger
    from kvserving.gateway.tokenizer import TextTokenizer
    from kvserving.model_dir import tiny_model_dir

    root = tiny_model_dir()
    tagger = ChatTagger(TextTokenizer.from_dir(root), ChatTemplate.from_dir(root))
    tag_lists = []
    for i in range(agents):
        messages, tools = agent_messages(spec, i)
        tag_lists.append(tagger.build(messages, tools=tools, add_generation_prompt=True).tags)
    pages, residual = page_mix(tag_lists)
    return pages, residual, sum(len(t) for t in tag_lists)


def render_module(pages: Pages, residual: int, tokens: int, *, agents: int = AGENTS) -> str:
    """The data module's source text (deterministic: a test compares it byte for byte)."""
    lines = [
        '"""Generated by ``python -m kvserving.agent_pages common/agent_pages_data.py``: do not edit.',
        "",
        f"The class mix of the {PAGE_SIZE}-token KV pages of {agents} agents' last prompts",
        f"({tokens} tokens; ``kvserving.agent_pages`` says how they are made). Each entry of",
        "``PAGES`` is (number of pages, ((tag, tokens), ...)); ``RESIDUAL`` counts the tokens",
        'of partial last pages. Imports nothing."""',
        "",
        f"PAGE_SIZE = {PAGE_SIZE}",
        f"TOKENS = {tokens}",
        f"RESIDUAL = {residual}",
        "PAGES: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] = (",
    ]
    lines += [f"    ({n}, {mix!r})," for n, mix in pages]
    lines.append(")")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvserving.agent_pages", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the data module to write (common/agent_pages_data.py)")
    args = parser.parse_args(argv)
    pages, residual, tokens = measure()
    args.out.write_text(render_module(pages, residual, tokens))
    print(f"{args.out}: {sum(n for n, _ in pages)} pages in {len(pages)} mixes, {tokens} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
