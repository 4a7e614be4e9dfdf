"""What the API server does to a custom resource on create or update, done offline.

`modelfleet local up` uses it to refuse a model.yaml the API server would refuse, with the same message;
the tests use it to check examples and the CRDs' own defaults (operator/crd_checks.py checks the CRDs).

`admit(crd, obj, old=None)` prunes unknown fields, applies the schema's defaults, then validates
metadata.name, the OpenAPI schema, list-type map/set uniqueness and the CEL rules; `check_object` returns
the stored object or raises `Invalid` with kubectl's message (`The InferenceModel "chat" is invalid:
spec.replicas: Invalid value: "object": min must be <= max`). The steps are public too: `prune`,
`apply_defaults`, `validate_openapi`, `validate_list_types`, `validate_cel`.

CEL rules run on cel-python (the `local` extra), imported on first use so the operator does not need it.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any

# --- field errors, formatted like k8s.io/apimachinery's field.Error ------------------------------------

INVALID = "Invalid value"
REQUIRED = "Required value"
UNSUPPORTED = "Unsupported value"
FORBIDDEN = "Forbidden"
TOO_LONG = "Too long"
TOO_MANY = "Too many"
DUPLICATE = "Duplicate value"
_NO_VALUE_SHOWN = {REQUIRED, FORBIDDEN, TOO_LONG}
OMIT = object()  # "no bad value to show"


def go_repr(value: Any, nested: bool = False) -> str:
    """A value as Go's fmt prints it in a field error (%v for scalars, %#v for maps and lists)."""
    if value is None:
        return "interface {}(nil)" if nested else "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        items = ", ".join(f"{json.dumps(k)}:{go_repr(value[k], True)}" for k in sorted(value))
        return f"map[string]interface {{}}{{{items}}}"
    if isinstance(value, list):
        return f"[]interface {{}}{{{', '.join(go_repr(v, True) for v in value)}}}"
    return str(value)


@dataclass(frozen=True)
class FieldError:
    """One error of the API server: `path: Type: value: detail`."""

    field: str
    type: str
    value: Any = OMIT
    detail: str = ""

    def __str__(self) -> str:
        body = self.type
        if self.type not in _NO_VALUE_SHOWN and self.value is not OMIT:
            body += f": {go_repr(self.value)}"
        if self.detail:
            body += f": {self.detail}"
        return f"{self.field}: {body}"


def invalid_message(kind: str, name: str, errors: list[FieldError]) -> str:
    """kubectl's message for a 422 Invalid answer."""
    if len(errors) == 1:
        return f'The {kind} "{name}" is invalid: {errors[0]}'
    return f'The {kind} "{name}" is invalid: \n' + "\n".join(f"* {e}" for e in errors)


class Invalid(ValueError):
    """The API server would answer 422; `errors` are the field errors, str() is kubectl's message."""

    def __init__(self, kind: str, name: str, errors: list[FieldError]) -> None:
        super().__init__(invalid_message(kind, name, errors))
        self.errors = errors


