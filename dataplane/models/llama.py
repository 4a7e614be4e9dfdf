"""The Llama family: Llama 2/3.x, Mistral, Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm).

Module names follow the Hugging Face checkpoints except for the fused projections
(`qkv_proj` = q|k|v, `gate_up_proj` = gate|up), which the loader assembles from the parts.

With a tensor-parallel group (`tp`) each rank builds its slice (parallel/sharding.py): q/k/v and
gate/up are column-parallel (the rank's heads, the rank's MLP columns), o_proj and down_proj
row-parallel with an all-reduce after them, the embedding and the LM head split by vocabulary. A
sliced module carries a `tp_shard` telling the loader which rows or columns to read. Without `tp`
(one device) the model is the plain one.

At decode the MLP's down projection, where it runs as the Triton GEMV, computes silu(gate) * up itself
from the gate_up output (one kernel less per layer; the same products, summed in another order where
the fused launch takes wider row blocks): see LlamaMLP.fuse_silu_mul.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from modelfleet.dataplane.attention.backend import AttentionBackend
from modelfleet.dataplane.attention.metadata import AttentionMetadata
from modelfleet.dataplane.kernels import registry
from modelfleet.dataplane.layers import Linear, RMSNorm, RotaryEmbedding, SiluAndMul, make_linear
from modelfleet.dataplane.layers.vocab_parallel import VocabParallelEmbedding
from modelfleet.dataplane.models.config import ModelConfig
from modelfleet.dataplane.ops import get_op
from modelfleet.dataplane.parallel.sharding import Shard, even_range, split_heads, vocab_range
from modelfleet.dataplane.quantization import QuantizedLinear
from torch import nn

if TYPE_CHECKING:
    from modelfleet.dataplane.parallel.group import TensorParallelGroup


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        backend: AttentionBackend,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.sliding_windows[layer_idx] if config.sliding_windows else None
        # Static KV scales of an fp8 KV cache (kv_cache_dtype fp8; see attention/kv_quant.py for why 1.0).
        self.k_scale = self.v_scale = 1.0
        self.backend = backend
        quant = config.quantization.format if config.quantization else None
        split = None
        if tp is not None:
            split = split_heads(config.num_heads, config.num_kv_heads, tp.rank, tp.size)
            self.num_heads, self.num_kv_heads = split.num_heads, split.num_kv_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = make_linear(
            config.hidden_size,
            self.qkv_sizes,
            ["q_proj", "k_proj", "v_proj"],
            bias=config.qkv_bias,
            quant_format=quant,
        )
        # Row-parallel: rank 0 alone adds the bias, before the all-reduce sums the ranks' parts.
        self.o_proj = make_linear(
            q_size, [config.hidden_size], bias=config.o_proj_bias and _is_first(tp), quant_format=quant
        )
        if split is not None:
            q_rows = (split.first_head * self.head_dim, split.first_head * self.head_dim + q_size)
            kv_start = split.first_kv_head * self.head_dim
            kv_rows = (kv_start, kv_start + kv_size)
            full = (config.q_size, config.kv_size, config.kv_size)
            self.qkv_proj.tp_shard = Shard(dim=0, ranges=(q_rows, kv_rows, kv_rows), full_sizes=full)
            self.o_proj.tp_shard = Shard(dim=1, ranges=(q_rows,), full_sizes=(config.q_size,))
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        rotary: RotaryEmbedding,
        cos: torch.Tensor,  # [T, D/2]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        out = self.o_proj(self.attend(self.qkv_proj(hidden), rotary, cos, sin, kv_cache, attn_metadata))
        return out if self.tp is None else self.tp.all_reduce(out)

    def attend(
        self,
        qkv: torch.Tensor,  # [T, q + k + v]: qkv_proj's output
        rotary: RotaryEmbedding,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Rotary, the KV-cache write and attention: [T, heads * head_dim], o_proj's input."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        scales = {"k_scale": self.k_scale, "v_scale": self.v_scale}
        q, k = self.backend.rope_and_write_kv(
            q, k, v, rotary, cos, sin, kv_cache, attn_metadata.slot_mapping, **scales
        )
        window = self.sliding_window
        out = self.backend.forward(
            q, kv_cache, attn_metadata, self.scale, key=k, value=v, sliding_window=window, **scales
        )
        return out.reshape(num_tokens, self.num_heads * self.head_dim)


class LlamaMLP(nn.Module):
    # Decode rows whose down projection runs as the GEMV: it reads gate_up and computes the activation
    # itself (silu_mul_down_gemv). False (on the class or one module) keeps the separate activation kernel.
    fuse_silu_mul = True

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        size = config.intermediate_size if tp is None else config.intermediate_size // tp.size
        quant = config.quantization.format if config.quantization else None
        self.gate_up_proj = make_linear(
            config.hidden_size,
            [size, size],
            ["gate_proj", "up_proj"],
            bias=config.mlp_bias,
            quant_format=quant,
        )
        self.act = SiluAndMul()
        self.down_proj = make_linear(
            size, [config.hidden_size], bias=config.mlp_bias and _is_first(tp), quant_format=quant
        )
        if tp is not None:
            full = config.intermediate_size
            cols = even_range(full, tp.rank, tp.size)
            self.gate_up_proj.tp_shard = Shard(dim=0, ranges=(cols, cols), full_sizes=(full, full))
            self.down_proj.tp_shard = Shard(dim=1, ranges=(cols,), full_sizes=(full,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        out = silu_mul_down_gemv(self.down_proj, gate_up) if self.fuse_silu_mul else None
        if out is None:
            out = self.down_proj(self.act(gate_up))
        # row-parallel (tp): each rank's gate_up holds its own gate and up columns, down_proj its K slice
        return out if self.tp is None else self.tp.all_reduce(out)


def silu_mul_down_gemv(down: nn.Module, gate_up: torch.Tensor) -> torch.Tensor | None:
    """down(silu_and_mul(gate_up)) as one GEMV computing the activation as it reads gate_up [T, 2I], where
    the built-in CUDA ops would run silu_and_mul's kernel and then down as the GEMV for these rows (decode
    on CUDA with Triton; bf16/fp16 or QuantizedLinear int8/fp8 weights); else None (prefill, CPU, float32,
    an op a user registered)."""
    if get_op("silu_and_mul", gate_up.device.type) is not registry.silu_and_mul:
        return None
    # gate_up has the activation's rows and dtype, all that the checks look at
    operands = gemv_operands(down, gate_up)
    if operands is None:
        return None
    from modelfleet.dataplane.kernels.gemv import gemv

    weight, bias, scale = operands
    return gemv(gate_up, weight, bias, scale=scale, silu_mul=True)


GemvOperands = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def gemv_operands(linear: nn.Module, x: torch.Tensor) -> GemvOperands | None:
    """(weight, bias, scale or None) where the built-in ops multiply x by `linear` with the Triton GEMV
    (decode rows on CUDA: bf16/fp16 Linear, QuantizedLinear int8/fp8), else None."""
    if isinstance(linear, QuantizedLinear):
        return linear_operands(linear) if linear._gemv_applies(x) else None
    if isinstance(linear, Linear) and get_op("linear", x.device.type) is registry.linear:
        return linear_operands(linear) if registry.gemv_applies(x, linear.weight) else None
    return None


def linear_operands(linear: nn.Module) -> GemvOperands:
    """What the GEMV reads of a Linear or QuantizedLinear: weight, bias, per-channel scale (or None)."""
    return linear.weight, linear.bias, getattr(linear, "weight_scale", None)


def norms_fuse(layer: LlamaDecoderLayer, hidden: torch.Tensor) -> bool:
    """Whether decode rows `hidden` run `layer` with its norms and residual adds inside its GEMVs
    (LlamaDecoderLayer.forward_fused): one device, the built-in norm kernel, and each of the four
    projections a GEMV for these rows."""
    attn, mlp = layer.self_attn, layer.mlp
    if not layer.fuse_norms or attn.tp is not None:
        return False
    if get_op("fused_add_rms_norm", hidden.device.type) is not registry.fused_add_rms_norm:
        return False
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    return all(gemv_operands(linear, hidden) is not None for linear in linears)


def norm_gemv(linear: nn.Module, residual: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """linear(norm(residual)), the norm computed inside the GEMV (norms_fuse held: not checked again)."""
    from modelfleet.dataplane.kernels.gemv import gemv

    weight, bias, scale = linear_operands(linear)
    return gemv(residual, weight, bias, scale=scale, norm=(norm.weight, norm.eps))


def add_gemv(
    linear: nn.Module, x: torch.Tensor, residual: torch.Tensor, silu_mul: bool = False
) -> torch.Tensor:
    """residual += linear(x) (of silu_and_mul(x) with silu_mul), in place, in the GEMV's epilogue."""
    from modelfleet.dataplane.kernels.gemv import gemv

    weight, bias, scale = linear_operands(linear)
    return gemv(x, weight, bias, scale=scale, silu_mul=silu_mul, residual=residual)


