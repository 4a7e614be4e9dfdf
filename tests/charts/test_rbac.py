"""The chart's RBAC as the API server decides it: the evaluator itself, then the shared table of what each
service account may and may not do, over what the real helm renders."""

from __future__ import annotations

from typing import Any

import pytest

from .helm import by_kind, render
from .rbac import Authorizer, Request, can_i, service_account
from .rbac_expectations import expectations

RELEASE_NS, RELEASE = "modelfleet-system", "mf"
OPERATOR = service_account(RELEASE_NS, "mf-modelfleet-operator")
CONTROL_PLANE = service_account(RELEASE_NS, "mf-modelfleet-controlplane")
PEERING = "modelfleet-system-mf-modelfleet"
SA = service_account("apps", "robot")


def _role(kind: str, name: str, rules: list[dict[str, Any]], namespace: str | None = None) -> dict[str, Any]:
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": kind, "metadata": meta, "rules": rules}


def _binding(
    kind: str, role_kind: str, role: str, namespace: str | None = None, subject: dict[str, str] | None = None
) -> dict[str, Any]:
    meta = {"name": f"{role}-binding", **({"namespace": namespace} if namespace else {})}
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": kind,
        "metadata": meta,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": role},
        "subjects": [subject or {"kind": "ServiceAccount", "name": "robot", "namespace": "apps"}],
    }


def _rule(groups: list[str], resources: list[str], verbs: list[str], names: list[str] | None = None) -> dict:
    rule = {"apiGroups": groups, "resources": resources, "verbs": verbs}
    return {**rule, "resourceNames": names} if names else rule


# --- the evaluator ---------------------------------------------------------------------------------------


def test_cluster_role_binding_grants_everywhere_role_binding_only_in_its_namespace() -> None:
    objects = [
        _role("ClusterRole", "read-pods", [_rule([""], ["pods"], ["get"])]),
        _binding("ClusterRoleBinding", "ClusterRole", "read-pods"),
        _role("ClusterRole", "edit-jobs", [_rule(["batch"], ["jobs"], ["create"])]),
        _binding("RoleBinding", "ClusterRole", "edit-jobs", namespace="team-a"),
        _role("Role", "cms", [_rule([""], ["configmaps"], ["list"])], namespace="team-b"),
        _binding("RoleBinding", "Role", "cms", namespace="team-b"),
    ]
    assert can_i(objects, SA, "get", "pods") and can_i(objects, SA, "get", "pods", "team-z")
    assert can_i(objects, SA, "create", "jobs.batch", "team-a")
    assert not can_i(objects, SA, "create", "jobs.batch", "team-b")
    assert not can_i(objects, SA, "create", "jobs.batch")  # all namespaces: a RoleBinding is not enough
    assert can_i(objects, SA, "list", "configmaps", "team-b")
    assert not can_i(objects, SA, "list", "configmaps", "team-a")
    assert not can_i(objects, SA, "delete", "pods", "team-a")  # verb
    assert not can_i(objects, SA, "create", "jobs", "team-a")  # the core group is not batch
    assert not can_i(objects, service_account("apps", "other"), "get", "pods")  # another subject


def test_resource_names_subresources_and_wildcards() -> None:
    objects = [
        _role(
            "ClusterRole",
            "mixed",
            [
                _rule([""], ["secrets"], ["get", "create"], names=["mine"]),
                _rule([""], ["pods/log"], ["get"]),
                _rule(["apps"], ["*/status"], ["patch"]),
                _rule(["*"], ["widgets"], ["*"]),
            ],
        ),
        _binding("ClusterRoleBinding", "ClusterRole", "mixed"),
    ]
    assert can_i(objects, SA, "get", "secrets", "ns", name="mine")
    assert can_i(objects, SA, "create", "secrets", "ns", name="mine")
    assert not can_i(objects, SA, "get", "secrets", "ns")  # no name: a list-like request
    assert not can_i(objects, SA, "create", "secrets", "ns")  # a plain POST carries no name
    assert not can_i(objects, SA, "get", "secrets", "ns", name="theirs")
    assert can_i(objects, SA, "get", "pods/log", "ns") and not can_i(objects, SA, "get", "pods", "ns")
    assert can_i(objects, SA, "patch", "deployments.apps/status", "ns")
    assert not can_i(objects, SA, "patch", "deployments.apps", "ns")  # */status is not the object itself
    assert can_i(objects, SA, "delete", "widgets.example.com", "ns")
    assert not can_i(objects, SA, "get", "widgets.example.com/scale", "ns")  # a subresource is named


