"""What the API server does with a KVServing before the operator sees it,
done offline: structural defaulting, OpenAPI validation, CEL rules (cel-python).

Kubernetes types CEL values by the schema (an OpenAPI ``number`` is always a
double, even when the YAML says ``3``), so values are converted by the schema
too, not by their Python type.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml
from celpy import celtypes

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


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting: a missing field with a default gets it, then its own fields are defaulted."""
    value = copy.deepcopy(value)
    if isinstance(value, dict) and schema.get("type") == "object":
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                if key not in (schema.get("properties") or {}):
                    value[key] = apply_defaults(extra, value[key])
    elif isinstance(value, list) and "items" in schema:
        value = [apply_defaults(schema["items"], v) for v in value]
    return value


def openapi_errors(schema: dict[str, Any], value: Any) -> list[str]:
    """JSON-schema validation of the OpenAPI v3 subset (x-kubernetes-* keywords are ignored)."""
    validator = jsonschema.Draft4Validator(schema)
    return sorted(f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(value))


def to_cel(schema: dict[str, Any], value: Any) -> Any:
    kind = schema.get("type")
    if schema.get("x-kubernetes-int-or-string"):
        return celtypes.IntType(value) if isinstance(value, int) else celtypes.StringType(value)
    if kind == "object" and isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        out = {}
        for key, item in value.items():
            sub = props.get(key) or (extra if isinstance(extra, dict) else None)
            out[celtypes.StringType(key)] = to_cel(sub, item) if sub else celpy.json_to_cel(item)
        return celtypes.MapType(out)
    if kind == "array":
        return celtypes.ListType([to_cel(schema.get("items", {}), v) for v in value])
    if kind == "number":
        return celtypes.DoubleType(float(value))
    if kind == "integer":
        return celtypes.IntType(value)
    if kind == "boolean":
        return celtypes.BoolType(value)
    if kind == "string":
        return celtypes.StringType(value)
    return celpy.json_to_cel(value)


_ENV = celpy.Environment()


def cel_failures(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Messages of every x-kubernetes-validations rule that does not hold, as the API server reports them."""
    failures = []
    for rule in schema.get("x-kubernetes-validations") or []:
        program = _ENV.program(_ENV.compile(rule["rule"]))
        result = program.evaluate({"self": to_cel(schema, value)})
        if isinstance(result, Exception) or not bool(result):
            failures.append(f"{path or '<root>'}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for key, item in value.items():
            if key in props:
                failures += cel_failures(props[key], item, f"{path}.{key}" if path else key)
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            failures += cel_failures(schema["items"], item, f"{path}[{i}]")
    return failures


def unknown_fields(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Fields the structural schema does not know: the API server would prune them (kubectl: strict field validation)."""
    found = []
    if isinstance(value, dict) and schema.get("type") == "object" and "properties" in schema:
        props = schema["properties"]
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            if key in props:
                found += unknown_fields(props[key], item, where)
            elif not isinstance(schema.get("additionalProperties"), dict):
                found.append(f"{where}: unknown field")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += unknown_fields(schema["items"], item, f"{path}[{i}]")
    return found


def admit(body: dict[str, Any], crd: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """Default the object as the API server would and list every refusal (schema, then CEL)."""
    schema = root_schema(crd)
    defaulted = apply_defaults(schema, body)
    return defaulted, unknown_fields(schema, defaulted) + openapi_errors(schema, defaulted) + cel_failures(schema, defaulted)
