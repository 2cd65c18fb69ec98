"""The simulator's optional compiled core: cluster.py, workers.py and cache.py built
with mypyc from the same source, for ``kvserving simulate`` at population scale.

The pure-Python modules are the reference (the tests and ``--validate`` run them).
``kvserving simulate --build-native`` compiles copies of the three (mypyc comes with the pinned
dev requirement mypy; it needs a C compiler and the Python headers; ~20 s of CPU) into a
cache directory named by a hash of their source and the Python build, and later runs load it
only when that hash matches the source they would run (an edited simulator never runs stale
compiled code: it runs pure Python until rebuilt). The copies import each other as package
``kvs_simnative``; everything else (the router, the lease table, agents, the cost model) is
the same Python code either way. Results are the same as pure Python's (tests/test_simulate.py
compares them when a build is present; docs/performance-log/simulate.md, the digests of whole runs).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

NATIVE_MODULES = ("cache", "workers", "cluster")
PACKAGE = "kvs_simnative"
_IMPORT = re.compile(r"\bkvserving\.sim\.(" + "|".join(NATIVE_MODULES) + r")\b")
# mypy's settings for the build: it types our modules and the standard library, and takes every other package as
# Any (the core uses none at run time; following torch's 1,400 modules, reached through annotations only, was
# ~95 % of the build's type checking and changes no byte of the generated C)
MYPY_INI = "[mypy]\nfollow_imports = skip\n\n[mypy-kvserving.*]\nfollow_imports = normal\n"


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/kvserving/sim-native`` (``~/.cache`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvserving" / "sim-native"


def _source(name: str) -> str:
    return Path(__file__).with_name(f"{name}.py").read_text()


def rewrite(text: str) -> str:
    """A module's source with its imports of the other compiled modules pointed at the copies."""
    return _IMPORT.sub(lambda m: f"{PACKAGE}.{m.group(1)}", text)


def source_key() -> str:
    """What a build must match: the three sources, the Python build and the machine."""
    h = hashlib.sha256()
    for name in NATIVE_MODULES:
        h.update(name.encode() + b"\0" + _source(name).encode() + b"\0")
    h.update(MYPY_INI.encode() + b"\0")
    h.update(f"{sys.version}|{sys.implementation.cache_tag}|{platform.machine()}".encode())
    return h.hexdigest()[:20]


def build_dir() -> Path:
    return cache_root() / source_key()


def build(*, log: bool = True, opt_level: int = 3) -> Path:
    """Compile the core for the current source (once: an existing build is kept); its directory.
    ``opt_level``: the C compiler's (mypyc's ``MYPYC_OPT_LEVEL``); 0 builds in a fraction of the time,
    for a check of the results rather than a run."""
    dest = build_dir()
    if (dest / "ok").is_file():
        return dest
    with tempfile.TemporaryDirectory(prefix="kvs-simnative-") as tmp:
        pkg = Path(tmp) / PACKAGE
        pkg.mkdir()
        (pkg / "__init__.py").write_text("")
        (Path(tmp) / "mypy.ini").write_text(MYPY_INI)  # mypyc's mypy reads the working directory's
        for name in NATIVE_MODULES:
            (pkg / f"{name}.py").write_text(rewrite(_source(name)))
        cmd = [sys.executable, "-m", "mypyc", *(f"{PACKAGE}/{name}.py" for name in NATIVE_MODULES)]
        if log:
            print(f"compiling the simulator core with mypyc into {dest} ...", file=sys.stderr)
        try:
            env = {**os.environ, "MYPYC_OPT_LEVEL": str(opt_level)}
            proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=1800, env=env)
        except FileNotFoundError as exc:
            raise ValueError(f"cannot run mypyc: {exc}") from exc
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]
            raise ValueError(f"mypyc failed (needs the dev requirements, a C compiler, Python headers): {tail[0]}")
        staging = Path(tempfile.mkdtemp(prefix=".build-", dir=_ensure(cache_root())))
        (staging / PACKAGE).mkdir()
        shutil.copy(pkg / "__init__.py", staging / PACKAGE / "__init__.py")
        for lib in Path(tmp).glob("*.so"):  # mypyc's shared runtime for the group
            shutil.copy(lib, staging / lib.name)
        for lib in pkg.glob("*.so"):
            shutil.copy(lib, staging / PACKAGE / lib.name)
        if len(list((staging / PACKAGE).glob("*.so"))) != len(NATIVE_MODULES):
            shutil.rmtree(staging, ignore_errors=True)
            raise ValueError("mypyc built no extension modules")
        (staging / "ok").write_text(source_key() + "\n")
        try:
            staging.rename(dest)
        except OSError:  # another process built it first
            shutil.rmtree(staging, ignore_errors=True)
    return dest


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def load() -> ModuleType | None:
    """The compiled ``simulate`` module when a build matches the current source, else None."""
    dest = build_dir()
    if not (dest / "ok").is_file():
        return None
    if str(dest) not in sys.path:
        sys.path.insert(0, str(dest))
    try:
        return importlib.import_module(f"{PACKAGE}.cluster")
    except ImportError:
        return None
