"""The canary's decision (reconcile/rollout.py) and its windows (reconcile/windows.py): plain data."""

from __future__ import annotations

import datetime as dt

import pytest
from modelfleet.operator.api import InferenceModelSpec
from modelfleet.operator.reconcile import rollout
from modelfleet.operator.reconcile.windows import (
    VersionCounters,
    VersionWindow,
    quantile,
    sample_from_status,
    sample_to_status,
    windows,
)

T0 = dt.datetime(2026, 1, 1, 10, 0, tzinfo=dt.UTC)
SAMPLE = {"takenAt": "2026-01-01T10:00:00Z", "pods": [{"name": "chat-a", "versions": []}]}
LATER = {"takenAt": "2026-01-01T10:05:00Z", "pods": [{"name": "chat-b", "versions": []}]}


def spec(traffic: dict[str, int], **rollout_spec) -> InferenceModelSpec:
    return InferenceModelSpec.model_validate(
        {
            "hardware": {"accelerator": "nvidia-h100"},
            "traffic": [{"version": v, "weight": w} for v, w in traffic.items()],
            "rollout": {"candidate": "v2", "interval": "5m", **rollout_spec},
        }
    )


def split(state: dict) -> dict[str, int]:
    return {t["version"]: t["weight"] for t in state["traffic"]}


def ok(requests: int, errors: int = 0, p95: float | None = 0.4) -> dict[str, VersionWindow]:
    statuses = {"200": requests - errors, **({"503": errors} if errors else {})}
    return {"v2": VersionWindow("v2", statuses, p95), "v1": VersionWindow("v1", {"200": 500}, 0.3)}


def started(s: InferenceModelSpec) -> dict:
    decision = rollout.decide(s, None, T0, rollout.Observed(sample=SAMPLE))
    assert decision.action == "start"
    return decision.state


def test_a_rollout_starts_at_the_first_step_with_the_baseline_taking_the_rest():
    s = spec({"v1": 90, "v2": 10}, steps=[10, 50, 100])
    decision = rollout.decide(s, None, T0, rollout.Observed(sample=SAMPLE))
    state = decision.state
    assert split(state) == {"v1": 90, "v2": 10}
    assert state["baseline"] == [{"version": "v1", "weight": 100}]
    assert (state["phase"], state["step"], state["stepStartedAt"]) == (
        "Progressing",
        0,
        "2026-01-01T10:00:00Z",
    )
    assert state["sample"] == SAMPLE and state["specHash"] == rollout.spec_hash(s)
    assert (
        decision.event[:2] == ("Normal", "RolloutStepAdvanced")
        and "step 1/3: v1=90,v2=10" in decision.message
    )


def test_several_baseline_versions_share_the_rest_in_proportion():
    s = spec({"v1": 60, "v3": 30, "v2": 10}, steps=[25, 50], minRequests=10)
    state = started(s)
    assert split(state) == {"v1": 50, "v3": 25, "v2": 25}
    advanced = rollout.decide(s, state, T0 + dt.timedelta(minutes=5), rollout.Observed(LATER, ok(10)))
    assert advanced.action == "advance" and split(advanced.state) == {"v1": 33, "v3": 17, "v2": 50}
    rolled_back = rollout.decide(
        s, advanced.state, T0 + dt.timedelta(minutes=10), rollout.Observed(LATER, ok(10, 1))
    )
    assert split(rolled_back.state) == {"v1": 67, "v3": 33, "v2": 0}


def test_a_step_waits_for_its_interval_without_reading_metrics():
    s = spec({"v1": 100, "v2": 0})
    state = started(s)
    assert rollout.stage(s, state, T0 + dt.timedelta(minutes=4, seconds=59)) == "wait"
    decision = rollout.decide(s, state, T0 + dt.timedelta(minutes=4), None)
    assert decision.action == "wait" and decision.state is state and decision.event is None


def test_too_few_requests_wait_and_keep_the_window_open():
    s = spec({"v1": 100, "v2": 0}, minRequests=20)
    state = started(s)
    decision = rollout.decide(s, state, T0 + dt.timedelta(minutes=6), rollout.Observed(LATER, ok(19, 5)))
    assert decision.action == "wait" and decision.event is None
    new = decision.state
    assert split(new) == {"v1": 90, "v2": 10} and new["step"] == 0
    # The window still starts where the step began, so the next judgement sees all requests since then.
    assert new["sample"] == SAMPLE and new["stepStartedAt"] == state["stepStartedAt"]
    assert "answered 19 request(s)" in new["message"] and "fewer than minRequests 20" in new["message"]
    assert new["lastMetrics"][1] == {
        "version": "v2",
        "requests": 19,
        "errors": 5,
        "errorRate": 0.263158,
        "p95LatencyMs": 400.0,
    }


