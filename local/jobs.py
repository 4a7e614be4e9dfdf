"""The Job controller and the kubelet of conversion pods: each Job's pod runs as a local process, and its
outcome is written back as the job controller and kubelet write it (the pod's terminated state with the
termination message, the Job's succeeded/failed counts and Complete/Failed conditions), which is what the
operator's `conversion.job_outcome` reads."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

from modelfleet.local import pods, processes
from modelfleet.local.store import LocalKube
from modelfleet.operator.reconcile.conditions import now_rfc3339

log = logging.getLogger(__name__)
BACKOFF_SECONDS = 1.0  # before the n-th retry: BACKOFF_SECONDS * 2**(n-1) (10 s in a cluster)


def exit_code(returncode: int) -> int:
    """Popen's -SIGNAL as the kubelet reports it (128 + signal)."""
    return 128 - returncode if returncode < 0 else returncode


class JobController:
    def __init__(self, kube: LocalKube, work_dir: Path, pvc_root: Path) -> None:
        self.kube, self.work_dir, self.pvc_root = kube, work_dir, pvc_root
        self.running: dict[str, pods.Container] = {}  # pod name -> its container
        self.retry_at: dict[str, float] = {}  # job uid -> when its next pod may start

    def sync(self) -> None:
        jobs = {j["metadata"]["uid"]: j for j in self.kube.all("batch/v1", "Job")}
        for name, container in list(self.running.items()):
            job_uid = container.extra["job_uid"]
            job = jobs.get(job_uid)
            if job is None:  # the Job (or its owner) was deleted: its pod goes with it
                self._abandon(container)
                del self.running[name]
                continue
            code = container.process.poll()
            deadline = job["spec"].get("activeDeadlineSeconds")
            if code is None and deadline and time.monotonic() - container.extra["t0"] > deadline:
                processes.stop(container.process, grace=5)
                self._finish(
                    job, "Failed", "DeadlineExceeded", "Job was active longer than specified deadline"
                )
                del self.running[name]
                continue
            if code is not None:
                del self.running[name]
                self._exited(job, container, exit_code(code))
        for uid in jobs:
            job = self.kube.get(*_ref(jobs[uid]))
            if job is None or _finished(job) or any(c.extra["job_uid"] == uid for c in self.running.values()):
                continue
            if time.monotonic() >= self.retry_at.get(uid, 0):
                self._start_pod(job)

    def _start_pod(self, job: dict[str, Any]) -> None:
        meta = job["metadata"]
        name = f"{meta['name']}-{pods.suffix()}"
        labels = {"job-name": meta["name"], "batch.kubernetes.io/job-name": meta["name"],
                  "controller-uid": meta["uid"]}  # fmt: skip
        pod = pods.pod_object(job, job["spec"]["template"], name, labels)
        pod = self.kube.apply(pod)
        folder = self.work_dir / "pods" / name
        container = pods.prepare(pod, folder, self.pvc_root)
        container.extra.update(job_uid=meta["uid"], t0=time.monotonic())
        pods.launch(pod, container)
        self.running[name] = container
        status = {
            **(job.get("status") or {}),
            "active": 1,
            "startTime": job.get("status", {}).get("startTime") or now_rfc3339(),
        }
        self.kube.put_status(job, status)
        self.kube.put_status(
            pod, _pod_status(container, {"running": {"startedAt": container.started_at}}, "Running")
        )
        log.info("Job %s: started pod %s (pid %d)", meta["name"], name, container.process.pid)

    def _exited(self, job: dict[str, Any], container: pods.Container, code: int) -> None:
        pod = self.kube.get("v1", "Pod", container.namespace, container.pod)
        terminated = pods.termination(container, code)
        if pod is not None:
            phase = "Succeeded" if code == 0 else "Failed"
            self.kube.put_status(pod, _pod_status(container, {"terminated": terminated}, phase))
        status = dict(job.get("status") or {})
        status.pop("active", None)
        spec = job["spec"]
        if code == 0:
            status["succeeded"] = status.get("succeeded", 0) + 1
            self.kube.put_status(job, status)
            self._finish(job, "Complete", "", "")
            return
        status["failed"] = status.get("failed", 0) + 1
        self.kube.put_status(job, status)
        job = self.kube.get(*_ref(job)) or job
        for index, rule in enumerate((spec.get("podFailurePolicy") or {}).get("rules", [])):
            match = rule.get("onExitCodes") or {}
            if rule.get("action") == "FailJob" and code in match.get("values", []):
                pod_name = f"{container.namespace}/{container.pod}"
                message = (
                    f"Container {container.spec['name']} for pod {pod_name} failed "
                    f"with exit code {code} matching FailJob rule at index {index}"
                )
                self._finish(job, "Failed", "PodFailurePolicy", message)
                return
        if status["failed"] > spec.get("backoffLimit", 6):
            self._finish(job, "Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")
            return
        self.retry_at[job["metadata"]["uid"]] = time.monotonic() + BACKOFF_SECONDS * 2 ** (
            status["failed"] - 1
        )

    def _finish(self, job: dict[str, Any], type_: str, reason: str, message: str) -> None:
        job = self.kube.get(*_ref(job)) or job
        now = now_rfc3339()
        status = dict(job.get("status") or {})
        status.pop("active", None)
        first = "SuccessCriteriaMet" if type_ == "Complete" else "FailureTarget"
        status["conditions"] = [
            {"type": t, "status": "True", "reason": reason, "message": message,
             "lastProbeTime": now, "lastTransitionTime": now}
            for t in (first, type_)
        ]  # fmt: skip
        if type_ == "Complete":
            status["completionTime"] = now
        self.kube.put_status(job, status)
        log.info("Job %s: %s %s", job["metadata"]["name"], type_, message)

    def _abandon(self, container: pods.Container, wait: bool = True) -> Any:
        """Stop a conversion that is no longer wanted and remove what it left half-written."""
        return processes.stop(container.process, grace=5, wait=wait, after=lambda: _remove_staging(container))

    def stop_all(self) -> None:
        threads = [self._abandon(c, wait=False) for c in self.running.values()]
        for thread in threads:
            if thread is not None:
                thread.join()
        self.running.clear()


def _remove_staging(container: pods.Container) -> None:
    """The converter stages an artifact as `.<name>.tmp-*` beside its --out folder and publishes it by a
    rename; a conversion stopped midway leaves the staging folder behind."""
    words = [*container.spec.get("command", []), *container.spec.get("args", [])]
    if "--out" in words[:-1]:
        out = Path(container.mounts.path(words[words.index("--out") + 1]))
        for staging in out.parent.glob(f".{out.name}.tmp-*"):
            shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(container.folder, ignore_errors=True)


def _ref(obj: dict[str, Any]) -> tuple[str, str, str, str]:
    return obj["apiVersion"], obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]


def _finished(job: dict[str, Any]) -> bool:
    return any(
        c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
        for c in (job.get("status") or {}).get("conditions", [])
    )


def _pod_status(container: pods.Container, state: dict[str, Any], phase: str) -> dict[str, Any]:
    return {
        "phase": phase,
        "podIP": pods.POD_IP,
        "startTime": container.started_at,
        "containerStatuses": [
            {
                "name": container.spec["name"],
                "ready": "running" in state,
                "restartCount": container.restarts,
                "state": state,
                "image": container.spec.get("image", ""),
            }
        ],
    }
