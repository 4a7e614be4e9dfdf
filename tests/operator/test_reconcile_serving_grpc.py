"""The data plane's gRPC port on the serving objects: absent by default, a named container port, Service
port and environment variable when the operator's setting asks for it."""

from __future__ import annotations

import kubernetes_validate
import pytest
from modelfleet.operator.api import InferenceModel
from modelfleet.operator.reconcile import serving
from modelfleet.operator.settings import OperatorSettings
from pydantic import ValidationError

BASE = {"dataplane_image": "registry.example/modelfleet:1.2.3"}


def objects(example_objects, **settings):
    im = example_objects["chat"]
    spec = InferenceModel.model_validate(im).spec
    config = OperatorSettings(**BASE, **settings)
    return serving.deployment(im, spec, config), serving.service(im, config)


def test_no_grpc_port_by_default(example_objects):
    deployment, service = objects(example_objects)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert [p["name"] for p in container["ports"]] == ["http"]
    assert [p["name"] for p in service["spec"]["ports"]] == ["http"]
    assert "MODELFLEET_GRPC_PORT" not in {e["name"] for e in container["env"]}


@pytest.mark.parametrize("k8s_version", ["1.30.0", "1.37.0"])
def test_a_grpc_port_is_served_and_exposed(example_objects, k8s_version):
    deployment, service = objects(example_objects, dataplane_grpc_port=9000)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "grpc", "containerPort": 9000, "protocol": "TCP"} in container["ports"]
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert (grpc["port"], grpc["targetPort"], grpc["appProtocol"]) == (9000, "grpc", "kubernetes.io/h2c")
    assert {"name": "MODELFLEET_GRPC_PORT", "value": "9000"} in container["env"]
    for obj in (deployment, service):
        kubernetes_validate.validate(obj, k8s_version, strict=True)


def test_the_grpc_port_cannot_be_the_http_port():
    with pytest.raises(ValidationError, match="is the HTTP port"):
        OperatorSettings(**BASE, dataplane_port=8000, dataplane_grpc_port=8000)
