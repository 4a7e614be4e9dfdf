"""What the API server checks when a CRD is created, done offline, plus this project's stricter rules.

`crd_errors(crd)` mirrors apiextensions' CRD validation: names, versions, printer columns, the scale
subresource, the structural schema and its x-kubernetes-* extensions, CEL rules (parsed, fields checked
against the schema, oldSelf only where old and new values correlate) and every default, validated as
written (pruned, OpenAPI, CEL). The errors read like the API server's; `check_crd` raises them as
kubectl prints them. `project_problems(crd)` adds our own rules. tests/operator/test_crd_checks.py says
which API server checks are mirrored and which are not. Needs cel-python (the `local` extra).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from modelfleet.operator.schema_checks import (
    FORBIDDEN,
    INVALID,
    OMIT,
    REQUIRED,
    UNSUPPORTED,
    Cel,
    FieldError,
    Invalid,
    apply_defaults,
    prune,
    subdomain_errors,
    validate_cel,
    validate_openapi,
)

# The keywords of a structural schema we accept. The API server also takes anyOf/allOf/oneOf/not with
# value validations only; our generator never needs them, so they are refused here (stricter).
STRUCTURAL_KEYS = {
    "description", "type", "format", "default", "enum", "nullable", "title", "example", "externalDocs",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "minLength", "maxLength", "pattern", "minItems", "maxItems", "minProperties", "maxProperties",
    "required", "properties", "items", "additionalProperties",
    "x-kubernetes-validations", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
    "x-kubernetes-preserve-unknown-fields", "x-kubernetes-map-type", "x-kubernetes-int-or-string",
    "x-kubernetes-embedded-resource",
}  # fmt: skip
UNSUPPORTED_KEYS = {"id", "additionalItems", "patternProperties", "definitions", "dependencies", "$ref"}
TYPES = ["array", "boolean", "integer", "number", "object", "string"]
COLUMN_TYPES = ["boolean", "date", "integer", "number", "string"]
COLUMN_FORMATS = ["byte", "date", "date-time", "double", "float", "int32", "int64", "password"]
REASONS = ["FieldValueDuplicate", "FieldValueForbidden", "FieldValueInvalid", "FieldValueRequired"]
# What the root of a schema may hold when the status subresource is on.
ROOT_KEYS = {
    "description", "type", "format", "title", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "maxItems", "minItems", "multipleOf", "required", "items",
    "properties", "externalDocs", "example", "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-validations",
}  # fmt: skip
META_FIELDS = ("apiVersion", "kind", "metadata")
DNS1035_LABEL = r"[a-z]([-a-z0-9]*[a-z0-9])?"


def _invalid(at: str, value: Any, detail: str) -> FieldError:
    return FieldError(at, INVALID, value, detail)


def _required(at: str, detail: str = "") -> FieldError:
    return FieldError(at, REQUIRED, OMIT, detail)


def _forbidden(at: str, detail: str) -> FieldError:
    return FieldError(at, FORBIDDEN, OMIT, detail)


def _unsupported(at: str, value: Any, allowed: list[str]) -> FieldError:
    return FieldError(at, UNSUPPORTED, value, "supported values: " + ", ".join(f'"{a}"' for a in allowed))


def _invalid_or_required(at: str, value: Any, detail: str) -> FieldError:
    return _invalid(at, value, detail) if value else _required(at, detail)


def label_errors(name: str) -> list[str]:
    """IsDNS1035Label: what names, short names, categories and version names must be."""
    found = ["must be no more than 63 characters"] if len(name) > 63 else []
    if not re.fullmatch(DNS1035_LABEL, name):
        found.append(
            "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
            "alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', "
            f"regex used for validation is '{DNS1035_LABEL}')"
        )
    return found


# --- the CRD object ---------------------------------------------------------------------------------------


def crd_errors(crd: dict[str, Any]) -> list[FieldError]:
    """What the API server's validation of a CRD create would report (the part that can run offline)."""
    spec = crd.get("spec", {})
    names = spec.get("names", {})
    name = crd.get("metadata", {}).get("name", "")
    problems = subdomain_errors(name)
    if name != f"{names.get('plural')}.{spec.get('group')}":
        problems.append('must be spec.names.plural+"."+spec.group')
    errors = [_invalid("metadata.name", name, p) for p in problems]
    group = spec.get("group", "")
    if not group:
        errors.append(_required("spec.group"))
    elif subdomain_errors(group) or "." not in group:
        detail = ",".join(subdomain_errors(group)) or "should be a domain with at least one dot"
        errors.append(_invalid("spec.group", group, detail))
    if spec.get("scope") not in ("Cluster", "Namespaced"):
        errors.append(_unsupported("spec.scope", spec.get("scope"), ["Cluster", "Namespaced"]))
    if spec.get("preserveUnknownFields"):
        detail = "must be false in order to use defaults in the schema"
        errors.append(_invalid("spec.preserveUnknownFields", True, detail))
    errors += _names_errors(names)
    errors += _versions_errors(spec.get("versions", []))
    unique: dict[str, FieldError] = {}  # a schema shared by all versions is reported once, as the API does
    for error in errors:
        unique.setdefault(str(error), error)
    return list(unique.values())


