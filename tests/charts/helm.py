"""Running the real helm binary on charts/modelfleet and checking what it renders."""

from __future__ import annotations

import functools
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "modelfleet"
HELM = ROOT / ".modelfleet" / "tools" / "bin" / "helm"
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
# Kinds of other projects' CRDs that we render but cannot validate: no schema ships with
# kubernetes-validate and the CRD is not ours. ServiceMonitor is prometheus-operator's.
FOREIGN_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}

# kubernetes-validate parses its schema files (megabytes of JSON) again on every call; the files never
# change, so parse each once. Ten times faster over the whole suite.
kubernetes_validate.utils.schema_contents = functools.lru_cache(maxsize=None)(
    kubernetes_validate.utils.schema_contents
)


def helm_binary() -> Path:
    """The helm that `make setup` installs; a missing one fails the test (it is part of the setup)."""
    if not HELM.is_file():
        pytest.fail(f"helm is missing at {HELM}: run `scripts/install-helm.sh` (part of `make setup`)")
    return HELM


def run_helm(*args: str, values: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
    command = [str(helm_binary()), *args]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as values_file:
        if values is not None:
            yaml.safe_dump(values, values_file)
            values_file.flush()
            command += ["--values", values_file.name]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def render(
    values: dict[str, Any] | None = None,
    *,
    kube_version: str = KUBERNETES_VERSIONS[-1],
    namespace: str = "modelfleet-system",
    release: str = "mf",
) -> list[dict[str, Any]]:
    """`helm template` with the CRDs included; every rendered document, parsed."""
    result = run_helm(
        "template",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "--kube-version",
        kube_version,
        "--include-crds",
        values=values or {},
    )
    assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def crd_schemas(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> openAPIV3Schema of every CRD in the rendered documents."""
    schemas = {}
    for doc in docs:
        if doc["kind"] != "CustomResourceDefinition":
            continue
        group, kind = doc["spec"]["group"], doc["spec"]["names"]["kind"]
        for version in doc["spec"]["versions"]:
            schemas[(f"{group}/{version['name']}", kind)] = version["schema"]["openAPIV3Schema"]
    return schemas


def validation_errors(docs: list[dict[str, Any]], kube_version: str) -> list[str]:
    """Every document checked: built-in kinds (and CRD manifests) by kubernetes-validate --strict, our
    custom resources against their CRD's schema. Returns one line per problem."""
    problems = []
    custom = crd_schemas(docs)
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if key in FOREIGN_KINDS:
            continue
        try:
            if key in custom:
                jsonschema.Draft7Validator(custom[key]).validate(doc)
            else:
                kubernetes_validate.validate(doc, kube_version, strict=True)
        except jsonschema.ValidationError as exc:
            problems.append(f"{name} (k8s {kube_version}): {exc.message} at {list(exc.absolute_path)}")
        except kubernetes_validate.utils.SchemaNotFoundError as exc:
            problems.append(f"{name} (k8s {kube_version}): {exc.message}")
    return problems


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def container_env(deployment: dict[str, Any]) -> dict[str, Any]:
    """name -> value (or valueFrom) of the first container's environment."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container.get("env", [])}
