"""The operator at scale and at rest; one JSON line.

Starts `modelfleet operator` as a subprocess, creates N InferenceModels (one ModelVersion each) at R per
second, and measures for each model the time from its creation to all its children existing (ConfigMap,
Deployment, Service, PDB, HPA when autoscaled, conversion Job): p50/p99, goal p99 <= 5 s. Then, with
nothing changing, it measures the operator process over a window: CPU (% of one core, goal < 5), RSS,
reconciles, its API requests by method, objects whose resourceVersion changed, Events posted. The
baseline, in the same run: the same operator before any model exists (its CPU, RSS and requests).

    python bench/operator_scale.py                # the cluster in KUBECONFIG: 1,000 models at 10/s
    python bench/operator_scale.py --kmock        # an emulated API server in this process: 100 models

Against a cluster it needs the CRDs (`kubectl apply -f crds/`) and rights to create a namespace; it
deletes the namespace at the end. Without a reachable cluster it prints a JSON line saying skipped.
In --kmock mode every watch also expires once in the middle of the rest window, as watches on a real
API server do now and then (kopf then lists everything again).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
GROUP, VERSION = "modelfleet.dev", "v1alpha1"
KINDS = ("configmaps", "deployments", "services", "poddisruptionbudgets", "horizontalpodautoscalers", "jobs")


def model(namespace: str, name: str, autoscaled: bool) -> tuple[dict, dict]:
    im = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceModel",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "hardware": {"accelerator": "nvidia-h100", "count": 1},
            "replicas": {"min": 1, "max": 2 if autoscaled else 1},
            "traffic": [{"version": "v1", "weight": 100}],
        },
    }
    mv = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ModelVersion",
        "metadata": {"name": f"{name}-v1", "namespace": namespace},
        "spec": {
            "model": name,
            "version": "v1",
            "source": {"uri": f"pvc://models/{name}/v1", "format": "hf-safetensors"},
        },
    }
    return im, mv


def expected_children(name: str, autoscaled: bool) -> set[tuple[str, str]]:
    kinds = ["deployments", "services", "poddisruptionbudgets"] + (["horizontalpodautoscalers"] * autoscaled)
    return {("configmaps", f"{name}-manifest"), ("jobs", name)} | {(kind, name) for kind in kinds}


def child_key(plural: str, obj: dict) -> tuple[str, str] | None:
    """(kind, name) of a child as `expected_children` names it: a Job by its model label."""
    meta = obj.get("metadata") or {}
    if plural == "jobs":
        model_name = (meta.get("labels") or {}).get(f"{GROUP}/model")
        return ("jobs", model_name) if model_name else None
    return (plural, meta.get("name", ""))


# --- the operator process --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Operator:
    def __init__(self, scope: list[str], env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        env = {
            **os.environ,
            **env,
            "MODELFLEET_OPERATOR_METRICS_PORT": str(self.port),
            "MODELFLEET_OPERATOR_HEALTH_PORT": "0",
        }
        self.log = log_path.open("w")
        command = [sys.executable, "-m", "modelfleet.cli", "operator", *scope, "--standalone"]
        self.proc = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.ps = psutil.Process(self.proc.pid)

    def metrics(self) -> dict[str, float]:
        """The operator's counters, summed by metric and the label that matters here."""
        from prometheus_client.parser import text_string_to_metric_families

        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5).read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "modelfleet_operator_reconciles_total":
                    key = "reconciles"
                elif sample.name == "modelfleet_operator_api_requests_total":
                    key = f"api_{sample.labels['method']}"
                elif sample.name == "modelfleet_operator_skipped_triggers_total":
                    key = f"skipped_{sample.labels['why']}"
                else:
                    continue
                out[key] = out.get(key, 0.0) + sample.value
        return out

    async def ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the operator exited ({self.proc.returncode}); see {self.log.name}")
            try:
                self.metrics()
                return
            except OSError:
                await asyncio.sleep(0.5)
        raise RuntimeError(f"the operator's metrics never answered; see {self.log.name}")

    async def window(self, seconds: float, halfway: Any = None) -> dict[str, Any]:
        """CPU, RSS and counter deltas of the operator over `seconds` (calling `halfway` midway)."""
        before, cpu0, t0 = self.metrics(), self.ps.cpu_times(), time.monotonic()
        await asyncio.sleep(seconds / 2)
        if halfway is not None:
            await halfway()
        await asyncio.sleep(seconds / 2)
        after, cpu1, t1 = self.metrics(), self.ps.cpu_times(), time.monotonic()
        busy = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
        delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
        return {
            "window_s": round(t1 - t0, 1),
            "cpu_percent_of_core": round(100 * busy / (t1 - t0), 2),
            "rss_mib": round(self.ps.memory_info().rss / 2**20, 1),
            "reconciles": int(delta.get("reconciles", 0)),
            "reconciles_per_min": round(60 * delta.get("reconciles", 0) / (t1 - t0), 1),
            "api_requests": {k[4:]: int(v) for k, v in sorted(delta.items()) if k.startswith("api_") and v},
            "skipped_triggers": {k[8:]: int(v) for k, v in sorted(delta.items()) if k.startswith("skipped_")},
        }

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# --- where the objects live ------------------------------------------------------------------------------


