"""Desired serving objects of an InferenceModel: valid manifests, hardware placement, safety, and a pod
template that traffic never touches."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
from modelfleet.dataplane import LLM
from modelfleet.dataplane.manifest import ServingManifest
from modelfleet.operator import schema_checks
from modelfleet.operator.api import InferenceModel
from modelfleet.operator.reconcile import serving
from modelfleet.operator.reconcile.plan import serving_plan, version_views
from modelfleet.operator.reconcile.traffic import plan_traffic
from modelfleet.operator.settings import OperatorSettings

SETTINGS = OperatorSettings(
    dataplane_image="registry.example/modelfleet:1.2.3", dataplane_api_keys_secret="keys"
)


def ready(mv: dict, *artifacts: tuple[str, str, str]) -> dict:
    mv = copy.deepcopy(mv)
    version = mv["spec"]["version"]
    mv["status"] = {
        "phase": "Ready",
        "artifacts": [
            {
                "accelerator": a,
                "format": f,
                "dtype": d,
                "uri": f"file:///models/artifacts/chat/{version}/{a}-{f}-{d}",
            }
            for a, f, d in artifacts
        ],
    }
    return mv


def plan_for(im: dict, mvs: list[dict]):
    spec = InferenceModel.model_validate(im).spec
    planned = plan_traffic(spec, version_views(mvs, im["metadata"]["name"]), SETTINGS)
    return serving_plan(im, spec, planned, SETTINGS), planned


def by_kind(plan) -> dict:
    return {obj["kind"]: obj for obj in plan.apply}


def pod_template(im: dict, mvs: list[dict]) -> dict:
    return by_kind(plan_for(im, mvs)[0])["Deployment"]["spec"]["template"]


@pytest.fixture()
def both_ready(example_objects):
    im = example_objects["chat"]
    v1 = ready(example_objects["chat-v1"], ("nvidia-h100", "torch", "bf16"))
    v2 = ready(example_objects["chat-v2"], ("nvidia-h100", "torch", "bf16"), ("nvidia-h100", "torch", "fp8"))
    return im, [v1, v2]


@pytest.mark.parametrize("k8s_version", ["1.30.0", "1.37.0"])
def test_every_serving_object_passes_kubernetes_validate_strict(both_ready, k8s_version):
    im, mvs = both_ready
    im = copy.deepcopy(im)
    im["spec"]["replicas"] = {"min": 2, "max": 4}  # so that the HPA and the PDB exist too
    plan, _ = plan_for(im, mvs)
    assert sorted(by_kind(plan)) == [
        "ConfigMap",
        "Deployment",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "Service",
    ]
    for obj in plan.apply:
        kubernetes_validate.validate(obj, k8s_version, strict=True)


def test_manifest_serves_the_requested_split_with_the_quantized_artifact(both_ready):
    im, mvs = both_ready
    plan, _ = plan_for(im, mvs)
    text = by_kind(plan)["ConfigMap"]["data"]["manifest.yaml"]
    manifest = ServingManifest.from_yaml(text)
    (model,) = manifest.models
    assert model.name == "chat"
    assert [(v.name, v.weight) for v in model.versions] == [("v1", 90), ("v2", 10)]
    # v2 asked for fp8, so its fp8 artifact is served; v1 gets the full-precision one.
    assert model.versions[0].artifact == "/models/artifacts/chat/v1/nvidia-h100-torch-bf16"
    assert model.versions[1].artifact == "/models/artifacts/chat/v2/nvidia-h100-torch-fp8"
    assert model.routing.stickyBy == "user"
    assert model.engine == {
        "max_num_seqs": 128,
        "kv_cache_memory_fraction": 0.9,
        "enable_prefix_caching": True,
        "max_model_len": 4096,
    }
    assert all(v.preload for v in model.versions)  # loading.mode: eager


def test_the_step_budget_and_held_steps_of_spec_engine_reach_the_engine(
    both_ready, tiny_model_dir, crd_files
):
    """spec.engine.maxNumBatchedTokens and prefillWaitSteps, through the serving manifest, set the engine's
    scheduler; unset, the manifest leaves both to the engine's defaults."""
    im, mvs = both_ready
    plan, _ = plan_for(im, mvs)
    unset = ServingManifest.from_yaml(by_kind(plan)["ConfigMap"]["data"]["manifest.yaml"]).models[0].engine
    assert "max_num_batched_tokens" not in unset and "prefill_wait_steps" not in unset
    im = copy.deepcopy(im)
    im["spec"]["engine"].update(maxNumBatchedTokens=96, prefillWaitSteps=3, maxModelLen=128)
    assert not schema_checks.admit(crd_files["InferenceModel"], im).errors  # the API server takes it
    plan, _ = plan_for(im, mvs)
    (model,) = ServingManifest.from_yaml(by_kind(plan)["ConfigMap"]["data"]["manifest.yaml"]).models
    assert model.engine["max_num_batched_tokens"] == 96 and model.engine["prefill_wait_steps"] == 3
    engine = LLM(tiny_model_dir, device="cpu", dtype="float32", kv_cache_bytes=1 << 21, **model.engine).engine
    assert engine.scheduler.max_num_batched_tokens == 96
    assert engine.scheduler.prefill_wait_steps == 3


