"""MODELFLEET_GPU_SHARING=mps: the server's MPS control daemon, started before its engine processes, handed
to them through their environment, and told to quit once they have ended.

Without a GPU, a stand-in `nvidia-cuda-mps-control` on PATH records what the server asks of it (and, at
`quit`, which engine processes still carry its pipe directory: MPS clients left behind). The GPU test runs the
real daemon and checks that a CUDA process joins it."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from modelfleet.dataplane.server.gpu_sharing import CONTROL, LOG_ENV, PID_FILE, PIPE_ENV, MpsDaemon
from modelfleet.dataplane.server.settings import ServerSettings

from .conftest import engine_process_server

STAND_IN = textwrap.dedent(
    """\
    #!{python}
    # A stand-in for nvidia-cuda-mps-control, recording each call. `-d` starts a daemon in the background
    # (its pid in the pipe folder, as the real one keeps it) and returns. `quit` asks it to go: like the
    # real one, it takes a moment and still needs its folders to shut down.
    import json, os, subprocess, sys
    pipe = os.environ.get("{pipe}")
    record = {{"argv": sys.argv[1:], "pipe": pipe, "log": os.environ.get("{log}")}}
    exit_code = int(os.environ.get("STAND_IN_EXIT", "0"))
    if sys.argv[1:] == ["-d"] and exit_code == 0:
        daemon = [sys.executable, __file__, "--daemon"]  # detached, as a daemon is: no inherited stdio
        quiet = subprocess.DEVNULL
        subprocess.Popen(daemon, start_new_session=True, stdin=quiet, stdout=quiet, stderr=quiet)
        while not os.path.exists(os.path.join(pipe, "{pid_file}")):
            pass
    elif sys.argv[1:] == ["--daemon"]:
        import time
        with open(os.path.join(pipe, "{pid_file}"), "w") as out:
            out.write(str(os.getpid()))
        deadline = time.monotonic() + 20
        while not os.path.exists(os.path.join(pipe, "quit")) and time.monotonic() < deadline:
            time.sleep(0.02)
        if not os.environ.get("STAND_IN_IGNORE_QUIT"):
            time.sleep(0.3)
            record["folders_at_exit"] = os.path.isdir(pipe) and os.path.isdir(record["log"])
        else:
            time.sleep(5)
    elif not sys.argv[1:]:
        record["stdin"] = sys.stdin.read()
        open(os.path.join(pipe, "quit"), "w").close()
        clients = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                environ = open(f"/proc/{{pid}}/environ", "rb").read().split(b"\\0")
                spawned = b"spawn_main" in open(f"/proc/{{pid}}/cmdline", "rb").read()  # an engine process
            except OSError:
                continue
            if spawned and f"{pipe_env}={{pipe}}".encode() in environ:
                clients.append(int(pid))
        record["clients"] = clients
    with open(os.environ["STAND_IN_RECORD"], "a") as out:
        out.write(json.dumps(record) + "\\n")
    sys.exit(exit_code)
    """
)


@pytest.fixture
def stand_in(tmp_path, monkeypatch) -> Path:
    """PATH leads to the stand-in; returns the file its calls are recorded in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    control = bin_dir / CONTROL
    control.write_text(
        STAND_IN.format(
            python=sys.executable, pipe=PIPE_ENV, log=LOG_ENV, pid_file=PID_FILE, pipe_env=PIPE_ENV
        )
    )
    control.chmod(0o755)
    record = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("STAND_IN_RECORD", str(record))
    monkeypatch.delenv(PIPE_ENV, raising=False)
    monkeypatch.delenv(LOG_ENV, raising=False)
    return record