def check_crd(crd: dict[str, Any]) -> None:
    """Raise `Invalid` with kubectl's message where the API server would refuse `crd`."""
    errors = crd_errors(crd)
    if errors:
        raise Invalid("CustomResourceDefinition", crd.get("metadata", {}).get("name", ""), errors)


def _names_errors(names: dict[str, Any]) -> list[FieldError]:
    at = "spec.names"
    errors = [_required(f"{at}.{k}") for k in ("plural", "singular", "kind", "listKind") if not names.get(k)]
    for key in ("plural", "singular"):
        errors += [_invalid(f"{at}.{key}", names[key], e) for e in label_errors(names.get(key) or "a")]
    for key in ("kind", "listKind"):
        if found := label_errors((names.get(key) or "a").lower()):
            detail = "may have mixed case, but should otherwise match: " + ",".join(found)
            errors.append(_invalid(f"{at}.{key}", names[key], detail))
    for key in ("shortNames", "categories"):
        for index, value in enumerate(names.get(key, [])):
            errors += [_invalid(f"{at}.{key}[{index}]", value, e) for e in label_errors(value)]
    if names.get("kind") and names.get("kind") == names.get("listKind"):
        errors.append(_invalid(f"{at}.listKind", names["listKind"], "kind and listKind may not be the same"))
    return errors


def _shared(versions: list[dict[str, Any]], key: str) -> bool:
    """The API server lifts a per-version field every version sets alike to the top level, and reports
    its errors there (spec.validation, spec.subresources, spec.additionalPrinterColumns)."""
    values = [v.get(key) for v in versions]
    return bool(values) and all(v and v == values[0] for v in values)


def _versions_errors(versions: list[dict[str, Any]]) -> list[FieldError]:
    names = [v.get("name", "") for v in versions]
    errors = []
    if len(set(names)) != len(names):
        errors.append(_invalid("spec.versions", OMIT, "must contain unique version names"))
    if sum(1 for v in versions if v.get("storage")) != 1:
        errors.append(
            _invalid("spec.versions", OMIT, "must have exactly one version marked as storage version")
        )
    for index, version in enumerate(versions):
        at = f"spec.versions[{index}]"
        errors += [_invalid(f"{at}.name", names[index], e) for e in label_errors(names[index])]
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        if schema is None:
            errors.append(_required(f"{at}.schema.openAPIV3Schema", "schemas are required"))
            continue
        schema_at = "spec.validation" if _shared(versions, "schema") else f"{at}.schema"
        status_on = "status" in (version.get("subresources") or {})
        errors += schema_errors(schema, f"{schema_at}.openAPIV3Schema", status_subresource=status_on)
        columns_at = "spec" if _shared(versions, "additionalPrinterColumns") else at
        for col, column in enumerate(version.get("additionalPrinterColumns", [])):
            errors += _column_errors(column, f"{columns_at}.additionalPrinterColumns[{col}]")
        scale = (version.get("subresources") or {}).get("scale")
        if scale is not None:
            sub_at = "spec" if _shared(versions, "subresources") else at
            errors += _scale_errors(scale, f"{sub_at}.subresources.scale")
    return errors


def _simple_json_path_errors(path: str, at: str) -> list[FieldError]:
    if not path.startswith("."):
        return [_invalid(at, path, "must be a simple json path starting with .")]
    return []


def _column_errors(column: dict[str, Any], at: str) -> list[FieldError]:
    errors = [] if column.get("name") else [_required(f"{at}.name")]
    kinds = f"must be one of {','.join(COLUMN_TYPES)}"
    if column.get("type") not in COLUMN_TYPES:
        errors.append(_invalid_or_required(f"{at}.type", column.get("type"), kinds))
    if column.get("format") and column["format"] not in COLUMN_FORMATS:
        errors.append(
            _invalid(f"{at}.format", column["format"], f"must be one of {','.join(COLUMN_FORMATS)}")
        )
    priority = column.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        errors.append(_invalid(f"{at}.priority", priority, "must be an integer"))
    if not column.get("jsonPath"):
        errors.append(_required(f"{at}.JSONPath"))
    else:
        errors += _simple_json_path_errors(column["jsonPath"], f"{at}.JSONPath")
    return errors