def test_group_subjects_and_missing_roles() -> None:
    group = {"kind": "Group", "name": "system:serviceaccounts:apps", "apiGroup": "rbac.authorization.k8s.io"}
    objects = [
        _role("ClusterRole", "view", [_rule([""], ["services"], ["get"])]),
        _binding("ClusterRoleBinding", "ClusterRole", "view", subject=group),
        _binding("ClusterRoleBinding", "ClusterRole", "not-there"),
    ]
    assert can_i(objects, SA, "get", "services")
    assert not can_i(objects, service_account("other", "robot"), "get", "services")
    assert not can_i(objects, SA, "get", "anything")


@pytest.mark.parametrize(
    "bad, message",
    [
        ({**_role("ClusterRole", "agg", []), "aggregationRule": {"clusterRoleSelectors": []}}, "aggregated"),
        ({**_role("Role", "r", [], "ns"), "apiVersion": "rbac.authorization.k8s.io/v1beta1"}, "apiVersion"),
        (_binding("ClusterRoleBinding", "Role", "r"), "refers to a Role"),
        (_binding("ClusterRoleBinding", "ClusterRole", "r", subject={"kind": "Robot", "name": "x"}), "Robot"),
    ],
)
def test_evaluator_refuses_what_it_does_not_model(bad: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Authorizer([bad]).allows(Request(SA, "get", "pods"))


# --- the chart -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chart() -> Authorizer:
    return Authorizer(render(namespace=RELEASE_NS, release=RELEASE))


def test_default_install_grants_exactly_the_table(chart: Authorizer) -> None:
    table = expectations(OPERATOR, CONTROL_PLANE, PEERING, tenant="team-a")
    wrong = [
        f"{'may' if allowed else 'may not'}: {request.describe()}"
        for request, allowed in table
        if chart.allows(request) != allowed
    ]
    assert wrong == []
    assert len(table) > 100  # both components, both directions


def test_peering_object_is_the_one_the_operator_may_patch() -> None:
    docs = render(namespace=RELEASE_NS, release=RELEASE)
    assert list(by_kind(docs, "ClusterKopfPeering")) == [PEERING]


def test_served_namespaces_bound_the_operator() -> None:
    chart = Authorizer(render({"operator": {"watchNamespaces": ["team-a", "team-b"]}}))
    for namespace in ("team-a", "team-b"):
        for verb, resource in [
            ("patch", "inferencemodels.modelfleet.dev"),
            ("create", "jobs.batch"),
            ("watch", "services"),
            ("list", "kopfpeerings.kopf.dev"),
        ]:
            assert chart.allows(Request(OPERATOR, verb, resource, namespace)), (verb, resource, namespace)
        assert chart.allows(Request(OPERATOR, "patch", "kopfpeerings.kopf.dev", namespace, PEERING))
        assert not chart.allows(Request(OPERATOR, "patch", "kopfpeerings.kopf.dev", namespace, "other"))
    for namespace in ("team-c", None):
        assert not chart.allows(Request(OPERATOR, "list", "inferencemodels.modelfleet.dev", namespace))
        assert not chart.allows(Request(OPERATOR, "create", "jobs.batch", namespace))
    assert chart.allows(Request(OPERATOR, "watch", "namespaces"))  # kopf learns which served ones exist
    assert not chart.allows(Request(OPERATOR, "list", "clusterkopfpeerings.kopf.dev"))
    assert chart.allows(Request(OPERATOR, "watch", "customresourcedefinitions.apiextensions.k8s.io"))


def test_without_control_plane_its_account_may_do_nothing() -> None:
    chart = Authorizer(render({"controlPlane": {"enabled": False}}))
    assert not chart.allows(Request(CONTROL_PLANE, "create", "namespaces"))
    assert not chart.allows(Request(CONTROL_PLANE, "get", "secrets", "team-a", "modelfleet-api-keys"))
    assert chart.allows(Request(OPERATOR, "create", "jobs.batch", "team-a"))
