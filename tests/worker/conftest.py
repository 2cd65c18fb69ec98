"""Worker test fixtures: the built-in tiny model, built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Nothing may reach the Hugging Face hub from the tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding `kvserving tiny-model` output (seed 0); read-only by convention."""
    from kvserving.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))
