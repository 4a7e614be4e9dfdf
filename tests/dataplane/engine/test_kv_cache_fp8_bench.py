"""bench/kv_cache_fp8.py on the CPU with the tiny model: an error line (the fp8 cache changes the logits
a little and no top token) and a capacity line (twice the sequences in the same bytes)."""

from __future__ import annotations

import json
from pathlib import Path


def test_the_benchmark_prints_error_and_capacity(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[3] / "bench"))
    import kv_cache_fp8

    argv = ["--device", "cpu", "--model-dir", str(tiny_model_dir), "--num-prompts", "2", "--prompt-len", "30"]
    assert kv_cache_fp8.main([*argv, "--decode-steps", "6", "--kv-cache-bytes", str(1 << 20)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [line["case"] for line in lines] == ["error", "capacity"]  # "engine" runs on a GPU only
    error, capacity = lines
    assert error["positions"] == 2 * 7
    assert 0 < error["max_abs_logit_diff"] < 0.1 * error["max_abs_logit"]
    assert error["top1_agreement"] == 1.0
    assert 0 < error["kv_amax"] < 448
    # the tiny model: 2 layers x 2 KV heads x head_dim 16 x 16 tokens x K and V
    assert capacity["bf16"]["block_bytes"] == 2 * capacity["fp8"]["block_bytes"] == 4096
    assert capacity["fp8"]["seqs"] == 2 * capacity["bf16"]["seqs"] == 8
    assert capacity["seqs_ratio"] == 2.0
