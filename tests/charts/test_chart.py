"""The Helm chart, rendered by the real helm: lint, schema, Kubernetes validation and what it grants."""

from __future__ import annotations

import filecmp
from typing import Any

import celpy
import pytest
import yaml
from modelfleet.dataplane.observability import LOG_FORMAT_ENV
from modelfleet.operator.api import InferenceModelSpec
from modelfleet.operator.reconcile import serving
from modelfleet.operator.settings import OperatorSettings

from .helm import (
    CHART,
    KUBERNETES_VERSIONS,
    ROOT,
    by_kind,
    container_env,
    helm_binary,
    render,
    run_helm,
    validation_errors,
)

DIGEST = "sha256:" + "ab" * 32
DATAPLANE_POD_LABELS = {
    "app.kubernetes.io/component": "dataplane",
    "app.kubernetes.io/managed-by": "modelfleet-operator",
}
EXAMPLE_MODEL = {
    "metadata": {"name": "chat", "namespace": "team-a", "uid": "u1"},
    "apiVersion": "x",
    "kind": "y",
}
EXAMPLE_SPEC = InferenceModelSpec.model_validate(
    {"hardware": {"accelerator": "cpu"}, "traffic": [{"version": "v1", "weight": 100}]}
)

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "postgresql": {
        "database": {"type": "postgresql", "postgresql": {"existingSecret": "modelfleet-db"}},
        "controlPlane": {"replicas": 3},
        "logFormat": "json",
    },
    "postgresql-url": {
        "database": {"type": "postgresql", "postgresql": {"url": "postgresql://mf:pw@db.example:5432/mf"}},
    },
    "without-control-plane": {"controlPlane": {"enabled": False}},
    "custom-images": {
        "images": {
            "controlPlane": {"repository": "registry.example.com/mf/controlplane", "tag": "1.2.3"},
            "dataplane": {
                "repository": "registry.example.com/mf/dataplane",
                "tag": "1.2.3-cu12",
                "digest": DIGEST,
            },
        },
        "imagePullSecrets": [{"name": "regcred"}],
        "dataplane": {"imagePullSecrets": ["regcred"]},
        "operator": {"watchNamespaces": ["team-a", "team-b"]},
        "modelStore": {"tenantNamespaces": ["team-a", "team-b"], "storageClass": "nfs"},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "tracing": {"otlpEndpoint": "http://otel-collector.observability:4318"},
        "networkPolicy": {"metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]},
    },
}

# Each bad value, and the path helm's schema error must name so that the user finds the field.
BAD_VALUES = {
    "unknown-key": ({"operater": {"replicas": 2}}, "operater"),
    "bad-digest": ({"images": {"dataplane": {"digest": "sha256:xyz"}}}, "/images/dataplane/digest"),
    "zero-replicas": ({"operator": {"replicas": 0}}, "/operator/replicas"),
    "unknown-database": ({"database": {"type": "mysql"}}, "/database/type"),
    "postgresql-without-url": ({"database": {"type": "postgresql"}}, "/database/postgresql/url"),
    "sqlite-two-replicas": ({"controlPlane": {"replicas": 2}}, "/controlPlane/replicas"),
    "root-user": ({"podSecurityContext": {"runAsNonRoot": False}}, "/podSecurityContext/runAsNonRoot"),
    "short-admin-key": ({"controlPlane": {"auth": {"adminKey": "short"}}}, "/controlPlane/auth/adminKey"),
    "bad-namespace": ({"operator": {"watchNamespaces": ["Team_A"]}}, "/operator/watchNamespaces/0"),
    "bad-log-format": ({"logFormat": "yaml"}, "/logFormat"),
    "bad-gpu-sharing": ({"dataplane": {"gpuSharing": "time-slicing"}}, "/dataplane/gpuSharing"),
    "negative-migration-retries": (
        {"controlPlane": {"migrationJob": {"backoffLimit": -1}}},
        "/controlPlane/migrationJob/backoffLimit",
    ),
}


