"""A container's view of the file system, mapped onto local folders: each volumeMount's path becomes a
folder of the pod (emptyDir, projected ConfigMap) or of the PVC root (persistentVolumeClaim), and every
path a container is given (arguments, environment, the serving manifest) is rewritten the same way."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class Mounts:
    """mountPath -> local folder, longest mount first so nested mounts win."""

    def __init__(self, table: dict[str, Path]) -> None:
        self.table = dict(sorted(table.items(), key=lambda item: -len(item[0])))

    def path(self, text: str) -> str:
        """`text` with a leading mount path replaced by its local folder; anything else unchanged."""
        for mount, local in self.table.items():
            if text == mount or text.startswith(mount.rstrip("/") + "/"):
                return str(local) + text[len(mount.rstrip("/")) :]
        return text

    def deep(self, value: Any) -> Any:
        """Every string in a nested structure rewritten with `path`."""
        if isinstance(value, str):
            return self.path(value)
        if isinstance(value, list):
            return [self.deep(item) for item in value]
        if isinstance(value, dict):
            return {k: self.deep(v) for k, v in value.items()}
        return value


def pod_mounts(pod_spec: dict[str, Any], container: dict[str, Any], pod_dir: Path, pvc_root: Path) -> Mounts:
    """The container's mounts as local folders (created); ConfigMap folders are filled by the caller."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    table: dict[str, Path] = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"])
        if volume is None:
            raise ValueError(f"volumeMount {mount['name']!r} names no volume of the pod")
        if "persistentVolumeClaim" in volume:
            local = pvc_root / volume["persistentVolumeClaim"]["claimName"]
        else:
            local = pod_dir / "volumes" / mount["name"]
        local.mkdir(parents=True, exist_ok=True)
        table[mount["mountPath"]] = local
    return Mounts(table)


def configmap_volumes(pod_spec: dict[str, Any]) -> dict[str, str]:
    """volume name -> ConfigMap name, for the pod's ConfigMap volumes."""
    return {v["name"]: v["configMap"]["name"] for v in pod_spec.get("volumes", []) if "configMap" in v}


def write_atomically(path: Path, text: str) -> bool:
    """Write `text` to `path` by rename, as the kubelet swaps a ConfigMap volume; False when unchanged."""
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return True


def container_env(container: dict[str, Any], pod: dict[str, Any], mounts: Mounts) -> dict[str, str]:
    """The container's env: our own process environment (the image's, less our own MODELFLEET_ settings),
    then the container's variables, with $(VAR) references expanded and fieldRefs to the pod's name and
    namespace resolved."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFLEET_")}
    defined: dict[str, str] = {}  # $(VAR) names only variables the container defined before
    for entry in container.get("env", []):
        name = entry["name"]
        if "value" in entry:
            value = _expand(str(entry["value"]), defined)
        elif field := (entry.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath"):
            value = {
                "metadata.name": pod["metadata"]["name"],
                "metadata.namespace": pod["metadata"]["namespace"],
            }.get(field, "")
        else:
            continue
        env[name] = defined[name] = mounts.path(value)
    return env


def _expand(text: str, env: dict[str, str]) -> str:
    for name, value in env.items():
        text = text.replace(f"$({name})", value)
    return text
