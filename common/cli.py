"""The one ``kvserving`` command: each subcommand lives in the module that owns it.

A subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``;
it is imported only when its subcommand runs, so ``kvserving --help`` stays
fast and the operator's image needs no torch to start.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("kvserving.demo", "run the main job on the built-in tiny model"),
    "capacity": ("kvserving.kernels.capacity", "print KV bytes per token and tokens per GPU for each format"),
    "operator": ("kvserving.operator.main", "run the kopf operator"),
    "tiny-model": ("kvserving.worker.tiny_model", "write the built-in tiny model (HF format) to DIR"),
    "generate": ("kvserving.worker.generate", "offline generation with the engine (no server)"),
    "worker": ("kvserving.worker.main", "serve one worker (prefill, decode or both): the worker HTTP API, engine and NIXL agent"),
    "gateway": ("kvserving.gateway.main", "the OpenAI-compatible gateway in front of prefill/decode workers"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserving", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text)
        sub_parser.set_defaults(_module=module_name)
        # Arguments are declared by the owning module, imported lazily here
        # only for the subcommand actually named on the command line.
        if len(sys.argv) > 1 and sys.argv[1] == name:
            importlib.import_module(module_name).add_arguments(sub_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    args = build_parser().parse_args()
    module = importlib.import_module(args._module)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
