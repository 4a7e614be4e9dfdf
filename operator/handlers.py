"""kopf handlers: thin triggers that call the reconcile loops of `sync.py`.

Every trigger (the resource's own changes, a periodic resync, events of the Jobs and Deployments it owns)
runs the same convergent reconcile of the InferenceModel concerned, one at a time per model. Errors map
to kopf's: a transient API failure is a TemporaryError (retried after a delay), a spec the operator can
never use is a PermanentError (the status already says why; no retries).
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import kopf
from modelfleet.operator import sync
from modelfleet.operator.api import GROUP, VERSION
from modelfleet.operator.kube import Kube, KubeError
from modelfleet.operator.observability import observed_reconcile
from modelfleet.operator.reconcile import names
from modelfleet.operator.settings import get_settings
from modelfleet.operator.validation import InvalidResource

INFERENCE_MODELS = (GROUP, VERSION, "inferencemodels")
MODEL_VERSIONS = (GROUP, VERSION, "modelversions")
MANAGED = {names.LABEL_MANAGED_BY: names.FIELD_MANAGER}
ANNOTATION_PREFIX = "modelfleet.dev"
RETRY_SECONDS = 10
RESYNC_SECONDS = get_settings().resync_seconds
ROLLOUT_TICK_SECONDS = get_settings().rollout_tick_seconds

_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


@contextmanager
def _one_at_a_time(namespace: str, model: str) -> Iterator[None]:
    """Triggers of one model arrive from several watch streams at once; reconcile them in turn."""
    with _locks_guard:
        lock = _locks.setdefault((namespace, model), threading.Lock())
    with lock:
        yield


def make_context(kube: Kube | None = None) -> sync.Context:
    return sync.Context(kube=kube or Kube(), settings=get_settings(), record=post_event)


def post_event(obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
    """A Kubernetes Event about `obj`, through kopf's event poster (batched, never blocking a reconcile)."""
    kopf.event(obj, type=type_, reason=reason, message=message[:1024])


def _context(memo: Any, logger: Any) -> sync.Context:
    ctx = getattr(memo, "ctx", None)
    if ctx is None:
        ctx = memo.ctx = make_context()
    return replace(ctx, logger=logger)


def _plain(body: Any) -> dict[str, Any]:
    return copy.deepcopy(dict(body))


def _run(kind: str, trigger: str, obj: dict[str, Any], model: str, work: Callable[[], Any]) -> None:
    namespace, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    with _one_at_a_time(namespace, model), observed_reconcile(kind, namespace, name, trigger):
        try:
            work()
        except InvalidResource as exc:
            raise kopf.PermanentError(str(exc)) from None
        except KubeError as exc:
            if exc.retryable:
                raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=RETRY_SECONDS) from None
            if exc.status in (401, 403):
                raise kopf.TemporaryError(
                    f"Kubernetes API refused the operator ({exc}); check its RBAC", delay=6 * RETRY_SECONDS
                ) from None
            raise kopf.PermanentError(f"Kubernetes API rejected a request: {exc}") from None


# --- startup ---------------------------------------------------------------------------------------------


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    # Progress and diff-base in our own annotations: the structural status schema would prune kopf's
    # status fields, so they must not live there.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/in-use-protection"
    settings.posting.reporting_component = names.FIELD_MANAGER
    # Events come from what the operator did (ConversionStarted, TrafficUpdated, ...), posted explicitly;
    # of kopf's own log lines only warnings and errors (failed handlers) become Events.
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = 8
    memo.ctx = make_context()


# --- InferenceModel --------------------------------------------------------------------------------------


@kopf.on.resume(*INFERENCE_MODELS)
@kopf.on.create(*INFERENCE_MODELS)
@kopf.on.update(*INFERENCE_MODELS)
def model_changed(body: kopf.Body, memo: Any, logger: Any, reason: str = "update", **_: Any) -> None:
    im = _plain(body)
    ctx = _context(memo, logger)
    _run("InferenceModel", str(reason), im, im["metadata"]["name"], lambda: sync.reconcile_model(ctx, im))


@kopf.timer(*INFERENCE_MODELS, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS, idle=RESYNC_SECONDS / 2)
def model_resync(body: kopf.Body, memo: Any, logger: Any, **_: Any) -> None:
    model_changed(body=body, memo=memo, logger=logger, reason="resync")


