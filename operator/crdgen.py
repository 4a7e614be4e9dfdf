"""Generate the CRDs of crds/ from the pydantic models of `api.py` (`modelfleet crds --out DIR [--check]`).

pydantic writes JSON Schema 2020-12; a CRD wants a *structural* OpenAPI v3.0 schema. The translation
inlines every `$ref`, turns `Optional[X]` into plain X (the API server prunes nulls of non-nullable
fields, which is what "unset" means to us), converts numeric `exclusiveMinimum` to the v3.0 boolean form,
maps free-form objects to `x-kubernetes-preserve-unknown-fields`, and gives spec sub-objects whose fields
are all optional a default with their nested defaults written out: the API server validates a default as
written, CEL rules included, before any nested default applies (`{}` fails `self.min <= self.max`).
Anything else it does not know raises, so a new model feature cannot slip an invalid keyword into a CRD.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml
from modelfleet.operator import api, schema_checks
from pydantic import BaseModel

# The OpenAPI v3.0 keywords a CRD schema accepts (apiextensions JSONSchemaProps) that we emit.
ALLOWED_KEYS = {
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
_KEY_ORDER = ["description", "type", "format", "enum", "default", "required", "properties", "items"]

HEADER = "# Generated from operator/api.py by `modelfleet crds --out crds`; do not edit by hand.\n"


class SchemaError(ValueError):
    """The pydantic schema uses something a structural CRD schema cannot express."""


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    """Inline `$ref`s and collapse `Optional[X]` / single-item `allOf` wrappers."""
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = copy.deepcopy(defs[node.pop("$ref").rsplit("/", 1)[-1]])
        node = {**target, **node}  # siblings (description, default) win over the definition's
    if "allOf" in node and len(node["allOf"]) == 1:
        node = {**copy.deepcopy(_deref(node.pop("allOf")[0], defs)), **node}
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o != {"type": "null"}]
        if len(options) != 1:
            raise SchemaError(f"a union of several types cannot be structural: {options}")
        if node.get("default", ...) is None:
            del node["default"]
        node = {**_deref(options[0], defs), **node}
    return {key: (_resolve(value, defs) if key != "default" else value) for key, value in node.items()}


def _deref(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]]) if "$ref" in node else node


def _to_openapi(node: dict[str, Any], where: str, *, in_spec: bool) -> dict[str, Any]:
    """One resolved JSON Schema node -> OpenAPI v3.0 structural node (recursively)."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "title":
            continue
        if key == "const":
            out["enum"] = [value]
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "additionalProperties":
            if value is True or value == {}:
                out["x-kubernetes-preserve-unknown-fields"] = True
            elif isinstance(value, dict):
                out[key] = _to_openapi(value, f"{where}.*", in_spec=in_spec)
            # `false` is dropped: the API server prunes unknown fields anyway and v1 forbids it
        elif key == "properties":
            out[key] = {
                name: _with_object_default(_to_openapi(sub, f"{where}.{name}", in_spec=in_spec), in_spec)
                for name, sub in value.items()
            }
        elif key == "items":
            out[key] = _to_openapi(value, f"{where}[]", in_spec=in_spec)
        elif key in ALLOWED_KEYS:
            out[key] = value
        else:
            raise SchemaError(f"{where}: keyword {key!r} is not allowed in a structural CRD schema")
    if "type" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        raise SchemaError(f"{where}: has no type")
    return _ordered(out)


def _with_object_default(node: dict[str, Any], in_spec: bool) -> dict[str, Any]:
    """A spec field holding an object whose fields are all optional defaults to that object with its
    nested defaults filled in, so a user may leave the whole object out."""
    if in_spec and node.get("type") == "object" and "properties" in node and not node.get("required"):
        node.setdefault("default", schema_checks.apply_defaults(node, {}))
    return _ordered(node)


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    first = [k for k in _KEY_ORDER if k in node]
    return {key: node[key] for key in first + sorted(k for k in node if k not in first)}


def openapi_schema(model: type[BaseModel], *, in_spec: bool) -> dict[str, Any]:
    """The structural OpenAPI v3.0 schema of a pydantic model (wire names, i.e. camelCase)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _to_openapi(_resolve(raw, defs), model.__name__, in_spec=in_spec)


def _root_schema(description: str, spec: type[BaseModel], status: type[BaseModel]) -> dict[str, Any]:
    return {
        "description": description,
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": openapi_schema(spec, in_spec=True),
            "status": openapi_schema(status, in_spec=False),
        },
    }


def _crd(
    *,
    kind: str,
    plural: str,
    short_name: str,
    description: str,
    spec: type[BaseModel],
    status: type[BaseModel],
    columns: list[dict[str, Any]],
) -> dict[str, Any]:
    age = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": [short_name],
                "categories": ["modelfleet"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": _root_schema(description, spec, status)},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [*columns, age],
                }
            ],
        },
    }


def inference_model_crd() -> dict[str, Any]:
    return _crd(
        kind="InferenceModel",
        plural="inferencemodels",
        short_name="im",
        description="A stable OpenAI-compatible endpoint that serves one model, split over its versions.",
        spec=api.InferenceModelSpec,
        status=api.InferenceModelStatus,
        columns=[
            {"name": "Accelerator", "type": "string", "jsonPath": ".spec.hardware.accelerator"},
            {"name": "Traffic", "type": "string", "jsonPath": ".status.traffic"},
            {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
            {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint"},
            # -o wide only: most models run no rollout.
            {"name": "Rollout", "type": "string", "jsonPath": ".status.rollout.phase", "priority": 1},
        ],
    )


def model_version_crd() -> dict[str, Any]:
    return _crd(
        kind="ModelVersion",
        plural="modelversions",
        short_name="mv",
        description="One immutable set of weights of an InferenceModel, converted for its hardware.",
        spec=api.ModelVersionSpec,
        status=api.ModelVersionStatus,
        columns=[
            {"name": "Model", "type": "string", "jsonPath": ".spec.model"},
            {"name": "Version", "type": "string", "jsonPath": ".spec.version"},
            {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        ],
    )


def all_crds() -> dict[str, dict[str, Any]]:
    """File name -> CRD, for every CRD of the project."""
    crds = [inference_model_crd(), model_version_crd()]
    return {f"{crd['metadata']['name']}.yaml": crd for crd in crds}


def render(crd: dict[str, Any]) -> str:
    return HEADER + yaml.safe_dump(crd, sort_keys=False, width=110)


def stale_files(out_dir: Path) -> list[str]:
    """The CRD files under `out_dir` that are missing or differ from what the models generate."""
    stale = []
    for name, crd in all_crds().items():
        path = out_dir / name
        if not path.is_file() or path.read_text(encoding="utf-8") != render(crd):
            stale.append(name)
    return stale


def write_crds(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, crd in all_crds().items():
        path = out_dir / name
        path.write_text(render(crd), encoding="utf-8")
        written.append(path)
    return written


def _run(args: argparse.Namespace) -> int:
    out_dir = Path(args.out)
    if args.check:
        stale = stale_files(out_dir)
        if stale:
            print(
                f"error: CRDs in {out_dir} are out of date with operator/api.py: {', '.join(stale)}; "
                f"run `modelfleet crds --out {out_dir}`",
                file=sys.stderr,
            )
            return 1
        print(f"CRDs in {out_dir} are up to date")
        return 0
    for path in write_crds(out_dir):
        print(f"wrote {path}")
    return 0