def _scale_errors(scale: dict[str, Any], at: str) -> list[FieldError]:
    errors = []
    for key, under in (("specReplicasPath", ".spec"), ("statusReplicasPath", ".status")):
        value = scale.get(key) or ""
        if not value:
            errors.append(_required(f"{at}.{key}"))
        elif found := _simple_json_path_errors(value, f"{at}.{key}"):
            errors += found
        elif not value.startswith(under + "."):
            errors.append(_invalid(f"{at}.{key}", value, f"should be a json path under {under}"))
    return errors


# --- one openAPIV3Schema ----------------------------------------------------------------------------------


_IF_STATUS = "if the status subresource is enabled"


@dataclass(frozen=True)
class _Scope:
    """What the position of a schema node allows."""

    defaults_forbidden: str = ""  # why a default may not be set here ("": it may)
    inside_meta: bool = False
    uncorrelatable: str = ""  # the ancestor below which old and new values do not correlate


def schema_errors(root: dict[str, Any], at: str, *, status_subresource: bool = True) -> list[FieldError]:
    """The API server's checks of one openAPIV3Schema: structural rules, x-kubernetes-* extensions and
    CEL rules; then, on a structural schema only, every default as written."""
    errors = []
    if status_subresource and root.get("type", "object") != "object":
        detail = f'only "object" is allowed as the type at the root of the schema {_IF_STATUS}'
        errors.append(_invalid(f"{at}.type", root["type"], detail))
    if status_subresource and set(root) - ROOT_KEYS:
        detail = f"only {sorted(ROOT_KEYS)} fields are allowed at the root of the schema {_IF_STATUS}"
        errors.append(_invalid(at, OMIT, detail))
    if root.get("nullable"):
        errors.append(_forbidden(f"{at}.nullable", "nullable cannot be true at the root"))
    errors += _node_errors(root, at, _Scope(), root=True)
    errors += _root_meta_errors(root, at)
    if not errors:
        errors += _default_errors(root, at)
    return errors


def _root_meta_errors(root: dict[str, Any], at: str) -> list[FieldError]:
    """A resource root: apiVersion and kind are strings, metadata an object that may restrict only its
    name and generateName."""
    errors = []
    props = root.get("properties", {})
    for key, kind in (("apiVersion", "string"), ("kind", "string"), ("metadata", "object")):
        if key in props and props[key].get("type") != kind:
            errors.append(_invalid(f"{at}.properties[{key}].type", props[key].get("type"), f"must be {kind}"))
    meta = props.get("metadata", {})
    if set(meta.get("properties", {})) - {"name", "generateName"} or set(meta) - {
        "type",
        "description",
        "properties",
    }:
        detail = (
            "must not specify anything other than name and generateName, but metadata is implicitly specified"
        )
        errors.append(_forbidden(f"{at}.properties[metadata]", detail))
    return errors


def _node_errors(node: dict[str, Any], at: str, scope: _Scope, root: bool = False) -> list[FieldError]:
    errors = []
    for key in node:
        if key in UNSUPPORTED_KEYS:
            errors.append(_forbidden(f"{at}.{key}", f"{key} is not supported"))
        elif key not in STRUCTURAL_KEYS:
            errors.append(_forbidden(f"{at}.{key}", "must not be used in a structural schema"))
    kind = node.get("type")
    preserve = node.get("x-kubernetes-preserve-unknown-fields")
    if kind is not None and kind not in TYPES:
        errors.append(_unsupported(f"{at}.type", kind, TYPES))
    if node.get("x-kubernetes-int-or-string") and kind:
        errors.append(_invalid(f"{at}.type", kind, "must be empty if x-kubernetes-int-or-string is true"))
    if not (kind or node.get("x-kubernetes-int-or-string") or preserve or root):
        errors.append(_required(f"{at}.type", "must not be empty for specified object fields"))
    if kind == "array" and not isinstance(node.get("items"), dict):
        errors.append(_required(f"{at}.items", "must be specified"))
    if node.get("uniqueItems"):
        detail = "uniqueItems cannot be set to true since the runtime complexity becomes quadratic"
        errors.append(_forbidden(f"{at}.uniqueItems", detail))
    if "default" in node and scope.defaults_forbidden:
        errors.append(_forbidden(f"{at}.default", f"must not be set {scope.defaults_forbidden}"))
    extra = node.get("additionalProperties")
    if node.get("properties") and (extra is False or isinstance(extra, dict)):
        detail = "additionalProperties and properties are mutual exclusive"
        errors.append(_forbidden(f"{at}.additionalProperties", detail))
    if preserve is not None and preserve is not True:
        errors.append(
            _invalid(f"{at}.x-kubernetes-preserve-unknown-fields", preserve, "must be true or undefined")
        )
    if node.get("x-kubernetes-embedded-resource"):
        if kind != "object":
            detail = "must be object if x-kubernetes-embedded-resource is true"
            errors.append(_invalid_or_required(f"{at}.type", kind, detail))
        if not node.get("properties") and not preserve:
            detail = (
                "must not be empty if x-kubernetes-embedded-resource is true without "
                "x-kubernetes-preserve-unknown-fields"
            )
            errors.append(_required(f"{at}.properties", detail))
        if scope.inside_meta:
            errors.append(
                _forbidden(f"{at}.x-kubernetes-embedded-resource", "must not be used inside of resource meta")
            )
    errors += _map_and_list_errors(node, at)
    errors += _rule_errors(node, at, scope)
    errors += _children_errors(node, at, scope, root)
    return errors


