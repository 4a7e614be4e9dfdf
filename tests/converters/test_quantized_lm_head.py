"""The opt-in quantized lm_head of int8/fp8 artifacts: what the converter writes (only when asked, tied and
untied checkpoints), and what the engine loads and computes from it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from modelfleet.converters.checkpoint import EMBEDDINGS, LM_HEAD, read_checkpoint, write_torch
from modelfleet.dataplane import LLM, SamplingParams
from modelfleet.dataplane.attention import AttentionMetadata
from modelfleet.dataplane.models import ConfigError, ModelConfig, load_model
from modelfleet.dataplane.quantization import FP8_DTYPE, QuantizedLinear, dequantize, fp8_supported, quantize
from safetensors.torch import load_file, save_file

from tests.converters.test_convert import run_convert

QUANT_CONFIG = {"quant_method": "modelfleet", "format": "int8", "group": "per-channel"}
PROMPTS = [[5, 17, 42, 9, 100, 7], [300, 2, 2, 64], [11, 12, 13, 14, 15, 16, 17, 18]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tied_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny demo model with tied embeddings: no lm_head.weight, config says tied."""
    out = tmp_path_factory.mktemp("tied")
    for path in tiny_model_dir.iterdir():
        if path.is_file() and path.name not in ("model.safetensors", "config.json"):
            (out / path.name).write_bytes(path.read_bytes())
    state = load_file(tiny_model_dir / "model.safetensors")
    del state[LM_HEAD]
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    return out


@pytest.fixture(scope="module")
def sources(tiny_model_dir, tied_model_dir) -> dict[str, Path]:
    return {"untied": tiny_model_dir, "tied": tied_model_dir}


def convert(source: Path, out: Path, fmt: str = "int8", **options) -> Path:
    out.mkdir(parents=True)
    write_torch(read_checkpoint(source), out, dtype="bf16", quant=fmt, serving_dtype="bf16", **options)
    return out


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_lm_head_is_quantized_only_when_asked(sources, kind, tmp_path):
    source = load_file(sources[kind] / "model.safetensors")
    off = load_file(convert(sources[kind], tmp_path / "off") / "model.safetensors")
    on = load_file(convert(sources[kind], tmp_path / "on", quantize_lm_head=True) / "model.safetensors")
    assert LM_HEAD + "_scale" not in off
    assert (LM_HEAD in off) == (kind == "untied") and (
        LM_HEAD not in off or off[LM_HEAD].dtype == torch.bfloat16
    )
    assert set(on) == set(off) | {LM_HEAD, LM_HEAD + "_scale"}
    assert on[LM_HEAD].dtype == torch.int8 and on[LM_HEAD + "_scale"].dtype == torch.float32
    # Per vocabulary row, from the head the source computes with (the embeddings when tied).
    head = source[LM_HEAD if kind == "untied" else EMBEDDINGS]
    assert on[LM_HEAD].shape == head.shape and on[LM_HEAD + "_scale"].shape == (head.shape[0],)
    scale = on[LM_HEAD + "_scale"]
    assert ((dequantize(on[LM_HEAD], scale) - head.float()).abs() <= scale[:, None] / 2 + 1e-7).all()
    assert on[EMBEDDINGS].dtype == torch.bfloat16  # the embedding gather stays float
    for name in set(off) - {LM_HEAD}:  # every other tensor as without the option
        assert torch.equal(on[name].view(torch.uint8), off[name].view(torch.uint8)), name
    on_config = json.loads((tmp_path / "on" / "config.json").read_text())
    off_config = json.loads((tmp_path / "off" / "config.json").read_text())
    assert off_config["quantization_config"] == QUANT_CONFIG
    assert on_config["quantization_config"] == {**QUANT_CONFIG, "lm_head": True}
    assert on_config["tie_word_embeddings"] == (kind == "tied")  # the source's fact, kept


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_the_option_off_writes_todays_artifact_byte_for_byte(sources, kind, tmp_path):
    """Without the option: the quantized projections, every other tensor in bf16, lm_head untouched."""
    out = convert(sources[kind], tmp_path / "off")
    expected = {}
    for name, tensor in load_file(sources[kind] / "model.safetensors").items():
        if name.endswith("proj.weight"):
            expected[name], expected[name + "_scale"] = quantize(tensor, "int8")
        else:
            expected[name] = tensor.to(torch.bfloat16)
    save_file(expected, tmp_path / "expected.safetensors", metadata={"format": "pt"})
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "expected.safetensors").read_bytes()