class Emulated:
    """ClusterEmulator (tests/operator/emulator.py) served from this process."""

    scope = ["--all-namespaces"]  # the emulator serves no Namespace list for kopf to watch

    async def start(self, namespace: str, kubeconfig: Path) -> None:
        sys.path.insert(0, str(ROOT / "tests" / "operator"))
        import kmock
        from emulator import ClusterEmulator

        self.namespace = namespace
        self.kmock = ClusterEmulator()
        self.server = kmock.Server(self.kmock)
        await self.kmock.__aenter__()
        await self.server.__aenter__()
        verbs = {"get", "list", "watch", "create", "patch", "update", "delete"}
        resources = {
            f"{GROUP}/{VERSION}/inferencemodels": "InferenceModel",
            f"{GROUP}/{VERSION}/modelversions": "ModelVersion",
            "apps/v1/deployments": "Deployment",
            "v1/services": "Service",
            "v1/configmaps": "ConfigMap",
            "v1/pods": "Pod",
            "v1/events": "Event",
            "batch/v1/jobs": "Job",
            "policy/v1/poddisruptionbudgets": "PodDisruptionBudget",
            "autoscaling/v2/horizontalpodautoscalers": "HorizontalPodAutoscaler",
        }
        for resource, kind in resources.items():
            info = {"kind": kind, "namespaced": True, "verbs": verbs, "subresources": {"status"}}
            self.kmock.resources[resource] = info
        for resource, kind in {
            "apiextensions.k8s.io/v1/customresourcedefinitions": "CustomResourceDefinition",
            "v1/namespaces": "Namespace",
        }.items():
            self.kmock.resources[resource] = {"kind": kind, "namespaced": False, "verbs": verbs}
        url = str(self.kmock.url).rstrip("/")
        kubeconfig.write_text(yaml.safe_dump(_kubeconfig(url)))

    async def create(self, obj: dict) -> None:
        plural = "inferencemodels" if obj["kind"] == "InferenceModel" else "modelversions"
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{self.namespace}/{plural}"
        response = await self.kmock.post(path, json=obj)
        response.raise_for_status()

    def children(self) -> set[tuple[str, str]]:
        found = set()
        for (resource, _, name), obj in list(self.kmock.objects.items()):
            if resource.plural in KINDS and not obj.deleted:
                key = child_key(resource.plural, {"metadata": {"name": name, **_meta(obj)}})
                if key is not None:
                    found.add(key)
        return found

    def versions(self) -> dict[tuple[str, str], str]:
        return {
            (str(resource.plural), name): str(_meta(obj).get("resourceVersion"))
            for (resource, _, name), obj in list(self.kmock.objects.items())
            if not obj.deleted and resource.plural != "events"
        }

    def events(self) -> int:
        return sum(
            1 for (resource, _, _), _obj in list(self.kmock.objects.items()) if resource.plural == "events"
        )

    def writes(self) -> int:
        return len(self.kmock.writes())

    async def halfway(self) -> None:
        await self.kmock.expire_watches()

    async def close(self) -> None:
        await self.server.__aexit__(None, None, None)
        await self.kmock.__aexit__(None, None, None)


def _meta(obj: Any) -> dict:
    return dict(obj.raw.get("metadata") or {})


def _kubeconfig(url: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "bench", "cluster": {"server": url}}],
        "users": [{"name": "bench", "user": {"token": "bench"}}],
        "contexts": [{"name": "bench", "context": {"cluster": "bench", "user": "bench"}}],
        "current-context": "bench",
    }


