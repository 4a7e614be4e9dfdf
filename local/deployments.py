"""The Deployment controller and the kubelet of data-plane pods.

Each replica is a local process on its own loopback port, its pod object says where (podIP 127.0.0.1 and
the `http` containerPort), so the Service proxy and the operator's metrics scraper find it like a pod.
Readiness comes from the server's own /ready; a process that dies is restarted with a backoff and counted
in restartCount. A changed pod template replaces the pods (new ones first); a ConfigMap change is written
into the mounted files, which the servers reload in place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from modelfleet.local import pods, processes
from modelfleet.local.jobs import exit_code
from modelfleet.local.store import LocalKube

log = logging.getLogger(__name__)
STARTUP_PROBE_PERIOD = 0.5  # until ready; then the readinessProbe's own periodSeconds
PROBE_TIMEOUT = 2.0
MAX_BACKOFF = 30.0


def _rmtree(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def _pre_stop(container: pods.Container) -> None:
    """The container's preStop exec hook, as the kubelet runs it before SIGTERM: the Service has dropped
    the pod meanwhile, so requests that were on their way still find a server that accepts them."""
    hook = ((container.spec.get("lifecycle") or {}).get("preStop") or {}).get("exec", {}).get("command")
    if not hook:
        return
    try:
        process = subprocess.Popen(
            processes.argv({"command": hook}, container.mounts.path),
            cwd=container.folder, start_new_session=True,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    except OSError as exc:
        log.warning("pod %s: preStop hook failed: %s", container.pod, exc)
        return
    container.extra["pre_stop"] = process  # `stop_all` cuts it short: the whole fleet is going
    try:
        process.wait(timeout=container.extra.get("grace", 30))
    except subprocess.TimeoutExpired:
        log.warning("pod %s: preStop hook outlived the grace period", container.pod)
    processes.stop(process, grace=1)


def template_hash(template: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


class Replica:
    """The kubelet's view of one serving pod."""

    def __init__(self, container: pods.Container, deploy_uid: str, template: str, port: int) -> None:
        self.container, self.deploy_uid, self.template, self.port = container, deploy_uid, template, port
        self.ready = False
        self.failures = 0
        probe = container.spec.get("readinessProbe") or {}
        self.period = float(probe.get("periodSeconds", 10))
        self.failure_threshold = int(probe.get("failureThreshold", 3))
        self.next_probe = 0.0
        self.probe: Future | None = None
        self.restart_at: float | None = None
        self.last_state: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return self.container.pod


