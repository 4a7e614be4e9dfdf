"""bench/serve.py --structured: a checkpoint whose tokenizer cannot write the schema's JSON (the presets'
word-level tokenizer) is refused with the reason, and a preset is served beside a byte-level BPE
tokenizer that can, for both built-in schemas."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[3] / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        import serve
        import throughput

        yield serve, throughput
    finally:
        sys.path.remove(str(BENCH))


def fake_preset(path: Path, throughput, vocab_size: int) -> Path:
    """A preset's folder as build_preset leaves it (config, weights, word-level tokenizer), tiny."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"vocab_size": vocab_size, "max_position_embeddings": 512}))
    (path / "model.safetensors").write_bytes(b"weights")
    throughput.write_word_tokenizer(path, vocab_size)
    return path


def test_the_word_tokenizer_cannot_run_the_structured_bench(bench, tmp_path):
    serve, throughput = bench
    preset = fake_preset(tmp_path / "preset", throughput, 300)
    assert "has no chat template" in serve.structured_problem(preset, serve.LONG_SCHEMA)
    config = json.loads((preset / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (preset / "tokenizer_config.json").write_text(json.dumps(config))
    # Words only ("t17"): nothing starts `{`.
    assert "no token of" in serve.structured_problem(preset, serve.LONG_SCHEMA)


def test_a_preset_is_served_with_a_bpe_tokenizer_that_writes_json(bench, tmp_path):
    serve, throughput = bench
    preset = fake_preset(tmp_path / "preset", throughput, 2000)
    served = serve.with_bpe_tokenizer(preset)
    assert served == tmp_path / "preset-bpe"
    assert (served / "model.safetensors").resolve() == (preset / "model.safetensors").resolve()
    assert (served / "config.json").is_symlink()
    tokenizer = json.loads((served / "tokenizer.json").read_text())
    assert tokenizer["model"]["type"] == "BPE"
    assert 1000 < len(tokenizer["model"]["vocab"]) <= 2000
    for name, schema in serve.SCHEMAS.items():
        assert serve.structured_problem(served, schema) is None, name
    # Made once: a second call keeps the folder as it is.
    stamp = (served / "tokenizer.json").stat().st_mtime_ns
    assert serve.with_bpe_tokenizer(preset) == served
    assert (served / "tokenizer.json").stat().st_mtime_ns == stamp


def test_the_overhead_bench_traces_the_engine_steps(tmp_path):
    """bench/structured_overhead.py --trace: a Chrome trace per mode of the extra steps, with the engine's
    phases named, and the JSON line of the timed steps beside it."""
    import subprocess

    trace = tmp_path / "traces"
    args = [
        "--schema",
        "records",
        "--num-seqs",
        "4",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--modes",
        "json_schema",
        "--trace-steps",
        "2",
    ]
    done = subprocess.run(
        [sys.executable, str(BENCH / "structured_overhead.py"), *args, "--trace", str(trace)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["mode"] == "json_schema" and line["step_wall_ms"] > 0
    events = json.loads((trace / "structured-overhead-json_schema.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"LLMEngine.step", "schedule", "launch", "process"} <= names
    assert sum(e.get("name") == "LLMEngine.step" for e in events) == 2


def test_rounds_give_each_ratio_and_their_median_and_spread(bench):
    """bench/serve.py --structured --rounds N: each round's constrained line carries its ratio to the
    plain line of the same round; the summary gives all of them, their median and spread."""
    serve, _ = bench
    lines = []
    for plain, constrained in ((100.0, 80.0), (200.0, 170.0), (100.0, 90.0)):
        lines.append({"mode": "plain", "output_throughput_tok_s": plain})
        lines.append(
            {
                "mode": "json_schema",
                "output_throughput_tok_s": constrained,
                "structured_vs_plain_output_throughput": round(constrained / plain, 3),
            }
        )
    assert serve.structured_summary(lines) == {
        "structured_vs_plain_ratios": [0.8, 0.85, 0.9],
        "structured_vs_plain_median": 0.85,
        "structured_vs_plain_spread": 0.1,
    }
    assert serve.structured_summary([{"mode": "plain", "output_throughput_tok_s": 0.0}]) is None


def test_the_fill_bench_times_the_split_fill_against_xgrammars_pool(bench, tiny_model_dir, capsys):
    """bench/grammar_fill.py, on the demo model's tokenizer: one line with the baseline (xgrammar's pool)
    and the grammar process's split fill for each thread count, and one thread's."""
    import grammar_fill

    assert (
        grammar_fill.main(
            ["--model", str(tiny_model_dir), "--rows", "6", "--threads", "2", "3", "--repeats", "3"]
        )
        == 0
    )
    line = json.loads(capsys.readouterr().out)
    assert line["bench"] == "grammar_fill" and line["rows"] == 6
    for key in ("one_thread_ms", "xgrammar_pool_2_ms", "split_2_ms", "xgrammar_pool_3_ms", "split_3_ms"):
        assert line[key] > 0, key
