"""The served model as the gateway needs it: tokenizer, chat template (in the tagger),
context length, end-of-sequence ids and sampling defaults, read from its directory."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .prompt.chat_template import ChatTemplate
from .prompt.tagger import ChatTagger
from .prompt.tokenizer import TextTokenizer


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """The served model as the gateway needs it."""

    name: str
    max_model_len: int
    tokenizer: TextTokenizer
    tagger: ChatTagger
    stop_token_ids: tuple[int, ...]
    defaults: Mapping[str, Any]  # generation_config.json sampling defaults
    created: int

    @classmethod
    def load(
        cls, model_dir: str | Path, *, served_name: str, max_kept_tokens: int | None = None, max_model_len: int | None = None
    ) -> ModelInfo:
        """Tokenizer, chat template, context length and EOS ids of a model directory. What is
        kept between turns is bounded by the conversation store (completions.build_conversations);
        ``max_kept_tokens`` is accepted for the callers that still pass it."""
        root = Path(model_dir)
        tokenizer = TextTokenizer.from_dir(root)
        config = _read_json(root / "config.json")
        generation = _read_json(root / "generation_config.json")
        context = max_model_len or config.get("max_position_embeddings") or tokenizer.config.get("model_max_length")
        if not isinstance(context, int) or context < 1:
            raise ValueError(f"model.max_model_len: cannot tell the context length of {root}; set it in the config")
        eos = generation.get("eos_token_id", config.get("eos_token_id"))
        stop_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stop_ids:
            stop_ids.append(tokenizer.eos_token_id)
        defaults = {k: generation[k] for k in ("temperature", "top_p", "top_k") if generation.get(k) is not None}
        tagger = ChatTagger(tokenizer, ChatTemplate.from_dir(root))
        return cls(
            name=served_name,
            max_model_len=context,
            tokenizer=tokenizer,
            tagger=tagger,
            stop_token_ids=tuple(int(i) for i in stop_ids),
            defaults=defaults,
            created=int(root.stat().st_mtime),
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}
