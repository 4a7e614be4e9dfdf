"""Domain errors, each mapped once to an HTTP status (main.py) with the OpenAI error body."""

from __future__ import annotations


class ControlPlaneError(Exception):
    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class NotAuthenticated(ControlPlaneError):
    status_code = 401
    error_type = "authentication_error"


class Forbidden(ControlPlaneError):
    status_code = 403
    error_type = "permission_error"


class NotFound(ControlPlaneError):
    status_code = 404
    error_type = "not_found_error"


class Conflict(ControlPlaneError):
    status_code = 409
    error_type = "conflict_error"


class Invalid(ControlPlaneError):
    """A well-formed request that names something that does not fit (e.g. an unknown version)."""

    status_code = 422
    error_type = "invalid_request_error"


class ClusterUnavailable(ControlPlaneError):
    status_code = 502
    error_type = "cluster_error"


class ClusterConflict(ClusterUnavailable):
    """The object changed since it was read (HTTP 409 from the API server); read again and retry."""

    status_code = 409
    error_type = "conflict_error"