def _map_and_list_errors(node: dict[str, Any], at: str) -> list[FieldError]:
    """x-kubernetes-map-type, x-kubernetes-list-type and x-kubernetes-list-map-keys."""
    errors = []
    kind = node.get("type")
    map_type = node.get("x-kubernetes-map-type")
    if map_type is not None and kind != "object":
        errors.append(
            _invalid_or_required(f"{at}.type", kind, "must be object if x-kubernetes-map-type is specified")
        )
    if map_type is not None and map_type not in ("atomic", "granular"):
        errors.append(_unsupported(f"{at}.x-kubernetes-map-type", map_type, ["atomic", "granular"]))
    list_type = node.get("x-kubernetes-list-type")
    keys = node.get("x-kubernetes-list-map-keys", [])
    items = node.get("items") if isinstance(node.get("items"), dict) else None
    if list_type is not None and kind != "array":
        errors.append(
            _invalid_or_required(f"{at}.type", kind, "must be array if x-kubernetes-list-type is specified")
        )
    if list_type is not None and list_type not in ("atomic", "set", "map"):
        errors.append(_unsupported(f"{at}.x-kubernetes-list-type", list_type, ["atomic", "set", "map"]))
    if keys and list_type != "map":
        detail = "must be map if x-kubernetes-list-map-keys is non-empty"
        errors.append(_invalid_or_required(f"{at}.x-kubernetes-list-type", list_type, detail))
    if list_type in ("set", "map") and items is not None and items.get("nullable"):
        errors.append(
            _forbidden(
                f"{at}.items.nullable", f"cannot be nullable when x-kubernetes-list-type is {list_type}"
            )
        )
    if list_type == "set" and items is not None:
        atomic = "must be atomic as item of a list with x-kubernetes-list-type=set"
        if items.get("type") == "array" and items.get("x-kubernetes-list-type", "atomic") != "atomic":
            errors.append(
                _invalid(f"{at}.items.x-kubernetes-list-type", items["x-kubernetes-list-type"], atomic)
            )
        if items.get("type") == "object" and items.get("x-kubernetes-map-type") != "atomic":
            errors.append(
                _invalid(f"{at}.items.x-kubernetes-map-type", items.get("x-kubernetes-map-type"), atomic)
            )
    if list_type == "map":
        errors += _list_map_errors(keys, items, at)
    return errors


def _list_map_errors(keys: list[str], items: dict[str, Any] | None, at: str) -> list[FieldError]:
    if not keys:
        return [
            _required(
                f"{at}.x-kubernetes-list-map-keys", "must not be empty if x-kubernetes-list-type is map"
            )
        ]
    if items is None:
        return [_required(f"{at}.items", "must have a schema if x-kubernetes-list-type is map")]
    if items.get("type") != "object":
        detail = "must be object if parent array's x-kubernetes-list-type is map"
        return [_invalid(f"{at}.items.type", items.get("type"), detail)]
    errors = []
    props = items.get("properties", {})
    if len(set(keys)) != len(keys):
        errors.append(
            _invalid(f"{at}.x-kubernetes-list-map-keys", keys, "must not contain duplicate entries")
        )
    for key in keys:
        key_at = f"{at}.items.properties[{key}]"
        if key not in props:
            detail = "entries must all be names of item properties"
            errors.append(_invalid(f"{at}.x-kubernetes-list-map-keys", keys, detail))
            continue
        if props[key].get("type") in ("array", "object"):
            detail = "must be a scalar type if parent array's x-kubernetes-list-type is map"
            errors.append(_invalid(f"{key_at}.type", props[key]["type"], detail))
        if key not in items.get("required", []) and "default" not in props[key]:
            detail = (
                "this property is in x-kubernetes-list-map-keys, so it must have a default or be a required "
            )
            detail += "property"
            errors.append(_required(f"{key_at}.default", detail))
        if props[key].get("nullable"):
            detail = "this property is in x-kubernetes-list-map-keys, so it cannot be nullable"
            errors.append(_forbidden(f"{key_at}.nullable", detail))
    return errors


