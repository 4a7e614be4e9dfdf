"""ONNX export of a Llama-family checkpoint with key/value inputs and outputs, plus int8 quantization.

Graph interface (what dataplane/onnx_runner.py feeds); kv = kv_heads, d = head_dim:
  inputs   input_ids int64 [batch, seq], attention_mask int64 [batch, past + seq] (1 = real token),
           position_ids int64 [batch, seq], past_key_values.{i}.key / .value [batch, kv, past, d]
  outputs  logits float32 [batch, seq, vocab], present.{i}.key / .value [batch, kv, past + seq, d]
The module below is a plain re-statement of the Hugging Face Llama forward written for tracing (no cache
objects, no data-dependent control flow); validation checks its logits against transformers. Which
projections carry a bias, and whether queries and keys are normalized per head (Qwen3), are the engine's
facts (`ModelConfig`), never decided here.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from modelfleet.converters import progress
from modelfleet.converters.checkpoint import Checkpoint
from modelfleet.converters.errors import BadInputError, ConversionError
from modelfleet.dataplane.models.config import ModelConfig
from torch import nn

OPSET = 18
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_key_values.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]
    present = [f"present.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Layer(nn.Module):
    def __init__(self, mc: ModelConfig) -> None:
        super().__init__()
        hidden, heads, kv, head_dim, inter = (
            mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.intermediate_size
        )  # fmt: skip
        self.heads, self.kv_heads, self.head_dim = heads, kv, head_dim
        self.input_layernorm = _RMSNorm(hidden, mc.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(hidden, mc.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(hidden, heads * head_dim, bias=mc.qkv_bias)
        self.self_attn.k_proj = nn.Linear(hidden, kv * head_dim, bias=mc.qkv_bias)
        self.self_attn.v_proj = nn.Linear(hidden, kv * head_dim, bias=mc.qkv_bias)
        self.self_attn.o_proj = nn.Linear(heads * head_dim, hidden, bias=mc.o_proj_bias)
        self.qk_norm = mc.qk_norm
        if mc.qk_norm:  # per head, before the rotary embedding
            self.self_attn.q_norm = _RMSNorm(head_dim, mc.rms_norm_eps)
            self.self_attn.k_norm = _RMSNorm(head_dim, mc.rms_norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(hidden, inter, bias=mc.mlp_bias)
        self.mlp.up_proj = nn.Linear(hidden, inter, bias=mc.mlp_bias)
        self.mlp.down_proj = nn.Linear(inter, hidden, bias=mc.mlp_bias)

    def forward(self, x, cos, sin, mask, past_k, past_v):
        b, s, _ = x.shape
        h = self.input_layernorm(x)
        attn = self.self_attn
        q = attn.q_proj(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = torch.cat([past_k, k], dim=2)  # [b, kv, past + s, d]
        v = torch.cat([past_v, v], dim=2)
        groups = self.heads // self.kv_heads
        k_all = k.repeat_interleave(groups, dim=1) if groups > 1 else k
        v_all = v.repeat_interleave(groups, dim=1) if groups > 1 else v
        scores = torch.matmul(q, k_all.transpose(-1, -2)) * (1.0 / math.sqrt(self.head_dim)) + mask
        out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v_all)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))
        h = self.post_attention_layernorm(x)
        mlp = self.mlp
        x = x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
        return x, k, v


class ExportableLlama(nn.Module):
    def __init__(self, mc: ModelConfig, inv_freq: torch.Tensor, attention_scaling: float) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(mc.vocab_size, mc.hidden_size)
        self.model.layers = nn.ModuleList(_Layer(mc) for _ in range(mc.num_layers))
        self.model.norm = _RMSNorm(mc.hidden_size, mc.rms_norm_eps)
        self.lm_head = nn.Linear(mc.hidden_size, mc.vocab_size, bias=False)
        if mc.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = attention_scaling

    def forward(self, input_ids, attention_mask, position_ids, *past):
        x = self.model.embed_tokens(input_ids)
        dtype = x.dtype
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)[:, None]  # [b, 1, s, d]
        sin = (emb.sin() * self.attention_scaling).to(dtype)[:, None]
        # Query i of this step sits at absolute index past + i of the mask; it sees keys j <= past + i
        # that are real tokens. A large finite negative (not -inf) keeps fully padded rows free of NaN.
        total = attention_mask.shape[1]
        seq = input_ids.shape[1]
        key_idx = torch.arange(total, device=input_ids.device)[None, :]
        query_idx = torch.arange(seq, device=input_ids.device)[:, None] + (total - seq)
        allowed = (key_idx <= query_idx)[None, None] & (attention_mask[:, None, None, :] > 0)
        mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min / 2).to(dtype)
        presents = []
        for i, layer in enumerate(self.model.layers):
            x, k, v = layer(x, cos, sin, mask, past[2 * i], past[2 * i + 1])
            presents += [k, v]
        logits = self.lm_head(self.model.norm(x)).float()
        return (logits, *presents)


def rotary(config: dict) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling through transformers' own rope initialisers (all rope types)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = AutoConfig.for_model(
        config["model_type"], **{k: v for k, v in config.items() if k != "model_type"}
    )
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)), 1.0
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return inv_freq, float(scaling)


def build_module(ckpt: Checkpoint, dtype: torch.dtype) -> ExportableLlama:
    mc = ckpt.model_config
    inv_freq, scaling = rotary(ckpt.config)
    with torch.device("meta"):
        module = ExportableLlama(mc, inv_freq.to("meta"), scaling)
    state = {}
    for shard in ckpt.shards:
        for name, tensor in ckpt.tensors(shard):
            state[name] = tensor.to(dtype)
    if mc.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (mc.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ConversionError(
            f"checkpoint does not fit the {mc.architecture} layout: missing {missing[:3]}, "
            f"extra {unexpected[:3]}"
        )
    if mc.tie_word_embeddings:
        module.lm_head.weight = module.model.embed_tokens.weight
    module.inv_freq = inv_freq.float()
    return module.eval()


def export_onnx(ckpt: Checkpoint, dest: Path, dtype: torch.dtype) -> None:
    """Write dest/model.onnx (+ model.onnx.data) with dynamic batch, sequence and past lengths."""
    mc = ckpt.model_config
    window = next((w for w in mc.sliding_windows if w is not None), None)
    if window is not None:  # the engine's reading of the window settings, per architecture
        raise BadInputError(
            f"ONNX export has no sliding-window attention (config.json sliding_window={window}); "
            "use --format torch for this model"
        )
    module = build_module(ckpt, dtype)
    layers, kv, head_dim = mc.num_layers, mc.num_kv_heads, mc.head_dim
    batch, seq, past = 2, 3, 4  # sizes above 1 so the exporter keeps them symbolic
    args = (
        torch.ones(batch, seq, dtype=torch.long),
        torch.ones(batch, past + seq, dtype=torch.long),
        torch.arange(past, past + seq).repeat(batch, 1),
        *[torch.zeros(batch, kv, past, head_dim, dtype=dtype) for _ in range(2 * layers)],
    )
    # One named symbol per size shared by all tensors; AUTO lets the exporter derive the mask's length
    # (past + sequence) instead of us declaring it.
    batch_dim = torch.export.Dim("batch")
    seq_dim, past_dim = torch.export.Dim("sequence"), torch.export.Dim("past_sequence")
    dynamic = [
        {0: batch_dim, 1: seq_dim},
        {0: batch_dim, 1: torch.export.Dim.AUTO},
        {0: batch_dim, 1: seq_dim},
        tuple([{0: batch_dim, 2: past_dim}] * (2 * layers)),
    ]
    inputs, outputs = io_names(layers)
    with progress.task("export onnx"), torch.no_grad():
        try:
            program = torch.onnx.export(
                module,
                args,
                dynamo=True,
                opset_version=OPSET,
                input_names=inputs,
                output_names=outputs,
                dynamic_shapes=dynamic,
                optimize=True,
                verbose=False,
            )
            program.save(str(dest / MODEL_FILE), external_data=True)
        except Exception as exc:  # the exporter raises many types; one line for the user
            raise ConversionError(f"ONNX export failed: {str(exc).splitlines()[0]}") from exc
    if not (dest / DATA_FILE).exists():
        raise ConversionError(f"ONNX export wrote no external data file {DATA_FILE}")
    name_dynamic_dims(dest / MODEL_FILE)


def name_dynamic_dims(path: Path) -> None:
    """Rename the exporter's symbols (s10, s70, ...) to batch / sequence / past_sequence / total_sequence, so
    the graph documents its own interface. Only model.onnx is rewritten; the weights file is untouched."""
    import re

    import onnx

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    inputs = {i.name: [d.dim_param for d in i.type.tensor_type.shape.dim] for i in graph.input}
    names = {
        inputs["input_ids"][0]: "batch",
        inputs["input_ids"][1]: "sequence",
        inputs["attention_mask"][1]: "total_sequence",
        inputs["past_key_values.0.key"][2]: "past_sequence",
    }
    names = {old: new for old, new in names.items() if old}
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b") if names else None
    for value in [*graph.input, *graph.output, *graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if pattern and dim.dim_param:
                dim.dim_param = pattern.sub(lambda m: names[m.group(1)], dim.dim_param)
    onnx.save(model, str(path))


def quantize_onnx_int8(src: Path, dest: Path) -> None:
    """onnxruntime dynamic quantization: int8 weights per channel, activations quantized at run time.

    The output projection stays float, as in the torch artifacts unless --quantize-lm-head: its input is
    quantized per tensor at run time, and on the demo model that alone put the logits 1.37 off the float
    model's (the int8 limit is 0.5); the decoder layers' linears are quantized."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with progress.task("quantize onnx int8"):
        quantize_dynamic(
            model_input=str(src / MODEL_FILE),
            model_output=str(dest / MODEL_FILE),
            weight_type=QuantType.QInt8,
            per_channel=True,
            op_types_to_quantize=["MatMul", "Gemm"],
            use_external_data_format=True,
            nodes_to_exclude=[output_projection(src / MODEL_FILE)],
            extra_options={"MatMulConstBOnly": True},
        )


def output_projection(path: Path) -> str:
    """The name of the MatMul (or Gemm) whose product becomes the graph's `logits`."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    producers = {output: node for node in graph.node for output in node.output}
    node = producers.get("logits")
    while node is not None and node.op_type not in ("MatMul", "Gemm"):
        node = producers.get(node.input[0])
    if node is None:
        raise ValueError(f"{path}: no MatMul or Gemm computes the graph's logits")
    return node.name
