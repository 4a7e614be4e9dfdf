"""Outputs cross the process boundary as rows of field values and come back equal, every field kept."""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler

from modelfleet.dataplane.engine.messages import Outputs
from modelfleet.dataplane.engine.outputs import EngineStats, RequestOutput


def outputs() -> Outputs:
    delta = RequestOutput(
        "a",
        [],
        " t1",
        [7],
        " t1",
        [7],
        [{7: -0.25, 3: -1.5}],
        finish_reason="stop",
        finished=True,
        num_cached_tokens=16,
        arrival_time=1.5,
        first_token_time=2.0,
        finished_time=2.5,
        delta=True,
    )
    failed = RequestOutput("b", [1, 2], finish_reason="error", finished=True, error="NaN logits")
    return Outputs([delta, failed], EngineStats(2, 1, 0.5, 0.25, 10, 20, num_preemptions=3))


def test_outputs_round_trip_through_the_pipes_pickler():
    sent = outputs()
    received = pickle.loads(ForkingPickler.dumps(sent))
    assert received == sent
    assert type(received.outputs[0]) is RequestOutput and received.outputs[0] is not sent.outputs[0]


def test_the_wire_form_names_no_field():
    # rows of values: field names would be pickled (and read back) with every output
    data = pickle.dumps(outputs())
    assert b"num_cached_tokens" not in data and b"first_token_time" not in data
    assert pickle.loads(pickle.dumps(Outputs([], EngineStats(0, 0, 0.0, 0.0, 1, 1)))).outputs == []