def test_traffic_change_leaves_the_pod_template_unchanged(both_ready):
    im, mvs = both_ready
    before_plan, _ = plan_for(im, mvs)
    changed = copy.deepcopy(im)
    changed["spec"]["traffic"] = [{"version": "v1", "weight": 50}, {"version": "v2", "weight": 50}]
    changed["metadata"]["generation"] = 2
    after_plan, _ = plan_for(changed, mvs)
    before, after = by_kind(before_plan), by_kind(after_plan)
    assert after["Deployment"] == before["Deployment"]
    assert after["Service"] == before["Service"]
    assert after["ConfigMap"] != before["ConfigMap"]
    assert "weight: 50" in after["ConfigMap"]["data"]["manifest.yaml"]


def test_versions_becoming_ready_leave_the_pod_template_unchanged(example_objects, both_ready):
    im, ready_mvs = both_ready
    converting = [example_objects["chat-v1"], example_objects["chat-v2"]]
    assert pod_template(im, converting) == pod_template(im, ready_mvs)


@pytest.mark.parametrize(
    ("accelerator", "resource", "label"),
    [
        ("nvidia-h100", "nvidia.com/gpu", ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3")),
        ("amd-mi300x", "amd.com/gpu", ("amd.com/gpu.product-name", "AMD_Instinct_MI300X_OAM")),
        ("cpu", None, None),
    ],
)
def test_devices_and_node_selection_follow_the_hardware_class(example_objects, accelerator, resource, label):
    im = copy.deepcopy(example_objects["chat"])
    im["spec"]["hardware"] = {
        "accelerator": accelerator,
        "count": 2,
        "nodeSelector": {"pool": "inference"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
    }
    pod = pod_template(im, [])["spec"]
    limits = pod["containers"][0]["resources"]["limits"]
    tolerated = [t["key"] for t in pod.get("tolerations", [])]
    if resource:
        assert limits[resource] == "2"
        assert pod["nodeSelector"] == {"pool": "inference", label[0]: label[1]}
        assert tolerated == ["dedicated", resource]
    else:
        assert set(limits) == {"memory"}
        assert pod["nodeSelector"] == {"pool": "inference"}
        assert tolerated == ["dedicated"]


def test_pod_is_locked_down_probed_scraped_and_drains(both_ready):
    im, mvs = both_ready
    template = pod_template(im, mvs)
    pod = template["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "registry.example/modelfleet:1.2.3"
    assert container["command"] + container["args"] == [
        "modelfleet",
        "serve",
        "--manifest",
        "/etc/modelfleet/manifest.yaml",
        "--port",
        "8000",
    ]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["terminationGracePeriodSeconds"] == SETTINGS.dataplane_termination_grace_seconds >= 60
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["model-store"]["readOnly"] is True and mounts["model-store"]["mountPath"] == "/models"
    # Mounted as a directory (no subPath): the kubelet then updates the file in place on a traffic change.
    assert mounts["manifest"]["mountPath"] == "/etc/modelfleet" and "subPath" not in mounts["manifest"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["OTEL_SERVICE_NAME"] == "modelfleet-dataplane"
    assert env["MODELFLEET_API_KEY_FILE"] == "/etc/modelfleet-keys/keys"


def test_hpa_only_when_replicas_may_vary_and_always_a_pdb(example_objects):
    im = copy.deepcopy(example_objects["chat"])  # replicas 1..3
    plan, _ = plan_for(im, [])
    kinds = by_kind(plan)
    hpa = kinds["HorizontalPodAutoscaler"]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (1, 3)
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "modelfleet_pod_requests_waiting"
    assert "replicas" not in kinds["Deployment"]["spec"]  # the HPA owns it
    assert plan.remove == []
    assert kinds["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1  # never blocks a drain of 1 pod

    im["spec"]["replicas"] = {"min": 2, "max": 2}
    plan, _ = plan_for(im, [])
    kinds = by_kind(plan)
    assert kinds["Deployment"]["spec"]["replicas"] == 2
    assert kinds["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1
    assert [r.kind for r in plan.remove] == ["HorizontalPodAutoscaler"]


def test_children_are_owned_by_the_model(both_ready):
    im, mvs = both_ready
    plan, _ = plan_for(im, mvs)
    for obj in plan.apply:
        (owner,) = obj["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": "modelfleet.dev/v1alpha1",
            "kind": "InferenceModel",
            "name": "chat",
            "uid": im["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert obj["metadata"]["namespace"] == "team-a"
    service = by_kind(plan)["Service"]
    assert service["spec"]["selector"] == by_kind(plan)["Deployment"]["spec"]["selector"]["matchLabels"]
    assert serving.endpoint(im, SETTINGS) == "http://chat.team-a.svc:8000/v1"


def test_nothing_servable_renders_an_empty_manifest(example_objects):
    plan, planned = plan_for(example_objects["chat"], [example_objects["chat-v1"]])
    assert [p.weight for p in planned] == [0, 0]
    assert ServingManifest.from_yaml(by_kind(plan)["ConfigMap"]["data"]["manifest.yaml"]).models == []