def test_a_healthy_step_advances_and_starts_a_new_window():
    s = spec({"v1": 100, "v2": 0}, thresholds={"maxErrorRate": 0.05, "maxP95LatencyMs": 500})
    state = started(s)
    now = T0 + dt.timedelta(minutes=5)
    decision = rollout.decide(s, state, now, rollout.Observed(LATER, ok(100, 5)))  # 5% is not above 5%
    assert decision.action == "advance"
    new = decision.state
    assert split(new) == {"v1": 50, "v2": 50} and new["step"] == 1 and new["phase"] == "Progressing"
    assert new["sample"] == LATER and new["stepStartedAt"] == "2026-01-01T10:05:00Z"
    assert decision.event[1] == "RolloutStepAdvanced"
    assert (
        "step 1/3 passed (100 requests, error rate 5.00% <= 5.00%, p95 400 ms <= 500 ms)" in decision.message
    )


def test_the_last_healthy_step_succeeds_with_all_traffic_on_the_candidate():
    s = spec({"v1": 100, "v2": 0}, steps=[50, 100])
    state = started(s)
    state = rollout.decide(s, state, T0 + dt.timedelta(minutes=5), rollout.Observed(LATER, ok(40))).state
    assert split(state) == {"v1": 0, "v2": 100}
    decision = rollout.decide(s, state, T0 + dt.timedelta(minutes=10), rollout.Observed(LATER, ok(40)))
    assert decision.action == "succeed" and decision.state["phase"] == "Succeeded"
    assert split(decision.state) == {"v1": 0, "v2": 100} and decision.event[:2] == (
        "Normal",
        "RolloutSucceeded",
    )
    assert rollout.stage(s, decision.state, T0 + dt.timedelta(hours=1)) == "finished"
    assert rollout.effective_traffic(s, decision.state) == decision.state["traffic"]


def test_an_error_rate_breach_rolls_back_and_names_the_values():
    s = spec({"v1": 90, "v2": 10}, steps=[20, 100])
    state = started(s)
    decision = rollout.decide(s, state, T0 + dt.timedelta(minutes=5), rollout.Observed(LATER, ok(200, 3)))
    assert decision.action == "rollback" and decision.state["phase"] == "RolledBack"
    assert split(decision.state) == {"v1": 100, "v2": 0}
    assert decision.event[:2] == ("Warning", "RolloutRolledBack")
    assert "maxErrorRate: error rate 1.50% (3 of 200 requests failed) > 1.00%" in decision.message
    assert rollout.stage(s, decision.state, T0 + dt.timedelta(hours=1)) == "finished"


def test_a_p95_latency_breach_rolls_back():
    s = spec({"v1": 100, "v2": 0}, thresholds={"maxP95LatencyMs": 2000})
    state = started(s)
    decision = rollout.decide(
        s, state, T0 + dt.timedelta(minutes=5), rollout.Observed(LATER, ok(50, p95=2.5))
    )
    assert decision.action == "rollback" and split(decision.state) == {"v1": 100, "v2": 0}
    assert "maxP95LatencyMs: p95 latency 2500 ms > 2000 ms" in decision.message
    assert "maxErrorRate" not in decision.message


def test_client_errors_are_requests_but_not_failures():
    window = VersionWindow("v2", {"200": 90, "400": 5, "429": 3, "499": 2})
    assert (window.requests, window.errors, window.error_rate) == (100, 0, 0.0)
    s = spec({"v1": 100, "v2": 0})
    decision = rollout.decide(
        s, started(s), T0 + dt.timedelta(minutes=5), rollout.Observed(LATER, {"v2": window})
    )
    assert decision.action == "advance"


def test_unreadable_metrics_pause_the_step_and_it_resumes_after():
    s = spec({"v1": 100, "v2": 0})
    state = started(s)
    paused = rollout.decide(
        s, state, T0 + dt.timedelta(minutes=5), rollout.Observed(error="pod a: timed out")
    )
    assert paused.action == "pause" and paused.state["phase"] == "Paused"
    assert split(paused.state) == {"v1": 90, "v2": 10} and paused.state["sample"] == SAMPLE
    assert paused.event[:2] == ("Warning", "RolloutPaused") and "pod a: timed out" in paused.message
    resumed = rollout.decide(s, paused.state, T0 + dt.timedelta(minutes=6), rollout.Observed(LATER, ok(30)))
    assert resumed.action == "advance" and resumed.state["phase"] == "Progressing"


