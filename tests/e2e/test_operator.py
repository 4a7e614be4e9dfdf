"""The operator against a real API server: kubectl apply -f examples/model.yaml -> Jobs, serving objects,
status, traffic changes without pod restarts, and clean-up.

Needs KUBECONFIG pointing at a cluster (v1.30 or newer) with kube-controller-manager (its Job,
ReplicaSet, Deployment, ResourceQuota and garbage-collector controllers do their real work here) where
the current user is an administrator. No node is needed. Without nodes the controllers still create the
pods, which stay Pending; the test then does what a kubelet would, through the pod's status subresource
(phase Succeeded, the container terminated with the artifact summary as its message). It never writes a
Job's status: that belongs to the Job controller, which reads the pod and marks the Job Complete, as it
would on a real node.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"
EXAMPLE = ROOT / "examples" / "model.yaml"
BAD = ROOT / "examples" / "bad"
CRD_NAMES = ("inferencemodels.modelfleet.dev", "modelversions.modelfleet.dev")
JOBS = {
    "v1": ["chat-v1-convert-nvidia-h100-torch-bf16"],
    "v2": ["chat-v2-convert-nvidia-h100-torch-bf16", "chat-v2-convert-nvidia-h100-torch-fp8"],
}

pytestmark = [
    pytest.mark.skipif(
        not os.environ.get("KUBECONFIG"),
        reason="KUBECONFIG is not set: no Kubernetes cluster to test against",
    ),
    pytest.mark.timeout(600),
]


@pytest.fixture()
def crds(cluster_kubectl, wait) -> None:
    """Our CRDs, installed (or updated) from crds/ and established."""
    cluster_kubectl.run("apply", "--server-side", "--force-conflicts", "-f", str(CRDS))
    for name in CRD_NAMES:
        cluster_kubectl.run("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")


@contextlib.contextmanager
def running_operator(namespace: str, *options: str, **env: str) -> Iterator[Path]:
    """`modelfleet operator -n NAMESPACE OPTIONS` in a subprocess; yields its log file."""
    log = Path(tempfile.mkstemp(prefix="modelfleet-operator-", suffix=".log")[1])
    environment = {
        **os.environ,
        "MODELFLEET_OPERATOR_METRICS_PORT": "0",
        "MODELFLEET_OPERATOR_HEALTH_PORT": "0",
        "MODELFLEET_RESYNC_SECONDS": "5",
        "MODELFLEET_DATAPLANE_IMAGE": "registry.example/modelfleet:e2e",
        **env,
    }
    command = [str(Path(sys.executable).parent / "modelfleet"), "operator", *options, "-n", namespace]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environment)
    try:
        yield log
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.unlink(missing_ok=True)


@pytest.fixture()
def operator(namespace, crds) -> Iterator[Path]:
    """`modelfleet operator --standalone` for the test namespace; yields its log file."""
    with running_operator(namespace, "--standalone") as log:
        yield log


def test_bad_examples_are_refused_by_the_api_server(namespace, kubectl, crds):
    """The CRD schema and its CEL rules, enforced by a real API server, name the field."""
    expected = {
        "weights-sum-90.yaml": "spec.traffic",
        "duplicate-version.yaml": "spec.traffic",
        "unknown-accelerator.yaml": "spec.hardware.accelerator",
        "replicas-min-above-max.yaml": "spec.replicas",
        "bad-uri-scheme.yaml": "spec.source.uri",
        "missing-source.yaml": "spec.source",
    }
    for name, field in expected.items():
        result = kubectl.run("apply", "-f", str(BAD / name), check=False)
        assert result.returncode != 0, f"{name} was accepted"
        assert field in result.stderr, f"{name}: {result.stderr}"


def pod_summary(job: str) -> dict:
    version = job.split("-convert-")[0].removeprefix("chat-")
    slug = job.split("-convert-")[1]
    accelerator, fmt, dtype = "nvidia-h100", slug.split("-")[-2], slug.split("-")[-1]
    return {
        "ok": True,
        "accelerator": accelerator,
        "format": fmt,
        "dtype": dtype,
        "uri": f"pvc://modelfleet-models/artifacts/chat/{version}/{slug}",
        "sha256": "0" * 64,
        "sizeBytes": 1024,
        "validation": {"maxLogitDiff": 0.0, "top1Agreement": 1.0},
    }


def complete_conversion(kubectl, wait, job: str, logs) -> None:
    """Do what a kubelet would: the Job's pod ran, and its container left the summary as its message."""
    pod = wait(
        f"a pod of Job {job}", lambda: kubectl.get("pods", None, "-l", f"job-name={job}"), on_fail=logs
    )[0]
    now = "2026-01-01T00:00:00Z"
    container = pod["spec"]["containers"][0]
    status = {
        "status": {
            "phase": "Succeeded",
            "startTime": now,
            "containerStatuses": [
                {
                    "name": container["name"],
                    "image": container["image"],
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "started": False,
                    "state": {
                        "terminated": {
                            "exitCode": 0,
                            "reason": "Completed",
                            "message": json.dumps(pod_summary(job)),
                            "startedAt": now,
                            "finishedAt": now,
                        }
                    },
                }
            ],
        }
    }
    kubectl.run(
        "patch",
        "pod",
        pod["metadata"]["name"],
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(status),
    )


