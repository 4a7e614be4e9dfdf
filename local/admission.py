"""What the API server does to a custom resource before it stores it: the CRD schema's defaults, its
structural validation and its CEL rules, refused with the API server's message.

The checks themselves are the project's (`operator/schema_checks.py`); this module runs them against the
CRDs that `operator/crdgen.py` generates and words the refusal as the API server does.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

from modelfleet.operator import crdgen
from modelfleet.operator.api import API_VERSION, GROUP

DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


class Refused(ValueError):
    """The API server would not store this object; the message is the one it answers with."""


@lru_cache(maxsize=1)
def _checks() -> ModuleType:
    try:
        return importlib.import_module("modelfleet.operator.schema_checks")
    except ImportError:
        # A development checkout from before the checks moved into the operator package.
        path = Path(__file__).resolve().parents[1] / "tests" / "operator" / "crd_checks.py"
        spec = importlib.util.spec_from_file_location("modelfleet_crd_checks", path)
        if spec is None or spec.loader is None or not path.is_file():
            raise
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


@lru_cache(maxsize=1)
def crds() -> dict[str, dict[str, Any]]:
    """The generated CRDs, by kind."""
    return {crd["spec"]["names"]["kind"]: crd for crd in crdgen.all_crds().values()}


def schema(kind: str) -> dict[str, Any]:
    return crds()[kind]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def admit(obj: Any, old: dict[str, Any] | None = None) -> dict[str, Any]:
    """The object as the API server stores it (pruned, defaulted), or `Refused` with its message.
    `old`: the stored object an update replaces (transition rules compare the two)."""
    if not isinstance(obj, dict):
        raise Refused(f"a document is not an object (got {type(obj).__name__}); each must be a resource")
    kind, api_version = obj.get("kind"), obj.get("apiVersion")
    if kind not in crds() or api_version != API_VERSION:
        raise Refused(
            f'no matches for kind "{kind}" in version "{api_version}": the local fleet takes '
            f"InferenceModel and ModelVersion of {API_VERSION}"
        )
    checks = _checks()
    if hasattr(checks, "check_object"):
        try:
            return checks.check_object(crds()[kind], obj, old)
        except ValueError as exc:
            raise Refused(str(exc)) from None
    return _admit_with_test_checks(checks, kind, obj)


def _admit_with_test_checks(checks: ModuleType, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    name = (obj.get("metadata") or {}).get("name")
    if not name:
        raise Refused(f"{kind}.{GROUP} is invalid: metadata.name: Required value: name is required")
    if not isinstance(name, str) or len(name) > 253 or not DNS_SUBDOMAIN.match(name):
        raise Refused(
            f'{kind}.{GROUP} "{name}" is invalid: metadata.name: Invalid value: "{name}": a lowercase '
            "RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
            "start and end with an alphanumeric character"
        )
    crd_schema = schema(kind)
    defaulted = checks.apply_defaults(crd_schema, obj)
    errors = checks.schema_errors(crd_schema, defaulted)
    if not errors:
        errors = checks.cel_violations(crd_schema, defaulted)
    if errors:
        detail = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
        raise Refused(f'The {kind} "{name}" is invalid: {detail}')
    return defaulted
