"""The GEMV with silu(gate) * up fused in (gemv(..., silu_mul=True)) against the silu_and_mul kernel then
the GEMV, for bf16, int8 and fp8 weights; and the Llama MLP's choice of it at decode, logits compared with
the fusion off.

The kernel cases run on a GPU, or on the CPU under Triton's interpreter: one test here runs the small ones
that way in a pytest of its own (the interpreter must be on before triton.jit runs). The interpreter rounds
float32 -> bf16 by truncation, but the same way in both paths, so they still agree exactly there."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

WEIGHTS = ["bf16", "int8", "fp8"]
# (M, N, K, split_k, reduce_at_end): one row and even K; ragged K and masked rows with per-tile row sums;
# K split unevenly, more rows than one program takes, a ragged last row block
LAUNCHES = {
    "even": (1, 24, 256, 1, True),
    "ragged": (3, 9, 200, 1, False),
    "split": (6, 13, 520, 3, True),
}
# The Llama-3.2-1B and Llama-3-8B down projections (N = hidden, K = intermediate)
DOWN_SHAPES = [(2048, 8192), (4096, 14336)]
TOL = {"atol": 3e-2, "rtol": 3e-2}  # bf16 results against a float32 product


def launch_shape(launch: str):
    """(M, N, K, GemvConfig) of one of LAUNCHES: 4-row blocks of 64-wide K tiles."""
    from modelfleet.dataplane.kernels.gemv import GemvConfig

    m, n, k, split_k, reduce_at_end = LAUNCHES[launch]
    config = GemvConfig(block_n=4, block_k=64, num_warps=4, split_k=split_k, reduce_at_end=reduce_at_end)
    return m, n, k, config


def down_weight(n, k, weights, device):
    """(weight, scale or None): bf16, or quantized per channel as the checkpoints are."""
    from modelfleet.dataplane.quantization import quantize

    float_weight = torch.randn(n, k) / k**0.5
    if weights == "bf16":
        return float_weight.to(device, torch.bfloat16), None
    q, scale = quantize(float_weight, weights)
    return q.to(device), scale.to(device)


def skip_fp8_where_missing(weights, device):
    if weights == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip("float8 e4m3 loads need compute capability 8.9 or newer")


def unfused(gate_up, weight, bias, scale, config=None):
    from modelfleet.dataplane.kernels.activation import silu_and_mul
    from modelfleet.dataplane.kernels.gemv import gemv

    return gemv(silu_and_mul(gate_up), weight, bias, scale=scale, config=config)


def reference(gate_up, weight, bias, scale):
    """float32 product of the bf16-rounded activation (as the kernels round it) and the float weight."""
    from modelfleet.dataplane.quantization import dequantize

    gate, up = gate_up.float().chunk(2, dim=-1)
    act = (F.silu(gate).to(gate_up.dtype).float() * up).to(gate_up.dtype).float()
    w = weight.float() if scale is None else dequantize(weight, scale)
    out = F.linear(act, w, None if bias is None else bias.float())
    return out.to(gate_up.dtype)


def assert_within_one_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 results that differ by at most one unit in the last place of the larger of the two. Results
    below a thousandth of the largest count as that size: there another summation order's fp32 error,
    not the bf16 rounding, sets the difference."""
    g, w = got.float(), want.float()
    floor = 1e-3 * w.abs().max()
    _, exponent = torch.frexp(torch.maximum(g.abs(), w.abs()).clamp_min(floor))
    ulp = torch.ldexp(torch.ones_like(g), exponent - 8)  # bf16: 8 significant bits
    worst = ((g - w).abs() / ulp).max().item()
    assert worst <= 1, f"differences up to {worst} bf16 ulps"


