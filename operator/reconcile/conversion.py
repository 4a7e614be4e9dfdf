"""Conversion Jobs of a ModelVersion, and reading their results back.

Each target gets one Job running `modelfleet convert` in the data-plane image. The converter writes a
compact JSON summary of the artifact to the container's termination log; the kubelet turns it into the
container's termination message, which is how the result reaches the operator without any shared storage
or extra API permissions for the Job.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any, Literal

from modelfleet.converters.formats import Target, hardware
from modelfleet.operator.api import ModelVersion, ModelVersionSpec, SecretKey
from modelfleet.operator.reconcile import names
from modelfleet.operator.settings import OperatorSettings

CONTAINER = "convert"
PVC_ROOT = "/mnt/pvc"  # the converter resolves pvc://CLAIM/PATH to PVC_ROOT/CLAIM/PATH
TERMINATION_LOG = "/dev/termination-log"
MAX_MESSAGE = 1024
# `modelfleet convert` exit codes: 1 failed (perhaps transiently), 2 bad input, 3 a needed tool is
# missing, 4 validation failed. Only 1 is worth a retry; the others fail the Job at once.
FINAL_EXIT_CODES = (2, 3, 4)
EXIT_REASONS = {1: "ConversionFailed", 2: "InvalidSource", 3: "ToolMissing", 4: "ValidationFailed"}


def artifact_dir(
    settings: OperatorSettings, model: str, version: str, target: Target, quantized_lm_head: bool = False
) -> str:
    """Where the Job writes the artifact: the model store claim, mounted under the converter's PVC root,
    so the converter reports it as pvc://<store claim>/artifacts/... (see `traffic.local_path`)."""
    slug = names.artifact_slug(target, quantized_lm_head)
    return f"{PVC_ROOT}/{settings.model_store_claim}/artifacts/{model}/{version}/{slug}"


def quantizes_lm_head(spec: ModelVersionSpec, target: Target) -> bool:
    """Whether `target`'s artifact quantizes lm_head: asked by the spec, and an int8/fp8 torch target
    (the converter refuses the option for any other; a version's float reference target never gets it)."""
    return spec.quantize_lm_head and target.quantized_torch


@dataclass(frozen=True)
class SourceMount:
    """The source URI as the converter gets it, and the extra claim the pod must mount for it."""

    uri: str
    claim: str | None = None


def source_mount(uri: str, settings: OperatorSettings) -> SourceMount:
    """pvc://<claim>/<path> is mounted read-only under the PVC root; file:// paths are on the model store
    (with or without its mount path in front); http(s)://, s3:// and hf:// are fetched by the converter."""
    scheme, _, rest = uri.partition("://")
    if scheme == "file":
        path = "/" + rest.lstrip("/")
        store = settings.model_store_path.rstrip("/") + "/"
        relative = path.removeprefix(store) if path.startswith(store) else path.lstrip("/")
        return SourceMount(f"pvc://{settings.model_store_claim}/{relative}")
    if scheme == "pvc":
        claim = rest.partition("/")[0]
        return SourceMount(uri, None if claim == settings.model_store_claim else claim)
    return SourceMount(uri)


def _token_env(secret: SecretKey | None) -> list[dict[str, Any]]:
    """HF_TOKEN from the Secret the ModelVersion names: the kubelet reads it, the operator never does."""
    if secret is None:
        return []
    return [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}}}]


def _needs_device(target: Target) -> bool:
    # A TensorRT engine is built for the GPU it will run on, and an fp8 artifact is validated in fp8,
    # which needs the hardware; everything else converts on CPU and is validated there.
    return target.format == "tensorrt" or target.dtype == "fp8"


def conversion_command(
    source: str, target: Target, out: str, sha256: str | None = None, quantize_lm_head: bool = False
) -> list[str]:
    command = ["modelfleet", "convert", "--source", source]
    command += ["--target", target.accelerator, "--format", target.format, "--dtype", target.dtype]
    if quantize_lm_head:
        command += ["--quantize-lm-head"]
    # --force: a version name may come back (deleted, re-created with new weights); never keep the old one.
    command += ["--out", out, "--force", "--termination-log", TERMINATION_LOG]
    if sha256:
        command += ["--sha256", sha256]
    return command