def _children_errors(node: dict[str, Any], at: str, scope: _Scope, root: bool) -> list[FieldError]:
    errors = []
    # Old and new values of an atomic map's fields, or of a non-map list's items, cannot be paired up.
    map_scope = scope
    if node.get("x-kubernetes-map-type") == "atomic" and not scope.uncorrelatable:
        map_scope = replace(scope, uncorrelatable=at)
    for name, sub in node.get("properties", {}).items():
        sub_scope = map_scope
        if (root or node.get("x-kubernetes-embedded-resource")) and name in META_FIELDS:
            sub_scope = replace(sub_scope, inside_meta=True)
            if root:
                sub_scope = replace(sub_scope, defaults_forbidden=f"in top-level {name}")
        errors += _node_errors(sub, f"{at}.properties[{name}]", sub_scope)
    if isinstance(node.get("additionalProperties"), dict):
        sub_scope = map_scope
        if scope.inside_meta:
            sub_scope = replace(
                sub_scope, defaults_forbidden="inside additionalProperties applying to object metadata"
            )
        errors += _node_errors(node["additionalProperties"], f"{at}.additionalProperties", sub_scope)
    if isinstance(node.get("items"), dict):
        sub_scope = scope
        if node.get("x-kubernetes-list-type") != "map" and not scope.uncorrelatable:
            sub_scope = replace(scope, uncorrelatable=at)
        errors += _node_errors(node["items"], f"{at}.items", sub_scope)
    elif isinstance(node.get("items"), list):
        errors.append(_forbidden(f"{at}.items", "items must be a schema object and not an array"))
    return errors


def _rule_value(rule: dict[str, Any]) -> str:
    """A rule as the API server prints it in an error (Go's %#v of apiextensions.ValidationRule)."""
    quoted = {
        k: '"' + str(rule.get(k, "")).replace('"', '\\"') + '"' for k in ("rule", "message", "fieldPath")
    }
    return (
        f"apiextensions.ValidationRule{{Rule:{quoted['rule']}, Message:{quoted['message']}, "
        f'MessageExpression:"", Reason:(*apiextensions.FieldValueErrorReason)(nil), '
        f"FieldPath:{quoted['fieldPath']}, OptionalOldSelf:(*bool)(nil)}}"
    )


def _rule_errors(node: dict[str, Any], at: str, scope: _Scope) -> list[FieldError]:
    errors = []
    for index, rule in enumerate(node.get("x-kubernetes-validations", [])):
        here = f"{at}.x-kubernetes-validations[{index}]"
        text, message = rule.get("rule", "").strip(), rule.get("message", "")
        if not text:
            errors.append(_required(f"{here}.rule", "rule is not specified"))
            continue
        if message and not message.strip():
            errors.append(_invalid(f"{here}.message", message, "message must be non-empty if specified"))
        elif re.search(r"[\n\r]", message.strip()):
            errors.append(_invalid(f"{here}.message", message, "message must not contain line breaks"))
        elif re.search(r"[\n\r]", text) and not message.strip():
            errors.append(
                _required(f"{here}.message", "message must be specified if rule contains line breaks")
            )
        if "reason" in rule and rule["reason"] not in REASONS:
            errors.append(_unsupported(f"{here}.reason", rule["reason"], REASONS))
        if "fieldPath" in rule and resolve_field_path(node, rule["fieldPath"]) is None:
            errors.append(_invalid(f"{here}.fieldPath", rule["fieldPath"], "fieldPath must be a valid path"))
        check = check_rule(node, text)
        if check.error:
            detail = f"compilation failed: {check.error}"
            errors.append(FieldError(f"{here}.rule", INVALID, OMIT, f"{_rule_value(rule)}: {detail}"))
        elif check.uses_old_self and scope.uncorrelatable:
            within = scope.uncorrelatable
            detail = f"oldSelf cannot be used on the uncorrelatable portion of the schema within {within}"
            errors.append(_invalid(f"{here}.rule", text, detail))
        elif not check.uses_old_self and "optionalOldSelf" in rule:
            detail = "may not be set if oldSelf is not used in rule"
            errors.append(_invalid(f"{here}.optionalOldSelf", rule["optionalOldSelf"], detail))
    return errors