@pytest.mark.gpu
@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_fused_activation_gives_the_unfused_result(device, weights, launch):
    """Bit for bit at the same launch configuration: the activation is rounded as silu_and_mul stores it."""
    from modelfleet.dataplane.kernels.gemv import gemv

    skip_fp8_where_missing(weights, device)
    m, n, k, config = launch_shape(launch)
    gate_up = (2 * torch.randn(m, 2 * k)).to(device, torch.bfloat16)
    weight, scale = down_weight(n, k, weights, device)
    bias = torch.randn(n).to(device, torch.bfloat16) if launch == "split" else None
    got = gemv(gate_up, weight, bias, scale=scale, config=config, silu_mul=True)
    want = unfused(gate_up, weight, bias, scale, config)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert torch.equal(got, want), (got.float() - want.float()).abs().max().item()
    torch.testing.assert_close(got, reference(gate_up, weight, bias, scale), **TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize(("n", "k"), DOWN_SHAPES)
def test_fused_on_the_decode_shapes(device, weights, m, n, k):
    """Equal to the unfused path at the same configuration; within one bf16 ulp of it at each path's own
    default (the fused one may take wider row blocks, which sums in another order)."""
    from modelfleet.dataplane.kernels.gemv import _num_sms, default_config, gemv

    skip_fp8_where_missing(weights, device)
    gate_up = (2 * torch.randn(m, 2 * k)).to(device, torch.bfloat16)
    weight, scale = down_weight(n, k, weights, device)
    config = default_config(m, n, k, _num_sms(device), weight.element_size(), silu_mul=True)
    got = gemv(gate_up, weight, scale=scale, silu_mul=True)
    assert torch.equal(got, unfused(gate_up, weight, None, scale, config))
    assert_within_one_ulp(got, unfused(gate_up, weight, None, scale))
    torch.testing.assert_close(got, reference(gate_up, weight, None, scale), **TOL)


@pytest.mark.gpu
def test_fused_gemv_replays_in_a_cuda_graph(device):
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA GPU")
    from modelfleet.dataplane.kernels.gemv import gemv

    gate_up = torch.randn(1, 2 * 8192, device=device).to(torch.bfloat16)
    weight, scale = down_weight(2048, 8192, "int8", device)
    gemv(gate_up, weight, scale=scale, silu_mul=True)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = gemv(gate_up, weight, scale=scale, silu_mul=True)
    gate_up.copy_(torch.randn_like(gate_up))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, gemv(gate_up, weight, scale=scale, silu_mul=True))


def test_fused_row_blocks_share_the_activation():
    """The fused launch takes at least SILU_MUL_MIN_BLOCK_N weight rows per program and is otherwise the
    shape's own configuration; a wider tuned row block is kept."""
    import dataclasses

    from modelfleet.dataplane.kernels.gemv import SILU_MUL_MIN_BLOCK_N, TUNED, TUNED_ONE_BYTE, default_config

    narrow = TUNED[(4096, 14336, 1)]
    assert narrow.block_n < SILU_MUL_MIN_BLOCK_N
    fused = default_config(1, 4096, 14336, silu_mul=True)
    assert fused == dataclasses.replace(narrow, block_n=SILU_MUL_MIN_BLOCK_N)
    wide = TUNED_ONE_BYTE[(4096, 14336, 1)]
    assert wide.block_n >= SILU_MUL_MIN_BLOCK_N
    assert default_config(1, 4096, 14336, weight_bytes=1, silu_mul=True) == wide


def test_fused_gemv_refuses_a_gate_up_that_does_not_match_the_weight():
    from modelfleet.dataplane.kernels.gemv import gemv

    weight = torch.zeros(8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"x \[\.\.\., 2K\]"):
        gemv(torch.zeros(1, 129, dtype=torch.bfloat16), weight, silu_mul=True)
    with pytest.raises(ValueError, match="half of x's last dim"):
        gemv(torch.zeros(1, 64, dtype=torch.bfloat16), weight, silu_mul=True)


# ---- the Llama MLP at decode ----