def _child(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


# --- custom resources: pruning, defaulting, validation ----------------------------------------------------

_META_FIELDS = ("apiVersion", "kind", "metadata")


def prune(schema: dict[str, Any], value: Any, path: str = "", *, root: bool = True) -> tuple[Any, list[str]]:
    """`value` without the fields the schema does not know, and their paths (kubectl warns about them)."""
    dropped: list[str] = []

    def walk(node: dict[str, Any], val: Any, at: str, is_root: bool) -> Any:
        if isinstance(val, dict) and (node.get("type") == "object" or is_root):
            props = node.get("properties", {})
            extra = node.get("additionalProperties")
            out = {}
            for key, sub in val.items():
                if key in props:
                    keep = is_root and key in _META_FIELDS and not props[key].get("properties")
                    out[key] = sub if keep else walk(props[key], sub, _child(at, key), False)
                elif isinstance(extra, dict):
                    out[key] = walk(extra, sub, _child(at, key), False)
                elif node.get("x-kubernetes-preserve-unknown-fields") or (is_root and key in _META_FIELDS):
                    out[key] = sub
                else:
                    dropped.append(_child(at, key))
            return out
        if isinstance(val, list) and isinstance(node.get("items"), dict):
            return [walk(node["items"], item, f"{at}[{i}]", False) for i, item in enumerate(val)]
        return val

    return walk(schema, copy.deepcopy(value), path, root), dropped


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """The API server's defaulting: missing (or null, non-nullable) properties take their `default`,
    then nested values are defaulted in turn; nulls without a default are dropped."""
    value = copy.deepcopy(value)
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if value.get(name, ...) is None and not sub.get("nullable"):
                del value[name]
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        value = {k: apply_defaults(schema["additionalProperties"], v) for k, v in value.items()}
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [apply_defaults(schema["items"], item) for item in value]
    return value


_JSON_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
}


_TYPE_NAMES = {"null", "object", "array", "string", "integer", "number", "boolean"}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _has_type(schema: dict[str, Any], value: Any) -> bool:
    kind = schema.get("type")
    if value is None:
        return bool(schema.get("nullable")) or (not kind and "x-kubernetes-preserve-unknown-fields" in schema)
    if schema.get("x-kubernetes-int-or-string"):
        return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))
    if not kind:
        return True
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, _JSON_TYPES[kind])


_DATE_TIME = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")
_FORMATS = {"date-time": _DATE_TIME, "date": re.compile(r"^\d{4}-\d{2}-\d{2}$")}


def _is_type_error(error: FieldError) -> bool:
    return (
        isinstance(error.value, str)
        and error.value in _TYPE_NAMES
        and " in body must be of type " in error.detail
    )


def validate_openapi(schema: dict[str, Any], value: Any, path: str = "") -> list[FieldError]:
    """The OpenAPI v3 validation of a (pruned, defaulted) value, with the API server's messages."""
    name = path or "body"
    if not _has_type(schema, value):
        want = "integer or string" if schema.get("x-kubernetes-int-or-string") else schema.get("type")
        got = _json_type(value)
        return [FieldError(path, INVALID, got, f'{name} in body must be of type {want}: "{got}"')]
    if value is None:
        return []
    errors: list[FieldError] = []
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(go_repr(v) for v in schema["enum"])
        errors.append(FieldError(path, UNSUPPORTED, value, f"supported values: {allowed}"))
    if isinstance(value, int | float) and not isinstance(value, bool):
        errors += _number_errors(schema, value, path, name)
    if isinstance(value, str):
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(
                FieldError(path, TOO_LONG, detail=f"may not be more than {schema['maxLength']} bytes")
            )
        if "minLength" in schema and len(value) < schema["minLength"]:
            detail = f"{name} in body should be at least {schema['minLength']} chars long"
            errors.append(FieldError(path, INVALID, value, detail))
        if "pattern" in schema and not re.search(schema["pattern"], value):
            detail = f"{name} in body should match '{schema['pattern']}'"
            errors.append(FieldError(path, INVALID, value, detail))
        pattern = _FORMATS.get(schema.get("format", ""))
        if pattern and not pattern.match(value):
            detail = f'{name} in body must be of type {schema["format"]}: "{value}"'
            errors.append(FieldError(path, INVALID, value, detail))
    if isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            detail = f"must have at most {schema['maxItems']} items"
            errors.append(FieldError(path, TOO_MANY, len(value), detail))
        if "minItems" in schema and len(value) < schema["minItems"]:
            detail = f"{name} in body should have at least {schema['minItems']} items"
            errors.append(FieldError(path, INVALID, len(value), detail))
        if isinstance(schema.get("items"), dict):
            for index, item in enumerate(value):
                errors += validate_openapi(schema["items"], item, f"{path}[{index}]")
    if isinstance(value, dict):
        errors += _object_errors(schema, value, path, name)
    return errors