def resolve_field_path(node: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The schema a rule's fieldPath (`.a.b` or `['a']`) names, or None when it names no field."""
    rest = path
    while rest:
        step = re.match(r"\.([A-Za-z_][A-Za-z0-9_]*)|\['([^']*)'\]", rest)
        if not step:
            return None
        name = step.group(1) or step.group(2)
        extra = node.get("additionalProperties")
        if name in node.get("properties", {}):
            node = node["properties"][name]
        elif isinstance(extra, dict):
            node = extra
        else:
            return None
        rest = rest[step.end() :]
    return node if path else None


def _default_errors(node: dict[str, Any], at: str) -> list[FieldError]:
    """Every default as written against the schema it sits under: it must be pruned already, pass the
    OpenAPI validation, then every CEL rule in scope (oldSelf bound to the default too). Like the API
    server, defaults under additionalProperties are not followed (they are checked where they apply)."""
    errors = []
    if "default" in node:
        default, where = node["default"], f"{at}.default"
        if prune(node, default, root=False)[0] != default:
            errors.append(_invalid(where, default, "must not have unknown fields"))
        elif found := validate_openapi(node, default, where):
            errors += found
        else:
            errors += validate_cel(node, default, where, old=default)
    for name, sub in node.get("properties", {}).items():
        errors += _default_errors(sub, f"{at}.properties[{name}]")
    if isinstance(node.get("items"), dict):
        errors += _default_errors(node["items"], f"{at}.items")
    return errors


# --- CEL rules against the schema they sit on ------------------------------------------------------------

_MACROS = {"all", "exists", "exists_one", "map", "filter"}
_TYPE_IDENTS = {"int", "uint", "double", "bool", "string", "bytes", "list", "map", "type", "null_type", "dyn"}
_CEL_RESERVED = {
    "true", "false", "null", "in", "as", "break", "const", "continue", "else", "for", "function", "if",
    "import", "let", "loop", "package", "namespace", "return", "var", "void", "while",
}  # fmt: skip
_WRAPPERS = {
    "expr", "conditionalor", "conditionaland", "relation", "addition", "multiplication", "unary", "member",
    "primary", "paren_expr",
}  # fmt: skip


def cel_field_name(prop: str) -> str:
    """How a rule spells property `prop`: Kubernetes escapes CEL's reserved words and `_ . - /`."""
    if prop in _CEL_RESERVED:
        return f"__{prop}__"
    for plain, escaped in (
        ("__", "__underscores__"),
        (".", "__dot__"),
        ("-", "__dash__"),
        ("/", "__slash__"),
    ):
        prop = prop.replace(plain, escaped)
    return prop


@dataclass
class RuleCheck:
    """A static look at one rule: its compile error in cel-go's words ("" if none), whether it reads
    oldSelf, and the optional fields it reads without a has() guard first."""

    error: str = ""
    uses_old_self: bool = False
    unguarded: list[str] = field(default_factory=list)


def check_rule(schema: dict[str, Any], rule: str) -> RuleCheck:
    """Parse `rule` and check each field it selects against `schema`, the schema of its `self`."""
    result = RuleCheck()
    try:
        tree = Cel.get().parse(rule)
    except ValueError as exc:
        result.error = f"ERROR: <input>: Syntax error: {exc}"
        return result
    walker = _RuleWalker(result)
    walker.visit(tree, {"self": schema, "oldSelf": schema}, frozenset())
    result.error = walker.errors[0] if walker.errors else ""
    return result


def _is_tree(node: Any) -> bool:
    return hasattr(node, "data") and hasattr(node, "children")


def _unwrap(node: Any) -> Any:
    while _is_tree(node) and node.data in _WRAPPERS and len(node.children) == 1:
        node = node.children[0]
    return node


def _text(node: Any) -> str | None:
    """`self.a.b` for a chain of field selections on a name, else None."""
    node = _unwrap(node)
    data = getattr(node, "data", None)
    if data == "ident":
        return str(node.children[0])
    if data == "member_dot":
        base = _text(node.children[0])
        return f"{base}.{node.children[1]}" if base else None
    return None


def _facts(node: Any, when: bool) -> frozenset[str]:
    """The fields a has() in `node` proves present once `node` has evaluated to `when`."""
    node = _unwrap(node)
    data, kids = getattr(node, "data", None), getattr(node, "children", [])
    if data == "unary" and len(kids) == 2:  # !x
        return _facts(kids[1], not when)
    if data == ("conditionaland" if when else "conditionalor") and len(kids) == 2:
        return _facts(kids[0], when) | _facts(kids[1], when)
    if when and data == "ident_arg" and str(kids[0]) == "has" and len(kids) == 2:
        args = kids[1].children
        found = _text(args[0]) if len(args) == 1 else None
        return frozenset([found]) if found else frozenset()
    return frozenset()


class _RuleWalker:
    """Walks cel-python's parse tree, typing names and field selections with the schema."""

    def __init__(self, result: RuleCheck) -> None:
        self.result = result
        self.errors: list[str] = []

    def visit(self, node: Any, env: dict[str, Any], facts: frozenset[str]) -> dict[str, Any] | None:
        """The schema of `node`'s value where known (None: not known, so not checked)."""
        if not _is_tree(node):
            return None
        data, kids = node.data, node.children
        if data == "expr" and len(kids) == 3:  # c ? a : b
            self.visit(kids[0], env, facts)
            self.visit(kids[1], env, facts | _facts(kids[0], True))
            self.visit(kids[2], env, facts | _facts(kids[0], False))
            return None
        if data in ("conditionalor", "conditionaland") and len(kids) == 2:
            self.visit(kids[0], env, facts)
            self.visit(kids[1], env, facts | _facts(kids[0], data == "conditionaland"))
            return None
        if data == "ident":
            return self.name(kids[0], env)
        if data == "member_dot":
            receiver = self.visit(kids[0], env, facts)
            return self.select(receiver, kids[1], _text(node), facts, guard=True)
        if data == "ident_arg" and str(kids[0]) == "has" and len(kids) == 2:
            arg = _unwrap(kids[1].children[0])
            if getattr(arg, "data", None) == "member_dot":
                receiver = self.visit(arg.children[0], env, facts)
                self.select(receiver, arg.children[1], _text(arg), facts, guard=False)
            return None
        if data == "member_dot_arg":
            return self.call(kids, env, facts)
        if len(kids) == 1 and data in _WRAPPERS:
            return self.visit(kids[0], env, facts)
        for kid in kids:
            self.visit(kid, env, facts)
        return None

    def name(self, token: Any, env: dict[str, Any]) -> dict[str, Any] | None:
        name = str(token)
        if name == "oldSelf":
            self.result.uses_old_self = True
        if name not in env and name not in _TYPE_IDENTS:
            self.errors.append(
                f"ERROR: <input>:{token.line}:{token.column}: undeclared reference to '{name}'"
            )
        return env.get(name)

    def call(self, kids: list[Any], env: dict[str, Any], facts: frozenset[str]) -> None:
        """`x.f(args)`: a macro binds its variable to x's items; other calls are only walked."""
        receiver = self.visit(kids[0], env, facts)
        args = kids[2].children if len(kids) > 2 else []
        variable = _text(args[0]) if args else None
        if str(kids[1]) in _MACROS and variable and "." not in variable:
            items = receiver.get("items") if receiver and receiver.get("type") == "array" else None
            for arg in args[1:]:
                self.visit(arg, {**env, variable: items}, facts)
            return None
        for arg in args:
            self.visit(arg, env, facts)
        return None

    def select(
        self,
        receiver: dict[str, Any] | None,
        token: Any,
        path: str | None,
        facts: frozenset[str],
        *,
        guard: bool,
    ) -> dict[str, Any] | None:
        if receiver is None:
            return None
        name = str(token)
        props = {cel_field_name(p): p for p in receiver.get("properties", {})}
        extra = receiver.get("additionalProperties")
        if name in props:
            optional = props[name] not in receiver.get("required", [])
            if guard and optional and path not in facts:
                self.result.unguarded.append(path or name)
            return receiver["properties"][props[name]]
        if isinstance(extra, dict):
            if guard and path not in facts:
                self.result.unguarded.append(path or name)
            return extra
        if receiver.get("x-kubernetes-preserve-unknown-fields") or receiver.get(
            "x-kubernetes-embedded-resource"
        ):
            return None
        where = f"<input>:{token.line}:{max(token.column - 1, 1)}"
        if receiver.get("type") == "object":
            self.errors.append(f"ERROR: {where}: undefined field '{name}'")
        else:
            self.errors.append(
                f"ERROR: {where}: type '{receiver.get('type')}' does not support field selection"
            )
        return None


# --- our stricter rules -----------------------------------------------------------------------------------


def project_problems(crd: dict[str, Any]) -> list[str]:
    """This project's rules on top of the API server's: bounded strings, lists and maps (they keep the
    CEL cost estimate small), patterns RE2 can run, has() before every optional field a rule reads,
    defaults written out in full (nested defaults included, and valid so), printer columns that name an
    existing field of a fitting type, and the status subresource exactly when the schema has a status."""
    problems = []
    for version in crd["spec"]["versions"]:
        schema = version["schema"]["openAPIV3Schema"]
        props = schema.get("properties", {})
        for part in ("spec", "status"):
            if part in props:
                problems += _walk_problems(props[part], part)
        if ("status" in props) != ("status" in (version.get("subresources") or {})):
            problems.append(
                f"version {version['name']}: the status subresource must be on iff there is a status"
            )
        for column in version.get("additionalPrinterColumns", []):
            problems += _column_problems(schema, column)
    return problems


def _walk_problems(node: dict[str, Any], path: str) -> list[str]:
    problems = []
    kind = node.get("type")
    if kind == "string" and not ({"maxLength", "enum", "format"} & node.keys()):
        problems.append(f"{path}: string without maxLength or enum")
    if kind == "array" and "maxItems" not in node:
        problems.append(f"{path}: array without maxItems")
    if kind == "object" and "additionalProperties" in node and "maxProperties" not in node:
        problems.append(f"{path}: map without maxProperties")
    if re.search(r"\(\?[=!<>]|\\[1-9]", node.get("pattern", "")):
        problems.append(
            f"{path}: pattern needs look-around or back-references, which RE2 (the API server's) lacks"
        )
    for validation in node.get("x-kubernetes-validations", []):
        unguarded = check_rule(node, validation["rule"]).unguarded
        problems += [
            f"{path}: rule {validation['rule']!r} reads optional {f} without has()" for f in unguarded
        ]
    if "default" in node:
        filled = apply_defaults(node, node["default"])
        if filled != node["default"]:  # what the API server checks must be what it stores
            problems.append(
                f"{path}: default {node['default']!r} leaves out nested defaults; write {filled!r}"
            )
        found = validate_openapi(node, filled, f"{path}.default") or validate_cel(
            node, filled, f"{path}.default"
        )
        problems += [f"once defaulted: {e}" for e in found]
    for name, sub in node.get("properties", {}).items():
        problems += _walk_problems(sub, f"{path}.{name}")
    for key, suffix in (("items", "[]"), ("additionalProperties", ".*")):
        if isinstance(node.get(key), dict):
            problems += _walk_problems(node[key], path + suffix)
    return problems


_COLUMN_FITS = {"integer": {"integer"}, "number": {"integer", "number"}, "boolean": {"boolean"}}


def _column_problems(schema: dict[str, Any], column: dict[str, Any]) -> list[str]:
    name, path, kind = column.get("name"), column.get("jsonPath", ""), column.get("type")
    target = column_field(schema, path)
    if target is None:
        return [f"printer column {name!r}: {path} names no field of the schema"]
    if target == {}:  # under metadata: free-form to the schema, ObjectMeta to the API server
        return []
    if target.get("type") in ("object", "array"):
        return [f"printer column {name!r}: {path} is not a scalar"]
    if kind == "date" and target.get("format") != "date-time":
        return [f"printer column {name!r}: a date column needs a field of format date-time"]
    if kind in _COLUMN_FITS and target.get("type") not in _COLUMN_FITS[kind]:
        return [f"printer column {name!r}: {kind} column on a {target.get('type')} field"]
    return []


def column_field(schema: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The schema a printer column's JSONPath reaches (`[...]` steps into list items; a path under
    metadata gives {}), or None when it names no field."""
    steps = re.findall(r"\.([A-Za-z0-9_-]+)|(\[[^\]]*\])", path)
    if not steps or "".join(f".{n}" if n else b for n, b in steps) != path:
        return None
    node = schema
    for name, bracket in steps:
        if name == "metadata" and node is schema:
            return {}
        if bracket:
            node = node.get("items") if node.get("type") == "array" else None
        elif name in node.get("properties", {}):
            node = node["properties"][name]
        else:
            node = (
                node.get("additionalProperties")
                if isinstance(node.get("additionalProperties"), dict)
                else None
            )
        if not isinstance(node, dict):
            return None
    return node
