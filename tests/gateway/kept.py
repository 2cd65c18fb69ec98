"""Prompts kept on conversation records as the gateway keeps them: the tagger finds kept
prefixes and renders in a store, and what a prompt produced is filed on its conversation's
record once identity names it (completions.py)."""

from __future__ import annotations

from typing import Any

from kvserving.gateway.conversations import Conversations
from kvserving.gateway.prompt.chat_template import ChatTemplate
from kvserving.gateway.prompt.tagger import ChatTagger, TaggedPrompt
from kvserving.gateway.prompt.token_prefixes import Prefixed, TokenPrefixes
from kvserving.gateway.prompt.tokenizer import TextTokenizer
from kvserving.gateway.prompt.turn_render import TurnRenders


def kept_tagger(
    tokenizer: TextTokenizer, template: ChatTemplate, *, prefixes: bool = True, renders: bool = False, store: Conversations | None = None
) -> ChatTagger:
    """A tagger that finds kept prefixes and/or renders in ``store`` (a new one by default)."""
    store = store if store is not None else Conversations()
    return ChatTagger(
        tokenizer, template, prefixes=TokenPrefixes(tokenizer, store) if prefixes else None, renders=TurnRenders(store) if renders else None
    )


def store_of(tagger: ChatTagger) -> Conversations:
    kept = tagger.prefixes.kept if tagger.prefixes is not None else tagger.renders.kept if tagger.renders is not None else None
    assert isinstance(kept, Conversations)
    return kept


def build(tagger: ChatTagger, messages: Any, *, key: str = "c", scope: str = "", **kw: Any) -> TaggedPrompt:
    """``tagger.build``, its prefixes and render filed on conversation ``key``'s record."""
    prompt = tagger.build(messages, scope=scope, **kw)
    store = store_of(tagger)
    conv = store.open(key, scope=scope)
    store.keep_prefixes(conv, prompt.kept_prefixes)
    if prompt.kept_render is not None:
        store.keep_render(conv, prompt.kept_render)
    return prompt


def encode(prefixes: TokenPrefixes, text: str, *, key: str = "c", scope: str = "") -> Prefixed:
    """``prefixes.encode_prefixed``, its entries filed on conversation ``key``'s record."""
    got = prefixes.encode_prefixed(text, scope=scope)
    store = prefixes.kept
    assert isinstance(store, Conversations)
    store.keep_prefixes(store.open(key, scope=scope), got.filed)
    return got
