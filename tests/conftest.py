"""Shared pytest setup: deterministic seeds, no GPU assumptions, nothing from the
network, and the built-in tiny model every test folder uses."""

import os
from pathlib import Path

import pytest
import torch

# Nothing may reach the Hugging Face hub from the tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# One intra-op thread: the tiny shapes gain nothing from more, and on a
# shared 2-core machine OpenMP threads that spin against other processes
# made the engine ~30x slower (measured: 2.6 vs 89 tokens/s).
torch.set_num_threads(1)

# Triton kernels run in the interpreter on machines without a GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; run on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding `kvserving tiny-model` output (seed 0); read-only by convention."""
    from kvserving.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))
