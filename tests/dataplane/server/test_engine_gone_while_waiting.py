"""A request waiting for admission while its version's engine dies (and is unloaded to load again) gets
a 503 to retry, not an internal error from an engine that is no longer there."""

from __future__ import annotations

import asyncio

import pytest
from modelfleet.dataplane.server.auth import ANONYMOUS
from modelfleet.dataplane.server.dataplane import RequestContext
from modelfleet.dataplane.server.errors import ModelUnavailable
from modelfleet.dataplane.server.protocol import CompletionRequest

from .test_dataplane import dataplane  # noqa: F401  (the fixture: a facade over a scripted engine)


async def test_a_request_whose_engine_died_while_it_waited_gets_503(dataplane):  # noqa: F811
    ctx = RequestContext(principal=ANONYMOUS)
    dataplane.admission.cap = 1
    first = await dataplane.completion(CompletionRequest(model="m", prompt=[1, 2], max_tokens=5), ctx)
    waiting = asyncio.create_task(
        dataplane.completion(CompletionRequest(model="m", prompt=[1], max_tokens=1), ctx)
    )
    await asyncio.sleep(0.01)
    assert dataplane.admission.waiting == 1
    slot = dataplane.manager.slots[("m", "v1")]
    engine, slot.engine = slot.engine, None  # what the manager does with an engine process that died
    await first.aclose()  # its place goes to the waiting request
    with pytest.raises(ModelUnavailable) as info:
        await waiting
    assert info.value.status == 503 and info.value.headers["Retry-After"] == "1"
    assert (dataplane.admission.running, dataplane.admission.waiting) == (0, 0)
    slot.engine = engine
