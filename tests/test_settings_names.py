"""No environment variable is read by two components' settings with two meanings: MODELFLEET_PORT is the
data plane's, the control plane's is MODELFLEET_CONTROLPLANE_PORT."""

from __future__ import annotations

from itertools import combinations

from modelfleet.controlplane.core.config import Settings
from modelfleet.dataplane.server.settings import ServerSettings
from modelfleet.operator.settings import OperatorSettings
from pydantic_settings import BaseSettings

COMPONENTS = {"dataplane": ServerSettings, "operator": OperatorSettings, "controlplane": Settings}
# Names two components may both read because they mean the same thing in each (none today).
SAME_MEANING: frozenset[str] = frozenset()


def env_names(settings: type[BaseSettings]) -> set[str]:
    """Every variable the class reads: prefix + field name, and the upper-case aliases."""
    prefix = settings.model_config.get("env_prefix", "")
    names = set()
    for name, field in settings.model_fields.items():
        aliases = getattr(field.validation_alias, "choices", None) or [field.validation_alias]
        upper = {alias for alias in aliases if isinstance(alias, str) and alias.isupper()}
        names |= upper or {f"{prefix}{name}".upper()}
    return names


def test_no_variable_means_two_things():
    for (a, cls_a), (b, cls_b) in combinations(COMPONENTS.items(), 2):
        shared = (env_names(cls_a) & env_names(cls_b)) - SAME_MEANING
        assert not shared, f"{a} and {b} both read {sorted(shared)}"


def test_the_collision_check_sees_the_names():
    names = {component: env_names(cls) for component, cls in COMPONENTS.items()}
    assert {"MODELFLEET_HOST", "MODELFLEET_PORT"} <= names["dataplane"]
    assert {"MODELFLEET_CONTROLPLANE_HOST", "MODELFLEET_CONTROLPLANE_PORT"} <= names["controlplane"]
    assert {"MODELFLEET_CONTROLPLANE_DATABASE_URL", "DATABASE_URL", "KUBECONFIG"} <= names["controlplane"]
    assert "MODELFLEET_OPERATOR_PEERING" in names["operator"]


def test_each_prefix_belongs_to_one_component():
    """The control plane's and the operator's own variables start with their name, so a new field cannot
    land on a data-plane name: the data plane has no field starting with controlplane_ or operator_."""
    assert Settings.model_config["env_prefix"] == "MODELFLEET_CONTROLPLANE_"
    assert not [
        name for name in ServerSettings.model_fields if name.startswith(("controlplane_", "operator_"))
    ]
