"""Reconcile loops: read the world through `Kube`, decide with `reconcile.*`, write the difference.

Each function reads everything it needs fresh, so calling it again (from a timer, a child's event, or a
retry) converges on the same state; applying unchanged objects and patching an unchanged status are
both no-ops, so nothing loops.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from modelfleet.operator.api import API_VERSION, InferenceModel, InferenceModelSpec, TrafficEntry
from modelfleet.operator.kube import Kube, KubeError, matches, status_patch, with_digest
from modelfleet.operator.metrics_source import MetricsSource, ScrapeError
from modelfleet.operator.reconcile import conversion, names, rollout
from modelfleet.operator.reconcile.conditions import condition, find, merge_conditions, now_rfc3339
from modelfleet.operator.reconcile.model_status import invalid_spec_status, model_status
from modelfleet.operator.reconcile.plan import duplicate_versions, serving_plan, version_views
from modelfleet.operator.reconcile.serving import endpoint
from modelfleet.operator.reconcile.targets import TargetError, resolve_targets
from modelfleet.operator.reconcile.traffic import draft_artifact, plan_traffic
from modelfleet.operator.reconcile.version_status import version_status
from modelfleet.operator.reconcile.windows import Sample, sample_from_status, sample_to_status, windows
from modelfleet.operator.settings import OperatorSettings
from modelfleet.operator.validation import InvalidResource, validate_inference_model, validate_model_version

log = logging.getLogger(__name__)
Clock = Callable[[], str]
Recorder = Callable[[dict[str, Any], str, str, str], None]  # (object, Normal|Warning, reason, message)
Scraper = Callable[[str, str], Sample]  # (namespace, model) -> counters of the model's data-plane pods


def _no_events(obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
    return None


@dataclass
class Context:
    kube: Kube
    settings: OperatorSettings
    logger: logging.Logger | logging.LoggerAdapter = log
    clock: Clock = now_rfc3339
    record: Recorder = _no_events  # posts a Kubernetes Event about an object
    scrape: Scraper | None = None  # default: the pods' /metrics, through `MetricsSource`
    # (namespace, model) -> names of its ModelVersions as the watch knows them; None: list the namespace
    version_names: Callable[[str, str], list[str] | None] | None = None
    # (kind, namespace, name) -> a serving object as the watch last saw it; None: not watched, or unseen
    watched: Callable[[str, str, str], dict[str, Any] | None] | None = None

    def event(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        log_level = logging.WARNING if type_ == "Warning" else logging.INFO
        # k8s_skip: kopf's object logger would post this line as an Event of the handled object too.
        text = f"{obj.get('kind')} {obj['metadata']['name']}: {message}"
        self.logger.log(log_level, text, extra={"k8s_skip": True})
        self.record(obj, type_, reason, message)


def _write_status(ctx: Context, obj: dict[str, Any], new: dict[str, Any]) -> bool:
    patch = status_patch(obj.get("status"), new)
    if patch is None:
        return False
    meta = obj["metadata"]
    try:
        ctx.kube.patch_status(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"], patch)
    except KubeError as exc:
        if exc.status == 404:  # deleted meanwhile: nothing left to report on
            return False
        raise
    obj["status"] = new
    return True


# --- ModelVersion ----------------------------------------------------------------------------------------


def reconcile_version(
    ctx: Context, mv: dict[str, Any], accelerator: str | None, duplicate_of: str | None = None
) -> dict[str, Any]:
    """Create the missing conversion Jobs of `mv`, read their outcomes, write its status; returns it.

    `duplicate_of` names an older ModelVersion that already provides the same model and version: this
    one then converts nothing and says so.
    """
    meta = mv["metadata"]
    namespace, generation = meta["namespace"], meta.get("generation")
    version = None
    try:
        version = validate_model_version(mv)
    except InvalidResource as exc:
        targets: Any = TargetError("InvalidSpec", str(exc))
    if duplicate_of is not None:
        spec = mv.get("spec", {})
        targets = TargetError(
            "DuplicateVersion",
            f"ModelVersion {duplicate_of} already provides {spec.get('model')}@{spec.get('version')}; "
            "delete this one or give it another spec.version",
        )
    elif version is not None:
        try:
            targets = resolve_targets(version.spec, accelerator)
        except TargetError as exc:
            targets = exc
    outcomes = {}
    if version is not None and not isinstance(targets, TargetError):
        jobs = {
            j["metadata"].get("labels", {}).get(names.LABEL_TARGET): j
            for j in ctx.kube.list("batch/v1", "Job", namespace, {names.LABEL_VERSION: meta["name"]})
        }
        for target in targets:
            slug = names.target_slug(target)
            job = jobs.get(slug)
            if job is None and meta.get("deletionTimestamp"):
                outcomes[slug] = conversion.JobOutcome("missing")
                continue
            created = job is None
            if job is None:
                # Jobs are immutable once created; create only the missing ones.
                job = ctx.kube.apply(conversion.conversion_job(mv, version, target, ctx.settings))
                ctx.event(
                    mv, "Normal", "ConversionStarted", f"created Job {job['metadata']['name']} for {slug}"
                )
            pods, job_events = [], []
            if _job_finished(job):
                pods = ctx.kube.list("v1", "Pod", namespace, {"job-name": job["metadata"]["name"]})
            elif not created and not (job.get("status") or {}).get("active"):
                # No pod of this Job exists: if none can be created, only the Job's Events say why.
                job_events = _job_events(ctx, job)
            outcomes[slug] = conversion.job_outcome(job, pods, target, job_events)
    status = version_status(
        generation=generation,
        targets=targets,
        outcomes=outcomes,
        old_status=mv.get("status"),
        now=ctx.clock(),
    )
    before = (mv.get("status") or {}).get("phase")
    before_reason = (find((mv.get("status") or {}).get("conditions"), "Ready") or {}).get("reason")
    written = _write_status(ctx, mv, status)
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    if written and before != status["phase"]:
        type_ = "Warning" if status["phase"] == "Failed" else "Normal"
        ctx.event(
            mv, type_, ready["reason"], f"phase {before or 'none'} -> {status['phase']}: {ready['message']}"
        )
    elif written and ready["reason"] in conversion.POD_CREATION_REASONS and ready["reason"] != before_reason:
        # Still Converting, but stuck: a refused pod is worth a Warning of its own (once per refusal).
        ctx.event(mv, "Warning", ready["reason"], ready["message"])
    return status


_events_forbidden_said = False


def _job_events(ctx: Context, job: dict[str, Any]) -> list[dict[str, Any]]:
    """The Job's Events; none (said once in the log) when RBAC does not let the operator list them."""
    global _events_forbidden_said
    meta = job["metadata"]
    try:
        return ctx.kube.list_events(meta["namespace"], "Job", meta["name"], meta.get("uid"))
    except KubeError as exc:
        if exc.status != 403:
            raise
        if not _events_forbidden_said:
            _events_forbidden_said = True
            log.warning(
                "cannot list Events (%s): a conversion Job whose pods are refused will show as Converting "
                "without the reason; grant the operator `list` on events",
                exc,
            )
        return []