def _number_errors(schema: dict[str, Any], value: float, path: str, name: str) -> list[FieldError]:
    errors = []
    if "maximum" in schema:
        top, strict = schema["maximum"], schema.get("exclusiveMaximum", False)
        if value > top or (strict and value == top):
            detail = f"{name} in body should be less than {'' if strict else 'or equal to '}{top}"
            errors.append(FieldError(path, INVALID, value, detail))
    if "minimum" in schema:
        low, strict = schema["minimum"], schema.get("exclusiveMinimum", False)
        if value < low or (strict and value == low):
            detail = f"{name} in body should be greater than {'' if strict else 'or equal to '}{low}"
            errors.append(FieldError(path, INVALID, value, detail))
    if schema.get("multipleOf") and (value / schema["multipleOf"]) % 1:
        errors.append(
            FieldError(path, INVALID, value, f"{name} in body should be a multiple of {schema['multipleOf']}")
        )
    return errors


def _object_errors(schema: dict[str, Any], value: dict[str, Any], path: str, name: str) -> list[FieldError]:
    errors = [
        FieldError(_child(path, req), REQUIRED) for req in schema.get("required", []) if req not in value
    ]
    if "maxProperties" in schema and len(value) > schema["maxProperties"]:
        detail = f"must have at most {schema['maxProperties']} items"
        errors.append(FieldError(path, TOO_MANY, len(value), detail))
    if "minProperties" in schema and len(value) < schema["minProperties"]:
        detail = f"{name} in body should have at least {schema['minProperties']} properties"
        errors.append(FieldError(path, INVALID, len(value), detail))
    props = schema.get("properties", {})
    extra = schema.get("additionalProperties")
    for key, sub in value.items():
        if key in props:
            errors += validate_openapi(props[key], sub, _child(path, key))
        elif isinstance(extra, dict):
            errors += validate_openapi(extra, sub, _child(path, key))
    return errors


def validate_list_types(schema: dict[str, Any], value: Any, path: str = "") -> list[FieldError]:
    """Duplicate keys of x-kubernetes-list-type map lists and duplicate items of set lists."""
    errors: list[FieldError] = []
    if isinstance(value, list):
        kind = schema.get("x-kubernetes-list-type")
        seen: list[Any] = []
        for index, item in enumerate(value):
            if kind == "map" and isinstance(item, dict):
                key = {k: item.get(k) for k in schema.get("x-kubernetes-list-map-keys", [])}
            elif kind == "set":
                key = item
            else:
                continue
            if key in seen:
                errors.append(FieldError(f"{path}[{index}]", DUPLICATE, key))
            seen.append(key)
        if isinstance(schema.get("items"), dict):
            for index, item in enumerate(value):
                errors += validate_list_types(schema["items"], item, f"{path}[{index}]")
    elif isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, sub in value.items():
            sub_schema = props.get(key, extra if isinstance(extra, dict) else None)
            if sub_schema is not None:
                errors += validate_list_types(sub_schema, sub, _child(path, key))
    return errors


# --- CEL -------------------------------------------------------------------------------------------------

_MISSING = object()
_REASONS = {
    "FieldValueInvalid": INVALID,
    "FieldValueForbidden": FORBIDDEN,
    "FieldValueRequired": REQUIRED,
    "FieldValueDuplicate": DUPLICATE,
}


