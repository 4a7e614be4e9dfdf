"""The operator's conversion Job, read by the converter it runs: the host allow-list set in the chart
(MODELFLEET_CONVERSION_SOURCE_ALLOW_HOSTS) becomes the converter's own policy in the Job's environment."""

from __future__ import annotations

import httpx
import pytest
from modelfleet.converters.errors import BadInputError
from modelfleet.converters.hosts import HostPolicy
from modelfleet.operator.api import ModelVersion
from modelfleet.operator.reconcile import conversion
from modelfleet.operator.reconcile.targets import Target
from modelfleet.operator.settings import OperatorSettings

MV = {
    "apiVersion": "modelfleet.dev/v1alpha1",
    "kind": "ModelVersion",
    "metadata": {"name": "chat-v1", "namespace": "team-a", "uid": "uid-v1"},
    "spec": {"model": "chat", "version": "v1", "source": {"uri": "https://models.internal/chat.tar"}},
}
TARGET = Target("cpu", "torch", "fp32")


def job_env(settings: OperatorSettings) -> dict[str, str]:
    job = conversion.conversion_job(MV, ModelVersion.model_validate(MV), TARGET, settings)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return {var["name"]: var["value"] for var in container["env"]}


def test_the_allow_list_reaches_the_converter():
    policy = HostPolicy.from_env(job_env(OperatorSettings(conversion_source_allow_hosts="10.0.0.0/8")))
    assert policy.address(httpx.URL("http://10.1.2.3/model.tar")) == "10.1.2.3"
    with pytest.raises(BadInputError, match="not in MODELFLEET_SOURCE_ALLOW_HOSTS"):
        policy.address(httpx.URL("http://169.254.169.254/latest/meta-data"))


def test_without_a_list_the_converter_keeps_its_safe_default():
    env = job_env(OperatorSettings())
    assert "MODELFLEET_SOURCE_ALLOW_HOSTS" not in env
    with pytest.raises(BadInputError, match="private address"):
        HostPolicy.from_env(env).address(httpx.URL("http://10.1.2.3/model.tar"))
