"""What the chart's service accounts may and may not do, as one table: tests/charts/test_rbac.py asks
the offline evaluator (rbac.py) over `helm template`, tests/e2e/test_chart.py asks a real API server.

For a default install (the operator serves all namespaces, the control plane is on). Rows are
(verb, resource, where[, name]): resource as kubectl takes it (`plural[.group][/subresource]`), where is
ALL (cluster-scoped, or every namespace at once) or TENANT (one namespace a tenant's models run in).
"""

from __future__ import annotations

from modelfleet.controlplane.resources import KEYS_SECRET, QUOTA_NAME

from .rbac import Request

ALL, TENANT = "all", "tenant"
PEERING = "<peering>"  # the release's own kopf peering object, filled in per release
IM, MV = "inferencemodels.modelfleet.dev", "modelversions.modelfleet.dev"

Row = tuple[str, ...]  # (verb, resource, where) or (verb, resource, where, name)


def _each(verbs: str, resources: str, where: str, name: str | None = None) -> list[Row]:
    return [(verb, resource, where, name) for resource in resources.split() for verb in verbs.split()]


OPERATOR_MAY: list[Row] = [
    *_each("list watch", "customresourcedefinitions.apiextensions.k8s.io", ALL),
    *_each("list watch", "clusterkopfpeerings.kopf.dev", ALL),
    *_each("get patch", "clusterkopfpeerings.kopf.dev", ALL, PEERING),
    *_each("list watch", f"{IM} {MV}", ALL),
    *_each("get patch", f"{IM} {MV}", TENANT),
    *_each("patch", f"{IM}/status {MV}/status", TENANT),
    *_each("update", f"{IM}/finalizers {MV}/finalizers", TENANT),
    *_each("list watch create patch", "jobs.batch", TENANT),
    ("list", "pods", TENANT),
    *_each("get list watch create patch", "configmaps services", TENANT),
    *_each("get list watch create patch", "deployments.apps", TENANT),
    *_each("get create patch delete", "horizontalpodautoscalers.autoscaling", TENANT),
    *_each("get create patch", "poddisruptionbudgets.policy", TENANT),
    *_each("list create", "events", TENANT),
]
OPERATOR_MAY_NOT: list[Row] = [
    *_each("get list watch", "secrets", ALL),
    *_each("get list", "secrets", TENANT),
    ("get", "secrets", TENANT, KEYS_SECRET),
    # Serving every namespace, kopf never lists namespaces; nobody of ours deletes one.
    *_each("list delete", "namespaces", ALL),
    ("patch", "clusterkopfpeerings.kopf.dev", ALL),
    ("patch", "clusterkopfpeerings.kopf.dev", ALL, "someone-elses-peering"),
    ("delete", "clusterkopfpeerings.kopf.dev", ALL, PEERING),
    ("get", "clusterkopfpeerings.kopf.dev", ALL, "someone-elses-peering"),
    ("create", "customresourcedefinitions.apiextensions.k8s.io", ALL),
    *_each("create delete update", f"{IM} {MV}", TENANT),
    ("update", f"{IM}/status", TENANT),
    *_each("get create delete", "pods", TENANT),
    ("create", "pods/exec", TENANT),
    ("get", "pods/log", TENANT),
    *_each("delete update", "deployments.apps", TENANT),
    ("delete", "jobs.batch", TENANT),
    *_each("delete update", "configmaps services", TENANT),
    ("delete", "poddisruptionbudgets.policy", TENANT),
    *_each("list watch", "horizontalpodautoscalers.autoscaling", TENANT),
    *_each("get watch patch delete", "events", TENANT),
    *_each("create patch", "resourcequotas", TENANT),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io", ALL),
    ("escalate", "clusterroles.rbac.authorization.k8s.io", ALL),
    ("impersonate", "serviceaccounts", TENANT),
    ("patch", "nodes", ALL),
]

CONTROL_PLANE_MAY: list[Row] = [
    *_each("create patch delete", "namespaces", ALL),
    *_each("create patch", "resourcequotas", TENANT, QUOTA_NAME),
    *_each("get create patch", "secrets", TENANT, KEYS_SECRET),
    *_each("get list create patch delete", f"{IM} {MV}", TENANT),
]
CONTROL_PLANE_MAY_NOT: list[Row] = [
    # Only its own Secret, by name: no Secret of any other name, and no list or watch of any.
    *_each("get list watch", "secrets", ALL),
    *_each("get list watch create", "secrets", TENANT),
    *_each("get patch", "secrets", TENANT, "someone-elses-secret"),
    *_each("delete update", "secrets", TENANT, KEYS_SECRET),
    *_each("get list watch", "namespaces", ALL),
    ("create", "resourcequotas", TENANT),
    ("patch", "resourcequotas", TENANT, "someone-elses-quota"),
    ("delete", "resourcequotas", TENANT, QUOTA_NAME),
    *_each("get list", "pods", TENANT),
    ("create", "pods/exec", TENANT),
    ("get", "pods/log", TENANT),
    *_each("create get", "deployments.apps jobs.batch", TENANT),
    ("watch", IM, TENANT),
    ("patch", f"{IM}/status", TENANT),
    ("update", f"{IM}/finalizers", TENANT),
    ("create", "rolebindings.rbac.authorization.k8s.io", TENANT),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io", ALL),
    ("create", "customresourcedefinitions.apiextensions.k8s.io", ALL),
]


def expectations(operator: str, control_plane: str, peering: str, tenant: str) -> list[tuple[Request, bool]]:
    """Every row as a request of one of the two service accounts (usernames system:serviceaccount:...),
    with whether the API server must allow it."""

    def requests(user: str, rows: list[Row], allowed: bool) -> list[tuple[Request, bool]]:
        return [
            (
                Request(
                    user,
                    verb,
                    resource,
                    namespace=tenant if where == TENANT else None,
                    name=peering if name == PEERING else name,
                ),
                allowed,
            )
            for verb, resource, where, name in ((*row, None)[:4] for row in rows)
        ]

    return [
        *requests(operator, OPERATOR_MAY, True),
        *requests(operator, OPERATOR_MAY_NOT, False),
        *requests(control_plane, CONTROL_PLANE_MAY, True),
        *requests(control_plane, CONTROL_PLANE_MAY_NOT, False),
    ]
