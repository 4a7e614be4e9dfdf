"""Versions sharing one NVIDIA GPU through MPS (the Multi-Process Service).

Each loaded version's engine runs in a process of its own. Without MPS a GPU time-slices between the
processes' contexts: one engine's kernels never run beside another's, and two versions of a small model
split one GPU's throughput between them though neither fills it. Under MPS the engines' kernels run
concurrently (an A/B pair of the 1B preset at 128 streams on an H200: 36.6k -> 47.3k output tokens/s,
0.62x -> 0.86-0.98x of one version alone, alternating on one server (medians of three rounds), the pair
steady at 46-54k).

The server starts a control daemon of its own before any engine process exists (a process joins MPS when
it creates its CUDA context, and keeps the mode it started with), points the engine processes at it through
the environment they inherit, and asks it to quit once they have ended. Where the node already runs one
(the NVIDIA device plugin's MPS sharing sets CUDA_MPS_PIPE_DIRECTORY in the container), that one is used.
Fault isolation is the price: a GPU fault in one engine can end the MPS server of all of them.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

log = logging.getLogger("modelfleet.server")

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
PID_FILE = "nvidia-cuda-mps-control.pid"  # in the pipe folder


class MpsDaemon:
    """The server's own MPS control daemon; `start` says whether engines will share the GPU through MPS."""

    def __init__(self, control: str = CONTROL, environ: dict[str, str] | None = None) -> None:
        self.control = control
        self.environ = os.environ if environ is None else environ  # what engine processes inherit
        self.root: Path | None = None  # the pipe and log folders of a daemon this object started
        self.binary = control

    def start(self) -> bool:
        if self.environ.get(PIPE_ENV):
            log.info(
                "GPU sharing: MPS through the daemon at %s (%s is set)", self.environ[PIPE_ENV], PIPE_ENV
            )
            return True
        binary = shutil.which(self.control, path=self.environ.get("PATH"))
        if binary is None:
            log.warning(
                "MODELFLEET_GPU_SHARING=mps: %s is not on PATH; versions on one GPU take turns on it",
                self.control,
            )
            return False
        root = Path(tempfile.mkdtemp(prefix="modelfleet-mps-"))
        env = self._daemon_env(root)
        (root / "pipe").mkdir()
        (root / "log").mkdir()
        try:
            # -d: the daemon forks and this call returns once it listens on its pipe.
            done = subprocess.run([binary, "-d"], env=env, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            done = subprocess.CompletedProcess([binary, "-d"], -1, "", str(exc))
        if done.returncode != 0:
            shutil.rmtree(root, ignore_errors=True)
            log.warning(
                "MODELFLEET_GPU_SHARING=mps: %s -d failed (%s): %s; versions on one GPU take turns on it",
                self.control,
                done.returncode,
                (done.stderr or done.stdout).strip()[-300:],
            )
            return False
        self.root, self.binary = root, binary
        self.environ[PIPE_ENV], self.environ[LOG_ENV] = env[PIPE_ENV], env[LOG_ENV]
        log.info("GPU sharing: MPS control daemon started (pipes in %s)", env[PIPE_ENV])
        return True

    def stop(self, timeout: float = 30.0) -> None:
        """After the engine processes have ended: `quit`, which the daemon answers at once and carries
        out after its clients have gone, then its folders, once it has exited (it shuts its MPS server
        down through them: removed earlier, both stay running)."""
        if self.root is None:
            return
        root, self.root = self.root, None
        env = self._daemon_env(root)
        for name in (PIPE_ENV, LOG_ENV):
            if self.environ.get(name) == env[name]:
                del self.environ[name]
        pid = _daemon_pid(root / "pipe")
        try:
            subprocess.run(
                [self.binary], input="quit\n", env=env, capture_output=True, text=True, timeout=timeout
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("MPS control daemon: quit failed (%s); its folders stay: %s", exc, root)
            return
        if pid is not None and not _ended(pid, timeout):
            log.warning(
                "MPS control daemon %s: still running %.0f s after quit; its folders stay: %s",
                pid,
                timeout,
                root,
            )
            return
        shutil.rmtree(root, ignore_errors=True)

    def _daemon_env(self, root: Path) -> dict[str, str]:
        """The environment that names the daemon under `root`: its pipe and log folders."""
        return {**self.environ, PIPE_ENV: str(root / "pipe"), LOG_ENV: str(root / "log")}


def _daemon_pid(pipe: Path) -> int | None:
    """The control daemon's pid, from the file it keeps in its pipe folder."""
    try:
        return int((pipe / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def _ended(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            pass
        time.sleep(0.05)
    return False