def test_a_tied_checkpoints_lm_head_copy_is_replaced_by_the_embeddings(tied_model_dir, tmp_path):
    """Some tied checkpoints carry lm_head.weight: the head the model computes with is the embeddings."""
    source = tmp_path / "src"
    source.mkdir()
    for path in tied_model_dir.iterdir():
        (source / path.name).write_bytes(path.read_bytes())
    state = load_file(tied_model_dir / "model.safetensors")
    save_file({**state, LM_HEAD: torch.zeros_like(state[EMBEDDINGS])}, source / "model.safetensors")
    out = load_file(convert(source, tmp_path / "on", quantize_lm_head=True) / "model.safetensors")
    q, scale = quantize(state[EMBEDDINGS], "int8")
    assert torch.equal(out[LM_HEAD], q) and torch.equal(out[LM_HEAD + "_scale"], scale)


def test_the_option_needs_a_quantized_target(tiny_model_dir, tmp_path, capsys):
    code, summary, err = run_convert(
        capsys, "--source", str(tiny_model_dir), "--target", "cpu", "--dtype", "bf16",
        "--quantize-lm-head", "--out", str(tmp_path / "bf16"),
    )  # fmt: skip
    assert code == 2 and summary["ok"] is False
    assert "--quantize-lm-head applies to torch int8/fp8 targets, not torch bf16" in err
    assert not (tmp_path / "bf16").exists()


def test_convert_validates_and_records_the_quantized_head(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "a100-int8-head"
    code, summary, _ = run_convert(
        capsys, "--source", str(tiny_model_dir), "--target", "nvidia-a100", "--dtype", "int8",
        "--quantize-lm-head", "--out", str(out),
    )  # fmt: skip
    assert code == 0, summary
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["quantization"] == {
        "format": "int8", "group": "per-channel", "symmetric": True, "lmHead": True,
    }  # fmt: skip
    validation = manifest["validation"]
    assert validation["passed"] and validation["method"] == "quantized-kernels"
    assert validation["rule"] == "relative-to-bf16"
    # A retry without the option is another artifact, not "already published".
    code, summary, _ = run_convert(
        capsys, "--source", str(tiny_model_dir), "--target", "nvidia-a100", "--dtype", "int8",
        "--out", str(out),
    )  # fmt: skip
    assert code == 2 and "is not empty" in summary["reason"]


def test_a_bad_lm_head_setting_is_named():
    raw = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 1, "max_position_embeddings": 64,
        "quantization_config": {**QUANT_CONFIG, "lm_head": "yes"},
    }  # fmt: skip
    with pytest.raises(ConfigError, match="quantization_config lm_head='yes': must be true or false"):
        ModelConfig.from_hf_dict(raw)


