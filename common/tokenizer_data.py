"""The built-in tiny model's tokenizer: a byte-level BPE trained on local text,
its special tokens and its Qwen-style chat template.

Nothing is downloaded: the training text is a fixed list of the running
Python's standard-library sources, read in a fixed order, so the same Python
version always yields the same tokenizer.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

VOCAB_SIZE = 4096  # including the special tokens

# Special tokens, in id order after the learned vocabulary. Each is a single id.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",  # pad
    "<|im_start|>",
    "<|im_end|>",  # eos
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
# Tokens that are markup inside text (the model may generate them) rather than
# control tokens: `skip_special_tokens` must keep them when decoding.
NON_SKIPPED_SPECIALS = frozenset({"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"})
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Splits text into words/numbers/punctuation/whitespace runs before BPE, so no
# merge crosses those boundaries (the usual GPT-style pre-tokenization; digits
# are split one by one).
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Standard-library files present in every CPython 3.11+; together a few
# hundred KB of code and English docstrings. Order matters for determinism.
CORPUS_FILES: tuple[str, ...] = (
    "textwrap.py",
    "string.py",
    "heapq.py",
    "bisect.py",
    "queue.py",
    "shlex.py",
    "fnmatch.py",
    "glob.py",
    "json/__init__.py",
    "json/decoder.py",
    "json/encoder.py",
    "functools.py",
    "dataclasses.py",
    "argparse.py",
    "difflib.py",
    "calendar.py",
    "csv.py",
)
MAX_CORPUS_CHARS = 400_000

# Qwen-style chat template (ChatML turns). Written for this project:
# - system first (with a `# Tools` block listing `tools` as JSON lines);
# - user content is a string or a list of parts; `image`/`image_url` parts
#   become <|vision_start|><|image_pad|><|vision_end|>;
# - assistant reasoning comes from `reasoning_content` or from inline
#   <think>...</think> at the start of `content`, and is always rendered, in
#   every turn: turn N's prompt then stays a prefix of turn N+1's, which is
#   what lets a worker reuse the KV it kept (DESIGN.md, Worker);
# - `tool_calls` become <tool_call>{"name": ..., "arguments": ...}</tool_call>;
# - consecutive `tool` messages share one user turn of <tool_response> blocks;
# - `add_generation_prompt` opens the assistant turn; `enable_thinking=false`
#   pre-fills an empty think block.
CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is iterable and content is not mapping -%}"
    "{%- for part in content -%}"
    "{%- if part is string -%}{{- part -}}"
    "{%- elif part.type == 'text' -%}{{- part.text -}}"
    "{%- elif part.type in ('image', 'image_url') or 'image' in part or 'image_url' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part.type == 'video' or 'video' in part -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    # System turn: the system message and/or the tool schemas.
    "{%- set has_system = messages and messages[0].role == 'system' -%}"
    "{%- if tools or has_system -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if has_system -%}{{- render_content(messages[0].content) -}}{%- endif -%}"
    "{%- if tools -%}"
    "{%- if has_system -%}{{- '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou can call the functions below; their JSON schemas are inside <tools></tools>:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' ~ (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call one, reply with its name and arguments as JSON inside <tool_call></tool_call>:\\n'"
    ' \'<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>\' -}}'
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message.role == 'system' -%}"
    "{%- elif message.role in ('user', 'system') -%}"
    "{{- '<|im_start|>' ~ message.role ~ '\\n' ~ render_content(message.content) ~ '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{%- set content = render_content(message.content) -%}"
    "{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- if not reasoning -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- endif -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if reasoning -%}{{- '<think>\\n' ~ reasoning.strip('\\n') ~ '\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- content -}}"
    "{%- for call in (message.tool_calls or []) -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    '{{- \'<tool_call>\\n{"name": "\' ~ fn.name ~ \'", "arguments": \' -}}'
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' ~ render_content(message.content) ~ '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- raise_exception('unknown role: ' ~ message.role) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def corpus_texts(*, max_chars: int = MAX_CORPUS_CHARS) -> list[str]:
    """The training text: CORPUS_FILES from the standard library, in order,
    cut at `max_chars` in total."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for name in CORPUS_FILES:
        path = stdlib / name
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")[: max_chars - total]
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if total < 50_000:
        raise ValueError(f"too little training text in {stdlib} ({total} chars); is the standard library installed?")
    return texts


def train_tokenizer(*, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE over the corpus; special tokens take the last ids."""
    learned = vocab_size - len(SPECIAL_TOKENS)
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=learned,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(corpus_texts(), trainer=trainer)
    if tokenizer.get_vocab_size() != learned:
        raise ValueError(f"BPE learned {tokenizer.get_vocab_size()} tokens, wanted {learned}: corpus too small")
    # One at a time to keep SPECIAL_TOKENS' order as id order. Markup tokens
    # are added as non-special so that decoding with skip_special_tokens keeps them.
    for tok in SPECIAL_TOKENS:
        if tok in NON_SKIPPED_SPECIALS:
            tokenizer.add_tokens([AddedToken(tok, special=False, normalized=False)])
        else:
            tokenizer.add_special_tokens([AddedToken(tok, special=True, normalized=False)])
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer) -> dict[str, object]:
    """tokenizer_config.json for `tokenizer` (ids of the special tokens, chat template)."""
    added = {
        str(tokenizer.token_to_id(tok)): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": tok not in NON_SKIPPED_SPECIALS,
        }
        for tok in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "chat_template": CHAT_TEMPLATE,
    }
