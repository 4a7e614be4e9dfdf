"""config.json parsing, checkpoint checks and their one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_checkpoints import make_checkpoint
from modelfleet.dataplane.attention import AttentionMetadata
from modelfleet.dataplane.models import (
    SUPPORTED_ARCHITECTURES,
    CheckpointError,
    ConfigError,
    ModelConfig,
    QuantizationError,
    UnsupportedModelError,
    kv_cache_block_bytes,
    load_model,
)
from modelfleet.dataplane.quantization import dequantize, quantize
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    model_dir, _ = make_checkpoint("llama2", tmp_path_factory.mktemp("llama"))
    return model_dir


def copy_with(src: Path, dst: Path, *, tensors=None, config_updates=None) -> Path:
    """A copy of the checkpoint with its tensors and/or config.json edited."""
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config.update(config_updates or {})
    (dst / "config.json").write_text(json.dumps(config))
    state = load_file(src / "model.safetensors")
    save_file(tensors(state) if tensors else state, dst / "model.safetensors")
    return dst


def test_loaded_model_has_real_weights_on_the_device(llama_dir):
    model = load_model(llama_dir, device=torch.device("cpu"), dtype=torch.float32)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert tensor.device.type == "cpu", name
        assert not tensor.requires_grad, name
    assert model.lm_head is not None  # llama2 case is untied


def test_unknown_architecture_lists_supported(llama_dir, tmp_path):
    bad = copy_with(llama_dir, tmp_path / "bad", config_updates={"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(UnsupportedModelError) as err:
        load_model(bad, device="cpu", dtype=torch.float32)
    message = str(err.value)
    assert "GPT2LMHeadModel" in message
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in message
    assert isinstance(err.value, ValueError)


def test_missing_tensor_is_named(llama_dir, tmp_path):
    def drop(state):
        del state["model.layers.1.self_attn.k_proj.weight"]
        return state

    bad = copy_with(llama_dir, tmp_path / "bad", tensors=drop)
    with pytest.raises(
        CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.weight'"
    ):
        load_model(bad, device="cpu", dtype=torch.float32)


def test_wrong_shape_is_named(llama_dir, tmp_path):
    def shrink(state):
        state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"][:-1].clone()
        return state

    bad = copy_with(llama_dir, tmp_path / "bad", tensors=shrink)
    with pytest.raises(
        CheckpointError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \[95, 64\]"
    ):
        load_model(bad, device="cpu", dtype=torch.float32)


def test_unexpected_tensor_is_named(llama_dir, tmp_path):
    def extra(state):
        state["model.layers.0.self_attn.surprise"] = torch.zeros(3)
        return state

    bad = copy_with(llama_dir, tmp_path / "bad", tensors=extra)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.surprise'"):
        load_model(bad, device="cpu", dtype=torch.float32)


def test_config_that_disagrees_with_weights(llama_dir, tmp_path):
    bad = copy_with(llama_dir, tmp_path / "bad", config_updates={"num_hidden_layers": 3})
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\."):
        load_model(bad, device="cpu", dtype=torch.float32)


def test_tied_checkpoint_with_a_copy_of_lm_head_loads(tmp_path):
    model_dir, _ = make_checkpoint("qwen2", tmp_path / "q")

    def add_head(state):
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
        return state

    copy = copy_with(model_dir, tmp_path / "copy", tensors=add_head)
    model = load_model(copy, device="cpu", dtype=torch.float32)
    assert model.lm_head is None and model.config.qkv_bias


def test_sharded_checkpoint_with_index(llama_dir, tmp_path):
    out = tmp_path / "sharded"
    out.mkdir()
    (out / "config.json").write_text((llama_dir / "config.json").read_text())
    state = load_file(llama_dir / "model.safetensors")
    names = sorted(state)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: state[n] for n in shard_names}, out / shard)
        weight_map.update(dict.fromkeys(shard_names, shard))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = load_model(out, device="cpu", dtype=torch.float32)
    assert torch.equal(model.model.norm.weight, state["model.norm.weight"])


def test_no_safetensors_is_refused(llama_dir, tmp_path):
    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files"):
        load_model(tmp_path, device="cpu", dtype=torch.float32)


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError, match=r"config\.json: not found"):
        load_model(tmp_path, device="cpu", dtype=torch.float32)


QUANTIZED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INT8 = {"quantization_config": {"quant_method": "modelfleet", "format": "int8", "group": "per-channel"}}


def quantize_state(state: dict, fmt: str) -> dict:
    """The converters' checkpoint format: X.weight int8/fp8 plus X.weight_scale float32 [out]."""
    out = {}
    for name, tensor in state.items():
        if name.rpartition(".")[0].endswith(QUANTIZED_PROJECTIONS) and name.endswith(".weight"):
            out[name], out[name + "_scale"] = quantize(tensor, fmt)
        else:
            out[name] = tensor
    return out


