"""The whole fleet on one machine, from model.yaml to tokens: the operator's reconcile converts both
versions with the real converter, starts the real server, and the official `openai` client gets tokens
through the local endpoint. The tests share one fleet and run in file order; the last one deletes it."""

from __future__ import annotations

import math
import os
import signal
import threading
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest
import torch
from local_fleet import (
    KV_CACHE_BYTES,
    MODEL,
    alive,
    descendants,
    model,
    model_yaml,
    serving_pods,
    version_doc,
    wait_for,
)
from modelfleet.dataplane.config import EngineConfig
from modelfleet.dataplane.device import default_dtype
from modelfleet.dataplane.models import ModelConfig, kv_cache_block_bytes
from modelfleet.operator.api import API_VERSION

# p=0.7 over 160 requests: the 99.9% binomial interval is 112 +- 19 (normal approximation, z=3.29).
REQUESTS = 160
Z = 3.29


def client(fleet, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.endpoint(MODEL), api_key="local", max_retries=0, timeout=60, **kwargs)


def split(fleet, n: int = REQUESTS) -> Counter:
    """Which version answered each of `n` requests, from the x-modelfleet-version header."""
    api = client(fleet)
    counts: Counter = Counter()
    lock = threading.Lock()

    def send(count: int) -> None:
        for _ in range(count):
            raw = api.completions.with_raw_response.create(model=MODEL, prompt="Once upon", max_tokens=1)
            with lock:
                counts[raw.headers["x-modelfleet-version"]] += 1

    threads = [threading.Thread(target=send, args=(n // 4,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counts


def assert_split(counts: Counter, weights: dict[str, int]) -> None:
    n = sum(counts.values())
    for version, weight in weights.items():
        p = weight / 100
        half = Z * math.sqrt(n * p * (1 - p))
        assert n * p - half <= counts[version] <= n * p + half, (counts, weights)


def replica_pids(fleet) -> dict[str, int]:
    return {name: r.container.process.pid for name, r in fleet.deployments.replicas.items()}


class Traffic:
    """Requests to the model in the background, until stopped; counts answers and failures."""

    def __init__(self, fleet) -> None:
        self.api = client(fleet)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

        self.answered = 0
        self.failures: list[str] = []

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.api.completions.create(model=MODEL, prompt="Once", max_tokens=1)
                self.answered += 1
            except openai.APIError as exc:
                self.failures.append(str(exc))

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.stopped.set()
        self.thread.join(timeout=60)


# --- 1. conversion, serving, split ------------------------------------------------------------------------


def test_both_versions_are_converted_validated_and_published(fleet, pvc_root: Path):
    by_version = {
        mv["spec"]["version"]: mv["status"] for mv in fleet.kube.list(API_VERSION, "ModelVersion", "default")
    }
    v1 = {(a["format"], a["dtype"]) for a in by_version["v1"]["artifacts"]}
    v2 = {(a["format"], a["dtype"]) for a in by_version["v2"]["artifacts"]}
    assert v1 == {("torch", "bf16")} and v2 == {("torch", "bf16"), ("onnx", "int8")}
    for status in by_version.values():
        for artifact in status["artifacts"]:
            assert artifact["uri"].startswith("pvc://modelfleet-models/artifacts/chat/")
            assert artifact["validation"], artifact  # the converter checked it against the source
            folder = pvc_root / artifact["uri"].removeprefix("pvc://")
            assert (folder / "manifest.json").is_file()
            assert not list(folder.parent.glob(".*.tmp-*")), "a staging folder was left behind"
    # The int8 version is served from its onnxruntime artifact: the manifest the server reads says so.
    (replica,) = fleet.deployments.replicas.values()
    manifest = (replica.container.folder / "volumes" / "manifest" / "manifest.yaml").read_text()
    assert str(pvc_root / "modelfleet-models/artifacts/chat/v2/cpu-onnx-int8") in manifest


def test_openai_client_gets_completions_and_streams_from_both_versions(fleet):
    api = client(fleet)
    for version in ("v1", "v2"):
        raw = api.completions.with_raw_response.create(
            model=f"{MODEL}@{version}", prompt="Hello", max_tokens=4
        )
        assert raw.headers["x-modelfleet-version"] == version
        assert raw.parse().choices[0].text
        with api.chat.completions.with_streaming_response.create(
            model=f"{MODEL}@{version}",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=6,
            stream=True,
        ) as stream:
            assert stream.headers["x-modelfleet-version"] == version
            chunks = list(stream.parse())
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_requests_follow_the_requested_split(fleet):
    assert model(fleet)["status"]["traffic"] == "v1=70,v2=30"
    assert_split(split(fleet), {"v1": 70, "v2": 30})


# --- 3. spec.engine reaches the engine ----------------------------------------------------------------


def test_engine_settings_of_the_yaml_are_what_the_server_runs(fleet, pvc_root: Path):
    split(fleet, 8)  # both versions loaded (lazy loading)
    ready = httpx.get(fleet.endpoint(MODEL).removesuffix("/v1") + "/ready", timeout=10).json()
    loaded = [v for v in ready["versions"] if v["state"] == "loaded"]
    assert {v["version"] for v in loaded} == {"v1", "v2"}
    for version in loaded:
        assert version["max_num_seqs"] == 6 and version["max_model_len"] == 192, version
    # The KV budget, in blocks of v1's torch engine (its dtype: this CPU's default).
    config = ModelConfig.from_dir(pvc_root / "models" / "chat" / "v1")
    dtype = default_dtype(torch.device("cpu"))
    block_bytes = kv_cache_block_bytes(config, EngineConfig.block_size, dtype)
    (v1,) = [v for v in loaded if v["version"] == "v1"]
    assert v1["kv_cache_blocks"] == KV_CACHE_BYTES // block_bytes < 6 * 192 // EngineConfig.block_size
    with pytest.raises(openai.BadRequestError):  # the engine holds maxModelLen: 192 tokens in all
        client(fleet).completions.create(model=MODEL, prompt="Hello", max_tokens=200)


# --- 2. a traffic edit applies live --------------------------------------------------------------------


def test_a_traffic_edit_applies_live_without_restarts_or_dropped_requests(fleet):
    pids = replica_pids(fleet)
    api = client(fleet)
    with api.completions.with_streaming_response.create(
        model=f"{MODEL}@v1",
        prompt="Once",
        max_tokens=120,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ) as stream:
        events = stream.parse()
        first = next(events)
        fleet.apply(model_yaml(w1=20, w2=80))
        wait_for(lambda: model(fleet)["status"]["traffic"] == "v1=20,v2=80", 30, "the new split in status")
        wait_for(
            lambda: _server_weights(fleet) == {"v1": 20, "v2": 80}, 30, "the servers to reload the split"
        )
        rest = list(events)
    chunks = [first, *rest]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 120  # every token of the in-flight stream arrived
    assert_split(split(fleet), {"v1": 20, "v2": 80})
    assert replica_pids(fleet) == pids
    for pod in serving_pods(fleet):
        assert pod["status"]["containerStatuses"][0]["restartCount"] == 0


def _server_weights(fleet) -> dict[str, int]:
    ready = httpx.get(fleet.endpoint(MODEL).removesuffix("/v1") + "/ready", timeout=10).json()
    return {v["version"]: v["weight"] for v in ready["versions"]}


# --- 5. a server killed mid-stream -----------------------------------------------------------------------


def kill_during_a_stream(fleet, pid: int) -> bool:
    """Kill the replica as soon as a long stream has begun. True when the stream broke off, ending in the
    error event the local Service writes for a replica lost mid-stream; False when the whole answer had
    already been written (the kill came too late), which the stream must then show."""
    api = client(fleet)
    with api.completions.with_streaming_response.create(
        model=MODEL,
        prompt="Once",
        max_tokens=185,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ) as stream:
        # Killed as soon as the stream has begun (its head is here): the tiny model writes its 185 tokens
        # in well under a second, and on a loaded machine even this kill can land after the last one.
        os.kill(pid, signal.SIGKILL)
        chunks = []
        try:
            chunks.extend(stream.parse())
        except openai.APIError as exc:  # the Service ends the broken stream with an error event
            assert "stopped before its end" in str(exc), exc
            return True
    # Not broken off: then it is the whole answer, never a stream cut short that looks complete.
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 185, chunks[-1]
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)
    return False


def test_a_server_killed_mid_stream_breaks_that_stream_and_is_restarted(fleet):
    ((name, pid),) = replica_pids(fleet).items()
    for kills in range(1, 4):
        broke = kill_during_a_stream(fleet, pid)

        def restarted(kills: int = kills) -> bool:
            pod = fleet.kube.get("v1", "Pod", "default", name)
            status = pod["status"]["containerStatuses"][0]
            return status["restartCount"] == kills and status["ready"]

        wait_for(restarted, 90, "the replica to restart and be ready")
        assert replica_pids(fleet)[name] != pid
        pid = replica_pids(fleet)[name]
        pod = fleet.kube.get("v1", "Pod", "default", name)
        assert (
            pod["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"]
            == 128 + signal.SIGKILL
        )
        if broke:
            break
    assert broke, "three kills all came after the stream's last token"
    answers = [client(fleet).completions.create(model=MODEL, prompt="Again", max_tokens=2) for _ in range(4)]
    assert all(a.choices[0].text is not None for a in answers)


# --- 4. canary rollouts, judged from the servers' own /metrics -------------------------------------------

ROLLOUT = {"steps": [50, 100], "interval": "1s", "minRequests": 4, "thresholds": {"maxErrorRate": 0.2}}


def rollout_end(fleet, candidate: str) -> str | None:
    """The phase the rollout of `candidate` ended in, None while it runs."""
    state = model(fleet).get("status", {}).get("rollout") or {}
    ended = state.get("candidate") == candidate and state.get("phase") in ("Succeeded", "RolledBack")
    return state["phase"] if ended else None


def test_a_healthy_canary_completes(fleet):
    fleet.apply(model_yaml(w1=100, w2=0, rollout={"candidate": "v2", **ROLLOUT}))
    with Traffic(fleet):
        phase = wait_for(lambda: rollout_end(fleet, "v2"), 90, "the rollout to end")
    assert phase == "Succeeded", model(fleet)["status"]["rollout"]
    assert model(fleet)["status"]["traffic"] == "v1=0,v2=100"
    metrics = {m["version"]: m for m in model(fleet)["status"]["rollout"]["lastMetrics"]}
    assert metrics["v2"]["requests"] >= 4 and metrics["v2"]["errors"] == 0  # read from the servers' /metrics
    assert any(e["reason"] == "RolloutSucceeded" for e in fleet.events)


def test_a_failing_canary_is_rolled_back(fleet, pvc_root: Path):
    fleet.apply([version_doc("v3", "pvc://models/chat/v1")])
    wait_for(lambda: _phase(fleet, "chat-v3") == "Ready", 120, "v3 to be converted")
    # Break the published artifact before any server loads it (loading is lazy): every load fails.
    weights = pvc_root / "modelfleet-models/artifacts/chat/v3/cpu-torch-bf16/model.safetensors"
    weights.write_bytes(b"not a safetensors file")
    im = model_yaml(w1=100, w2=0, rollout={"candidate": "v3", **ROLLOUT})[0]
    im["spec"]["traffic"].append({"version": "v3", "weight": 0})
    fleet.apply([im])
    with Traffic(fleet):
        phase = wait_for(lambda: rollout_end(fleet, "v3"), 90, "the rollout to end")
    status = model(fleet)["status"]
    assert phase == "RolledBack", status["rollout"]
    assert status["traffic"] == "v1=100,v2=0,v3=0"
    (event,) = [e for e in fleet.events if e["reason"] == "RolloutRolledBack"]
    assert "maxErrorRate" in event["message"], event


def _phase(fleet, name: str) -> str | None:
    mv = fleet.kube.get(API_VERSION, "ModelVersion", "default", name)
    return ((mv or {}).get("status") or {}).get("phase")


# --- the pod template changes: the replica is replaced, new one first ---------------------------------------


def test_a_pod_template_change_replaces_the_replica_without_failing_a_request(fleet):
    (old,) = replica_pids(fleet).items()
    fleet.apply(model_yaml(w1=20, w2=80))  # the rollout's spec goes: the servers get this split back
    wait_for(lambda: _server_weights(fleet) == {"v1": 20, "v2": 80}, 30, "the servers to drop v3")
    with Traffic(fleet) as traffic:
        # idleUnloadAfter is an environment variable of the servers: a new pod template.
        fleet.apply(model_yaml(w1=20, w2=80, idle_unload_after="1h"))

        def replaced() -> bool:
            pods = serving_pods(fleet)
            return (
                [p["metadata"]["name"] for p in pods] != [old[0]]
                and len(pods) == 1
                and all(p["status"]["containerStatuses"][0]["ready"] for p in pods)
            )

        wait_for(replaced, 120, "the new replica to replace the old one")
        wait_for(lambda: not alive({old[1]}), 60, "the old server to stop")
    assert traffic.answered > 0 and traffic.failures == []
    (new,) = serving_pods(fleet)
    env = new["spec"]["containers"][0]["env"]
    assert {"name": "MODELFLEET_IDLE_UNLOAD_SECONDS", "value": "3600"} in env


# --- 6. deleting the model ---------------------------------------------------------------------------------


def test_deleting_the_model_stops_every_process_and_its_staging_folders(fleet, pvc_root: Path):
    fleet.apply([version_doc("v4", "pvc://models/chat/v2", quantization="int8")])
    v4 = pvc_root / "modelfleet-models/artifacts/chat/v4"
    wait_for(lambda: list(v4.glob(".*.tmp-*")), 120, "a conversion of v4 to be half-way")
    started = alive(descendants())
    assert len(started) >= 2  # the server and the conversions
    endpoint = fleet.endpoint(MODEL)
    docs = [*model_yaml(), version_doc("v3", ""), version_doc("v4", "")]
    assert len(fleet.delete(docs)) == 5
    wait_for(lambda: not alive(started), 60, "every process of the model to stop")
    assert not alive(descendants())
    assert not list(v4.glob(".*.tmp-*"))
    wait_for(lambda: fleet.endpoint(MODEL) is None, 10, "the endpoint to close")
    with pytest.raises(httpx.ConnectError):
        httpx.get(endpoint.removesuffix("/v1") + "/health", timeout=5)
    assert {o["kind"] for o in fleet.kube.all()} == set()