def _job_finished(job: dict[str, Any]) -> bool:
    return any(
        c.get("type") in ("Complete", "Failed", "SuccessCriteriaMet") and c.get("status") == "True"
        for c in job.get("status", {}).get("conditions", []) or []
    )


def traffic_holders(kube: Kube, mv: dict[str, Any]) -> list[str]:
    """Names of the InferenceModels whose spec.traffic still lists this version."""
    spec = mv.get("spec", {})
    models = kube.list(API_VERSION, "InferenceModel", mv["metadata"]["namespace"])
    return [
        m["metadata"]["name"]
        for m in models
        if m["metadata"]["name"] == spec.get("model")
        and not m["metadata"].get("deletionTimestamp")
        and any(t.get("version") == spec.get("version") for t in m.get("spec", {}).get("traffic", []))
    ]


def mark_in_use(ctx: Context, mv: dict[str, Any], holders: list[str]) -> None:
    """The condition that explains why a deleted version is still there."""
    generation = mv["metadata"].get("generation")
    version = mv.get("spec", {}).get("version")
    message = (
        f"InferenceModel {', '.join(holders)} still lists version {version!r} in spec.traffic; "
        "remove it there to finish the deletion"
    )
    old = mv.get("status") or {}
    in_use = condition("InUse", True, "TrafficStillRouted", message, generation)
    others = [c for c in old.get("conditions", []) if c.get("type") != "InUse"]
    kept = [c for c in old.get("conditions", []) if c.get("type") == "InUse"]
    if _write_status(ctx, mv, {**old, "conditions": others + merge_conditions(kept, [in_use], ctx.clock())}):
        ctx.event(mv, "Warning", "TrafficStillRouted", message)


