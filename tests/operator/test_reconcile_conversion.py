"""Conversion Jobs of a ModelVersion and the version's status from their outcomes."""

from __future__ import annotations

import copy
import json

import kubernetes_validate
import pytest
from modelfleet.converters.formats import Target
from modelfleet.operator.api import ModelVersion
from modelfleet.operator.reconcile import conversion, names
from modelfleet.operator.reconcile.conversion import ConversionResult, JobOutcome, job_outcome, parse_summary
from modelfleet.operator.reconcile.targets import TargetError, resolve_targets
from modelfleet.operator.reconcile.version_status import version_status
from modelfleet.operator.settings import OperatorSettings

SETTINGS = OperatorSettings(conversion_backoff_limit=3)
BF16 = Target("nvidia-h100", "torch", "bf16")
FP8 = Target("nvidia-h100", "torch", "fp8")


def summary(target: Target = BF16, **extra) -> str:
    return json.dumps(
        {
            "ok": True,
            "accelerator": target.accelerator,
            "format": target.format,
            "dtype": target.dtype,
            "uri": f"pvc://modelfleet-models/artifacts/chat/v2/{names.target_slug(target)}",
            "sha256": "ab" * 32,
            "sizeBytes": 1234,
            "validation": {"maxLogitDiff": 0.01, "top1Agreement": 1.0},
            **extra,
        }
    )


def job(conditions=(), name="chat-v2-convert-nvidia-h100-torch-bf16") -> dict:
    return {
        "metadata": {"name": name},
        "status": {
            "conditions": [{"type": t, "status": "True", "reason": r, "message": m} for t, r, m in conditions]
        },
    }


def pod(message: str | None, finished="2026-01-01T00:00:00Z", exit_code=0) -> dict:
    terminated = {"exitCode": exit_code, "finishedAt": finished, **({"message": message} if message else {})}
    return {"status": {"containerStatuses": [{"name": "convert", "state": {"terminated": terminated}}]}}


def test_targets_default_from_the_model_hardware_and_quantization(example_objects):
    v2 = ModelVersion.model_validate(example_objects["chat-v2"]).spec  # quantization fp8
    assert resolve_targets(v2, "nvidia-h100") == [BF16, FP8]
    with pytest.raises(TargetError) as caught:
        resolve_targets(v2, "nvidia-a100")  # no fp8 on Ampere
    assert caught.value.reason == "NoTargetForHardware" and "fp8" in str(caught.value)
    with pytest.raises(TargetError) as caught:
        resolve_targets(v2, None)
    assert caught.value.reason == "ModelNotFound"


def test_explicit_targets_are_checked_against_the_table(example_objects):
    mv = copy.deepcopy(example_objects["chat-v1"])
    mv["spec"]["targets"] = [{"accelerator": "cpu", "format": "tensorrt", "dtype": "fp16"}]
    with pytest.raises(TargetError, match="not served on cpu") as caught:
        resolve_targets(ModelVersion.model_validate(mv).spec, "nvidia-h100")
    assert caught.value.reason == "InvalidTarget"


@pytest.mark.parametrize("k8s_version", ["1.30.0", "1.37.0"])
def test_conversion_job_is_valid_owned_and_deterministic(example_objects, k8s_version):
    mv = example_objects["chat-v2"]
    version = ModelVersion.model_validate(mv)
    job_ = conversion.conversion_job(mv, version, FP8, SETTINGS)
    kubernetes_validate.validate(job_, k8s_version, strict=True)
    assert job_ == conversion.conversion_job(copy.deepcopy(mv), version, FP8, SETTINGS)
    assert job_["metadata"]["name"] == "chat-v2-convert-nvidia-h100-torch-fp8"
    assert job_["metadata"]["ownerReferences"][0]["uid"] == mv["metadata"]["uid"]
    assert job_["spec"]["backoffLimit"] == 3
    (container,) = job_["spec"]["template"]["spec"]["containers"]
    assert container["command"] == [
        "modelfleet",
        "convert",
        "--source",
        "pvc://models/chat/v2",
        "--target",
        "nvidia-h100",
        "--format",
        "torch",
        "--dtype",
        "fp8",
        "--out",
        "/mnt/pvc/modelfleet-models/artifacts/chat/v2/nvidia-h100-torch-fp8",
        "--force",
        "--termination-log",
        "/dev/termination-log",
    ]
    rules = job_["spec"]["podFailurePolicy"]["rules"]
    assert rules == [
        {
            "action": "FailJob",
            "onExitCodes": {"containerName": "convert", "operator": "In", "values": [2, 3, 4]},
        }
    ]
    # fp8 is validated on the hardware itself: one GPU, on an H100 node.
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert job_["spec"]["template"]["spec"]["nodeSelector"] == {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"
    }
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    # The converter finds pvc://CLAIM/PATH under its PVC root, where each claim is mounted by name.
    assert mounts["source-models"] == {
        "name": "source-models",
        "mountPath": "/mnt/pvc/models",
        "readOnly": True,
    }
    assert mounts["model-store"] == {"name": "model-store", "mountPath": "/mnt/pvc/modelfleet-models"}
    assert {"name": "MODELFLEET_PVC_ROOT", "value": "/mnt/pvc"} in container["env"]


