"""The pieces of the local fleet on their own: the API store's semantics the operator relies on, the
printer columns' JSONPaths, mount-path mapping, and the Service proxy's spreading and streaming."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections import Counter
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from local_fleet import wait_for
from modelfleet.local import processes
from modelfleet.local.columns import evaluate, table
from modelfleet.local.jobs import JobController
from modelfleet.local.mounts import Mounts, container_env
from modelfleet.local.proxy import ServiceProxy
from modelfleet.local.store import LocalKube
from modelfleet.operator.api import API_VERSION
from modelfleet.operator.kube import KubeError


def config_map(data: dict, owner: dict | None = None) -> dict:
    meta: dict = {"name": "cm", "namespace": "default"}
    if owner:
        meta["ownerReferences"] = [{"uid": owner["metadata"]["uid"], "kind": owner["kind"], "name": "x"}]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def test_apply_sets_server_fields_and_bumps_generation_only_for_spec_changes():
    kube = LocalKube()
    created = kube.apply(config_map({"a": "1"}))
    meta = created["metadata"]
    assert meta["uid"] and meta["generation"] == 1 and meta["creationTimestamp"] and meta["resourceVersion"]
    assert kube.apply(config_map({"a": "1"})) == created  # a no-op apply writes nothing
    kube.patch_status("v1", "ConfigMap", "default", "cm", {"seen": True})
    after_status = kube.get("v1", "ConfigMap", "default", "cm")
    assert after_status["metadata"]["generation"] == 1
    assert after_status["metadata"]["resourceVersion"] != meta["resourceVersion"]
    changed = kube.apply(config_map({"a": "2"}))
    assert changed["metadata"]["generation"] == 2 and changed["metadata"]["uid"] == meta["uid"]
    assert changed["status"] == {"seen": True}  # apply never touches the status subresource


def test_patch_status_merges_and_compares_resource_versions():
    kube = LocalKube()
    obj = kube.apply(config_map({}))
    kube.patch_status("v1", "ConfigMap", "default", "cm", {"a": 1, "b": {"c": 2}})
    kube.patch_status("v1", "ConfigMap", "default", "cm", {"a": None, "b": {"d": 3}})
    assert kube.get("v1", "ConfigMap", "default", "cm")["status"] == {"b": {"c": 2, "d": 3}}
    with pytest.raises(KubeError) as conflict:
        kube.patch_status(
            "v1", "ConfigMap", "default", "cm", {"x": 1}, resource_version=obj["metadata"]["resourceVersion"]
        )
    assert conflict.value.status == 409
    with pytest.raises(KubeError) as missing:
        kube.patch_status("v1", "ConfigMap", "default", "gone", {"x": 1})
    assert missing.value.status == 404


def test_delete_collects_what_the_object_owns():
    kube = LocalKube()
    owner = kube.apply(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "d", "namespace": "default"},
            "spec": {},
        }
    )
    assert owner["spec"]["replicas"] == 1  # the API server's default
    kube.apply(config_map({}, owner))
    assert kube.delete("apps/v1", "Deployment", "default", "d")
    assert kube.all() == [] and not kube.delete("apps/v1", "Deployment", "default", "d")


def test_list_filters_by_labels():
    kube = LocalKube()
    for name, labels in (("a", {"x": "1"}), ("b", {"x": "2"})):
        kube.apply(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": "default", "labels": labels},
            }
        )
    assert [p["metadata"]["name"] for p in kube.list("v1", "Pod", "default", {"x": "2"})] == ["b"]


def test_printer_columns_evaluate_the_crds_json_paths():
    im = {
        "kind": "InferenceModel",
        "metadata": {"name": "chat", "creationTimestamp": "2020-01-01T00:00:00Z"},
        "spec": {"hardware": {"accelerator": "cpu"}},
        "status": {
            "traffic": "v1=100",
            "conditions": [{"type": "Progressing", "status": "False"}, {"type": "Ready", "status": "True"}],
        },
    }
    assert evaluate('.status.conditions[?(@.type=="Ready")].status', im) == ["True"]
    assert evaluate(".status.conditions[1].type", im) == ["Ready"]
    assert evaluate(".spec.missing.field", im) == []
    lines = table("InferenceModel", [im], wide=True).splitlines()
    assert lines[0].split() == ["NAME", "ACCELERATOR", "TRAFFIC", "READY", "ENDPOINT", "ROLLOUT", "AGE"]
    row = lines[1].split()
    assert row[:6] == ["inferencemodel.modelfleet.dev/chat", "cpu", "v1=100", "True", "<none>", "<none>"]
    assert row[6].endswith("d")  # years old, in days
    assert "ROLLOUT" not in table("InferenceModel", [im])  # a priority-1 column is for -o wide only
    assert API_VERSION.startswith("modelfleet.dev/")


def test_mount_paths_map_to_local_folders_longest_first(tmp_path: Path):
    mounts = Mounts(
        {"/mnt/pvc": tmp_path / "pvc", "/mnt/pvc/models": tmp_path / "store", "/tmp": tmp_path / "t"}
    )
    assert mounts.path("/mnt/pvc/models/artifacts/x") == f"{tmp_path}/store/artifacts/x"
    assert mounts.path("/mnt/pvc/other/y") == f"{tmp_path}/pvc/other/y"
    assert mounts.path("/tmpfoo") == "/tmpfoo" and mounts.path("--port") == "--port"
    assert mounts.deep({"a": ["/tmp/hf", 3]}) == {"a": [f"{tmp_path}/t/hf", 3]}


class Backend:
    """A replica stand-in: answers its own name, or streams ten numbered lines."""

    def __init__(self, name: str) -> None:
        app = FastAPI()

        @app.post("/v1/completions")
        async def complete() -> dict:
            return {"replica": name}

        @app.get("/stream")
        async def stream() -> StreamingResponse:
            async def lines():
                for i in range(10):
                    yield f"{i}\n"
                    await asyncio.sleep(0.01)

            return StreamingResponse(lines(), media_type="text/plain")

        @app.get("/events")
        async def events(broken: bool = False) -> StreamingResponse:
            async def sse():
                for i in range(3):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
                if broken:  # half an event, then the replica is gone
                    yield "data: hal"
                    await asyncio.sleep(0.01)
                    raise RuntimeError("replica lost")
                yield "data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> tuple[str, int]:
        self.thread.start()
        while not self.server.started:
            threading.Event().wait(0.01)
        return "127.0.0.1", self.server.servers[0].sockets[0].getsockname()[1]

    def __exit__(self, *_) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def test_the_service_proxy_spreads_requests_over_ready_replicas_and_streams():
    with Backend("a") as a, Backend("b") as b:
        ready = [a, b]
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        proxy = ServiceProxy("chat", lambda: list(ready))
        asyncio.run_coroutine_threadsafe(proxy.start(), loop).result(timeout=10)
        try:
            answers = Counter(
                httpx.post(f"{proxy.url}/v1/completions", json={}).json()["replica"] for _ in range(10)
            )
            assert answers == {"a": 5, "b": 5}
            with httpx.stream("GET", f"{proxy.url}/stream") as response:
                assert response.headers["connection"] == "close"
                assert list(response.iter_lines()) == [str(i) for i in range(10)]
            ready.clear()
            refused = httpx.post(f"{proxy.url}/v1/completions", json={})
            assert refused.status_code == 503 and "no ready replica" in refused.json()["error"]["message"]
        finally:
            asyncio.run_coroutine_threadsafe(proxy.close(), loop).result(timeout=10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)


def test_a_stream_whose_replica_breaks_off_ends_well_formed_with_an_error_event():
    with Backend("a") as a:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        proxy = ServiceProxy("chat", lambda: [a])
        asyncio.run_coroutine_threadsafe(proxy.start(), loop).result(timeout=10)
        try:
            with httpx.stream("GET", f"{proxy.url}/events") as whole:
                assert [line for line in whole.iter_lines() if line] == [
                    "data: 0",
                    "data: 1",
                    "data: 2",
                    "data: [DONE]",
                ]
            with httpx.stream("GET", f"{proxy.url}/events", params={"broken": "true"}) as broken:
                lines = [line for line in broken.iter_lines() if line]  # no error: the body is whole
            # the half event is dropped, an error event takes its place
            assert lines[:3] == ["data: 0", "data: 1", "data: 2"] and len(lines) == 4
            error = json.loads(lines[3].removeprefix("data: "))["error"]
            assert error["code"] == "replica_lost" and "service chat" in error["message"]
        finally:
            asyncio.run_coroutine_threadsafe(proxy.close(), loop).result(timeout=10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)


def job(command: str, backoff_limit: int = 0) -> dict:
    """A Job shaped like the operator's conversion Jobs, running a Python snippet."""
    container = {
        "name": "convert",
        "command": [sys.executable, "-c", command],
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "j", "namespace": "default"},
        "spec": {
            "backoffLimit": backoff_limit,
            "podFailurePolicy": {
                "rules": [{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [2]}}]
            },
            "template": {"spec": {"containers": [container], "volumes": [{"name": "tmp", "emptyDir": {}}]}},
        },
    }