# --- InferenceModel --------------------------------------------------------------------------------------


def reconcile_model(ctx: Context, im: dict[str, Any]) -> dict[str, Any]:
    """Reconcile the model's versions, apply its serving objects, write its status; returns the status."""
    meta = im["metadata"]
    namespace, name, generation = meta["namespace"], meta["name"], meta.get("generation")
    try:
        model: InferenceModel = validate_inference_model(im)
    except InvalidResource as exc:
        status = invalid_spec_status(
            generation=generation, message=str(exc), old_status=im.get("status"), now=ctx.clock()
        )
        _write_status(ctx, im, status)
        raise
    accelerator = model.spec.hardware.accelerator
    old_rollout = None
    if model.spec.rollout is not None:
        # The rollout timer may have moved a step since this body was read: serve what status says now.
        latest = ctx.kube.get(API_VERSION, "InferenceModel", namespace, name)
        if latest is not None:
            im["status"] = latest.get("status") or {}
        old_rollout = (im.get("status") or {}).get("rollout")
    traffic_spec = _effective_spec(model.spec, old_rollout)
    mvs = _model_versions(ctx, namespace, name)
    duplicates = duplicate_versions(mvs)
    for mv in mvs:
        reconcile_version(ctx, mv, accelerator, duplicates.get(mv["metadata"]["name"]))
    views = version_views(mvs, name)
    planned = plan_traffic(traffic_spec, views, ctx.settings)
    draft = draft_artifact(model.spec, views, ctx.settings)
    plan = serving_plan(im, model.spec, planned, ctx.settings, draft)
    live = {(obj["kind"], obj["metadata"]["name"]): _apply_if_changed(ctx, obj) for obj in plan.apply}
    for ref in plan.remove:
        # Read first: deleting what is not there is still a write, and an idle reconcile makes none.
        if ctx.kube.get(ref.api_version, ref.kind, ref.namespace, ref.name) is None:
            continue
        if ctx.kube.delete(ref.api_version, ref.kind, ref.namespace, ref.name):
            ctx.event(
                im, "Normal", "Deleted", f"deleted {ref.kind} {ref.name}: replicas.min/max no longer need it"
            )
    deploy = live.get(("Deployment", names.serving_name(name)))
    status = model_status(
        generation=generation,
        planned=planned,
        deploy=deploy,
        endpoint=endpoint(im, ctx.settings),
        old_status=im.get("status"),
        now=ctx.clock(),
        rollout=old_rollout if rollout.is_current(model.spec, old_rollout) else None,
    )
    if old_rollout is not None:  # kept while spec.rollout is set; dropped (and forgotten) without it
        status["rollout"] = old_rollout
    before = (im.get("status") or {}).get("traffic")
    if _write_status(ctx, im, status) and before != status["traffic"]:
        requested = "rollout" if traffic_spec is not model.spec else "requested"
        message = f"serving traffic {status['traffic'] or 'none'} ({requested}: {_split(traffic_spec)})"
        ctx.event(im, "Normal", "TrafficUpdated", message)
    return status


def _model_versions(ctx: Context, namespace: str, model: str) -> list[dict[str, Any]]:
    """The model's ModelVersions, read fresh. Their names come from the operator's watch when it has
    one (a few GETs, however many versions the namespace holds), else from a list of the namespace."""
    known = ctx.version_names(namespace, model) if ctx.version_names is not None else None
    if known is None:
        found = ctx.kube.list(API_VERSION, "ModelVersion", namespace)
    else:
        found = [ctx.kube.get(API_VERSION, "ModelVersion", namespace, mv) for mv in sorted(known)]
    return [mv for mv in found if mv is not None and mv.get("spec", {}).get("model") == model]


def _apply_if_changed(ctx: Context, obj: dict[str, Any]) -> dict[str, Any]:
    """The live object after making it hold `obj`: applied only when something differs (missing, edited
    by someone, or our desired state moved), so a reconcile that finds nothing to change writes nothing.
    The watch's view of the object, when it matches, spares even the read."""
    obj = with_digest(obj)
    meta = obj["metadata"]
    seen = ctx.watched(obj["kind"], meta["namespace"], meta["name"]) if ctx.watched is not None else None
    if seen is not None and matches(seen, obj):
        return seen
    live = ctx.kube.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
    if live is not None and matches(live, obj):
        return live
    if live is not None:
        ctx.logger.debug("%s %s differs from what it should be; applying", obj["kind"], meta["name"])
    return ctx.kube.apply(obj)


