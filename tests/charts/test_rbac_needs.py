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


def test_operator_is_allowed_every_request_it_makes(default_chart, operator_calls) -> None:
    needs = operator_calls + kopf_needs(None, PEERING) + preflight_needs(None, PEERING)
    assert refused(Authorizer(default_chart), OPERATOR, needs) == []


def test_operator_serving_listed_namespaces_is_allowed_every_request(operator_calls) -> None:
    chart = Authorizer(render({"operator": {"watchNamespaces": ["team-a"]}}))
    needs = operator_calls + kopf_needs("team-a", PEERING) + preflight_needs("team-a", PEERING)
    assert refused(chart, OPERATOR, needs) == []


def test_operator_is_granted_nothing_it_does_not_use(default_chart, operator_calls) -> None:
    role = by_kind(default_chart, "ClusterRole")["modelfleet-system-mf-modelfleet-operator"]
    needs = operator_calls + kopf_needs(None, PEERING) + preflight_needs(None, PEERING)
    used = {(verb, resource) for verb, resource, _, _ in needs}
    assert grants(role) - used == set()
    # The scenario reaches the rarer calls too (else the check above would prove little).
    assert {
        ("delete", "horizontalpodautoscalers.autoscaling"),
        ("list", "pods"),
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
    assert refused(Authorizer(default_chart), CONTROL_PLANE, needs) == []
    role = by_kind(default_chart, "ClusterRole")["modelfleet-system-mf-modelfleet-controlplane"]
    assert grants(role) - {(verb, resource) for verb, resource, _, _ in needs} == set()
    # Its Secret is the one it names: the grant is no wider than the code's one name.
    secrets = {name for verb, resource, _, name in needs if resource == "secrets"}
    assert secrets == {"modelfleet-api-keys"}
