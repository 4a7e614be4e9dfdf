"""Kubernetes RBAC, decided over rendered chart objects the way the API server's RBAC authorizer does.

Only the chart's own Roles, ClusterRoles and their bindings count (the cluster's default roles grant a
service account nothing on resources). A ClusterRoleBinding grants its ClusterRole everywhere; a
RoleBinding grants its Role or ClusterRole only in the binding's namespace. A rule matches a request
when its verbs, apiGroups, resources (`*`, `res/sub`, `*/sub`) and resourceNames all match; a rule with
resourceNames never matches a request without a name (a plain create, a list).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

RBAC_API = "rbac.authorization.k8s.io/v1"
SA_PREFIX = "system:serviceaccount:"


@dataclass(frozen=True)
class Request:
    """One resource request as the authorizer sees it. `resource` is written as kubectl takes it:
    `plural[.group][/subresource]` (`deployments.apps`, `pods/log`, `inferencemodels.modelfleet.dev`).
    `namespace` None: a cluster-scoped object, or every namespace at once (`--all-namespaces`)."""

    user: str
    verb: str
    resource: str
    namespace: str | None = None
    name: str | None = None

    @property
    def group(self) -> str:
        plural = self.resource.split("/", 1)[0]
        return plural.split(".", 1)[1] if "." in plural else ""

    @property
    def plural(self) -> str:
        return self.resource.split("/", 1)[0].split(".", 1)[0]

    @property
    def subresource(self) -> str:
        return self.resource.split("/", 1)[1] if "/" in self.resource else ""

    def describe(self) -> str:
        where = f"-n {self.namespace}" if self.namespace else "cluster-wide"
        target = f"{self.resource} {self.name}" if self.name else self.resource
        return f"{self.user} {self.verb} {target} {where}"


def service_account(namespace: str, name: str) -> str:
    return f"{SA_PREFIX}{namespace}:{name}"


def groups(user: str) -> set[str]:
    """The groups the API server puts a service account in."""
    if not user.startswith(SA_PREFIX):
        return {"system:authenticated"}
    namespace = user[len(SA_PREFIX) :].split(":", 1)[0]
    return {"system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"}


def _subject_matches(subject: dict[str, Any], user: str) -> bool:
    kind = subject.get("kind")
    if kind == "ServiceAccount":
        return user == service_account(subject.get("namespace", ""), subject["name"])
    if kind == "User":
        return user == subject["name"]
    if kind == "Group":
        return subject["name"] in groups(user)
    raise ValueError(f"binding subject of unknown kind {kind!r}: {subject}")


def _rule_allows(rule: dict[str, Any], request: Request) -> bool:
    if "nonResourceURLs" in rule:
        return False  # only resource requests are asked here
    combined = f"{request.plural}/{request.subresource}" if request.subresource else request.plural
    resources = rule.get("resources", [])
    resource_ok = "*" in resources or combined in resources
    if request.subresource and f"*/{request.subresource}" in resources:
        resource_ok = True
    names = rule.get("resourceNames") or []
    return (
        ("*" in rule.get("verbs", []) or request.verb in rule.get("verbs", []))
        and ("*" in rule.get("apiGroups", []) or request.group in rule.get("apiGroups", []))
        and resource_ok
        and (not names or request.name in names)
    )


class Authorizer:
    """The RBAC objects among `objects` (other kinds are ignored), ready to answer requests."""

    def __init__(self, objects: Iterable[dict[str, Any]]) -> None:
        self.cluster_roles: dict[str, dict[str, Any]] = {}
        self.roles: dict[tuple[str, str], dict[str, Any]] = {}
        self.bindings: list[dict[str, Any]] = []
        for obj in objects:
            kind = obj.get("kind")
            if kind not in ("ClusterRole", "Role", "ClusterRoleBinding", "RoleBinding"):
                continue
            if obj.get("apiVersion") != RBAC_API:
                raise ValueError(f"{kind} {obj['metadata']['name']}: apiVersion must be {RBAC_API}")
            meta = obj["metadata"]
            if kind == "ClusterRole":
                if obj.get("aggregationRule"):
                    raise ValueError(f"ClusterRole {meta['name']}: aggregated roles are not evaluated")
                self.cluster_roles[meta["name"]] = obj
            elif kind == "Role":
                self.roles[(meta["namespace"], meta["name"])] = obj
            else:
                self.bindings.append(obj)

    def _rules(self, binding: dict[str, Any]) -> list[dict[str, Any]]:
        ref, meta = binding["roleRef"], binding["metadata"]
        if ref["kind"] == "ClusterRole":
            role = self.cluster_roles.get(ref["name"])
        elif ref["kind"] == "Role" and binding["kind"] == "RoleBinding":
            role = self.roles.get((meta["namespace"], ref["name"]))
        else:
            raise ValueError(f"{binding['kind']} {meta['name']} refers to a {ref['kind']}")
        # A binding to a missing role grants nothing, as on a real cluster.
        return (role or {}).get("rules") or []

    def allows(self, request: Request) -> bool:
        for binding in self.bindings:
            if binding["kind"] == "RoleBinding" and binding["metadata"]["namespace"] != request.namespace:
                continue
            if not any(_subject_matches(s, request.user) for s in binding.get("subjects") or []):
                continue
            if any(_rule_allows(rule, request) for rule in self._rules(binding)):
                return True
        return False


def can_i(
    objects: Iterable[dict[str, Any]],
    user: str,
    verb: str,
    resource: str,
    namespace: str | None = None,
    name: str | None = None,
) -> bool:
    """Whether `user` (e.g. system:serviceaccount:NS:NAME) may `verb` `resource`, as `kubectl auth can-i`
    answers it against a cluster holding only these RBAC objects."""
    return Authorizer(objects).allows(Request(user, verb, resource, namespace, name))
