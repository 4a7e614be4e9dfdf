"""A quantized lm_head split by vocabulary over tensor-parallel ranks (CPU, gloo): each rank reads its rows
of the int8 head and of its scales (the last one padded), and the split engine gives TP=1's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from modelfleet.converters.checkpoint import LM_HEAD, read_checkpoint, write_torch
from modelfleet.dataplane.models import load_model
from modelfleet.dataplane.parallel.group import TensorParallelGroup
from modelfleet.dataplane.quantization import QuantizedLinear
from safetensors.torch import load_file

from .test_tensor_parallel import make_tp_checkpoint, run


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    """int8 artifacts with a quantized head: an untied model of 509 words (shards padded) and a tied one."""
    root = tmp_path_factory.mktemp("tp-lm-head")
    out = {}
    for arch in ("llama-biases", "qwen2-qkv-bias-tied"):
        source = make_tp_checkpoint(root / arch, arch)
        out[arch] = root / f"{arch}-int8"
        out[arch].mkdir()
        ckpt = read_checkpoint(source)
        write_torch(ckpt, out[arch], dtype="fp32", quant="int8", serving_dtype="fp32", quantize_lm_head=True)
    return out


class LastOf4(TensorParallelGroup):
    def __init__(self) -> None:  # no collectives: the model is only built and loaded here
        self.rank, self.size, self.device = 3, 4, torch.device("cpu")


def test_the_last_rank_holds_its_padded_rows_of_the_head(artifacts):
    full = load_file(artifacts["llama-biases"] / "model.safetensors")
    head = load_model(artifacts["llama-biases"], device="cpu", dtype=torch.float32, tp=LastOf4()).lm_head
    assert isinstance(head, QuantizedLinear)
    # 509 = 4 x 128 - 3: rows 384..508, then 3 rows of padding that give logits of 0 (cut off later)
    assert head.weight.shape == (128, 64) and head.weight_scale.shape == (128,)
    assert torch.equal(head.weight[:125], full[LM_HEAD][384:]) and not head.weight[125:].any()
    assert torch.equal(head.weight_scale[:125], full[LM_HEAD + "_scale"][384:])
    assert not head.weight_scale[125:].any()


@pytest.mark.parametrize("arch", ["llama-biases", "qwen2-qkv-bias-tied"])
def test_the_split_quantized_head_gives_the_single_rank_tokens(artifacts, arch):
    single = load_model(artifacts[arch], device="cpu", dtype=torch.float32)
    assert isinstance(single.lm_head, QuantizedLinear)
    assert run(artifacts[arch], 2)[0] == run(artifacts[arch], 1)[0]