class LlamaDecoderLayer(nn.Module):
    # Decode rows whose four projections all run as the GEMV take forward_fused: two kernels less per
    # layer. False (on the class or one layer) keeps the norm kernels.
    fuse_norms = True

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        backend: AttentionBackend,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, backend, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each norm can fuse the add before it.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rotary, cos, sin, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def forward_fused(
        self,
        residual: torch.Tensor,
        rotary: RotaryEmbedding,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The layer on the residual stream alone, for decode rows (norms_fuse): each RMSNorm is computed
        by the GEMV that reads its output (qkv, gate_up) and each residual add by the GEMV whose output
        it adds (o, down), in place. Returns the stream (the same tensor)."""
        attn, mlp = self.self_attn, self.mlp
        qkv = norm_gemv(attn.qkv_proj, residual, self.input_layernorm)
        out = attn.attend(qkv, rotary, cos, sin, kv_cache, attn_metadata)
        residual = add_gemv(attn.o_proj, out, residual)
        gate_up = norm_gemv(mlp.gate_up_proj, residual, self.post_attention_layernorm)
        if mlp.fuse_silu_mul and get_op("silu_and_mul", gate_up.device.type) is registry.silu_and_mul:
            return add_gemv(mlp.down_proj, gate_up, residual, silu_mul=True)
        return add_gemv(mlp.down_proj, mlp.act(gate_up), residual)


class LlamaModel(nn.Module):
    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallelGroup | None = None
    ) -> None:
        super().__init__()
        if tp is None:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, backend, tp) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """CausalLM over a paged KV cache; see modelfleet.dataplane.models for the contract."""

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallelGroup | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.attention_backend = backend
        self.model = LlamaModel(config, backend, tp)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope)
        # Tied embeddings: the output projection is the embedding matrix, no separate tensor, unless the
        # artifact quantized it (then it holds its own quantized lm_head and the embeddings stay float).
        head_quant = lm_head_quant_format(config)
        self.lm_head = None
        if not config.tie_word_embeddings or head_quant is not None:
            if tp is None:
                self.lm_head = make_linear(config.hidden_size, [config.vocab_size], quant_format=head_quant)
            else:  # the rank's vocabulary shard, as the embedding's
                start, end, padded = vocab_range(config.vocab_size, tp.rank, tp.size)
                self.lm_head = make_linear(config.hidden_size, [padded], quant_format=head_quant)
                self.lm_head.tp_shard = Shard(
                    dim=0, ranges=((start, end),), full_sizes=(config.vocab_size,), rows=padded
                )

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        kv_caches: list[torch.Tensor],  # one [2, num_blocks, block_size, Hkv, D] per layer
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(
                f"kv_caches has {len(kv_caches)} entries; the model has {self.config.num_layers}"
            )
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        layers = self.model.layers
        if len(layers) and norms_fuse(layers[0], hidden):  # every layer is built alike
            for layer, kv_cache in zip(layers, kv_caches, strict=True):
                hidden = layer.forward_fused(hidden, self.rotary, cos, sin, kv_cache, attn_metadata)
            return self.model.norm(hidden)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, self.rotary, cos, sin, kv_cache, attn_metadata)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor, *, float32: bool = True) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab]: float32, or in the model dtype with float32=False
        (for a sampler that reads them once; the matmul is in the model dtype either way, as HF does).
        Tensor-parallel: a collective, so every rank calls it for the same rows."""
        if self.lm_head is None:
            logits = F.linear(hidden, self.model.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        if self.tp is not None:  # every rank's vocabulary shard side by side, the padding cut off
            logits = self.tp.gather_last_dim(logits)[:, : self.config.vocab_size]
        return logits.float() if float32 else logits

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        """Swap the attention implementation of every layer (e.g. for a graph-captured decode path)."""
        self.attention_backend = backend
        for layer in self.model.layers:
            layer.self_attn.backend = backend

    def after_load(self, device: torch.device) -> None:
        """Recompute the tensors that are derived rather than loaded, on the target device."""
        self.rotary.to_device(device)

    def tensors_held_elsewhere(self) -> set[str]:
        """Checkpoint tensors this rank does not load: row-parallel biases live on rank 0 only."""
        if _is_first(self.tp):
            return set()
        names: set[str] = set()
        for i in range(self.config.num_layers):
            if self.config.o_proj_bias:
                names.add(f"model.layers.{i}.self_attn.o_proj.bias")
            if self.config.mlp_bias:
                names.add(f"model.layers.{i}.mlp.down_proj.bias")
        return names


def lm_head_quant_format(config: ModelConfig) -> str | None:
    """The quantized format of the output projection, or None where it is float (the default)."""
    quant = config.quantization
    return quant.format if quant is not None and quant.lm_head else None


def _is_first(tp: TensorParallelGroup | None) -> bool:
    return tp is None or tp.rank == 0