def _split(spec: InferenceModelSpec) -> str:
    return ",".join(f"{t.version}={t.weight}" for t in spec.traffic)


def _effective_spec(spec: InferenceModelSpec, rollout_state: dict[str, Any] | None) -> InferenceModelSpec:
    """spec, with the rollout's split in place of spec.traffic while a rollout of this spec holds one."""
    traffic = rollout.effective_traffic(spec, rollout_state)
    if traffic is None:
        return spec
    return spec.model_copy(update={"traffic": [TrafficEntry.model_validate(t) for t in traffic]})


# --- rollouts --------------------------------------------------------------------------------------------


def rollout_pending(spec: dict[str, Any], status: dict[str, Any] | None) -> bool:
    """Whether an InferenceModel has a rollout to start or step (the rollout timer's filter)."""
    if not spec.get("rollout"):
        return False
    try:
        parsed = InferenceModelSpec.model_validate(spec)
    except ValueError:
        return False  # the model's reconcile reports the invalid spec
    return rollout.stage(parsed, (status or {}).get("rollout"), dt.datetime.now(dt.UTC)) != "finished"


def step_rollout(ctx: Context, im: dict[str, Any]) -> rollout.Decision | None:
    """Start, judge or advance the model's rollout; apply the resulting traffic. Safe to run twice:
    the step is read fresh from status and written back only if status is still what it was read as."""
    meta = im["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    latest = ctx.kube.get(API_VERSION, "InferenceModel", namespace, name)
    if latest is None or latest["metadata"].get("deletionTimestamp"):
        return None
    model = validate_inference_model(latest)
    if model.spec.rollout is None:
        return None
    state = (latest.get("status") or {}).get("rollout")
    now_text = ctx.clock()
    now = dt.datetime.fromisoformat(now_text)
    stage = rollout.stage(model.spec, state, now)
    if stage in ("wait", "finished"):
        return rollout.decide(model.spec, state, now, None)
    observed = _observe(ctx, namespace, name, state if stage == "judge" else None, now_text)
    decision = rollout.decide(model.spec, state, now, observed)
    if decision.state is None or decision.state == state:
        return decision
    status = {**(latest.get("status") or {}), "rollout": decision.state}
    try:
        ctx.kube.patch_status(
            API_VERSION,
            "InferenceModel",
            namespace,
            name,
            {"rollout": decision.state},
            resource_version=latest["metadata"].get("resourceVersion"),
        )
    except KubeError as exc:
        if exc.status == 404:
            return None
        raise  # 409: another writer moved first; the next tick reads its result
    latest["status"] = status
    repeated_pause = decision.action == "pause" and (state or {}).get("phase") == "Paused"
    if decision.event is not None and not repeated_pause:  # one RolloutPaused per pause, not per tick
        ctx.event(latest, *decision.event)
    if decision.traffic != (state or {}).get("traffic"):
        reconcile_model(ctx, latest)
    return decision


def _observe(
    ctx: Context, namespace: str, name: str, state: dict[str, Any] | None, now: str
) -> rollout.Observed:
    scrape = ctx.scrape or MetricsSource(
        ctx.kube, ctx.settings.dataplane_port, ctx.settings.rollout_scrape_timeout_seconds
    )
    try:
        current = scrape(namespace, name)
    except ScrapeError as exc:
        return rollout.Observed(error=str(exc))
    previous = sample_from_status((state or {}).get("sample"))
    return rollout.Observed(sample=sample_to_status(current, now), windows=windows(previous, current))


def reconcile_model_of_version(ctx: Context, mv: dict[str, Any]) -> None:
    """After a version or its Job changed: reconcile its model, or the version alone if it has none."""
    namespace = mv["metadata"]["namespace"]
    model_name = mv.get("spec", {}).get("model")
    im = ctx.kube.get(API_VERSION, "InferenceModel", namespace, model_name) if model_name else None
    if im is not None and not im["metadata"].get("deletionTimestamp"):
        reconcile_model(ctx, im)
        return
    reconcile_version(ctx, mv, None)