class Cel:
    """cel-python, loaded on first use, with the functions of Kubernetes' CEL libraries that we use."""

    _instance: Cel | None = None

    def __init__(self) -> None:
        try:
            import celpy
            from celpy import celtypes
        except ImportError as exc:  # pragma: no cover - depends on the installation
            raise ImportError(
                "evaluating CEL rules needs cel-python: pip install 'modelfleet[local]'"
            ) from exc
        self.celpy, self.celtypes = celpy, celtypes
        self.env = celpy.Environment()
        self.functions = {
            "sum": self._sum,
            "isSorted": lambda values: celtypes.BoolType(all(a <= b for a, b in itertools.pairwise(values))),
        }
        self.programs: dict[str, Any] = {}

    @classmethod
    def get(cls) -> Cel:
        if cls._instance is None:
            cls._instance = Cel()
        return cls._instance

    def _sum(self, values: Any) -> Any:
        total: Any = self.celtypes.IntType(0)
        for item in values:
            total = total + item
        return total

    def parse(self, rule: str) -> Any:
        """The lark tree of `rule`; raises ValueError with the parser's message."""
        try:
            return self.env.compile(rule)
        except self.celpy.CELParseError as exc:
            raise ValueError(" ".join(str(exc).split())) from None

    def evaluate(self, rule: str, activation: dict[str, Any]) -> Any:
        """The rule's result, or an Exception (its evaluation error)."""
        if rule not in self.programs:
            self.programs[rule] = self.env.program(self.parse(rule), functions=self.functions)
        try:
            return self.programs[rule].evaluate(self.celpy.json_to_cel(activation))
        except self.celpy.CELEvalError as exc:
            return exc


def _cel_error_text(exc: Exception) -> str:
    """cel-python's evaluation error in cel-go's words where they differ."""
    text = str(exc.args[0]) if exc.args else str(exc)
    found = re.match(r"no such member in mapping: '(.*)'", text)
    return f"no such key: {found.group(1)}" if found else text


def _uses_old_self(rule: str) -> bool:
    return re.search(r"\boldSelf\b", rule) is not None


def as_declared(schema: dict[str, Any], value: Any) -> Any:
    """`value` with the integers of `number` fields as floats: CEL sees the declared type (double), as the
    API server gives it, so `self.fraction <= 1.0` holds for `fraction: 1`."""
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        return {
            k: as_declared(props.get(k, extra if isinstance(extra, dict) else {}), v)
            for k, v in value.items()
        }
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [as_declared(schema["items"], item) for item in value]
    return value


def validate_cel(schema: dict[str, Any], value: Any, path: str = "", old: Any = _MISSING) -> list[FieldError]:
    """Every x-kubernetes-validations rule in scope, on `value` as it is (the caller defaults first).
    Transition rules (oldSelf) run only where an old value correlates, as on an update."""
    old = old if old is _MISSING else as_declared(schema, old)
    return _validate_cel(schema, as_declared(schema, value), path, old)


def _validate_cel(schema: dict[str, Any], value: Any, path: str, old: Any) -> list[FieldError]:
    errors: list[FieldError] = []
    for rule in schema.get("x-kubernetes-validations", []):
        uses_old = _uses_old_self(rule["rule"])
        if uses_old and old is _MISSING:
            continue
        activation = {"self": value, "oldSelf": old} if uses_old else {"self": value}
        result = Cel.get().evaluate(rule["rule"], activation)
        where = path + rule.get("fieldPath", "")
        kind = schema.get("type", "object")
        if isinstance(result, Exception):
            text = f"{_cel_error_text(result)} evaluating rule: {rule.get('message') or rule['rule']}"
            errors.append(FieldError(where, INVALID, kind, text.strip()))
        elif result is not True and result != Cel.get().celtypes.BoolType(True):
            message = rule.get("message") or f"failed rule: {rule['rule']}"
            if rule.get("messageExpression"):
                custom = Cel.get().evaluate(rule["messageExpression"], activation)
                message = custom if isinstance(custom, str) and custom.strip() else message
            error_type = _REASONS.get(rule.get("reason", "FieldValueInvalid"), INVALID)
            errors.append(FieldError(where, error_type, kind, message.strip()))
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        correlates = isinstance(old, dict) and schema.get("x-kubernetes-map-type") != "atomic"
        for key, sub in value.items():
            sub_schema = props.get(key, extra if isinstance(extra, dict) else None)
            if sub_schema is not None:
                sub_old = old.get(key, _MISSING) if correlates else _MISSING
                errors += _validate_cel(sub_schema, sub, _child(path, key), sub_old)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        keys = schema.get("x-kubernetes-list-map-keys", [])
        by_key = {}
        if schema.get("x-kubernetes-list-type") == "map" and isinstance(old, list):
            by_key = {json.dumps([o.get(k) for k in keys]): o for o in old if isinstance(o, dict)}
        for index, item in enumerate(value):
            item_key = json.dumps([item.get(k) for k in keys]) if isinstance(item, dict) else None
            errors += _validate_cel(schema["items"], item, f"{path}[{index}]", by_key.get(item_key, _MISSING))
    return errors