def prefill_logits(model_dir: Path, tokens: list[int]) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """(model, final hidden states, logits) of one prompt, run by the engine's model on the CPU."""
    model = load_model(model_dir, device="cpu", dtype=torch.bfloat16)
    cfg = model.config
    n = len(tokens)
    kv = [
        torch.zeros(2, 4, 4, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16)
        for _ in range(cfg.num_layers)
    ]
    meta = AttentionMetadata.build(query_lens=[n], seq_lens=[n], block_tables=[[0, 1, 2, 3]], block_size=4)
    with torch.inference_mode():
        hidden = model(torch.tensor(tokens), torch.arange(n), kv, meta)
        return model, hidden, model.compute_logits(hidden)


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_the_engine_runs_the_quantized_head(sources, kind, tmp_path):
    plain = convert(sources[kind], tmp_path / "off")
    headq = convert(sources[kind], tmp_path / "on", quantize_lm_head=True)
    _, _, reference = prefill_logits(plain, PROMPTS[2])
    model, hidden, logits = prefill_logits(headq, PROMPTS[2])
    head = model.lm_head
    assert isinstance(head, QuantizedLinear) and head.weight.dtype == torch.int8
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    # The logits are the hidden states times the dequantized head ...
    state = load_file(headq / "model.safetensors")
    expected = hidden.float() @ dequantize(state[LM_HEAD], state[LM_HEAD + "_scale"]).t()
    torch.testing.assert_close(logits, expected, atol=0.02 * expected.abs().max().item(), rtol=0)
    # ... and close to the bf16 head's: int8 per-row error is a small part of the logits' spread.
    assert (logits - reference).abs().max() < 0.05 * (reference.amax() - reference.amin())
    # Greedy decoding gives the bf16 head's tokens.
    tokens = {}
    for name, folder in (("plain", plain), ("headq", headq)):
        llm = LLM(folder, max_model_len=64, kv_cache_bytes=1 << 20, dtype="bfloat16", device="cpu")
        tokens[name] = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
    assert tokens["headq"] == tokens["plain"]


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_the_benchmarks_quantized_artifact_has_the_same_head(sources, kind, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "bench"))
    sys.modules.pop("throughput", None)
    from throughput import quantized_artifact

    converted = load_file(
        convert(sources[kind], tmp_path / "conv", quantize_lm_head=True) / "model.safetensors"
    )
    bench = Path(quantized_artifact(sources[kind], "int8", tmp_path / "bench", lm_head=True))
    got = load_file(bench / "model.safetensors")
    assert sorted(got) == sorted(converted)
    assert torch.equal(got[LM_HEAD], converted[LM_HEAD])
    assert torch.equal(got[LM_HEAD + "_scale"], converted[LM_HEAD + "_scale"])
    config = json.loads((bench / "config.json").read_text())
    assert config["quantization_config"] == {**QUANT_CONFIG, "lm_head": True}
    # A cached artifact without the head is not reused for one with it.
    plain = Path(quantized_artifact(sources[kind], "int8", tmp_path / "plain"))
    assert quantized_artifact(sources[kind], "int8", plain, lm_head=True) == str(plain)
    assert LM_HEAD + "_scale" in load_file(plain / "model.safetensors")


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and fp8_supported("cuda")),
    reason="needs a CUDA GPU with compute capability >= 8.9 (L4, H100, H200)",
)
@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_the_engine_runs_an_fp8_head_on_cuda(sources, kind, tmp_path):
    headq = convert(sources[kind], tmp_path / "on", "fp8", quantize_lm_head=True)
    model = load_model(headq, device="cuda", dtype=torch.bfloat16)
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.weight.dtype == FP8_DTYPE
    state = load_file(headq / "model.safetensors")
    weight = dequantize(state[LM_HEAD], state[LM_HEAD + "_scale"]).cuda()
    for rows in (1, 3, 40):  # the decode GEMV and the fp8 matmul
        hidden = torch.randn(rows, weight.shape[1], device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            logits = model.compute_logits(hidden)
        expected = hidden.float() @ weight.t()
        assert (logits - expected).abs().max() < 0.08 * expected.abs().max()


@pytest.mark.skipif(fp8_supported("cuda"), reason="this host runs fp8 kernels; the case is a host without")
def test_validating_fp8_without_fp8_keeps_a_tied_models_embeddings(tied_model_dir, tmp_path, monkeypatch):
    """Without fp8 hardware validation dequantizes the weights into the source model: a tied head's
    dequantized copy must become the head alone, not the embeddings it was tied to."""
    from modelfleet.converters import candidates

    headq = convert(tied_model_dir, tmp_path / "on", "fp8", quantize_lm_head=True)
    models = []
    monkeypatch.setattr(candidates, "hf_logits_fn", models.append)
    _, how = candidates.quantized_candidate(headq, tied_model_dir, "fp8", "bf16")
    assert how["method"] == "dequantized-weights"
    state = load_file(headq / "model.safetensors")
    model = models[0]
    assert torch.equal(model.model.embed_tokens.weight, state[EMBEDDINGS])
    head = dequantize(state[LM_HEAD], state[LM_HEAD + "_scale"], torch.bfloat16)
    assert torch.equal(model.lm_head.weight, head) and not torch.equal(head, state[EMBEDDINGS])
