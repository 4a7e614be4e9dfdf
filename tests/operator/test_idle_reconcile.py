"""The pieces that make an idle reconcile free: apply only what differs, and drop triggers with no news."""

from __future__ import annotations

import time

import pytest
from modelfleet.operator.kube import APPLIED, matches, with_digest
from modelfleet.operator.triggers import Triggers


def test_a_live_object_with_server_defaults_matches_what_was_applied():
    desired = {
        "spec": {
            "replicas": 1,
            "template": {
                "spec": {"containers": [{"name": "s", "resources": {"limits": {"nvidia.com/gpu": 1}}}]}
            },
            "selector": {},
            "note": "",
        }
    }
    live = {
        "metadata": {"resourceVersion": "7", "managedFields": []},
        "spec": {
            "replicas": 1,
            "revisionHistoryLimit": 10,
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "s",
                            "resources": {"limits": {"nvidia.com/gpu": "1"}},
                            "imagePullPolicy": "Always",
                        }
                    ]
                }
            },
        },
    }
    assert matches(live, desired)


@pytest.mark.parametrize(
    "live",
    [
        {"spec": {"replicas": 2, "ports": [{"port": 80}]}},  # a value edited
        {"spec": {"replicas": 1, "ports": [{"port": 80}, {"port": 81}]}},  # a list grown
        {"spec": {"ports": [{"port": 80}]}},  # a field removed
        None,  # the object deleted
    ],
)
def test_drift_does_not_match(live):
    assert not matches(live, {"spec": {"replicas": 1, "ports": [{"port": 80}]}})


def test_the_digest_changes_when_a_field_is_no_longer_set():
    before = with_digest({"metadata": {"name": "m", "annotations": {"a": "1"}}, "spec": {"replicas": 1}})
    after = with_digest({"metadata": {"name": "m", "annotations": {"a": "1"}}, "spec": {}})
    assert before["metadata"]["annotations"]["a"] == "1"
    # The live object still holds every field of `after`, but not its digest: it is applied again.
    assert not matches(before, after)
    assert matches(
        before, with_digest({"metadata": {"name": "m", "annotations": {"a": "1"}}, "spec": {"replicas": 1}})
    )
    assert before["metadata"]["annotations"][APPLIED] != after["metadata"]["annotations"][APPLIED]


def body(uid: str, version: str, generation: int = 1, deleting: bool = False) -> dict:
    meta = {"uid": uid, "resourceVersion": version, "generation": generation}
    return {"metadata": {**meta, "deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else meta}


def test_an_event_of_a_version_a_reconcile_saw_is_no_news():
    triggers = Triggers()
    assert triggers.is_news(body("u1", "5"), "ADDED")
    triggers.remember(body("u1", "5")["metadata"])
    assert not triggers.is_news(body("u1", "5"), None)  # listed again, unchanged
    assert not triggers.is_news(body("u1", "5"), "MODIFIED")  # the operator's own write
    assert triggers.is_news(body("u1", "6"), "MODIFIED")  # someone else's
    assert triggers.is_news(body("u1", "5"), "DELETED")
    assert triggers.is_news(body("u1", "5"), None)  # forgotten with its deletion


def test_for_a_version_only_its_spec_and_its_deletion_are_news():
    triggers = Triggers()
    triggers.remember(body("mv", "5")["metadata"])
    assert not triggers.is_news(body("mv", "6"), "MODIFIED", spec_only=True)  # kopf's finalizer
    assert triggers.is_news(body("mv", "7", generation=2), "MODIFIED", spec_only=True)
    assert triggers.is_news(body("mv", "8", deleting=True), "MODIFIED", spec_only=True)
    assert triggers.is_news(body("mv", "6"), "MODIFIED")  # for other kinds any new version is news


def test_a_trigger_is_covered_only_by_a_reconcile_that_began_after_it_and_succeeded():
    triggers = Triggers()
    received = time.monotonic()
    with pytest.raises(RuntimeError), triggers.turn("ns", "m", time.monotonic()) as needed:
        assert needed
        raise RuntimeError("the API server went away")
    with triggers.turn("ns", "m", received) as needed:
        assert needed  # the failed one covers nothing
    with triggers.turn("ns", "m", received) as needed:
        assert not needed  # the one above began after `received` and succeeded
    before_step = time.monotonic()
    with triggers.turn("ns", "m", None) as needed:
        assert needed  # a rollout step always runs...
    with triggers.turn("ns", "m", before_step) as needed:
        assert needed  # ...and covers nothing
    assert triggers.since_reconciled("ns", "m") < 1 and triggers.since_reconciled("ns", "other") == float(
        "inf"
    )