def run_job(tmp_path: Path, obj: dict) -> tuple[dict, list[dict]]:
    kube = LocalKube()
    kube.apply(obj)
    jobs = JobController(kube, tmp_path, tmp_path / "pvc")

    def finished():
        jobs.sync()
        found = kube.get("batch/v1", "Job", "default", "j")
        return (
            found
            if any(c["type"] in ("Complete", "Failed") for c in found.get("status", {}).get("conditions", []))
            else None
        )

    found = wait_for(finished, 30, "the Job to finish", interval=0.05)
    return found, kube.list("v1", "Pod", "default", {"job-name": "j"})


def test_a_job_reports_its_termination_message_as_the_kubelet_does(tmp_path: Path):
    # The converter gets the path as an argument (--termination-log), which the local kubelet maps.
    program = (
        'import sys; open(sys.argv[1], \'w\').write(\'{"ok": false, "reason": "bad input"}\'); sys.exit(2)'
    )
    obj = job(program)
    obj["spec"]["template"]["spec"]["containers"][0]["args"] = ["/dev/termination-log"]
    found, pods = run_job(tmp_path, obj)
    (failed,) = [c for c in found["status"]["conditions"] if c["type"] == "Failed"]
    assert failed["reason"] == "PodFailurePolicy" and "exit code 2" in failed["message"]
    (pod,) = pods
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 2 and terminated["message"] == '{"ok": false, "reason": "bad input"}'