def conversion_job(
    mv: dict[str, Any], version: ModelVersion, target: Target, settings: OperatorSettings
) -> dict:
    """The Job that converts `version`'s source into one target artifact."""
    spec = version.spec
    name = names.conversion_job_name(mv["metadata"]["name"], target)
    source = source_mount(spec.source.uri, settings)
    labels = {
        **names.common_labels(spec.model, "conversion"),
        names.LABEL_VERSION: mv["metadata"]["name"],
        names.LABEL_TARGET: names.target_slug(target),
    }
    resources: dict[str, dict[str, str]] = {
        "requests": {"cpu": settings.conversion_cpu, "memory": settings.conversion_memory},
        "limits": {"memory": settings.conversion_memory},
    }
    pod_spec: dict[str, Any] = {}
    hw = hardware(target.accelerator)
    if _needs_device(target) and hw.resource_name:
        resources["requests"][hw.resource_name] = "1"
        resources["limits"][hw.resource_name] = "1"
        if hw.node_label:
            pod_spec["nodeSelector"] = {hw.node_label[0]: hw.node_label[1]}
        pod_spec["tolerations"] = [{"key": hw.resource_name, "operator": "Exists", "effect": "NoSchedule"}]
    if settings.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in settings.image_pull_secrets]
    mounts = [
        {"name": "model-store", "mountPath": f"{PVC_ROOT}/{settings.model_store_claim}"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "model-store", "persistentVolumeClaim": {"claimName": settings.model_store_claim}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if source.claim:
        volume = names.bounded_name("source", source.claim)
        mounts.append({"name": volume, "mountPath": f"{PVC_ROOT}/{source.claim}", "readOnly": True})
        volumes.append(
            {"name": volume, "persistentVolumeClaim": {"claimName": source.claim, "readOnly": True}}
        )
    lm_head = quantizes_lm_head(spec, target)
    out = artifact_dir(settings, spec.model, spec.version, target, lm_head)
    container = {
        "name": CONTAINER,
        "image": settings.dataplane_image,
        "imagePullPolicy": settings.dataplane_image_pull_policy,
        "command": conversion_command(source.uri, target, out, spec.source.sha256, lm_head),
        "env": [
            {"name": "MODELFLEET_PVC_ROOT", "value": PVC_ROOT},
            {"name": "HF_HOME", "value": "/tmp/hf"},
            {"name": "HOME", "value": "/tmp"},
            *(
                [{"name": "MODELFLEET_SOURCE_ALLOW_HOSTS", "value": settings.conversion_source_allow_hosts}]
                if settings.conversion_source_allow_hosts
                else []
            ),
            *_token_env(spec.source.token_secret),
        ],
        "resources": resources,
        # The summary is written to the termination log; a crash before that still leaves the log tail.
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security(),
        "volumeMounts": mounts,
    }
    final_exit = {"containerName": CONTAINER, "operator": "In", "values": list(FINAL_EXIT_CODES)}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": mv["metadata"]["namespace"],
            "labels": labels,
            "ownerReferences": [names.owner_reference(mv)],
        },
        "spec": {
            "backoffLimit": settings.conversion_backoff_limit,
            "activeDeadlineSeconds": settings.conversion_deadline_seconds,
            "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": final_exit}]},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    "securityContext": _pod_security(),
                    "containers": [container],
                    "volumes": volumes,
                    **pod_spec,
                },
            },
        },
    }


def _pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "fsGroup": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


# --- results ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConversionResult:
    """What a finished conversion reported."""

    ok: bool
    artifact: dict[str, Any] | None = None
    reason: str = ""
    message: str = ""


@dataclass(frozen=True)
class JobOutcome:
    # blocked: the Job exists but its pod cannot be created (a ResourceQuota, an admission webhook); the
    # Job controller keeps retrying, so this may clear by itself. `reason` and `message` say why.
    state: Literal["missing", "running", "blocked", "succeeded", "failed"]
    result: ConversionResult | None = None
    message: str = ""
    reason: str = ""


def _failure_reason(text: str, exit_code: int | None) -> str:
    """A condition reason for a failed conversion: from its exit code, SourceNotFound when it says so."""
    if exit_code in (None, 2) and ("does not exist" in text or "not found" in text.lower()):
        return "SourceNotFound"
    return EXIT_REASONS.get(exit_code or 0, "ConversionFailed")


