"""``kvserving demo``: the main job on the built-in tiny model.

Today it prints the KV format capacity table; later issues make it start the
serving stack on loopback and run an agent conversation through it.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="KV memory budget in GiB for the table")


def run(args: argparse.Namespace) -> int:
    from kvserving.kernels import capacity

    print(capacity.format_table(capacity.capacity_rows(gpu_bytes=int(args.gpu_gib * 2**30))))
    return 0
