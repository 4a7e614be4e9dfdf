"""Pre-flight of kopf peering: never wait for a peering object in silence.

Run with a peering name (the default; `--standalone` is the exception), kopf makes peering mandatory.
Without the peering CRD it pauses every watch stream; without the peering object it pauses until the
object's first watch event, which never comes. Either way it logs nothing above DEBUG and reconciles
nothing. So at start-up the operator looks for the CRD and the object itself, logs a WARNING naming what
is missing and the two ways out, and its `/healthz` (kopf's liveness endpoint) says the same until the
object is there. The answer stays 200: kopf resumes by itself once the object appears, and a restart
would not create it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import kopf
from modelfleet.operator.kube import Kube, KubeError

log = logging.getLogger(__name__)
# kopf accepts its peering kinds under either group; the chart's crds/kopf-peering.yaml has kopf.dev.
GROUPS = ("kopf.dev/v1", "zalando.org/v1")
GLOB = set("*?[")
PROBE_SECONDS = 2.0  # the chart's liveness probe gives up after 5


@dataclass(frozen=True)
class PeeringObject:
    """One peering object kopf waits for: cluster-wide, or one per served namespace."""

    name: str
    namespace: str | None = None

    @property
    def kind(self) -> str:
        return "KopfPeering" if self.namespace else "ClusterKopfPeering"

    @property
    def plural(self) -> str:
        return self.kind.lower() + "s"

    def __str__(self) -> str:
        where = f"{self.namespace}/{self.name}" if self.namespace else self.name
        return f"{self.kind} {where}"

    def path(self, group_version: str) -> str:
        scope = f"namespaces/{self.namespace}/" if self.namespace else ""
        return f"/apis/{group_version}/{scope}{self.plural}/{self.name}"


def peering_objects(name: str, namespaces: list[str], clusterwide: bool) -> list[PeeringObject]:
    """The objects kopf needs: a ClusterKopfPeering when serving every namespace, else a KopfPeering in
    each served namespace (namespace patterns cannot be named in advance and are left out)."""
    if clusterwide:
        return [PeeringObject(name)]
    return [PeeringObject(name, ns) for ns in namespaces if not GLOB & set(ns)]


def ways_out(missing: PeeringObject) -> str:
    return (
        "Either install the chart's crds/kopf-peering.yaml and create the peering object "
        f"(apiVersion kopf.dev/v1, kind {missing.kind}, name {missing.name}"
        + (f", namespace {missing.namespace}" if missing.namespace else "")
        + "; the chart's templates/operator/peering.yaml creates it under the name it passes in "
        "MODELFLEET_OPERATOR_PEERING), or run `modelfleet operator --standalone` (one replica only)."
    )


def check_peering(kube: Kube, objects: list[PeeringObject]) -> list[str]:
    """One line per peering object kopf would wait for in vain (empty: all there). Never raises: an API
    failure is reported as a line too."""
    problems = []
    served: dict[str, set[str]] = {}
    for obj in objects:
        try:
            groups = [g for g in GROUPS if obj.plural in _served(kube, g, served)]
            if not groups:
                crds = " nor ".join(f"{obj.plural}.{g.split('/')[0]}" for g in GROUPS)
                problems.append(
                    f"kopf peering: the {obj.kind} CRD is not installed (neither {crds}), so kopf pauses and "
                    f"nothing is reconciled; it waits for {obj}. {ways_out(obj)}"
                )
            elif all(kube.get_path(obj.path(g)) is None for g in groups):
                problems.append(
                    f"kopf peering: {obj} does not exist, so kopf pauses and nothing is reconciled until it "
                    f"does. {ways_out(obj)}"
                )
        except KubeError as exc:
            problems.append(f"kopf peering: cannot read {obj} ({exc}); kopf may be paused waiting for it")
    return problems


def _served(kube: Kube, group_version: str, cache: dict[str, set[str]]) -> set[str]:
    """The resource plurals an API group version serves (discovery; any authenticated user may read it)."""
    if group_version not in cache:
        found = kube.get_path(f"/apis/{group_version}") or {}
        cache[group_version] = {r.get("name", "") for r in found.get("resources", [])}
    return cache[group_version]


class PeeringCheck:
    """The last word on peering, kept for the liveness probe; logs each change of it."""

    def __init__(self, kube: Kube, objects: list[PeeringObject]) -> None:
        self.kube, self.objects = kube, objects
        self.problems: list[str] | None = None

    def run(self) -> list[str]:
        problems = check_peering(self.kube, self.objects)
        if problems != self.problems:
            for line in problems:
                log.warning(line)
            if not problems and self.objects:
                found = ", ".join(str(o) for o in self.objects)
                log.info("kopf peering: %s found; replicas take turns through it", found)
        self.problems = problems
        return problems

    def report(self) -> str:
        """For /healthz: re-checked while something is missing (kopf caches probes for 10 s), never after."""
        if self.problems:
            self.run()
        return self.last_report()

    def last_report(self) -> str:
        if self.problems is None:
            return "not checked yet"
        return "; ".join(self.problems) if self.problems else "ok: " + ", ".join(str(o) for o in self.objects)


# --- kopf registrations (imported by `modelfleet operator`, after handlers.py, whose start-up handler
# loads the kube config and creates memo.ctx) -------------------------------------------------------------


@kopf.on.startup()
def peering_preflight(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    if settings.peering.standalone or not settings.peering.mandatory:
        memo.peering_check = None
        return
    ctx = getattr(memo, "ctx", None)
    objects = peering_objects(
        settings.peering.name, list(getattr(memo, "namespaces", None) or []), settings.peering.clusterwide
    )
    memo.peering_check = PeeringCheck(ctx.kube if ctx is not None else Kube(), objects)
    memo.peering_check.run()


@kopf.on.probe(id="peering")
async def peering_probe(memo: Any, **_: Any) -> str:
    check = getattr(memo, "peering_check", None)
    if check is None:
        return "standalone"
    # A slow API server must not make the liveness probe time out (and the pod restart): answer with
    # what is known and let the re-check finish in the background.
    try:
        return await asyncio.wait_for(asyncio.to_thread(check.report), timeout=PROBE_SECONDS)
    except TimeoutError:
        return check.last_report()
