"""Every architecture the engine serves converts: a tiny random checkpoint of each, written by transformers,
goes through `convert` for the cpu target (validated against transformers) and the published artifact
loads in the engine; the ONNX export takes its biases and norms from the engine's model configuration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from modelfleet.converters.checkpoint import read_checkpoint
from modelfleet.converters.convert import Request, convert
from modelfleet.converters.errors import BadInputError
from modelfleet.converters.onnx_export import build_module
from modelfleet.dataplane import LLM
from modelfleet.dataplane.models.config import SUPPORTED_ARCHITECTURES
from modelfleet.dataplane.sampling_params import SamplingParams
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

MODEL_TYPES = {arch: model_type for model_type, arch in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}
PROMPT = [3, 17, 42, 99, 7, 5]


def tiny_checkpoint(root: Path, architecture: str, **extra) -> Path:
    """A random float32 checkpoint of `architecture` as transformers saves it (no tokenizer)."""
    config = transformers.AutoConfig.for_model(
        MODEL_TYPES[architecture],
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2,
        tie_word_embeddings=False, sliding_window=None,
    )  # fmt: skip
    torch.manual_seed(0)
    out = root / architecture
    model = getattr(transformers, architecture)._from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    if extra:  # keys transformers ignores for this architecture, as some published configs carry them
        path = out / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **extra}))
    return out


@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
def test_every_served_architecture_converts_for_cpu_and_the_engine_loads_it(architecture, tmp_path):
    source = tiny_checkpoint(tmp_path, architecture)
    out = tmp_path / "artifact"
    summary = convert(Request(str(source), "cpu", out, cache_dir=tmp_path / "cache"))
    assert summary["ok"], summary
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["architecture"] == architecture
    assert manifest["validation"]["passed"]

    # The data plane serves what was published: its greedy token is transformers' on the same weights.
    reference = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = int(reference(torch.tensor([PROMPT])).logits[0, -1].argmax())
    engine = LLM(out, dtype="float32", max_model_len=64, kv_cache_bytes=1 << 20, max_num_seqs=2)
    (output,) = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1))
    assert output.token_ids == [expected]


@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
def test_onnx_module_matches_transformers_for_every_architecture(architecture, tmp_path):
    # Mistral has no biases whatever `attention_bias` says: the engine's rule, now the export's too.
    extra = {"attention_bias": True} if architecture == "MistralForCausalLM" else {}
    source = tiny_checkpoint(tmp_path, architecture, **extra)
    module = build_module(read_checkpoint(source), torch.float32)
    reference = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    layers = reference.config.num_hidden_layers
    empty = [torch.zeros(1, 2, 0, 16) for _ in range(2 * layers)]
    with torch.no_grad():
        logits = module(ids, torch.ones_like(ids), torch.arange(len(PROMPT))[None], *empty)[0]
        expected = reference(ids).logits
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_a_config_the_engine_cannot_load_is_refused_before_conversion(tmp_path):
    source = tiny_checkpoint(tmp_path, "LlamaForCausalLM")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(BadInputError, match="hidden_act='gelu'"):
        read_checkpoint(source)