LAYERS, HIDDEN, INTERMEDIATE, VOCAB = 2, 2048, 8192, 1000  # the 1B's MLP and attention shapes
HEADS, KV_HEADS, BLOCK_SIZE, BLOCKS_PER_SEQ = 32, 8, 16, 4


def random_llama(device, weights):
    """A 2-layer Llama with the 1B's shapes and random weights: bf16, or its linears quantized."""
    from modelfleet.dataplane.attention import get_backend
    from modelfleet.dataplane.models import ModelConfig
    from modelfleet.dataplane.models.llama import LlamaForCausalLM
    from modelfleet.dataplane.quantization import QuantizedLinear, quantize
    from modelfleet.dataplane.registration import register_builtins

    hf_config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "eos_token_id": 2,
    }  # fmt: skip
    if weights != "bf16":
        hf_config["quantization_config"] = {"quant_method": "modelfleet", "format": weights}
    register_builtins()  # as an engine's start: the "triton" backend and the Triton ops
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_hf_dict(hf_config), get_backend("triton")).to(device)
    with torch.no_grad():
        for p in model.parameters():  # norms around 1, the rest small
            p.data = (torch.randn(p.shape) * 0.05 + (1.0 if p.dim() == 1 else 0.0)).to(device, torch.bfloat16)
        for module in model.modules():
            if isinstance(module, QuantizedLinear):
                q, scale = quantize(torch.randn(module.out_features, module.in_features) * 0.05, weights)
                module.weight, module.weight_scale = q.to(device), scale.to(device)
    model.after_load(device)
    return model.requires_grad_(False)


def decode_step(model, batch, device, kv_dtype=torch.bfloat16, caches: list | None = None):
    """One decode token per sequence, each with its own blocks and a context of a few blocks: the logits
    (the KV caches written, appended to `caches`)."""
    from modelfleet.dataplane.attention import AttentionMetadata

    config = model.config
    gen = torch.Generator().manual_seed(batch)
    kv_caches = [
        torch.randn(
            2, batch * BLOCKS_PER_SEQ, BLOCK_SIZE, config.num_kv_heads, config.head_dim, generator=gen
        ).to(device, kv_dtype)
        for _ in range(config.num_layers)
    ]
    seq_lens = torch.randint(1, BLOCKS_PER_SEQ * BLOCK_SIZE + 1, (batch,), generator=gen)
    tables = torch.arange(batch * BLOCKS_PER_SEQ).view(batch, BLOCKS_PER_SEQ)
    last = seq_lens - 1
    slots = tables[torch.arange(batch), last // BLOCK_SIZE] * BLOCK_SIZE + last % BLOCK_SIZE
    meta = AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=seq_lens.to(torch.int32).to(device),
        block_tables=tables.to(torch.int32).to(device),
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
    )
    input_ids = torch.randint(0, config.vocab_size, (batch,), generator=gen).to(device)
    if caches is not None:
        caches.extend(kv_caches)
    with torch.inference_mode():
        hidden = model(input_ids, last.to(device), kv_caches, meta)
        return model.compute_logits(hidden)


def count_fused_gemvs(monkeypatch) -> list:
    from modelfleet.dataplane.kernels import gemv as gemv_module

    calls = []
    real = gemv_module.gemv

    def counting(*args, **kwargs):
        if kwargs.get("silu_mul"):
            calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(gemv_module, "gemv", counting)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("batch", [1, 2, 4])
