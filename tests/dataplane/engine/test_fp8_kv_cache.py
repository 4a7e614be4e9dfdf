"""The fp8 KV cache (kv_cache_dtype fp8) on the CPU, where torch emulates it: the quantization, the torch
attention backend against attention over the dequantized cache, the model's logits against the bf16
cache's, the engine's block count, and the setting's checks."""

from __future__ import annotations

import pytest
import torch
from modelfleet.dataplane.attention import AttentionMetadata, get_backend
from modelfleet.dataplane.attention.kv_quant import (
    FP8_KV_DTYPE,
    FP8_MAX,
    check_scale,
    dequantize,
    quantize,
    resolve_kv_cache_dtype,
)
from modelfleet.dataplane.registration import register_builtins

from tests.dataplane.models.test_paged_attention import SCENARIOS, make_case, naive_attention


@pytest.fixture(autouse=True, scope="module")
def builtin_backends() -> None:
    register_builtins()


def test_quantize_divides_by_the_scale_rounds_to_nearest_and_saturates():
    x = torch.tensor([1000.0, -1000.0, 1.0, 0.3, 1.0624, 1.0626, 0.0])
    got = quantize(x, 1.0)
    assert got.dtype == FP8_KV_DTYPE
    # e4m3 has 3 mantissa bits: 1.0625 is the midpoint between 1.0 and 1.125
    assert got.float().tolist() == [FP8_MAX, -FP8_MAX, 1.0, 0.3125, 1.0, 1.125, 0.0]
    assert quantize(x * 4, 4.0).float().tolist() == got.float().tolist()
    assert dequantize(quantize(torch.tensor([3.0]), 0.5), 0.5, torch.float32).item() == 3.0
    normal = torch.linspace(-400, 400, 1001)
    rel = (dequantize(quantize(normal, 1.0), 1.0, torch.float32) - normal).abs() / normal.abs().clamp_min(
        2**-6
    )
    assert rel.max().item() <= 2**-4  # half of e4m3's relative step


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), "1", True])
def test_a_scale_must_be_a_positive_finite_number(bad):
    with pytest.raises(ValueError, match=r"^k_scale: "):
        check_scale("k_scale", bad)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize(("k_scale", "v_scale"), [(1.0, 1.0), (0.01, 0.03)])
def test_torch_backend_reads_what_it_wrote_dequantized(scenario, k_scale, v_scale):
    """Every path of the torch backend (fresh prompts, cached context, decode groups) computes attention
    over exactly the dequantized cache; the small scales make K and V saturate where |x| > 448 x scale."""
    query_lens, seq_lens = SCENARIOS[scenario]
    q, k, v, _, meta, tables = make_case(query_lens, seq_lens, 8, 2, 32, 16, torch.float32)
    k, v = k * 3, v * 3  # some values beyond 448 x 0.01
    num_blocks = max(max(t) for t in tables) + 1
    fp8_cache = torch.zeros(2, num_blocks, 16, 2, 32, dtype=FP8_KV_DTYPE)
    # the context (tokens before this step's) too: written through the backend like the new tokens
    context = AttentionMetadata.build(
        query_lens=seq_lens, seq_lens=seq_lens, block_tables=tables, block_size=16
    ).slot_mapping
    backend = get_backend("torch")
    filler = torch.randn(context.shape[0], 2, 32) * 3
    backend.write_kv(filler, -filler, fp8_cache, context, k_scale=k_scale, v_scale=v_scale)
    backend.write_kv(k, v, fp8_cache, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)
    assert bool((fp8_cache.float().abs() == FP8_MAX).any()) == (k_scale != 1.0)

    float_cache = torch.stack(
        [dequantize(fp8_cache[0], k_scale, torch.float32), dequantize(fp8_cache[1], v_scale, torch.float32)]
    )
    want = naive_attention(q, float_cache, query_lens, seq_lens, tables, 0.2)
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    got = backend.forward(q, fp8_cache, meta, 0.2, key=k, value=v, **scales)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # reading every key from the cache instead of this step's K/V: the same answer
    torch.testing.assert_close(backend.forward(q, fp8_cache, meta, 0.2, **scales), want, atol=2e-5, rtol=1e-5)