def test_int8_checkpoint_matches_hf_with_dequantized_weights(tmp_path):
    model_dir, hf_model = make_checkpoint("qwen2", tmp_path / "src")  # qkv bias and tied embeddings
    quantized = copy_with(
        model_dir, tmp_path / "int8", tensors=lambda s: quantize_state(s, "int8"), config_updates=INT8
    )
    ours = load_model(quantized, device="cpu", dtype=torch.float32)
    assert ours.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.int8
    assert ours.model.layers[0].mlp.gate_up_proj.weight_scale.dtype == torch.float32
    state = load_file(quantized / "model.safetensors")
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name + "_scale" in state:
                param.copy_(dequantize(state[name], state[name + "_scale"]))
        tokens = torch.arange(3, 20)
        expected = hf_model(tokens[None]).logits[0]
    cfg = ours.config
    kv = [torch.zeros(2, 8, 4, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    meta = AttentionMetadata.build(
        query_lens=[17], seq_lens=[17], block_tables=[[4, 0, 6, 1, 2]], block_size=4
    )
    with torch.inference_mode():
        logits = ours.compute_logits(ours(tokens, torch.arange(17), kv, meta))
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=0)


def test_quantized_config_with_float_weights_is_refused(llama_dir, tmp_path):
    bad = copy_with(llama_dir, tmp_path / "q", config_updates=INT8)
    with pytest.raises(CheckpointError, match=r"weight_scale|dtype"):
        load_model(bad, device="cpu", dtype=torch.float32)


def test_fp8_checkpoint_needs_a_capable_gpu(llama_dir, tmp_path):
    fp8 = {"quantization_config": {"quant_method": "modelfleet", "format": "fp8"}}
    quantized = copy_with(
        llama_dir, tmp_path / "fp8", tensors=lambda s: quantize_state(s, "fp8"), config_updates=fp8
    )
    with pytest.raises(QuantizationError, match="fp8 weights need a CUDA GPU"):
        load_model(quantized, device="cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("update", "field"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope type 'yarn'"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
        ({"hidden_size": "big"}, "hidden_size"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quant_method"),
    ],
)
def test_bad_config_fields_are_named(llama_dir, update, field):
    raw = {**json.loads((llama_dir / "config.json").read_text()), **update}
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_dict(raw)


def test_eos_ids_merge_generation_config(llama_dir, tmp_path):
    copy = copy_with(llama_dir, tmp_path / "c", config_updates={"eos_token_id": [2, 5]})
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert ModelConfig.from_dir(copy).eos_token_ids == (7, 2, 5)


def test_mistral_window_and_qwen_sliding_layers():
    base = dict(
        vocab_size=10,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=4096,
    )
    mistral = ModelConfig.from_hf_dict(
        {**base, "architectures": ["MistralForCausalLM"], "sliding_window": 512}
    )
    assert mistral.sliding_windows == (512,) * 4
    unbounded = ModelConfig.from_hf_dict(
        {**base, "architectures": ["MistralForCausalLM"], "sliding_window": None}
    )
    assert unbounded.sliding_windows == (None,) * 4
    qwen = ModelConfig.from_hf_dict(
        {
            **base,
            "architectures": ["Qwen2ForCausalLM"],
            "sliding_window": 256,
            "use_sliding_window": True,
            "max_window_layers": 2,
        }
    )
    assert qwen.sliding_windows == (None, None, 256, 256)


def test_kv_cache_block_bytes(llama_dir):
    config = ModelConfig.from_dir(llama_dir)
    # 2 (K,V) * 2 layers * 16 tokens * 2 kv heads * 16 dims * 4 bytes
    assert kv_cache_block_bytes(config, 16, torch.float32) == 2 * 2 * 16 * 2 * 16 * 4
    assert kv_cache_block_bytes(config, 16, torch.bfloat16) == 2 * 2 * 16 * 2 * 16 * 2
