"""Admission of a KVServing manifest, offline: what the API server does before the operator sees it.

``kvserving operator --render FILE`` runs this first, so a manifest it renders
is one ``kubectl apply`` accepts (strict field validation), and one it refuses
is answered with one line per problem:

    parse_manifest   YAML text -> one object (empty, list, several documents refused)
    admit            identity (apiVersion/kind), names (DNS-1035/1123), then the
                     CRD's structural schema: defaults, unknown fields, OpenAPI
                     types and bounds, CEL rules (x-kubernetes-validations)
    operator_problems  what parse_spec refuses beyond the CRD, e.g. a container's
                     limits below its requests (operator/quantity.py: CEL in a
                     CRD cannot compare quantities such as 500m and 1)

Kubernetes types CEL values by the schema (an OpenAPI ``number`` is always a
double, even when the YAML says ``3``), so values are converted by the schema,
not by their Python type. Pure: the CRD comes in as a dict.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import celpy
import jsonschema
import yaml
from celpy import celtypes

from kvserving.operator.names import GROUP, KIND, VERSION
from kvserving.operator.spec import parse_spec

# A KVServing's name prefixes its Services' names (NAME-prefill): a DNS-1035 label.
DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
MAX_LABEL = 63
# ObjectMeta's fields: strict field validation refuses any other key under metadata.
OBJECT_META_FIELDS = frozenset(
    {
        "name",
        "generateName",
        "namespace",
        "labels",
        "annotations",
        "uid",
        "resourceVersion",
        "generation",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "ownerReferences",
        "finalizers",
        "managedFields",
        "selfLink",
    }
)


@dataclass(slots=True, frozen=True)
class Admission:
    """The object as the API server would store it (defaults applied) and every refusal."""

    body: dict[str, Any]
    problems: tuple[str, ...]


def parse_manifest(text: str, *, source: str) -> dict[str, Any]:
    """The one YAML object in ``text``; ValueError (one line, naming ``source``) otherwise."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"{source} is not valid YAML{where}: {problem}") from None
    if not docs:
        raise ValueError(f"{source} is empty: expected one KVServing object")
    if len(docs) > 1:
        raise ValueError(f"{source} holds {len(docs)} YAML documents: expected one KVServing object")
    (doc,) = docs
    if not isinstance(doc, dict):
        raise ValueError(f"{source} holds a YAML {_yaml_kind(doc)}, not a KVServing object")
    return doc


def admit(body: dict[str, Any], *, crd: dict[str, Any]) -> Admission:
    """Default ``body`` by the CRD's schema and list every refusal, as the API server would."""
    api_version = f"{GROUP}/{VERSION}"
    if body.get("apiVersion") != api_version or body.get("kind") != KIND:
        found = f"{body.get('kind') or '(no kind)'} ({body.get('apiVersion') or 'no apiVersion'})"
        return Admission(body, (f"the manifest is a {found}, not a {KIND} ({api_version})",))
    problems = metadata_problems(body.get("metadata"))
    if problems:
        return Admission(body, tuple(problems))
    schema = root_schema(crd)
    defaulted = apply_defaults(schema, body)
    problems = unknown_fields(schema, defaulted) + openapi_errors(schema, defaulted)
    if not problems:
        # The API server evaluates CEL rules only on values of the schema's types.
        problems = cel_failures(schema, defaulted)
    if not problems:
        problems = operator_problems(defaulted.get("spec") or {})
    return Admission(defaulted, tuple(problems))


def operator_problems(spec: dict[str, Any]) -> list[str]:
    """What the operator refuses beyond the CRD (it reports these as InvalidSpec)."""
    try:
        parse_spec(spec)
    except ValueError as exc:
        return [str(exc)]
    return []


