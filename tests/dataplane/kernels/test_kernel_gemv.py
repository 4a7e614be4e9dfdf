"""The small-M GEMV against F.linear, and the registered "linear" op's choice between them."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

# (N, K): Llama-3.2-1B and Llama-3-8B decode linears (fused qkv, o, fused gate_up, down), then odd sizes
SHAPES = [
    (3072, 2048),
    (2048, 2048),
    (16384, 2048),
    (2048, 8192),
    (6144, 4096),
    (4096, 4096),
    (28672, 4096),
    (4096, 14336),
    (1000, 1000),
    (17, 4096),
]
TOLERANCES = {torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}, torch.float16: {"atol": 2e-3, "rtol": 2e-3}}


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    b = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), b).to(x.dtype)


def random_linear(m, n, k, dtype, device, with_bias):
    x = torch.randn(m, k, device=device).to(dtype)
    weight = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    bias = torch.randn(n, device=device).to(dtype) if with_bias else None
    return x, weight, bias


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_linear(device, dtype, m, n, k, with_bias):
    from modelfleet.dataplane.kernels.gemv import gemv

    x, weight, bias = random_linear(m, n, k, dtype, device, with_bias)
    got = gemv(x, weight, bias)
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got, reference(x, weight, bias), **TOLERANCES[dtype])


@pytest.mark.parametrize("split_k", [1, 3, 8])
@pytest.mark.parametrize("reduce_at_end", [False, True])
@pytest.mark.parametrize("use_pdl", [False, True])
@pytest.mark.parametrize("m", [3, 6])
def test_every_launch_shape_gives_the_same_sums(device, split_k, reduce_at_end, use_pdl, m):
    """Ragged K (not a multiple of BLOCK_K), a ragged last row block, K split unevenly, and more rows of x
    than one program takes."""
    from modelfleet.dataplane.kernels.gemv import GemvConfig, gemv

    x, weight, bias = random_linear(m, 37, 1000, torch.bfloat16, device, True)
    config = GemvConfig(
        block_n=8, block_k=128, num_warps=4, split_k=split_k, reduce_at_end=reduce_at_end, use_pdl=use_pdl
    )
    torch.testing.assert_close(
        gemv(x, weight, bias, config=config), reference(x, weight, bias), **TOLERANCES[torch.bfloat16]
    )


def test_gemv_takes_strided_rows_of_x(device):
    from modelfleet.dataplane.kernels.gemv import gemv

    wide = torch.randn(2, 2 * 512, device=device).to(torch.bfloat16)
    x = wide[:, 512:]  # rows 1024 elements apart
    weight = torch.randn(64, 512, device=device).to(torch.bfloat16)
    torch.testing.assert_close(gemv(x, weight), reference(x, weight, None), **TOLERANCES[torch.bfloat16])


def test_gemv_rejects_mismatched_dtypes(device):
    from modelfleet.dataplane.kernels.gemv import gemv

    x = torch.randn(1, 64, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match="cast one of them"):
        gemv(x, torch.randn(8, 64, device=device, dtype=torch.bfloat16))


def test_gemv_replays_in_a_cuda_graph(device):
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA GPU")
    from modelfleet.dataplane.kernels.gemv import gemv

    x, w_small, _ = random_linear(1, 2048, 2048, torch.bfloat16, device, False)
    w_big = random_linear(1, 16384, 2048, torch.bfloat16, device, False)[1]
    gemv(x, w_small), gemv(x, w_big)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        small, big = gemv(x, w_small), gemv(x, w_big)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(small, reference(x, w_small, None), **TOLERANCES[torch.bfloat16])
    torch.testing.assert_close(big, reference(x, w_big, None), **TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("tokens", ["one", "most", "one too many", "prefill"])
def test_registered_linear_uses_the_gemv_for_few_tokens_only(device, monkeypatch, tokens):
    if device.type != "cuda":
        pytest.skip("the op is registered for cuda devices")
    from modelfleet.dataplane.kernels import gemv as gemv_module
    from modelfleet.dataplane.kernels import registry

    most = registry.GEMV_MAX_TOKENS
    m, uses_gemv = {
        "one": (1, True),
        "most": (most, True),
        "one too many": (most + 1, False),
        "prefill": (64, False),
    }[tokens]
    calls = []
    real = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    x, weight, bias = random_linear(m, 2048, 2048, torch.bfloat16, device, True)
    got = registry.linear(x, weight, bias)
    assert bool(calls) == uses_gemv
    torch.testing.assert_close(got, reference(x, weight, bias), **TOLERANCES[torch.bfloat16])


def test_registered_linear_leaves_float32_and_transposed_weights_to_torch(device, monkeypatch):
    if device.type != "cuda":
        pytest.skip("the op is registered for cuda devices")
    from modelfleet.dataplane.kernels import gemv as gemv_module
    from modelfleet.dataplane.kernels import registry

    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **kw: pytest.fail("gemv must not be used"))
    x = torch.randn(1, 256, device=device)
    weight = torch.randn(128, 256, device=device)
    torch.testing.assert_close(registry.linear(x, weight, None), F.linear(x, weight))
    xb, wt = x.bfloat16(), torch.randn(256, 128, device=device).bfloat16().t()  # non-contiguous view
    torch.testing.assert_close(registry.linear(xb, wt, None), F.linear(xb, wt))