@pytest.fixture(scope="module")
def rendered() -> dict[tuple[str, str], list[dict[str, Any]]]:
    """(value set, Kubernetes version) -> rendered documents; helm runs once per pair."""
    return {
        (name, kv): render(values, kube_version=kv)
        for name, values in VALUE_SETS.items()
        for kv in KUBERNETES_VERSIONS
    }


def test_helm_is_installed_by_the_setup() -> None:
    result = run_helm("version", "--short")
    assert result.returncode == 0 and result.stdout.startswith("v"), result.stderr
    assert helm_binary().stat().st_mode & 0o111


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_lint_strict(value_set: str) -> None:
    result = run_helm("lint", "--strict", str(CHART), values=VALUE_SETS[value_set])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("kube_version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_manifest_validates(rendered, value_set: str, kube_version: str) -> None:
    docs = rendered[(value_set, kube_version)]
    assert validation_errors(docs, kube_version) == []
    kinds = {doc["kind"] for doc in docs}
    assert {"CustomResourceDefinition", "Deployment", "ClusterRole", "NetworkPolicy"} <= kinds


@pytest.mark.parametrize("case", BAD_VALUES)
def test_schema_rejects_bad_values(case: str) -> None:
    values, field = BAD_VALUES[case]
    result = run_helm("template", "mf", str(CHART), values=values)
    assert result.returncode != 0, f"{case} was accepted"
    assert "values don't meet the specifications of the schema" in result.stderr
    assert field in result.stderr, result.stderr


def test_chart_refuses_kubernetes_older_than_1_30() -> None:
    """ValidatingAdmissionPolicy v1 and the CRDs' CEL rules need 1.30."""
    result = run_helm("template", "mf", str(CHART), "--kube-version", "1.29.5")
    assert result.returncode != 0 and "requires kubeVersion" in result.stderr


def test_validation_catches_a_broken_manifest(rendered) -> None:
    """The validator itself can fail: a misspelt field in a Deployment is reported under --strict."""
    docs = [dict(doc) for doc in rendered[("defaults", KUBERNETES_VERSIONS[-1])]]
    deployment = next(doc for doc in docs if doc["kind"] == "Deployment")
    broken = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    assert validation_errors([broken], KUBERNETES_VERSIONS[-1])


def test_chart_crds_are_the_generated_ones() -> None:
    generated = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    assert generated, "no CRDs in crds/: run `make crds`"
    in_chart = sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    fix = "run scripts/sync-chart-crds.sh"
    assert in_chart == sorted([*generated, "kopf-peering.yaml"]), f"chart CRDs differ from crds/: {fix}"
    _, mismatch, errors = filecmp.cmpfiles(ROOT / "crds", CHART / "crds", generated, shallow=False)
    assert mismatch == [] and errors == [], f"chart CRDs {mismatch + errors} differ from crds/: {fix}"


def test_operator_runs_two_replicas_with_kopf_peering(rendered) -> None:
    docs = rendered[("defaults", KUBERNETES_VERSIONS[-1])]
    operator = by_kind(docs, "Deployment")["mf-modelfleet-operator"]
    assert operator["spec"]["replicas"] == 2
    env = container_env(operator)
    peerings = by_kind(docs, "ClusterKopfPeering")
    assert list(peerings) == [env["MODELFLEET_OPERATOR_PEERING"]]
    assert env["POD_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["MODELFLEET_OPERATOR_NAMESPACES"] == ""
    crd_names = set(by_kind(docs, "CustomResourceDefinition"))
    assert {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"} <= crd_names
    assert by_kind(docs, "PodDisruptionBudget")["mf-modelfleet-operator"]["spec"]["maxUnavailable"] == 1


def test_operator_gets_dataplane_defaults(rendered) -> None:
    env = container_env(
        by_kind(rendered[("custom-images", "1.37.0")], "Deployment")["mf-modelfleet-operator"]
    )
    assert env["MODELFLEET_DATAPLANE_IMAGE"] == f"registry.example.com/mf/dataplane:1.2.3-cu12@{DIGEST}"
    assert env["MODELFLEET_DATAPLANE_IMAGE_PULL_SECRETS"] == "regcred"
    assert env["MODELFLEET_MODEL_STORE_CLAIM"] == "mf-modelfleet-models"
    assert env["MODELFLEET_MODEL_STORE_PATH"] == "/models"
    assert env["MODELFLEET_DATAPLANE_OTLP_ENDPOINT"] == "http://otel-collector.observability:4318"
    defaults = container_env(
        by_kind(rendered[("defaults", "1.37.0")], "Deployment")["mf-modelfleet-operator"]
    )
    assert defaults["MODELFLEET_DATAPLANE_IMAGE"] == "ghcr.io/modelfleet/dataplane:0.1.0"


def test_custom_images_are_used(rendered) -> None:
    docs = rendered[("custom-images", KUBERNETES_VERSIONS[-1])]
    for deployment in by_kind(docs, "Deployment").values():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["containers"][0]["image"] == "registry.example.com/mf/controlplane:1.2.3"
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_rbac_is_least_privilege(rendered, value_set: str) -> None:
    docs = rendered[(value_set, KUBERNETES_VERSIONS[-1])]
    roles = [*by_kind(docs, "ClusterRole").values(), *by_kind(docs, "Role").values()]
    for role in roles:
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert "*" not in rule.get(field, []), f"wildcard in {role['metadata']['name']}: {rule}"
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])
    for binding in [*by_kind(docs, "ClusterRoleBinding").values(), *by_kind(docs, "RoleBinding").values()]:
        assert binding["roleRef"]["name"] in {r["metadata"]["name"] for r in roles}, (
            "bound to a role not ours"
        )


def test_peering_writes_are_limited_to_our_own(rendered) -> None:
    """What each role grants is checked against what the code calls in test_rbac_needs.py."""
    operator = by_kind(rendered[("defaults", KUBERNETES_VERSIONS[-1])], "ClusterRole")[
        "modelfleet-system-mf-modelfleet-operator"
    ]
    peering_writes = [
        r for r in operator["rules"] if "patch" in r["verbs"] and "clusterkopfpeerings" in r["resources"]
    ]
    assert [r["resourceNames"] for r in peering_writes] == [["modelfleet-system-mf-modelfleet"]]


def test_operator_rbac_is_namespaced_when_namespaces_are_listed(rendered) -> None:
    docs = rendered[("custom-images", KUBERNETES_VERSIONS[-1])]
    operator = by_kind(docs, "ClusterRole")["modelfleet-system-mf-modelfleet-operator"]
    # Cluster-wide only discovery; the workload rules live in one Role per listed namespace.
    cluster_wide = {resource for rule in operator["rules"] for resource in rule["resources"]}
    assert cluster_wide == {"customresourcedefinitions", "namespaces"}
    roles = [doc for doc in docs if doc["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert roles[0]["rules"] == roles[1]["rules"]
    assert "kopfpeerings" in {resource for rule in roles[0]["rules"] for resource in rule["resources"]}
    peerings = [doc for doc in docs if doc["kind"] == "KopfPeering"]
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    assert not by_kind(docs, "ClusterKopfPeering")
    env = container_env(by_kind(docs, "Deployment")["mf-modelfleet-operator"])
    assert env["MODELFLEET_OPERATOR_NAMESPACES"] == "team-a,team-b"


def test_every_rbac_rule_says_why() -> None:
    """Each rule in the RBAC templates sits right below a comment giving its reason."""
    for template in (CHART / "templates").rglob("rbac.yaml"):
        lines = template.read_text().splitlines()
        for number, line in enumerate(lines):
            if line.lstrip().startswith("- apiGroups:"):
                previous = lines[number - 1].strip()
                assert previous.startswith("#"), f"{template.name}:{number + 1}: rule without a comment"


def test_control_plane_database(rendered) -> None:
    sqlite = by_kind(rendered[("defaults", "1.37.0")], "Deployment")["mf-modelfleet-controlplane"]
    assert container_env(sqlite)["DATABASE_URL"] == "sqlite:////var/lib/modelfleet/controlplane.db"
    assert sqlite["spec"]["strategy"]["type"] == "Recreate"
    volumes = {v["name"]: v for v in sqlite["spec"]["template"]["spec"]["volumes"]}
    assert volumes["data"]["persistentVolumeClaim"]["claimName"] == "mf-modelfleet-controlplane-sqlite"

    postgres_docs = rendered[("postgresql", "1.37.0")]
    postgres = by_kind(postgres_docs, "Deployment")["mf-modelfleet-controlplane"]
    assert postgres["spec"]["replicas"] == 3
    url = container_env(postgres)["DATABASE_URL"]
    assert url == {"secretKeyRef": {"name": "modelfleet-db", "key": "DATABASE_URL"}}
    assert "mf-modelfleet-controlplane-sqlite" not in by_kind(postgres_docs, "PersistentVolumeClaim")
    assert "mf-modelfleet-controlplane-database" not in by_kind(postgres_docs, "Secret")

    url_docs = rendered[("postgresql-url", "1.37.0")]
    secret = by_kind(url_docs, "Secret")["mf-modelfleet-controlplane-database"]
    assert "DATABASE_URL" in secret["data"]
    egress_ports = {
        port["port"]
        for rule in by_kind(url_docs, "NetworkPolicy")["mf-modelfleet-controlplane"]["spec"]["egress"]
        for port in rule["ports"]
    }
    assert 5432 in egress_ports


def test_without_control_plane_only_the_operator_is_installed(rendered) -> None:
    docs = rendered[("without-control-plane", "1.37.0")]
    components = {doc["metadata"].get("labels", {}).get("app.kubernetes.io/component") for doc in docs}
    assert "controlplane" not in components
    assert set(by_kind(docs, "Deployment")) == {"mf-modelfleet-operator"}
    # Nobody writes the API key Secret without the control plane: serving pods must not mount it.
    assert (
        container_env(by_kind(docs, "Deployment")["mf-modelfleet-operator"])[
            "MODELFLEET_DATAPLANE_API_KEYS_SECRET"
        ]
        == ""
    )


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_pods_are_hardened(rendered, value_set: str) -> None:
    for deployment in by_kind(rendered[(value_set, "1.37.0")], "Deployment").values():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]
            assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]


def test_model_store_claims(rendered) -> None:
    docs = rendered[("custom-images", "1.37.0")]
    claims = [
        d
        for d in docs
        if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == "mf-modelfleet-models"
    ]
    assert sorted(c["metadata"]["namespace"] for c in claims) == ["modelfleet-system", "team-a", "team-b"]
    assert {c["spec"]["storageClassName"] for c in claims} == {"nfs"}
    existing = render({"modelStore": {"existingClaim": "shared-models"}})
    assert not [
        d for d in existing if d["kind"] == "PersistentVolumeClaim" and "models" in d["metadata"]["name"]
    ]
    env = container_env(by_kind(existing, "Deployment")["mf-modelfleet-operator"])
    assert env["MODELFLEET_MODEL_STORE_CLAIM"] == "shared-models"


def test_service_monitor_is_optional(rendered) -> None:
    assert not by_kind(rendered[("defaults", "1.37.0")], "ServiceMonitor")
    monitor = by_kind(rendered[("custom-images", "1.37.0")], "ServiceMonitor")["mf-modelfleet"]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {"metrics", "http"}


def test_generated_auth_secret_is_random_and_overridable() -> None:
    first, second = (by_kind(render(), "Secret")["mf-modelfleet-controlplane-auth"] for _ in range(2))
    assert first["data"]["admin-key"] != second["data"]["admin-key"]
    given = by_kind(render({"controlPlane": {"auth": {"existingSecret": "my-auth"}}}), "Deployment")
    admin = container_env(given["mf-modelfleet-controlplane"])["MODELFLEET_CONTROLPLANE_ADMIN_KEY"]
    assert admin == {"secretKeyRef": {"name": "my-auth", "key": "admin-key"}}


def test_notes_give_the_next_steps() -> None:
    result = run_helm("install", "mf", str(CHART), "--dry-run=client", "--namespace", "modelfleet-system")
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    for step in (
        "rollout status deployment/mf-modelfleet-operator",
        "kubectl -n modelfleet-system get secret mf-modelfleet-controlplane-auth",
        "apply -f examples/model.yaml",
        "patch im chat",
    ):
        assert step in notes
    manifest = result.stdout.split("NOTES:", 1)[0].split("MANIFEST:", 1)[1]
    assert {"Deployment", "ClusterKopfPeering"} <= {d["kind"] for d in yaml.safe_load_all(manifest) if d}


def admission_allows(policy: dict[str, Any], operation: str, old: dict | None, new: dict | None) -> bool:
    """Evaluates the policy's CEL validations the way the API server does for one request."""
    env = celpy.Environment()
    variables = {
        v["name"]: env.program(env.compile(v["expression"])).evaluate(celpy.json_to_cel({}))
        for v in policy["spec"].get("variables", [])
    }
    activation = celpy.json_to_cel(
        {"request": {"operation": operation}, "oldObject": old, "object": new, "variables": variables}
    )
    return all(
        bool(env.program(env.compile(rule["expression"])).evaluate(activation))
        for rule in policy["spec"]["validations"]
    )


def test_control_plane_may_only_touch_what_it_created(rendered) -> None:
    docs = rendered[("defaults", "1.37.0")]
    policy = by_kind(docs, "ValidatingAdmissionPolicy")["modelfleet-system-mf-modelfleet-controlplane"]
    binding = by_kind(docs, "ValidatingAdmissionPolicyBinding")[
        "modelfleet-system-mf-modelfleet-controlplane"
    ]
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    (condition,) = policy["spec"]["matchConditions"]
    assert "system:serviceaccount:modelfleet-system:mf-modelfleet-controlplane" in condition["expression"]
    covered = policy["spec"]["matchConstraints"]["resourceRules"][0]["resources"]
    assert sorted(covered) == ["namespaces", "resourcequotas", "secrets"]

    ours = {
        "metadata": {"name": "team-a", "labels": {"app.kubernetes.io/managed-by": "modelfleet-controlplane"}}
    }
    theirs = {"metadata": {"name": "kube-system", "labels": {"kubernetes.io/metadata.name": "kube-system"}}}
    unlabelled = {"metadata": {"name": "default"}}
    assert admission_allows(policy, "CREATE", None, ours)
    assert admission_allows(policy, "UPDATE", ours, ours)
    assert admission_allows(policy, "DELETE", ours, None)
    assert not admission_allows(policy, "CREATE", None, unlabelled)
    assert not admission_allows(policy, "DELETE", theirs, None)
    assert not admission_allows(policy, "DELETE", unlabelled, None)
    assert not admission_allows(policy, "UPDATE", theirs, {**theirs, **ours})  # taking over is refused
    assert not by_kind(
        render({"controlPlane": {"admissionPolicy": {"enabled": False}}}), "ValidatingAdmissionPolicy"
    )


def test_env_names_are_settings_the_components_read(rendered) -> None:
    """Every MODELFLEET_* variable the chart sets is a field of the component's settings (no typo
    silently ignored), and the Secret names agree with the control plane's."""
    from modelfleet.controlplane import resources
    from modelfleet.controlplane.core.config import Settings

    deployments = by_kind(rendered[("postgresql", "1.37.0")], "Deployment")
    for name, settings in (("operator", OperatorSettings), ("controlplane", Settings)):
        prefix = settings.model_config["env_prefix"]
        read = {f"{prefix}{field.upper()}" for field in settings.model_fields}
        for field in settings.model_fields.values():
            aliases = getattr(field.validation_alias, "choices", [])
            read |= {alias for alias in aliases if isinstance(alias, str) and alias.isupper()}
        env = container_env(deployments[f"mf-modelfleet-{name}"])
        ours = {key for key in env if key.startswith("MODELFLEET_") or key == "DATABASE_URL"}
        assert ours - read - {LOG_FORMAT_ENV} == set(), f"{name}: variables its settings do not read"
        assert env[LOG_FORMAT_ENV] == "json"
    operator_env = container_env(deployments["mf-modelfleet-operator"])
    assert operator_env["MODELFLEET_DATAPLANE_API_KEYS_SECRET"] == resources.KEYS_SECRET
    operator = {f"MODELFLEET_{field.upper()}" for field in OperatorSettings.model_fields}
    must_set = {"MODELFLEET_OPERATOR_PEERING", "MODELFLEET_DATAPLANE_IMAGE", "MODELFLEET_MODEL_STORE_CLAIM"}
    assert must_set <= operator & set(operator_env)


def test_network_policies_allow_only_what_is_used(rendered) -> None:
    policies = by_kind(rendered[("defaults", "1.37.0")], "NetworkPolicy")
    for name, ingress_ports, egress_ports in (
        ("operator", {"metrics", "health"}, {53, 443, 6443, 8000}),
        ("controlplane", {"http"}, {53, 443, 6443}),
    ):
        spec = policies[f"mf-modelfleet-{name}"]["spec"]
        assert spec["policyTypes"] == ["Ingress", "Egress"]
        assert {p["port"] for rule in spec["ingress"] for p in rule["ports"]} == ingress_ports
        assert {p["port"] for rule in spec["egress"] for p in rule["ports"]} == egress_ports
    # The operator reaches only the data-plane pods it made (rollouts read their /metrics), on their port.
    operator_egress = policies["mf-modelfleet-operator"]["spec"]["egress"]
    to_pods = [rule for rule in operator_egress if "to" in rule]
    assert to_pods == [
        {
            "to": [{"podSelector": {"matchLabels": DATAPLANE_POD_LABELS}, "namespaceSelector": {}}],
            "ports": [{"port": 8000, "protocol": "TCP"}],
        }
    ]
    template = serving.deployment(EXAMPLE_MODEL, EXAMPLE_SPEC, OperatorSettings())["spec"]["template"]
    assert DATAPLANE_POD_LABELS.items() <= template["metadata"]["labels"].items()
    assert template["spec"]["containers"][0]["ports"][0]["containerPort"] == 8000
    (namespaced,) = [
        rule
        for rule in by_kind(rendered[("custom-images", "1.37.0")], "NetworkPolicy")["mf-modelfleet-operator"][
            "spec"
        ]["egress"]
        if "to" in rule
    ]
    assert namespaced["to"][0]["namespaceSelector"] == {
        "matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a", "team-b"]}
        ]
    }
    moved = by_kind(render({"dataplane": {"port": 9000}}), "NetworkPolicy")["mf-modelfleet-operator"]
    assert [r["ports"] for r in moved["spec"]["egress"] if "to" in r] == [[{"port": 9000, "protocol": "TCP"}]]
    restricted = render(
        {"networkPolicy": {"controlPlaneFrom": [{"podSelector": {"matchLabels": {"a": "b"}}}]}}
    )
    (rule,) = by_kind(restricted, "NetworkPolicy")["mf-modelfleet-controlplane"]["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": {"a": "b"}}}]
    assert not by_kind(render({"networkPolicy": {"enabled": False}}), "NetworkPolicy")


