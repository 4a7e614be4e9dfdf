"""One pod on this machine: its object in the store, its folder, and its one container as a process."""

from __future__ import annotations

import copy
import secrets
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from modelfleet.local import processes
from modelfleet.local.mounts import Mounts, configmap_volumes, container_env, pod_mounts, write_atomically
from modelfleet.local.store import LocalKube
from modelfleet.operator.reconcile.conditions import now_rfc3339
from modelfleet.operator.reconcile.conversion import PVC_ROOT
from modelfleet.operator.reconcile.names import owner_reference

POD_IP = "127.0.0.1"  # every pod's address: nothing listens beyond loopback


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((POD_IP, 0))
        return s.getsockname()[1]


def pod_object(owner: dict[str, Any], template: dict[str, Any], name: str, labels: dict[str, str]) -> dict:
    """A Pod of `template`, owned (and garbage-collected) with `owner`."""
    meta = owner["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": meta["namespace"],
            "labels": {**(template.get("metadata") or {}).get("labels", {}), **labels},
            "ownerReferences": [owner_reference(owner)],
        },
        "spec": copy.deepcopy(template.get("spec") or {}),
        "status": {"phase": "Pending"},
    }


def suffix() -> str:
    return secrets.token_hex(3)[:5]


@dataclass
class Container:
    """The running (or last run) process of a pod's first container."""

    pod: str
    namespace: str
    folder: Path
    spec: dict[str, Any]
    mounts: Mounts
    port: int | None = None  # the local port standing in for the container's `http` port
    process: subprocess.Popen | None = None
    started_at: str = ""
    restarts: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def log(self) -> Path:
        return self.folder / "container.log"

    @property
    def termination_log(self) -> Path:
        return self.folder / "termination-log"


def prepare(pod: dict[str, Any], folder: Path, pvc_root: Path, port: int | None = None) -> Container:
    spec = pod["spec"]["containers"][0]
    table = pod_mounts(pod["spec"], spec, folder, pvc_root).table
    # Claims are mounted by name under the converter's PVC root, so the root itself maps too
    # ($MODELFLEET_PVC_ROOT names it).
    table.setdefault(PVC_ROOT, pvc_root)
    if path := spec.get("terminationMessagePath"):
        table[path] = folder / "termination-log"
    mounts = Mounts(table)
    return Container(pod["metadata"]["name"], pod["metadata"]["namespace"], folder, spec, mounts, port)


def container_port(spec: dict[str, Any]) -> int | None:
    for entry in spec.get("ports", []) or []:
        if entry.get("name") == "http":
            return int(entry["containerPort"])
    return None


def project_configmaps(kube: LocalKube, pod: dict[str, Any], container: Container) -> bool:
    """Write the pod's ConfigMap volumes as files (paths inside rewritten to local folders); True when a
    file changed. The server watches its manifest file, so a changed ConfigMap reaches it in place."""
    changed = False
    namespace = pod["metadata"]["namespace"]
    for volume, name in configmap_volumes(pod["spec"]).items():
        cm = kube.get("v1", "ConfigMap", namespace, name)
        seen = (cm or {}).get("metadata", {}).get("resourceVersion")
        if seen is not None and container.extra.get(f"configmap/{volume}") == seen:
            continue  # projected already: nothing to parse or write
        container.extra[f"configmap/{volume}"] = seen
        for key, text in ((cm or {}).get("data") or {}).items():
            target = container.folder / "volumes" / volume / key
            changed |= write_atomically(target, _localize(text, container.mounts))
    return changed


def _localize(text: str, mounts: Mounts) -> str:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if not isinstance(data, (dict, list)):
        return text
    return yaml.safe_dump(mounts.deep(data), sort_keys=False)


def launch(pod: dict[str, Any], container: Container, ports: dict[int, int] | None = None) -> None:
    """Start (or restart) the container's process; `ports` maps container ports to local ones (an
    argument naming a container port names the local one instead)."""
    env = container_env(container.spec, pod, container.mounts)
    by_text = {str(k): str(v) for k, v in (ports or {}).items()}
    if by_text:
        env["MODELFLEET_HOST"] = POD_IP  # the pod's address: the server listens on loopback only

    def rewrite(word: str) -> str:
        return by_text.get(word) or container.mounts.path(word)

    words = processes.argv(container.spec, rewrite)
    container.termination_log.unlink(missing_ok=True)
    container.process = processes.start(words, env, container.folder, container.log)
    container.started_at = now_rfc3339()


def termination(container: Container, code: int) -> dict[str, Any]:
    """The container's terminated state as the kubelet reports it, with its termination message."""
    message = ""
    if container.termination_log.is_file():
        message = container.termination_log.read_text(encoding="utf-8", errors="replace")[:4096]
    policy = container.spec.get("terminationMessagePolicy", "File")
    if not message.strip() and code != 0 and policy == "FallbackToLogsOnError":
        message = processes.tail(container.log)
    state: dict[str, Any] = {
        "exitCode": code,
        "reason": "Completed" if code == 0 else "Error",
        "startedAt": container.started_at,
        "finishedAt": now_rfc3339(),
    }
    if message:
        state["message"] = message
    return state