def condition(obj: dict | None, type_: str) -> tuple[str, str] | None:
    found = full_condition(obj, type_)
    return (found["status"], found["reason"]) if found else None


def full_condition(obj: dict | None, type_: str) -> dict | None:
    return next(
        (c for c in ((obj or {}).get("status") or {}).get("conditions", []) if c["type"] == type_), None
    )


def manifest_of(kubectl) -> dict | None:
    cm = kubectl.get("configmap", "chat-manifest")
    return yaml.safe_load(cm["data"]["manifest.yaml"]) if cm else None


def weights(kubectl) -> dict[str, int] | None:
    manifest = manifest_of(kubectl)
    if not manifest or not manifest.get("models"):
        return None
    return {v["name"]: v["weight"] for v in manifest["models"][0]["versions"]}


def test_model_yaml_to_serving_objects_traffic_and_clean_up(namespace, kubectl, operator, wait):
    logs = lambda: "operator log (tail):\n" + operator.read_text()[-4000:]  # noqa: E731
    kubectl.run("apply", "-f", str(EXAMPLE))

    # Conversion Jobs, one per target, owned by their ModelVersion.
    for names in JOBS.values():
        for job in names:
            found = wait(f"Job {job}", lambda job=job: kubectl.get("job", job), on_fail=logs)
            assert found["metadata"]["ownerReferences"][0]["kind"] == "ModelVersion"
            assert found["spec"]["template"]["spec"]["containers"][0]["command"][:2] == [
                "modelfleet",
                "convert",
            ]

    # The serving objects exist before any version is ready; nothing is served yet.
    deploy = wait("Deployment chat", lambda: kubectl.get("deployment", "chat"), on_fail=logs)
    assert deploy["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/modelfleet:e2e"
    assert (
        deploy["spec"]["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"]
        == "NVIDIA-H100-80GB-HBM3"
    )
    service = wait("Service chat", lambda: kubectl.get("service", "chat"), on_fail=logs)
    assert service["spec"]["ports"][0]["port"] == 8000
    assert wait("ConfigMap chat-manifest", lambda: manifest_of(kubectl), on_fail=logs) == {"models": []}
    wait("HPA chat (replicas 1..3)", lambda: kubectl.get("hpa", "chat"), on_fail=logs)
    im = wait("status of chat", lambda: (kubectl.get("im", "chat") or {}).get("status"), on_fail=logs)
    assert im["endpoint"] == f"http://chat.{namespace}.svc:8000/v1"
    assert wait(
        "Ready=False VersionNotReady",
        lambda: condition(kubectl.get("im", "chat"), "Ready") == ("False", "VersionNotReady"),
        on_fail=logs,
    )
    assert wait(
        "v2 Converting",
        lambda: (kubectl.get("mv", "chat-v2").get("status") or {}).get("phase") == "Converting",
    )

    # v1 converted: all traffic goes to v1 (v2 has nothing to serve yet) and the status says why.
    complete_conversion(kubectl, wait, JOBS["v1"][0], logs)
    wait(
        "Job controller marks v1's Job complete",
        lambda: condition(kubectl.get("job", JOBS["v1"][0]), "Complete"),
    )
    wait(
        "v1 Ready",
        lambda: (kubectl.get("mv", "chat-v1").get("status") or {}).get("phase") == "Ready",
        on_fail=logs,
    )
    assert wait("manifest v1=100", lambda: weights(kubectl) == {"v1": 100}, on_fail=logs)
    # The ConfigMap is applied a moment before the status is written: wait for the status too.
    im = wait(
        "status traffic v1=100,v2=0",
        lambda: (m := kubectl.get("im", "chat"))["status"]["traffic"] == "v1=100,v2=0" and m,
        on_fail=logs,
    )
    assert condition(im, "Degraded") == ("True", "VersionNotReady")

    # v2 converted too: the requested 90/10 split is served.
    for job in JOBS["v2"]:
        complete_conversion(kubectl, wait, job, logs)
    assert wait("manifest v1=90 v2=10", lambda: weights(kubectl) == {"v1": 90, "v2": 10}, on_fail=logs)
    wait(
        "Degraded=False", lambda: condition(kubectl.get("im", "chat"), "Degraded") == ("False", "AsExpected")
    )
    artifacts = kubectl.get("mv", "chat-v2")["status"]["artifacts"]
    assert sorted(a["dtype"] for a in artifacts) == ["bf16", "fp8"]
    # No node runs the data-plane pods, so the model is not Ready, and says so.
    assert condition(kubectl.get("im", "chat"), "Ready") == ("False", "PodsNotReady")

    # A traffic change rewrites the ConfigMap only: the pod template (and so every pod) stays.
    before = kubectl.get("deployment", "chat")
    kubectl.run(
        "patch",
        "im",
        "chat",
        "--type=merge",
        "-p",
        json.dumps({"spec": {"traffic": [{"version": "v1", "weight": 50}, {"version": "v2", "weight": 50}]}}),
    )
    assert wait("manifest v1=50 v2=50", lambda: weights(kubectl) == {"v1": 50, "v2": 50}, on_fail=logs)
    wait(
        "status traffic",
        lambda: kubectl.get("im", "chat")["status"]["traffic"] == "v1=50,v2=50",
        on_fail=logs,
    )
    after = kubectl.get("deployment", "chat")
    assert after["spec"]["template"] == before["spec"]["template"]
    assert after["metadata"]["generation"] == before["metadata"]["generation"]

    # Printer columns.
    table = kubectl.run("get", "im").stdout
    for column in ("ACCELERATOR", "TRAFFIC", "READY", "ENDPOINT", "AGE", "nvidia-h100", "v1=50,v2=50"):
        assert column in table
    assert "Ready" in kubectl.run("get", "mv").stdout

    # A version's spec is immutable: the API server itself refuses the edit.
    edit = kubectl.run(
        "patch",
        "mv",
        "chat-v1",
        "--type=merge",
        "-p",
        json.dumps({"spec": {"source": {"uri": "pvc://models/chat/other"}}}),
        check=False,
    )
    assert edit.returncode != 0 and "spec is immutable" in edit.stderr

    # A version still in traffic is kept by the finalizer, and says why, until traffic leaves it.
    kubectl.run("delete", "mv", "chat-v2", "--wait=false")
    held = wait("InUse on chat-v2", lambda: condition(kubectl.get("mv", "chat-v2"), "InUse"), on_fail=logs)
    assert held == ("True", "TrafficStillRouted")
    kubectl.run(
        "patch",
        "im",
        "chat",
        "--type=merge",
        "-p",
        json.dumps({"spec": {"traffic": [{"version": "v1", "weight": 100}]}}),
    )
    wait("chat-v2 gone", lambda: kubectl.get("mv", "chat-v2") is None, on_fail=logs)

    # A deleted child comes back.
    kubectl.run("delete", "service", "chat")
    wait("Service chat re-created", lambda: kubectl.get("service", "chat"), on_fail=logs)

    # Deleting the resources removes everything they own (garbage collection through owner references).
    kubectl.run("delete", "-f", str(EXAMPLE), "--ignore-not-found", "--wait=false")
    for kind, name in [
        ("deployment", "chat"),
        ("service", "chat"),
        ("configmap", "chat-manifest"),
        ("hpa", "chat"),
        ("job", JOBS["v1"][0]),
    ]:
        wait(
            f"{kind} {name} deleted",
            lambda kind=kind, name=name: kubectl.get(kind, name) is None,
            on_fail=logs,
        )
    wait("no InferenceModel left", lambda: kubectl.get("im") == [], on_fail=logs)
    wait("no ModelVersion left (the finalizer lets go)", lambda: kubectl.get("mv") == [], on_fail=logs)


def test_a_conversion_refused_by_a_resource_quota_says_so_and_recovers(namespace, kubectl, operator, wait):
    """A quota of 0 pods: the Job controller's pod creation fails (FailedCreate Events on the Job, nothing
    in the Job's status), and the ModelVersion's Ready condition carries the API server's refusal."""
    logs = lambda: "operator log (tail):\n" + operator.read_text()[-4000:]  # noqa: E731
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "no-pods"}}
    kubectl.run("apply", "-f", "-", stdin=json.dumps({**quota, "spec": {"hard": {"pods": "0"}}}))
    # The quota controller has counted the namespace: from now on pods are refused for exceeding it.
    wait(
        "quota counted",
        lambda: ((kubectl.get("resourcequota", "no-pods") or {}).get("status") or {}).get("used"),
    )
    kubectl.run("apply", "-f", str(EXAMPLE))

    job = JOBS["v1"][0]
    refusals = wait(
        f"a FailedCreate Event of Job {job}",
        lambda: kubectl.get(
            "events", None, "--field-selector", f"involvedObject.name={job},reason=FailedCreate"
        ),
        on_fail=logs,
    )
    assert "exceeded quota: no-pods" in refusals[0]["message"]
    assert not (kubectl.get("job", job).get("status") or {}).get("conditions")  # the Job says nothing

    def refused() -> dict | None:
        found = full_condition(kubectl.get("mv", "chat-v1"), "Ready")
        return found if found and found["reason"] == "QuotaExceeded" else None

    ready = wait("chat-v1 Ready=False QuotaExceeded", refused, on_fail=logs)
    assert ready["status"] == "False"
    assert ready["message"].startswith("conversion Job for nvidia-h100-torch-bf16 cannot create its pod: ")
    assert "exceeded quota: no-pods" in ready["message"]
    assert kubectl.get("mv", "chat-v1")["status"]["phase"] == "Converting"
    warned = wait(
        "a QuotaExceeded Event of chat-v1",
        lambda: kubectl.get(
            "events", None, "--field-selector", "involvedObject.name=chat-v1,reason=QuotaExceeded"
        ),
        on_fail=logs,
    )
    assert warned[0]["type"] == "Warning"
    # The data-plane pods are refused too (the Deployment's ReplicaFailure condition).
    wait(
        "chat Degraded=True QuotaExceeded",
        lambda: condition(kubectl.get("im", "chat"), "Degraded") == ("True", "QuotaExceeded"),
        on_fail=logs,
    )

    # The quota goes: the Job controller retries (backing off up to a minute) and the pod is created.
    kubectl.run("delete", "resourcequota", "no-pods")
    wait(f"a pod of Job {job}", lambda: kubectl.get("pods", None, "-l", f"job-name={job}"), timeout_s=150)
    wait(
        "chat-v1 back to Converting",
        lambda: condition(kubectl.get("mv", "chat-v1"), "Ready") == ("False", "Converting"),
        on_fail=logs,
    )
    delete_example(kubectl, wait, logs)


