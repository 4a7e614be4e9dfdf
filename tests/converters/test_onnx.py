"""ONNX artifacts (float32 and onnxruntime int8), the data plane's onnxruntime runner and the engine on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from modelfleet.converters.convert import Request, convert
from modelfleet.dataplane import LLM, SamplingParams
from modelfleet.dataplane.onnx_engine import graph_engine
from modelfleet.dataplane.onnx_runner import OnnxRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

MODELFLEET = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "modelfleet"


@pytest.fixture(scope="module")
def onnx_fp32(tiny_model_dir, convert_cache, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("onnx") / "cpu-onnx-fp32"
    summary = convert(
        Request(str(tiny_model_dir), "cpu", out, format="onnx", dtype="fp32", cache_dir=convert_cache)
    )
    return out, summary


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def test_fp32_export_interface_and_validation(onnx_fp32):
    out, summary = onnx_fp32
    assert {"model.onnx", "model.onnx.data", "config.json", "tokenizer.json", "manifest.json"} <= {
        p.name for p in out.iterdir()
    }
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 18
    inputs = {
        i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input
    }
    outputs = {
        o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output
    }
    assert inputs["input_ids"] == ["batch", "sequence"]
    assert inputs["attention_mask"] == ["batch", "total_sequence"]
    assert inputs["past_key_values.1.value"] == ["batch", 2, "past_sequence", 16]
    assert outputs["logits"] == ["batch", "sequence", 512]
    assert outputs["present.1.key"] == ["batch", 2, "past_sequence + sequence", 16]
    # Every weight matrix lives in the external data file, not in the graph.
    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert len(external) >= 2 * 7 + 2  # 7 projections per layer, embeddings and lm_head
    external_bytes = sum(int(np.prod(t.dims)) * 4 for t in external)
    assert (
        0.9 * (out / "model.onnx.data").stat().st_size
        <= external_bytes
        <= (out / "model.onnx.data").stat().st_size
    )
    v = summary["validation"]
    assert summary["ok"] and v["passed"] and v["top1Agreement"] == 1.0 and v["maxAbsLogitDiff"] < 1e-4


def test_int8_through_the_cli(tiny_model_dir, convert_cache, onnx_fp32, tmp_path):
    out = tmp_path / "cpu-onnx-int8"
    log = tmp_path / "termination-log"
    command = [str(MODELFLEET)] if MODELFLEET.exists() else [sys.executable, "-m", "modelfleet.cli"]
    done = subprocess.run(
        [*command, "convert", "--source", tiny_model_dir.as_uri(), "--target", "cpu", "--dtype", "int8",
         "--out", str(out), "--cache-dir", str(convert_cache), "--termination-log", str(log)],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert json.loads(log.read_text()) == summary
    assert (summary["format"], summary["dtype"]) == ("onnx", "int8")  # cpu int8 defaults to onnxruntime
    assert summary["validation"]["passed"] and summary["validation"]["top1Agreement"] >= 0.85
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= {n.op_type for n in graph.node}
    # the output projection stays float (as the torch artifacts' lm_head does by default)
    (head,) = [n for n in graph.node if "logits" in n.output]
    assert head.op_type == "MatMul", head.op_type
    fp32_dir, _ = onnx_fp32
    assert (out / "model.onnx.data").stat().st_size < 0.6 * (fp32_dir / "model.onnx.data").stat().st_size


def test_runner_logits_match_transformers_through_the_cache(onnx_fp32, hf_model):
    runner = OnnxRunner(onnx_fp32[0])
    ids = [0, 44, 318, 97, 250, 11, 400, 3, 77]
    with torch.no_grad():
        reference = hf_model(torch.tensor([ids])).logits[0].numpy()
    for split in (0, 1, 5, len(ids) - 1):
        np.testing.assert_allclose(runner.logits(ids, split=split), reference, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def onnx_llm(onnx_fp32) -> LLM:
    """The engine's request loop over the runner: what a server runs for an ONNX artifact."""
    return LLM(graph_engine(onnx_fp32[0], OnnxRunner))


def test_greedy_generation_matches_transformers(onnx_llm, hf_model, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = ["The scheduler batches", "A canary release is a cautious experiment with many words in it"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    batched = onnx_llm.generate(prompts, params)
    for prompt, result in zip(prompts, batched, strict=True):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected = hf_model.generate(
            ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert result.token_ids == expected[0, ids.shape[1] :].tolist()
        assert result.finish_reason == "length" and len(result.token_ids) == 8
        assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
        # Padding in a batch changes nothing: the same prompt alone gives the same tokens.
        assert onnx_llm.generate([prompt], params)[0].token_ids == result.token_ids


def test_sampling_is_seeded_and_arguments_checked(onnx_llm, onnx_fp32):
    prompt = [[0, 44, 318, 97]]

    def sample(**params) -> list[int]:
        return onnx_llm.generate(prompt, SamplingParams(max_tokens=12, **params))[0].token_ids

    first = sample(temperature=1.0, top_p=0.9, top_k=50, seed=7)
    again = sample(temperature=1.0, top_p=0.9, top_k=50, seed=7)
    other = sample(temperature=1.0, seed=8)
    assert first == again
    assert first != other
    with pytest.raises(ValueError, match="max_tokens: 0 must be an integer >= 1"):
        onnx_llm.generate(prompt, SamplingParams(max_tokens=0))
    with pytest.raises(FileNotFoundError, match=r"has no model\.onnx"):
        OnnxRunner(onnx_fp32[0].parent)


def test_generation_stops_at_eos(onnx_fp32):
    llm = LLM(graph_engine(onnx_fp32[0], OnnxRunner))
    # Make every token an end token: generation must stop after the first one.
    llm.engine.eos_token_ids = frozenset(range(llm.engine.vocab_size))
    result = llm.generate([[0, 44, 318]], SamplingParams(max_tokens=5))[0]
    assert result.finish_reason == "stop" and len(result.token_ids) == 1
