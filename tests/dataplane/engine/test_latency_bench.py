"""bench/latency.py and bench/throughput.py --quantize on the CPU with the tiny model: every engine built
once, runs interleaved, each run's rate with the median, the best and the step times, ratios of each;
fp8 refused up front where it cannot run. On a GPU: the GPU's own step times (CUDA events)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).parents[3] / "bench"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    for name in ("latency", "throughput"):
        sys.modules.pop(name, None)
    import latency
    import throughput

    return latency, throughput


def json_line(capsys) -> dict:
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    return json.loads(line)


def test_runs_are_interleaved_round_by_round(bench):
    latency, _ = bench
    calls: list[str] = []

    def run(name):
        def call():
            calls.append(name)
            return {"n": calls.count(name)}

        return call

    measured = latency.interleave({"bf16": run("bf16"), "int8": run("int8"), "fp8": run("fp8")}, 3)
    assert calls == ["bf16", "int8", "fp8"] * 3
    assert measured["int8"] == [{"n": 1}, {"n": 2}, {"n": 3}]


def test_summary_keeps_every_run_and_their_median_and_best(bench):
    latency, _ = bench
    runs = [
        {"rate": 100.0, "ttft": 0.01, "step_s": [0.010, 0.011, 0.030], "device_step_s": [0.009] * 3},
        {"rate": 50.0, "ttft": 0.03, "step_s": [0.010, 0.050, 0.050], "device_step_s": [0.0095] * 3},
        {"rate": 80.0, "ttft": 0.02, "step_s": [0.012, 0.012, 0.012], "device_step_s": [0.010] * 3},
    ]
    runs = [
        {**r, "host_step_s": [0.002, 0.004, 0.003] if i != 1 else [0.002, 0.045, 0.044]}
        for i, r in enumerate(runs)
    ]
    out = latency.summary(runs)
    assert out["decode_tokens_per_s_runs"] == [100.0, 50.0, 80.0]
    assert out["decode_tokens_per_s"] == 80.0 and out["decode_tokens_per_s_best"] == 100.0
    assert out["ms_per_token"] == 12.5 and out["ttft_ms"] == 20.0
    assert out["step_ms_median_runs"] == [11.0, 50.0, 12.0]
    assert out["step_ms_max_runs"] == [30.0, 50.0, 12.0]
    assert out["step_ms_median"] == 12.0  # over all nine steps
    assert out["device_step_ms_median_runs"] == [9.0, 9.5, 10.0]
    assert out["device_step_ms_median"] == 9.5
    assert out["host_step_ms_median_runs"] == [3.0, 44.0, 3.0]  # the slow run's host was slow
    assert "sm_clock_mhz_runs" not in out  # no clock read
    clocked = latency.summary([{**r, "sm_clock_mhz": 1980 - 100 * i} for i, r in enumerate(runs)])
    assert clocked["sm_clock_mhz_runs"] == [1980, 1880, 1780]
    # Without GPU times (the CPU) there are no device keys.
    cpu = latency.summary([{**r, "device_step_s": []} for r in runs])
    assert not any(k.startswith("device") for k in cpu) and "host_step_ms_median" in cpu


def test_speedups_compare_medians_bests_steps_and_device_times(bench):
    latency, _ = bench
    base = {"decode_tokens_per_s": 100.0, "decode_tokens_per_s_best": 120.0, "step_ms_median": 10.0}
    fast = {"decode_tokens_per_s": 150.0, "decode_tokens_per_s_best": 150.0, "step_ms_median": 8.0}
    assert latency.speedups("int8", fast, base) == {
        "speedup_int8": 1.5,
        "speedup_int8_best": 1.25,
        "speedup_int8_step": 1.25,
    }
    with_device = latency.speedups(
        "fp8", {**fast, "device_step_ms_median": 4.0}, {**base, "device_step_ms_median": 6.0}
    )
    assert with_device["speedup_fp8_device"] == 1.5


def test_two_tokens_give_rates_without_step_times(bench, tiny_model_dir, capsys):
    """--output-len 2: the one decode step waits for the prefill's tokens, so no step is timed; the rates
    and their ratios are still reported (the step ratios are not)."""
    latency, _ = bench
    argv = ["--model", str(tiny_model_dir), "--input-len", "8", "--output-len", "2", "--skip-hf"]
    assert latency.main([*argv, "--quantize", "int8", "--repeats", "2"]) == 0
    result = json_line(capsys)
    assert "step_ms_median" not in result["engine"] and "step_ms_median" not in result["engine_int8"]
    assert result["speedup_int8"] > 0 and "speedup_int8_step" not in result


def test_latency_builds_each_engine_once_and_interleaves_its_runs(bench, tiny_model_dir, monkeypatch, capsys):
    latency, _ = bench
    built: list[str] = []
    build = latency.build_engine

    def counting_build(args, prompt_len, model, tensor_parallel=1):
        built.append(model)
        return build(args, prompt_len, model, tensor_parallel)

    monkeypatch.setattr(latency, "build_engine", counting_build)
    argv = ["--model", str(tiny_model_dir), "--input-len", "8", "--output-len", "6", "--skip-hf"]
    assert latency.main([*argv, "--quantize", "int8", "--repeats", "3"]) == 0
    result = json_line(capsys)
    assert len(built) == 2 and built[0] == str(tiny_model_dir) and built[1] != built[0]
    for name in ("engine", "engine_int8"):
        engine = result[name]
        assert len(engine["decode_tokens_per_s_runs"]) == 3
        assert engine["decode_tokens_per_s_best"] == max(engine["decode_tokens_per_s_runs"])
        assert engine["decode_tokens_per_s"] <= engine["decode_tokens_per_s_best"]
        assert len(engine["step_ms_median_runs"]) == len(engine["step_ms_max_runs"]) == 3
        assert all(
            0 < med <= top
            for med, top in zip(engine["step_ms_median_runs"], engine["step_ms_max_runs"], strict=True)
        )
        assert "device_step_ms_median" not in engine  # CPU: no CUDA events
        # The CPU computes in the launch: nothing is left to wait for, the host's time is the step's.
        assert engine["host_step_ms_median"] <= engine["step_ms_median"]
        assert engine["host_step_ms_median"] > 0.8 * engine["step_ms_median"]
    base, int8 = result["engine"], result["engine_int8"]
    assert result["speedup_int8"] == round(int8["decode_tokens_per_s"] / base["decode_tokens_per_s"], 2)
    assert result["speedup_int8_best"] == round(
        int8["decode_tokens_per_s_best"] / base["decode_tokens_per_s_best"], 2
    )
    assert result["speedup_int8_step"] == round(base["step_ms_median"] / int8["step_ms_median"], 2)
    assert int8["weight_bytes_per_step"] < result["weight_bytes_per_step"]


def test_latency_compares_with_hugging_face(bench, tiny_model_dir, capsys):
    latency, _ = bench
    argv = ["--model", str(tiny_model_dir), "--input-len", "8", "--output-len", "4", "--repeats", "2"]
    assert latency.main(argv) == 0
    result = json_line(capsys)
    hf = result["hf"]
    assert len(hf["decode_tokens_per_s_runs"]) == 2 and hf["decode_tokens_per_s"] > 0
    assert "step_ms_median" not in hf  # its steps are not timed one by one
    ours = result["engine"]["decode_tokens_per_s"]
    assert result["ratio_vs_hf"] == round(ours / hf["decode_tokens_per_s"], 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host may run fp8; the refusal is for the CPU")
@pytest.mark.parametrize("script", ["latency", "throughput"])
def test_fp8_on_the_cpu_is_refused_before_any_engine_runs(bench, script, tiny_model_dir, capsys):
    module = dict(zip(("latency", "throughput"), bench, strict=True))[script]
    argv = ["--model", str(tiny_model_dir), "--skip-hf", "--quantize", "int8", "--quantize", "fp8"]
    assert module.main(argv) == 2
    out = capsys.readouterr()
    assert out.out == ""  # nothing measured
    assert "--quantize fp8: fp8 weights need a CUDA GPU with compute capability >= 8.9" in out.err


def test_throughput_runs_the_int8_artifact_on_the_same_prompts(bench, tiny_model_dir, monkeypatch, capsys):
    _, throughput = bench
    built: list[tuple[str, bool]] = []
    artifact = throughput.quantized_artifact

    def recording_artifact(model_dir, fmt, out_dir, device="cpu", lm_head=False):
        built.append((fmt, lm_head))
        return artifact(model_dir, fmt, out_dir, device, lm_head)

    monkeypatch.setattr(throughput, "quantized_artifact", recording_artifact)
    argv = ["--model", str(tiny_model_dir), "--num-prompts", "6", "--input-len", "12", "--output-len", "5"]
    assert throughput.main([*argv, "--quantize", "int8", "--quantize-lm-head", "--skip-hf"]) == 0
    result = json_line(capsys)
    assert built == [("int8", True)] and result["quantize_lm_head"] is True
    int8 = result["engine_int8"]
    assert result["output_tokens"] == 30 and int8["output_tokens_per_s"] > 0
    assert result["speedup_int8"] == round(
        int8["output_tokens_per_s"] / result["engine"]["output_tokens_per_s"], 2
    )


@pytest.mark.parametrize("script", ["latency", "throughput"])
def test_quantize_lm_head_needs_a_quantize_format(bench, script, tiny_model_dir, capsys):
    module = dict(zip(("latency", "throughput"), bench, strict=True))[script]
    assert module.main(["--model", str(tiny_model_dir), "--skip-hf", "--quantize-lm-head"]) == 2
    assert "--quantize-lm-head: applies to the --quantize artifacts" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_latency_on_cuda_times_each_step_on_the_gpu(bench, tiny_llama_dir, capsys):
    latency, _ = bench
    argv = ["--device", "cuda", "--model", str(tiny_llama_dir), "--dtype", "bfloat16", "--skip-hf"]
    assert latency.main([*argv, "--output-len", "24", "--quantize", "int8", "--repeats", "2"]) == 0
    result = json_line(capsys)
    for name in ("engine", "engine_int8"):
        engine = result[name]
        assert len(engine["device_step_ms_median_runs"]) == 2
        # Steady decode: the engine steps as fast as the slower of the GPU and the host, so a step's GPU
        # time is at most its wall time (some slack: the two medians are over different steps' times).
        assert 0 < engine["device_step_ms_median"] <= engine["step_ms_median"] * 1.25
        assert 0 < engine["host_step_ms_median"] <= engine["step_ms_median"]
        assert "sm_clock_mhz_runs" not in engine or len(engine["sm_clock_mhz_runs"]) == 2
    assert "speedup_int8_device" in result
