"""The operator's serving objects, fed as they are to the real model server: the engine settings of the
InferenceModel are what the server runs with and admits, and the HPA's metric is one the server exports
and that rises while requests wait."""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import httpx
import torch
from modelfleet.dataplane.config import EngineConfig
from modelfleet.dataplane.models import ModelConfig, kv_cache_block_bytes
from modelfleet.dataplane.server import cli as serve_cli
from modelfleet.dataplane.server.settings import ServerSettings
from modelfleet.operator.api import InferenceModel
from modelfleet.operator.reconcile import serving
from modelfleet.operator.reconcile.plan import serving_plan, version_views
from modelfleet.operator.reconcile.traffic import plan_traffic
from modelfleet.operator.settings import OperatorSettings
from prometheus_client.parser import text_string_to_metric_families

MAX_NUM_SEQS = 3
MAX_MODEL_LEN = 2048  # the tiny model's longest: streams that outlast the checks
KV_CACHE_BYTES = 3 << 20  # fewer blocks than MAX_NUM_SEQS sequences of MAX_MODEL_LEN could use
HOST_KV_CACHE_BYTES = 1 << 20


def objects(artifact: Path) -> tuple[dict, dict]:
    im = {
        "apiVersion": "modelfleet.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "uid-chat", "generation": 1},
        "spec": {
            "hardware": {"accelerator": "cpu"},
            "replicas": {"min": 1, "max": 3},
            "engine": {
                "maxNumSeqs": MAX_NUM_SEQS,
                "maxModelLen": MAX_MODEL_LEN,
                "kvCacheBytes": KV_CACHE_BYTES,
                "hostKvCacheBytes": HOST_KV_CACHE_BYTES,
            },
            "traffic": [{"version": "v1", "weight": 100}],
            "loading": {"mode": "eager"},
        },
    }
    mv = {
        "apiVersion": "modelfleet.dev/v1alpha1",
        "kind": "ModelVersion",
        "metadata": {"name": "chat-v1", "namespace": "team-a", "uid": "uid-v1"},
        "spec": {"model": "chat", "version": "v1", "source": {"uri": "pvc://models/chat/v1"}},
        "status": {
            "phase": "Ready",
            "artifacts": [
                {"accelerator": "cpu", "format": "torch", "dtype": "fp32", "uri": f"file://{artifact}"}
            ],
        },
    }
    return im, mv


def reconcile(im: dict, mv: dict, settings: OperatorSettings) -> dict[str, dict]:
    spec = InferenceModel.model_validate(im).spec
    planned = plan_traffic(spec, version_views([mv], "chat"), settings)
    return {obj["kind"]: obj for obj in serving_plan(im, spec, planned, settings).apply}


def pod_server_settings(
    deployment: dict, configmap: dict, root: Path, monkeypatch
) -> tuple[ServerSettings, Path]:
    """What the pod's `modelfleet serve` reads: its arguments, its MODELFLEET_* environment and the
    ConfigMap mounted at the manifest directory (here under `root`)."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args([*container["command"][1:], *container["args"]])
    mounted = root / args.manifest.relative_to(serving.MANIFEST_DIR)
    mounted.parent.mkdir(parents=True, exist_ok=True)
    mounted.write_text(configmap["data"][serving.MANIFEST_FILE])
    for var in container["env"]:
        if var["name"].startswith("MODELFLEET_") and "value" in var:
            monkeypatch.setenv(var["name"], var["value"])
    return ServerSettings(), mounted


def metric(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def hold_stream(url: str, stop: threading.Event) -> None:
    """One long completion, kept open until `stop`; leaving it aborts the request on the server."""
    body = {
        "model": "chat",
        "prompt": "go",
        "max_tokens": MAX_MODEL_LEN - 16,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        for _ in response.iter_lines():
            if stop.is_set():
                return


def wait_for(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_spec_engine_is_what_the_server_runs_admits_and_scales_on(
    tiny_model_dir, tmp_path, monkeypatch, run_server
):
    im, mv = objects(tiny_model_dir)
    kinds = reconcile(im, mv, OperatorSettings())
    settings, manifest_path = pod_server_settings(
        kinds["Deployment"], kinds["ConfigMap"], tmp_path, monkeypatch
    )
    server = run_server(settings, manifest_path)

    # The server reports the engine settings written in the InferenceModel.
    (version,) = httpx.get(f"{server.url}/ready").json()["versions"]
    assert (version["max_num_seqs"], version["max_model_len"]) == (MAX_NUM_SEQS, MAX_MODEL_LEN)
    assert version["admission_limit"] == MAX_NUM_SEQS
    model = ModelConfig.from_dir(tiny_model_dir)
    block_bytes = kv_cache_block_bytes(model, EngineConfig.block_size, torch.float32)
    assert version["kv_cache_blocks"] == KV_CACHE_BYTES // block_bytes
    # The host KV tier too (the engine runs in the server's process on the CPU).
    (slot,) = server.dataplane.manager.slots.values()
    engine = slot.engine.engine
    assert engine.config.host_kv_cache_bytes == HOST_KV_CACHE_BYTES
    assert engine.host_tier.pool.num_blocks == HOST_KV_CACHE_BYTES // engine.runner.block_bytes

    hpa_metric = kinds["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert metric(httpx.get(f"{server.url}/metrics").text, hpa_metric) == 0.0

    # maxNumSeqs requests run at once; the next ones wait in admission, not in the engine.
    stop = threading.Event()
    streams = [threading.Thread(target=hold_stream, args=(server.url, stop)) for _ in range(MAX_NUM_SEQS + 2)]
    try:
        for thread in streams:
            thread.start()
        wait_for(lambda: server.dataplane.admission.waiting == 2, "two requests waiting for admission")
        labels = {"model": "chat", "version": "v1"}

        def engine_running() -> float | None:
            return metric(
                httpx.get(f"{server.url}/metrics").text, "modelfleet_num_requests_running", **labels
            )

        wait_for(lambda: engine_running() == MAX_NUM_SEQS, "the admitted requests to reach the engine")
        text = httpx.get(f"{server.url}/metrics").text
        assert server.dataplane.admission.running == MAX_NUM_SEQS
        assert metric(text, "modelfleet_num_requests_waiting", **labels) == 2
        assert metric(text, hpa_metric) == 2  # the autoscaler sees the queue the engine never sees
    finally:
        stop.set()
        for thread in streams:
            thread.join(60)
    wait_for(lambda: server.dataplane.admission.running == 0, "the aborted requests to leave")
    assert metric(httpx.get(f"{server.url}/metrics").text, hpa_metric) == 0.0
