"""Both services' HTTP errors have one shape, dataplane/errorbody.py's: OpenAI's error body, with `code`
a string naming the error (the HTTP status is only the response's status)."""

from __future__ import annotations

import pytest
from controlplane_factories import ADMIN
from fastapi.testclient import TestClient
from modelfleet.dataplane.errorbody import ErrorBody
from modelfleet.dataplane.server import errors as dataplane_errors
from pydantic import ValidationError

API = "/api/v1"


def test_the_schema_refuses_a_status_as_code():
    body = {"error": {"message": "no such tenant", "type": "not_found_error", "param": None, "code": 404}}
    with pytest.raises(ValidationError):
        ErrorBody.model_validate(body)


@pytest.mark.parametrize(
    ("method", "path", "headers", "json", "status", "code"),
    [
        ("get", f"{API}/tenants", {}, None, 401, "invalid_api_key"),
        ("get", f"{API}/tenants/no-such-tenant", ADMIN, None, 404, "not_found"),
        ("post", f"{API}/tenants", ADMIN, {"name": ""}, 422, "invalid_request"),
        ("get", f"{API}/no-such-route", ADMIN, None, 404, "not_found"),
        ("delete", f"{API}/tenants", ADMIN, None, 405, "method_not_allowed"),
    ],
)
def test_control_plane_errors(client: TestClient, method, path, headers, json, status, code):
    response = client.request(method, path, headers=headers, json=json)
    assert response.status_code == status, response.text
    assert ErrorBody.model_validate(response.json()).error.code == code


def _server_errors() -> list[type[dataplane_errors.ServerError]]:
    found, todo = [], [dataplane_errors.ServerError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


@pytest.mark.parametrize("cls", _server_errors(), ids=lambda cls: cls.__name__)
def test_data_plane_errors(cls):
    kwargs = {"retry_after": 1.0} if cls.__init__.__code__.co_varnames.count("retry_after") else {}
    error = cls("something went wrong", **kwargs)
    body = ErrorBody.model_validate(error.body())
    assert body.error.message == "something went wrong"
    assert body.error.code is None or body.error.code.isidentifier()
