"""The local fleet: the object store, the operator's reconcile driven by a loop, and the controllers that
play the cluster (Jobs, Deployments with their pods, Services as local endpoints).

One control thread does everything that changes state, in turn: hand-overs from other shells, the
operator's reconcile of every model (on every change of the store and on a short tick), rollout steps,
then the Job and Deployment controllers. The Service proxies run on an asyncio loop of their own.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from modelfleet.local import state
from modelfleet.local.admission import admit
from modelfleet.local.deployments import DeploymentController
from modelfleet.local.jobs import JobController
from modelfleet.local.proxy import ServiceProxy
from modelfleet.local.store import LocalKube
from modelfleet.operator import sync
from modelfleet.operator.api import API_VERSION, GROUP
from modelfleet.operator.kube import KubeError
from modelfleet.operator.settings import OperatorSettings
from modelfleet.operator.validation import InvalidResource

log = logging.getLogger(__name__)
TICK_SECONDS = 0.2  # process exits and readiness are looked at this often
RESYNC_SECONDS = 5.0  # every model is reconciled at least this often (60 s in a cluster)


class FleetError(RuntimeError):
    """The fleet cannot go on (e.g. its endpoint's port is taken); it stops, and says why."""


class Fleet:
    def __init__(
        self,
        work_dir: Path,
        *,
        pvc_root: Path | None = None,
        port: int = 8000,
        settings: OperatorSettings | None = None,
    ) -> None:
        self.work_dir = work_dir.resolve()
        self.pvc_root = (pvc_root or self.work_dir / "pvc").resolve()
        self.port = port
        self.kube = LocalKube()
        self.settings = settings or OperatorSettings()
        self.ctx = sync.Context(kube=self.kube, settings=self.settings, logger=log, record=self._record)
        self.jobs = JobController(self.kube, self.work_dir, self.pvc_root)
        self.deployments = DeploymentController(self.kube, self.work_dir, self.pvc_root)
        self.proxies: dict[tuple[str, str], ServiceProxy] = {}
        self._loop = asyncio.new_event_loop()
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._reconciled = -1
        self._next_resync = 0.0
        self._next_rollout: dict[tuple[str, str], float] = {}
        self._complaints: dict[tuple[str, str], str] = {}
        self._written = -1
        self.error: BaseException | None = None

    # --- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> Fleet:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.pvc_root.mkdir(parents=True, exist_ok=True)
        state.claim(self.work_dir)
        self._threads = [
            threading.Thread(target=self._loop.run_forever, name="fleet-proxies", daemon=True),
            threading.Thread(target=self._control, name="fleet-control", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        """Stop every process of the fleet and its endpoints; nothing is left running."""
        self._stop.set()
        control = self._threads[1] if len(self._threads) > 1 else None
        if control is not None and control is not threading.current_thread():
            control.join(timeout=60)
        self.jobs.stop_all()
        self.deployments.stop_all()
        for proxy in self.proxies.values():
            asyncio.run_coroutine_threadsafe(proxy.close(), self._loop).result(timeout=10)
        self.proxies.clear()
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._threads:
            self._threads[0].join(timeout=10)
        state.release(self.work_dir)

    def request_stop(self) -> None:
        """Ask the fleet to stop (safe from a signal handler); `stop` does the stopping."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # --- what users do ---------------------------------------------------------------------------------

    def apply(self, docs: Iterable[Any]) -> list[str]:
        """Admit every document first (nothing is stored when one is refused), then store them all."""
        admitted = []
        for doc in docs:
            meta = doc.get("metadata") if isinstance(doc, dict) else None
            if isinstance(meta, dict):
                meta.setdefault("namespace", "default")
            stored = self.kube.get(*_ref(doc)) if isinstance(meta, dict) and "name" in meta else None
            admitted.append((admit(doc, stored), stored))
        done = []
        for obj, before in admitted:
            after = self.kube.apply(obj)
            verb = "created" if before is None else ("unchanged" if before == after else "configured")
            done.append(f"{_kind_name(obj['kind'], obj['metadata']['name'])} {verb}")
        return done

    def delete(self, docs: Iterable[Any]) -> list[str]:
        done = []
        for doc in docs:
            meta = doc["metadata"]
            ref = (
                doc.get("apiVersion", API_VERSION),
                doc["kind"],
                meta.get("namespace", "default"),
                meta["name"],
            )
            if self.kube.delete(*ref):
                done.append(f"{_kind_name(ref[1], ref[3])} deleted")
        return done

    def endpoint(self, model: str, namespace: str = "default") -> str | None:
        proxy = self.proxies.get((namespace, model))
        return f"{proxy.url}/v1" if proxy else None

    # --- the control loop ------------------------------------------------------------------------------

    def _control(self) -> None:
        seen = -1
        while not self._stop.is_set():
            try:
                self._step()
            except FleetError as exc:
                log.error("%s", exc)
                self.error = exc
                self._stop.set()
                return
            except Exception as exc:  # a bug must not leave processes running unattended
                log.exception("the local fleet's control loop failed")
                self.error = exc
                self._stop.set()
                return
            seen = self.kube.wait_for_change(seen if seen >= 0 else self.kube.version, TICK_SECONDS)

    def _step(self) -> None:
        for request in state.inbox(self.work_dir):
            state.answer(request, self._handle(request))
        now = time.monotonic()
        if self.kube.version != self._reconciled or now >= self._next_resync:
            self._reconciled = self.kube.version
            self._next_resync = now + RESYNC_SECONDS
            self._reconcile_all()
        self._rollouts(now)
        self.jobs.sync()
        self.deployments.sync()
        self._services()
        if self.kube.version != self._written:
            self._written = self.kube.version
            state.write(self.work_dir, self._snapshot())

    def _reconcile_all(self) -> None:
        ims = self.kube.all(API_VERSION, "InferenceModel")
        models = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in ims}
        for im in ims:
            self._guard(im, lambda o=im: sync.reconcile_model(self.ctx, o))
        for mv in self.kube.all(API_VERSION, "ModelVersion"):  # a version without its model
            if (mv["metadata"]["namespace"], mv["spec"].get("model")) not in models:
                self._guard(mv, lambda o=mv: sync.reconcile_version(self.ctx, o, None))

    def _rollouts(self, now: float) -> None:
        """The rollout timer: every `rollout_tick_seconds` for models whose rollout is not finished."""
        for im in self.kube.all(API_VERSION, "InferenceModel"):
            key = (im["metadata"]["namespace"], im["metadata"]["name"])
            if not sync.rollout_pending(im.get("spec", {}), im.get("status")):
                self._next_rollout.pop(key, None)
                continue
            if now >= self._next_rollout.get(key, 0):
                self._next_rollout[key] = now + self.settings.rollout_tick_seconds
                self._guard(im, lambda o=im: sync.step_rollout(self.ctx, o))

    def _guard(self, obj: dict[str, Any], work: Any) -> None:
        """Run one reconcile as kopf would: a spec it can never use is said once, API errors retried."""
        key = (obj["kind"], obj["metadata"]["name"])
        try:
            work()
            self._complaints.pop(key, None)
        except (InvalidResource, KubeError) as exc:
            if self._complaints.get(key) != str(exc):
                self._complaints[key] = str(exc)
                log.warning("%s %s: %s", *key, exc)

    def _services(self) -> None:
        services = {
            (s["metadata"]["namespace"], s["metadata"]["name"]): s for s in self.kube.all("v1", "Service")
        }
        for key in list(self.proxies):
            if key not in services:
                asyncio.run_coroutine_threadsafe(self.proxies.pop(key).close(), self._loop).result(timeout=10)
        for key, service in services.items():
            if key in self.proxies:
                continue
            port = self.port if not any(p.port == self.port for p in self.proxies.values()) else 0
            selector = service["spec"].get("selector") or {}
            proxy = ServiceProxy(
                key[1], lambda ns=key[0], sel=selector: self._ready_endpoints(ns, sel), port=port
            )
            try:
                asyncio.run_coroutine_threadsafe(proxy.start(), self._loop).result(timeout=10)
            except OSError as exc:
                raise FleetError(
                    f"service {key[1]}: cannot listen on 127.0.0.1:{port} ({exc}); use --port"
                ) from None
            self.proxies[key] = proxy
            log.info("service %s/%s: %s", *key, proxy.url)

    def _ready_endpoints(self, namespace: str, selector: dict[str, str]) -> list[tuple[str, int]]:
        found = []
        for pod in self.kube.list("v1", "Pod", namespace, selector):
            status = pod.get("status") or {}
            ready = any(
                c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", [])
            )
            ports = [
                p["containerPort"]
                for c in pod["spec"]["containers"]
                for p in c.get("ports", [])
                if p.get("name") == "http"
            ]
            if ready and ports and not pod["metadata"].get("deletionTimestamp"):
                found.append((status.get("podIP", "127.0.0.1"), ports[0]))
        return found

    def _record(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        self.kube.post_event(obj, type_, reason, message[:1024])

    @property
    def events(self) -> list[dict[str, Any]]:
        """The Events the operator posted, oldest first, in short: time, kind, name, type, reason, message."""
        return [
            {
                "time": e["lastTimestamp"],
                "kind": e["involvedObject"]["kind"],
                "name": e["involvedObject"]["name"],
                **{k: e[k] for k in ("type", "reason", "message")},
            }
            for e in self.kube.events()
        ]

    def _handle(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            if request.get("op") == "delete":
                return {"ok": True, "lines": self.delete(request.get("docs", []))}
            return {"ok": True, "lines": self.apply(request.get("docs", []))}
        except (ValueError, KeyError, TypeError) as exc:
            return {"ok": False, "message": str(exc)}

    def _snapshot(self) -> dict[str, Any]:
        replicas = [
            *self.deployments.replicas.values(),
            *(r for r, _ in self.deployments.terminating.values()),
        ]
        pods = {
            r.name: {"pid": r.container.process.pid if r.container.process else None, "port": r.port}
            for r in replicas
        }
        pods.update(
            {
                name: {"pid": c.process.pid if c.process else None, "port": None}
                for name, c in self.jobs.running.items()
            }
        )
        return {
            "endpoints": {f"{ns}/{name}": f"{p.url}/v1" for (ns, name), p in self.proxies.items()},
            "pods": pods,
            "objects": [
                o for o in self.kube.all() if o["kind"] in ("InferenceModel", "ModelVersion", "Pod", "Job")
            ],
            "events": self.events[-50:],
        }


def _kind_name(kind: str, name: str) -> str:
    """kubectl's way of naming an object it acted on: inferencemodel.modelfleet.dev/chat."""
    return f"{kind.lower()}.{GROUP}/{name}"


def _ref(obj: dict[str, Any]) -> tuple[str, str, str, str]:
    meta = obj["metadata"]
    return obj.get("apiVersion", ""), obj.get("kind", ""), meta["namespace"], meta["name"]