def lm_head_version(example_objects, **spec) -> dict:
    """examples/model.yaml's chat-v2 (fp8) with spec.quantizeLmHead, and `spec` over it."""
    mv = copy.deepcopy(example_objects["chat-v2"])
    mv["spec"].update(quantizeLmHead=True, **spec)
    return mv


def job_command(mv: dict, target: Target) -> list[str]:
    job_ = conversion.conversion_job(mv, ModelVersion.model_validate(mv), target, SETTINGS)
    return job_["spec"]["template"]["spec"]["containers"][0]["command"]


def out_of(command: list[str]) -> str:
    return command[command.index("--out") + 1]


def test_quantize_lm_head_reaches_the_quantized_targets_job_only(example_objects):
    mv = lm_head_version(example_objects)
    assert resolve_targets(ModelVersion.model_validate(mv).spec, "nvidia-h100") == [BF16, FP8]
    fp8 = job_command(mv, FP8)
    assert fp8[fp8.index("--dtype") : fp8.index("--out")] == ["--dtype", "fp8", "--quantize-lm-head"]
    assert out_of(fp8) == "/mnt/pvc/modelfleet-models/artifacts/chat/v2/nvidia-h100-torch-fp8-lm-head"
    # The bf16 target is the float reference: the converter would refuse the option there.
    bf16 = job_command(mv, BF16)
    assert "--quantize-lm-head" not in bf16
    assert bf16 == job_command(example_objects["chat-v2"], BF16)


def test_a_quantized_lm_head_artifact_has_its_own_folder(example_objects):
    plain, head = (
        job_command(example_objects["chat-v2"], FP8),
        job_command(lm_head_version(example_objects), FP8),
    )
    assert "--quantize-lm-head" not in plain
    assert out_of(plain) != out_of(head) and out_of(head).startswith(out_of(plain))
    assert names.artifact_slug(FP8) == names.target_slug(FP8) == "nvidia-h100-torch-fp8"
    assert names.artifact_slug(FP8, quantized_lm_head=True) == "nvidia-h100-torch-fp8-lm-head"


@pytest.mark.parametrize(
    ("spec", "accelerator", "reason"),
    [
        # cpu quantizes to onnx by default: nothing would quantize lm_head.
        ({"quantization": "int8"}, "cpu", "NoTargetForHardware"),
        (
            {"targets": [{"accelerator": "nvidia-h100", "format": "torch", "dtype": "bf16"}]},
            "nvidia-h100",
            "InvalidTarget",
        ),
        (
            {"quantization": "int8", "targets": [{"accelerator": "cpu", "format": "onnx", "dtype": "int8"}]},
            "cpu",
            "InvalidTarget",
        ),
    ],
)
def test_quantize_lm_head_without_a_torch_int8_or_fp8_target_is_refused(
    example_objects, spec, accelerator, reason
):
    mv = lm_head_version(example_objects, **spec)
    with pytest.raises(
        TargetError, match=r"^spec\.quantizeLmHead: it applies to torch int8/fp8 targets"
    ) as caught:
        resolve_targets(ModelVersion.model_validate(mv).spec, accelerator)
    assert caught.value.reason == reason


