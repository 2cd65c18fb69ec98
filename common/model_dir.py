"""Where a worker's (or gateway's) model lives: ``model.path``, or, when that is
empty, the built-in tiny model generated once into a cache directory.

The CRD says an empty ``model.path`` means the built-in tiny model; this makes
that true everywhere. The cache is ``$KVSERVING_CACHE_DIR`` (default
``~/.cache/kvserving``), one subfolder per tiny-model recipe
(``tiny-model-<hash>``, the hash over the code and numbers that produce the
files), so a changed recipe builds afresh instead of reusing stale files.

Building is atomic: into a temporary directory next to the target, then one
rename. A concurrent builder that loses the race discards its copy and uses the
winner's, so a folder under its final name is always complete.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import tempfile
from pathlib import Path

from kvserving.config import ModelConfig

CACHE_ENV = "KVSERVING_CACHE_DIR"
_RECIPE_VERSION = b"1"  # bump to force a rebuild when something outside the hashed code changes


def resolve_model_dir(model: ModelConfig) -> Path:
    """The model directory of ``model``: its ``path`` (which must be an existing directory),
    or the cached built-in tiny model when ``path`` is empty (built on first use)."""
    if model.path:
        path = Path(model.path).expanduser()
        if not path.exists():
            raise ValueError(f"model.path {model.path!r} does not exist")
        if not path.is_dir():
            raise ValueError(f"model.path {model.path!r} is not a directory")
        return path
    return tiny_model_dir()


def cache_dir() -> Path:
    """``$KVSERVING_CACHE_DIR``, else ``~/.cache/kvserving``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvserving"


def tiny_model_dir() -> Path:
    """The built-in tiny model in the cache, built there (atomically) if missing."""
    # Lazy: the gateway calls this to find the tokenizer without loading torch up front.
    from kvserving import tiny_model

    target = cache_dir() / f"tiny-model-{_recipe_hash()}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tiny_model.build_tiny_model(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
            # Another process renamed its complete copy first: use that one.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _recipe_hash() -> str:
    """16 hex digits over what decides the tiny model's files: its config and the source of
    the modules that build it (an edit there rebuilds once; stale weights never load)."""
    from kvserving import tiny_model, tokenizer_data

    h = hashlib.sha256(_RECIPE_VERSION)
    h.update(json.dumps(tiny_model.TINY_CONFIG, sort_keys=True).encode())
    for module in (tiny_model, tokenizer_data):
        h.update(Path(inspect.getfile(module)).read_bytes())
    return h.hexdigest()[:16]
