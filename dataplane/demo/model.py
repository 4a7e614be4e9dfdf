"""A Llama-architecture checkpoint with random weights, in Hugging Face layout, for tests and benchmarks."""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from modelfleet.dataplane.atomic import replace_folder
from modelfleet.dataplane.demo.tokenizer import BOS, EOS, IM_END, PAD, build_tokenizer, write_tokenizer_files
from safetensors.torch import save_file


@dataclass(frozen=True)
class DemoSize:
    vocab_size: int  # asked of the tokenizer trainer; the config gets the size it really reached
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: torch.dtype


SIZES: dict[str, DemoSize] = {
    # ~0.16M parameters: fast enough for every test.
    "tiny": DemoSize(512, 64, 192, 2, 4, 2, 2048, False, torch.float32),
    # ~100M parameters (the corpus yields a ~2.2k vocabulary), bf16 like published checkpoints.
    "small": DemoSize(8192, 768, 2880, 12, 12, 4, 2048, True, torch.bfloat16),
}

INIT_STD = 0.02
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def llama_config(size: DemoSize, vocab_size: int, special_ids: dict[str, int]) -> dict:
    head_dim = size.hidden_size // size.num_heads
    rope_theta = 10000.0
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_hidden_layers": size.num_layers,
        "num_attention_heads": size.num_heads,
        "num_key_value_heads": size.num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": size.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        # Both spellings: older transformers read rope_theta, newer ones rope_parameters.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": size.tie_word_embeddings,
        "bos_token_id": special_ids[BOS],
        "eos_token_id": [special_ids[IM_END], special_ids[EOS]],
        "pad_token_id": special_ids[PAD],
        "initializer_range": INIT_STD,
        "torch_dtype": _DTYPE_NAMES[size.dtype],
        "use_cache": True,
    }


def generation_config(special_ids: dict[str, int]) -> dict:
    return {
        "bos_token_id": special_ids[BOS],
        "eos_token_id": [special_ids[IM_END], special_ids[EOS]],
        "pad_token_id": special_ids[PAD],
        "do_sample": False,
    }


def weight_shapes(size: DemoSize, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, in Hugging Face Llama names, in a fixed order (the seed's order)."""
    hidden, inter, head_dim = size.hidden_size, size.intermediate_size, size.hidden_size // size.num_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, hidden)}
    for i in range(size.num_layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
        shapes[f"{p}.self_attn.q_proj.weight"] = (size.num_heads * head_dim, hidden)
        shapes[f"{p}.self_attn.k_proj.weight"] = (size.num_kv_heads * head_dim, hidden)
        shapes[f"{p}.self_attn.v_proj.weight"] = (size.num_kv_heads * head_dim, hidden)
        shapes[f"{p}.self_attn.o_proj.weight"] = (hidden, size.num_heads * head_dim)
        shapes[f"{p}.post_attention_layernorm.weight"] = (hidden,)
        shapes[f"{p}.mlp.gate_proj.weight"] = (inter, hidden)
        shapes[f"{p}.mlp.up_proj.weight"] = (inter, hidden)
        shapes[f"{p}.mlp.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    if not size.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab_size, hidden)
    return shapes


def random_weights(size: DemoSize, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """Norms at one; matrices normal(0, 0.02); embeddings and lm_head at 1/sqrt(hidden) so the logits spread
    over a few units instead of all sitting near zero. One tensor at a time, cast as it is made."""
    generator = torch.Generator().manual_seed(seed)
    embed_std = size.hidden_size**-0.5
    weights = {}
    for name, shape in weight_shapes(size, vocab_size).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=size.dtype)
            continue
        std = embed_std if name in ("model.embed_tokens.weight", "lm_head.weight") else INIT_STD
        weights[name] = torch.randn(shape, generator=generator).mul_(std).to(size.dtype)
    return weights


def _check_destination(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a folder; choose another output folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} is not empty; choose an empty folder or pass force=True (--force)")


def create_demo_model(out_dir: str | Path, *, size: str = "tiny", seed: int = 0, force: bool = False) -> Path:
    """Write a random-weight Llama checkpoint with its tokenizer into out_dir and return the folder.

    The tokenizer does not depend on the seed, so two seeds give two interchangeable versions of one model.
    """
    if size not in SIZES:
        raise ValueError(f"size {size!r} is unknown; use one of: {', '.join(SIZES)}")
    if seed < 0:
        raise ValueError(f"seed {seed} is negative; use a seed >= 0")
    preset = SIZES[size]
    out = Path(out_dir).absolute()
    _check_destination(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(preset.vocab_size)
    vocab_size = tokenizer.get_vocab_size()
    special_ids = {tok: tokenizer.token_to_id(tok) for tok in (BOS, EOS, IM_END, PAD)}

    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write_tokenizer_files(tokenizer, staging, preset.max_position_embeddings)
        config = llama_config(preset, vocab_size, special_ids)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (staging / "generation_config.json").write_text(
            json.dumps(generation_config(special_ids), indent=2) + "\n"
        )
        weights = random_weights(preset, vocab_size, seed)
        save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
        del weights
        # mkdtemp (and safetensors) make private files; a published model is readable like any folder.
        staging.chmod(0o755)
        for path in staging.iterdir():
            path.chmod(0o644)
        replace_folder(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
