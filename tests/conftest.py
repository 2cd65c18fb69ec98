"""Shared pytest setup: deterministic seeds, no GPU assumptions, nothing from the
network, and the built-in tiny model every test folder uses."""

import gc
import os
from collections.abc import Iterator
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


def _nested_calls_without_repatching() -> None:
    """Triton's interpreter patches the language modules a kernel's module sees when its grid starts and restores
    them when the grid ends; every call of a nested ``@triton.jit`` function inside the grid (``tl.zeros``,
    ``tl.sum``, our helpers) patches its own module's again: a scan of every member of ``tl``, ``tl.core``,
    ``tl.tensor`` and ``tl.math`` a call, the larger part of an interpreted GEMV's time. Here a grid patches all of
    them once, before the kernel's own (a superset of what any function's patch covers), so nested calls run
    without patching: the same functions run. Applied to the Triton version pinned in requirements only, whose
    interpreter these names are."""
    import types

    import triton
    import triton.language as tl
    from triton.runtime import interpreter as interp

    if triton.__version__ != "3.9.0":
        return
    # _patch_lang(fn) patches those of tl and tl.core that fn's module sees: with both seen, all of them
    both = types.FunctionType((lambda: None).__code__, {"tl": tl, "core": tl.core})
    depth = [0]  # grids running (the interpreter runs a grid at a time, on the calling thread)

    grid_call, nested_call = interp.GridExecutor.__call__, interp.InterpretedFunction.__call__

    def run_grid(self: interp.GridExecutor, *args: object, **kwargs: object) -> object:
        scope = interp._patch_lang(both)
        depth[0] += 1
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            depth[0] -= 1
            scope.restore()

    def call_nested(self: interp.InterpretedFunction, *args: object, **kwargs: object) -> object:
        if not depth[0]:
            return nested_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    interp.GridExecutor.__call__ = run_grid
    interp.InterpretedFunction.__call__ = call_nested


if os.environ.get("TRITON_INTERPRET") == "1":
    _nested_calls_without_repatching()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; run on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _gpu_memory_given_back(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a gpu test, its tensors collected and torch's cached blocks returned to the driver: bench/gpu_run.sh runs
    the gpu suite in several processes on one GPU, and memory one process keeps cached is memory another lacks."""
    yield
    if "gpu" in request.keywords and torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding `kvserving tiny-model` output (seed 0); read-only by convention."""
    from kvserving.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))