def test_a_start_without_metrics_opens_its_window_at_the_first_readable_scrape():
    s = spec({"v1": 100, "v2": 0})
    started_blind = rollout.decide(s, None, T0, rollout.Observed(error="no running data-plane pod"))
    state = started_blind.state
    assert state["sample"] is None and split(state) == {"v1": 90, "v2": 10}
    assert started_blind.message.endswith("(no metrics yet: no running data-plane pod)")
    assert state["message"] == started_blind.message
    now = T0 + dt.timedelta(minutes=5)
    decision = rollout.decide(s, state, now, rollout.Observed(LATER, ok(500)))
    assert decision.action == "wait" and decision.state["sample"] == LATER
    assert decision.state["stepStartedAt"] == "2026-01-01T10:05:00Z"


def test_nothing_to_roll_out_when_the_candidate_already_has_everything():
    s = spec({"v1": 0, "v2": 100})
    decision = rollout.decide(s, None, T0, rollout.Observed(sample=SAMPLE))
    assert decision.action == "succeed" and split(decision.state) == {"v1": 0, "v2": 100}
    assert "nothing to roll out" in decision.message


def test_a_changed_rollout_starts_over_and_a_stale_state_is_not_served():
    s = spec({"v1": 100, "v2": 0}, steps=[10, 50, 100])
    state = rollout.decide(s, started(s), T0 + dt.timedelta(minutes=5), rollout.Observed(LATER, ok(50))).state
    assert state["step"] == 1
    changed = spec({"v1": 100, "v2": 0}, steps=[5, 100])
    assert rollout.effective_traffic(changed, state) is None
    again = rollout.decide(changed, state, T0 + dt.timedelta(minutes=6), rollout.Observed(sample=LATER))
    assert again.action == "start" and again.state["step"] == 0 and split(again.state) == {"v1": 95, "v2": 5}


# --- windows ---------------------------------------------------------------------------------------------


def counters(statuses: dict[str, float], buckets: dict[str, float] | None = None) -> VersionCounters:
    return VersionCounters(statuses=statuses, buckets=buckets or {})


def test_windows_are_deltas_summed_over_pods_and_survive_restarts():
    before = {
        "a": {"v2": counters({"200": 10, "500": 1}, {"0.5": 5, "1.0": 11, "+Inf": 11})},
        "b": {"v2": counters({"200": 50}, {"0.5": 50, "1.0": 50, "+Inf": 50})},
        "gone": {"v2": counters({"200": 1000})},
    }
    after = {
        "a": {"v2": counters({"200": 30, "500": 3}, {"0.5": 15, "1.0": 33, "+Inf": 33})},
        "b": {"v2": counters({"200": 4}, {"0.5": 4, "1.0": 4, "+Inf": 4})},  # restarted: counts from 0
        "new": {"v2": counters({"200": 6, "503": 1}), "v1": counters({"200": 2})},
    }
    result = windows(before, after)
    assert result["v2"].statuses == {"200": 20 + 4 + 6, "500": 2, "503": 1}
    assert (result["v2"].requests, result["v2"].errors) == (33, 3)
    assert result["v1"].requests == 2 and result["v1"].p95_seconds is None
    # Merged bucket deltas {0.5: 14, 1.0: 26}: the 95th percentile (rank 24.7) lies in (0.5, 1.0].
    assert result["v2"].p95_seconds == pytest.approx(0.5 + 0.5 * (24.7 - 14) / 12)


def test_quantile_interpolates_inside_its_bucket_and_stops_at_the_last_finite_bound():
    assert quantile(0.95, {"0.1": 50, "0.5": 90, "1.0": 100, "+Inf": 100}) == pytest.approx(0.75)
    assert quantile(0.95, {"0.1": 0, "0.5": 1, "+Inf": 10}) == 0.5
    assert quantile(0.95, {"0.1": 0, "+Inf": 0}) is None


def test_a_sample_round_trips_through_status():
    sample = {"a": {"v1": counters({"200": 3.0}, {"0.05": 1.0, "+Inf": 3.0})}}
    stored = sample_to_status(sample, "2026-01-01T10:00:00Z")
    assert stored["pods"][0]["versions"][0]["buckets"] == [
        {"le": "0.05", "count": 1.0},
        {"le": "+Inf", "count": 3.0},
    ]
    assert sample_from_status(stored) == sample


def test_a_latency_threshold_is_never_passed_without_latency_observations():
    s = spec({"v1": 100, "v2": 0}, thresholds={"maxP95LatencyMs": 2000})
    rejected = {"v2": VersionWindow("v2", {"400": 50})}  # answered, but none reached generation
    decision = rollout.decide(s, started(s), T0 + dt.timedelta(minutes=5), rollout.Observed(LATER, rejected))
    assert decision.action == "wait" and decision.state["step"] == 0
    assert "no latency observations" in decision.message
