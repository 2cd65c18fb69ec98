"""The built-in tiny model is real Hugging Face format: transformers loads it
unchanged, its tokenizer round-trips, its chat template renders every role."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvserving import cli
from kvserving.worker.model import DenseCausalAttention, load_model
from kvserving.tiny_model import build_tiny_model
from kvserving.tokenizer_data import SPECIAL_TOKENS, VOCAB_SIZE

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "What is "}, {"type": "image"}, {"type": "text", "text": "?"}],
    },
    {
        "role": "assistant",
        "reasoning_content": "Look it up.",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"q": "cat"}}}],
    },
    {"role": "tool", "content": "a cat"},
    {"role": "assistant", "content": "<think>\nSure.\n</think>\n\nA cat."},
    {"role": "user", "content": "Thanks"},
]
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]

EXPECTED = (
    "<|im_start|>system\nYou are terse.\n\n# Tools\n\n"
    "You can call the functions below; their JSON schemas are inside <tools></tools>:\n<tools>\n"
    '{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}\n</tools>\n\n'
    "To call one, reply with its name and arguments as JSON inside <tool_call></tool_call>:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWhat is <|vision_start|><|image_pad|><|vision_end|>?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nLook it up.\n</think>\n\n"
    '<tool_call>\n{"name": "lookup", "arguments": {"q": "cat"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\na cat\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n<think>\nSure.\n</think>\n\nA cat.<|im_end|>\n"
    "<|im_start|>user\nThanks<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_cli_writes_hf_model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # cli.main rewrites sys.argv
    assert cli.main(["tiny-model", str(tmp_path / "tiny")]) == 0
    out = tmp_path / "tiny"
    files = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
    for name in files:
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (256, 4, 2)


def test_build_is_deterministic(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


def test_transformers_loads_it_unchanged(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    n_params = sum(p.numel() for p in model.parameters())
    assert 3_000_000 < n_params < 8_000_000
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tok) == VOCAB_SIZE == model.config.vocab_size
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == model.config.eos_token_id
    assert tok.pad_token == "<|endoftext|>"


def test_special_tokens_are_single_ids_at_the_end_of_the_vocab(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = [tok.encode(t, add_special_tokens=False) for t in SPECIAL_TOKENS]
    assert ids == [[VOCAB_SIZE - len(SPECIAL_TOKENS) + i] for i in range(len(SPECIAL_TOKENS))]
    # Inside text they are still one id each.
    text_ids = tok.encode("a<think>b</think><tool_call>", add_special_tokens=False)
    first_special = VOCAB_SIZE - len(SPECIAL_TOKENS)
    assert tok.convert_tokens_to_ids(["<think>", "</think>", "<tool_call>"]) == [t for t in text_ids if t >= first_special]


@pytest.mark.parametrize(
    "text",
    [
        "def f(x):\n    return x + 1\n",
        "Hello, world!  Tabs\tand\r\nnewlines.",
        "Unicode: café, naïve, 日本語, emoji 🙂, ∑ x²",
        "",
    ],
)
def test_tokenizer_round_trips_text(tiny_model_dir: Path, text: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    if text.startswith("def"):
        assert len(ids) < len(text) / 2  # BPE learned Python from the corpus


def test_chat_template_renders_every_role(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text == EXPECTED
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert ids.count(tok.convert_tokens_to_ids("<|image_pad|>")) == 1
    assert ids.count(tok.convert_tokens_to_ids("<think>")) == 2
    assert ids.count(tok.convert_tokens_to_ids("<tool_response>")) == 1


def test_chat_template_groups_tool_results_and_can_skip_thinking(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "a", "arguments": "{}"}}, {"function": {"name": "b", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert text == (
        "<|im_start|>user\ngo<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def _greedy(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], float]:
    """n greedy tokens, and the smallest top-1 minus top-2 logit gap seen (in logit std units)."""
    attn = DenseCausalAttention()
    hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), attn)
    out: list[int] = []
    min_gap = float("inf")
    for _ in range(n):
        logits = model.compute_logits(hidden[-1:])[0]
        top = logits.topk(2).values
        min_gap = min(min_gap, float((top[0] - top[1]) / logits.std()))
        out.append(int(logits.argmax()))
        hidden = model(torch.tensor(out[-1:]), torch.tensor([len(prompt) + len(out) - 1]), attn)
    return out, min_gap


def test_greedy_output_is_not_degenerate(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    _, model = load_model(tiny_model_dir)
    out, _ = _greedy(model, tok.encode("import json\n", add_special_tokens=False), 32)
    assert len(set(out)) >= 16


def test_greedy_has_clear_winners_yet_depends_on_context(tiny_model_dir: Path) -> None:
    """What engine tests rely on: greedy tokens survive rounding (bf16 KV,
    another summation order), but a wrong prefix (a KV bug) changes them."""
    _, model = load_model(tiny_model_dir)
    g = torch.Generator().manual_seed(1234)
    changed = 0
    for n in (7, 33, 70, 129):
        prompt = torch.randint(10, VOCAB_SIZE, (n,), generator=g).tolist()
        out, min_gap = _greedy(model, prompt, 32)
        assert min_gap > 0.05, (n, min_gap)
        other_prefix = torch.randint(10, VOCAB_SIZE, (n - 1,), generator=g).tolist() + prompt[-1:]
        changed += _greedy(model, other_prefix, 32)[0] != out
    assert changed >= 2
