"""e2e fixtures: the tiny model (built once per session) and a factory of real
`kvserving worker` processes whose process groups are killed at the end of the
module, also on failure."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvs_workers import WorkerFactory

# The in-process reference engines: one thread, like the workers (OMP_NUM_THREADS=1).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvserving.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("e2e_tiny_model"))


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[WorkerFactory]:
    factory = WorkerFactory(tmp_path_factory.mktemp("workers"), tiny_model_dir)
    try:
        yield factory
    finally:
        factory.close()
