"""kopf handlers: thin triggers that call the reconcile loops of `sync.py`.

Every trigger (the resource's own changes, a periodic resync, events of the Jobs and Deployments it owns)
runs the same convergent reconcile of the InferenceModel concerned, one at a time per model. Triggers that
cannot tell a reconcile anything new are dropped (`triggers.py`): events of the operator's own writes,
objects replayed unchanged when kopf lists again, triggers a later reconcile already covered, and a resync
of a model reconciled recently. Errors map to kopf's: a transient API failure is a TemporaryError (retried
after a delay; for watch events, which kopf never retries, by a timer here), a spec the operator can
never use is a PermanentError (the status already says why; no retries).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import kopf
from modelfleet.operator import sync
from modelfleet.operator.api import GROUP, VERSION
from modelfleet.operator.kube import Kube, KubeError
from modelfleet.operator.observability import API_REQUESTS, SKIPPED, observed_reconcile
from modelfleet.operator.reconcile import names
from modelfleet.operator.settings import get_settings
from modelfleet.operator.triggers import Triggers
from modelfleet.operator.validation import InvalidResource

INFERENCE_MODELS = (GROUP, VERSION, "inferencemodels")
MODEL_VERSIONS = (GROUP, VERSION, "modelversions")
MANAGED = {names.LABEL_MANAGED_BY: names.FIELD_MANAGER}
ANNOTATION_PREFIX = "modelfleet.dev"
RETRY_SECONDS = 10
RETRY_ATTEMPTS = 6
RESYNC_SECONDS = get_settings().resync_seconds
RESYNC_SKIP_SECONDS = RESYNC_SECONDS / 2  # a resync finds nothing to do this soon after a reconcile
ROLLOUT_TICK_SECONDS = get_settings().rollout_tick_seconds

TRIGGERS = Triggers()
log = logging.getLogger(__name__)


def make_context(kube: Kube | None = None) -> sync.Context:
    kube = kube or Kube(on_request=lambda method: API_REQUESTS.labels(method).inc())
    return sync.Context(kube=kube, settings=get_settings(), record=post_event)


def post_event(obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
    """A Kubernetes Event about `obj`, through kopf's event poster (batched, never blocking a reconcile)."""
    kopf.event(obj, type=type_, reason=reason, message=message[:1024])


def _context(memo: Any, logger: Any, indices: Mapping[str, Any] | None = None) -> sync.Context:
    """The operator's context for one handler call; `indices`: kopf's keyword arguments, which carry its
    indices (the watch's view of versions and serving objects; absent when a test calls a handler)."""
    ctx = getattr(memo, "ctx", None)
    if ctx is None:
        ctx = memo.ctx = make_context()
    indices = indices or {}
    versions = indices.get("versions_by_model")
    serving = {kind: indices.get(index) for kind, index in SERVING_INDICES.items()}
    return replace(
        ctx,
        logger=logger,
        version_names=_names_in(versions) if versions is not None else ctx.version_names,
        watched=_watched_in(serving) if all(i is not None for i in serving.values()) else ctx.watched,
    )


def _names_in(index: Any) -> Callable[[str, str], list[str] | None]:
    def names_of(namespace: str, model: str) -> list[str] | None:
        try:
            return list(index.get((namespace, model), ()))
        except RuntimeError:  # the watch changed it while this thread read it: list the namespace
            return None

    return names_of


def _watched_in(indices: dict[str, Any]) -> Callable[[str, str, str], dict[str, Any] | None]:
    def watched(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        index = indices.get(kind)
        try:
            found = list(index.get((namespace, name), ())) if index is not None else []
        except RuntimeError:  # changed while read: read it from the API instead
            return None
        return copy.deepcopy(found[0]) if len(found) == 1 else None

    return watched


def _plain(body: Any) -> dict[str, Any]:
    return copy.deepcopy(dict(body))


def _run(
    ctx: sync.Context,
    kind: str,
    trigger: str,
    obj: dict[str, Any],
    model: str,
    work: Callable[[], Any],
    received: float | None = None,
    news: Callable[[], bool] | None = None,
) -> None:
    """Run `work` in the model's turn, unless a reconcile begun after `received` already covered it,
    or `news` (the event filter, asked again in the turn) says a reconcile has seen this version
    meanwhile: the event of a write of the reconcile this one waited for. `received` None: the trigger
    is not a plain reconcile (a rollout step) and always runs."""
    namespace, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    with TRIGGERS.turn(namespace, model, received) as needed:
        if not needed or (news is not None and not news()):
            SKIPPED.labels(kind, "covered" if not needed else "seen").inc()
            return
        with observed_reconcile(kind, namespace, name, trigger), ctx.kube.journal(TRIGGERS.remember):
            try:
                work()
            except InvalidResource as exc:
                raise kopf.PermanentError(str(exc)) from None
            except KubeError as exc:
                if exc.retryable:
                    raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=RETRY_SECONDS) from None
                if exc.status in (401, 403):
                    raise kopf.TemporaryError(
                        f"Kubernetes API refused the operator ({exc}); check its RBAC",
                        delay=6 * RETRY_SECONDS,
                    ) from None
                raise kopf.PermanentError(f"Kubernetes API rejected a request: {exc}") from None


