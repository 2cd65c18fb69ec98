"""Kubernetes resource quantities (500m, 1Gi, 2e3) and the resource checks the
API server makes on a pod that CEL in a CRD cannot express (a limit below its
request). Pure."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

# Kubernetes resource quantities: a decimal number with a binary (Ki..Ei),
# decimal (n..E) or exponent suffix.
_QUANTITY = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))((?:[KMGTPE]i)|[numkMGTPE]|(?:[eE][+-]?[0-9]+))?$")
_SUFFIX = {
    "": Decimal(1),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
    **{f"{p}i": Decimal(1024) ** (i + 1) for i, p in enumerate("KMGTPE")},
}


def parse_quantity(value: Any) -> Decimal | None:
    """A resource quantity (``500m``, ``4Gi``, ``1e3``, ``2``) as a number; None if it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return Decimal(value)
    if not isinstance(value, str):
        return None
    m = _QUANTITY.match(value)
    if m is None:
        return None
    number, suffix = m.group(1), m.group(2) or ""
    try:
        if suffix[:1] in ("e", "E"):
            return Decimal(number) * Decimal(10) ** int(suffix[1:])
        return Decimal(number) * _SUFFIX[suffix]
    except (InvalidOperation, KeyError):
        return None


def resources_problems(resources: dict[str, Any], *, where: str) -> list[str]:
    """Every quantity a number, and no limit below its request (as the API server refuses the pod)."""
    problems = []
    requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
    for kind, values in (("requests", requests), ("limits", limits)):
        for name, value in values.items():
            if parse_quantity(value) is None:
                problems.append(f"{where}.{kind}.{name}: {value!r} is not a resource quantity")
    for name, request in requests.items():
        req, lim = parse_quantity(request), parse_quantity(limits.get(name))
        if req is not None and lim is not None and lim < req:
            problems.append(f"{where}.limits.{name}: {limits[name]} is below the request {request}")
    return problems
