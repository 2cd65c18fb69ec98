"""What the API server does with a KVServing before the operator sees it,
done offline: structural defaulting, OpenAPI validation, CEL rules (cel-python).
The checks themselves live in ``kvserving.operator.validate``; this module
adds the repository's CRD and samples.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

# The package's admission code (what `kvserving operator --render` runs) is the one implementation.
from kvserving.operator.validate import apply_defaults, cel_failures, openapi_errors, to_cel, unknown_fields

__all__ = [
    "REPO",
    "CRD_PATH",
    "SAMPLES",
    "load_crd",
    "root_schema",
    "load_sample",
    "admit",
    "apply_defaults",
    "cel_failures",
    "openapi_errors",
    "to_cel",
    "unknown_fields",
]

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "kvserving.yaml"
SAMPLES = {p.stem: p for p in sorted((REPO / "manifests" / "samples").glob("*.yaml"))}


def load_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def root_schema(crd: dict[str, Any] | None = None) -> dict[str, Any]:
    crd = crd or load_crd()
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def load_sample(name: str) -> dict[str, Any]:
    body = yaml.safe_load(SAMPLES[name].read_text())
    body["metadata"].setdefault("namespace", "default")
    return body


def admit(body: dict[str, Any], crd: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """Default the object as the API server would and list every refusal (schema, then CEL)."""
    schema = root_schema(crd)
    defaulted = apply_defaults(schema, body)
    return defaulted, unknown_fields(schema, defaulted) + openapi_errors(schema, defaulted) + cel_failures(schema, defaulted)
