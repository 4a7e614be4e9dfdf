"""Desired children of an InferenceModel: manifest ConfigMap, Deployment, Service, HPA and PDB.

The pod template depends only on the hardware, engine-independent settings and the loading policy,
never on traffic or on which artifacts exist: a traffic change rewrites the ConfigMap alone, which the
pods reload in place (the ConfigMap is mounted as a directory, not with subPath, so the kubelet updates
the file), and no pod restarts.
"""

from __future__ import annotations

import re
from typing import Any

from modelfleet.converters.formats import hardware
from modelfleet.dataplane.manifest import Routing, ServedModel, ServedVersion, ServingManifest
from modelfleet.operator.api import InferenceModelSpec
from modelfleet.operator.reconcile import names
from modelfleet.operator.reconcile.traffic import PlannedVersion
from modelfleet.operator.settings import OperatorSettings

MANIFEST_DIR = "/etc/modelfleet"
MANIFEST_FILE = "manifest.yaml"
API_KEYS_DIR = "/etc/modelfleet-keys"
CONTAINER = "server"


def engine_settings(spec: InferenceModelSpec, draft_artifact: str | None = None) -> dict[str, Any]:
    """spec.engine in the engine's own keyword names (EngineConfig). `draft_artifact`: the draft
    model's path for speculative decoding with proposer draft (traffic.draft_artifact); without it
    that proposer is left off."""
    engine: dict[str, Any] = {
        "max_num_seqs": spec.engine.max_num_seqs,
        "kv_cache_memory_fraction": spec.engine.kv_cache_memory_fraction,
        "enable_prefix_caching": spec.engine.prefix_caching,
    }
    if spec.engine.max_model_len is not None:
        engine["max_model_len"] = spec.engine.max_model_len
    if spec.engine.kv_cache_bytes is not None:
        engine["kv_cache_bytes"] = spec.engine.kv_cache_bytes
    if spec.engine.host_kv_cache_bytes:
        engine["host_kv_cache_bytes"] = spec.engine.host_kv_cache_bytes
    if spec.engine.kv_cache_dtype != "auto":
        engine["kv_cache_dtype"] = spec.engine.kv_cache_dtype
    if spec.engine.max_num_batched_tokens is not None:
        engine["max_num_batched_tokens"] = spec.engine.max_num_batched_tokens
    if spec.engine.prefill_wait_steps is not None:
        engine["prefill_wait_steps"] = spec.engine.prefill_wait_steps
    if spec.hardware.count > 1:
        # One model split over the pod's devices (it requests that many), or on cpu over that many engine
        # processes (gloo); one device needs no setting.
        engine["tensor_parallel_size"] = spec.hardware.count
    speculative = spec.engine.speculative
    if speculative.proposer == "ngram" or (speculative.proposer == "draft" and draft_artifact):
        engine["speculative_proposer"] = speculative.proposer
        engine["num_speculative_tokens"] = speculative.num_tokens
        if speculative.proposer == "draft":
            engine["speculative_draft_model"] = draft_artifact
    return engine


def render_manifest(
    model_name: str,
    spec: InferenceModelSpec,
    planned: list[PlannedVersion],
    draft_artifact: str | None = None,
) -> ServingManifest:
    """The serving manifest: only versions with an artifact on this hardware, at their served weights."""
    versions = [
        ServedVersion(
            name=p.name,
            weight=p.weight,
            artifact=p.artifact_path,
            preload=spec.loading.mode == "eager",
        )
        for p in planned
        if p.artifact_path
    ]
    if not versions:
        return ServingManifest(models=[])
    model = ServedModel(
        name=model_name,
        versions=versions,
        routing=Routing(stickyBy=spec.routing.sticky_by),
        engine=engine_settings(spec, draft_artifact),
    )
    return ServingManifest(models=[model])


def _metadata(im: dict[str, Any], name: str, component: str) -> dict[str, Any]:
    model = im["metadata"]["name"]
    return {
        "name": name,
        "namespace": im["metadata"]["namespace"],
        "labels": names.common_labels(model, component),
        "ownerReferences": [names.owner_reference(im)],
    }


def manifest_configmap(im: dict[str, Any], manifest: ServingManifest) -> dict[str, Any]:
    model = im["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(im, names.manifest_configmap_name(model), "dataplane"),
        "data": {MANIFEST_FILE: manifest.to_yaml()},
    }


