"""The commands the operator puts into its pods exist: every ``kvserving ...``
container command that ``operator/render.py`` emits parses with the CLI's own
parser (issue 10, "Rendered commands exist").

Every rendered subcommand must be registered in ``kvserving.cli.COMMANDS``
(``worker`` and ``gateway`` now are; the skip that waited for them is gone)
and its rendered flags must parse. Also: every flag of every registered command
has help text, the help shows the defaults, and the README and docs/design.md
link only to documents inside the repository.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvserving.cli import COMMANDS, build_parser
from kvserving.operator.render import Owner, render

SAMPLES = sorted((Path(__file__).resolve().parents[1] / "manifests" / "samples").glob("*.yaml"))


def rendered_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after `kvserving`) for every container of every Deployment the samples render."""
    found = []
    for path in SAMPLES:
        body = yaml.safe_load(path.read_text())
        owner = Owner(name=body["metadata"]["name"], namespace="default", uid="uid-1")
        for obj in render(body.get("spec") or {}, owner=owner).objects:
            if obj["kind"] != "Deployment":
                continue
            for container in obj["spec"]["template"]["spec"]["containers"]:
                assert container["command"] == ["kvserving"], container["command"]
                found.append((f"{path.stem}: {obj['metadata']['name']}", list(container["args"])))
    return found


COMMAND_LINES = rendered_commands()


def test_the_samples_render_worker_and_gateway_commands() -> None:
    assert {argv[0] for _, argv in COMMAND_LINES} == {"worker", "gateway"}
    assert len(COMMAND_LINES) == 3 * len(SAMPLES)  # prefill, decode, gateway


@pytest.mark.parametrize(("where", "argv"), COMMAND_LINES, ids=[w for w, _ in COMMAND_LINES])
def test_rendered_command_parses(where: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    command = argv[0]
    assert command in COMMANDS, f"{where}: the operator renders `kvserving {command}`, which the CLI does not have"
    try:
        args = build_parser(command).parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: `kvserving {' '.join(argv)}` is refused by the CLI (exit {exc.code}): {capsys.readouterr().err}")
    assert args.command == command
    # Every rendered --flag VALUE pair landed in the attribute argparse derives from the flag.
    for flag, value in zip(argv[1::2], argv[2::2]):
        assert flag.startswith("--"), argv
        parsed: Any = getattr(args, flag[2:].replace("-", "_"))
        assert str(parsed) == value, (flag, parsed, value)


def _sub_parser(command: str) -> argparse.ArgumentParser:
    parser = build_parser(command)
    (sub_action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    sub: argparse.ArgumentParser = sub_action.choices[command]
    return sub


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_has_help_and_shows_its_default(command: str) -> None:
    sub = _sub_parser(command)
    actions = [a for a in sub._actions if not isinstance(a, argparse._HelpAction)]
    missing = [a.option_strings or [a.dest] for a in actions if not a.help or a.help == argparse.SUPPRESS]
    assert missing == [], f"kvserving {command}: flags without help text"
    text = " ".join(sub.format_help().split())
    for action in actions:
        default = action.default
        if not action.option_strings or action.required or default is None or default is False or default == []:
            continue  # nothing to show: required, off-by-default switch, no value
        stated = "default" in (action.help or "")
        assert stated or f"(default: {default})" in text, (command, action.option_strings)


def test_readme_and_design_links_stay_inside_the_repository() -> None:
    # A plain clone has no ../shared/: every document the README points to is in the repo.
    root = Path(__file__).resolve().parents[1]
    for doc in (root / "README.md", root / "docs" / "design.md"):
        text = doc.read_text()
        assert "../shared" not in text, doc.name
        for target in re.findall(r"\]\(([^)#]+)\)", text):
            if not target.startswith(("http://", "https://")):
                assert (doc.parent / target).exists(), (doc.name, target)