def delete_example(kubectl, wait, logs) -> None:
    """Delete examples/model.yaml while the operator still runs, so that its finalizer lets the versions
    go (else they, and the test's namespace, would stay Terminating)."""
    kubectl.run("delete", "-f", str(EXAMPLE), "--ignore-not-found", "--wait=false", check=False)
    wait("no ModelVersion left", lambda: kubectl.get("mv") == [], on_fail=logs)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def healthz(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            return json.loads(response.read())
    except OSError:
        return None


def test_an_operator_without_its_peering_says_so_then_resumes(
    namespace, kubectl, cluster_kubectl, crds, wait
):
    """Without --standalone kopf needs a KopfPeering in each served namespace. While it is missing the
    operator logs a WARNING naming it and /healthz says so; once it exists, kopf resumes on its own."""
    peering, port = f"e2e-{namespace}", free_port()
    kubectl.run("apply", "-f", str(EXAMPLE))
    kopf_crds = ("clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev")
    found = cluster_kubectl.run("get", "crd", *kopf_crds, "--ignore-not-found", "-o", "name").stdout.split()
    installed_here = sorted(set(kopf_crds) - {name.split("/", 1)[1] for name in found})
    env = {"MODELFLEET_OPERATOR_PEERING": peering, "MODELFLEET_OPERATOR_HEALTH_PORT": str(port)}
    with running_operator(namespace, **env) as log:
        logs = lambda: "operator log (tail):\n" + log.read_text()[-4000:]  # noqa: E731
        name = f"KopfPeering {namespace}/{peering}"
        warning = wait(
            "the peering WARNING",
            lambda: [line for line in log.read_text().splitlines() if "WARNING" in line and name in line],
            timeout_s=60,
            on_fail=logs,
        )
        assert "--standalone" in warning[0] and "crds/kopf-peering.yaml" in warning[0]
        health = wait("/healthz", lambda: healthz(port), on_fail=logs)
        assert name in health["peering"]
        assert kubectl.get("jobs") == []  # kopf is paused: nothing was reconciled

        try:
            if installed_here:
                cluster_kubectl.run(
                    "apply", "-f", str(ROOT / "charts" / "modelfleet" / "crds" / "kopf-peering.yaml")
                )
                for crd in kopf_crds:
                    cluster_kubectl.run("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")
            obj = {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": peering}}
            kubectl.run("apply", "-f", "-", stdin=json.dumps(obj))
            wait(
                f"Job {JOBS['v1'][0]} (kopf resumed)", lambda: kubectl.get("job", JOBS["v1"][0]), on_fail=logs
            )
            wait(
                "/healthz ok",
                lambda: (healthz(port) or {}).get("peering") == f"ok: {name}",
                timeout_s=60,
                on_fail=logs,
            )
        finally:
            delete_example(kubectl, wait, logs)
    if (
        installed_here
    ):  # leave the cluster as found (the namespace and its peering object go with the fixture)
        cluster_kubectl.run(
            "delete", "crd", *installed_here, "--ignore-not-found", "--wait=false", check=False
        )
