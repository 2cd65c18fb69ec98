"""`kvserving operator`: run the kopf operator with this package's handlers.

    kvserving operator                      # all namespaces (the manifests' default)
    kvserving operator --namespace team-a   # only these namespaces
    kvserving operator --render FILE        # admit a KVServing YAML as the API server would, print its children
    kvserving operator --print-rbac         # the RBAC objects the code needs: a ClusterRole,
                                            # or with --namespace a Role in each namespace

Without credentials (no service account, no kubeconfig) it exits at once with
one line instead of letting kopf retry the login forever.
"""

from __future__ import annotations

import argparse
import importlib.resources
import logging
import sys
from pathlib import Path
from typing import Any

import yaml

from kvserving.argtypes import int_in
from kvserving.operator.validate import DNS1123_LABEL, MAX_LABEL, admit, parse_manifest

CRD_PACKAGE, CRD_FILE = "kvserving.crds", "kvserving.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", action="append", default=[], help="watch only this namespace (repeatable; default: all)")
    parser.add_argument("--liveness-port", type=int_in(0, 65535), default=8081, help="kopf's /healthz port (0: off)")
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--render",
        metavar="FILE",
        type=Path,
        default=None,
        help="admit a KVServing manifest as the API server would, print the objects rendered for it and exit",
    )
    parser.add_argument(
        "--print-rbac",
        action="store_true",
        help="print the RBAC objects the code needs (YAML) and exit: a ClusterRole and binding, "
        "or with --namespace a Role and RoleBinding per namespace",
    )


def load_crd() -> dict[str, Any]:
    """The KVServing CRD shipped with the package (crds/kvserving.yaml)."""
    text = importlib.resources.files(CRD_PACKAGE).joinpath(CRD_FILE).read_text(encoding="utf-8")
    crd: dict[str, Any] = yaml.safe_load(text)
    return crd


def read_manifest(path: Path) -> str:
    if not path.exists():
        raise ValueError(f"{path} does not exist")
    if path.is_dir():
        raise ValueError(f"{path} is a directory, not a KVServing manifest")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a UTF-8 text file, not a KVServing manifest") from None


def render_file(path: Path) -> int:
    """Print the children of the KVServing in ``path``; one stderr line per problem and exit 1 if it is refused."""
    from kvserving.operator.render import Owner, internal_secret_name, render
    from kvserving.operator.spec import INTERNAL_TOKEN_KEY

    admission = admit(parse_manifest(read_manifest(path), source=str(path)), crd=load_crd())
    if admission.problems:
        for problem in admission.problems:
            print(f"kvserving operator: error: {path}: {problem}", file=sys.stderr)
        return 1
    meta = admission.body["metadata"]
    owner = Owner(name=meta["name"], namespace=meta.get("namespace", "default"), uid=meta.get("uid", "00000000-render"))
    print(
        f"# Secret/{internal_secret_name(owner.name)} (key {INTERNAL_TOKEN_KEY!r}): made once by the operator with a random "
        "value, mounted into the gateway and workers below; not printed"
    )
    yaml.safe_dump_all(render(admission.body["spec"], owner=owner).objects, sys.stdout, sort_keys=False)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.render is not None:
        return render_file(args.render)
    for namespace in args.namespace:
        if len(namespace) > MAX_LABEL or not DNS1123_LABEL.fullmatch(namespace):
            raise ValueError(f"--namespace {namespace!r} is not a valid namespace name (a DNS-1123 label)")
    if args.print_rbac:
        from kvserving.operator.rbac import rbac_objects

        yaml.safe_dump_all(rbac_objects(args.namespace), sys.stdout, sort_keys=False)
        return 0
    import kopf

    from kvserving.operator.handlers import registry
    from kvserving.operator.kube import connection_info

    try:
        connection_info(kopf.OperatorSettings())
    except (kopf.LoginError, OSError, ValueError, KeyError, yaml.YAMLError) as exc:
        # kopf would retry the login every minute with a traceback; a missing or broken kubeconfig is not transient.
        if isinstance(exc, OSError):
            reason = f"{exc.strerror}: {exc.filename}"
        elif isinstance(exc, yaml.YAMLError):
            reason = f"the kubeconfig is not valid YAML ({getattr(exc, 'problem', None) or 'parse error'})"
        elif isinstance(exc, KeyError):
            reason = f"the kubeconfig names {exc} but does not define it"
        else:
            reason = str(exc).splitlines()[0]
        print(f"kvserving operator: error: no cluster credentials: {reason} (set KUBECONFIG or run in a pod)", file=sys.stderr)
        return 1
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