# --- whole custom resources -------------------------------------------------------------------------------

DNS1123_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"


def subdomain_errors(name: str) -> list[str]:
    found = []
    if len(name) > 253:
        found.append("must be no more than 253 characters")
    if not re.fullmatch(DNS1123_SUBDOMAIN, name):
        found.append(
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
            "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for "
            f"validation is '{DNS1123_SUBDOMAIN}')"
        )
    return found


def version_schema(crd: dict[str, Any], version: str | None = None) -> dict[str, Any]:
    """openAPIV3Schema of `version` (default: the storage version)."""
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version or (version is None and entry.get("storage")):
            return entry["schema"]["openAPIV3Schema"]
    raise KeyError(f"{crd['metadata']['name']} has no version {version!r}")


@dataclass
class Admission:
    """What the API server would store (`object`), or why not (`errors`); `warnings` name pruned fields."""

    object: dict[str, Any]
    errors: list[FieldError] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def admit(crd: dict[str, Any], obj: dict[str, Any], old: dict[str, Any] | None = None) -> Admission:
    """A create (or, with `old`, an update) of a custom resource of `crd`, as the API server does it."""
    spec = crd["spec"]
    group, kind = spec["group"], spec["names"]["kind"]
    served = [v["name"] for v in spec["versions"] if v.get("served")]
    api_version = obj.get("apiVersion", "")
    errors: list[FieldError] = []
    if obj.get("kind") != kind or api_version not in [f"{group}/{v}" for v in served]:
        supported = [f"{group}/{v}" for v in served]
        errors.append(
            FieldError("apiVersion", UNSUPPORTED, api_version, f"kind {kind} is served as {supported}")
        )
        return Admission(obj, errors)
    schema = version_schema(crd, api_version.split("/", 1)[1])
    pruned, dropped = prune(schema, obj)
    defaulted = apply_defaults(schema, pruned)
    warnings = [f'unknown field "{path}"' for path in dropped]
    metadata = defaulted.get("metadata") if isinstance(defaulted.get("metadata"), dict) else {}
    name = metadata.get("name")
    if not name and not metadata.get("generateName"):
        errors.append(FieldError("metadata.name", REQUIRED, detail="name or generateName is required"))
    elif name:
        errors += [FieldError("metadata.name", INVALID, name, e) for e in subdomain_errors(name)]
    errors += validate_openapi(schema, defaulted)
    errors += validate_list_types(schema, defaulted)
    # Like the API server: CEL does not run on a value of the wrong type.
    if not any(_is_type_error(e) for e in errors):
        old_value = _MISSING if old is None else apply_defaults(schema, prune(schema, old)[0])
        errors += validate_cel(schema, defaulted, "", old_value)
    return Admission(defaulted, errors, warnings)


def check_object(
    crd: dict[str, Any], obj: dict[str, Any], old: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The object the API server would store; raises `Invalid` with kubectl's message otherwise."""
    result = admit(crd, obj, old)
    if result.errors:
        name = (obj.get("metadata") or {}).get("name") or ""
        raise Invalid(crd["spec"]["names"]["kind"], name, result.errors)
    return result.object