def test_decode_logits_with_the_fused_mlp_equal_the_unfused(device, monkeypatch, weights, batch):
    """Every layer's MLP fuses where its down projection is a GEMV (bf16: up to 2 rows, quantized: up to
    4), and the logits are those of the separate activation kernel: exactly where both paths launch the
    down GEMV alike, else within the rounding of a different summation order."""
    if device.type != "cuda":
        pytest.skip("the MLP fuses on CUDA devices only")
    skip_fp8_where_missing(weights, device)
    from modelfleet.dataplane import quantization
    from modelfleet.dataplane.kernels import registry
    from modelfleet.dataplane.kernels.gemv import _num_sms, default_config
    from modelfleet.dataplane.models.llama import LlamaMLP

    model = random_llama(device, weights)
    calls = count_fused_gemvs(monkeypatch)
    fused = decode_step(model, batch, device)
    most = registry.GEMV_MAX_TOKENS if weights == "bf16" else quantization.GEMV_MAX_TOKENS
    assert calls == ([(batch, 2 * INTERMEDIATE)] * LAYERS if batch <= most else [])
    monkeypatch.setattr(LlamaMLP, "fuse_silu_mul", False)
    plain = decode_step(model, batch, device)
    assert len(calls) == (LAYERS if batch <= most else 0)  # none more with the fusion off
    weight_bytes = 2 if weights == "bf16" else 1
    shape = (batch, HIDDEN, INTERMEDIATE, _num_sms(device), weight_bytes)
    if batch > most or default_config(*shape, silu_mul=True) == default_config(*shape):
        assert torch.equal(fused, plain), (fused - plain).abs().max().item()
    else:
        torch.testing.assert_close(fused, plain, **TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_decode_graphs_capture_the_fused_mlp(device, monkeypatch, weights):
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA GPU")
    from modelfleet.dataplane.attention import AttentionMetadata
    from modelfleet.dataplane.kernels.cuda_graphs import model_decode_runner

    model = random_llama(device, weights)
    kv = [
        torch.randn(2, 2 * BLOCKS_PER_SEQ, BLOCK_SIZE, KV_HEADS, HIDDEN // HEADS, device=device).bfloat16()
        for _ in range(LAYERS)
    ]
    graph_caches, eager_caches = [c.clone() for c in kv], [c.clone() for c in kv]
    runner = model_decode_runner(
        model, graph_caches, max_batch_size=2, max_blocks_per_seq=BLOCKS_PER_SEQ, batch_sizes=[1, 2]
    )
    calls = count_fused_gemvs(monkeypatch)
    runner.capture()
    assert calls, "the captured decode steps never took the fused MLP"
    inputs = {
        "input_ids": torch.tensor([5, 7], device=device),
        "positions": torch.tensor([20, 40], device=device),
        "slot_mapping": torch.tensor([20, BLOCKS_PER_SEQ * BLOCK_SIZE + 40], device=device),
        "seq_lens": torch.tensor([21, 41], dtype=torch.int32, device=device),
        "block_tables": torch.arange(2 * BLOCKS_PER_SEQ, dtype=torch.int32, device=device).view(2, -1),
    }
    with torch.inference_mode():
        got = runner.run(inputs, 2).clone()
        meta = AttentionMetadata(
            slot_mapping=inputs["slot_mapping"],
            query_start_loc=torch.arange(3, dtype=torch.int32, device=device),
            seq_lens=inputs["seq_lens"],
            block_tables=inputs["block_tables"],
            max_query_len=1,
            max_seq_len=41,
        )
        want = model(inputs["input_ids"], inputs["positions"], eager_caches, meta)
    torch.testing.assert_close(got, want, **TOL)


def test_the_mlp_keeps_the_activation_kernel_off_the_gpu():
    """On the CPU (prefill and decode alike) the MLP runs silu_and_mul and the down projection as before."""
    from modelfleet.dataplane.layers import Linear
    from modelfleet.dataplane.models.llama import silu_mul_down_gemv

    down = Linear(64, 32)
    assert silu_mul_down_gemv(down, torch.randn(1, 128)) is None


# every launch for every weight format but fp8's K split (~12 s there; its words decode as in the
# even and ragged fp8 cases, its split as in int8's)
INTERPRETER_CASES = [
    f"test_fused_activation_gives_the_unfused_result[{launch}-{weights}]"
    for launch in LAUNCHES
    for weights in WEIGHTS
    if (launch, weights) != ("split", "fp8")
]
