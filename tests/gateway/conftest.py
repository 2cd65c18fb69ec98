"""Gateway test fixtures: the built-in tiny model (built once per session) and
the gateway's view of it (tokenizer, chat template)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from gw_harness import Stack

from kvserving.gateway.prompt.chat_template import ChatTemplate
from kvserving.gateway.prompt.tokenizer import TextTokenizer

# Nothing may reach the Hugging Face hub from the tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding `kvserving tiny-model` output (seed 0); read-only by convention."""
    # Test-only import: the gateway package itself never imports the worker.
    from kvserving.worker.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


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