def root_schema(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == VERSION]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def metadata_problems(metadata: Any) -> list[str]:
    """ObjectMeta fields only, string labels and annotations, metadata.name a DNS-1035 label
    (its children's Service names start with it), namespace a DNS-1123 label."""
    if not isinstance(metadata, dict) or not isinstance(metadata.get("name"), str) or not metadata["name"]:
        return ["metadata.name: required"]
    problems = [f"metadata.{key}: unknown field" for key in metadata if key not in OBJECT_META_FIELDS]
    for field in ("labels", "annotations"):
        value = metadata.get(field)
        if value is not None and not (isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())):
            problems.append(f"metadata.{field}: must map strings to strings (quote numbers and booleans)")
    name = metadata["name"]
    if len(name) > MAX_LABEL or not DNS1035_LABEL.fullmatch(name):
        problems.append(
            f"metadata.name: {name!r} is not a DNS-1035 label (lowercase letters, digits and '-', starting with a "
            f"letter, ending with a letter or digit, at most {MAX_LABEL} characters): the Services are named after it"
        )
    namespace = metadata.get("namespace")
    if namespace is not None and (not isinstance(namespace, str) or len(namespace) > MAX_LABEL or not DNS1123_LABEL.fullmatch(namespace)):
        problems.append(
            f"metadata.namespace: {namespace!r} is not a DNS-1123 label (lowercase letters, digits and '-', "
            f"starting and ending with a letter or digit, at most {MAX_LABEL} characters)"
        )
    return problems


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting: a null field that is not nullable is dropped (as the API server
    prunes it), a missing field with a default gets it, then its own fields are defaulted."""
    value = copy.deepcopy(value)
    if isinstance(value, dict) and schema.get("type") == "object":
        for key, sub in (schema.get("properties") or {}).items():
            if key in value and value[key] is None and not sub.get("nullable"):
                del value[key]
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


def unknown_fields(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Fields the structural schema does not know (the API server prunes them; kubectl's strict validation refuses)."""
    found = []
    if isinstance(value, dict) and schema.get("type") == "object" and "properties" in schema:
        props = schema["properties"]
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if key in props:
                found += unknown_fields(props[key], item, where)
            elif not isinstance(schema.get("additionalProperties"), dict):
                found.append(f"{where}: unknown field")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += unknown_fields(schema["items"], item, f"{path}[{i}]")
    return found


def openapi_errors(schema: dict[str, Any], value: Any) -> list[str]:
    """JSON-schema validation of the OpenAPI v3 subset (x-kubernetes-* keywords are ignored)."""
    validator = jsonschema.Draft4Validator(schema)
    return sorted(f"{'.'.join(map(str, e.path)) or '<root>'}: {e.message}" for e in validator.iter_errors(value))


def cel_failures(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Messages of every x-kubernetes-validations rule that does not hold, as the API server reports them."""
    failures = []
    for rule in schema.get("x-kubernetes-validations") or []:
        result = _program(rule["rule"]).evaluate({"self": to_cel(schema, value)})
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


def to_cel(schema: dict[str, Any], value: Any) -> Any:
    """A JSON value as the CEL value its schema type says (numbers are doubles, integers ints)."""
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
    if kind == "array" and isinstance(value, list):
        return celtypes.ListType([to_cel(schema.get("items", {}), v) for v in value])
    if kind == "number" and isinstance(value, int | float) and not isinstance(value, bool):
        return celtypes.DoubleType(float(value))
    if kind == "integer" and isinstance(value, int) and not isinstance(value, bool):
        return celtypes.IntType(value)
    if kind == "boolean" and isinstance(value, bool):
        return celtypes.BoolType(value)
    if kind == "string" and isinstance(value, str):
        return celtypes.StringType(value)
    # A value of the wrong type: the OpenAPI check reports it; CEL sees it as JSON.
    return celpy.json_to_cel(value)


_ENV = celpy.Environment()


@lru_cache(maxsize=None)
def _program(rule: str) -> Any:
    return _ENV.program(_ENV.compile(rule))


def _yaml_kind(value: Any) -> str:
    if isinstance(value, list):
        return "list"
    if isinstance(value, str):
        return "string"
    return type(value).__name__