def _decode_logits(
    model, kv_dtype: torch.dtype, prompt: list[int], steps: int, forced: list[int] | None = None
) -> tuple[torch.Tensor, list[int]]:
    """Logits of a prefill and `steps` decode steps in a cache of `kv_dtype`, each step fed the greedy
    token or, with `forced`, the given one; and the tokens fed."""
    mc = model.config
    caches = list(
        torch.zeros(mc.num_layers, 2, 8, 16, mc.num_kv_heads, mc.head_dim, dtype=kv_dtype).unbind(0)
    )
    table = [[3, 1, 6, 0, 5]]
    tokens, rows = list(prompt), []
    with torch.inference_mode():
        n = len(tokens)
        meta = AttentionMetadata.build(query_lens=[n], seq_lens=[n], block_tables=table, block_size=16)
        hidden = model(torch.tensor(tokens), torch.arange(n), caches, meta)
        rows.append(model.compute_logits(hidden[-1:])[0])
        for step in range(steps):
            token = int(rows[-1].argmax()) if forced is None else forced[step]
            tokens.append(token)
            n = len(tokens)
            meta = AttentionMetadata.build(query_lens=[1], seq_lens=[n], block_tables=table, block_size=16)
            hidden = model(torch.tensor([token]), torch.tensor([n - 1]), caches, meta)
            rows.append(model.compute_logits(hidden)[0])
    return torch.stack(rows), tokens[len(prompt) :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_logits_with_an_fp8_cache_stay_close_to_the_model_dtype_cache(tiny_model_dir, dtype):
    """The tiny model over 40 prompt tokens and 24 decode steps, both caches fed the same tokens: the
    fp8 cache changes the logits (it is used), by at most 0.1 (they span about +-4), and never the
    top token."""
    from modelfleet.dataplane.models import load_model

    model = load_model(tiny_model_dir, device="cpu", dtype=dtype)
    prompt = [(11 * j) % 300 + 3 for j in range(40)]
    want, tokens = _decode_logits(model, dtype, prompt, 24)
    got, _ = _decode_logits(model, FP8_KV_DTYPE, prompt, 24, forced=tokens)
    diff = (got - want).abs().max().item()
    assert 0.0 < diff <= 0.1, diff
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_engine_with_an_fp8_cache_holds_twice_the_blocks_and_gives_the_same_tokens(tiny_model_dir):
    from modelfleet.dataplane import LLM, SamplingParams

    prompts = [[(7 * i + 3 * j) % 200 + 5 for j in range(20 + 9 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    runs = {}
    for kv_cache_dtype in ("auto", "fp8"):
        llm = LLM(
            tiny_model_dir, max_model_len=256, kv_cache_bytes=1 << 20, dtype="bfloat16", device="cpu",
            kv_cache_dtype=kv_cache_dtype,
        )  # fmt: skip
        runner = llm.engine.runner
        runs[kv_cache_dtype] = (runner, [out.token_ids for out in llm.generate(prompts, params)])
    (bf16, want), (fp8, got) = runs["auto"], runs["fp8"]
    assert bf16.kv_cache.dtype == torch.bfloat16 and fp8.kv_cache.dtype == FP8_KV_DTYPE
    assert fp8.num_blocks == 2 * bf16.num_blocks
    assert fp8.kv_cache_bytes == bf16.kv_cache_bytes
    # a flip at a near tie changes the rest of its sequence: at most one of the four may differ
    assert sum(x == y for x, y in zip(want, got, strict=True)) >= len(want) - 1, (want, got)


def test_fp8_needs_a_gpu_with_fp8(monkeypatch):
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, torch.device("cpu")) is torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, torch.device("cpu")) is FP8_KV_DTYPE
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: fp8 needs a CUDA GPU with compute capability "
                       r">= 8\.9 .*NVIDIA A100-SXM4-80GB \(compute capability 8\.0\) has none"):  # fmt: skip
        resolve_kv_cache_dtype("fp8", torch.bfloat16, torch.device("cuda:0"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, torch.device("cuda:0")) is FP8_KV_DTYPE
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: fp8 needs .* mps has none"):
        resolve_kv_cache_dtype("fp8", torch.float16, torch.device("mps"))


def test_setting_is_checked_and_flows_from_the_serve_flag(tiny_model_dir):
    from modelfleet.dataplane import EngineConfig
    from modelfleet.dataplane.server.cli import _engine_settings

    assert EngineConfig(str(tiny_model_dir)).kv_cache_dtype == "auto"  # off by default
    settings = _engine_settings(["kv_cache_dtype=fp8"])  # modelfleet serve --engine ...
    assert EngineConfig.from_kwargs(tiny_model_dir, **settings).kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: 'fp16' is not one of auto, fp8$"):
        EngineConfig(str(tiny_model_dir), kv_cache_dtype="fp16")


def test_host_tier_copies_fp8_blocks_unchanged(tiny_model_dir):
    """Blocks spilled to host memory and loaded back hold the same bytes: an fp8 engine gives the same
    tokens with the host tier as without it, and the tier's hits are real."""
    from modelfleet.dataplane import LLM

    from tests.dataplane.engine.test_host_kv_engine import (
        BLOCK,
        BLOCK_BYTES,
        NUM_BLOCKS,
        NUM_PREFIXES,
        PREFIX_BLOCKS,
        run,
    )

    fp8_block = BLOCK_BYTES // 4  # float32 -> one byte per element

    def make(host_blocks: int) -> LLM:
        return LLM(
            tiny_model_dir, max_model_len=256, max_num_seqs=2, kv_cache_bytes=NUM_BLOCKS * fp8_block,
            host_kv_cache_bytes=host_blocks * fp8_block, dtype="float32", device="cpu", kv_cache_dtype="fp8",
        )  # fmt: skip

    without = make(0)
    assert without.engine.runner.num_blocks == NUM_BLOCKS
    tokens = run(without)
    with_tier = make(64)
    assert run(with_tier) == tokens
    assert with_tier.stats().host_kv_hits == NUM_PREFIXES * PREFIX_BLOCKS * BLOCK
