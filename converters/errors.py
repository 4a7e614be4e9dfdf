"""The converter's errors: each is one line a user can act on, with the exit code it maps to."""

from __future__ import annotations


class ConversionError(Exception):
    """The conversion could not produce a valid artifact; nothing was published."""

    exit_code = 1


class BadInputError(ConversionError):
    """The source or the arguments are wrong (missing/corrupt files, unsupported model, bad target)."""

    exit_code = 2


class ToolMissingError(ConversionError):
    """An optional tool this conversion needs (TensorRT, s3fs) is not installed here."""

    exit_code = 3


class ValidationFailedError(ConversionError):
    """The artifact was built but does not match its source within the thresholds of its dtype."""

    exit_code = 4

    def __init__(self, message: str, validation: dict) -> None:
        super().__init__(message)
        self.validation = validation