def test_a_failing_job_is_retried_up_to_its_backoff_limit_and_falls_back_to_its_log(tmp_path: Path):
    found, pods = run_job(
        tmp_path, job("print('boom: the tail of the log'); raise SystemExit(1)", backoff_limit=1)
    )
    (failed,) = [c for c in found["status"]["conditions"] if c["type"] == "Failed"]
    assert failed["reason"] == "BackoffLimitExceeded" and found["status"]["failed"] == 2
    assert len(pods) == 2
    for pod in pods:
        assert (
            "boom: the tail of the log"
            in pod["status"]["containerStatuses"][0]["state"]["terminated"]["message"]
        )


def test_container_env_expands_references_and_resolves_the_pods_name(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("MODELFLEET_PORT", "1")  # the user's own settings stay out of the pods
    container = {
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "ATTRS", "value": "pod=$(POD_NAME),later=$(LATER)"},
            {"name": "HOME", "value": "/tmp"},
            {"name": "LATER", "value": "x"},
        ]
    }
    pod = {"metadata": {"name": "chat-abc", "namespace": "default"}}
    env = container_env(container, pod, Mounts({"/tmp": tmp_path}))
    assert env["ATTRS"] == "pod=chat-abc,later=$(LATER)"  # only variables defined before expand
    assert env["HOME"] == str(tmp_path) and "MODELFLEET_PORT" not in env


def test_the_local_example_is_admitted_and_converts_for_cpu():
    from modelfleet.converters.formats import default_targets
    from modelfleet.local.admission import admit
    from modelfleet.local.cli import load_documents

    path = Path(__file__).resolve().parents[2] / "examples" / "local-model.yaml"
    im, v1, v2 = (admit(doc) for doc in load_documents(path))
    assert im["spec"]["hardware"]["accelerator"] == "cpu"
    assert im["spec"]["replicas"] == {"min": 1, "max": 1}  # the CRD's defaults, as the API server fills them
    assert [(t.format, t.dtype) for t in default_targets("cpu", v1["spec"].get("quantization"))] == [
        ("torch", "bf16")
    ]
    assert [(t.format, t.dtype) for t in default_targets("cpu", v2["spec"]["quantization"])] == [
        ("torch", "bf16"),
        ("onnx", "int8"),
    ]


def test_local_admission_takes_quantize_lm_head_only_with_quantization():
    from modelfleet.local.admission import Refused, admit
    from modelfleet.local.cli import load_documents

    path = Path(__file__).resolve().parents[2] / "examples" / "local-model.yaml"
    _, v1, v2 = load_documents(path)
    assert admit(v1)["spec"]["quantizeLmHead"] is False
    v2["spec"]["quantizeLmHead"] = True
    assert admit(v2)["spec"]["quantizeLmHead"] is True
    v1["spec"]["quantizeLmHead"] = True
    with pytest.raises(Refused, match="quantizeLmHead applies to quantization int8 or fp8, not none"):
        admit(v1)


def test_events_are_listed_per_object_as_the_api_lists_them():
    kube = LocalKube()
    job = kube.apply(
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j", "namespace": "default"}}
    )
    kube.post_event(job, "Warning", "FailedCreate", "pods refused")
    kube.post_event({**job, "metadata": {**job["metadata"], "name": "other"}}, "Normal", "X", "y")
    (event,) = kube.list_events("default", "Job", "j", job["metadata"]["uid"])
    assert (event["reason"], event["involvedObject"]["uid"]) == ("FailedCreate", job["metadata"]["uid"])
    assert kube.list_events("default", "Job", "j", "another-uid") == []


def test_the_program_is_this_machines_and_only_what_follows_it_is_mapped():
    mounts = Mounts({"/tmp": Path("/pods/j/volumes/tmp")})
    container = {"name": "c", "command": ["/tmp/venv/bin/python", "/tmp/input.json"], "args": ["--out=/x"]}
    words = processes.argv(container, mounts.path)
    assert words == ["/tmp/venv/bin/python", "/pods/j/volumes/tmp/input.json", "--out=/x"]