def _retrying(
    ctx: sync.Context,
    kind: str,
    trigger: str,
    obj: dict[str, Any],
    model: str,
    work: Callable[[], Any],
    received: float,
    news: Callable[[], bool] | None = None,
    attempt: int = 0,
) -> None:
    """`_run` for watch events, which kopf never retries: a failure is retried here by a timer, with
    backoff, so a child's change is not left to the next resync. `work` must read what it needs fresh."""
    try:
        _run(ctx, kind, trigger, obj, model, work, received, news)
    except kopf.TemporaryError:
        if attempt < RETRY_ATTEMPTS:
            delay = min(RETRY_SECONDS * 2**attempt, RESYNC_SECONDS)
            again = threading.Timer(delay, _retry, args=(ctx, kind, obj, model, work, attempt + 1))
            again.daemon = True
            again.start()
        raise


def _retry(
    ctx: sync.Context, kind: str, obj: dict[str, Any], model: str, work: Callable[[], Any], attempt: int
) -> None:
    try:
        _retrying(ctx, kind, "retry", obj, model, work, time.monotonic(), attempt=attempt)
    except (kopf.TemporaryError, kopf.PermanentError) as exc:
        log.warning("%s %s: reconcile failed again: %s", kind, obj["metadata"]["name"], exc)


def _model_work(ctx: sync.Context, namespace: str, model: str) -> Callable[[], None]:
    """Reconcile the model as it is now (read fresh), unless it is gone or going."""

    def work() -> None:
        im = ctx.kube.get(*_im_ref(), namespace, model)
        if im is not None and not im["metadata"].get("deletionTimestamp"):
            sync.reconcile_model(ctx, im)

    return work


def _version_work(ctx: sync.Context, namespace: str, mv_name: str) -> Callable[[], None]:
    """Reconcile the version's model, or the version alone if it has none (read fresh)."""

    def work() -> None:
        mv = ctx.kube.get(*_mv_ref(), namespace, mv_name)
        if mv is not None:
            sync.reconcile_model_of_version(ctx, mv)

    return work


def _ref(namespace: str, name: str) -> dict[str, Any]:
    return {"metadata": {"namespace": namespace, "name": name}}


def _is_news(body: Any, type: str | None = None, **_: Any) -> bool:
    """kopf's `when` filter of the watch handlers: drop events that cannot tell a reconcile anything."""
    news = TRIGGERS.is_news(body, type)
    if not news:
        SKIPPED.labels(body.get("kind") or "object", "seen").inc()
    return news


def _is_version_news(body: Any, type: str | None = None, **_: Any) -> bool:
    """`_is_news` for ModelVersions, whose spec and deletion are all that a reconcile reads of them."""
    news = TRIGGERS.is_news(body, type, spec_only=True)
    if not news:
        SKIPPED.labels("ModelVersion", "seen").inc()
    return news


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
def model_changed(
    body: kopf.Body,
    memo: Any,
    logger: Any,
    reason: str = "update",
    **indices: Any,
) -> None:
    received = time.monotonic()
    im = _plain(body)
    ctx = _context(memo, logger, indices)
    name = im["metadata"]["name"]
    _run(ctx, "InferenceModel", str(reason), im, name, lambda: sync.reconcile_model(ctx, im), received)


# A safety net, not the way changes arrive (watch events are): it runs only on models that no other
# trigger reconciled for half an interval, and reads the model fresh.
@kopf.timer(*INFERENCE_MODELS, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS, idle=RESYNC_SECONDS / 2)
def model_resync(body: kopf.Body, memo: Any, logger: Any, **indices: Any) -> None:
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    if TRIGGERS.since_reconciled(namespace, name) < RESYNC_SKIP_SECONDS:
        SKIPPED.labels("InferenceModel", "covered").inc()
        return
    ctx = _context(memo, logger, indices)
    work = _model_work(ctx, namespace, name)
    _run(ctx, "InferenceModel", "resync", _ref(namespace, name), name, work, time.monotonic())


def _rollout_pending(spec: Any, status: Any, **_: Any) -> bool:
    return sync.rollout_pending(copy.deepcopy(dict(spec or {})), copy.deepcopy(dict(status or {})))


# kopf timer intervals are fixed per handler: the timer ticks often, and each rollout step waits its own
# spec.rollout.interval, counted from status.rollout.stepStartedAt.
@kopf.timer(*INFERENCE_MODELS, interval=ROLLOUT_TICK_SECONDS, when=_rollout_pending)
def rollout_tick(body: kopf.Body, memo: Any, logger: Any, **indices: Any) -> None:
    """Start, judge or advance the model's canary (spec.rollout), and serve its traffic."""
    im = _plain(body)
    ctx = _context(memo, logger, indices)
    _run(ctx, "InferenceModel", "rollout", im, im["metadata"]["name"], lambda: sync.step_rollout(ctx, im))


