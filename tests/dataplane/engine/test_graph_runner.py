"""The engine's request loop over an exported graph (GraphRunner), with a fake graph whose next token is
known: batches of sequences with different cached lengths, chunked prefills and preemption all have to
keep each sequence's cache exactly its own tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest
from modelfleet.dataplane import LLM, SamplingParams
from modelfleet.dataplane.onnx_engine import graph_engine

VOCAB = 32


class SumGraph:
    """The next token is the sum of (token + 1) over the sequence so far, modulo VOCAB. The cache holds
    the tokens themselves as keys (and values), so a wrong or misaligned cache, or a padding position
    the mask lets through, changes the tokens."""

    device = "cpu"
    num_layers, num_kv_heads, head_dim = 1, 1, 1

    def __init__(self, model_dir: str) -> None:
        self.calls: list[tuple[int, int]] = []  # (batch, new tokens) of each forward

    def empty_cache(self, batch: int) -> list[np.ndarray]:
        return [np.zeros((batch, 1, 0, 1), dtype=np.float32) for _ in range(2)]

    def forward(self, input_ids, attention_mask, cache):
        self.calls.append(input_ids.shape)
        new = input_ids[:, None, :, None].astype(np.float32)
        present = [np.concatenate([layer, new], axis=2) for layer in cache]
        tokens = (present[0][:, 0, :, 0] + 1) * attention_mask
        sums = np.cumsum(tokens, axis=1)[:, -input_ids.shape[1] :].astype(np.int64) % VOCAB
        logits = np.full((*input_ids.shape, VOCAB), -10.0, dtype=np.float32)
        np.put_along_axis(logits, sums[..., None], 10.0, axis=-1)
        return logits, present


def expected(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(sum(t + 1 for t in tokens) % VOCAB)
    return tokens[len(prompt) :]


@pytest.fixture
def model_dir(tmp_path):
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 1,
        "max_position_embeddings": 64,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_batched_chunked_and_preempted_sequences_keep_their_own_cache(model_dir):
    # Blocks of 4 tokens, 6 of them: three requests of 20 tokens cannot all stay, so some are preempted
    # and recomputed; 5 tokens per step split the prompts into chunks.
    engine = graph_engine(
        model_dir, SumGraph, block_size=4, kv_cache_bytes=6 * 32, max_num_batched_tokens=5, max_num_seqs=3
    )
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2], [1, 1, 2, 3, 5, 8, 13]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = LLM(engine).generate(prompts, params)
    assert [o.token_ids for o in outputs] == [expected(p, 10) for p in prompts]
    assert engine.stats().num_preemptions > 0
    assert any(batch > 1 for batch, _ in engine.runner.graph.calls)  # decodes of different lengths batched
    assert engine.stats().kv_cache_usage == 0.0


def test_graph_engines_run_without_prefix_caching(model_dir):
    from modelfleet.dataplane.config import EngineConfig
    from modelfleet.dataplane.engine.graph_runner import GraphRunner

    with pytest.raises(ValueError, match="enable_prefix_caching"):
        GraphRunner(EngineConfig(str(model_dir)), 64, graph_class=SumGraph)
    assert graph_engine(model_dir, SumGraph).config.enable_prefix_caching is False


@pytest.mark.gpu
def test_tensorrt_engine_matches_the_torch_engine(tiny_model_dir, tmp_path):
    pytest.importorskip("tensorrt")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from modelfleet.converters.convert import Request, convert
    from modelfleet.dataplane.tensorrt_engine import TensorRTRunner

    out = tmp_path / "nvidia-h100-tensorrt-fp32"
    request = Request(str(tiny_model_dir), "nvidia-h100", out, format="tensorrt", dtype="fp32")
    assert convert(request)["ok"]
    prompts = ["The scheduler batches", "A canary release is a cautious experiment with many words in it"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ours = LLM(graph_engine(out, TensorRTRunner))
    assert ours.engine.runner.sampler.fused  # the logits stay on the GPU for the sampling kernel
    want = LLM(tiny_model_dir, device="cpu", dtype="float32").generate(prompts, params)
    assert [o.token_ids for o in ours.generate(prompts, params)] == [o.token_ids for o in want]