class DeploymentController:
    def __init__(self, kube: LocalKube, work_dir: Path, pvc_root: Path) -> None:
        self.kube, self.work_dir, self.pvc_root = kube, work_dir, pvc_root
        self.replicas: dict[str, Replica] = {}
        self.terminating: dict[str, tuple[Replica, threading.Thread]] = {}  # removed, still stopping
        self.http = httpx.Client(timeout=PROBE_TIMEOUT, trust_env=False)
        self.probes = ThreadPoolExecutor(max_workers=4, thread_name_prefix="probe")

    def sync(self) -> None:
        deploys = {d["metadata"]["uid"]: d for d in self.kube.all("apps/v1", "Deployment")}
        for name, replica in list(self.replicas.items()):
            pod = self.kube.get("v1", "Pod", replica.container.namespace, name)
            if replica.deploy_uid not in deploys or pod is None:
                self._remove(replica, delete=False)
        for deploy in deploys.values():
            self._sync_deployment(deploy)
        for name, (_, thread) in list(self.terminating.items()):
            if not thread.is_alive():
                del self.terminating[name]

    def _sync_deployment(self, deploy: dict[str, Any]) -> None:
        uid = deploy["metadata"]["uid"]
        wanted = template_hash(deploy["spec"]["template"])
        desired = self._desired(deploy)
        mine = [r for r in self.replicas.values() if r.deploy_uid == uid]
        current = [r for r in mine if r.template == wanted]
        for _ in range(desired - len(current)):
            current.append(self._create(deploy, wanted))
        for replica in [*mine, *current]:
            if replica.name in self.replicas:
                self._kubelet(replica)
        ready_current = [r for r in current if r.ready]
        if len(ready_current) >= desired:  # new pods first, then the old ones go
            for replica in mine:
                if replica.template != wanted:
                    self._remove(replica)
        extra = len(current) - desired
        if extra > 0:
            for replica in sorted(current, key=lambda r: (r.ready, r.name))[:extra]:
                self._remove(replica)
        mine = [r for r in self.replicas.values() if r.deploy_uid == uid]
        ready = sum(r.ready for r in mine)
        status = {
            "observedGeneration": deploy["metadata"].get("generation", 1),
            "replicas": len(mine),
            "updatedReplicas": sum(r.template == wanted for r in mine),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "conditions": [
                {
                    "type": "Available",
                    "status": "True" if ready >= desired else "False",
                    "reason": "MinimumReplicasAvailable"
                    if ready >= desired
                    else "MinimumReplicasUnavailable",
                }
            ],
        }
        if desired - ready > 0:
            status["unavailableReplicas"] = desired - ready
        self.kube.put_status(deploy, status)

    def _desired(self, deploy: dict[str, Any]) -> int:
        """spec.replicas; with an HPA on the Deployment, its minReplicas (nothing scales on load here)."""
        meta = deploy["metadata"]
        for hpa in self.kube.list("autoscaling/v2", "HorizontalPodAutoscaler", meta["namespace"]):
            if hpa["spec"].get("scaleTargetRef", {}).get("name") == meta["name"]:
                return int(hpa["spec"].get("minReplicas", 1))
        return int(deploy["spec"].get("replicas", 1))

    def _create(self, deploy: dict[str, Any], template: str) -> Replica:
        meta = deploy["metadata"]
        name = f"{meta['name']}-{template}-{pods.suffix()}"
        pod = pods.pod_object(deploy, deploy["spec"]["template"], name, {"pod-template-hash": template})
        container_spec = pod["spec"]["containers"][0]
        declared = pods.container_port(container_spec)
        port = pods.free_port()
        for entry in container_spec.get("ports", []) or []:
            if entry.get("name") == "http":
                entry["containerPort"] = port  # where the scraper and the proxy reach this pod
        pod = self.kube.apply(pod)
        container = pods.prepare(pod, self.work_dir / "pods" / name, self.pvc_root, port)
        container.extra["ports"] = {declared: port} if declared is not None else {}
        container.extra["grace"] = float(pod["spec"].get("terminationGracePeriodSeconds", 30))
        replica = Replica(container, meta["uid"], template, port)
        self.replicas[name] = replica
        pods.project_configmaps(self.kube, pod, container)
        pods.launch(pod, container, container.extra["ports"])
        log.info(
            "Deployment %s: started pod %s on port %d (pid %d)",
            meta["name"],
            name,
            port,
            container.process.pid,
        )
        return replica

    def _kubelet(self, replica: Replica) -> None:
        container = replica.container
        pod = self.kube.get("v1", "Pod", container.namespace, replica.name)
        if pod is None:
            return
        pods.project_configmaps(self.kube, pod, container)
        now = time.monotonic()
        code = container.process.poll() if container.process else None
        if code is not None and replica.restart_at is None:
            replica.last_state = {"terminated": pods.termination(container, exit_code(code))}
            replica.ready, replica.probe = False, None
            replica.restart_at = now + min(MAX_BACKOFF, 2.0**container.restarts)
            log.warning("pod %s: server exited with %d; restarting", replica.name, exit_code(code))
        if replica.restart_at is not None and now >= replica.restart_at:
            container.restarts += 1
            replica.restart_at, replica.failures = None, 0
            pods.launch(pod, container, container.extra["ports"])
        if replica.restart_at is None:
            self._probe(replica, now)
        self.kube.put_status(pod, self._pod_status(replica))

    def _probe(self, replica: Replica, now: float) -> None:
        if replica.probe is not None and replica.probe.done():
            ok = replica.probe.result()
            replica.failures = 0 if ok else replica.failures + 1
            if ok:
                replica.ready = True
            elif replica.failures >= replica.failure_threshold:
                replica.ready = False
            replica.probe = None
        if replica.probe is None and now >= replica.next_probe:
            replica.next_probe = now + (replica.period if replica.ready else STARTUP_PROBE_PERIOD)
            replica.probe = self.probes.submit(self._ready, replica.port)

    def _ready(self, port: int) -> bool:
        try:
            return self.http.get(f"http://{pods.POD_IP}:{port}/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def _pod_status(self, replica: Replica) -> dict[str, Any]:
        container = replica.container
        if replica.restart_at is not None:
            state: dict[str, Any] = {"waiting": {"reason": "CrashLoopBackOff"}}
        else:
            state = {"running": {"startedAt": container.started_at}}
        status: dict[str, Any] = {
            "phase": "Running",
            "podIP": pods.POD_IP,
            "conditions": [{"type": "Ready", "status": "True" if replica.ready else "False"}],
            "containerStatuses": [
                {
                    "name": container.spec["name"],
                    "ready": replica.ready,
                    "restartCount": container.restarts,
                    "state": state,
                    "image": container.spec.get("image", ""),
                    **({"lastState": replica.last_state} if replica.last_state else {}),
                }
            ],
        }
        return status

    def _remove(self, replica: Replica, delete: bool = True) -> None:
        """The pod leaves the endpoints first, then its server gets SIGTERM and its grace period."""
        self.replicas.pop(replica.name, None)
        replica.ready = False
        if delete:
            self.kube.delete("v1", "Pod", replica.container.namespace, replica.name)
        container = replica.container
        if container.process is not None:
            folder = container.folder  # its emptyDirs and projected files go with the pod
            thread = processes.stop(
                container.process,
                grace=container.extra.get("grace", 30),
                wait=False,
                before=lambda: _pre_stop(container),
                after=lambda: _rmtree(folder),
            )
            assert thread is not None
            self.terminating[replica.name] = (replica, thread)
        log.info("pod %s: stopping", replica.name)

    def stop_all(self) -> None:
        """Stop every server, those already stopping too; returns once all are gone."""
        stopping = [thread for _, thread in self.terminating.values()]
        for replica, _ in self.terminating.values():
            hook = replica.container.extra.get("pre_stop")
            if hook is not None:
                processes.stop(hook, grace=1)
            processes.terminate_group(replica.container.process.pid)  # now, not after the hook
        threads = [
            processes.stop(
                r.container.process,
                grace=30,
                wait=False,
                after=lambda f=r.container.folder: _rmtree(f / "volumes"),
            )
            for r in self.replicas.values()
            if r.container.process is not None
        ]  # the pods' logs stay in the work dir
        for thread in [*threads, *stopping]:
            if thread is not None:
                thread.join()
        self.replicas.clear()
        self.terminating.clear()
        self.probes.shutdown(wait=False, cancel_futures=True)
        self.http.close()
