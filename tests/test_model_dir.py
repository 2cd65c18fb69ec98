"""resolve_model_dir: a given path must be a directory; an empty one means the
built-in tiny model, built once into the cache, atomically, per recipe."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvserving import model_dir
from kvserving.config import ModelConfig
from kvserving.model_dir import CACHE_ENV, resolve_model_dir
from kvserving import tiny_model


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the (6 s) real build by one that writes a marker file; records each build dir."""
    dirs: list[Path] = []

    def fake_build(out_dir: str | Path, *, seed: int = 0) -> Path:
        out = Path(out_dir)
        (out / "config.json").write_text("{}")
        dirs.append(out)
        return out

    monkeypatch.setattr(tiny_model, "build_tiny_model", fake_build)
    return dirs


def test_a_given_path_must_be_an_existing_directory(tmp_path: Path) -> None:
    assert resolve_model_dir(ModelConfig(path=str(tmp_path))) == tmp_path
    with pytest.raises(ValueError, match=r"model.path '/nonexistent/m' does not exist"):
        resolve_model_dir(ModelConfig(path="/nonexistent/m"))
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match=rf"model.path '{f}' is not a directory"):
        resolve_model_dir(ModelConfig(path=str(f)))


def test_empty_path_builds_the_tiny_model_once_into_the_cache(cache: Path, builds: list[Path]) -> None:
    first = resolve_model_dir(ModelConfig())
    assert first.parent == cache and first.name.startswith("tiny-model-")
    assert (first / "config.json").read_text() == "{}"
    assert resolve_model_dir(ModelConfig()) == first
    assert len(builds) == 1  # the second call reused it
    assert builds[0].parent == cache and builds[0] != first  # built beside it, then renamed
    assert sorted(p.name for p in cache.iterdir()) == [first.name]  # no temporary dir left


def test_a_changed_recipe_builds_a_new_folder(cache: Path, builds: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    old = resolve_model_dir(ModelConfig())
    monkeypatch.setitem(tiny_model.TINY_CONFIG, "num_hidden_layers", 5)
    new = resolve_model_dir(ModelConfig())
    assert new != old and len(builds) == 2
    assert sorted(p.name for p in cache.iterdir()) == sorted([old.name, new.name])


def test_a_builder_that_loses_the_race_uses_the_winners_copy(cache: Path, builds: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    target = cache / f"tiny-model-{model_dir._recipe_hash()}"
    fake = tiny_model.build_tiny_model

    def racing_build(out_dir: str | Path, *, seed: int = 0) -> Path:
        out = fake(out_dir, seed=seed)
        target.mkdir()  # another process finishes first
        (target / "config.json").write_text('{"winner": true}')
        return out

    monkeypatch.setattr(tiny_model, "build_tiny_model", racing_build)
    assert resolve_model_dir(ModelConfig()) == target
    assert (target / "config.json").read_text() == '{"winner": true}'
    assert sorted(p.name for p in cache.iterdir()) == [target.name]  # the loser's copy is gone


def test_a_failed_build_leaves_nothing_behind(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(out_dir: str | Path, *, seed: int = 0) -> Path:
        (Path(out_dir) / "half.json").write_text("{")
        raise OSError("disk full")

    monkeypatch.setattr(tiny_model, "build_tiny_model", broken)
    with pytest.raises(OSError, match="disk full"):
        resolve_model_dir(ModelConfig())
    assert list(cache.iterdir()) == []


def test_importing_it_loads_neither_the_worker_nor_torch() -> None:
    code = "import sys, kvserving.model_dir; print('torch' in sys.modules, 'kvserving.worker' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["False", "False"]