class Real:
    """The cluster in KUBECONFIG: a namespace of its own, children seen through watches."""

    async def start(self, namespace: str, kubeconfig: Path) -> None:
        from kubernetes import client

        self.namespace = namespace
        self.scope = ["--namespace", namespace]
        self.api = client.ApiClient()
        self.custom = client.CustomObjectsApi(self.api)
        self.core = client.CoreV1Api(self.api)
        self.core.create_namespace({"metadata": {"name": namespace}})
        self.seen: set[tuple[str, str]] = set()
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        lists = {
            "configmaps": self.core.list_namespaced_config_map,
            "services": self.core.list_namespaced_service,
            "deployments": client.AppsV1Api(self.api).list_namespaced_deployment,
            "poddisruptionbudgets": client.PolicyV1Api(self.api).list_namespaced_pod_disruption_budget,
            "horizontalpodautoscalers": client.AutoscalingV2Api(
                self.api
            ).list_namespaced_horizontal_pod_autoscaler,
            "jobs": client.BatchV1Api(self.api).list_namespaced_job,
        }
        for plural, list_fn in lists.items():
            threading.Thread(target=self._watch, args=(plural, list_fn), daemon=True).start()

    def _watch(self, plural: str, list_fn: Any) -> None:
        from kubernetes import watch

        while not self.stopping.is_set():
            for event in watch.Watch().stream(list_fn, self.namespace, timeout_seconds=30):
                key = child_key(plural, self.api.sanitize_for_serialization(event["object"]))
                if key is not None and event["type"] in ("ADDED", "MODIFIED"):
                    with self.lock:
                        self.seen.add(key)

    async def create(self, obj: dict) -> None:
        plural = "inferencemodels" if obj["kind"] == "InferenceModel" else "modelversions"
        await asyncio.to_thread(
            self.custom.create_namespaced_custom_object, GROUP, VERSION, self.namespace, plural, obj
        )

    def children(self) -> set[tuple[str, str]]:
        with self.lock:
            return set(self.seen)

    def versions(self) -> dict[tuple[str, str], str]:
        out = {}
        for plural in ("inferencemodels", "modelversions"):
            listed = self.custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, plural)
            out.update(
                {(plural, i["metadata"]["name"]): i["metadata"]["resourceVersion"] for i in listed["items"]}
            )
        from kubernetes import client

        for plural, list_fn in {
            "configmaps": self.core.list_namespaced_config_map,
            "services": self.core.list_namespaced_service,
            "deployments": client.AppsV1Api(self.api).list_namespaced_deployment,
            "jobs": client.BatchV1Api(self.api).list_namespaced_job,
        }.items():
            for item in list_fn(self.namespace).items:
                out[(plural, item.metadata.name)] = item.metadata.resource_version
        return out

    def events(self) -> int:
        return len(self.core.list_namespaced_event(self.namespace).items)

    def writes(self) -> None:
        return None  # the API server's own count is not ours to read; see objects_changed

    halfway = None

    async def close(self) -> None:
        self.stopping.set()
        self.core.delete_namespace(self.namespace)


def cluster_problem() -> str | None:
    """Why the cluster in KUBECONFIG cannot run this benchmark, or None."""
    from kubernetes import client, config

    try:
        config.load_kube_config()
        client.ApiextensionsV1Api().read_custom_resource_definition(f"inferencemodels.{GROUP}")
    except config.ConfigException as exc:
        return f"no cluster: {exc}"
    except client.ApiException as exc:
        if exc.status == 404:
            return "the CRDs are not installed: kubectl apply -f crds/"
        return f"the cluster refused: {exc.status} {exc.reason}"
    except OSError as exc:
        return f"no cluster reachable: {exc}"
    return None


# --- the run ---------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)], 3)


