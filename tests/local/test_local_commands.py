"""`modelfleet local` as a user runs it: a model.yaml the API server would refuse is refused with its
message before anything starts; `up` in one shell, `status` and `down` from another."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml
from local_fleet import alive, wait_for
from modelfleet.operator.api import API_VERSION

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MODELFLEET = [sys.executable, "-m", "modelfleet.cli", "local"]


def local(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*MODELFLEET, *args], capture_output=True, text=True, timeout=timeout)


INVALID = 'The InferenceModel "chat" is invalid: '


@pytest.mark.parametrize(
    ("example", "message"),
    [
        ("weights-sum-90.yaml", INVALID + 'spec.traffic: Invalid value: "array": weights must sum to 100'),
        (
            "replicas-min-above-max.yaml",
            INVALID + 'spec.replicas: Invalid value: "object": min must be <= max',
        ),
    ],
)
def test_a_model_yaml_the_crds_refuse_is_refused_with_the_api_servers_message(tmp_path, example, message):
    # A valid ModelVersion first: it must not be created either, since the file as a whole is refused.
    good = yaml.safe_load_all((EXAMPLES / "model.yaml").read_text())
    bad = yaml.safe_load((EXAMPLES / "bad" / example).read_text())
    path = tmp_path / "model.yaml"
    first_version = next(d for d in good if d["kind"] == "ModelVersion")
    path.write_text(yaml.safe_dump_all([first_version, bad]))
    work = tmp_path / "work"
    result = local("up", "-f", str(path), "--work-dir", str(work), "--port", "0")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == f"modelfleet local: error: {message}"
    assert not work.exists()  # nothing started, nothing written


def start_up(tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    """`modelfleet local up` in its own session (as from another shell): model `chat`, whose one
    version's source is missing, so its conversion fails fast while its server runs."""
    docs = [
        {"apiVersion": API_VERSION, "kind": "InferenceModel", "metadata": {"name": "chat"},
         "spec": {"hardware": {"accelerator": "cpu"}, "traffic": [{"version": "v1", "weight": 100}]}},
        {"apiVersion": API_VERSION, "kind": "ModelVersion", "metadata": {"name": "chat-v1"},
         "spec": {"model": "chat", "version": "v1", "source": {"uri": "pvc://models/chat/missing"}}},
    ]  # fmt: skip
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    work = tmp_path / "work"
    with open(tmp_path / "up.log", "w") as log:
        up = subprocess.Popen(
            [*MODELFLEET, "up", "-f", str(path), "--work-dir", str(work), "--port", "0"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    return up, work, path


def failed_and_serving(work: Path) -> dict | None:
    """The fleet's state once the conversion has failed and a server runs."""
    try:
        state = json.loads((work / "state.json").read_text())
    except (OSError, ValueError):
        return None
    phases = {o["metadata"]["name"]: (o.get("status") or {}).get("phase") for o in state.get("objects", [])}
    served = any(p.get("port") for p in state.get("pods", {}).values())
    return state if phases.get("chat-v1") == "Failed" and served else None


def stop(up: subprocess.Popen) -> None:
    if up.poll() is None:
        os.killpg(up.pid, 9)
        up.wait()


def test_up_status_and_down_from_other_shells_leave_nothing_running(tmp_path):
    up, work, path = start_up(tmp_path)
    try:
        state = wait_for(lambda: failed_and_serving(work), 120, "the conversion to fail and a server to run")
        status = local("status", "--work-dir", str(work), "--events")
        assert status.returncode == 0, status.stderr
        lines = status.stdout.splitlines()
        assert lines[0].split() == ["NAME", "ACCELERATOR", "TRAFFIC", "READY", "ENDPOINT", "AGE"]
        assert lines[1].split()[:4] == ["inferencemodel.modelfleet.dev/chat", "cpu", "v1=0", "False"]
        (version,) = [line.split() for line in lines if line.startswith("modelversion.")]
        assert version[:4] == ["modelversion.modelfleet.dev/chat-v1", "chat", "v1", "Failed"]
        assert f"endpoint default/chat: {state['endpoints']['default/chat']}" in status.stdout
        events = status.stdout[status.stdout.index("LAST SEEN") :].splitlines()
        assert events[0].split() == ["LAST", "SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"]
        assert any(
            e.split()[1:4] == ["Normal", "ConversionStarted", "modelversion/chat-v1"] for e in events[1:]
        )

        server = {p.pid for p in psutil.Process(up.pid).children(recursive=True)}
        assert alive(server)
        deleted = local("delete", "im", "chat", "--work-dir", str(work))
        assert deleted.stdout.strip() == "inferencemodel.modelfleet.dev/chat deleted", deleted.stderr
        wait_for(lambda: not alive(server), 60, "the model's server to stop")
        assert local("apply", "-f", str(path), "--work-dir", str(work)).returncode == 0  # and back it comes
        wait_for(lambda: psutil.Process(up.pid).children(), 60, "a new server")

        started = {up.pid, *(p.pid for p in psutil.Process(up.pid).children(recursive=True))}
        assert len(alive(started)) >= 2  # the supervisor and its server
        down = local("down", "--work-dir", str(work))
        assert down.returncode == 0, down.stderr
        assert up.wait(timeout=60) == 0
        wait_for(lambda: not alive(started), 30, "every process of the fleet to stop")
        assert local("status", "--work-dir", str(work)).returncode == 1  # no fleet runs there any more
    finally:
        stop(up)


def test_down_stops_what_a_killed_fleet_left_running(tmp_path):
    up, work, _ = start_up(tmp_path)
    try:
        state = wait_for(lambda: failed_and_serving(work), 120, "a server to run")
        servers = {p["pid"] for p in state["pods"].values() if p.get("pid")}
        os.kill(up.pid, 9)  # the supervisor dies without stopping anything
        up.wait()
        assert alive(servers)
        again = local("up", "-f", str(tmp_path / "model.yaml"), "--work-dir", str(work), "--port", "0")
        assert again.returncode == 2 and "`modelfleet local down` first" in again.stderr, again.stderr
        down = local("down", "--work-dir", str(work))
        assert down.returncode == 0 and "left by a local fleet" in down.stdout, down.stdout
        wait_for(lambda: not alive(servers), 30, "the orphaned server to stop")
    finally:
        stop(up)