def calls(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


def test_the_daemon_starts_with_its_own_folders_and_quits_with_them(stand_in) -> None:
    environ = dict(os.environ)
    daemon = MpsDaemon(environ=environ)
    assert daemon.start()
    (started,) = calls(stand_in)
    assert started["argv"] == ["-d"]
    pipe, log = Path(started["pipe"]), Path(started["log"])
    assert pipe.is_dir() and log.is_dir() and pipe.parent == log.parent
    assert environ[PIPE_ENV] == str(pipe) and environ[LOG_ENV] == str(log)  # what engine processes inherit
    pid = int((pipe / PID_FILE).read_text())
    daemon.stop()
    _, quit_call, exited = calls(stand_in)
    assert quit_call["argv"] == [] and quit_call["stdin"] == "quit\n" and quit_call["pipe"] == str(pipe)
    # stop returned once the daemon had exited, and its folders went after it, not under it
    assert exited["argv"] == ["--daemon"] and exited["folders_at_exit"]
    assert not Path(f"/proc/{pid}").exists()
    assert not pipe.parent.exists()
    assert PIPE_ENV not in environ and LOG_ENV not in environ
    daemon.stop()  # a second stop does nothing
    assert len(calls(stand_in)) == 3


def test_a_daemon_that_outlives_quit_keeps_its_folders(stand_in, monkeypatch, caplog) -> None:
    monkeypatch.setenv("STAND_IN_IGNORE_QUIT", "1")
    daemon = MpsDaemon(environ=dict(os.environ))
    assert daemon.start()
    pipe = Path(calls(stand_in)[0]["pipe"])
    pid = int((pipe / PID_FILE).read_text())
    try:
        with caplog.at_level(logging.WARNING, logger="modelfleet.server"):
            daemon.stop(timeout=0.5)
        assert f"MPS control daemon {pid}: still running" in caplog.text
        assert pipe.is_dir()
    finally:
        os.kill(pid, signal.SIGKILL)
        shutil.rmtree(pipe.parent, ignore_errors=True)


def test_a_daemon_the_node_provides_is_used_and_left_alone(stand_in, tmp_path) -> None:
    environ = {**os.environ, PIPE_ENV: str(tmp_path / "node-mps")}
    daemon = MpsDaemon(environ=environ)
    assert daemon.start()
    daemon.stop()
    assert calls(stand_in) == []
    assert environ[PIPE_ENV] == str(tmp_path / "node-mps")


def test_without_the_control_binary_the_server_warns_and_serves_time_sliced(tmp_path, caplog) -> None:
    environ = {"PATH": str(tmp_path)}
    with caplog.at_level(logging.WARNING, logger="modelfleet.server"):
        assert not MpsDaemon(environ=environ).start()
    assert f"{CONTROL} is not on PATH" in caplog.text
    assert PIPE_ENV not in environ


def test_a_daemon_that_fails_to_start_is_reported_and_leaves_nothing(stand_in, monkeypatch, caplog) -> None:
    monkeypatch.setenv("STAND_IN_EXIT", "3")
    environ = dict(os.environ)
    with caplog.at_level(logging.WARNING, logger="modelfleet.server"):
        assert not MpsDaemon(environ=environ).start()
    assert f"{CONTROL} -d failed (3)" in caplog.text
    (started,) = calls(stand_in)
    assert not Path(started["pipe"]).parent.exists()
    assert PIPE_ENV not in environ


def test_the_servers_engine_process_joins_the_daemon_which_quits_after_it(
    stand_in, tiny_model_dir, monkeypatch
) -> None:
    """The seam: the server (settings from the environment, as in a pod) starts the daemon before its
    engine process, the process starts with the pipe directory in its environment, and `quit` comes once
    no process carries it any more."""
    with monkeypatch.context() as env:
        env.setenv("MODELFLEET_GPU_SHARING", "mps")
        settings = ServerSettings()
    assert settings.gpu_sharing == "mps"
    with engine_process_server(settings, tiny_model_dir) as live:
        pid = live.engine("tiny", "v1")._process.pid
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        pipe = calls(stand_in)[0]["pipe"]
        assert f"{PIPE_ENV}={pipe}".encode() in environ
    started, quit_call, exited = calls(stand_in)
    assert started["argv"] == ["-d"] and quit_call["stdin"] == "quit\n" and exited["folders_at_exit"]
    assert quit_call["clients"] == []  # the engine process had ended: no client left behind
    assert PIPE_ENV not in os.environ


@pytest.fixture
def gpu_environ() -> dict[str, str]:
    """This environment without any MPS daemon's folders, on a host with an NVIDIA GPU and the real
    control binary (else the test is skipped)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or shutil.which(CONTROL) is None:
        pytest.skip(f"needs an NVIDIA GPU and {CONTROL}")
    return {k: v for k, v in os.environ.items() if k not in (PIPE_ENV, LOG_ENV)}


@pytest.mark.gpu
def test_on_the_gpu_a_cuda_process_joins_the_servers_daemon(gpu_environ) -> None:
    environ = gpu_environ
    daemon = MpsDaemon(environ=environ)
    assert daemon.start()
    try:
        client = subprocess.Popen(
            [sys.executable, "-c", "import sys, torch; torch.ones(1, device='cuda'); sys.stdin.read()"],
            env=environ,
            stdin=subprocess.PIPE,
        )
        try:
            servers = ""
            for _ in range(100):  # an MPS server starts when its first client connects: this process
                servers = subprocess.run(
                    [CONTROL], input="get_server_list\n", env=environ, capture_output=True, text=True
                ).stdout.strip()
                if servers:
                    break
                time.sleep(0.2)
            assert servers, "no MPS server started: the CUDA process did not join the daemon"
        finally:
            client.communicate(b"", timeout=60)
        assert client.returncode == 0  # its CUDA work ran under MPS
    finally:
        pid = int((Path(environ[PIPE_ENV]) / "nvidia-cuda-mps-control.pid").read_text())
        daemon.stop()
    assert not Path(f"/proc/{pid}").exists()  # the daemon exited before stop returned


# The server process's own part, as it runs it: the daemon started, a version's loader asking whether
# there is a GPU (loading.torch_cuda_available), then the stop at shutdown. Run in a process of its own: a
# process that initialized CUDA before the daemon started is no client of it, whatever it asks later.
SERVER_SIDE = """
import time
from modelfleet.dataplane.server.gpu_sharing import MpsDaemon
from modelfleet.dataplane.server.loading import torch_cuda_available
daemon = MpsDaemon()
assert daemon.start()
root = daemon.root
assert torch_cuda_available()
started = time.monotonic()
daemon.stop(timeout=20)
print(round(time.monotonic() - started, 2), root.exists())
"""


@pytest.mark.gpu
def test_on_the_gpu_the_server_is_no_client_of_its_daemon_which_quits_at_once(gpu_environ) -> None:
    environ = gpu_environ
    done = subprocess.run(
        [sys.executable, "-c", SERVER_SIDE], env=environ, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seconds, folders_left = done.stdout.split()
    assert folders_left == "False" and float(seconds) < 10, (seconds, done.stderr[-2000:])