def test_an_explicit_torch_int8_target_quantizes_lm_head_on_cpu(example_objects):
    int8 = {"accelerator": "cpu", "format": "torch", "dtype": "int8"}
    mv = lm_head_version(example_objects, quantization="int8", targets=[int8])
    (target,) = resolve_targets(ModelVersion.model_validate(mv).spec, "cpu")
    assert "--quantize-lm-head" in job_command(mv, target)


def test_full_precision_conversion_needs_no_gpu(example_objects):
    mv = example_objects["chat-v1"]
    job_ = conversion.conversion_job(mv, ModelVersion.model_validate(mv), BF16, SETTINGS)
    limits = job_["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert "nvidia.com/gpu" not in limits and "nodeSelector" not in job_["spec"]["template"]["spec"]


def test_long_names_are_bounded_and_stable():
    long_name = "a-very-long-model-version-name-that-goes-on-and-on-and-on"
    first = names.conversion_job_name(long_name, BF16)
    assert len(first) <= 63 and first == names.conversion_job_name(long_name, BF16)
    assert first != names.conversion_job_name(long_name, FP8)


@pytest.mark.parametrize(
    ("uri", "passed", "claim"),
    [
        ("file:///models/raw/chat", "pvc://modelfleet-models/raw/chat", None),
        ("file:///raw/chat", "pvc://modelfleet-models/raw/chat", None),
        ("pvc://modelfleet-models/raw/chat", "pvc://modelfleet-models/raw/chat", None),
        ("pvc://team-weights/chat/v1", "pvc://team-weights/chat/v1", "team-weights"),
        ("s3://bucket/chat/v1", "s3://bucket/chat/v1", None),
    ],
)
def test_source_locations(uri, passed, claim):
    assert conversion.source_mount(uri, SETTINGS) == conversion.SourceMount(passed, claim)


def test_source_digest_is_passed_on(example_objects):
    mv = copy.deepcopy(example_objects["chat-v1"])
    mv["spec"]["source"]["sha256"] = "ab" * 32
    job_ = conversion.conversion_job(mv, ModelVersion.model_validate(mv), BF16, SETTINGS)
    assert job_["spec"]["template"]["spec"]["containers"][0]["command"][-2:] == ["--sha256", "ab" * 32]


def test_summary_parsing():
    ok = parse_summary(summary(), BF16)
    assert ok.ok and ok.artifact["sizeBytes"] == 1234 and ok.artifact["validation"]["top1Agreement"] == 1.0
    said = json.dumps({"ok": False, "accelerator": "nvidia-h100", "reason": "top-1 agreement 0.41 < 0.9"})
    failed = parse_summary(said, BF16, exit_code=4)
    assert (failed.ok, failed.reason, failed.message) == (
        False,
        "ValidationFailed",
        "top-1 agreement 0.41 < 0.9",
    )
    missing = json.dumps({"ok": False, "reason": "source pvc://m/x does not exist (looked at /mnt/pvc/m/x)"})
    assert parse_summary(missing, BF16, exit_code=2).reason == "SourceNotFound"
    assert (
        parse_summary(json.dumps({"ok": False, "reason": "no tensorrt"}), BF16, exit_code=3).reason
        == "ToolMissing"
    )
    assert parse_summary("Traceback...\nOSError: disk full", BF16).message == "OSError: disk full"
    assert parse_summary("", BF16).reason == "NoResult"
    assert parse_summary(json.dumps({"ok": True}), BF16).reason == "NoResult"


def test_job_outcomes():
    assert job_outcome(None, [], BF16).state == "missing"
    assert job_outcome(job(), [], BF16).state == "running"
    done = job_outcome(
        job([("Complete", "", "")]),
        [pod("old", "2026-01-01T00:00:00Z"), pod(summary(), "2026-01-01T00:05:00Z")],
        BF16,
    )
    assert done.state == "succeeded" and done.result.ok
    source_missing = json.dumps({"ok": False, "reason": "source s3://b/chat does not exist"})
    failed = job_outcome(
        job([("Failed", "PodFailurePolicy", "exit 2")]), [pod(source_missing, exit_code=2)], BF16
    )
    assert (failed.state, failed.result.reason) == ("failed", "SourceNotFound")
    deadline = job_outcome(job([("Failed", "DeadlineExceeded", "Job was active longer")]), [], BF16)
    assert (deadline.result.reason, deadline.result.message) == (
        "JobFailed",
        "DeadlineExceeded: Job was active longer",
    )


def status_for(outcomes, targets=(BF16, FP8), old=None, now="2026-01-01T00:00:00Z"):
    return version_status(generation=1, targets=list(targets), outcomes=outcomes, old_status=old, now=now)


def ready_condition(status):
    return next(c for c in status["conditions"] if c["type"] == "Ready")


def test_phase_moves_pending_converting_ready():
    pending = status_for({})
    assert pending["phase"] == "Pending" and ready_condition(pending)["reason"] == "Pending"
    converting = status_for(
        {"nvidia-h100-torch-bf16": JobOutcome("running"), "nvidia-h100-torch-fp8": JobOutcome("running")}
    )
    assert converting["phase"] == "Converting" and converting["artifacts"] == []
    half = status_for(
        {
            "nvidia-h100-torch-bf16": JobOutcome("succeeded", parse_summary(summary(), BF16)),
            "nvidia-h100-torch-fp8": JobOutcome("running"),
        }
    )
    assert half["phase"] == "Converting" and len(half["artifacts"]) == 1
    assert "1/2 done" in ready_condition(half)["message"]
    done = status_for(
        {
            "nvidia-h100-torch-bf16": JobOutcome("succeeded", parse_summary(summary(), BF16)),
            "nvidia-h100-torch-fp8": JobOutcome("succeeded", parse_summary(summary(FP8), FP8)),
        }
    )
    assert done["phase"] == "Ready" and ready_condition(done)["status"] == "True"
    assert [a["dtype"] for a in done["artifacts"]] == ["bf16", "fp8"]


def test_a_failed_target_fails_the_version_with_its_reason():
    bad = ConversionResult(False, reason="ValidationFailed", message="top-1 agreement 0.41 < 0.9")
    status = status_for(
        {"nvidia-h100-torch-bf16": JobOutcome("failed", bad), "nvidia-h100-torch-fp8": JobOutcome("running")}
    )
    cond = ready_condition(status)
    assert status["phase"] == "Failed" and cond["reason"] == "ValidationFailed"
    assert "nvidia-h100-torch-bf16" in cond["message"] and "0.41" in cond["message"]


def test_target_errors_become_conditions():
    missing = version_status(
        generation=3, targets=TargetError("ModelNotFound", "no model"), outcomes={}, old_status=None, now="t"
    )
    assert missing["phase"] == "Pending" and ready_condition(missing)["observedGeneration"] == 3
    unsupported = version_status(
        generation=3,
        targets=TargetError("NoTargetForHardware", "no fp8 on a100"),
        outcomes={},
        old_status=None,
        now="t",
    )
    assert (
        unsupported["phase"] == "Failed" and ready_condition(unsupported)["reason"] == "NoTargetForHardware"
    )


def test_transition_time_kept_while_the_status_holds():
    first = status_for({}, now="2026-01-01T00:00:00Z")
    again = status_for({}, old=first, now="2026-01-01T01:00:00Z")
    assert again == first  # nothing to write
    running = {"nvidia-h100-torch-bf16": JobOutcome("running")}
    later = status_for(running, old=first, now="2026-01-01T02:00:00Z")
    # Still not Ready (same status False): the transition time stays although the reason changed.
    assert ready_condition(later)["lastTransitionTime"] == "2026-01-01T00:00:00Z"


QUOTA = (
    'Error creating: pods "chat-v2-convert-nvidia-h100-torch-bf16-x7k2p" is forbidden: exceeded quota: '
    "no-pods, requested: pods=1, used: pods=0, limited: pods=0"
)
WEBHOOK = 'Error creating: admission webhook "policy.example.com" denied the request: no GPUs on Fridays'


def job_event(reason: str, message: str = "", at: str = "2026-01-01T00:00:00Z", **extra) -> dict:
    """A core/v1 Event of the Job controller about a conversion Job."""
    type_ = "Warning" if reason == "FailedCreate" else "Normal"
    return {"reason": reason, "type": type_, "message": message, "lastTimestamp": at, **extra}


def test_the_newest_pod_creation_event_decides():
    failure = conversion.pod_creation_failure
    assert failure([]) is None
    assert failure([job_event("FailedCreate", QUOTA)]) == ("QuotaExceeded", QUOTA)
    assert failure([job_event("FailedCreate", WEBHOOK)]) == ("PodCreationFailed", WEBHOOK)
    # The quota was lifted and the pod created: over.
    later_ok = [job_event("FailedCreate", QUOTA), job_event("SuccessfulCreate", at="2026-01-01T00:01:00Z")]
    assert failure(later_ok) is None
    # A pod was created, then a retry was refused: the refusal is the present.
    later_refused = [
        job_event("SuccessfulCreate"),
        job_event("FailedCreate", QUOTA, at="2026-01-01T00:01:00Z"),
    ]
    assert failure(later_refused) == ("QuotaExceeded", QUOTA)
    # Events of other reasons say nothing about pod creation; a tie is no refusal.
    assert failure([job_event("Completed"), job_event("SuccessfulDelete")]) is None
    assert failure([job_event("FailedCreate", QUOTA), job_event("SuccessfulCreate")]) is None


def test_events_of_the_new_api_are_read_by_their_own_times():
    """events.k8s.io/v1 events (also listed through core/v1) carry eventTime, series and `note`."""
    new_style = {
        "reason": "FailedCreate",
        "note": WEBHOOK,
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "series": {"count": 4, "lastObservedTime": "2026-01-01T00:09:00.000000Z"},
    }
    created = job_event("SuccessfulCreate", at="2026-01-01T00:05:00Z")
    assert conversion.pod_creation_failure([created, new_style]) == ("PodCreationFailed", WEBHOOK)
    unstamped = {"reason": "FailedCreate", "message": "x" * 5000}
    assert conversion.pod_creation_failure([unstamped]) == ("PodCreationFailed", "x" * conversion.MAX_MESSAGE)


def test_a_job_whose_pod_is_refused_is_blocked_until_it_finishes():
    refused = job_outcome(job(), [], BF16, [job_event("FailedCreate", QUOTA)])
    assert (refused.state, refused.reason, refused.message) == ("blocked", "QuotaExceeded", QUOTA)
    # Once the Job is finished its conditions speak, whatever old events say.
    done = job_outcome(
        job([("Complete", "", "")]), [pod(summary())], BF16, [job_event("FailedCreate", QUOTA)]
    )
    assert done.state == "succeeded"


def test_a_blocked_target_keeps_the_version_converting_and_says_why():
    status = status_for(
        {
            "nvidia-h100-torch-bf16": JobOutcome("blocked", reason="QuotaExceeded", message=QUOTA),
            "nvidia-h100-torch-fp8": JobOutcome("running"),
        }
    )
    cond = ready_condition(status)
    assert status["phase"] == "Converting"
    assert (cond["status"], cond["reason"]) == ("False", "QuotaExceeded")
    assert cond["message"] == f"conversion Job for nvidia-h100-torch-bf16 cannot create its pod: {QUOTA}"
    # A failed target outranks a blocked one: the version cannot become Ready anyway.
    bad = ConversionResult(False, reason="ValidationFailed", message="top-1 agreement 0.41 < 0.9")
    failed = status_for(
        {
            "nvidia-h100-torch-bf16": JobOutcome("blocked", reason="PodCreationFailed", message=WEBHOOK),
            "nvidia-h100-torch-fp8": JobOutcome("failed", bad),
        }
    )
    assert failed["phase"] == "Failed" and ready_condition(failed)["reason"] == "ValidationFailed"
    both = status_for(
        {
            "nvidia-h100-torch-bf16": JobOutcome("blocked", reason="PodCreationFailed", message=WEBHOOK),
            "nvidia-h100-torch-fp8": JobOutcome("blocked", reason="QuotaExceeded", message=QUOTA),
        }
    )
    assert ready_condition(both)["reason"] == "PodCreationFailed"
    assert ready_condition(both)["message"].endswith("(1 more target(s) blocked)")
