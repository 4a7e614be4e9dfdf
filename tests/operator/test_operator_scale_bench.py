"""bench/operator_scale.py without a cluster: its offline helpers, the one skipped line when KUBECONFIG
holds no cluster, and a short --kmock run whose JSON line carries what the cluster run reports (p99 from
a model's creation to its children, the operator's idle CPU and memory)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "bench"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import operator_scale

    return operator_scale


def json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_percentile_is_the_nearest_rank(bench):
    assert bench.percentile([], 0.99) is None
    assert bench.percentile([5.0, 1.0, 3.0], 0.5) == 3.0
    values = [float(v) for v in range(1, 101)]
    assert bench.percentile(values, 0.99) == 99.0
    assert bench.percentile(values, 1.0) == 100.0
    # One slow model in a hundred is the p99; one in a thousand is not.
    assert bench.percentile([0.1] * 999 + [9.0], 0.99) == 0.1
    assert bench.percentile([0.1] * 98 + [9.0, 9.0], 0.99) == 9.0


def test_a_model_is_done_only_once_each_of_its_children_exists(bench):
    wanted = {"a": bench.expected_children("a", True), "b": bench.expected_children("b", False)}
    assert ("horizontalpodautoscalers", "a") in wanted["a"]
    assert not any(kind == "horizontalpodautoscalers" for kind, _ in wanted["b"])
    created, done = {"a": 1.0, "b": 1.0}, {}
    job = {"metadata": {"name": "a-v1-convert-x", "labels": {"modelfleet.dev/model": "a"}}}
    found = {bench.child_key("jobs", job)} | (wanted["a"] - {("jobs", "a")}) | wanted["b"]
    bench._check(found - {("configmaps", "a-manifest")}, wanted, created, done)
    assert sorted(done) == ["b"]
    bench._check(found, wanted, created, done)
    assert sorted(done) == ["a", "b"]
    assert bench.child_key("jobs", {"metadata": {"name": "unlabelled"}}) is None


def test_without_a_cluster_it_prints_one_skipped_line(bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    assert bench.main([]) == 0
    (line,) = json_lines(capsys.readouterr().out)
    assert line["bench"] == "operator_scale"
    assert line["skipped"].startswith("no cluster")


@pytest.mark.slow
def test_a_short_emulated_run_prints_the_fields_of_the_cluster_run(bench, capsys):
    argv = ["--kmock", "--models", "4", "--rate", "20", "--resync", "2", "--rest-seconds", "2"]
    assert bench.main([*argv, "--baseline-seconds", "1", "--settle", "1", "--converge-timeout", "60"]) == 0
    (line,) = json_lines(capsys.readouterr().out)
    assert (line["mode"], line["models"]) == ("kmock", 4)
    latency = line["create_to_children_s"]
    assert latency["converged"] == 4
    assert 0 < latency["p50"] <= latency["p99"] <= latency["max"]
    assert latency["goal_p99"] == 5.0
    assert line["creation"]["reconciles"] >= 4  # each model reconciled at least once
    rest = line["rest"]
    assert rest["window_s"] >= 2 and rest["cpu_percent_of_core"] >= 0 and rest["rss_mib"] > 0
    assert rest["goal_cpu_percent_of_core"] == 5.0
    assert {"objects_changed", "events_posted", "writes_seen_by_api_server"} <= set(rest)
    assert line["baseline_no_models"]["rss_mib"] > 0
