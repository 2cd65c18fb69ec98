"""Gateway test fixtures: the gateway's view of the built-in tiny model
(tokenizer, chat template; the model is tests/conftest.py's)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from gw_harness import Stack

from kvserving.gateway.prompt.chat_template import ChatTemplate
from kvserving.gateway.prompt.tokenizer import TextTokenizer


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> TextTokenizer:
    """The gateway's tokenizer of the tiny model (shared: tests must not change it)."""
    return TextTokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="session")
def template(tiny_model_dir: Path) -> ChatTemplate:
    """The tiny model's chat template."""
    return ChatTemplate.from_dir(tiny_model_dir)


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    """`transformers`' tokenizer of the tiny model: the reference."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture()
def stack(tiny_model_dir: Path) -> Iterator[Stack]:
    """The app tests' harness: fake workers and gateways started on loopback, all stopped after the test."""
    s = Stack(tiny_model_dir)
    try:
        yield s
    finally:
        s.close()
