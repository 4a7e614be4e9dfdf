"""The models on a CUDA/ROCm GPU, with each attention backend the device offers, against transformers."""

from __future__ import annotations

import pytest
import torch
from model_checkpoints import make_checkpoint
from modelfleet.dataplane.attention import AttentionMetadata
from modelfleet.dataplane.device import attention_backend_name
from modelfleet.dataplane.models import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]

# float32 on the GPU: matmuls may differ in summation order from transformers' own kernels, and
# Triton's fp32 dot products may round their inputs to tf32.
TOLERANCE = {
    ("torch", torch.float32): dict(atol=2e-3, rtol=0),
    ("triton", torch.float32): dict(atol=2e-2, rtol=0),
    ("torch", torch.bfloat16): dict(atol=0.15, rtol=0.05),
    ("triton", torch.bfloat16): dict(atol=0.15, rtol=0.05),
}


def backends() -> list[str]:
    names = ["torch"]
    if torch.cuda.is_available() and attention_backend_name("cuda") == "triton":
        names.append("triton")
    return names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("arch", ["llama3", "mistral_window", "qwen2", "qwen3"])
def test_prefill_and_decode_match_hf_on_gpu(tmp_path, arch, backend, dtype):
    device = torch.device("cuda")
    model_dir, hf_model = make_checkpoint(arch, tmp_path)
    hf_model = hf_model.to(device=device, dtype=dtype)
    ours = load_model(model_dir, device=device, dtype=dtype, attention_backend=backend)
    cfg = ours.config
    tokens = torch.randint(0, cfg.vocab_size, (21,), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        expected = hf_model(tokens[None]).logits[0].float()
    block_size, table = 16, [3, 0]
    kv = list(torch.zeros(cfg.num_layers, 2, 4, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype,
                          device=device).unbind(0))  # fmt: skip
    got = []
    for start, length in [(0, 13), *((p, 1) for p in range(13, 21))]:  # a prompt chunk, then decodes
        meta = AttentionMetadata.build(
            query_lens=[length], seq_lens=[start + length], block_tables=[table], block_size=block_size,
            device=device,
        )  # fmt: skip
        positions = torch.arange(start, start + length, device=device)
        with torch.inference_mode():
            got.append(ours.compute_logits(ours(tokens[start : start + length], positions, kv, meta)))
    logits = torch.cat(got)
    torch.testing.assert_close(logits, expected, **TOLERANCE[backend, dtype])
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
