"""ModelConfig: the parts of a Hugging Face config.json that our Llama-family models need."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Architectures implemented by models/llama.py (one family, a few switches).
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")
SUPPORTED_QUANT_FORMATS: tuple[str, ...] = ("int8", "fp8")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture (or one of its settings) is not implemented here."""


class ConfigError(ValueError):
    """config.json is missing, unreadable or lacks a field we need."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "modelfleet"
    format: str  # "int8" | "fp8"
    # The output projection is quantized too (an opt-in of the converter); for tied embeddings the
    # artifact then holds its own lm_head.weight beside the float embeddings, which the engine unties.
    lm_head: bool = False


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # per layer: None (full attention) or the window W (a query at p sees keys at p-W+1..p)
    sliding_windows: tuple[int | None, ...] = ()
    checkpoint_dtype: str | None = None
    quantization: QuantConfig | None = None

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Parse model_dir/config.json, adding EOS ids from generation_config.json when present."""
        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise ConfigError(f"{config_path}: not found; a model directory needs a Hugging Face config.json")
        raw = _read_json(config_path)
        gen_path = model_dir / "generation_config.json"
        generation = _read_json(gen_path) if gen_path.is_file() else {}
        return cls.from_hf_dict(raw, generation)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        architecture = _architecture(raw)
        model_type = str(raw.get("model_type", ""))
        hidden_act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
        if hidden_act != "silu":
            raise UnsupportedModelError(f"config.json hidden_act={hidden_act!r}: only 'silu' is supported")
        hidden_size = _int(raw, "hidden_size")
        num_heads = _int(raw, "num_attention_heads")
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
        num_layers = _int(raw, "num_hidden_layers")
        max_pos = _int(raw, "max_position_embeddings")
        if num_heads % num_kv_heads:
            raise ConfigError(
                f"config.json num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv_heads}"
            )
        if raw.get("pretraining_tp", 1) not in (1, None):
            raise UnsupportedModelError("config.json pretraining_tp != 1 is not supported; set it to 1")

        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            architecture=architecture,
            model_type=model_type,
            vocab_size=_int(raw, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_int(raw, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope(raw, max_pos),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=_eos_ids(raw, generation or {}),
            bos_token_id=raw.get("bos_token_id"),
            # Qwen2 always has q/k/v bias; Llama's and Qwen3's attention_bias cover q/k/v and o;
            # Mistral has none.
            qkv_bias=is_qwen2 or (attention_bias and architecture != "MistralForCausalLM"),
            o_proj_bias=attention_bias and architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM"),
            mlp_bias=bool(raw.get("mlp_bias", False)) and architecture == "LlamaForCausalLM",
            qk_norm=architecture == "Qwen3ForCausalLM",
            sliding_windows=_sliding_windows(raw, architecture, num_layers, max_pos),
            checkpoint_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            quantization=_quantization(raw),
        )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    found = ", ".join(archs) if archs else "none"
    raise UnsupportedModelError(
        f"config.json architectures={found}: not supported; supported architectures: {supported}"
    )


def _int(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config.json {key}={value!r}: expected a positive integer")
    return value


def _rope(raw: dict[str, Any], max_pos: int) -> RopeConfig:
    # transformers >= 5 writes rope_parameters (with rope_theta inside); older files use
    # top-level rope_theta plus an optional rope_scaling dict ("type" or "rope_type").
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"config.json rope type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if raw.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError("config.json partial_rotary_factor != 1.0 is not supported")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if "factor" not in params:
        raise ConfigError(f"config.json rope scaling of type {rope_type!r} needs 'factor'")
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=float(params["factor"]))
    for key in ("low_freq_factor", "high_freq_factor"):
        if key not in params:
            raise ConfigError(f"config.json rope scaling 'llama3' needs {key!r}")
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings") or max_pos),
    )


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for value in (generation.get("eos_token_id"), raw.get("eos_token_id")):
        for token_id in _as_id_list(value):
            if token_id not in ids:
                ids.append(token_id)
    return tuple(ids)


def _sliding_windows(
    raw: dict[str, Any], architecture: str, num_layers: int, max_pos: int
) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if architecture == "MistralForCausalLM":
        active = [window is not None] * num_layers
    elif architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not raw.get("use_sliding_window", False):
            active = [False] * num_layers
        elif raw.get("layer_types"):
            active = [t == "sliding_attention" for t in raw["layer_types"]]
        else:
            max_window_layers = int(raw.get("max_window_layers", num_layers))
            active = [i >= max_window_layers for i in range(num_layers)]
    else:
        active = [False] * num_layers
    # A window that covers the whole context is the same as full attention.
    if window is None or int(window) >= max_pos:
        return (None,) * num_layers
    return tuple(int(window) if on else None for on in active)


def _quantization(raw: dict[str, Any]) -> QuantConfig | None:
    quant = raw.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    fmt = quant.get("format")
    if method != "modelfleet" or fmt not in SUPPORTED_QUANT_FORMATS:
        raise UnsupportedModelError(
            f"config.json quantization_config quant_method={method!r} format={fmt!r}: only "
            f"quant_method 'modelfleet' with format {' or '.join(SUPPORTED_QUANT_FORMATS)} is supported"
        )
    lm_head = quant.get("lm_head", False)
    if not isinstance(lm_head, bool):
        raise ConfigError(f"config.json quantization_config lm_head={lm_head!r}: must be true or false")
    return QuantConfig(method=method, format=fmt, lm_head=lm_head)