SERVING = {**MANAGED, names.LABEL_COMPONENT: "dataplane"}
SERVING_INDICES = {
    "Deployment": "deployments_seen",
    "Service": "services_seen",
    "ConfigMap": "configmaps_seen",
}


def _seen(namespace: str, name: str, body: kopf.Body) -> dict[tuple[str, str], dict[str, Any]]:
    """A serving object as the watch last saw it: a reconcile that finds it as it should be reads nothing
    (a stale view costs at most a GET: a difference is read again from the API before it is applied)."""
    meta = {k: v for k, v in body.get("metadata", {}).items() if k != "managedFields"}
    return {(namespace, name): {**body, "metadata": meta}}


@kopf.index("apps", "v1", "deployments", labels=SERVING)
def deployments_seen(namespace: str, name: str, body: kopf.Body, **_: Any) -> Any:
    return _seen(namespace, name, body)


@kopf.index("", "v1", "services", labels=SERVING)
def services_seen(namespace: str, name: str, body: kopf.Body, **_: Any) -> Any:
    return _seen(namespace, name, body)


@kopf.index("", "v1", "configmaps", labels=SERVING)
def configmaps_seen(namespace: str, name: str, body: kopf.Body, **_: Any) -> Any:
    return _seen(namespace, name, body)


@kopf.on.event("apps", "v1", "deployments", labels=SERVING, when=_is_news)
@kopf.on.event("", "v1", "services", labels=SERVING, when=_is_news)
@kopf.on.event("", "v1", "configmaps", labels=SERVING, when=_is_news)
def serving_child_event(body: kopf.Body, memo: Any, logger: Any, **indices: Any) -> None:
    """A serving object changed (pods ready, quota refusals, edited or deleted): refresh its model, which
    re-applies what drifted and re-creates what is gone."""
    received = time.monotonic()
    meta = body["metadata"]
    model = (meta.get("labels") or {}).get(names.LABEL_MODEL)
    if model:
        ctx = _context(memo, logger, indices)
        trigger, ref = str(body.get("kind") or "child").lower(), _ref(meta["namespace"], model)
        work = _model_work(ctx, meta["namespace"], model)
        news = lambda: TRIGGERS.is_news(body, None)  # noqa: E731
        _retrying(ctx, "InferenceModel", trigger, ref, model, work, received, news)


# --- ModelVersion ----------------------------------------------------------------------------------------


@kopf.index(*MODEL_VERSIONS)
def versions_by_model(namespace: str, name: str, spec: Any, **_: Any) -> dict[tuple[str, str], str]:
    """The names of each model's ModelVersions, from the watch: a reconcile reads them by name instead of
    listing every version of the namespace."""
    return {(namespace, str((spec or {}).get("model", ""))): name}


@kopf.on.event(*MODEL_VERSIONS, when=_is_version_news)
def version_event(
    body: kopf.Body,
    memo: Any,
    logger: Any,
    type: str | None = None,
    **indices: Any,
) -> None:
    """Any change of a version (created, converted, deleted) may change its model's traffic."""
    received = time.monotonic()
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    model = str((body.get("spec") or {}).get("model", ""))
    ctx = _context(memo, logger, indices)
    if type == "DELETED":  # gone: only its model has something left to do
        if model:
            work = _model_work(ctx, namespace, model)
            _retrying(ctx, "InferenceModel", "version-deleted", _ref(namespace, model), model, work, received)
        return
    work = _version_work(ctx, namespace, name)
    news = lambda: TRIGGERS.is_news(body, None, spec_only=True)  # noqa: E731
    _retrying(ctx, "ModelVersion", "event", _ref(namespace, name), model, work, received, news)


@kopf.on.event("batch", "v1", "jobs", labels={**MANAGED, names.LABEL_COMPONENT: "conversion"}, when=_is_news)
def job_event(body: kopf.Body, memo: Any, logger: Any, **indices: Any) -> None:
    """A conversion Job progressed: reconcile the version it belongs to (and that version's model)."""
    received = time.monotonic()
    namespace, labels = body["metadata"]["namespace"], body["metadata"].get("labels") or {}
    mv_name, model = labels.get(names.LABEL_VERSION), labels.get(names.LABEL_MODEL, "")
    if mv_name:
        ctx = _context(memo, logger, indices)
        work = _version_work(ctx, namespace, mv_name)
        news = lambda: TRIGGERS.is_news(body, None)  # noqa: E731
        _retrying(ctx, "ModelVersion", "job", _ref(namespace, mv_name), model, work, received, news)


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
            delay=3 * RETRY_SECONDS,
        )
    logger.info("no traffic points at this version any more; letting it go")


def _im_ref() -> tuple[str, str]:
    return f"{GROUP}/{VERSION}", "InferenceModel"


def _mv_ref() -> tuple[str, str]:
    return f"{GROUP}/{VERSION}", "ModelVersion"