def parse_summary(text: str | None, target: Target, exit_code: int | None = None) -> ConversionResult:
    """The converter's termination message -> result. Anything unparseable is a failure that says so."""
    if not text or not text.strip():
        return ConversionResult(False, reason="NoResult", message="the conversion left no result summary")
    try:
        summary = json.loads(text.strip().splitlines()[-1])
    except ValueError:
        # Not a summary: the container crashed and the kubelet kept the tail of its log instead.
        tail = text.strip().splitlines()[-1][:MAX_MESSAGE]
        return ConversionResult(False, reason="JobFailed", message=tail)
    if not isinstance(summary, dict):
        return ConversionResult(False, reason="NoResult", message="the result summary is not a JSON object")
    if not summary.get("ok"):
        said = str(summary.get("reason") or summary.get("message") or "the conversion failed")
        reason = said if said.isidentifier() else _failure_reason(said, exit_code)
        return ConversionResult(False, reason=reason, message=said[:MAX_MESSAGE])
    if not summary.get("uri"):
        return ConversionResult(False, reason="NoResult", message="the result summary names no artifact uri")
    artifact = {
        "accelerator": summary.get("accelerator") or target.accelerator,
        "format": summary.get("format") or target.format,
        "dtype": summary.get("dtype") or target.dtype,
        "uri": summary["uri"],
    }
    if summary.get("sha256"):
        artifact["sha256"] = summary["sha256"]
    if isinstance(summary.get("sizeBytes"), int):
        artifact["sizeBytes"] = summary["sizeBytes"]
    if isinstance(summary.get("validation"), dict):
        artifact["validation"] = summary["validation"]
    return ConversionResult(True, artifact=artifact)


def _last_termination(pods: list[dict[str, Any]]) -> tuple[str | None, int | None]:
    """(message, exit code) of the newest terminated `convert` container among the Job's pods."""
    finished = []
    for pod in pods:
        for status in pod.get("status", {}).get("containerStatuses", []) or []:
            terminated = (status.get("state") or {}).get("terminated")
            if status.get("name") == CONTAINER and terminated:
                stamp = terminated.get("finishedAt") or ""
                finished.append((stamp, terminated.get("message"), terminated.get("exitCode")))
    if not finished:
        return None, None
    _, message, code = max(finished, key=lambda item: item[0])
    return message, code


# The Job controller's Events about creating the Job's pods; only the newest one tells the present.
POD_CREATION_EVENTS = ("FailedCreate", "SuccessfulCreate")
POD_CREATION_REASONS = ("QuotaExceeded", "PodCreationFailed")
_EPOCH = dt.datetime.min.replace(tzinfo=dt.UTC)


def _event_time(event: dict[str, Any]) -> dt.datetime:
    """When an Event last happened: core/v1 events carry lastTimestamp, events.k8s.io ones eventTime and
    series.lastObservedTime."""
    stamps = [
        (event.get("series") or {}).get("lastObservedTime"),
        event.get("lastTimestamp"),
        event.get("eventTime"),
        event.get("firstTimestamp"),
        (event.get("metadata") or {}).get("creationTimestamp"),
    ]
    parsed = []
    for stamp in stamps:
        try:
            parsed.append(dt.datetime.fromisoformat(str(stamp)))
        except ValueError:
            continue
    return max(parsed, default=_EPOCH)


def pod_creation_failure(events: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(reason, message) when the newest pod-creation Event of a Job is a FailedCreate, else None.

    A Job whose pods are refused shows nothing in its status; the Job controller says why only in these
    Events. A later SuccessfulCreate means the refusal is over (a tie counts as over: never cry wolf).
    """
    relevant = [e for e in events if e.get("reason") in POD_CREATION_EVENTS]
    if not relevant:
        return None
    newest = max(relevant, key=lambda e: (_event_time(e), e.get("reason") == "SuccessfulCreate"))
    if newest.get("reason") != "FailedCreate":
        return None
    message = str(newest.get("message") or newest.get("note") or "the Job controller could not create a pod")
    reason = "QuotaExceeded" if "exceeded quota" in message else "PodCreationFailed"
    return reason, message[:MAX_MESSAGE]


def job_outcome(
    job: dict[str, Any] | None,
    pods: list[dict[str, Any]],
    target: Target,
    events: list[dict[str, Any]] | None = None,
) -> JobOutcome:
    """Where one conversion stands, from its Job, the Job's pods and (while it has none) its Events."""
    if job is None:
        return JobOutcome("missing")
    conditions = {c.get("type"): c for c in job.get("status", {}).get("conditions", []) or []}
    done = conditions.get("Complete") or conditions.get("SuccessCriteriaMet")
    failed = conditions.get("Failed")
    if done and done.get("status") == "True":
        message, _ = _last_termination(pods)
        return JobOutcome("succeeded", parse_summary(message, target))
    if failed and failed.get("status") == "True":
        message, code = _last_termination(pods)
        result = parse_summary(message, target, code)
        if result.ok or result.reason == "NoResult":
            job_says = f"{failed.get('reason', 'Failed')}: {failed.get('message', '')}".strip(": ")
            result = ConversionResult(False, reason="JobFailed", message=job_says[:MAX_MESSAGE])
        return JobOutcome("failed", result)
    refused = pod_creation_failure(events or [])
    if refused is not None:
        return JobOutcome("blocked", reason=refused[0], message=refused[1])
    return JobOutcome("running", message="conversion Job is running")
