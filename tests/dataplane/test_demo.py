"""The demo model: a Llama checkpoint transformers loads offline, deterministic by seed, atomic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from modelfleet.dataplane.demo import SIZES, create_demo_model, train_tokenizer
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

MODELFLEET = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "modelfleet"
HF_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How is the cache split?"}]


def load_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is no mapping)


def test_tiny_loads_in_transformers_offline(tiny_model_dir):
    assert {p.name for p in tiny_model_dir.iterdir()} == HF_FILES
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert model.config.architectures == ["LlamaForCausalLM"]
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query attention
    assert model.config.max_position_embeddings == 2048
    num_params = sum(p.numel() for p in model.parameters())
    assert 50_000 < num_params < 1_000_000
    assert len(tokenizer) == model.config.vocab_size == 512

    ids = tokenizer("The scheduler batches requests.").input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "The scheduler batches requests."
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    # Logits spread over a few units, not collapsed: greedy decoding is well defined.
    assert torch.isfinite(logits).all()
    assert 0.3 < logits.std().item() < 5.0


def test_special_tokens_and_chat_template(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer.bos_token == "<|begin_of_text|>"
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|pad|>"
    assert len({tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}) == 3

    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHow is the cache split?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # special, never split

    config = json.loads((tiny_model_dir / "config.json").read_text())
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert tokenizer.eos_token_id in config["eos_token_id"]
    assert generation["eos_token_id"] == config["eos_token_id"]
    assert config["bos_token_id"] == tokenizer.bos_token_id


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path, tiny_model_dir):
    again = create_demo_model(tmp_path / "again", seed=0)
    other = create_demo_model(tmp_path / "other", seed=1)
    for name in HF_FILES:
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    # A second version: the same tokenizer and config, different weights.
    for name in HF_FILES - {"model.safetensors"}:
        assert (other / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    base, changed = load_tensors(tiny_model_dir), load_tensors(other)
    assert base.keys() == changed.keys()
    assert not torch.equal(
        base["model.layers.0.self_attn.q_proj.weight"], changed["model.layers.0.self_attn.q_proj.weight"]
    )
    assert torch.equal(base["model.norm.weight"], changed["model.norm.weight"])


def test_non_empty_folder_is_refused_unless_forced(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("someone else's file")
    with pytest.raises(FileExistsError, match="is not empty; choose an empty folder or pass force=True"):
        create_demo_model(out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]

    create_demo_model(out, force=True)
    assert {p.name for p in out.iterdir()} == HF_FILES
    # Nothing left behind by the staging folder or the replaced one.
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_empty_folder_is_accepted_and_bad_arguments_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    assert {p.name for p in create_demo_model(tmp_path / "empty").iterdir()} == HF_FILES
    with pytest.raises(ValueError, match="size 'huge' is unknown; use one of: tiny, small"):
        create_demo_model(tmp_path / "x", size="huge")
    with pytest.raises(ValueError, match="seed -1 is negative"):
        create_demo_model(tmp_path / "x", seed=-1)
    assert not (tmp_path / "x").exists()


def test_train_tokenizer_writes_only_tokenizer_files(tmp_path):
    tokenizer = train_tokenizer(tmp_path / "tok", vocab_size=600)
    assert {p.name for p in (tmp_path / "tok").iterdir()} == {"tokenizer.json", "tokenizer_config.json"}
    assert tokenizer.get_vocab_size() == 600
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert (
        loaded.decode(loaded("Quantization trades accuracy").input_ids[1:]) == "Quantization trades accuracy"
    )
    with pytest.raises(ValueError, match="vocab_size 100 is too small"):
        train_tokenizer(tmp_path / "bad", vocab_size=100)


def test_cli_round_trip(tmp_path):
    out = tmp_path / "cli-model"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [str(MODELFLEET)] if MODELFLEET.exists() else [sys.executable, "-m", "modelfleet.cli"]
    done = subprocess.run(
        [*command, "demo", "create", str(out), "--seed", "3"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "wrote tiny demo model (seed 3)" in done.stdout
    assert {p.name for p in out.iterdir()} == HF_FILES

    again = subprocess.run([*command, "demo", "create", str(out)], capture_output=True, text=True, env=env)
    assert again.returncode == 2
    assert again.stderr.strip().count("\n") == 0
    assert again.stderr.startswith("error: ") and "--force" in again.stderr
    assert load_tensors(out).keys() == load_tensors(create_demo_model(tmp_path / "api", seed=3)).keys()
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "api" / "model.safetensors").read_bytes()


def test_small_is_about_100m_parameters_and_quick(tmp_path):
    started = time.monotonic()
    out = create_demo_model(tmp_path / "small", size="small", seed=0)
    elapsed = time.monotonic() - started
    config = json.loads((out / "config.json").read_text())
    tensors = load_tensors(out)
    num_params = sum(t.numel() for t in tensors.values())
    assert 90e6 < num_params < 110e6
    assert config["vocab_size"] == tensors["model.embed_tokens.weight"].shape[0] > 1000
    assert config["num_hidden_layers"] == 12 and config["num_key_value_heads"] < config["num_attention_heads"]
    assert all(t.dtype == SIZES["small"].dtype for t in tensors.values())
    assert elapsed < 30, f"creating the small model took {elapsed:.1f}s"
