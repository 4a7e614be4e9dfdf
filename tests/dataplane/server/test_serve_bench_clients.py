"""bench/serve.py's client split over processes, against a live server of the tiny demo model: every
request is answered once, whatever the split, and the summary says how busy the server and the
busiest client were (the figures that tell a saturated client from a saturated server)."""

from __future__ import annotations

import argparse
import asyncio
import os

import pytest


@pytest.fixture
def serve_bench(bench_scripts):
    import serve

    return serve


def test_a_split_client_answers_every_request_once(tiny_model_dir, serve_bench):
    process, url = serve_bench.start_server(tiny_model_dir, "tiny", ["max_model_len=256"])
    try:
        prompts = serve_bench.random_prompts(10, 8, 200, seed=0)
        args = argparse.Namespace(
            output_len=6, request_rate=float("inf"), max_concurrency=4, seed=0, input_len=8
        )
        summaries = {}
        for processes in (1, 3):
            args.client_processes = processes
            summaries[processes] = asyncio.run(
                serve_bench.run_http(url, "tiny", args, prompts, server_pid=process.pid)
            )
    finally:
        process.terminate()
        process.wait(timeout=30)
    for processes, summary in summaries.items():
        assert summary["client_processes"] == processes
        assert (summary["completed"], summary["failed"]) == (10, 0), summary["first_error"]
        assert summary["output_throughput_tok_s"] > 0
        # Busy shares over a run this short are coarse (clock ticks of 10 ms): present and positive.
        assert summary["server_cpu_util"] > 0 and summary["client_cpu_util_max"] > 0
        # The server's own TTFT (from its /metrics, this run's requests alone), within the requests'
        # whole time. (Not against the client's TTFT: the two start and stop at different points, and on
        # a run this short they came within a tenth of a millisecond of each other, either way round.)
        assert 0 < summary["server_ttft_mean_ms"] < summary["e2e_ms"]["mean"]
    # Each of the 10 answers counted its 6 tokens: none lost or counted twice across the clients. (The
    # count itself: throughput times the rounded duration can be a token off on a run this short.)
    assert {p: s["output_tokens"] for p, s in summaries.items()} == {1: 60, 3: 60}


def test_cpu_seconds_reads_this_process(serve_bench):
    import time

    before = serve_bench.cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    assert serve_bench.cpu_seconds(os.getpid()) - before >= 0.15


def test_the_ab_case_alternates_the_pair_and_one_version_on_one_server(tiny_model_dir, serve_bench):
    """bench/serve.py's A/B case: each round loads the 50/50 pair, then version a alone (pinned) on the
    same server; the pair's answers come from both versions, the one version's from a alone."""
    prompts = serve_bench.random_prompts(24, 8, 200, seed=0)  # all to one version: 2 in 2**24
    args = argparse.Namespace(
        model_name="tiny", engine=["max_model_len=256"], ab_streams=4, ab_rounds=2, output_len=4,
        request_rate=float("inf"), max_concurrency=None, seed=0, input_len=8, client_processes=1,
    )  # fmt: skip
    rounds = serve_bench.run_pair(args, tiny_model_dir, prompts, relays=None, gpu_sharing="none")
    assert len(rounds) == 2
    for r in rounds:
        pair, one = r["pair"], r["one_version"]
        assert (pair["completed"], one["completed"]) == (24, 24), (pair["first_error"], one["first_error"])
        assert set(pair["versions"]) == {"a", "b"} and set(one["versions"]) == {"a"}
        assert r["pair_vs_one_output_throughput"] == round(
            pair["output_throughput_tok_s"] / one["output_throughput_tok_s"], 3
        )
