"""The one ``kvserving`` command: each subcommand lives in the module that owns it.

A subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``;
it is imported only when its subcommand runs, so ``kvserving --help`` stays
fast and the operator's image needs no torch to start.

Bad input is answered with one line on stderr and a non-zero exit code, never
a traceback: argparse errors exit 2; a ``ValueError`` or ``OSError`` raised by
a subcommand's ``run`` (a library refusing its input at its boundary, a file
that cannot be read or written) exits 1 with ``kvserving CMD: error: ...``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Mapping
from typing import NoReturn

import kvserving

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("kvserving.local.demo", "run the main job on the built-in tiny model"),
    "capacity": ("kvserving.kernels.capacity", "print KV bytes per token and tokens per GPU for each format"),
    "operator": ("kvserving.operator.main", "run the kopf operator"),
    "tiny-model": ("kvserving.worker.model_files", "write the built-in tiny model (HF format) to DIR"),
    "generate": ("kvserving.worker.generate", "offline generation with the engine (no server)"),
    "calibrate": ("kvserving.calibrate.main", "measure KV sensitivity per token class: bits tables per budget and fp8/nvfp4 scales"),
    "config": ("kvserving.config_file", "write the engine-config file (every field, its default) that --config takes"),
    "worker": ("kvserving.worker.main", "serve one worker (prefill, decode or both): the worker HTTP API, engine and NIXL agent"),
    "gateway": ("kvserving.gateway.main", "the OpenAI-compatible gateway in front of prefill/decode workers"),
    "up": ("kvserving.local.up", "local mode: gateway + prefill + decode workers on loopback (the whole product on one machine)"),
    "simulate": ("kvserving.sim.plan", "cluster simulator: agents on N prefill + M decode GPUs, and the GPUs a TTFT p99 needs"),
}


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help where there is a default worth saying
    (not for required flags, off-by-default switches, or help that states its default)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        quiet = default is None or default is False or default == [] or default == argparse.SUPPRESS or action.required
        if quiet or "%(default)" in text or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block)."""

    commands: Mapping[str, argparse.ArgumentParser]  # the top-level parser's subcommand parsers, by name

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(command: str | None = None) -> OneLineParser:
    """The full parser; only ``command``'s module is imported to declare its arguments."""
    formatter = DefaultsHelpFormatter  # every flag's help shows its default
    summary = (kvserving.__doc__ or "kvserving").splitlines()[0]
    parser = OneLineParser(prog="kvserving", description=summary, formatter_class=formatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {kvserving.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text, formatter_class=formatter)
        sub_parser.set_defaults(_module=module_name)
        # Arguments are declared by the owning module, imported lazily here
        # only for the subcommand actually named on the command line.
        if name == command:
            importlib.import_module(module_name).add_arguments(sub_parser)
    parser.commands = sub.choices
    return parser


def describe(exc: BaseException) -> str:
    """One line for an error: the message, with the file name an OSError carries."""
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename is not None else ""
        return f"{exc.strerror}{where}"
    text = " ".join(str(exc).split())  # multi-line messages (jinja, safetensors) on one line
    return text or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command)
    if command is None:  # name a bad flag before asking for the missing command
        unknown = [a for a in argv if a not in ("-h", "--help", "--version")]
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the command whose flags they are not, with that command's help
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:  # an interrupt while an error is being reported is still an interrupt, not a traceback
        try:
            module = importlib.import_module(args._module)
            return int(module.run(args) or 0)
        except (ValueError, OSError) as exc:
            print(f"kvserving {args.command}: error: {describe(exc)}", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        print(f"kvserving {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