def duration_seconds(text: str) -> int:
    """'1h30m' -> 5400 (the CRD pattern guarantees the shape)."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return int(sum(float(n) * units[u] for n, u in re.findall(r"([0-9]+)(ms|s|m|h)", text)))


def _env(im: dict[str, Any], spec: InferenceModelSpec, settings: OperatorSettings) -> list[dict[str, Any]]:
    model, namespace = im["metadata"]["name"], im["metadata"]["namespace"]
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": "/tmp/hf"},
        {"name": "OTEL_SERVICE_NAME", "value": "modelfleet-dataplane"},
        {
            "name": "OTEL_RESOURCE_ATTRIBUTES",
            "value": f"k8s.namespace.name={namespace},k8s.pod.name=$(POD_NAME),modelfleet.model={model}",
        },
    ]
    if settings.dataplane_otlp_endpoint:
        env.append({"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": settings.dataplane_otlp_endpoint})
    else:
        env.append({"name": "OTEL_TRACES_EXPORTER", "value": "none"})
    if settings.dataplane_log_format:
        env.append({"name": "MODELFLEET_LOG_FORMAT", "value": settings.dataplane_log_format})
    if spec.loading.idle_unload_after:
        seconds = duration_seconds(spec.loading.idle_unload_after)
        env.append({"name": "MODELFLEET_IDLE_UNLOAD_SECONDS", "value": str(seconds)})
    if settings.dataplane_api_keys_secret:
        env.append({"name": "MODELFLEET_API_KEY_FILE", "value": f"{API_KEYS_DIR}/keys"})
    # Each pod enforces its share of every API key's limits: the live count of ready pods, read from the
    # headless Service's addresses (peers_service). Until a lookup answers, and whenever it fails, the
    # share of the most pods there may be: a key never gets more than its limit.
    replicas = spec.replicas.max if autoscaled(spec) else max(spec.replicas.min, 1)
    env.append({"name": "MODELFLEET_REPLICAS", "value": str(replicas)})
    env.append({"name": "MODELFLEET_PEERS_DNS", "value": peers_dns(im)})
    if settings.dataplane_grpc_port:
        env.append({"name": "MODELFLEET_GRPC_PORT", "value": str(settings.dataplane_grpc_port)})
    # A GPU pod's engines run in processes of their own, with stream relays; unset, the server gives each
    # engine as many as its max_num_seqs needs.
    hw = hardware(spec.hardware.accelerator)
    if hw.resource_name and settings.dataplane_stream_relays is not None:
        env.append({"name": "MODELFLEET_STREAM_RELAYS", "value": str(settings.dataplane_stream_relays)})
    # The pod's versions share its GPU: through MPS their engines' kernels run side by side
    # (dataplane/server/gpu_sharing.py). Set from the start, not when a second version arrives: a new
    # variable would roll the pods. One GPU only: tensor-parallel ranks under MPS are not tested.
    if hw.vendor == "nvidia" and spec.hardware.count == 1 and settings.dataplane_gpu_sharing == "mps":
        env.append({"name": "MODELFLEET_GPU_SHARING", "value": "mps"})
    return env


def _http_probe(path: str, period: int, failures: int, initial_delay: int = 0) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "initialDelaySeconds": initial_delay,
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def deployment(im: dict[str, Any], spec: InferenceModelSpec, settings: OperatorSettings) -> dict[str, Any]:
    model = im["metadata"]["name"]
    hw = hardware(spec.hardware.accelerator)
    requests: dict[str, str] = {"cpu": settings.dataplane_cpu, "memory": settings.dataplane_memory}
    limits: dict[str, str] = {"memory": settings.dataplane_memory}
    tolerations = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.hardware.tolerations]
    if hw.resource_name:
        requests[hw.resource_name] = limits[hw.resource_name] = str(spec.hardware.count)
        # GPU nodes are commonly tainted with their device resource; pods that request it may go there.
        tolerations.append({"key": hw.resource_name, "operator": "Exists", "effect": "NoSchedule"})
    node_selector = dict(spec.hardware.node_selector)
    if hw.node_label:
        node_selector[hw.node_label[0]] = hw.node_label[1]
    store = settings.model_store_path.rstrip("/")
    mounts = [
        {"name": "manifest", "mountPath": MANIFEST_DIR, "readOnly": True},
        {"name": "model-store", "mountPath": store, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "manifest", "configMap": {"name": names.manifest_configmap_name(model)}},
        {
            "name": "model-store",
            "persistentVolumeClaim": {"claimName": settings.model_store_claim, "readOnly": True},
        },
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
    ]
    if settings.dataplane_api_keys_secret:
        mounts.append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
        volumes.append({"name": "api-keys", "secret": {"secretName": settings.dataplane_api_keys_secret}})
    container = {
        "name": CONTAINER,
        "image": settings.dataplane_image,
        "imagePullPolicy": settings.dataplane_image_pull_policy,
        "command": ["modelfleet", "serve"],
        "args": ["--manifest", f"{MANIFEST_DIR}/{MANIFEST_FILE}", "--port", str(settings.dataplane_port)],
        "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in _named_ports(settings)],
        "env": _env(im, spec, settings),
        "resources": {"requests": requests, "limits": limits},
        # /health answers as soon as the server runs; /ready only once the versions it serves are loaded.
        "startupProbe": _http_probe("/health", period=5, failures=120),
        "livenessProbe": _http_probe("/health", period=10, failures=6),
        "readinessProbe": _http_probe("/ready", period=5, failures=3),
        # Give the Service time to drop this pod before the server stops accepting requests.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": mounts,
    }
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": settings.dataplane_termination_grace_seconds,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": volumes,
    }
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if settings.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in settings.image_pull_secrets]
    labels = {**names.common_labels(model, "dataplane"), **names.selector_labels(model)}
    deploy_spec: dict[str, Any] = {
        "selector": {"matchLabels": names.selector_labels(model)},
        # Never below the serving capacity during a rollout; one extra pod comes up first.
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
        "template": {
            "metadata": {
                "labels": labels,
                "annotations": {
                    "prometheus.io/scrape": "true",
                    "prometheus.io/port": str(settings.dataplane_port),
                    "prometheus.io/path": "/metrics",
                },
            },
            "spec": pod_spec,
        },
    }
    if not autoscaled(spec):
        deploy_spec["replicas"] = spec.replicas.min  # with an HPA, the HPA owns the replica count
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(im, names.serving_name(model), "dataplane"),
        "spec": deploy_spec,
    }


def service(im: dict[str, Any], settings: OperatorSettings) -> dict[str, Any]:
    model = im["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(im, names.serving_name(model), "dataplane"),
        "spec": {
            "type": "ClusterIP",
            "selector": names.selector_labels(model),
            "ports": [
                {"name": n, "port": p, "targetPort": n, "protocol": "TCP"}
                # h2c: gRPC without TLS, so that meshes and gateways route it as HTTP/2
                | ({"appProtocol": "kubernetes.io/h2c"} if n == "grpc" else {})
                for n, p in _named_ports(settings)
            ],
        },
    }


def peers_service(im: dict[str, Any], settings: OperatorSettings) -> dict[str, Any]:
    """A headless Service over the model's ready pods: its DNS name resolves to one address for each, so a
    pod counts its live peers (dataplane/server/peers.py). Not for traffic: that goes through `service`."""
    model = im["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(im, names.peers_service_name(model), "dataplane"),
        "spec": {
            "clusterIP": "None",
            "selector": names.selector_labels(model),
            "publishNotReadyAddresses": False,  # a pod that is not ready serves no share
            "ports": [
                {"name": "http", "port": settings.dataplane_port, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }


def peers_dns(im: dict[str, Any]) -> str:
    return f"{names.peers_service_name(im['metadata']['name'])}.{im['metadata']['namespace']}.svc"


def _named_ports(settings: OperatorSettings) -> list[tuple[str, int]]:
    """HTTP always; gRPC when the data plane serves it."""
    ports = [("http", settings.dataplane_port)]
    if settings.dataplane_grpc_port:
        ports.append(("grpc", settings.dataplane_grpc_port))
    return ports


def endpoint(im: dict[str, Any], settings: OperatorSettings) -> str:
    model, namespace = im["metadata"]["name"], im["metadata"]["namespace"]
    return f"http://{names.serving_name(model)}.{namespace}.svc:{settings.dataplane_port}/v1"


def autoscaled(spec: InferenceModelSpec) -> bool:
    return spec.replicas.max > max(spec.replicas.min, 1)


def autoscaler(
    im: dict[str, Any], spec: InferenceModelSpec, settings: OperatorSettings
) -> dict[str, Any] | None:
    """An HPA on the per-pod count of requests waiting in the engines' queues, when max > min.

    Queue depth is the signal of an LLM server that is full: it grows as soon as the batch is saturated,
    before latency does, while CPU and GPU utilisation stay high whether the queue is empty or long. The
    metric comes from the pods' /metrics through a custom-metrics adapter (e.g. prometheus-adapter).
    """
    if not autoscaled(spec):
        return None
    model = im["metadata"]["name"]
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(im, names.serving_name(model), "dataplane"),
        "spec": {
            "scaleTargetRef": {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": names.serving_name(model),
            },
            "minReplicas": max(spec.replicas.min, 1),
            "maxReplicas": spec.replicas.max,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": settings.hpa_metric},
                        "target": {"type": "AverageValue", "averageValue": settings.hpa_target_average},
                    },
                }
            ],
            # Loading a model takes minutes: scale up at once, scale down only after a calm spell.
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": 0},
                "scaleDown": {"stabilizationWindowSeconds": 600},
            },
        },
    }


def disruption_budget(im: dict[str, Any]) -> dict[str, Any]:
    """A PDB letting voluntary disruptions (node drains, upgrades) take one pod at a time.

    maxUnavailable rather than minAvailable: with a single replica a drain still goes through (the
    Deployment's surge pod takes over), where minAvailable: 1 would block it forever.
    """
    model = im["metadata"]["name"]
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(im, names.serving_name(model), "dataplane"),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": names.selector_labels(model)}},
    }
