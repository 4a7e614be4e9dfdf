"""An hf:// ModelVersion: accepted by the API models and the CRD's pattern, and its conversion Job gets
HF_TOKEN from the Secret the spec names (read by the kubelet, never by the operator)."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest
import yaml
from modelfleet.operator.api import URI_PATTERN, ModelVersion
from modelfleet.operator.reconcile import conversion
from modelfleet.operator.reconcile.targets import Target
from modelfleet.operator.settings import OperatorSettings
from pydantic import ValidationError

from tests.operator.conftest import ROOT

TARGET = Target("cpu", "torch", "fp32")


def model_version(source: dict) -> dict:
    return {
        "apiVersion": "modelfleet.dev/v1alpha1",
        "kind": "ModelVersion",
        "metadata": {"name": "chat-v3", "namespace": "team-a", "uid": "uid-v3"},
        "spec": {"model": "chat", "version": "v3", "source": source},
    }


def container(mv: dict) -> dict:
    job = conversion.conversion_job(mv, ModelVersion.model_validate(mv), TARGET, OperatorSettings())
    (only,) = job["spec"]["template"]["spec"]["containers"]
    return only


@pytest.mark.parametrize("k8s_version", ["1.30.0", "1.37.0"])
def test_the_token_comes_from_the_named_secret(k8s_version):
    mv = model_version({"uri": "hf://meta-llama/Llama-3.2-1B@main", "tokenSecret": {"name": "hf-token"}})
    job = conversion.conversion_job(mv, ModelVersion.model_validate(mv), TARGET, OperatorSettings())
    kubernetes_validate.validate(job, k8s_version, strict=True)
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"][2:4] == ["--source", "hf://meta-llama/Llama-3.2-1B@main"]
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_TOKEN"] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}},
    }
    assert all(v.get("claimName") != "hf" for v in job["spec"]["template"]["spec"]["volumes"])


def test_no_secret_no_token():
    env = {e["name"] for e in container(model_version({"uri": "hf://org/model"}))["env"]}
    assert "HF_TOKEN" not in env


def test_the_secret_key_can_be_named_and_is_checked():
    mv = model_version({"uri": "hf://org/model", "tokenSecret": {"name": "hub", "key": "HF_TOKEN"}})
    (entry,) = [e for e in container(mv)["env"] if e["name"] == "HF_TOKEN"]
    assert entry["valueFrom"]["secretKeyRef"] == {"name": "hub", "key": "HF_TOKEN"}
    with pytest.raises(ValidationError, match=r"tokenSecret\.name|token_secret\.name"):
        ModelVersion.model_validate(
            model_version({"uri": "hf://org/m", "tokenSecret": {"name": "Not_Valid"}})
        )


def test_the_crd_takes_hf_uris_and_the_secret():
    crd = yaml.safe_load((ROOT / "crds" / "modelversions.modelfleet.dev.yaml").read_text())
    source = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "source"
    ]
    assert re.match(source["properties"]["uri"]["pattern"], "hf://org/model@v1")
    assert source["properties"]["uri"]["pattern"] == URI_PATTERN
    assert source["properties"]["tokenSecret"]["required"] == ["name"]