MIGRATION_JOB = "mf-modelfleet-controlplane-migrate"


def _pod(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def test_migrations_run_once_per_release_in_a_hook_job(rendered) -> None:
    docs = render(
        {
            "database": {"type": "postgresql", "postgresql": {"existingSecret": "modelfleet-db"}},
            "controlPlane": {"replicas": 3, "extraEnv": [{"name": "PGSSLMODE", "value": "require"}]},
            "tracing": {"otlpEndpoint": "http://otel-collector.observability:4318"},
            "imagePullSecrets": [{"name": "regcred"}],
        }
    )
    job = by_kind(docs, "Job")[MIGRATION_JOB]
    deployment = by_kind(docs, "Deployment")["mf-modelfleet-controlplane"]
    # post-install: the Secrets it reads are the release's own; pre-upgrade: before the new pods start.
    assert job["metadata"]["annotations"] == {
        "helm.sh/hook": "post-install,pre-upgrade",
        "helm.sh/hook-weight": "0",
        "helm.sh/hook-delete-policy": "before-hook-creation,hook-succeeded",
    }
    pod, replica_pod = _pod(job), _pod(deployment)
    (migrate,), (replica,) = pod["containers"], replica_pod["containers"]
    assert migrate["command"] == ["modelfleet", "controlplane", "--migrate-only"]
    assert pod["restartPolicy"] == "Never"
    # The same database, image and hardening as the replicas it migrates for.
    for key in ("image", "imagePullPolicy", "env", "volumeMounts", "securityContext", "resources"):
        assert migrate[key] == replica[key], key
    for key in ("securityContext", "volumes", "serviceAccountName", "imagePullSecrets"):
        assert pod[key] == replica_pod[key], key
    assert {"name": "PGSSLMODE", "value": "require"} in migrate["env"]
    assert pod["automountServiceAccountToken"] is False  # migrating never calls the Kubernetes API
    # The replicas never migrate: they wait for the Job.
    assert container_env(deployment)["MODELFLEET_CONTROLPLANE_MIGRATE_ON_START"] == "false"
    # The Service must not send API requests to the Job's pod.
    job_labels = job["spec"]["template"]["metadata"]["labels"].items()
    selector = by_kind(docs, "Service")["mf-modelfleet-controlplane"]["spec"]["selector"]
    assert not selector.items() <= job_labels

    # Its NetworkPolicy: no ingress, egress only to DNS and PostgreSQL.
    policy = by_kind(docs, "NetworkPolicy")[MIGRATION_JOB]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= job_labels
    assert policy["ingress"] == [] and policy["policyTypes"] == ["Ingress", "Egress"]
    assert {p["port"] for rule in policy["egress"] for p in rule["ports"]} == {53, 5432}


def test_sqlite_migrates_in_its_one_replica_and_the_job_can_be_turned_off(rendered) -> None:
    """SQLite: the Recreate strategy makes the one replica the only writer, and a Job would need its
    ReadWriteOnce volume while the old pod holds it."""
    sqlite = rendered[("defaults", "1.37.0")]
    assert MIGRATION_JOB not in by_kind(sqlite, "Job")
    deployment = by_kind(sqlite, "Deployment")["mf-modelfleet-controlplane"]
    assert container_env(deployment)["MODELFLEET_CONTROLPLANE_MIGRATE_ON_START"] == "true"
    assert MIGRATION_JOB in by_kind(rendered[("postgresql-url", "1.37.0")], "Job")

    by_hand = render(
        {
            "database": {"type": "postgresql", "postgresql": {"existingSecret": "modelfleet-db"}},
            "controlPlane": {"migrationJob": {"enabled": False}},
        }
    )
    assert MIGRATION_JOB not in by_kind(by_hand, "Job")
    assert MIGRATION_JOB not in by_kind(by_hand, "NetworkPolicy")
    # Still no replica migrates: whoever turned the Job off runs `--migrate-only` themselves.
    replica_env = container_env(by_kind(by_hand, "Deployment")["mf-modelfleet-controlplane"])
    assert replica_env["MODELFLEET_CONTROLPLANE_MIGRATE_ON_START"] == "false"


def test_dataplane_pods_log_in_the_charts_log_format(rendered) -> None:
    operator = by_kind(rendered[("postgresql", "1.37.0")], "Deployment")["mf-modelfleet-operator"]
    log_format = container_env(operator)["MODELFLEET_DATAPLANE_LOG_FORMAT"]
    assert log_format == "json"
    settings = OperatorSettings(dataplane_log_format=log_format)
    pod = serving.deployment(EXAMPLE_MODEL, EXAMPLE_SPEC, settings)["spec"]["template"]["spec"]
    env = {item["name"]: item.get("value") for item in pod["containers"][0]["env"]}
    assert env[LOG_FORMAT_ENV] == "json"
    unset = serving.deployment(EXAMPLE_MODEL, EXAMPLE_SPEC, OperatorSettings())["spec"]["template"]["spec"]
    assert LOG_FORMAT_ENV not in {item["name"] for item in unset["containers"][0]["env"]}


def test_stream_relays_reach_gpu_pods_only_when_set(rendered) -> None:
    """dataplane.streamRelays unset (null): no operator setting, so GPU pods leave the count to the server
    (one relay per 64 of an engine's max_num_seqs); set, even to 0, it reaches the pods' server."""
    gpu_spec = EXAMPLE_SPEC.model_copy(
        update={"hardware": EXAMPLE_SPEC.hardware.model_copy(update={"accelerator": "nvidia-h100"})}
    )
    for values, relays in (
        ({}, None),
        ({"dataplane": {"streamRelays": 0}}, "0"),
        ({"dataplane": {"streamRelays": 4}}, "4"),
    ):
        docs = rendered[("defaults", "1.37.0")] if not values else render(values, kube_version="1.37.0")
        env = container_env(by_kind(docs, "Deployment")["mf-modelfleet-operator"])
        assert env.get("MODELFLEET_DATAPLANE_STREAM_RELAYS") == relays
        settings = OperatorSettings(dataplane_stream_relays=None if relays is None else int(relays))
        pod = serving.deployment(EXAMPLE_MODEL, gpu_spec, settings)["spec"]["template"]["spec"]
        pod_env = {item["name"]: item.get("value") for item in pod["containers"][0]["env"]}
        assert pod_env.get("MODELFLEET_STREAM_RELAYS") == relays


@pytest.mark.parametrize(
    ("values", "sharing"), [({}, "mps"), ({"dataplane": {"gpuSharing": "none"}}, "none")]
)
def test_gpu_sharing_reaches_one_gpu_nvidia_pods(rendered, values, sharing) -> None:
    """dataplane.gpuSharing -> the operator's setting -> MODELFLEET_GPU_SHARING of a one-GPU NVIDIA pod."""
    docs = rendered[("defaults", "1.37.0")] if not values else render(values, kube_version="1.37.0")
    env = container_env(by_kind(docs, "Deployment")["mf-modelfleet-operator"])
    assert env["MODELFLEET_DATAPLANE_GPU_SHARING"] == sharing
    gpu_spec = EXAMPLE_SPEC.model_copy(
        update={"hardware": EXAMPLE_SPEC.hardware.model_copy(update={"accelerator": "nvidia-h100"})}
    )
    pod = serving.deployment(EXAMPLE_MODEL, gpu_spec, OperatorSettings(dataplane_gpu_sharing=sharing))
    pod_env = {
        item["name"]: item.get("value") for item in pod["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert pod_env.get("MODELFLEET_GPU_SHARING") == ("mps" if sharing == "mps" else None)
