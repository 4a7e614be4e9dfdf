"""Checks a real API server makes on our CRDs and objects, re-done in Python for the tests.

- `structural_problems`: the rules of a structural schema (apiextensions v1) and our own bounds that keep
  the CEL cost estimate finite;
- `apply_defaults`: the API server's defaulting of a schema onto an object;
- `cel_violations`: evaluates every `x-kubernetes-validations` rule with cel-python, adding the list
  functions of Kubernetes' CEL library that the rules use (`sum`, `isSorted`).
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import celpy
import jsonschema
from celpy import celtypes

# Fields of JSONSchemaProps a structural schema may carry (no $ref, definitions, *Of, not, uniqueItems...).
STRUCTURAL_KEYS = {
    "description",
    "type",
    "format",
    "default",
    "enum",
    "nullable",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "required",
    "properties",
    "items",
    "additionalProperties",
    "x-kubernetes-validations",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-map-type",
    "x-kubernetes-int-or-string",
    "x-kubernetes-embedded-resource",
}
TYPES = {"object", "array", "string", "integer", "number", "boolean"}


def structural_problems(node: dict[str, Any], path: str = "") -> list[str]:
    """Everything in `node` (an openAPIV3Schema below the root) a structural schema forbids."""
    problems = [f"{path}: keyword {key!r} not allowed" for key in node if key not in STRUCTURAL_KEYS]
    free_form = node.get("x-kubernetes-preserve-unknown-fields") or node.get("x-kubernetes-int-or-string")
    if node.get("type") not in TYPES and not free_form:
        problems.append(f"{path}: no valid type ({node.get('type')!r})")
    if "properties" in node and "additionalProperties" in node:
        problems.append(f"{path}: properties and additionalProperties together")
    if node.get("additionalProperties") is False:
        problems.append(f"{path}: additionalProperties: false")
    if node.get("type") == "array" and "items" not in node:
        problems.append(f"{path}: array without items")
    if node.get("x-kubernetes-list-type") == "map":
        item = node.get("items", {})
        for key in node.get("x-kubernetes-list-map-keys", []):
            if key not in item.get("required", []) and "default" not in item.get("properties", {}).get(
                key, {}
            ):
                problems.append(f"{path}: list-map key {key!r} is neither required nor defaulted")
    # Unbounded strings and lists make the API server's CEL cost estimate explode.
    if node.get("type") == "string" and not ({"maxLength", "enum"} & node.keys()) and "format" not in node:
        problems.append(f"{path}: string without maxLength or enum")
    if node.get("type") == "array" and "maxItems" not in node:
        problems.append(f"{path}: array without maxItems")
    if node.get("type") == "object" and "additionalProperties" in node and "maxProperties" not in node:
        problems.append(f"{path}: map without maxProperties")
    for name, sub in node.get("properties", {}).items():
        problems += structural_problems(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        problems += structural_problems(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        problems += structural_problems(node["additionalProperties"], f"{path}.*")
    return problems


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """The API server's defaulting: fill missing properties from `default`, then recurse."""
    value = copy.deepcopy(value)
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
    elif isinstance(value, list) and "items" in schema:
        value = [apply_defaults(schema["items"], item) for item in value]
    return value


def all_rules(schema: dict[str, Any]) -> list[str]:
    rules = [v["rule"] for v in schema.get("x-kubernetes-validations", [])]
    for sub in schema.get("properties", {}).values():
        rules += all_rules(sub)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            rules += all_rules(schema[key])
    return rules


def _sum(values: celtypes.ListType) -> Any:
    total: Any = celtypes.IntType(0)
    for item in values:
        total = total + item
    return total


def _is_sorted(values: celtypes.ListType) -> celtypes.BoolType:
    items = list(values)
    return celtypes.BoolType(all(a <= b for a, b in itertools.pairwise(items)))


_ENV = celpy.Environment()
_FUNCTIONS = {"sum": _sum, "isSorted": _is_sorted}


def compile_rule(rule: str) -> Any:
    return _ENV.program(_ENV.compile(rule), functions=_FUNCTIONS)


def cel_violations(schema: dict[str, Any], value: Any, path: str = "", old: Any = None) -> list[str]:
    """`path: message` for each rule that fails on `value` (transition rules only when `old` is given)."""
    found = []
    for validation in schema.get("x-kubernetes-validations", []):
        rule = validation["rule"]
        if "oldSelf" in rule and old is None:
            continue
        activation = {"self": value} if old is None else {"self": value, "oldSelf": old}
        result = compile_rule(rule).evaluate(celpy.json_to_cel(activation))
        if result is not True and result != celtypes.BoolType(True):
            found.append(f"{path}: {validation['message']}")
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                sub_old = old.get(name) if isinstance(old, dict) else None
                found += cel_violations(sub, value[name], f"{path}.{name}" if path else name, sub_old)
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            found += cel_violations(schema["items"], item, f"{path}[{index}]")
    return found


def schema_errors(schema: dict[str, Any], value: Any) -> list[str]:
    """jsonschema errors of `value` as `path: message`. OpenAPI v3.0 schemas are JSON Schema draft 4 in
    the parts we use (boolean exclusiveMinimum); the x-kubernetes-* keywords are ignored here."""
    validator = jsonschema.Draft4Validator(schema)
    return [
        f"{_json_path(error.absolute_path)}: {error.message}"
        for error in sorted(validator.iter_errors(value), key=lambda e: list(map(str, e.absolute_path)))
    ]


def _json_path(parts: Any) -> str:
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path
