"""The chart grants each component exactly what its code asks the API server for: every request it
makes is allowed, and every grant is something it asks for (nothing left over after a code change)."""

from __future__ import annotations

from typing import Any

import pytest
from modelfleet.controlplane.cluster import Cluster

from .code_requests import Need, control_plane_needs, kopf_needs, operator_needs, preflight_needs
from .helm import by_kind, render
from .rbac import Authorizer, Request, service_account

OPERATOR = service_account("modelfleet-system", "mf-modelfleet-operator")
CONTROL_PLANE = service_account("modelfleet-system", "mf-modelfleet-controlplane")
PEERING = "modelfleet-system-mf-modelfleet"
GRANT = (
    "the code makes these requests: grant them in charts/modelfleet/templates/*/rbac.yaml (a comment says "
    "why) and add them to tests/charts/rbac_expectations.py"
)
UNUSED = "nothing calls these any more: drop them from the rbac.yaml and from rbac_expectations.py"


def grants(role: dict[str, Any]) -> set[tuple[str, str]]:
    """(verb, resource as kubectl writes it) of every rule of a role."""
    return {
        (
            verb,
            f"{resource.split('/')[0]}.{group}{resource[len(resource.split('/')[0]) :]}"
            if group
            else resource,
        )
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def refused(chart: Authorizer, user: str, needs: list[Need]) -> list[str]:
    return sorted(
        {Request(user, *need).describe() for need in needs if not chart.allows(Request(user, *need))}
    )


@pytest.fixture(scope="module")
def default_chart() -> list[dict[str, Any]]:
    return render(namespace="modelfleet-system", release="mf")


@pytest.fixture(scope="module")
def operator_calls() -> list[Need]:
    return operator_needs()


SERVED = {"all namespaces": None, "listed namespaces": "team-a"}


@pytest.fixture(scope="module")
def charts(default_chart) -> dict[str | None, list[dict[str, Any]]]:
    """Served namespace (None: all) -> the rendered chart."""
    return {None: default_chart, "team-a": render({"operator": {"watchNamespaces": ["team-a"]}})}


def all_operator_needs(operator_calls: list[Need], served: str | None) -> list[Need]:
    return operator_calls + kopf_needs(served, PEERING) + preflight_needs(served, PEERING)


@pytest.mark.parametrize("served", SERVED.values(), ids=SERVED.keys())
def test_operator_is_allowed_every_request_it_makes(charts, operator_calls, served) -> None:
    chart = Authorizer(charts[served])
    assert refused(chart, OPERATOR, all_operator_needs(operator_calls, served)) == [], GRANT


@pytest.mark.parametrize("served", SERVED.values(), ids=SERVED.keys())
def test_operator_is_granted_nothing_it_does_not_use(charts, operator_calls, served) -> None:
    roles = [
        role
        for role in [
            *by_kind(charts[served], "ClusterRole").values(),
            *by_kind(charts[served], "Role").values(),
        ]
        if role["metadata"]["name"].endswith("-operator")
    ]
    assert len(roles) == (1 if served is None else 2)
    used = {(verb, resource) for verb, resource, _, _ in all_operator_needs(operator_calls, served)}
    assert set().union(*(grants(role) for role in roles)) - used == set(), UNUSED
    # The scenario reaches the rarer calls too (else the check above would prove little).
    assert {
        ("delete", "horizontalpodautoscalers.autoscaling"),
        ("list", "pods"),
        ("list", "events"),
        ("update", "modelversions.modelfleet.dev/finalizers"),
        ("patch", "inferencemodels.modelfleet.dev/status"),
        ("get", "modelversions.modelfleet.dev"),
    } <= used


def test_control_plane_is_allowed_exactly_what_it_uses(default_chart) -> None:
    needs, called = control_plane_needs()
    interface = {
        name for name, value in vars(Cluster).items() if callable(value) and not name.startswith("_")
    }
    assert interface - {"describe"} == called, "a Cluster method is not exercised in code_requests.py"
    assert refused(Authorizer(default_chart), CONTROL_PLANE, needs) == [], GRANT
    role = by_kind(default_chart, "ClusterRole")["modelfleet-system-mf-modelfleet-controlplane"]
    assert grants(role) - {(verb, resource) for verb, resource, _, _ in needs} == set(), UNUSED
    # Its Secret is the one it names: the grant is no wider than the code's one name.
    secrets = {name for verb, resource, _, name in needs if resource == "secrets"}
    assert secrets == {"modelfleet-api-keys"}
