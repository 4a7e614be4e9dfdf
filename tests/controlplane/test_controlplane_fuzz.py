"""Fuzzing the control plane's API from its own OpenAPI document, as the admin (the widest surface), on
SQLite and PostgreSQL: no 5xx, one error shape for every refusal, and the service works afterwards."""

from __future__ import annotations

import schemathesis
from controlplane_factories import ADMIN, Factory
from fastapi.testclient import TestClient
from fuzzing import fuzz
from modelfleet.controlplane.api.handlers import error_code
from modelfleet.dataplane.errorbody import ErrorBody


def one_error_shape_and_no_5xx(case: schemathesis.Case, response: schemathesis.Response) -> None:
    assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
    if response.status_code >= 400:
        error = ErrorBody.model_validate(response.json()).error.model_dump()
        assert error["code"] == error_code(response.status_code), response.text
        assert isinstance(error["message"], str) and error["message"], response.text
        assert isinstance(error["type"], str), response.text


def as_admin(case: schemathesis.Case) -> None:
    case.headers = {**(case.headers or {}), **ADMIN}


def test_no_input_gets_a_5xx_and_the_service_works_on(client: TestClient, factory: Factory):
    tenant = factory.tenant()  # so that some generated paths name a tenant that exists
    factory.model(tenant, name="chat")
    schema = schemathesis.openapi.from_asgi("/openapi.json", client.app)
    fuzzed = fuzz(schema, one_error_shape_and_no_5xx, max_examples=25, prepare=as_admin)
    assert len(fuzzed) >= 15, fuzzed
    assert client.get(f"/api/v1/tenants/{tenant}/models/chat", headers=ADMIN).status_code == 200
    factory.tenant()  # and writes still work
