"""`kvserving operator`: run the kopf operator with this package's handlers.

    kvserving operator                      # all namespaces (the manifests' default)
    kvserving operator --namespace team-a   # only these namespaces
    kvserving operator --render FILE        # print the children of a KVServing YAML, no cluster
    kvserving operator --print-rbac         # the ClusterRole rules the code needs
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import kopf
import yaml


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", action="append", default=[], help="watch only this namespace (repeatable)")
    parser.add_argument("--liveness-port", type=int, default=8081, help="kopf's /healthz port (0: off)")
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    parser.add_argument("--render", metavar="FILE", help="print the objects rendered for a KVServing manifest and exit")
    parser.add_argument("--print-rbac", action="store_true", help="print the ClusterRole rules the code needs and exit")


def _render(path: str) -> int:
    from kvserving.operator.render import Owner, render

    with open(path) as f:
        body = yaml.safe_load(f)
    meta = body["metadata"]
    owner = Owner(name=meta["name"], namespace=meta.get("namespace", "default"), uid=meta.get("uid", "00000000-render"))
    yaml.safe_dump_all(render(body.get("spec") or {}, owner=owner).objects, sys.stdout, sort_keys=False)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.render:
        return _render(args.render)
    if args.print_rbac:
        from kvserving.operator.rbac import cluster_role_rules

        print(json.dumps(cluster_role_rules(), indent=2))
        return 0
    from kvserving.operator.handlers import registry

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO)
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    kopf.run(
        registry=registry,
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=liveness,
    )
    return 0