async def run(args: argparse.Namespace, where: Emulated | Real) -> dict[str, Any]:
    namespace = f"modelfleet-bench-{uuid.uuid4().hex[:6]}"
    workdir = Path(tempfile.mkdtemp(prefix="operator-scale-"))
    kubeconfig = workdir / "kubeconfig"
    await where.start(namespace, kubeconfig)
    env = {"MODELFLEET_RESYNC_SECONDS": str(args.resync), "MODELFLEET_LOG_LEVEL": "warning"}
    if isinstance(where, Emulated):
        env["KUBECONFIG"] = str(kubeconfig)
    operator = Operator(where.scope, env, workdir / "operator.log")
    try:
        await operator.ready()
        await asyncio.sleep(args.settle)
        baseline = await operator.window(args.baseline_seconds)

        created: dict[str, float] = {}
        done: dict[str, float] = {}
        wanted = {f"m{i:04d}": expected_children(f"m{i:04d}", i % 2 == 0) for i in range(args.models)}
        start = time.monotonic()
        cpu0, metrics0 = operator.ps.cpu_times(), operator.metrics()
        for index, name in enumerate(wanted):
            await asyncio.sleep(max(0.0, start + index / args.rate - time.monotonic()))
            im, mv = model(namespace, name, index % 2 == 0)
            await where.create(im)
            created[name] = time.monotonic()
            await where.create(mv)
            _check(where.children(), wanted, created, done)
        deadline = time.monotonic() + args.converge_timeout
        while len(done) < len(wanted) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            _check(where.children(), wanted, created, done)
        cpu1, metrics1 = operator.ps.cpu_times(), operator.metrics()
        creation_s = time.monotonic() - start
        made = {key: metrics1.get(key, 0.0) - metrics0.get(key, 0.0) for key in metrics1}
        requests = sum(v for k, v in made.items() if k.startswith("api_"))
        latencies = [done[m] - created[m] for m in done]

        await asyncio.sleep(args.settle)
        versions_before, events_before, writes_before = where.versions(), where.events(), where.writes()
        rest = await operator.window(args.rest_seconds, where.halfway)
        versions_after = where.versions()
        rest["objects_changed"] = sum(1 for k, v in versions_after.items() if versions_before.get(k) != v)
        rest["events_posted"] = where.events() - events_before
        if writes_before is not None:
            rest["writes_seen_by_api_server"] = where.writes() - writes_before
        busy = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
        return {
            "bench": "operator_scale",
            "mode": "kmock" if isinstance(where, Emulated) else "cluster",
            "models": args.models,
            "rate_per_s": args.rate,
            "resync_s": args.resync,
            "create_to_children_s": {
                "p50": percentile(latencies, 0.50),
                "p99": percentile(latencies, 0.99),
                "max": percentile(latencies, 1.0),
                "goal_p99": 5.0,
                "converged": len(done),
            },
            "creation": {
                "wall_s": round(creation_s, 1),
                "cpu_percent_of_core": round(100 * busy / creation_s, 1),
                "reconciles": int(made.get("reconciles", 0)),
                "api_requests_per_reconcile": round(requests / max(1.0, made.get("reconciles", 0)), 1),
                "skipped_triggers": {k[8:]: int(v) for k, v in made.items() if k.startswith("skipped_")},
            },
            "rest": {**rest, "goal_cpu_percent_of_core": 5.0},
            "baseline_no_models": baseline,
            "operator_log": str(workdir / "operator.log"),
        }
    finally:
        operator.stop()
        await where.close()


def _check(found: set, wanted: dict, created: dict, done: dict) -> None:
    now = time.monotonic()
    for name in created:
        if name not in done and wanted[name] <= found:
            done[name] = now


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kmock", action="store_true", help="an emulated API server instead of a cluster")
    parser.add_argument("--models", type=int, help="default: 1000 (cluster), 100 (kmock)")
    parser.add_argument("--rate", type=float, default=10.0, help="models created per second")
    parser.add_argument(
        "--rest-seconds", type=float, help="default: one resync interval, so each model's resync falls in it"
    )
    parser.add_argument("--baseline-seconds", type=float, default=20.0)
    parser.add_argument("--settle", type=float, default=15.0, help="seconds between phases")
    parser.add_argument("--converge-timeout", type=float, default=120.0)
    parser.add_argument("--resync", type=float, default=300.0, help="MODELFLEET_RESYNC_SECONDS")
    args = parser.parse_args(argv)
    args.models = args.models or (100 if args.kmock else 1000)
    args.rest_seconds = args.rest_seconds or args.resync
    if args.kmock:
        where: Emulated | Real = Emulated()
    else:
        problem = cluster_problem()
        if problem is not None:
            print(f"skipped: {problem}", file=sys.stderr)
            print(json.dumps({"bench": "operator_scale", "skipped": problem}))
            return 0
        where = Real()
    print(json.dumps(asyncio.run(run(args, where))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
