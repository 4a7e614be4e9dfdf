"""Property-based fuzzing of a service from its own OpenAPI document (schemathesis strategies, run by
hypothesis), shared by the data-plane and control-plane fuzz tests."""

from __future__ import annotations

from collections.abc import Callable

import schemathesis
from hypothesis import HealthCheck, given, settings

Check = Callable[[schemathesis.Case, schemathesis.Response], None]


def fuzz(schema: schemathesis.BaseSchema, check: Check, *, max_examples: int, prepare=None) -> list[str]:
    """Run `check` on `max_examples` generated requests per operation (derandomized: the same cases each
    run); returns the operations fuzzed. `prepare` may bound a case before it is sent (e.g. max_tokens)."""
    fuzzed = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(
            max_examples=max_examples,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def one(case: schemathesis.Case) -> None:
            if prepare is not None:
                prepare(case)
            check(case, case.call(timeout=60))

        one()
        fuzzed.append(operation.label)
    return fuzzed
