"""The product image's Dockerfile (it cannot be built here: no container
engine): hadolint finds nothing, both targets run as a non-root user with the
`kvserving` entry point, the pins are requirements.txt's and the Makefile's,
and the version label and the images the operator renders follow the package."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvserving import __version__
from kvserving.operator.spec import DEFAULT_IMAGE

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return out


def stages() -> dict[str, list[tuple[str, str]]]:
    found: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for word, rest in instructions():
        if word == "FROM":
            m = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", rest, flags=re.IGNORECASE)
            assert m, f"every stage is named: FROM {rest}"
            current = found.setdefault(m.group(2), [("FROM", m.group(1))])
        elif current is not None:
            current.append((word, rest))
    return found


def _pins(text: str) -> dict[str, str]:
    return dict(re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)", text, flags=re.MULTILINE))


def test_hadolint_finds_nothing() -> None:
    binary = shutil.which("hadolint") or str(Path(__import__("sys").executable).parent / "hadolint")
    if not Path(binary).exists():
        pytest.fail("hadolint is pinned in requirements-dev.txt and must be installed")
    result = subprocess.run([binary, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_both_targets_run_kvserving_as_a_non_root_user() -> None:
    s = stages()
    for target in ("cpu", "gpu"):
        steps = s[target]
        users = [rest for word, rest in steps if word == "USER"]
        assert users and users[-1] not in ("root", "0", "0:0"), target
        assert ("ENTRYPOINT", '["kvserving"]') in steps, target
        assert any(w == "COPY" and "--from=wheel" in r for w, r in steps), target


def test_the_wheel_stage_copies_every_package_folder() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    folders = set(re.findall(r'^"kvserving[.a-z]*" = "(\w+)"', pyproject, flags=re.MULTILINE))
    copied = {rest.split()[0].rstrip("/") for w, rest in stages()["wheel"] if w == "COPY"}
    assert folders and folders <= copied


def test_pins_are_requirements_and_the_makefile_torch() -> None:
    requirements = _pins((REPO / "requirements.txt").read_text())
    text = " ".join(r for _, r in instructions())
    gpu = " ".join(r for w, r in stages()["gpu"] if w == "RUN")
    cpu = " ".join(r for w, r in stages()["cpu"] if w == "RUN")
    assert "-r requirements.txt" in gpu
    assert "-r requirements-cpu.txt" in cpu
    # the CPU image leaves out exactly the GPU stack
    assert re.search(r"grep -v -E '\^\(torch\|triton\|nixl-cu12\)==' requirements.txt", cpu)
    assert {"triton", "nixl-cu12"} <= set(requirements)
    makefile = (REPO / "Makefile").read_text()
    gpu_torch = re.search(r"echo '(torch==[^']+)'", makefile)
    assert gpu_torch and f'"{gpu_torch.group(1)}"' in gpu
    # every other pin in the file (build tools) is the one pyproject builds with
    build = dict(re.findall(r'"([a-z]+)==([^"]+)"', (REPO / "pyproject.toml").read_text()))
    for name, version in re.findall(r'"([a-z]+)==([^"]+)"', text):
        assert version == requirements.get(name, build.get(name, version if name == "torch" else None)), name


def test_version_label_and_rendered_images_follow_the_package() -> None:
    args = dict(r.split("=", 1) for w, r in instructions() if w == "ARG" and "=" in r)
    assert args["VERSION"] == __version__
    assert DEFAULT_IMAGE.endswith(f":{__version__}")
    operator = yaml.safe_load((REPO / "manifests" / "operator.yaml").read_text().split("\n---\n")[-1])
    images = [c["image"] for c in operator["spec"]["template"]["spec"]["containers"]]
    assert images == [f"{DEFAULT_IMAGE}-cpu"]