def _rollout_pending(spec: Any, status: Any, **_: Any) -> bool:
    return sync.rollout_pending(copy.deepcopy(dict(spec or {})), copy.deepcopy(dict(status or {})))


# kopf timer intervals are fixed per handler: the timer ticks often, and each rollout step waits its own
# spec.rollout.interval, counted from status.rollout.stepStartedAt.
@kopf.timer(*INFERENCE_MODELS, interval=ROLLOUT_TICK_SECONDS, when=_rollout_pending)
def rollout_tick(body: kopf.Body, memo: Any, logger: Any, **_: Any) -> None:
    """Start, judge or advance the model's canary (spec.rollout), and serve its traffic."""
    im = _plain(body)
    ctx = _context(memo, logger)
    _run("InferenceModel", "rollout", im, im["metadata"]["name"], lambda: sync.step_rollout(ctx, im))


SERVING = {**MANAGED, names.LABEL_COMPONENT: "dataplane"}


@kopf.on.event("apps", "v1", "deployments", labels=SERVING)
@kopf.on.event("", "v1", "services", labels=SERVING)
@kopf.on.event("", "v1", "configmaps", labels=SERVING)
def serving_child_event(body: kopf.Body, memo: Any, logger: Any, **_: Any) -> None:
    """A serving object changed (pods ready, quota refusals, edited or deleted): refresh its model, which
    re-applies what drifted and re-creates what is gone."""
    child = _plain(body)
    model = child["metadata"].get("labels", {}).get(names.LABEL_MODEL)
    ctx = _context(memo, logger)
    im = ctx.kube.get(*_im_ref(), child["metadata"]["namespace"], model) if model else None
    if im is not None and not im["metadata"].get("deletionTimestamp"):
        _run(
            "InferenceModel",
            child.get("kind", "child").lower(),
            im,
            model,
            lambda: sync.reconcile_model(ctx, im),
        )


# --- ModelVersion ----------------------------------------------------------------------------------------


@kopf.on.event(*MODEL_VERSIONS)
def version_event(body: kopf.Body, memo: Any, logger: Any, type: str | None = None, **_: Any) -> None:
    """Any change of a version (created, converted, deleted) may change its model's traffic."""
    mv = _plain(body)
    model = mv.get("spec", {}).get("model", "")
    ctx = _context(memo, logger)
    if type == "DELETED":  # gone: only its model has something left to do
        im = ctx.kube.get(*_im_ref(), mv["metadata"]["namespace"], model) if model else None
        if im is not None:
            _run("InferenceModel", "version-deleted", im, model, lambda: sync.reconcile_model(ctx, im))
        return
    _run("ModelVersion", "event", mv, model, lambda: sync.reconcile_model_of_version(ctx, mv))


@kopf.on.event("batch", "v1", "jobs", labels={**MANAGED, names.LABEL_COMPONENT: "conversion"})
def job_event(body: kopf.Body, memo: Any, logger: Any, **_: Any) -> None:
    """A conversion Job progressed: reconcile the version it belongs to (and that version's model)."""
    job = _plain(body)
    labels = job["metadata"].get("labels", {})
    ctx = _context(memo, logger)
    mv_name, model = labels.get(names.LABEL_VERSION), labels.get(names.LABEL_MODEL, "")
    mv = ctx.kube.get(*_mv_ref(), job["metadata"]["namespace"], mv_name) if mv_name else None
    if mv is not None:
        _run("ModelVersion", "job", mv, model, lambda: sync.reconcile_model_of_version(ctx, mv))


@kopf.on.delete(*MODEL_VERSIONS)
def version_deleted(body: kopf.Body, memo: Any, logger: Any, **_: Any) -> None:
    """Keep a version (through kopf's finalizer) while its model's traffic still lists it."""
    mv = _plain(body)
    ctx = _context(memo, logger)
    holders = sync.traffic_holders(ctx.kube, mv)
    if holders:
        sync.mark_in_use(ctx, mv, holders)
        raise kopf.TemporaryError(
            f"still in spec.traffic of InferenceModel {', '.join(holders)}; waiting for it to leave",
            delay=RESYNC_SECONDS / 2,
        )
    logger.info("no traffic points at this version any more; letting it go")


def _im_ref() -> tuple[str, str]:
    return f"{GROUP}/{VERSION}", "InferenceModel"


def _mv_ref() -> tuple[str, str]:
    return f"{GROUP}/{VERSION}", "ModelVersion"
